"""The workload capture (``serve --workload-file``, proxy/workload_capture.py) through the whole proxy.

The proxy runs in process in front of the suite's scripted upstream (a real loopback
server, so the production upstream client runs); the upstream counts each prompt's
tokens from the request body by a rule the test knows, and says them in its usage, so
every line's lengths and every pair of prompts' shared token blocks are known exactly:

* *exact* tokens: four characters of message content a token, nothing else;
* *template* tokens: the same, plus four tokens per message (a chat template's role
  markers, which have no bytes in the prompt the doctor hashes), so that two requests'
  bytes-per-token ratios differ as they do with a real tokenizer.

The property test generates conversations behind shared system prompts, growing turn
by turn, interleaved, some streamed, some repeated, over two models, and compares the
trace's leading shared ``hash_ids`` of every pair of requests with a brute-force
comparison of their token blocks: equal with exact tokens; with template tokens within
one block (the byte position of a token is estimated at the request's own ratio).
Also: lengths are the usage, timestamps are arrivals, no 8 characters of any prompt
are in the file, requests without usage are counted and not written, the client label
only when asked for, rotation by size and by age, a full buffer drops and counts,
SIGTERM to a real ``serve`` loses no line, ``serve --workers 2`` writes one file per
worker with one id namespace that ``bench --workload-file`` and ``workload merge`` read, and the
demo writes a trace that ``bench --workload-file`` replays.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings, from_sources
from proxy.config_values import SettingsError
from proxy.measure import Outcome, RequestRecord
from proxy.workload_capture import PrefixKeys, Shared, WorkloadCapture
from proxy.workload_file import WorkloadRecord, load, read_segments
from tests.fake_upstream import (
    Conn,
    Gate,
    RawUpstream,
    ScriptedUpstream,
    completion_json,
    content_event,
    stream_events,
)
from tests.servers import ROOT, proxy_process
from tests.test_reqlog import SlowDisk
from tests.upstream_fakes import InProcess

pytestmark = pytest.mark.anyio

WAIT_S = 30.0
CHAT = "/v1/chat/completions"
SSE = {"content-type": "text/event-stream"}
LETTERS = "bcdfghjklmnpqrstvwxz"  # no vowels: no word of a trace line is in a prompt
SKIPPED = "llm_proxy_trace_skipped_requests_total"


# ---------------------------------------------------------------------------
# The upstream: usage from a token rule the test knows


def tokens_of(messages: Sequence[dict[str, Any]], template: bool) -> list[Hashable]:
    """A prompt's tokens: four characters of content each, and with ``template`` four
    role-marker tokens before each message."""
    out: list[Hashable] = []
    for message in messages:
        if template:
            out += [("<|start|>", message["role"], k) for k in range(4)]
        content = message["content"]
        out += [content[i : i + 4] for i in range(0, len(content), 4)]
    return out


class Counting:
    """Answers every chat request with usage from :func:`tokens_of` (as a stream when
    asked for, its usage when the proxy asks for it), a completion length that cycles
    1..7, and cached tokens that cycle too; keeps what it said, in order."""

    def __init__(self, template: bool = False) -> None:
        self.template = template
        self.said: list[tuple[int, int, int]] = []  # (prompt, completion, cached)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompt = len(tokens_of(body["messages"], self.template))
        completion = 1 + len(self.said) % 7
        cached = prompt // 2 if len(self.said) % 3 else 0
        self.said.append((prompt, completion, cached))
        if body.get("stream") is True:
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = stream_events(completion, usage=usage, prompt=prompt, cached=cached)
            return httpx.Response(200, headers=SSE, content=b"".join(events))
        return httpx.Response(200, json=completion_json("ok", prompt=prompt,
                                                        completion=completion, cached=cached))


def proxy_app(handler: Any, trace: Path, **overrides: Any
              ) -> tuple[InProcess, CollectorRegistry]:
    upstream = ScriptedUpstream(handler)
    registry = CollectorRegistry()
    app = create_app(Settings(upstream=upstream.url + "/v1", upstream_name="up",
                              prefix_doctor=True, workload_file=str(trace), **overrides),
                     registry=registry)
    return InProcess(app, upstream), registry


async def send_all(app: Any, bodies: Sequence[dict[str, Any]],
                   headers: dict[str, str] | None = None) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as client:
        for body in bodies:
            response = await client.post(CHAT, json=body, headers=headers)
            assert response.status_code == 200, response.text


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------
# Workloads: conversations behind shared system prompts


def text(tokens: int, tag: int, rng: random.Random) -> str:
    """``tokens`` four-character tokens: a tag unique to this text first (two texts
    differ in their first token), then random letters and spaces."""
    head = "".join(LETTERS[tag // len(LETTERS) ** k % len(LETTERS)] for k in range(4))
    body = "".join(rng.choice(LETTERS + " ") for _ in range(4 * (tokens - 1)))
    return head + body


@st.composite
def workloads(draw: st.DrawFn, block_sizes: Sequence[int]) -> tuple[int, list[dict[str, Any]]]:
    """(block size, request bodies): 1-5 conversations, each behind one of 1-3 shared
    system prompts (or none) on one of two models, 1-4 turns, each turn's prompt its
    previous one with the answer and a new question; turns interleaved, some streamed,
    now and then a request sent twice."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    tags = iter(range(len(LETTERS) ** 4))
    block = draw(st.sampled_from(block_sizes))
    systems = [text(draw(st.integers(1, 600)), next(tags), rng)
               for _ in range(draw(st.integers(1, 3)))]
    conversations = []
    for _ in range(draw(st.integers(1, 5))):
        which = draw(st.integers(-1, len(systems) - 1))
        model = draw(st.sampled_from(["m", "n"]))
        head = [{"role": "system", "content": systems[which]}] if which >= 0 else []
        turns = []
        history = list(head)
        for _ in range(draw(st.integers(1, 4))):
            history = [*history, {"role": "user",
                                  "content": text(draw(st.integers(1, 300)), next(tags), rng)}]
            turns.append({"model": model, "messages": history,
                          "stream": draw(st.booleans())})
            history = [*history, {"role": "assistant",
                                  "content": text(draw(st.integers(1, 200)), next(tags), rng)}]
        conversations.append(turns)
    order = [c for c, turns in enumerate(conversations) for _ in turns]
    rng.shuffle(order)
    bodies = []
    for c in order:
        bodies.append(conversations[c].pop(0))
        if draw(st.integers(0, 9)) == 0:
            bodies.append(bodies[-1])  # a retry: the same request again
    return block, bodies


def blocks(tokens: Sequence[Hashable], size: int) -> list[tuple[Hashable, ...]]:
    return [tuple(tokens[i : i + size]) for i in range(0, len(tokens), size)]


def shared_blocks(a: Sequence[Hashable], b: Sequence[Hashable], size: int) -> int:
    """Brute force: how many leading token blocks two prompts have equal (a partial last
    block is equal only to the same partial block)."""
    n = 0
    for x, y in zip(blocks(a, size), blocks(b, size), strict=False):
        if x != y:
            break
        n += 1
    return n


def leading_equal(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def capture_workload(bodies: list[dict[str, Any]], block: int, template: bool,
                           folder: Path) -> tuple[Path, Counting]:
    counting = Counting(template)
    trace = folder / "trace.jsonl"
    app, _ = proxy_app(counting, trace, workload_block_size=block)
    async with app:
        await send_all(app, bodies)
    return trace, counting


def check_trace(trace: Path, bodies: list[dict[str, Any]], counting: Counting, block: int,
                *, slack: int) -> None:
    raw = lines(trace)
    assert len(raw) == len(bodies)
    stamps = [line["timestamp"] for line in raw]
    assert stamps == sorted(stamps)  # sent one after another: arrivals in order
    records = load([str(trace)]).records
    assert [r.timestamp for r in records] == stamps
    for record, (prompt, completion, cached), body in zip(
            records, counting.said, bodies, strict=True):
        assert (record.input_length, record.output_length) == (prompt, completion)
        assert record.cached_tokens == cached
        assert record.model == body["model"] and record.route == CHAT
        assert record.upstream == "up" and record.outcome == "completed"
        assert record.client is None
        assert len(record.hash_ids) == -(-prompt // block)
    tokens = [tokens_of(body["messages"], counting.template) for body in bodies]
    for i in range(len(bodies)):
        for j in range(i + 1, len(bodies)):
            expected = (shared_blocks(tokens[i], tokens[j], block)
                        if bodies[i]["model"] == bodies[j]["model"] else 0)
            got = leading_equal(records[i].hash_ids, records[j].hash_ids)
            assert abs(got - expected) <= slack, (i, j, got, expected)
            if bodies[i]["model"] != bodies[j]["model"]:
                assert not set(records[i].hash_ids) & set(records[j].hash_ids)
    # Not eight characters of any prompt in the file.
    written = trace.read_text()
    seen = {written[k : k + 8] for k in range(len(written) - 7)}
    for body in bodies:
        for message in body["messages"]:
            content = message["content"]
            assert not seen & {content[k : k + 8] for k in range(len(content) - 7)}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(block_sizes=[16, 32, 64, 128]))
def test_hash_ids_share_exactly_the_blocks_the_prompts_share(
        workload: tuple[int, list[dict[str, Any]]]) -> None:
    block, bodies = workload
    with tempfile.TemporaryDirectory() as folder:
        trace, counting = asyncio.run(capture_workload(bodies, block, False, Path(folder)))
        check_trace(trace, bodies, counting, block, slack=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(block_sizes=[64, 128, 512]))
def test_with_a_chat_templates_tokens_the_ids_stay_within_one_block(
        workload: tuple[int, list[dict[str, Any]]]) -> None:
    """Four tokens per message that the doctor's bytes do not hold: requests' ratios
    differ, and the shared ids still follow the shared blocks, at most one block off
    where a shared prefix ends (never a hole that stops the sharing early)."""
    block, bodies = workload
    with tempfile.TemporaryDirectory() as folder:
        trace, counting = asyncio.run(capture_workload(bodies, block, True, Path(folder)))
        check_trace(trace, bodies, counting, block, slack=1)


def conversation(turns: int, *, tokens: int = 300) -> list[dict[str, Any]]:
    rng = random.Random(turns)
    system = {"role": "system", "content": text(2000, 1, rng)}
    history: list[dict[str, Any]] = [system]
    bodies = []
    for t in range(turns):
        history = [*history, {"role": "user", "content": text(tokens, 10 + 2 * t, rng)}]
        bodies.append({"model": "m", "messages": history})
        history = [*history, {"role": "assistant", "content": text(tokens, 11 + 2 * t, rng)}]
    return bodies


async def test_a_growing_conversation_keeps_its_ids_whole_under_a_template(
        tmp_path: Path) -> None:
    """Each turn repeats the previous one whole: every full block of turn n is shared
    with turn n+1, with template tokens too (where mapping each request's blocks by its
    own ratio alone leaves holes)."""
    bodies = conversation(8)
    trace, _ = await capture_workload(bodies, 64, True, tmp_path)
    records = load([str(trace)]).records
    for before, after in itertools.pairwise(records):
        full = before.input_length // 64
        assert after.hash_ids[:full] == before.hash_ids[:full]


# ---------------------------------------------------------------------------
# What is and is not in a line


async def test_an_image_after_a_shared_prefix_shares_ids_only_as_far_as_the_text(
        tmp_path: Path) -> None:
    """The same system prompt (600 tokens), then a question and an image of 765 tokens of
    their own: the ids are shared for the system prompt's 9 whole blocks of 64 tokens.
    Placed at the prompt's own bytes per token, where the image's tokens follow no bytes
    (it enters the prompt as a short hash), the text's blocks were squeezed and 17 ids
    claimed to be shared: a replay read twice the cache the upstream could give."""
    rng = random.Random(7)
    system = text(600, 1, rng)  # 2,400 characters: 600 tokens of 4

    async def counting(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompt = 0
        for message in body["messages"]:
            content = message["content"]
            for part in ([{"type": "text", "text": content}] if isinstance(content, str)
                         else content):
                prompt += len(part["text"]) // 4 if part["type"] == "text" else 765
        events = stream_events(3, usage=True, prompt=prompt, cached=0)
        return httpx.Response(200, headers=SSE, content=b"".join(events))

    def asked(question: str, image: str) -> dict[str, Any]:
        return {"model": "m", "stream": True, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [
                {"type": "text", "text": question},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}}]}]}

    trace = tmp_path / "trace.jsonl"
    app, _ = proxy_app(counting, trace, workload_block_size=64)
    async with app:
        await send_all(app, [asked("What is in the picture?", "iVBORw0KGgo" * 40),
                             asked("And in this one?", "R0lGODlhAQ" * 40)])
    first, second = lines(trace)
    assert first["input_length"] == 600 + 5 + 765
    assert leading_equal(first["hash_ids"], second["hash_ids"]) == 9


async def test_requests_without_usage_are_counted_not_written(tmp_path: Path) -> None:
    """With --no-inject-usage a stream that did not ask for usage has none: no line (its
    prompt tokens would be an estimate), counted; one that asked gets its line."""
    trace = tmp_path / "trace.jsonl"
    app, registry = proxy_app(Counting(), trace, inject_usage=False)
    body = {"model": "m", "messages": [{"role": "user", "content": "abcd" * 40}],
            "stream": True}
    asked = {**body, "stream_options": {"include_usage": True}}
    async with app:
        await send_all(app, [body, asked, body])
    (line,) = lines(trace)
    assert line["input_length"] == 40 and line["output_length"] == 2
    assert registry.get_sample_value(SKIPPED, {"reason": "no_usage"}) == 2
    assert registry.get_sample_value(SKIPPED, {"reason": "dropped"}) == 0


async def test_a_stream_cut_short_before_its_usage_is_counted_as_incomplete(
        tmp_path: Path) -> None:
    """A stream that broke (here the upstream's body ends after two tokens, with neither
    a finish nor its usage; a client that leaves is the same): no line, counted as
    incomplete. It was counted as no_usage, which says the upstream reports none."""
    async def broken(request: httpx.Request) -> httpx.Response:
        cut = content_event("a") + content_event("b")
        return httpx.Response(200, headers=SSE, content=cut)

    trace = tmp_path / "trace.jsonl"
    app, registry = proxy_app(broken, trace)
    body = {"model": "m", "messages": [{"role": "user", "content": "abcd" * 40}],
            "stream": True}
    async with app:
        await send_all(app, [body])
    assert not trace.read_text()
    assert registry.get_sample_value(SKIPPED, {"reason": "incomplete"}) == 1
    assert registry.get_sample_value(SKIPPED, {"reason": "no_usage"}) == 0


async def test_answers_that_are_not_2xx_are_not_traffic_to_replay(tmp_path: Path) -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"message": "slow down"}})

    trace = tmp_path / "trace.jsonl"
    app, registry = proxy_app(refuse, trace)
    transport = httpx.ASGITransport(app=app)
    async with app, httpx.AsyncClient(transport=transport, base_url="http://p") as client:
        response = await client.post(CHAT, json={"model": "m", "messages": []})
        assert response.status_code == 429
    assert trace.read_text() == ""
    assert registry.get_sample_value(SKIPPED, {"reason": "no_usage"}) == 0


@pytest.mark.parametrize("asked", [False, True])
async def test_the_client_label_only_when_asked_for(asked: bool, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    app, _ = proxy_app(Counting(), trace, client_label_from="header:x-team",
                       workload_client=asked)
    body = {"model": "m", "messages": [{"role": "user", "content": "abcd" * 10}],
            "stream": True}
    async with app:
        await send_all(app, [body], headers={"x-team": "search"})
    (line,) = lines(trace)
    assert ("client" in line) is asked
    if asked:
        assert line["client"] == "search"
    assert line["ttft_ms"] >= 0  # a stream: its time to first token


DOCTOR: dict[str, str] = {}  # the doctor, which capture needs, is on by default


def test_settings_that_cannot_capture_are_refused(tmp_path: Path) -> None:
    trace = str(tmp_path / "t.jsonl")
    for flags, message in [
        ({"LLM_PROXY_PREFIX_DOCTOR": "false"},  # turned off, said as it was
         r"prompt-cache doctor.*turned off \(LLM_PROXY_PREFIX_DOCTOR=false\)"),
        ({"LLM_PROXY_MEASURE": "false"}, "--no-measure"),
        ({"LLM_PROXY_WORKLOAD_CLIENT": "true"}, "no client label"),
        ({"LLM_PROXY_LOG_REQUESTS": trace}, "same file"),
    ]:
        with pytest.raises(SettingsError, match=message):
            from_sources(environ={"LLM_PROXY_WORKLOAD_FILE": trace, **DOCTOR, **flags})
    with pytest.raises(SettingsError, match="no such directory"):
        from_sources(environ={"LLM_PROXY_WORKLOAD_FILE": str(tmp_path / "nope" / "t.jsonl"),
                              **DOCTOR})
    with pytest.raises(SettingsError, match="only used with"):
        from_sources(environ={"LLM_PROXY_WORKLOAD_CLIENT": "true"})
    with pytest.raises(SettingsError, match="standard output"):
        from_sources(environ={"LLM_PROXY_WORKLOAD_FILE": "-", **DOCTOR})
    with pytest.raises(SettingsError, match=">= 0"):
        from_sources(environ={"LLM_PROXY_WORKLOAD_FILE": trace, **DOCTOR,
                              "LLM_PROXY_WORKLOAD_ROTATE_SECONDS": "-1"})
    with pytest.raises(SettingsError, match=r"cannot write .*Is a directory"):
        create_app(Settings(prefix_doctor=True, workload_file=str(tmp_path)),
                   registry=CollectorRegistry())
    ok = from_sources(environ={"LLM_PROXY_WORKLOAD_FILE": trace, **DOCTOR,
                               "LLM_PROXY_WORKLOAD_BLOCK_SIZE": "64",
                               "LLM_PROXY_WORKLOAD_ROTATE_BYTES": "1000000"})
    assert (ok.workload_block_size, ok.workload_rotate_bytes) == (64, 1_000_000)
    alone = from_sources(environ={"LLM_PROXY_WORKLOAD_FILE": trace})  # no other setting needed
    assert alone.workload_file == trace and alone.prefix_doctor


# ---------------------------------------------------------------------------
# Rotation, buffer


async def test_rotation_by_size_continues_one_trace_in_numbered_files(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    (tmp_path / "trace.jsonl.2").write_text("")  # a number in use is skipped
    bodies = conversation(12, tokens=60)
    app, _ = proxy_app(Counting(), trace, workload_block_size=64, workload_rotate_bytes=600)
    async with app:
        await send_all(app, bodies)
    check_rotated(tmp_path, len(bodies))


async def test_a_capture_started_on_a_file_that_holds_one_continues_beside_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A restart with the same --workload-file: the earlier capture's file is left as it
    was, and the new capture (its own id space, its own start) is written to the first
    free FILE.N and said so. Appended to the file, its ids began at 0 again and its
    timestamps went back: a reader that takes a file as one workload (AIPerf, Dynamo's
    mocker) read two prompts as one prefix."""
    trace = tmp_path / "trace.jsonl"
    first = conversation(3, tokens=60)
    app, _ = proxy_app(Counting(), trace, workload_block_size=64)
    async with app:
        await send_all(app, first)
    before = trace.read_bytes()
    (tmp_path / "trace.jsonl.1").write_text("")  # a number in use is skipped
    with caplog.at_level(logging.WARNING, logger="proxy.workload"):
        app, _ = proxy_app(Counting(), trace, workload_block_size=64)
        async with app:
            await send_all(app, conversation(2, tokens=60))
    assert trace.read_bytes() == before
    (segment,) = read_segments(str(trace))
    (again,) = read_segments(str(tmp_path / "trace.jsonl.2"))
    assert len(segment.records) == 3 and len(again.records) == 2
    assert segment.meta.workload_id != again.meta.workload_id
    assert "trace.jsonl.2" in caplog.text


def check_rotated(tmp_path: Path, requests: int) -> None:
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[:3] == ["trace.jsonl", "trace.jsonl.1", "trace.jsonl.2"]
    assert "trace.jsonl.3" in names
    assert (tmp_path / "trace.jsonl.2").read_text() == ""
    files = [p for p in tmp_path.iterdir() if p.stat().st_size]
    ids = set()
    for path in files:
        (segment,) = read_segments(str(path))  # metadata on each file's first line
        assert segment.meta.block_size == 64 and segment.meta.start is not None
        ids.add(segment.meta.workload_id)
    assert len(ids) == 1  # one trace: one id namespace, one start
    whole = load([str(tmp_path / "trace.jsonl*")])
    assert len(whole.records) == requests and len(set(whole.namespaces)) == 1
    records = whole.records
    for before, after in itertools.pairwise(records):  # shared across files
        full = before.input_length // 64
        assert after.hash_ids[:full] == before.hash_ids[:full]


def record(prompt: int = 100) -> RequestRecord:
    return RequestRecord(request_id="r", route=CHAT, model="m", upstream="up", stream=True,
                         status=200, outcome=Outcome.COMPLETED, duration_s=0.1,
                         prompt_tokens=prompt, completion_tokens=5)


def test_rotation_by_age(tmp_path: Path) -> None:
    now = [0.0]
    capture = WorkloadCapture(str(tmp_path / "t.jsonl"), rotate_seconds=60.0,
                      monotonic=lambda: now[0])
    for at in (0.0, 30.0, 61.0, 90.0, 130.0):
        now[0] = at
        capture.add(record(), 1.0, "m", None)
        deadline = time.monotonic() + WAIT_S
        while capture.lines < [0.0, 30.0, 61.0, 90.0, 130.0].index(at) + 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)  # waiting for the writer thread's count, not timing it
    capture.close()
    sizes = {p.name: len(p.read_text().splitlines()) for p in tmp_path.iterdir()}
    # 0 and 30 s; 61 s is 61 s after the file's first line: a new file, whose first line
    # at 61 s makes 130 s the next file's
    assert sizes == {"t.jsonl": 2, "t.jsonl.1": 2, "t.jsonl.2": 1}


def test_a_full_buffer_drops_and_counts(tmp_path: Path) -> None:
    disk = SlowDisk(tmp_path / "trace.fifo")
    counted: list[tuple[str, int]] = []
    try:
        capture = WorkloadCapture(str(disk.path), buffer=4,
                          skipped=lambda reason, n: counted.append((reason, n)))
        for _ in range(200):  # far more than the pipe and the buffer hold
            capture.add(record(), 1.0, "m", None)
        assert not disk.read_early, "add() waited for the file"
        disk.start_reading()
        capture.close()
        written = len(disk.lines())
    finally:
        disk.close()
    dropped = sum(n for reason, n in counted if reason == "dropped")
    assert dropped > 0 and written + dropped == 200


def test_prompt_keys_waiting_for_the_disk_are_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond MAX_PENDING_KEYS prompt keys waiting for the writer, a line is dropped and
    counted, whatever room the buffer has; once the disk takes lines, the keys written
    make room again."""
    from types import SimpleNamespace

    from proxy import workload_capture as capture_module
    from proxy.dialects import PromptPart
    from proxy.doctor.keys import PromptHasher

    hashed = PromptHasher().hash([PromptPart("prompt", 0, "", b"x" * 2560)],
                                 upstream="u", model="m")
    assert hashed is not None and len(hashed.keys) == 14  # 10 blocks, 1 chunk, the scope's 3
    job: Any = SimpleNamespace(hashed=hashed)
    monkeypatch.setattr(capture_module, "MAX_PENDING_KEYS", 70)
    disk = SlowDisk(tmp_path / "trace.fifo")
    counted: list[tuple[str, int]] = []
    try:
        capture = WorkloadCapture(str(disk.path), skipped=lambda reason, n: counted.append((reason, n)))
        for _ in range(50):
            capture.add(record(), 1.0, "m", job)
        dropped = sum(n for reason, n in counted if reason == "dropped")
        assert 0 < dropped <= 45  # five fit (more if the thread took some meanwhile)
        disk.start_reading()
        deadline = time.monotonic() + WAIT_S
        while capture.lines < 50 - dropped:
            assert time.monotonic() < deadline
            time.sleep(0.001)  # waiting for the writer thread's count, not timing it
        capture.add(record(), 1.0, "m", job)  # room again
        capture.close()
        written = len(disk.lines())
    finally:
        disk.close()
    assert written == 51 - dropped


def test_prefix_keys_are_bounded() -> None:
    from proxy.dialects import PromptPart
    from proxy.doctor.keys import PromptHasher

    keys = PrefixKeys(16, capacity=50)
    hasher = PromptHasher()
    for i in range(40):
        hashed = hasher.hash([PromptPart("prompt", 0, "", b"%04d" % i * 500)],
                             upstream="u", model="m")
        assert hashed is not None
        keys(hashed, 500)
        assert len(keys) <= 50


# ---------------------------------------------------------------------------
# Real processes: SIGTERM, workers, the demo


async def test_sigterm_writes_every_buffered_line_before_exit(tmp_path: Path) -> None:
    """``serve`` in a real process, its trace a file that takes nothing until after
    SIGTERM: the lines of the requests answered before, and of the stream that finishes
    during the drain, are all written before the process exits."""
    disk = SlowDisk(tmp_path / "trace.fifo")
    gate = Gate()
    events = stream_events(3, usage=True, prompt=12)

    async def held(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(events[0])
        await gate.wait(WAIT_S)
        for event in events[1:]:
            await conn.chunk(event)
        await conn.end()

    upstream = RawUpstream({"held": held})
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    try:
        with upstream.running():
            async with proxy_process(upstream.url, "--prefix-doctor", "--workload-file", str(disk.path),
                                     "--graceful-timeout", "20") as (proc, port, out):
                base = f"http://127.0.0.1:{port}"
                async with httpx.AsyncClient(timeout=WAIT_S) as client:
                    for _ in range(30):
                        r = await client.post(base + CHAT, content=body)
                        assert r.status_code == 200
                    held_body = json.dumps({"model": "held", "stream": True, "messages": [
                        {"role": "user", "content": "hold on"}]})
                    async with client.stream("POST", base + CHAT, content=held_body) as stream:
                        chunks = stream.aiter_raw()
                        await anext(chunks)  # the first event: the stream is in flight
                        proc.send_signal(signal.SIGTERM)
                        gate.open()
                        async for _ in chunks:
                            pass
                await disk.exit_waits_for_it(proc, out)
        written = await anyio.to_thread.run_sync(disk.lines)
    finally:
        disk.close()
    assert len(written) == 31
    assert [line["model"] for line in written] == ["m"] * 30 + ["held"]
    assert written[-1]["input_length"] == 12 and written[-1]["output_length"] == 3
    assert written[0]["input_length"] == 3  # normal's usage


def _run(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return subprocess.run([sys.executable, "-m", "proxy", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def behind_one_system_prompt(conversations: int) -> list[list[dict[str, Any]]]:
    """Conversations behind one system prompt of 2,000 tokens, 3 to 5 turns each, each
    with its own message length (so every prompt has a length of its own)."""
    rng = random.Random(7)
    system = {"role": "system", "content": text(2000, 1, rng)}
    out = []
    for c in range(conversations):
        history: list[dict[str, Any]] = [system]
        turns = []
        for t in range(3 + c % 3):
            history = [*history, {"role": "user",
                                  "content": text(100 + 10 * c, 100 * c + 2 * t + 2, rng)}]
            turns.append({"model": "m", "messages": history})
            history = [*history, {"role": "assistant",
                                  "content": text(100 + 10 * c, 100 * c + 2 * t + 3, rng)}]
        out.append(turns)
    return out


@pytest.mark.e2e
def test_workers_write_one_file_each_in_one_id_namespace(tmp_path: Path) -> None:
    """``serve --workers 2``: a file per worker; a conversation whose turns went to
    different workers shares its ids across the files (one hashing secret, one trace
    id, the keys' digests as ids); ``workload merge`` and ``bench --workload-file`` read them."""
    counting = Counting()
    trace = tmp_path / "trace.jsonl"
    conversations = behind_one_system_prompt(4)
    bodies = [body for turns in conversations for body in turns]
    with ScriptedUpstream(counting).running() as upstream:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--upstream", upstream.url + "/v1",
             "--port", "0", "--workers", "2", "--prefix-doctor", "--workload-file", str(trace),
             "--workload-block-size", "64"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output: list[str] = []
        ready = threading.Event()
        port: list[int] = []

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                output.append(line)
                m = re.search(r"Uvicorn running on http://[\d.]+:(\d+)", line)
                if m:
                    port.append(int(m[1]))
                if sum("Application startup complete" in x for x in output) == 2:
                    ready.set()
            ready.set()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            assert ready.wait(WAIT_S) and port, "".join(output)
            url = f"http://127.0.0.1:{port[0]}"
            with httpx.Client(base_url=url, timeout=WAIT_S) as client:
                for body in bodies:  # a new connection each: spread over both workers
                    r = client.post(CHAT, json=body, headers={"connection": "close"})
                    assert r.status_code == 200, r.text
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(WAIT_S)
            reader.join(5)
            assert proc.stdout is not None
            proc.stdout.close()
        assert code == 0, "".join(output)
    files = sorted(tmp_path.glob("trace.jsonl.*"))
    assert len(files) == 2 and not trace.exists(), "".join(output)
    per_file = [len(p.read_text().splitlines()) for p in files]
    assert sum(per_file) == len(bodies) and min(per_file) > 0  # both workers served
    metas = {read_segments(str(p))[0].meta for p in files}
    assert len({m.workload_id for m in metas}) == 1 and len({m.start for m in metas}) == 1
    whole = load([str(tmp_path / "trace.jsonl.*")])
    assert len(set(whole.namespaces)) == 1
    lengths = [prompt for prompt, _, _ in counting.said]
    check_conversations(whole.records, conversations, lengths)

    merged = tmp_path / "merged.jsonl"
    done = _run("workload", "merge", str(tmp_path / "trace.jsonl.*"), "-o", str(merged))
    assert done.returncode == 0, done.stderr
    small = load([str(merged)]).records
    assert max(i for r in small for i in r.hash_ids) < 10_000  # small ids again
    check_conversations(small, conversations, lengths)
    replay = tmp_path / "replay.json"
    done = _run("bench", "--workload-file", str(tmp_path / "trace.jsonl.*"), "--speedup", "20",
                "--simulate", "--slots 8", "--json", str(replay), "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(json.loads(replay.read_text())["replay"]["scheduled_s"]) == len(bodies)


def check_conversations(records: Sequence[WorkloadRecord],
                        conversations: list[list[dict[str, Any]]], lengths: list[int]) -> None:
    """Every request holds the system prompt's 31 full blocks' ids, and each turn the
    previous turn's full blocks: found by prompt length (``lengths``, in send order)."""
    assert len(set(lengths)) == len(lengths)
    by_length = {r.input_length: r for r in records}
    system = by_length[lengths[0]].hash_ids[: 2000 // 64]
    sent = iter(lengths)
    for turns in conversations:
        previous: WorkloadRecord | None = None
        for _ in turns:
            now = by_length[next(sent)]
            assert now.hash_ids[: len(system)] == system
            if previous is not None:
                full = previous.input_length // 64
                assert now.hash_ids[:full] == previous.hash_ids[:full]
                if previous.input_length % 64:  # its partial last block: not the same
                    assert now.hash_ids[full] != previous.hash_ids[full]
            previous = now


@pytest.mark.e2e
def test_the_demo_writes_a_trace_that_bench_replays(tmp_path: Path) -> None:
    trace = tmp_path / "demo.jsonl"
    done = _run("demo", "--port", "0", "--duration", "4", "--rate", "6", "--burst-every", "2",
                "--burst-size", "4", "--workload-file", str(trace), "--workload-block-size", "64")
    assert done.returncode == 0, done.stderr
    assert f"demo: workload capture to {trace}" in done.stdout
    records = load([str(trace)]).records
    assert len(records) >= 10
    assert {r.route for r in records} >= {"/v1/chat/completions"}
    # Shared system prompts: some ids in more than one request.
    assert len({i for r in records for i in r.hash_ids}) < sum(len(r.hash_ids) for r in records)
    replay = tmp_path / "replay.json"
    done = _run("bench", "--workload-file", str(trace), "--speedup", "4", "--simulate",
                "--slots 8 --prefill-rate 6000 --itl 0.025", "--json", str(replay),
                "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the replay beside the workload file" in done.stdout
    result = json.loads(replay.read_text())
    assert len(result["replay"]["scheduled_s"]) == len(records)


def test_workers_share_what_the_supervisor_drew() -> None:
    shared = Shared.new()
    assert Shared.decode(shared.encode()) == shared
