"""The prompt-cache doctor under concurrency, through the whole proxy on the production
path: a real uvicorn proxy on loopback in front of the suite's scripted upstream
(tests/fake_upstream.py) on a thread of its own, the proxy's own clock.

A sighting counts for a later request only once the earlier request's prefill was done
(its first output event) and only if that was at or before the later request arrived
(proxy/doctor/index.py). The upstream holds each answer, headers included,
until the test opens that request's gate, so the test orders arrivals and first tokens
exactly; it waits on the upstream having received a request (so the proxy received it
first) and on the client having read a first token, never on a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings
from proxy.doctor.shared_index import PREFIX_SECRET_ENV, CacheIndexSpec
from proxy.upstream_spec import UpstreamSpec
from tests.fake_upstream import DONE, ScriptedUpstream, chunk_json, sse, usage_json
from tests.redis_server import redis_server
from tests.servers import serve_in_thread

pytestmark = pytest.mark.anyio

SSE = {"content-type": "text/event-stream"}
PROMPT_TOKENS = 3000


def text(n: int, seed: str) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnop") for _ in range(n))


SYSTEM = text(12_000, "a 12 KB system prompt")
BODY = {"model": "m", "stream": True,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi?"}]}


class Gated:
    """The upstream: the i-th request to arrive waits for ``gates[i]``, then sends its
    headers with its first token at once (so a later-arriving request can be answered
    first), then the rest of the stream."""

    def __init__(self, n: int) -> None:
        self.gates = [threading.Event() for _ in range(n)]
        self.arrived = [threading.Event() for _ in range(n)]
        self._count = 0
        self._lock = threading.Lock()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            i, self._count = self._count, self._count + 1
        self.arrived[i].set()
        await asyncio.to_thread(self.gates[i].wait, 30)
        first = (sse(chunk_json({"role": "assistant", "content": ""}))
                 + sse(chunk_json({"content": "ok"})))
        rest = (sse(chunk_json({}, finish="stop")) + sse(usage_json(PROMPT_TOKENS, 1, 0))
                + DONE)

        async def body() -> AsyncIterator[bytes]:
            yield first
            yield rest

        # the request log's request_id says which request a line is (by arrival)
        return httpx.Response(200, headers={**SSE, "x-request-id": f"r{i}"}, content=body())


@pytest.fixture(params=["in-process", "shared"])
def index(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
          ) -> Iterator[CacheIndexSpec | None]:
    """The doctor's index: the process's own, or one on a real redis-server."""
    if request.param == "in-process":
        yield None
        return
    monkeypatch.setenv(PREFIX_SECRET_ENV, "a secret every replica shares, 32+")
    with redis_server(tmp_path) as server:
        yield CacheIndexSpec(url=server.url, timeout_s=5.0)


@contextlib.contextmanager
def proxy_in_front(upstream: Gated, tmp_path: Path, index: CacheIndexSpec | None
                   ) -> Iterator[tuple[str, Path]]:
    """The proxy (real uvicorn) in front of ``upstream``; yields its URL and the request
    log, whose lines are all written once the block ends."""
    log_file = tmp_path / "requests.jsonl"
    with ScriptedUpstream(upstream).running() as up:
        spec = UpstreamSpec(name="up", url=up.url + "/v1", models=("*",), default=True)
        app = create_app(Settings(upstreams=(spec,), log_requests=str(log_file),
                                  prefix_doctor=True, cache_index=index),
                         registry=CollectorRegistry())
        with serve_in_thread(app) as proxy:
            yield proxy.url, log_file


class Stream:
    """One streamed request through the proxy: sent at once; :meth:`first_token` waits
    until the client read the first output, :meth:`end` until the stream's end."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self._first = asyncio.Event()
        self._task = asyncio.ensure_future(self._run(client, url))

    async def _run(self, client: httpx.AsyncClient, url: str) -> bytes:
        seen = b""
        async with client.stream("POST", url + "/v1/chat/completions",
                                 content=json.dumps(BODY).encode()) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_raw():
                seen += chunk
                if b'"ok"' in seen:
                    self._first.set()
        return seen

    async def first_token(self) -> None:
        await asyncio.wait_for(self._first.wait(), 30)

    async def end(self) -> None:
        seen = await asyncio.wait_for(self._task, 30)
        assert seen.endswith(DONE)


async def arrived(upstream: Gated, i: int) -> None:
    """Until the upstream received request ``i`` (so the proxy had received it)."""
    assert await asyncio.to_thread(upstream.arrived[i].wait, 30)


def findings(log_file: Path) -> list[dict[str, Any]]:
    """The request log's lines in the order the requests arrived (the log's order is
    that of the finishes)."""
    lines = {line["request_id"]: line for line in map(json.loads, log_file.read_text().splitlines())}
    return [lines[f"r{i}"] for i in range(len(lines))]


def doctor(line: dict[str, Any]) -> tuple[Any, ...]:
    return (line["repeated_prefix_bytes"], line["repeated_prefix_tokens"],
            line["cache_missed_tokens"], line["prefix_break"])


async def test_a_concurrent_identical_prompt_is_neither_repeated_nor_missed(
        tmp_path: Path, index: CacheIndexSpec | None) -> None:
    """A arrives; B, the same 12 KB prompt, arrives before A's first token: B is not
    repeated, misses nothing, and says why (concurrent). Then C, after both first
    tokens, repeats the whole prompt."""
    upstream = Gated(3)
    with proxy_in_front(upstream, tmp_path, index) as (url, log_file):
        async with httpx.AsyncClient(timeout=30) as client:
            a = Stream(client, url)
            await arrived(upstream, 0)
            b = Stream(client, url)
            await arrived(upstream, 1)
            upstream.gates[0].set()
            await a.first_token()
            await a.end()  # A's examination is in its record (a shared index's too)
            upstream.gates[1].set()
            await b.end()
            upstream.gates[2].set()
            c = Stream(client, url)
            await c.end()
    first, second, third = findings(log_file)
    assert doctor(first) == (0, 0, 0, "first_seen")
    assert doctor(second) == (0, 0, 0, "concurrent")
    assert (second["prefix_break_part"], second["prefix_break_offset"]) == ("system", 0)
    whole = first["prompt_bytes"]
    assert doctor(third) == (whole, PROMPT_TOKENS, 2944, None)  # 2,999 in 128-token steps


async def test_a_later_request_examined_first_is_not_the_source_of_an_earlier_one(
        tmp_path: Path, index: CacheIndexSpec | None) -> None:
    """A arrives, then B; B's first token (and headers) come first, so B is examined
    first: A, which arrived before B's prefill was done, repeats nothing of it."""
    upstream = Gated(2)
    with proxy_in_front(upstream, tmp_path, index) as (url, log_file):
        async with httpx.AsyncClient(timeout=30) as client:
            a = Stream(client, url)
            await arrived(upstream, 0)
            b = Stream(client, url)
            await arrived(upstream, 1)
            upstream.gates[1].set()
            await b.first_token()
            await b.end()  # its examination is in its record
            upstream.gates[0].set()
            await a.end()
    first, second = findings(log_file)
    assert doctor(second) == (0, 0, 0, "first_seen")  # B: nothing was done before it came
    assert doctor(first) == (0, 0, 0, "concurrent")  # A: B's prefill was done after A came


async def test_a_later_stamp_does_not_hide_an_earlier_one_that_still_counts(
        tmp_path: Path, index: CacheIndexSpec | None) -> None:
    """A is done long before; B arrives; C arrives after B and its prefill is done (and
    examined) before B's. C's sighting came after B arrived, A's before: B repeats the
    whole prompt (one time per key, overwritten by C's, would have hidden A's)."""
    upstream = Gated(3)
    with proxy_in_front(upstream, tmp_path, index) as (url, log_file):
        async with httpx.AsyncClient(timeout=30) as client:
            upstream.gates[0].set()
            await Stream(client, url).end()
            b = Stream(client, url)
            await arrived(upstream, 1)
            c = Stream(client, url)
            await arrived(upstream, 2)
            upstream.gates[2].set()
            await c.end()  # C's examination ran before B's first token
            upstream.gates[1].set()
            await b.end()
    a, b_line, c_line = findings(log_file)
    assert a["prefix_break"] == "first_seen"
    whole = a["prompt_bytes"]
    assert (b_line["repeated_prefix_bytes"], b_line["prefix_break"]) == (whole, None)
    assert b_line["repeated_prefix_tokens"] == PROMPT_TOKENS
    assert (c_line["repeated_prefix_bytes"], c_line["prefix_break"]) == (whole, None)

