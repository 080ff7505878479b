"""What the upstream says about its own work, and what the proxy says without it, through
the whole proxy: uvicorn with httptools on loopback, the production upstream client, the
simulator or the suite's scripted upstream behind it.

* llama.cpp's ``timings`` (the simulator's ``--llamacpp-timings``, shaped as llama.cpp's
  server sends them: on the last chunk of a stream, in a non-stream body): the engine's
  cached tokens and prefill time reach the request log and the metrics, and ``diagnose``
  takes the engine's prefill as the prefill part of the first token;
* no usage at all (an upstream that ignores ``stream_options.include_usage``, as
  llama-cpp-python's server does; here the proxy does not ask, which the upstream sees
  the same way): the doctor's repeated tokens and the prefill fit use the proxy's own
  estimate, and the request log, ``diagnose --json`` and the card say so;
* prefill that grows faster than linearly (the simulator's ``--prefill-attention``):
  no part of the card's first-token split exceeds the whole or goes below zero, and the
  card says which model was fitted (the quadratic);
* the provider's cache diagnostics (Anthropic's ``diagnostics``, OpenAI Responses'
  ``prompt_cache_diagnostics``): read, logged and counted against the doctor's reason.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.cli import main
from proxy.simulator.app import create_simulator_app
from proxy.simulator.model import SimConfig
from tests.fake_upstream import Conn, RawUpstream, ScriptedUpstream, sse
from tests.servers import serve_in_thread
from tests.test_keys import served

MODEL = "sim-llm"
CHAT = "/v1/chat/completions"


def prompt(tokens: int, i: int) -> str:
    """About ``tokens`` tokens (4 characters each, the simulator's count) that share no
    prefix with any other request's."""
    return (f"request {i} {secrets.token_hex(8)}: " + "lorem ipsum dolor sit amet " * tokens)[
        : tokens * 4
    ]


def chat(base: str, content: str, *, stream: bool = True, usage: bool = True) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "stream": stream,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": content}],
    }
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", base + CHAT, json=body) as r:
        assert r.status_code == 200
        for _ in r.iter_bytes():
            pass


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    text = httpx.get(base + "/metrics", timeout=10).text
    total = 0.0
    for found in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(found.group(2))
    return total


def wait_logged(log: Path, n: int) -> list[dict[str, Any]]:
    """The request log once it holds ``n`` lines (the proxy writes just after the client
    saw the end)."""
    deadline = time.monotonic() + 20
    while True:
        lines = log.read_text().splitlines() if log.exists() else []
        if len(lines) >= n:
            return [json.loads(line) for line in lines]
        assert time.monotonic() < deadline, f"the request log never held {n} lines"
        time.sleep(0.01)  # polling the log file, not timing anything


@contextlib.contextmanager
def behind_simulator(config: SimConfig, log: Path, **settings: Any) -> Iterator[str]:
    with (
        serve_in_thread(create_simulator_app(config)) as sim,
        served(
            sim.url, upstream_name="sim", log_requests=str(log), prefix_doctor=True, **settings
        ) as (proxy, _),
    ):
        yield proxy.url


def diagnose_json(base: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["diagnose", "--url", base, "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    (selection,) = doc["selections"]
    return selection


def diagnose_card(base: str, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["diagnose", "--url", base]) == 0
    return " ".join(capsys.readouterr().out.split())  # one line: the card wraps at 88


# ---------------------------------------------------------------------------
# llama.cpp's timings


LLAMA = SimConfig(
    slots=4,
    prefill_rate=100_000.0,
    prefill_overhead=0.002,
    itl=0.001,
    itl_growth=0.0,
    jitter=0.0,
    output_tokens=4,
    output_dist="fixed",
    llamacpp_timings=True,
    seed=1,
)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "stream,usage",
    [(True, True), (True, False), (False, True)],
    ids=["usage-chunk", "finish-chunk", "body"],
)
def test_llamacpp_timings_give_the_engines_cached_tokens_and_prefill(
    tmp_path: Path, stream: bool, usage: bool
) -> None:
    """The same 2,000-token prompt twice: the second reuses what the first computed
    (llama.cpp's cache_n). The timings ride on the usage chunk, on the finish chunk (no
    usage asked for: the proxy does not add the request with --no-inject-usage), or in
    the body; each way the record has the engine's own figures, and without usage the
    prompt tokens are the engine's count (prompt_n + cache_n), not an estimate."""
    log = tmp_path / "requests.jsonl"
    text = prompt(2000, 0)
    with behind_simulator(LLAMA, log, inject_usage=usage) as base:
        chat(base, text, stream=stream, usage=usage)
        wait_logged(log, 1)
        chat(base, text, stream=stream, usage=usage)
        first, second = wait_logged(log, 2)
        prefill_count = metric(base, "llm_proxy_upstream_prefill_seconds_count")
    tokens = first["prompt_tokens"]  # the prompt as the simulator renders it
    assert tokens >= 2000 and not first["tokens_estimated"]
    assert first["engine_cached_tokens"] == 0
    cached = second["engine_cached_tokens"]
    assert 0 < cached <= tokens and second["cached_prompt_tokens"] == cached
    assert first["engine_prefill_s"] == pytest.approx(tokens / 100_000.0, rel=1e-3)
    assert second["engine_prefill_s"] == pytest.approx((tokens - cached) / 100_000.0, rel=1e-3)
    assert second["prompt_tokens"] == tokens and not second["tokens_estimated"]
    assert prefill_count == 2


@pytest.mark.e2e
def test_diagnose_takes_the_engines_prefill_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "requests.jsonl"
    with behind_simulator(LLAMA, log) as base:
        for i in range(24):
            chat(base, prompt(200 + 150 * i, i))
        wait_logged(log, 24)
        s = diagnose_json(base, capsys)
        card = diagnose_card(base, capsys)
    split = s["first_token"]
    assert split["prefill_from"] == "engine"
    mean_prefill_ms = sum((200 + 150 * i) / 100.0 for i in range(24)) / 24  # 100 tokens/ms
    assert split["prefill_ms"] == pytest.approx(mean_prefill_ms, rel=0.02)
    assert 0 <= split["rest_ms"] <= split["mean_ms"]
    assert "prefill as the upstream engine timed it" in card
    prefill = next(lv for lv in s["levers"] if lv["name"] == "prefill")
    assert prefill["numbers"]["engine_requests"] == 24


# ---------------------------------------------------------------------------
# No usage at all


PLAIN = SimConfig(
    slots=4,
    prefill_rate=20_000.0,
    prefill_overhead=0.002,
    itl=0.001,
    itl_growth=0.0,
    jitter=0.0,
    output_tokens=4,
    output_dist="fixed",
    seed=1,
)


@pytest.mark.e2e
def test_without_usage_the_proxys_estimate_is_used_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An upstream that sends no usage (llama-cpp-python's server ignores the request for
    it): the doctor still names how much repeated, in the proxy's estimated tokens; the
    prefill fit has every stream, and diagnose says the tokens are estimated. Before,
    the repeated tokens were null and the fit skipped every request, so diagnose had
    nothing to say about the prefill."""
    log = tmp_path / "requests.jsonl"
    shared = "You are a careful assistant. " * 120  # about 3.5 KB, repeated by every turn
    with behind_simulator(PLAIN, log, inject_usage=False) as base:
        for i in range(24):
            chat(base, shared + prompt(200 + 150 * i, i), usage=False)
            wait_logged(log, i + 1)  # one after the other: each sees the one before
        lines = wait_logged(log, 24)
        estimated = metric(base, "llm_proxy_prefill_fit_estimated_requests_total")
        fitted = metric(base, "llm_proxy_prefill_fit_requests_total")
        skipped = metric(base, "llm_proxy_prefill_fit_skipped_total")
        s = diagnose_json(base, capsys)
        card = diagnose_card(base, capsys)
        page = httpx.get(base + "/ui/data", timeout=10).json()
    later = lines[1:]
    assert all(line["tokens_estimated"] for line in lines)
    assert all(line["repeated_prefix_tokens"] for line in later), "the shared head repeated"
    assert all(line["cache_missed_tokens"] is None for line in lines)  # no cached figure: unknown
    assert (estimated, fitted, skipped) == (24, 24, 0)
    assert s["tokens_estimated_share"] == 1
    assert s["prefill_ms_per_1k_tokens"] is not None
    assert "the proxy's own estimate" in s["fit_note"]
    assert "the proxy's own estimate" in card
    (selection,) = page["fix"]["selections"]  # the live page's What to fix
    live = selection["fit"]["total"]
    assert (live["requests"], live["estimated_requests"], live["skipped"]) == (24, 24, 0)
    assert "the proxy's own estimate" in live["note"]


@pytest.mark.e2e
def test_a_missing_fit_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "requests.jsonl"
    with behind_simulator(PLAIN, log) as base:
        for i in range(3):
            chat(base, prompt(300, i))
        wait_logged(log, 3)
        s = diagnose_json(base, capsys)
    assert s["prefill_ms_per_1k_tokens"] is None
    assert s["fit_note"] == "Prefill cost not known yet: 3 streamed requests fitted, 20 needed."


# ---------------------------------------------------------------------------
# Prefill faster than linear


ATTENTION = SimConfig(
    slots=4,
    prefill_rate=200_000.0,
    prefill_overhead=0.003,
    itl=0.001,
    itl_growth=0.0,
    jitter=0.0,
    output_tokens=2,
    output_dist="fixed",
    prefill_attention=0.02,
    seed=1,
)


@pytest.mark.e2e
def test_superlinear_prefill_keeps_every_part_within_the_first_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prompts of 400 to 4,000 tokens on an engine where attention shows: the straight
    line through the first tokens crosses zero above zero tokens (its fixed part is
    below zero). Before, the card printed that negative fixed part and a rest below
    zero; now the fit is the quadratic the simulator's prefill is (no term below zero),
    the card says so, and the parts stay within the mean first token."""
    log = tmp_path / "requests.jsonl"
    with behind_simulator(ATTENTION, log) as base:
        for i in range(24):
            chat(base, prompt(400 + 156 * i, i))
            wait_logged(log, i + 1)  # one at a time: no prefill waits behind another
        s = diagnose_json(base, capsys)
        card = diagnose_card(base, capsys)
    split = s["first_token"]
    assert s["fit_model"] == "quadratic", s["fit_note"]
    assert s["line_fixed_ms"] < 0 and s["fixed_ms"] >= 0
    assert min(s["fit_terms"].values()) >= 0 and s["fit_terms"]["ms_per_1k_tokens_squared"] > 0
    for part in ("prefill_ms", "rest_ms"):
        assert 0 <= split[part] <= split["mean_ms"], (part, split)
    assert "quadratic fit" in card and "faster than linearly" in card
    split_line = card[card.index("first token") : card.index("prefill ", card.index("rest"))]
    assert not re.search(r"-\d", split_line), split_line  # no part below zero


# ---------------------------------------------------------------------------
# The provider's own cache diagnostics


SYSTEM = "You answer questions about the manual. " * 80  # about 3 KB


def _messages_stream(diagnostics: dict[str, Any] | None) -> list[bytes]:
    message: dict[str, Any] = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [],
        "usage": {"input_tokens": 900, "output_tokens": 1, "cache_read_input_tokens": 0},
    }
    if diagnostics is not None:
        message["diagnostics"] = diagnostics
    named = [
        ("message_start", {"message": message}),
        ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "ok"}}),
        ("content_block_stop", {"index": 0}),
        ("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}}),
        ("message_stop", {}),
    ]
    return [sse({"type": n, **p}, compact=True, event=n) for n, p in named]


def _responses_stream(diagnostics: dict[str, Any] | None) -> list[bytes]:
    resp = {"id": "resp_2", "object": "response", "status": "in_progress", "model": "m"}
    done = {
        **resp,
        "status": "completed",
        "prompt_cache_diagnostics": diagnostics,
        "usage": {
            "input_tokens": 900,
            "output_tokens": 2,
            "input_tokens_details": {"cached_tokens": 0},
        },
    }
    named = [
        ("response.created", {"response": resp}),
        (
            "response.output_text.delta",
            {"item_id": "m1", "output_index": 0, "content_index": 0, "delta": "ok"},
        ),
        ("response.completed", {"response": done}),
    ]
    return [sse({"type": n, **p}, compact=True, event=n) for n, p in named]


@pytest.mark.e2e
def test_the_providers_reason_is_read_and_counted_against_the_doctors(tmp_path: Path) -> None:
    """Anthropic's diagnostics on message_start name system_changed, as the doctor does
    for a changed system prompt: agree. OpenAI's text_format_changed is a request
    setting, which the doctor names settings_changed: agree. Each reason and its missed
    tokens are in the request log; the proxy added nothing to the requests."""
    answers = [
        _messages_stream(None),
        _messages_stream(
            {"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 812}}
        ),
        _responses_stream(None),
        _responses_stream(
            {
                "type": "cache_miss",
                "reason": "text_format_changed",
                "cache_missed_tokens": 640,
                "comparison_reusable_tokens": 900,
            }
        ),
    ]

    async def handler(request: httpx.Request) -> httpx.Response:
        events = answers.pop(0)

        async def body() -> AsyncIterator[bytes]:
            for event in events:
                yield event

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    log = tmp_path / "requests.jsonl"
    upstream = ScriptedUpstream(handler)
    with (
        upstream.running(),
        served(upstream.url, upstream_name="up", log_requests=str(log), prefix_doctor=True) as (
            proxy,
            _,
        ),
    ):
        base = proxy.url
        with httpx.Client(timeout=30) as c:
            for system in (SYSTEM, SYSTEM.replace("manual", "guide")):
                r = c.post(
                    base + "/v1/messages",
                    json={
                        "model": "claude-x",
                        "max_tokens": 8,
                        "stream": True,
                        "system": system,
                        "messages": [{"role": "user", "content": "What is on page 2?"}],
                    },
                )
                assert r.status_code == 200
                wait_logged(log, 1 if system == SYSTEM else 2)
            for kind in ("text", "json_object"):
                r = c.post(
                    base + "/v1/responses",
                    json={"model": "gpt-x", "stream": True, "instructions": SYSTEM,
                          "input": "Hi", "text": {"format": {"type": kind}}},
                )
                assert r.status_code == 200
                wait_logged(log, 3 if kind == "text" else 4)
        lines = wait_logged(log, 4)
        agree = metric(
            base,
            "llm_proxy_prompt_cache_provider_reasons_total",
            provider_reason="system_changed",
            doctor_reason="system_changed",
            agreement="agree",
        )
        setting = metric(
            base,
            "llm_proxy_prompt_cache_provider_reasons_total",
            provider_reason="text_format_changed",
            doctor_reason="settings_changed",
            agreement="agree",
        )
    first, second, _, fourth = lines
    assert first["provider_cache_reason"] is None
    assert (second["provider_cache_reason"], second["provider_missed_tokens"]) == (
        "system_changed",
        812,
    )
    assert second["prefix_break"] == "system_changed"
    assert (fourth["provider_cache_reason"], fourth["provider_missed_tokens"]) == (
        "text_format_changed",
        640,
    )
    assert (fourth["prefix_break"], fourth["prefix_break_role"]) == ("settings_changed",
                                                                    "text.format")
    assert (agree, setting) == (1, 1)
    for seen in upstream.requests:  # nothing added to ask for diagnostics
        body = seen.json
        assert "diagnostics" not in body and "prompt_cache_options" not in body


# ---------------------------------------------------------------------------
# Per-provider rules: GPT-5.6 on without 128-token steps, Gemini's minimums


def test_provider_rules_by_model_name() -> None:
    from proxy.doctor.report import cache_granularity_tokens, minimum_cacheable_tokens

    assert cache_granularity_tokens("chat", "gpt-4o") == 128
    assert cache_granularity_tokens("responses", "gpt-5.5") == 128
    for model in ("gpt-5.6", "gpt-5.6-sol", "GPT-5.7-mini", "gpt-6", "openai/gpt-5.6"):
        assert cache_granularity_tokens("chat", model) == 1, model
    assert cache_granularity_tokens("messages", "claude-opus-4-5") == 1
    assert minimum_cacheable_tokens("chat", "gemini-2.5-flash") == 2048
    assert minimum_cacheable_tokens("chat", "models/gemini-3.1-pro-preview") == 4096
    assert minimum_cacheable_tokens("chat", "gpt-5.6") == 1024


@pytest.mark.anyio
@pytest.mark.parametrize(("model", "step"), [("gpt-4o", 128), ("gpt-5.6", 1)])
async def test_gpt_5_6_cached_tokens_are_not_rounded_to_128(
        tmp_path: Path, model: str, step: int) -> None:
    """The same conversation grown by a turn: its first turn repeats, and the upstream
    reports nothing cached. On gpt-4o the cacheable part is rounded down to 128 tokens;
    on the GPT-5.6 family, which caches without 128-token steps, it is not (before, it
    was rounded there too, under-counting the missed tokens by up to 127)."""
    from tests.test_prefix_proxy import CHAT as ROUTE
    from tests.test_prefix_proxy import SYSTEM as HEAD
    from tests.test_prefix_proxy import T0, Answers, ScriptedClock, doctor_app, lines, post

    turn1 = {"model": model, "messages": [{"role": "system", "content": HEAD},
                                          {"role": "user", "content": "q1"}]}
    turn2 = {"model": model, "messages": [*turn1["messages"],
                                          {"role": "assistant", "content": "a1"},
                                          {"role": "user", "content": "q2"}]}
    clock, answers = ScriptedClock(T0), Answers()
    app, _, log_file = doctor_app(answers, clock, tmp_path)
    answers.queue(2300, 0)
    answers.queue(2310, 0)
    async with app:
        await post(app, clock, ROUTE, turn1)
        await post(app, clock, ROUTE, turn2, at=T0 + 1)
    line = lines(log_file)[1]
    repeated = line["repeated_prefix_tokens"]
    assert 2200 < repeated < 2310
    cacheable = min(repeated, 2309)  # the prompt's last token is always computed
    assert cacheable % 128, "a multiple of 128 would not tell the two rules apart"
    assert line["cache_missed_tokens"] == cacheable // step * step


@pytest.mark.e2e
def test_a_non_stream_answer_without_usage_gets_the_estimate_too(tmp_path: Path) -> None:
    """A non-stream answer with no usage in its body: its prompt tokens are the proxy's
    estimate, said as such, as a stream's are, so the doctor's repeated tokens are
    known for the second request. Before, only streams got the estimate: the same
    prompt read null tokens when the app did not stream."""
    answer = json.dumps({"id": "c1", "object": "chat.completion", "model": MODEL, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"},
         "finish_reason": "stop"}]}).encode()

    async def no_usage(conn: Conn) -> None:
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(answer) + answer)

    log = tmp_path / "requests.jsonl"
    shared = "You are a careful assistant. " * 120  # about 3.5 KB, repeated
    upstream = RawUpstream({MODEL: no_usage})
    with upstream.running(), served(upstream.url, log_requests=str(log),
                                    prefix_doctor=True) as (proxy, _):
        chat(proxy.url, shared + "First question?", stream=False)
        wait_logged(log, 1)
        chat(proxy.url, shared + "Second question?", stream=False)
        first, second = wait_logged(log, 2)
    for line in (first, second):
        assert line["prompt_tokens"] and line["tokens_estimated"]
        assert line["completion_tokens"] is None  # no count to make of a body's text
    assert second["repeated_prefix_tokens"], "the shared head repeated, in estimated tokens"
    assert second["cache_missed_tokens"] is None  # no cached figure: unknown
