"""The prompt-cache doctor through the whole proxy (proxy/doctor/).

The proxy runs in process in front of the suite's scripted upstream (tests/fake_upstream.py:
a real loopback server, so the production upstream client runs); the upstream's usage sets
the prompt and cached tokens of every answer exactly, so the repeated, reported and missed
tokens are known from the script: repeated = round(repeated bytes x prompt tokens / prompt
bytes), missed = that (less the prompt's last token, down to the caching step) - cached.
Time is the scripted clock: a request's time is when the proxy received it.

Also here: every break reason from a request pair built for it, the minimum-length rule,
an absent cached field, answers that are not 2xx, the switch, the worker thread for large
prompts (a concurrent stream flows while it works), a doctor that fails, the settings,
a scan of everything the proxy exports for prompt text, memory under distinct large
prompts, and one end-to-end run with the official openai SDK in front of the simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import math
import random
import threading
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import ProxyApp, create_app
from proxy.config import Settings, add_arguments, from_sources, upstream_limits
from proxy.config_values import SettingsError
from proxy.diagnosis.fit import PrefillFit
from proxy.dialects import DIALECTS
from proxy.doctor import job as doctor_job
from proxy.doctor.index import BYTES_PER_ENTRY
from proxy.doctor.job import INLINE_MAX_BLOCKS, MAX_PENDING, Place, PrefixCheck, PrefixJob
from proxy.simulator.model import LatencyModel, SimConfig
from proxy.upstream_spec import UpstreamSpec, upstream_specs
from tests.fake_upstream import ScriptedClock, ScriptedUpstream, Seen, sse
from tests.upstream_fakes import InProcess

pytestmark = pytest.mark.anyio

T0 = 64.0
UP = "up"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
SSE = {"content-type": "text/event-stream"}
REPEATED = "llm_proxy_prompt_repeated_tokens_total"
MISSED = "llm_proxy_prompt_cache_missed_tokens_total"
BREAKS = "llm_proxy_prompt_prefix_breaks_total"
RATIO = "llm_proxy_prompt_repeated_prefix_ratio"
MISSED_HIST = "llm_proxy_prompt_cache_missed_tokens_per_request"
LARGE = 48 * 1024  # prompt bytes the doctor examines in its thread


def text(n: int, seed: str) -> str:
    """``n`` bytes of words unique to ``seed`` (no two seeds share 8 characters by chance)."""
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < n:
        word = "".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(rng.randint(3, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:n]


# ---------------------------------------------------------------------------
# The scripted upstream: each answer carries the usage the test queued for it


class Answers:
    """Answers each measured request in its API's shape, with the next queued usage
    (prompt tokens, cached tokens or None for a usage without the cached field), as JSON
    or as a stream, whichever the request asked for. ``status`` answers an error instead."""

    def __init__(self) -> None:
        self.usages: list[tuple[int, int | None]] = []
        self.status = 200
        self.seen: list[Seen] = []
        # a stream waits on it after its first output event (its prefill is done)
        self.hold: asyncio.Event | None = None

    def queue(self, prompt: int, cached: int | None) -> None:
        self.usages.append((prompt, cached))

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request.extensions["seen"])
        if self.status != 200:
            body = json.dumps({"error": {"message": "slow down", "type": "rate_limit_error"}})
            return httpx.Response(self.status, headers={"content-type": "application/json"},
                                  content=body.encode())
        prompt, cached = self.usages.pop(0) if self.usages else (100, 0)
        payload = json.loads(request.content)
        route = request.url.path
        events = _answer(route, prompt, cached)
        if payload.get("stream") is True:
            return httpx.Response(200, headers=SSE, content=self._stream(events))
        return httpx.Response(200, json=_body(route, prompt, cached))

    async def _stream(self, events: list[bytes]) -> AsyncIterator[bytes]:
        first = 3 if events[0].startswith(b"event: message_start") else 2
        yield b"".join(events[:first])  # up to the first output event
        if self.hold is not None:
            await self.hold.wait()
        yield b"".join(events[first:])


def _usage(route: str, prompt: int, cached: int | None) -> dict[str, Any]:
    if route == MESSAGES:  # Anthropic's input_tokens excludes the cache reads and writes
        read = cached or 0
        usage: dict[str, Any] = {"input_tokens": prompt - read - 7,
                                 "cache_creation_input_tokens": 7, "output_tokens": 2}
        if cached is not None:
            usage["cache_read_input_tokens"] = cached
        return usage
    if route == RESPONSES:
        usage = {"input_tokens": prompt, "output_tokens": 2, "total_tokens": prompt + 2}
        if cached is not None:
            usage["input_tokens_details"] = {"cached_tokens": cached}
        return usage
    usage = {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _body(route: str, prompt: int, cached: int | None) -> dict[str, Any]:
    usage = _usage(route, prompt, cached)
    if route == MESSAGES:
        return {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                "usage": usage}
    if route == RESPONSES:
        return {"id": "resp_1", "object": "response", "status": "completed", "model": "m",
                "output": [], "usage": usage}
    if route == COMPLETIONS:
        return {"id": "c1", "object": "text_completion", "model": "m",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}], "usage": usage}
    return {"id": "c1", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"},
         "finish_reason": "stop"}], "usage": usage}


def _answer(route: str, prompt: int, cached: int | None) -> list[bytes]:
    """The stream of an answer "ok", its usage where each API puts it."""
    usage = _usage(route, prompt, cached)
    if route == MESSAGES:
        start = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                 "content": [], "usage": usage}
        named = [("message_start", {"message": start}),
                 ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
                 ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "ok"}}),
                 ("content_block_stop", {"index": 0}),
                 ("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}}),
                 ("message_stop", {})]
        return [sse({"type": n, **p}, compact=True, event=n) for n, p in named]
    if route == RESPONSES:
        resp = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "m"}
        named = [("response.created", {"response": resp}),
                 ("response.output_text.delta", {"item_id": "m1", "output_index": 0,
                                                 "content_index": 0, "delta": "ok"}),
                 ("response.completed", {"response": {**resp, "status": "completed",
                                                      "usage": usage}})]
        return [sse({"type": n, **p}, compact=True, event=n) for n, p in named]
    chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "m"}
    return [sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
            sse({**chunk, "choices": [{"index": 0, "delta": {"content": "ok"}}]}),
            sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            sse({**chunk, "choices": [], "usage": usage}), b"data: [DONE]\n\n"]


def doctor_app(answers: Answers, clock: ScriptedClock, tmp_path: Path, *,
               spec: dict[str, Any] | None = None, **settings: Any
               ) -> tuple[InProcess, CollectorRegistry, Path]:
    """The proxy with one upstream (``spec``: more of its [[upstream]] settings) in front
    of ``answers``, a fresh registry, and a request log."""
    upstream = ScriptedUpstream(answers, clock)
    log_file = tmp_path / "requests.jsonl"
    specs = (UpstreamSpec(name=UP, url=upstream.url + "/v1", models=("*",), default=True,
                          **(spec or {})),)
    registry = CollectorRegistry()
    app = create_app(Settings(upstreams=specs, log_requests=str(log_file),
                              **{"prefix_doctor": True, **settings}),
                     registry=registry, clock=clock)
    return InProcess(app, upstream), registry, log_file


async def post(app: Any, clock: ScriptedClock, path: str, body: dict[str, Any], *,
               at: float = T0) -> httpx.Response:
    clock.now = at  # when the proxy receives it
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as client:
        return await client.post(path, content=json.dumps(body).encode())


def lines(log_file: Path) -> list[dict[str, Any]]:
    """The request log, read after the app closed (every line is written by then)."""
    return [json.loads(line) for line in log_file.read_text().splitlines()]


def value(registry: CollectorRegistry, name: str, route: str, model: str = "m",
          **extra: str) -> float | None:
    return registry.get_sample_value(name, {"route": route, "model": model, "upstream": UP,
                                            **extra})


def sizes(route: str, body: dict[str, Any]) -> list[int]:
    return [len(part.data) for part in DIALECTS[route].prompt_parts(body)]


def expected(route: str, repeated_bytes: int, prompt_bytes: int, prompt: int, cached: int,
             *, minimum: int = 1024) -> tuple[int, int]:
    """(repeated, missed) tokens, from the definition: the repeated bytes at the request's
    own ratio; missed leaves out the prompt's last token and rounds down to the step (128
    tokens on OpenAI's APIs, 1 on Anthropic's); 0 below the minimum cacheable length."""
    repeated = min(prompt, round(repeated_bytes * prompt / prompt_bytes))
    if repeated < minimum:
        return repeated, 0
    step = 1 if route == MESSAGES else 128
    cacheable = min(repeated, prompt - 1)
    return repeated, max(0, cacheable // step * step - cached)


async def test_the_doctors_last_findings_are_observed_at_shutdown(tmp_path: Path) -> None:
    """A finding waits for its batch (doctor.metrics.PrefixMetrics) and the app's shutdown
    observes it without a collection: a worker's files get it so."""
    clock, answers = ScriptedClock(T0), Answers()
    app, _, _ = doctor_app(answers, clock, tmp_path)
    body = chat(("system", STABLE), ("user", "hi"))
    async with app:
        for at in (T0, T0 + 1):
            assert (await post(app, clock, CHAT, body, at=at)).status_code == 200
        ratio = app.metrics.prefix.repeated_ratio.labels(CHAT, "m", UP)
        assert ratio._sum.get() == 0  # held: no collection yet
    assert ratio._sum.get() == 1.0  # the second request repeated the first whole


@pytest.mark.parametrize("capture", [False, True])
async def test_a_jobs_keys_stay_with_it_only_for_the_workload_capture(
    capture: bool, tmp_path: Path
) -> None:
    """The prompt's keys outlive the batch only where the workload capture reads them at
    the finish; the record is the same either way."""
    clock, answers = ScriptedClock(T0), Answers()
    settings = {"workload_file": str(tmp_path / "w.jsonl"), "workload_block_size": 256}
    app, _, log_file = doctor_app(answers, clock, tmp_path, **(settings if capture else {}))
    check = app.v1.prefix
    jobs: list[PrefixJob] = []
    begin = check.begin

    def kept(*args: Any, **kwargs: Any) -> PrefixJob | None:
        job = begin(*args, **kwargs)
        if job is not None:
            jobs.append(job)
        return job

    check.begin = kept
    body = chat(("system", STABLE), ("user", "hi"))
    async with app:
        for at in (T0, T0 + 1):
            assert (await post(app, clock, CHAT, body, at=at)).status_code == 200
    assert len(jobs) == 2 and all(job.examination is not None for job in jobs)
    assert all((job.hashed is not None) is capture for job in jobs)
    assert [line["repeated_prefix_bytes"] for line in lines(log_file)] == [0, sum(
        sizes(CHAT, body))]


# ---------------------------------------------------------------------------
# Repeated, reported and missed, exact, for each API

SYSTEM = text(9000, "system")
Q1, A1, Q2 = text(1000, "q1"), text(700, "a1"), text(300, "q2")


def conversation(route: str, turn: int) -> dict[str, Any]:
    """Turn 1, or turn 2: turn 1 grown by an answer and a question (the whole of turn 1
    repeats). Completions: one prompt of whole blocks, then the same with more after it."""
    if route == COMPLETIONS:
        head = SYSTEM[:8192]
        return {"model": "m", "prompt": head if turn == 1 else head + Q2}
    turns: list[tuple[str, str]] = [("user", Q1)]
    if turn == 2:
        turns += [("assistant", A1), ("user", Q2)]
    messages = [{"role": role, "content": content} for role, content in turns]
    if route == CHAT:
        return {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, *messages]}
    if route == RESPONSES:
        return {"model": "m", "instructions": SYSTEM, "input": messages, "stream": True}
    return {"model": "claude-sonnet-4-5", "max_tokens": 50, "system": SYSTEM,
            "messages": messages, "stream": True}


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, RESPONSES, MESSAGES])
async def test_repeated_reported_and_missed_tokens_are_exact(route: str, tmp_path: Path) -> None:
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    turn1, turn2 = conversation(route, 1), conversation(route, 2)
    answers.queue(2500, 0)
    answers.queue(3000, 1024 if route != MESSAGES else 2000)
    async with app:
        assert (await post(app, clock, route, turn1)).status_code == 200
        assert (await post(app, clock, route, turn2, at=T0 + 10)).status_code == 200
    model = turn2["model"]
    first, second = lines(log_file)
    assert first["prompt_bytes"] == sum(sizes(route, turn1))
    assert (first["repeated_prefix_bytes"], first["repeated_prefix_tokens"]) == (0, 0)
    assert (first["cache_missed_tokens"], first["prefix_break"]) == (0, "first_seen")
    repeated_bytes = sum(sizes(route, turn1))  # a grown conversation repeats its last turn
    prompt_bytes = sum(sizes(route, turn2))
    cached = 1024 if route != MESSAGES else 2000
    repeated, missed = expected(route, repeated_bytes, prompt_bytes, 3000, cached)
    assert missed > 0
    assert second["prompt_bytes"] == prompt_bytes
    assert second["repeated_prefix_bytes"] == repeated_bytes
    assert second["repeated_prefix_tokens"] == repeated
    assert (second["prompt_tokens"], second["cached_prompt_tokens"]) == (3000, cached)
    assert second["cache_missed_tokens"] == missed
    assert second["prefix_break"] is None and second["prefix_break_part"] is None
    assert value(registry, REPEATED, route, model) == repeated
    assert value(registry, MISSED, route, model) == missed
    assert value(registry, MISSED_HIST + "_count", route, model) == 2
    assert value(registry, MISSED_HIST + "_sum", route, model) == missed
    assert value(registry, RATIO + "_count", route, model) == 2
    assert value(registry, RATIO + "_sum", route, model) == pytest.approx(
        repeated_bytes / prompt_bytes)
    assert value(registry, RATIO + "_bucket", route, model, le="0.0") == 1
    assert value(registry, BREAKS, route, model, reason="first_seen", part="none") == 1


async def test_a_stream_whose_usage_the_proxy_asked_for_is_counted_too(tmp_path: Path) -> None:
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    turn1 = {**conversation(CHAT, 1), "stream": True}
    turn2 = {**conversation(CHAT, 2), "stream": True}
    answers.queue(2500, 0)
    answers.queue(3000, 1024)
    async with app:
        await post(app, clock, CHAT, turn1)
        response = await post(app, clock, CHAT, turn2, at=T0 + 1)
        assert b'"usage"' not in response.content  # the injected usage event is still taken out
        assert answers.seen[-1].json["stream_options"] == {"include_usage": True}
    repeated, missed = expected(CHAT, sum(sizes(CHAT, turn1)), sum(sizes(CHAT, turn2)), 3000,
                                1024)
    assert lines(log_file)[1]["cache_missed_tokens"] == missed
    assert value(registry, MISSED, CHAT) == missed
    assert value(registry, REPEATED, CHAT) == repeated


# ---------------------------------------------------------------------------
# Every break reason, from a request pair built for it

STABLE = text(4000, "stable")
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": text(600, f"t{i}"),
                                            "parameters": {"type": "object"}}} for i in range(3)]


def chat(*messages: tuple[str, Any], model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": r, "content": c} for r, c in messages], **extra}


def _image(data: str) -> dict[str, Any]:
    content = [{"type": "text", "text": text(600, "caption")},
               {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]
    return chat(("system", STABLE), ("user", content), ("assistant", "A cat."),
                ("user", "What colour?"))


def _timestamped(now: str) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-5", "max_tokens": 50,
            "system": f"Current time is {now}.\n" + STABLE,
            "messages": [{"role": "user", "content": "What changed?"}]}


def _short_timed(now: str, *after: tuple[str, Any]) -> dict[str, Any]:
    """A time ahead of a document of under a kilobyte, in one user message."""
    return chat(("system", STABLE), ("user", f"Current time is {now}. " + text(700, "doc")),
                *after)


HISTORY = [("system", STABLE), ("user", text(500, "h1")), ("assistant", text(700, "h2")),
           ("user", text(300, "h3")), ("assistant", text(400, "h4")), ("user", "q?")]
EDITED = [*HISTORY[:2], ("assistant", text(650, "rewritten")), *HISTORY[3:]]

# (route, first body, second body, seconds between them, reason, part, index, offset)
PAIRS: dict[str, tuple[str, dict[str, Any], dict[str, Any], float, str, str, int | None,
                       int | None]] = {
    "tools reordered": (
        CHAT, chat(("system", STABLE), ("user", "hi"), tools=TOOLS),
        chat(("system", STABLE), ("user", "hi"), tools=[TOOLS[1], TOOLS[0], TOOLS[2]]),
        1, "tools_changed", "tools", 0, 0),
    "timestamp at the head of system": (
        MESSAGES, _timestamped("15:09:20"), _timestamped("15:09:21"), 1,
        "variable_before_stable", "system", 0, 0),
    "a time ahead of a short document, in the last message": (
        CHAT, _short_timed("15:09:20"), _short_timed("15:09:21"), 1,
        "variable_before_stable", "message", 1, 0),
    "a time ahead of a short document, in an earlier message": (
        CHAT, _short_timed("15:09:20", ("assistant", "ok"), ("user", "q?")),
        _short_timed("15:09:21", ("assistant", "ok"), ("user", "q?")), 1,
        "variable_before_stable", "message", 1, 0),
    "a message edited in the middle": (
        CHAT, chat(*HISTORY), chat(*EDITED), 1, "message_changed", "message", 2, 0),
    "an expired window": (
        CHAT, chat(("system", STABLE), ("user", "hi")), chat(("system", STABLE), ("user", "hi")),
        301, "expired", "system", 0, 0),
    "a different model": (
        CHAT, chat(("system", STABLE), ("user", "hi")),
        chat(("system", STABLE), ("user", "hi"), model="m2"), 1, "model_changed", "none", None,
        None),
    "an image part changed": (
        CHAT, _image("iVBORw0KGgo" * 50), _image("R0lGODlhAQ" * 50), 1, "message_changed",
        "message", 1, 512),
    "another cache key": (
        CHAT, chat(("system", STABLE), ("user", "hi"), prompt_cache_key="a"),
        chat(("system", STABLE), ("user", "hi"), prompt_cache_key="b"), 1, "cache_key_changed",
        "none", None, None),
    "other instructions": (
        RESPONSES, {"model": "m", "instructions": "Be terse.", "input": "hi"},
        {"model": "m", "instructions": "Be verbose.", "input": "hi"}, 1,
        "instructions_changed", "instructions", 0, 0),
    "another response_format": (
        CHAT, chat(("system", STABLE), ("user", "hi"), response_format={"type": "json_object"}),
        chat(("system", STABLE), ("user", "hi"), response_format={"type": "text"}), 1,
        "settings_changed", "settings", 0, 0),
    "another reasoning effort": (
        RESPONSES, {"model": "m", "instructions": STABLE, "input": "hi",
                    "reasoning": {"effort": "low"}},
        {"model": "m", "instructions": STABLE, "input": "hi", "reasoning": {"effort": "high"}},
        1, "settings_changed", "settings", 0, 0),
    "thinking switched on": (
        MESSAGES, {"model": "m", "max_tokens": 50, "system": STABLE,
                   "messages": [{"role": "user", "content": "hi"}]},
        {"model": "m", "max_tokens": 50, "system": STABLE,
         "messages": [{"role": "user", "content": "hi"}],
         "thinking": {"type": "enabled", "budget_tokens": 1024}},
        1, "settings_changed", "settings", 0, 0),
    "another model and other settings": (
        CHAT, chat(("system", STABLE), ("user", "hi"), reasoning_effort="low"),
        chat(("system", STABLE), ("user", "hi"), model="m2", reasoning_effort="high"), 1,
        "model_changed", "none", None, None),
    "the first of two prompts": (
        COMPLETIONS, {"model": "m", "prompt": ["alpha " * 10, "beta " * 10]},
        {"model": "m", "prompt": ["gamma " * 10, "beta " * 10]}, 1, "prompt_changed", "prompt",
        0, 0),
}


@pytest.mark.parametrize("case", list(PAIRS))
async def test_each_break_reason_from_a_request_pair(case: str, tmp_path: Path) -> None:
    route, first, second, gap, reason, part, index, offset = PAIRS[case]
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    async with app:
        assert (await post(app, clock, route, first)).status_code == 200
        assert (await post(app, clock, route, second, at=T0 + gap)).status_code == 200
    line = lines(log_file)[1]
    assert (line["prefix_break"], line["prefix_break_part"] or "none") == (reason, part)
    assert (line["prefix_break_index"], line["prefix_break_offset"]) == (index, offset)
    model = second["model"]
    assert value(registry, BREAKS, route, model, reason=reason, part=part) == 1
    counted = {(s.labels["reason"], s.labels["part"]): s.value
               for m in registry.collect() if m.name == BREAKS.removesuffix("_total")
               for s in m.samples if s.name == BREAKS}
    assert sum(counted.values()) == 2  # the first request (first_seen) and this one
    if reason not in ("model_changed", "cache_key_changed"):
        assert counted[("first_seen", "none")] == 1


@pytest.mark.parametrize("route", [CHAT, RESPONSES, MESSAGES])
async def test_a_changed_setting_is_named_and_nothing_is_missed(route: str,
                                                                tmp_path: Path) -> None:
    """Two requests of the same prompt text, one setting changed (a response schema, a
    reasoning effort, the tool choice): the provider cannot reuse the cache, so the
    doctor names the setting (never its value) and counts no token missed, although the
    upstream reported none cached."""
    schema = {"type": "json_schema", "json_schema": {"name": "private-schema-a"}}
    other = {"type": "json_schema", "json_schema": {"name": "private-schema-b"}}
    if route == CHAT:
        name = "response_format"
        first = chat(("system", STABLE), ("user", "hi"), response_format=schema)
        second = chat(("system", STABLE), ("user", "hi"), response_format=other)
    elif route == RESPONSES:
        name = "text.format"
        body = {"model": "m", "instructions": STABLE, "input": "hi"}
        first = {**body, "text": {"format": schema, "verbosity": "low"}}
        second = {**body, "text": {"format": other, "verbosity": "low"}}
    else:
        name = "tool_choice"
        body = {"model": "m", "max_tokens": 50, "system": STABLE, "tools": TOOLS,
                "messages": [{"role": "user", "content": "hi"}]}
        first = {**body, "tool_choice": {"type": "auto", "private-schema-a": 1}}
        second = {**body, "tool_choice": {"type": "any", "private-schema-b": 1}}
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    answers.queue(2000, 0)
    answers.queue(2000, 0)
    async with app:
        await post(app, clock, route, first)
        await post(app, clock, route, second, at=T0 + 1)
    line = lines(log_file)[1]
    assert (line["prefix_break"], line["prefix_break_part"]) == ("settings_changed", "settings")
    assert line["prefix_break_role"] == name
    assert line["repeated_prefix_bytes"] == 0 and line["cache_missed_tokens"] == 0
    assert value(registry, BREAKS, route, reason="settings_changed", part="settings") == 1
    assert b"private-schema" not in log_file.read_bytes()


@pytest.mark.parametrize("case", ["one message", "system and user", "two settings",
                                  "one removed, another added"])
async def test_a_removed_setting_is_named_by_its_name(case: str, tmp_path: Path) -> None:
    """A setting present, then absent: the prefix breaks ahead of the text, where the
    setting was, so the break is the setting's (its name as the role), not the next
    part's (or none at all when that part is the newest message). One removed and
    another added in its place: the one given now is named (it was the removed one)."""
    schema = {"type": "json_schema", "json_schema": {"name": "private-schema-a"}}
    if case == "one message":
        first = chat(("user", STABLE), response_format=schema)
        second = chat(("user", STABLE))
    elif case == "system and user":
        first = chat(("system", STABLE), ("user", "hi"), response_format=schema)
        second = chat(("system", STABLE), ("user", "hi"))
    elif case == "two settings":  # one of two removed: the one removed is named, not the one that stays
        first = chat(("system", STABLE), ("user", "hi"), response_format=schema,
                     service_tier="flex")
        second = chat(("system", STABLE), ("user", "hi"), service_tier="flex")
    else:
        first = chat(("system", STABLE), ("user", "hi"), service_tier="flex")
        second = chat(("system", STABLE), ("user", "hi"), response_format=schema)
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    answers.queue(2000, 0)
    answers.queue(2000, 0)
    async with app:
        await post(app, clock, CHAT, first)
        await post(app, clock, CHAT, second, at=T0 + 1)
    line = lines(log_file)[1]
    assert (line["prefix_break"], line["prefix_break_part"]) == ("settings_changed", "settings")
    assert line["prefix_break_role"] == "response_format"
    assert line["repeated_prefix_bytes"] == 0 and line["cache_missed_tokens"] == 0
    assert value(registry, BREAKS, CHAT, reason="settings_changed", part="settings") == 1
    assert b"private-schema" not in log_file.read_bytes()


async def test_a_conversation_with_steady_settings_grows_without_a_break(
        tmp_path: Path) -> None:
    """Settings that stay the same are a prefix like any other: the next turn repeats
    the whole previous one, and a new prompt is still first seen under another model."""
    settings = {"response_format": {"type": "json_object"}, "reasoning_effort": "low"}
    turn1 = {**conversation(CHAT, 1), **settings}
    turn2 = {**conversation(CHAT, 2), **settings}
    clock, answers = ScriptedClock(T0), Answers()
    app, _, log_file = doctor_app(answers, clock, tmp_path)
    async with app:
        await post(app, clock, CHAT, turn1)
        await post(app, clock, CHAT, turn2, at=T0 + 1)
        await post(app, clock, CHAT, {**chat(("user", text(900, "new"))), **settings,
                                      "model": "m3"}, at=T0 + 2)
    first, second, third = lines(log_file)
    assert first["prefix_break"] == "first_seen"
    assert second["prefix_break"] is None
    assert second["repeated_prefix_bytes"] == first["prompt_bytes"] == sum(sizes(CHAT, turn1))
    assert third["prefix_break"] == "first_seen"


def document(n_words: int, seed: str) -> str:
    """A retrieval app's context: sentences of 4 to 24 words, a blank line between
    paragraphs of a few sentences."""
    rng = random.Random(seed)
    out: list[str] = []
    left = n_words
    while left > 0:
        sentence = text(rng.randint(20, 140), f"{seed}-{left}").split()[: min(left, 24)]
        left -= len(sentence)
        out.append(" ".join(sentence).capitalize() + ("." if rng.random() < 0.85 else "?"))
        out.append("\n\n" if rng.random() < 0.15 else " ")
    return "".join(out).rstrip()


DOC = document(500, "doc")  # about 3 KB


async def test_a_time_ahead_of_a_document_in_the_newest_message_is_named(tmp_path: Path) -> None:
    """Every turn one user message, ``Current time is <t>. <document> Question <n>?``:
    the time changes ahead of a document the previous turns sent, in the newest (and
    only) message. The request log names it ``variable_before_stable`` in that message,
    the changed run the time's sentence (one block, rounded) and the stable run the
    document up to the question's block; the metric counts it with its bounded labels."""
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    turns = [("15:09:20", 1), ("15:09:21", 2), ("15:09:37", 3), ("9:05:00", 4)]
    async with app:
        for i, (now, n) in enumerate(turns):
            body = chat(("user", f"Current time is {now}. {DOC} Question {n}?"), stream=True)
            assert (await post(app, clock, CHAT, body, at=T0 + i)).status_code == 200
    first, *rest = lines(log_file)
    assert first["prefix_break"] == "first_seen"
    for line in rest:
        assert (line["prefix_break"], line["prefix_break_part"], line["prefix_break_index"],
                line["prefix_break_offset"], line["repeated_prefix_bytes"]) == (
            "variable_before_stable", "message", 0, 0, 0)
    assert value(registry, BREAKS, CHAT, reason="variable_before_stable", part="message") == 3
    # The sizes of the last one, as the live page shows them (they are not labels).
    assert app.ui is not None and app.ui.data.breaks is not None
    _, example = app.ui.data.breaks.latest(lambda key: True)["variable_before_stable"]
    size = len(f"Current time is 9:05:00. {DOC} Question 4?".encode())
    assert (example.part, example.index, example.role, example.offset, example.part_bytes) == (
        "message", 0, "user", 0, size)
    assert example.changed_bytes == 256  # "Current time is ...": its block
    stable = example.stable_bytes
    assert stable is not None and stable % 256 == 0  # the document, block-rounded
    assert size - 3 * 256 <= stable <= size - 256 - len(" Question 4?")


async def test_a_new_question_after_the_same_document_is_not_a_break(tmp_path: Path) -> None:
    """``<document> Question <n>?``: the same document, a new question at the end of the
    message each turn. Everything up to the question repeats; nothing is named."""
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    async with app:
        for n in range(1, 5):
            body = chat(("user", f"{DOC} Question {n}?"))
            assert (await post(app, clock, CHAT, body, at=T0 + n)).status_code == 200
    first, *rest = lines(log_file)
    assert first["prefix_break"] == "first_seen"
    for line in rest:
        assert line["prefix_break"] is None and line["prefix_break_part"] is None
        assert line["repeated_prefix_bytes"] >= len(DOC) - 256
    assert value(registry, BREAKS, CHAT, reason="first_seen", part="none") == 1
    assert value(registry, BREAKS, CHAT, reason="variable_before_stable", part="message") is None


async def test_the_window_is_a_setting(tmp_path: Path) -> None:
    clock, answers = ScriptedClock(T0), Answers()
    app, _, log_file = doctor_app(answers, clock, tmp_path, prefix_window=30.0)
    body = chat(("system", STABLE), ("user", "hi"))
    async with app:
        await post(app, clock, CHAT, body)
        await post(app, clock, CHAT, body, at=T0 + 30)  # exactly the window: still held
        await post(app, clock, CHAT, body, at=T0 + 61)
    assert [line["prefix_break"] for line in lines(log_file)] == ["first_seen", None, "expired"]


# ---------------------------------------------------------------------------
# Responses with stored context: a new previous_response_id is how the API works


async def test_stored_context_leaves_tokens_unknown_and_a_new_response_id_is_no_break(
        tmp_path: Path) -> None:
    """The usage's input tokens include the stored history the proxy cannot see, so no
    token figure is derived from bytes (null, not a guess); repeated bytes and breaks of
    the visible parts are still said. A new previous_response_id each turn is no break;
    a conversation's stored items grow under the same id, so nothing after it repeats."""
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)

    def turn(**extra: Any) -> dict[str, Any]:
        return {"model": "m", "instructions": STABLE, "input": "Go on.", **extra}

    bodies = [turn(previous_response_id="resp_1"), turn(previous_response_id="resp_2"),
              {**turn(previous_response_id="resp_3"), "instructions": text(3000, "other")},
              turn(conversation="conv_1"), turn(conversation={"id": "conv_1"})]
    for _ in bodies:
        answers.queue(19_826, 19_000)  # about 500 visible tokens, the rest stored
    async with app:
        for i, body in enumerate(bodies):
            assert (await post(app, clock, RESPONSES, body, at=T0 + i)).status_code == 200
    first, second, edited, conversation, again = lines(log_file)
    instructions = len(STABLE.encode())
    assert first["prefix_break"] == "first_seen"
    for line in lines(log_file):
        assert line["repeated_prefix_tokens"] is None and line["cache_missed_tokens"] is None
        assert line["prompt_tokens"] == 19_826 and line["cached_prompt_tokens"] == 19_000
    assert (second["prefix_break"], second["repeated_prefix_bytes"]) == (None, instructions)
    assert (edited["prefix_break"], edited["prefix_break_part"]) == (
        "instructions_changed", "instructions")
    assert conversation["prefix_break"] is None
    # the same conversation and the same input: repeated up to the conversation's id only
    whole = again["prompt_bytes"]
    assert again["prefix_break"] is None
    assert instructions < again["repeated_prefix_bytes"] < whole
    assert again["repeated_prefix_bytes"] == whole - len(b"Go on.")
    assert not value(registry, REPEATED, RESPONSES)
    assert not value(registry, MISSED, RESPONSES)


# Images, audio and files: tokens in the usage that follow no bytes the proxy sees


def _with_media(route: str, turn: int) -> dict[str, Any]:
    """The same system prompt, then a new question with a new picture of its own."""
    picture = base64.b64encode(text(3000, f"pixels {turn}").encode()).decode()
    question = f"Question {turn}: what is in this picture?"
    if route == CHAT:
        return chat(("system", STABLE), ("user", [
            {"type": "text", "text": question},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{picture}"}}]))
    if route == RESPONSES:
        return {"model": "m", "instructions": STABLE, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": question},
            {"type": "input_image", "image_url": f"data:image/png;base64,{picture}"}]}]}
    return {"model": "claude-sonnet-4-5", "max_tokens": 50, "system": STABLE,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": question},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": picture}}]}]}


@pytest.mark.parametrize("route", [CHAT, RESPONSES, MESSAGES])
async def test_a_prompt_with_a_picture_has_no_token_figures(route: str, tmp_path: Path) -> None:
    """A picture enters the prompt as a hash of 50 bytes but costs the upstream hundreds
    of tokens or more, so the request's tokens per byte are not those of its text: at
    that ratio the repeated system prompt read as 3,000 tokens where the upstream cached
    all of its 1,000, and 2,000 were counted missed. Token figures are null; the
    repeated bytes and the break are still said."""
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    answers.queue(4000, 0)
    answers.queue(4000, 1000)  # the system prompt's tokens: cached whole
    async with app:
        await post(app, clock, route, _with_media(route, 1))
        await post(app, clock, route, _with_media(route, 2), at=T0 + 1)
    first, second = lines(log_file)
    assert first["prefix_break"] == "first_seen"
    assert second["prefix_break"] is None  # a new last message: no break
    assert second["repeated_prefix_bytes"] >= len(STABLE.encode())
    assert second["prompt_bytes"] < 2 * len(STABLE.encode())  # the picture: a short hash
    for line in (first, second):
        assert (line["prompt_tokens"], line["cached_prompt_tokens"]) == (
            4000, 0 if line is first else 1000)
        assert line["repeated_prefix_tokens"] is None and line["cache_missed_tokens"] is None
    model = _with_media(route, 1)["model"]
    for unknown in (REPEATED, MISSED, MISSED_HIST + "_count"):  # no series: not a 0
        assert value(registry, unknown, route, model) is None
    assert value(registry, RATIO + "_count", route, model) == 2  # the bytes still count


# ---------------------------------------------------------------------------
# What counts as missed, and what is unknown


async def test_below_the_minimum_cacheable_length_nothing_is_missed(tmp_path: Path) -> None:
    body1 = chat(("system", STABLE), ("user", "q1"))
    body2 = chat(("system", STABLE), ("user", "q1"), ("assistant", "a1"), ("user", "q2"))
    for spec, missed in (({}, 0), ({"min_cacheable_tokens": 500, "cache_granularity_tokens": 1},
                                   None)):
        clock, answers = ScriptedClock(T0), Answers()
        (tmp_path / str(len(spec))).mkdir()
        app, registry, log_file = doctor_app(answers, clock, tmp_path / str(len(spec)), spec=spec)
        answers.queue(1000, 0)
        answers.queue(1020, 0)
        async with app:
            await post(app, clock, CHAT, body1)
            await post(app, clock, CHAT, body2, at=T0 + 1)
        line = lines(log_file)[1]
        repeated = round(sum(sizes(CHAT, body1)) * 1020 / sum(sizes(CHAT, body2)))
        assert 500 < line["repeated_prefix_tokens"] == repeated < 1024
        if missed == 0:  # OpenAI's 1,024 tokens: a shorter prefix is never cached
            assert line["cache_missed_tokens"] == 0
            assert value(registry, MISSED, CHAT) == 0
            assert value(registry, MISSED_HIST + "_count", CHAT) == 2
        else:  # an upstream that caches from 500 tokens, token by token
            assert line["cache_missed_tokens"] == repeated  # nothing reported cached
            assert value(registry, MISSED, CHAT) == repeated


async def test_the_minimum_applies_after_rounding_to_the_step(tmp_path: Path) -> None:
    """A prompt of exactly 1,024 tokens repeated whole on OpenAI: without its last token
    and rounded down to 128-token steps, 896 tokens are cacheable, below the 1,024-token
    minimum, so nothing was missed (it was counted 896 when the minimum was checked on
    the repeated tokens before rounding)."""
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    body = chat(("system", STABLE), ("user", "q1"))
    answers.queue(1024, 0)
    answers.queue(1024, 0)
    async with app:
        await post(app, clock, CHAT, body)
        await post(app, clock, CHAT, body, at=T0 + 1)
    line = lines(log_file)[1]
    assert line["prefix_break"] is None and line["repeated_prefix_tokens"] == 1024
    assert line["cache_missed_tokens"] == 0
    assert value(registry, MISSED, CHAT) == 0


@pytest.mark.parametrize("route", [CHAT, RESPONSES, MESSAGES])
async def test_an_absent_cached_field_leaves_missed_unknown(route: str, tmp_path: Path) -> None:
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    turn1, turn2 = conversation(route, 1), conversation(route, 2)
    answers.queue(2500, None)
    answers.queue(3000, None)
    async with app:
        await post(app, clock, route, turn1)
        await post(app, clock, route, turn2, at=T0 + 1)
    line = lines(log_file)[1]
    assert line["cached_prompt_tokens"] is None  # the field was absent: not 0
    assert line["repeated_prefix_tokens"] > 2000
    assert line["cache_missed_tokens"] is None
    model = turn2["model"]
    assert value(registry, REPEATED, route, model) == line["repeated_prefix_tokens"]
    assert value(registry, MISSED, route, model) is None  # unknown: no series, not a 0
    assert value(registry, MISSED_HIST + "_count", route, model) is None


async def test_an_answer_that_is_not_2xx_is_not_examined(tmp_path: Path) -> None:
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    body = chat(("system", STABLE), ("user", "hi"))
    async with app:
        answers.status = 429
        assert (await post(app, clock, CHAT, body)).status_code == 429
        answers.status = 200
        await post(app, clock, CHAT, body, at=T0 + 1)  # the retry
    refused, retry = lines(log_file)
    assert refused["prompt_bytes"] is None and refused["prefix_break"] is None
    assert retry["prefix_break"] == "first_seen"  # the refused one left nothing behind
    assert retry["repeated_prefix_bytes"] == 0
    assert value(registry, RATIO + "_count", CHAT) == 1  # the retry only


async def test_off_switch(tmp_path: Path) -> None:
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path, prefix_doctor=False)
    async with app:
        assert app.v1.prefix is None
        await post(app, clock, CHAT, chat(("system", STABLE), ("user", "hi")))
    line = lines(log_file)[0]
    assert line["prompt_bytes"] is None and line["repeated_prefix_tokens"] is None
    assert value(registry, RATIO + "_count", CHAT) is None


# ---------------------------------------------------------------------------
# Where it runs, and what a failure does


async def test_a_large_prompt_is_examined_in_the_thread_while_another_stream_flows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock, answers = ScriptedClock(T0), Answers()
    app, _, log_file = doctor_app(answers, clock, tmp_path)
    check = app.v1.prefix
    assert check is not None
    examine = check.doctor.look
    threads: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def slow_examine(*args: Any, **kwargs: Any) -> Any:
        name = threading.current_thread().name
        threads.append(name)
        if name != threading.main_thread().name:  # the worker thread: hold it
            entered.set()
            assert release.wait(30)
        return examine(*args, **kwargs)

    monkeypatch.setattr(check.doctor, "look", slow_examine)
    large = {**chat(("system", text(LARGE, "large")), ("user", "sum up")),
             "stream": True}
    small = {**chat(("system", STABLE), ("user", "hi"), model="m2"), "stream": True}
    answers.queue(12_000, 0)
    answers.queue(1000, 0)
    answers.hold = held = asyncio.Event()  # the large request's stream waits after a token
    async with app:
        first = asyncio.ensure_future(post(app, clock, CHAT, large))
        assert await asyncio.to_thread(entered.wait, 30)  # its prompt is in the thread
        answers.hold = None
        # While the thread works on the large prompt, another stream flows end to end.
        other = await post(app, clock, CHAT, small, at=T0 + 1)
        assert other.status_code == 200 and b"data: [DONE]" in other.content
        assert not first.done()
        release.set()
        held.set()
        assert (await first).status_code == 200
    assert threads == ["prefix-doctor_0", "MainThread"]
    big, little = sorted(lines(log_file), key=lambda line: -line["prompt_bytes"])
    assert big["prompt_bytes"] > LARGE and big["prefix_break"] == "first_seen"
    assert little["prefix_break"] == "first_seen"


@pytest.mark.parametrize("in_time", [True, False])
async def test_the_finish_waits_for_the_thread_a_bounded_time(
        in_time: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer faster than its prompt's hashing: the record waits for the thread (the
    thread here finishes only once the finish waits for it), at most SETTLE_S."""
    clock, answers = ScriptedClock(T0), Answers()
    app, _, log_file = doctor_app(answers, clock, tmp_path)
    check = app.v1.prefix
    assert check is not None
    examine = check.doctor.look
    release, done = threading.Event(), threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30)
        try:
            return examine(*args, **kwargs)
        finally:
            done.set()

    settle = PrefixJob.settle

    async def settling(job: PrefixJob) -> None:
        if in_time:
            release.set()  # the thread goes on only once the finish waits for it
        await settle(job)

    monkeypatch.setattr(check.doctor, "look", held)
    monkeypatch.setattr(PrefixJob, "settle", settling)
    if not in_time:
        monkeypatch.setattr(doctor_job, "SETTLE_S", 0.05)
    large = chat(("system", text(LARGE, "large")), ("user", "sum up"))
    async with app:
        response = await post(app, clock, CHAT, large)
        assert response.status_code == 200
        release.set()
        assert await asyncio.to_thread(done.wait, 30)
    (line,) = lines(log_file)
    if in_time:
        assert line["prefix_break"] == "first_seen" and line["prompt_bytes"] > LARGE
    else:  # too late for the record; the index still has the prompt
        assert line["prompt_bytes"] is None and line["outcome"] == "completed"
        assert line["prefix_unchecked"] == "late"


def report_of(job: PrefixJob) -> Any:
    """The job's report, once examined (what its record is made from)."""
    return job.examination.report if job.examination is not None else None


async def test_a_job_that_never_got_its_turn_runs_at_the_finish() -> None:
    check = PrefixCheck()
    calls = []
    examine = check.doctor.look

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread().name)
        return examine(*args, **kwargs)

    check.doctor.look = counted  # type: ignore[method-assign]
    spec = UpstreamSpec(name=UP, url="http://u/v1")
    body = chat(("system", STABLE), ("user", "hi"))
    assert check.begin(DIALECTS[CHAT], body, spec, T0, 429, 100) is None
    assert check.begin(None, body, spec, T0, 200, 100) is None
    job = check.begin(DIALECTS[CHAT], body, spec, T0, 200, len(json.dumps(body)))
    assert job is not None and report_of(job) is None  # in a batch, not started yet
    await job.settle()  # the answer was relayed before the batch ran
    assert report_of(job) is not None and report_of(job).reason == "first_seen"
    check.run_batch()  # what the batch's timer would run: nothing is left
    assert calls == ["MainThread"]
    record = job.record
    assert record is not None and record.tokens(1000, None) == (0, None, None)
    check.close()


async def test_a_record_is_its_examination_and_gives_the_usages_tokens() -> None:
    """The finish's record is the batch's, every field in its place (the batch builds it
    by position: a field added or moved out of place fails here), and its tokens are
    those :func:`cache_tokens` gives for the usage under the upstream's rules."""
    from proxy.doctor.report import cache_tokens

    check = PrefixCheck()
    spec = UpstreamSpec(name=UP, url="http://u/v1", min_cacheable_tokens=100,
                        cache_granularity_tokens=64)
    body = chat(("system", STABLE), ("user", "hi"))
    size = len(json.dumps(body))
    jobs = []
    for at in (T0, T0 + 1):
        job = check.begin(DIALECTS[CHAT], body, spec, at, 200, size)
        assert job is not None
        await job.settle()
        jobs.append(job)
    examination = jobs[1].examination
    assert examination is not None and examination.report is not None
    report, record = examination.report, jobs[1].record
    assert record is not None and record is examination.record
    assert record._asdict() == {
        "prompt_bytes": report.prompt_bytes, "repeated_bytes": report.repeated_bytes,
        "break_reason": report.reason or "", "break_part": report.part or "",
        "break_index": report.index, "break_offset": report.offset,
        "break_role": report.role or "", "break_part_bytes": report.part_bytes,
        "changed_bytes": report.changed_bytes, "stable_bytes": report.stable_bytes,
        "unchecked": "", "index_s": None, "rules": record.rules}
    expected = cache_tokens(examination.report, 1000, 300, minimum_tokens=100,
                            granularity_tokens=64)
    assert expected.repeated and expected.missed  # figures worth comparing: none is 0
    assert record.tokens(1000, 300) == (expected.repeated, expected.missed, expected.unmarked)
    check.close()


async def test_a_streams_job_waits_for_its_prefill_and_is_stamped_then() -> None:
    """A stream's job joins no batch until its first output event (ready), and is stamped
    at that time; a stream that ends without one is stamped at its headers, at the
    finish; a non-stream answer's job is ready at its headers. A job is weighed (its
    estimate and place) in its batch, neither on the way to the response's first bytes
    nor at the first token."""
    check = PrefixCheck()
    held: list[tuple[int, int | None]] = []
    examine = check.doctor.look
    weighed: list[int] = []
    estimate = check.estimate

    def counted_estimate(payload: Any, body_bytes: int) -> int:
        weighed.append(body_bytes)
        return estimate(payload, body_bytes)

    check.estimate = counted_estimate  # type: ignore[method-assign]

    def recorded(*args: Any, now_ms: int, held_ms: int | None = None, **kwargs: Any) -> Any:
        held.append((now_ms, held_ms))
        return examine(*args, now_ms=now_ms, held_ms=held_ms, **kwargs)

    check.doctor.look = recorded  # type: ignore[method-assign]
    spec = UpstreamSpec(name=UP, url="http://u/v1")
    body = chat(("system", STABLE), ("user", "hi"))

    def begin(stream: bool) -> PrefixJob:
        job = check.begin(DIALECTS[CHAT], body, spec, T0, 200, 100, t_headers=T0 + 1,
                          stream=stream)
        assert job is not None
        return job

    streamed = begin(True)
    assert check._batch == [] and weighed == []  # not ready: no first token yet
    streamed.ready(T0 + 2.5)
    assert weighed == []  # in the batch, not run yet
    streamed.ready(T0 + 9)  # once
    assert check._batch == [streamed]
    await streamed.settle()
    assert weighed == [100]
    silent = begin(True)
    await silent.settle()  # no output at all: its headers' time
    plain = begin(False)
    assert check._batch == [plain]
    await plain.settle()
    at = round(T0 * 1000)
    assert held == [(at, at + 2500), (at, at + 1000), (at, at + 1000)]
    check.close()


async def test_jobs_run_in_batches_in_the_order_they_were_created(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch runs BATCH_S after its first job, or at the loop's next turn once it holds
    BATCH_JOBS jobs, BATCH_BLOCKS (its bodies' bytes over the block size, one more a
    body, at most a BATCH_LEAST th of them a body) or a body bound for the hashing
    thread; a finish that comes first runs the jobs before its own."""
    monkeypatch.setattr(doctor_job, "BATCH_TURN_S", 60.0)  # a batch in one turn (see below)
    check = PrefixCheck()
    order: list[int] = []
    ran = asyncio.Event()
    examine = check.doctor.look
    in_thread = threading.Event()

    def counted(*args: Any, now_ms: int, **kwargs: Any) -> Any:
        order.append(now_ms)
        if threading.current_thread() is threading.main_thread():
            ran.set()
        else:
            in_thread.set()
        return examine(*args, now_ms=now_ms, **kwargs)

    check.doctor.look = counted  # type: ignore[method-assign]
    spec = UpstreamSpec(name=UP, url="http://u/v1")
    body = chat(("system", STABLE), ("user", "hi"))

    def begin(i: int, size: int = 100) -> PrefixJob:
        job = check.begin(DIALECTS[CHAT], body, spec, T0 + i, 200, size)
        assert job is not None
        return job

    # The timer: three jobs, none started until the batch runs, then all in order.
    jobs = [begin(i) for i in range(3)]
    await asyncio.sleep(0)
    assert order == [] and all(report_of(job) is None for job in jobs)
    await asyncio.wait_for(ran.wait(), 30)
    assert order == [round((T0 + i) * 1000) for i in range(3)]
    assert all(report_of(job) is not None for job in jobs)
    # Bodies that reach BATCH_BLOCKS: the batch runs at the next turn (2 KB bodies: 9
    # blocks each, 9 jobs).
    order.clear()
    monkeypatch.setattr(doctor_job, "BATCH_S", 60.0)  # no timer runs these batches
    each = 9
    first = -(-doctor_job.BATCH_BLOCKS // each) - 1  # one job short
    jobs = [begin(10 + i, (each - 1) * 256) for i in range(first)]
    await asyncio.sleep(0)
    assert order == []
    jobs.append(begin(10 + first, (each - 1) * 256))
    await asyncio.sleep(0)
    assert order == [round((T0 + 10 + i) * 1000) for i in range(first + 1)]
    # A large body examined on the loop counts a BATCH_LEAST th of BATCH_BLOCKS: it does
    # not run its batch alone, where its code would run cold.
    order.clear()
    least, large = doctor_job.BATCH_LEAST, (INLINE_MAX_BLOCKS - 8) * 256  # still inline
    jobs = [begin(40 + i, large) for i in range(least - 1)]
    await asyncio.sleep(0)
    assert order == []
    jobs.append(begin(40 + least - 1, large))
    await asyncio.sleep(0)
    assert order == [round((T0 + 40 + i) * 1000) for i in range(least)]
    order.clear()
    jobs = [begin(100 + i) for i in range(doctor_job.BATCH_JOBS)]
    await asyncio.sleep(0)
    assert order == [round((T0 + 100 + i) * 1000) for i in range(doctor_job.BATCH_JOBS)]
    # A finish before the batch ran runs the batch up to its job, in order: the jobs
    # before it first; the one after it waits for its batch.
    order.clear()
    jobs = [begin(20), begin(21), begin(22)]
    await jobs[1].settle()
    assert order == [round((T0 + i) * 1000) for i in (20, 21)]
    assert report_of(jobs[1]) is not None and report_of(jobs[1]).reason is None  # a repeat
    assert check._batch == [jobs[2]] and report_of(jobs[2]) is None
    check.run_batch()
    assert order == [round((T0 + i) * 1000) for i in (20, 21, 22)]
    # A body bound for the hashing thread runs its batch at the loop's next turn, which
    # weighs it and hands it over; the small job before it is examined on the loop.
    order.clear()
    ran.clear()
    small, large = begin(30), begin(31, (INLINE_MAX_BLOCKS + 1) * 256)
    assert await asyncio.to_thread(in_thread.wait, 30)
    await large.settle()
    assert order == [round((T0 + i) * 1000) for i in (30, 31)] and ran.is_set()
    assert report_of(small) is not None and report_of(large) is not None
    check.close()


def counting_check() -> tuple[PrefixCheck, list[int]]:
    """A check whose examinations add their request's arrival (ms) to the list, in the
    order they ran."""
    check = PrefixCheck()
    order: list[int] = []
    examine = check.doctor.look

    def counted(*args: Any, now_ms: int, **kwargs: Any) -> Any:
        order.append(now_ms)
        return examine(*args, now_ms=now_ms, **kwargs)

    check.doctor.look = counted  # type: ignore[method-assign]
    return check, order


async def test_a_batch_turn_ends_past_its_time_and_the_rest_runs_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch holds the loop for BATCH_TURN_S and one job more: with no time at all,
    one job a turn, the rest at the next turns ahead of jobs that join meanwhile; a
    finish waits for the turns that reach its job, and the loop's other events run
    between them."""
    monkeypatch.setattr(doctor_job, "BATCH_TURN_S", 0.0)
    check, order = counting_check()
    spec = UpstreamSpec(name=UP, url="http://u/v1")
    body = chat(("system", STABLE), ("user", "hi"))

    def begin(i: int) -> PrefixJob:
        job = check.begin(DIALECTS[CHAT], body, spec, T0 + i, 200, 100)
        assert job is not None
        return job

    ms = [round((T0 + i) * 1000) for i in range(doctor_job.BATCH_JOBS + 3)]
    jobs = [begin(i) for i in range(doctor_job.BATCH_JOBS)]  # a full batch: the next turn
    await asyncio.sleep(0)
    assert order == ms[:1]
    await asyncio.sleep(0)
    assert order == ms[:2]
    jobs += [begin(doctor_job.BATCH_JOBS), begin(doctor_job.BATCH_JOBS + 1)]  # join after
    await asyncio.sleep(0)
    assert order == ms[:3]
    between: list[int] = []  # a stream's event, due while the finish waits
    asyncio.get_running_loop().call_soon(lambda: between.append(len(order)))
    await jobs[-2].settle()  # the jobs up to its own, a turn at a time
    assert len(order) > doctor_job.BATCH_JOBS and order == ms[: len(order)]
    assert report_of(jobs[-2]) is not None
    assert between and between[0] < len(order) - 1  # not every job in one turn
    assert check._batch == [jobs[-1]]
    await asyncio.sleep(0)  # the last at the next turn
    assert order == ms[: doctor_job.BATCH_JOBS + 2]
    check.close()


async def test_finishes_in_one_turn_of_the_loop_run_one_turn_of_their_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two finishes whose jobs wait in the same batch run one turn of it between them, not
    one each: the loop's other events wait for one turn at a time."""
    monkeypatch.setattr(doctor_job, "BATCH_TURN_S", 0.0)  # one job a turn
    monkeypatch.setattr(doctor_job, "BATCH_S", 60.0)  # no timer runs the batch
    check, order = counting_check()
    spec = UpstreamSpec(name=UP, url="http://u/v1")
    body = chat(("system", STABLE), ("user", "hi"))
    jobs = [check.begin(DIALECTS[CHAT], body, spec, T0 + i, 200, 100) for i in range(6)]
    assert all(job is not None for job in jobs)
    loop = asyncio.get_running_loop()
    seen: list[int] = []  # jobs examined, read once a turn of the loop

    def probe() -> None:
        seen.append(len(order))
        if len(order) < 5:
            loop.call_soon(probe)

    loop.call_soon(probe)
    await asyncio.gather(jobs[3].settle(), jobs[4].settle())  # type: ignore[union-attr]
    assert order[:5] == [round((T0 + i) * 1000) for i in range(5)]
    assert max(b - a for a, b in pairwise(seen)) == 1, seen
    check.close()


async def test_a_job_is_settled_once_examined_or_once_its_thread_is_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the finish asks before it awaits ``settle``: a job not yet examined, or whose
    thread is still on it, is not settled; one examined on the loop is, and one whose
    thread is done."""
    monkeypatch.setattr(doctor_job, "BATCH_S", 60.0)  # no timer runs a batch
    monkeypatch.setattr(doctor_job, "BATCH_TURN_S", 60.0)  # a turn runs the whole batch
    check = PrefixCheck()
    examine = check.doctor.look
    release = threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(30)
        return examine(*args, **kwargs)

    check.doctor.look = held  # type: ignore[method-assign]
    spec = UpstreamSpec(name=UP, url="http://u/v1")
    small = check.begin(DIALECTS[CHAT], chat(("user", "hi")), spec, T0, 200, 100, stream=True)
    large = check.begin(DIALECTS[CHAT], chat(("user", text(LARGE, "large"))), spec, T0, 200,
                        (INLINE_MAX_BLOCKS + 1) * 256, stream=True)
    assert small is not None and large is not None
    assert not small.settled  # no first token yet
    small.ready(T0 + 0.1)
    large.ready(T0 + 0.1)
    assert not small.settled and not large.settled  # in their batch
    try:
        check.run_batch()
        assert small.settled and report_of(small) is not None
        assert large.place is Place.THREAD and not large.settled  # its thread is held
    finally:
        release.set()
    await large.settle()
    assert large.settled and report_of(large) is not None
    check.close()


async def test_a_doctor_that_raises_does_not_break_the_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path)
    assert app.v1.prefix is not None

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the doctor broke")

    monkeypatch.setattr(app.v1.prefix.doctor, "look", broken)
    body = {**chat(("system", STABLE), ("user", "hi")), "stream": True}
    with caplog.at_level(logging.WARNING, logger="proxy"):
        async with app:
            for i in range(3):
                response = await post(app, clock, CHAT, body, at=T0 + i)
                assert response.status_code == 200
                assert response.content.endswith(b"data: [DONE]\n\n")
    assert all(line["outcome"] == "completed" and line["prompt_bytes"] is None
               and line["prefix_unchecked"] == "failed" for line in lines(log_file))
    assert registry.get_sample_value("llm_proxy_requests_total", {
        "route": CHAT, "model": "m", "upstream": UP, "stream": "true", "code": "200"}) == 3
    assert value(registry, "llm_proxy_prompt_prefix_unchecked_total", CHAT,
                 reason="failed") == 3
    warnings = [r for r in caplog.records if "prompt-cache doctor failed" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].exc_info is not None  # once, with its traceback


def test_the_threads_backlog_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    check = PrefixCheck()
    gate = threading.Event()
    try:
        futures = [check.submit(lambda: gate.wait(30) and None) for _ in range(MAX_PENDING)]
        assert all(f is not None for f in futures)
        with caplog.at_level(logging.WARNING, logger="proxy"):
            assert check.submit(lambda: None) is None  # one more is not examined
        assert "large prompts already wait" in caplog.text
        gate.set()
        for f in futures:
            assert f is not None
            f.result(30)
        assert check.submit(lambda: None) is not None  # room again
    finally:
        gate.set()
        check.close()


# ---------------------------------------------------------------------------
# Bounded: the place follows the parts and blocks, and a prompt past the cap is not examined


def body_bytes(body: dict[str, Any]) -> int:
    return len(json.dumps(body, separators=(",", ":")))


EMPTY_MESSAGES = {"model": "m", "messages": [{}] * 5000 + [{"role": "user", "content": "hi"}]}
HOSTILE: dict[str, tuple[dict[str, Any], Place]] = {
    "a short chat": (chat(("system", STABLE), ("user", "hi")), Place.INLINE),
    "a short chat with every setting": (
        chat(("user", "hi"), response_format={"type": "json_object"}, reasoning_effort="low",
             verbosity="low", service_tier="flex"), Place.INLINE),
    "Responses with its settings": (
        {"model": "m", "instructions": "x", "input": "hi", "previous_response_id": "r",
         "text": {"format": {"type": "text"}, "verbosity": "low"},
         "reasoning": {"effort": "low"}, "service_tier": "flex"}, Place.INLINE),
    "48 KB of text": (chat(("system", text(LARGE, "large")), ("user", "hi")), Place.THREAD),
    "5,000 empty messages in 16 KB": (EMPTY_MESSAGES, Place.THREAD),
    "5,000 empty tools": ({"model": "m", "tools": [{}] * 5000, "messages": []}, Place.THREAD),
    "5,000 content parts in one message": (
        chat(("user", [""] * 5000)), Place.THREAD),
    "a system prompt, then 5,000 content parts": (
        chat(("system", "be brief"), ("user", [""] * 5000)), Place.THREAD),
    "a message not an object, then 5,000 content parts": (
        {"model": "m", "messages": ["hi", {"role": "user", "content": [""] * 5000}]},
        Place.THREAD),
    "5,000 content parts in a tool result": (
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [""] * 5000}]}]},
        Place.THREAD),
    "8,000 token ids": ({"model": "m", "prompt": [1] * 8000}, Place.THREAD),
    "a token id, then 5,000 strings": ({"model": "m", "prompt": [1] + [""] * 5000},
                                       Place.THREAD),
    "200,000 tiny messages": (
        {"model": "m", "messages": [{"role": "user", "content": "x"}] * 200_000},
        Place.TOO_LARGE),
    "5 MB of text": (chat(("user", "x" * (5 << 20))), Place.TOO_LARGE),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_place_follows_parts_and_blocks_not_body_bytes(case: str) -> None:
    """Decided from the arrays' lengths and the body's bytes, before any part is built;
    every hostile body but the last two is under 16 KiB, which used to mean the loop."""
    body, place = HOSTILE[case]
    check = PrefixCheck()
    try:
        assert check.max_keys == 32_768  # the shared index's cap; an eighth of 64 MiB is more
        blocks = check.estimate(body, body_bytes(body))
        assert check.place(blocks) is place
        # never fewer blocks than the prompt has (the cap and the place rest on that)
        parts = DIALECTS[COMPLETIONS if "prompt" in body else CHAT].prompt_parts(body)
        if len(parts) < 10_000:
            hashed = check.doctor.hasher.hash(parts, upstream=UP, model="m")
            assert hashed is not None and len(hashed.chain) <= blocks
    finally:
        check.close()


async def test_a_prompt_past_the_key_cap_is_not_examined_and_evicts_nothing(
        tmp_path: Path) -> None:
    """A small index (1,000 entries' bytes, of which the hasher's part cache takes a
    share: a prompt may hold an eighth of what is left): a steady prompt, then a body of
    2,000 empty messages (4,000 keys, enough to push every entry out), then the steady
    prompt again, which still repeats whole."""
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = doctor_app(answers, clock, tmp_path,
                                         prefix_index_bytes=1000 * BYTES_PER_ENTRY)
    assert app.v1.prefix is not None
    capacity = app.v1.prefix.doctor.index.capacity  # type: ignore[attr-defined]
    assert 900 < capacity <= 1000 and app.v1.prefix.max_keys == capacity // 8
    steady = chat(("system", STABLE), ("user", "hi"))
    hostile = {"model": "m", "messages": [{}] * 2000 + [{"role": "user", "content": "hi"}]}
    async with app:
        await post(app, clock, CHAT, steady)
        assert (await post(app, clock, CHAT, hostile, at=T0 + 1)).status_code == 200
        await post(app, clock, CHAT, steady, at=T0 + 1.001)
    first, big, again = lines(log_file)
    assert first["prefix_break"] == "first_seen"
    assert big["prefix_unchecked"] == "too_large" and big["prompt_bytes"] is None
    assert big["outcome"] == "completed"
    assert again["prefix_break"] is None
    assert again["repeated_prefix_bytes"] == again["prompt_bytes"] == sum(sizes(CHAT, steady))
    assert value(registry, "llm_proxy_prompt_prefix_unchecked_total", CHAT,
                 reason="too_large") == 1


async def test_thousands_of_empty_messages_in_a_small_body_go_to_the_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock, answers = ScriptedClock(T0), Answers()
    app, _, log_file = doctor_app(answers, clock, tmp_path)
    check = app.v1.prefix
    assert check is not None
    examine = check.doctor.look
    threads: list[str] = []

    def where(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return examine(*args, **kwargs)

    monkeypatch.setattr(check.doctor, "look", where)
    assert body_bytes(EMPTY_MESSAGES) < 16 * 1024
    async with app:
        assert (await post(app, clock, CHAT, EMPTY_MESSAGES)).status_code == 200
    assert threads == ["prefix-doctor_0"]
    assert lines(log_file)[0]["prefix_break"] == "first_seen"


# ---------------------------------------------------------------------------
# Settings


def test_settings_and_their_checks(tmp_path: Path) -> None:
    s = Settings()  # on by default
    assert (s.prefix_doctor, s.prefix_window, s.prefix_index_bytes) == (True, 300.0, 64 << 20)
    env = {"LLM_PROXY_PREFIX_WINDOW": "90", "LLM_PROXY_PREFIX_DOCTOR": "false",
           "LLM_PROXY_PREFIX_INDEX_BYTES": "1000000"}
    s = from_sources(None, env)
    assert (s.prefix_doctor, s.prefix_window, s.prefix_index_bytes) == (False, 90.0, 1_000_000)
    config = tmp_path / "proxy.toml"
    config.write_text('prefix_doctor = false\n[[upstream]]\nname = "u"\n'
                      'url = "http://u:8000/v1"\ndefault = true\n')
    assert not from_sources(None, {"LLM_PROXY_CONFIG": str(config)}).prefix_doctor
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert not from_sources(parser.parse_args(["--no-prefix-doctor"]), {}).prefix_doctor
    assert "--prefix-doctor" in parser.format_help()
    for name, raw in (("PREFIX_WINDOW", "0"), ("PREFIX_WINDOW", "86401"),
                      ("PREFIX_INDEX_BYTES", str(BYTES_PER_ENTRY - 1))):
        with pytest.raises(SettingsError, match=f"LLM_PROXY_{name}"):
            from_sources(None, {f"LLM_PROXY_{name}": raw})
    doc = {"upstream": [{"name": "v", "url": "http://v:8000/v1", "default": True,
                         "min_cacheable_tokens": 16, "cache_granularity_tokens": 16}]}
    (spec,) = upstream_specs("p.toml", doc, upstream_limits(Settings()), {})
    assert (spec.min_cacheable_tokens, spec.cache_granularity_tokens) == (16, 16)
    for key, bad in (("min_cacheable_tokens", -1), ("cache_granularity_tokens", 0),
                     ("min_cacheable_tokens", "16")):
        table = {"name": "v", "url": "http://v:8000/v1", "default": True, key: bad}
        with pytest.raises(SettingsError, match=f"upstream 'v': {key}: must be an integer"):
            upstream_specs("p.toml", {"upstream": [table]}, upstream_limits(Settings()), {})


# ---------------------------------------------------------------------------
# What a missed cache cost


def test_missed_milliseconds_at_the_simulators_prefill_rate() -> None:
    config = SimConfig(prefill_rate=8_000.0, prefill_overhead=0.0)
    model = LatencyModel(config)
    prompt = text(16_000, "prefill")
    miss = model.plan(prompt)
    model.prefilled(miss)  # its first token out: its blocks cached for the next
    hit = model.plan(prompt)
    cached = hit.cached_tokens
    assert cached > 3000
    # Had the cache missed those tokens, the first token would have come this much later:
    # what the prefill fit's slope says (the missed cache's lever in `diagnose`).
    fit = PrefillFit(requests=3, status="fitted", ms_per_1k_tokens=1e6 / config.prefill_rate)
    assert fit.prefill_ms(cached) == pytest.approx(
        1000 * (miss.prefill_compute_s - hit.prefill_compute_s))
    assert PrefillFit(requests=3, status="fitted", ms_per_1k_tokens=100.0).prefill_ms(
        1664) == pytest.approx(166.4)


# ---------------------------------------------------------------------------
# Memory: distinct large prompts fill the index to its bound, never past it


def test_distinct_large_prompts_keep_the_index_under_its_bound() -> None:
    bound = 2 * 1024 * 1024
    check = PrefixCheck(index_bytes=bound)
    index = check.doctor.index
    assert isinstance(index.capacity, int)
    spec = UpstreamSpec(name=UP, url="http://u/v1")
    bodies = [{"model": "m", "messages": [{"role": "user", "content": text(32_768, f"d{i}")}]}
              for i in range(12)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        peaks = []
        for i in range(160):  # about 40 MB of distinct prompt text through a 2 MB index
            body = bodies[i % len(bodies)]
            body["model"] = f"m{i}"  # another scope: every block is new
            PrefixJob(check, DIALECTS[CHAT], body, spec, i, place=Place.INLINE).start()
            assert len(index) <= index.capacity  # type: ignore[attr-defined]
            peaks.append(tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert len(index) == index.capacity  # type: ignore[attr-defined]
    assert max(peaks[-40:]) <= bound  # the bound is a memory bound
    assert max(peaks[-40:]) - max(peaks[40:80]) < bound / 8  # flat once full


# ---------------------------------------------------------------------------
# Nothing of the prompt leaves the proxy


def windows(data: str | bytes, size: int = 8) -> set[bytes]:
    raw = data.encode() if isinstance(data, str) else data
    return {raw[i : i + size] for i in range(len(raw) - size + 1)}


async def test_no_prompt_text_in_metrics_log_spans_or_the_live_page(tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from tests.test_tracing import attrs, exported, receiving

    texts = [text(6000, "private-system"), text(900, "private-q1"), text(700, "private-a1"),
             text(400, "private-q2"), text(800, "private-tool"), text(300, "private-instr")]
    system, q1, a1, q2, tool, instructions = texts
    tools = [{"type": "function", "function": {"name": "lookup", "description": tool}}]
    turn1 = chat(("system", system), ("user", q1), tools=tools, stream=True)
    turn2 = chat(("system", system), ("user", q1), ("assistant", a1), ("user", q2),
                 tools=tools, stream=True)
    edited = chat(("system", system), ("user", q2), ("assistant", a1), ("user", q1),
                  tools=tools, stream=True)
    with receiving() as receiver:
        clock, answers = ScriptedClock(T0), Answers()
        app, registry, log_file = doctor_app(answers, clock, tmp_path,
                                             otlp_endpoint=receiver.url)
        for prompt, cached in ((2000, 0), (2400, 1024), (2400, 1500), (700, 0), (900, 0)):
            answers.queue(prompt, cached)
        async with app:
            await post(app, clock, CHAT, turn1)
            await post(app, clock, CHAT, turn2, at=T0 + 1)
            await post(app, clock, CHAT, edited, at=T0 + 2)
            await post(app, clock, RESPONSES, {"model": "m", "instructions": instructions,
                                               "input": q2, "stream": True}, at=T0 + 3)
            await post(app, clock, MESSAGES, {"model": "m", "max_tokens": 5, "system": system,
                                              "messages": [{"role": "user", "content": a1}]},
                       at=T0 + 4)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
                metrics = (await client.get("/metrics")).content
                openmetrics = (await client.get("/metrics", headers={
                    "accept": "application/openmetrics-text"})).content
                page = (await client.get("/ui/data")).content
            spans = await exported(app, receiver)
        with receiver.lock:
            otlp = b"".join(receiver.bodies)
    log = log_file.read_bytes()
    assert b"llm_proxy_prompt_prefix_breaks_total" in metrics
    # The live page reads the doctor's counter: the chat row's missed tokens are its value.
    table = json.loads(page)["table"]
    chat_rows = [row for row in table["rows"] if row["model"] == "m" and row["upstream"] == UP
                 and row.get("route", CHAT) == CHAT]
    missed_total = registry.get_sample_value(MISSED, {"route": CHAT, "model": "m",
                                                      "upstream": UP})
    assert table["missed_measured"] is True and missed_total
    assert [row["missed_tokens"] for row in chat_rows] == [missed_total]
    assert b'"prefix_break":"message_changed"' in log
    span_prefix = [attrs(span.attributes) for span in spans]
    assert len(spans) == 5
    assert any(a.get("llm_proxy.prefix.break_reason") == "message_changed" for a in span_prefix)
    assert any(a.get("llm_proxy.prefix.missed_tokens", 0) > 0 for a in span_prefix)
    secret = set().union(*(windows(t) for t in texts))
    for name, blob in (("metrics", metrics), ("openmetrics", openmetrics), ("log", log),
                       ("spans", otlp), ("live page", page)):
        leaked = secret & windows(blob)
        assert not leaked, f"{name} carries prompt text: {sorted(leaked)[:3]}"


# ---------------------------------------------------------------------------
# End to end: the official openai SDK, the proxy and the simulator, real servers


@pytest.fixture
def simulated() -> Iterator[tuple[Any, Any, CollectorRegistry, ProxyApp]]:
    from proxy.simulator.app import create_simulator_app
    from tests.servers import serve_in_thread

    config = SimConfig(cached_tokens_factor=0.5, prefill_overhead=0.0, itl=0.0, jitter=0.0,
                       output_tokens=3, output_dist="fixed", prefill_rate=1e6)
    sim_app = create_simulator_app(config)
    registry = CollectorRegistry()
    with serve_in_thread(sim_app) as sim:
        # vLLM-like: caches from one 16-token block, in blocks of 16 tokens.
        spec = UpstreamSpec(name="sim", url=sim.url + "/v1", models=("*",), default=True,
                            min_cacheable_tokens=16, cache_granularity_tokens=16)
        proxy_app = create_app(Settings(upstreams=(spec,), prefix_doctor=True), registry=registry)
        with serve_in_thread(proxy_app) as proxy:
            yield sim_app, proxy, registry, proxy_app


@pytest.mark.e2e
def test_the_sdk_through_the_proxy_counts_what_the_simulator_under_reports(
        simulated: tuple[Any, Any, CollectorRegistry, ProxyApp]) -> None:
    from openai import OpenAI

    sim_app, proxy, registry, _ = simulated
    client = OpenAI(base_url=proxy.url + "/v1", api_key="sk-test-not-a-key", max_retries=0)
    messages: list[Any] = [{"role": "system", "content": text(7000, "sdk-system")},
                           {"role": "user", "content": "What is in it?"}]
    reported = []
    for _ in range(2):
        stream = client.chat.completions.create(
            model="sim-llm", messages=messages, stream=True,
            stream_options={"include_usage": True})
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert len(usage) == 1 and usage[0].prompt_tokens_details is not None
        reported.append(usage[0].prompt_tokens_details.cached_tokens or 0)
    labels = {"route": CHAT, "model": "sim-llm", "upstream": "sim"}
    wait = dict(labels, stream="true", code="200")
    wait_recorded_labels(registry, wait)
    cached = sim_app.state.model.cached_tokens_total  # what the simulator really served
    assert reported[0] == 0 and cached > 1500
    assert reported[1] == math.floor(cached * 0.5)  # it under-reports by half
    assert registry.get_sample_value(MISSED, labels) == cached - reported[1]
    assert registry.get_sample_value(BREAKS, {**labels, "reason": "first_seen",
                                              "part": "none"}) == 1


def wait_recorded_labels(registry: CollectorRegistry, labels: dict[str, str]) -> None:
    """The SDK stops at ``[DONE]``; the proxy records a moment later: wait (bounded)."""
    flag = threading.Event()
    for _ in range(1000):
        if registry.get_sample_value("llm_proxy_requests_total", labels) == 2:
            return
        flag.wait(0.005)  # polling the registry, not timing anything
    raise AssertionError("the proxy never recorded both requests")


def test_the_offload_benchmark_runs() -> None:
    """benchmarks/prefix_offload.py, smoke run: one size on each side of the threshold."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "benchmarks/prefix_offload.py", "--quick", "--sizes", "2048,20000"],
        cwd=root, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 2")]
    assert len(rows) == 2 and all(line.count(" us ") == 4 for line in rows), out
    out = subprocess.run(
        [sys.executable, "benchmarks/prefix_offload.py", "--quick", "--hostile"],
        cwd=root, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line for line in out.splitlines() if line.count(" us ") == 3]
    assert len(rows) == 6, out


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_the_streaming_benchmark_sends_prompts_of_a_given_size(api: str) -> None:
    """benchmarks/run.py --prompt-bytes N: loadgen's user message is N bytes, every API."""
    import importlib.util
    import sys

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("bench_loadgen", root / "benchmarks" / "loadgen.py")
    assert spec is not None and spec.loader is not None
    loadgen = importlib.util.module_from_spec(spec)
    sys.modules["bench_loadgen"] = loadgen  # its dataclasses look their module up
    spec.loader.exec_module(loadgen)
    config = loadgen.LoadConfig(url="http://127.0.0.1:1/v1", api=api, prompt_bytes=32768)
    _, _, raw = loadgen._request_bytes(config)
    body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    prompt = body["input"] if api == "responses" else body["messages"][0]["content"]
    assert len(prompt.encode()) == 32768
    plain = loadgen._request_bytes(loadgen.LoadConfig(url="http://127.0.0.1:1/v1", api=api))[2]
    assert b'"benchmark"' in plain
