"""The Responses and Messages routes through the whole proxy, against a scripted upstream.

Each stream is an event script with known times (opening events at once, reasoning
deltas from T, answer deltas from T + k x ITL, final usage), written as the real APIs
write them (``event: NAME`` + ``data: {"type": NAME, ...}``). The scripted upstream
serves it over a loopback socket in lockstep with the proxy's clock reads, so TTFT,
time to first answer token, time to first byte, every ITL gap and the normalised
tokens are compared exactly with what the script implies, and the client's bytes with
the upstream's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from typing import Any

import pytest

from tests import upstream_fakes as fakes
from tests.upstream_fakes import (
    FakeUpstream,
    ScriptedClock,
    call_raw,
    histogram,
    json_upstream,
    labels,
    make_app,
    sse,
)

pytestmark = pytest.mark.anyio

T0 = 64.0
HEADERS_AT = T0 + 0.125
ITL = 0.015625  # exact in binary: sums and differences compare exactly
REASONING_AT = T0 + 0.5
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"


def event(name: str, payload: dict[str, Any], *, named: bool = True) -> bytes:
    """One event as the Responses and Messages APIs write it: the data's ``type`` is the
    event's name, and the ``event:`` line carries it too unless ``named`` is False."""
    return sse({"type": name, **payload}, compact=True, event=name if named else None)


def responses_script(reasoning: int, answer: int, *, end: str = "response.completed",
                     named: bool = True) -> tuple[list[tuple[float, bytes]], list[float], list[float]]:
    """(script, reasoning delta times, answer delta times) of a Responses stream."""
    seq = iter(range(1000))
    resp = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "m"}
    script = [(HEADERS_AT, event("response.created", {"response": resp, "sequence_number": next(seq)}, named=named)),
              (HEADERS_AT, event("response.in_progress", {"response": resp, "sequence_number": next(seq)}, named=named))]
    r_times = [REASONING_AT + i * ITL for i in range(reasoning)]
    a_start = REASONING_AT + reasoning * ITL + (0.25 if reasoning else 0.0)
    a_times = [a_start + i * ITL for i in range(answer)]
    if reasoning:
        script.append((REASONING_AT - ITL, event("response.output_item.added", {
            "output_index": 0, "item": {"id": "rs_1", "type": "reasoning"}, "sequence_number": next(seq)}, named=named)))
        for t in r_times:
            script.append((t, event("response.reasoning_text.delta", {
                "item_id": "rs_1", "output_index": 0, "content_index": 0, "delta": "think",
                "sequence_number": next(seq)}, named=named)))
        script.append((r_times[-1] + 0.001, event("response.reasoning_text.done", {
            "item_id": "rs_1", "output_index": 0, "content_index": 0, "text": "think",
            "sequence_number": next(seq)}, named=named)))
    script.append((a_start - 0.001, event("response.output_item.added", {
        "output_index": 1, "item": {"id": "msg_1", "type": "message"}, "sequence_number": next(seq)}, named=named)))
    for i, t in enumerate(a_times):
        script.append((t, event("response.output_text.delta", {
            "item_id": "msg_1", "output_index": 1, "content_index": 0, "delta": f"w{i} ",
            "sequence_number": next(seq)}, named=named)))
    done_at = (a_times or r_times or [REASONING_AT])[-1] + 0.001
    script.append((done_at, event("response.output_text.done", {
        "item_id": "msg_1", "output_index": 1, "content_index": 0, "text": "...",
        "sequence_number": next(seq)}, named=named)))
    usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32},
             "output_tokens": reasoning + answer,
             "output_tokens_details": {"reasoning_tokens": reasoning},
             "total_tokens": 40 + reasoning + answer}
    final = {**resp, "status": end.removeprefix("response."), "usage": usage}
    script.append((done_at + 0.001, event(end, {"response": final, "sequence_number": next(seq)}, named=named)))
    return script, r_times, a_times


def messages_script(thinking: int, answer: int, *, error: bool = False
                    ) -> tuple[list[tuple[float, bytes]], list[float], list[float]]:
    """(script, thinking delta times, text delta times) of a Messages stream."""
    start_usage = {"input_tokens": 10, "cache_read_input_tokens": 30,
                   "cache_creation_input_tokens": 5, "output_tokens": 1}
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
               "content": [], "stop_reason": None, "usage": start_usage}
    script = [(HEADERS_AT, event("message_start", {"message": message})),
              (HEADERS_AT, event("ping", {}))]
    r_times = [REASONING_AT + i * ITL for i in range(thinking)]
    a_start = REASONING_AT + thinking * ITL + (0.25 if thinking else 0.0)
    a_times = [a_start + i * ITL for i in range(answer)]
    index = 0
    if thinking:
        script.append((REASONING_AT - ITL, event("content_block_start", {
            "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}})))
        for t in r_times:
            script.append((t, event("content_block_delta", {
                "index": 0, "delta": {"type": "thinking_delta", "thinking": "hmm"}})))
        script.append((r_times[-1] + 0.001, event("content_block_delta", {
            "index": 0, "delta": {"type": "signature_delta", "signature": "c2ln"}})))
        script.append((r_times[-1] + 0.002, event("content_block_stop", {"index": 0})))
        index = 1
    script.append((a_start - 0.001, event("content_block_start", {
        "index": index, "content_block": {"type": "text", "text": ""}})))
    for i, t in enumerate(a_times):
        script.append((t, event("content_block_delta", {
            "index": index, "delta": {"type": "text_delta", "text": f"w{i} "}})))
    end = (a_times or r_times or [REASONING_AT])[-1]
    if error:
        script.append((end + 0.001, event("error", {
            "error": {"type": "overloaded_error", "message": "Overloaded"}})))
        return script, r_times, a_times
    script.append((end + 0.001, event("content_block_stop", {"index": index})))
    # output_tokens is cumulative: the last message_delta wins, never a sum
    half = (thinking + answer) // 2
    script.append((end + 0.002, event("message_delta", {
        "delta": {"stop_reason": None}, "usage": {"output_tokens": half}})))
    script.append((end + 0.003, event("message_delta", {
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": thinking + answer}})))
    script.append((end + 0.004, event("message_stop", {})))
    return script, r_times, a_times


def sse_upstream(clock: ScriptedClock, script: Sequence[tuple[float, bytes]], **kwargs: Any
                 ) -> FakeUpstream:
    return fakes.sse_upstream(clock, script, headers_at=HEADERS_AT, end=script[-1][0] + 0.001,
                              **kwargs)


def gaps(times: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def assert_timing(registry: Any, route: str, r_times: list[float], a_times: list[float]) -> None:
    lbl = labels(route=route)
    outputs = r_times + a_times
    ttft = histogram(registry, "llm_proxy_time_to_first_token_seconds", lbl)
    assert (ttft.count, ttft.sum) == (1, outputs[0] - T0)
    ttfa = histogram(registry, "llm_proxy_time_to_first_answer_token_seconds", lbl)
    assert (ttfa.count, ttfa.sum) == (1, a_times[0] - T0)
    ttfb = histogram(registry, "llm_proxy_time_to_first_byte_seconds", lbl)
    assert (ttfb.count, ttfb.sum) == (1, HEADERS_AT - T0)
    itl = histogram(registry, "llm_proxy_inter_token_latency_seconds", lbl)
    assert itl.count == len(outputs) - 1
    assert itl.sum == pytest.approx(sum(gaps(outputs)), abs=1e-12)


@pytest.mark.parametrize("named", [True, False], ids=["event-line", "type-only"])
@pytest.mark.parametrize("reasoning", [0, 3])
async def test_responses_stream_measured_exactly(reasoning: int, named: bool) -> None:
    clock = ScriptedClock(T0)
    script, r_times, a_times = responses_script(reasoning, 4, named=named)
    up = sse_upstream(clock, script)
    app, registry = make_app(up, clock)
    body = json.dumps({"model": "m", "stream": True, "input": "SECRET PROMPT"}).encode()
    try:
        result = await call_raw(app, "POST", RESPONSES, body=body)
        assert result.status == 200
        assert result.body == b"".join(c for _, c in script)  # every byte, unchanged
        assert up.seen[0].body == body  # usage is never injected for Responses
        assert_timing(registry, RESPONSES, r_times, a_times)
        lbl = labels(route=RESPONSES)
        assert histogram(registry, "llm_proxy_prompt_tokens", lbl).sum == 40
        assert histogram(registry, "llm_proxy_cached_prompt_tokens", lbl).sum == 32
        assert histogram(registry, "llm_proxy_completion_tokens", lbl).sum == reasoning + 4
        assert histogram(registry, "llm_proxy_reasoning_tokens", lbl).sum == reasoning
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(route=RESPONSES, outcome="completed")) == 1
    finally:
        await app.aclose()


@pytest.mark.parametrize("thinking", [0, 2])
async def test_messages_stream_measured_exactly(thinking: int) -> None:
    clock = ScriptedClock(T0)
    script, r_times, a_times = messages_script(thinking, 5)
    up = sse_upstream(clock, script)
    app, registry = make_app(up, clock)
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 64,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    try:
        result = await call_raw(app, "POST", MESSAGES, body=body,
                                headers=[(b"x-api-key", b"sk-ant-client"),
                                         (b"anthropic-version", b"2023-06-01")])
        assert result.status == 200
        assert result.body == b"".join(c for _, c in script)
        seen = up.seen[0]
        assert seen.body == body
        # the client's Anthropic headers pass through untouched
        assert seen.header("x-api-key") == "sk-ant-client"
        assert seen.header("anthropic-version") == "2023-06-01"
        assert_timing(registry, MESSAGES, r_times, a_times)
        lbl = labels(route=MESSAGES)
        # Anthropic's input_tokens excludes cache reads and writes: prompt = 10 + 30 + 5
        assert histogram(registry, "llm_proxy_prompt_tokens", lbl).sum == 45
        assert histogram(registry, "llm_proxy_cached_prompt_tokens", lbl).sum == 30
        assert histogram(registry, "llm_proxy_cache_write_prompt_tokens", lbl).sum == 5
        # the last cumulative message_delta, not a sum of them
        assert histogram(registry, "llm_proxy_completion_tokens", lbl).sum == thinking + 5
        assert histogram(registry, "llm_proxy_reasoning_tokens", lbl).count == 0
    finally:
        await app.aclose()


@pytest.mark.parametrize(("route", "make"), [
    (RESPONSES, lambda: responses_script(0, 3, end="response.failed")),
    (MESSAGES, lambda: messages_script(0, 3, error=True)),
])
async def test_error_event_inside_a_200_stream_is_upstream_error(route: str, make: Any) -> None:
    clock = ScriptedClock(T0)
    script, _, _ = make()
    app, registry = make_app(sse_upstream(clock, script), clock)
    try:
        result = await call_raw(app, "POST", route,
                                body=json.dumps({"model": "m", "stream": True}).encode())
        assert result.status == 200 and result.completed
        assert result.body == b"".join(c for _, c in script)
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(route=route, outcome="upstream_error")) == 1
        assert registry.get_sample_value(  # made at 0 with the label set, never counted
            "llm_proxy_stream_outcomes_total", labels(route=route, outcome="completed")) == 0
    finally:
        await app.aclose()


async def test_response_incomplete_is_completed_with_its_usage() -> None:
    clock = ScriptedClock(T0)
    script, _, _ = responses_script(0, 3, end="response.incomplete")
    app, registry = make_app(sse_upstream(clock, script), clock)
    try:
        await call_raw(app, "POST", RESPONSES, body=b'{"model": "m", "stream": true}')
        lbl = labels(route=RESPONSES)
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", {**lbl, "outcome": "completed"}) == 1
        assert histogram(registry, "llm_proxy_completion_tokens", lbl).sum == 3
    finally:
        await app.aclose()


@pytest.mark.parametrize(("route", "payload", "expected"), [
    (RESPONSES, {"id": "resp_1", "object": "response", "status": "completed", "output": [],
                 "usage": {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 16},
                           "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 4},
                           "total_tokens": 29}},
     {"prompt": 20, "cached_prompt": 16, "completion": 9, "reasoning": 4}),
    (MESSAGES, {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                "usage": {"input_tokens": 3, "cache_read_input_tokens": 8,
                          "cache_creation_input_tokens": 2, "output_tokens": 6}},
     {"prompt": 13, "cached_prompt": 8, "completion": 6, "cache_write_prompt": 2}),
])
async def test_non_stream_usage(route: str, payload: dict[str, Any],
                                expected: dict[str, int]) -> None:
    clock = ScriptedClock(T0)
    app, registry = make_app(json_upstream(200, json.dumps(payload).encode()), clock)
    try:
        result = await call_raw(app, "POST", route, body=b'{"model": "m"}')
        assert result.status == 200
        assert json.loads(result.body) == payload
        lbl = labels(route=route)
        for name, value in expected.items():
            assert histogram(registry, f"llm_proxy_{name}_tokens", lbl).sum == value, name
        assert histogram(registry, "llm_proxy_time_to_first_token_seconds", lbl).count == 0
    finally:
        await app.aclose()


# ---------------------------------------------------------------------------
# The fault rows for the two new dialects


@pytest.mark.parametrize("route", [RESPONSES, MESSAGES])
@pytest.mark.parametrize(("failure", "outcome"), [
    (ConnectionResetError("reset"), "upstream_interrupted"),
    (RuntimeError("dropped without the chunked terminator"), "upstream_interrupted"),
    (None, "upstream_timeout"),
])
async def test_stream_breaks_mid_way(route: str, failure: Exception | None, outcome: str) -> None:
    clock = ScriptedClock(T0)
    make = responses_script if route == RESPONSES else messages_script
    full, _, a_times = make(0, 6)
    script = [step for step in full if step[0] <= a_times[2]]  # up to the third answer delta
    closed = asyncio.Event()
    stall = asyncio.Event() if failure is None else None
    app, registry = make_app(
        sse_upstream(clock, script, fail=failure, closed=closed, hold=stall), clock,
        read_timeout=0.3)
    try:
        result = await call_raw(app, "POST", route, body=b'{"model": "m", "stream": true}')
        assert result.body == b"".join(c for _, c in script)  # every byte that arrived
        assert not result.completed  # broken as the upstream broke it
        await asyncio.wait_for(closed.wait(), 5)
        lbl = labels(route=route)
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", {**lbl, "outcome": outcome}) == 1
        ttft = histogram(registry, "llm_proxy_time_to_first_token_seconds", lbl)
        assert (ttft.count, ttft.sum) == (1, a_times[0] - T0)
        assert histogram(registry, "llm_proxy_inter_token_latency_seconds", lbl).count == 2
        # no final usage came: the output's count is not known (message_start's
        # output_tokens is a placeholder, not a count)
        assert histogram(registry, "llm_proxy_completion_tokens", lbl).count == 0
    finally:
        await app.aclose()


@pytest.mark.parametrize("route", [RESPONSES, MESSAGES])
async def test_client_disconnect_closes_the_upstream(route: str) -> None:
    clock = ScriptedClock(T0)
    make = responses_script if route == RESPONSES else messages_script
    full, _, a_times = make(0, 6)
    script = [step for step in full if step[0] <= a_times[1]]
    closed = asyncio.Event()
    app, registry = make_app(
        sse_upstream(clock, script, closed=closed, hold=asyncio.Event()), clock)
    try:
        result = await call_raw(app, "POST", route, body=b'{"model": "m", "stream": true}',
                                disconnect_after_body_messages=len(script))
        assert result.body == b"".join(c for _, c in script)
        await asyncio.wait_for(closed.wait(), 5)  # the upstream request was closed
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total",
            labels(route=route, outcome="client_disconnected")) == 1
    finally:
        await app.aclose()


def chat_done_script() -> tuple[list[tuple[float, bytes]], list[float], list[float]]:
    """A chat stream that ends with ``[DONE]``, as OpenAI writes it."""
    a_times = [REASONING_AT + i * ITL for i in range(3)]
    script = [(HEADERS_AT, sse(fakes.chunk_json({"role": "assistant"}), compact=True))]
    script += [(t, sse(fakes.chunk_json({"content": f"w{i}"}), compact=True))
               for i, t in enumerate(a_times)]
    end = a_times[-1] + 0.001
    script += [(end, sse(fakes.chunk_json({}, finish="stop"), compact=True)),
               (end + 0.001, sse(fakes.usage_json(4, 3), compact=True)),
               (end + 0.002, b"data: [DONE]\n\n")]
    return script, [], a_times


@pytest.mark.parametrize("route", ["/v1/chat/completions", RESPONSES, MESSAGES])
@pytest.mark.parametrize("cut", [0, 1])
async def test_a_client_that_leaves_after_the_last_event_completed_its_stream(
        route: str, cut: int) -> None:
    """The official openai SDK closes the connection as soon as it reads ``[DONE]``,
    before the upstream's final chunk: that stream was complete for the client (outcome
    completed, duration until the last event). Leaving one event earlier is a
    disconnect."""
    clock = ScriptedClock(T0)
    make = {RESPONSES: lambda: responses_script(0, 3), MESSAGES: lambda: messages_script(0, 3),
            "/v1/chat/completions": chat_done_script}[route]
    full, _, _ = make()
    script = full[:len(full) - cut]
    closed = asyncio.Event()
    app, registry = make_app(
        sse_upstream(clock, script, closed=closed, hold=asyncio.Event()), clock)
    try:
        result = await call_raw(app, "POST", route,
                                body=b'{"model": "m", "stream": true, "stream_options": '
                                     b'{"include_usage": true}}',
                                disconnect_after_body_messages=len(script))
        assert result.body == b"".join(c for _, c in script)
        await asyncio.wait_for(closed.wait(), 5)
        outcome = "completed" if cut == 0 else "client_disconnected"
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(route=route, outcome=outcome)) == 1
        duration = histogram(registry, "llm_proxy_request_duration_seconds",
                             {**labels(route=route), "stream": "true"})
        assert duration.count == 1
        if cut == 0:
            assert duration.sum == script[-1][0] - T0
        assert registry.get_sample_value("llm_proxy_requests_total", {
            **labels(route=route), "stream": "true", "code": "200"}) == 1  # the status sent
    finally:
        await app.aclose()
