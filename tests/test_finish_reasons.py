"""``llm_proxy_finish_reasons_total``: why answers ended, in one fixed set of label values
across the four APIs (the proxy in process, the scripted upstream behind it)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.metrics import FINISH_CLASSES, finish_class
from tests.test_proxy_inprocess import T0, BodyClock, client_for, sse_upstream, stream_request
from tests.upstream_fakes import (
    CHAT,
    FakeUpstream,
    ScriptedClock,
    chunk_json,
    labels,
    lazy,
    make_app,
    sse,
    usage_json,
)

NAME = "llm_proxy_finish_reasons_total"


@pytest.mark.parametrize(("reasons", "label"), [
    (("stop",), "stop"), (("end_turn",), "stop"), (("completed",), "stop"),
    (("length",), "length"), (("max_tokens",), "length"), (("max_output_tokens",), "length"),
    (("tool_calls",), "tool_calls"), (("tool_use",), "tool_calls"),
    (("content_filter",), "content_filter"), (("refusal",), "content_filter"),
    (("abort",), "other"), (("failed",), "other"), ((), "other"),
    (("stop", "length", "stop"), "length"),  # any choice cut short
    (("tool_calls", "stop"), "tool_calls"),  # else the first choice's
])
def test_finish_class(reasons: tuple[str, ...], label: str) -> None:
    assert finish_class(reasons) == label


def test_label_values_are_a_fixed_set() -> None:
    assert set(FINISH_CLASSES) | {"other"} == {
        "length", "stop", "tool_calls", "content_filter", "other"}


def count(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value(NAME, labels(finish_reason=reason)) or 0.0


def chat_stream(finish: str) -> list[tuple[float, bytes]]:
    return [(T0 + 0.25, sse(chunk_json({"role": "assistant", "content": ""}))),
            (T0 + 0.5, sse(chunk_json({"content": "Hel"}))),
            (T0 + 0.625, sse(chunk_json({"content": "lo"}))),
            (T0 + 0.75, sse(chunk_json({}, finish=finish))),
            (T0 + 0.875, sse(usage_json(10, 2))),
            (T0 + 1.0, b"data: [DONE]\n\n")]


@pytest.mark.anyio
async def test_streamed_and_whole_answers_count_once_each(tmp_path: Path) -> None:
    """With response info read (here for the request log), a chat stream that stopped
    on its length limit and a whole answer that stopped normally count once each."""
    clock = ScriptedClock()
    log = str(tmp_path / "requests.jsonl")
    app, registry = make_app(sse_upstream(clock, chat_stream("length")), clock,
                             log_requests=log)
    async with app, client_for(BodyClock(app, clock)) as client:
        await client.post(CHAT, json=stream_request())
    assert count(registry, "length") == 1
    assert count(registry, "stop") == 0

    body = {"id": "x", "choices": [{"index": 0, "message": {"content": "hi"},
                                    "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3}}

    async def respond(request: httpx.Request) -> httpx.Response:
        clock.now = T0 + 0.75
        return httpx.Response(200, headers={"content-type": "application/json"},
                              content=lazy(json.dumps(body).encode()))

    app, registry = make_app(FakeUpstream(respond), clock, log_requests=log)
    async with app, client_for(BodyClock(app, clock)) as client:
        await client.post(CHAT, json={"model": "m", "messages": []})
    assert count(registry, "stop") == 1
    assert count(registry, "length") == 0


@pytest.mark.anyio
async def test_counted_without_a_trace_or_request_log() -> None:
    """Finish reasons are read for the metrics alone: a chat stream in OpenAI's layout
    (the reason in a chunk without output) is counted with nothing else reading it."""
    clock = ScriptedClock()
    app, registry = make_app(sse_upstream(clock, chat_stream("length")), clock)
    async with app, client_for(BodyClock(app, clock)) as client:
        await client.post(CHAT, json=stream_request())
    assert count(registry, "length") == 1
