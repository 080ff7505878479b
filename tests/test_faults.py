"""The fault matrix: each fault behaves as promised and the proxy keeps serving.

Every test runs the proxy in a real uvicorn server on loopback and puts a
misbehaving raw upstream (:class:`tests.fake_upstream.RawUpstream`, on a thread of its
own) behind it, so the faults are
real socket events (refused connects, silence, RSTs, half-sent chunked bodies), not
mocked exceptions. After each fault the test checks three things: what the client got,
the outcome label the proxy recorded in ``/metrics``, and that a normal request through
the official ``openai`` SDK still succeeds.

Timing is asserted only where the proxy promises a bound (connect timeout, read timeout,
100 ms to close the upstream request) and always by waiting on an event with a bounded
wait, never by sleeping. A test that shows a timeout is *not* waited out (a refused
connect answered at once) sets that timeout well above :data:`AT_ONCE_S`; one that shows
a timeout ends a wait allows :data:`AT_ONCE_S` beyond it. Both still fail when the wait
is never ended, and hold on a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import anyio
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import ProxyApp, create_app
from proxy.config import Settings
from proxy.sse import DEFAULT_MAX_EVENT_BYTES, SSEParser
from tests.fake_upstream import DONE, Conn, Gate, RawUpstream, content_event, sse, stream_events
from tests.servers import RunningServer, closed_port, proxy_process, refuses, serve_in_thread

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

CHAT = "/v1/chat/completions"
# What "at once" may take on a loaded 2-core machine (a request through the proxy, a
# process reacting to a signal), and a timeout that must never be what ends a wait.
AT_ONCE_S = 10.0
NEVER_S = 30.0
# Loading the CA bundle costs 60-300 ms per client on a busy runner; build it once.
_SSL = ssl.create_default_context()


def client(timeout: float = 20) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=timeout, verify=_SSL)



# ---------------------------------------------------------------------------
# Helpers


@contextlib.contextmanager
def run_proxy(upstream_url: str, *, loop: str = "asyncio",
              **overrides: object) -> Iterator[tuple[RunningServer, ProxyApp]]:
    """The proxy (fresh registry) in a real uvicorn server in front of ``upstream_url``,
    on ``loop`` (asyncio's; ``uvloop`` is what ``serve`` runs on)."""
    settings = Settings(upstream=upstream_url + "/v1", **overrides)  # type: ignore[arg-type]
    app = create_app(settings, registry=CollectorRegistry())
    with serve_in_thread(app, timeout_graceful_shutdown=2, loop=loop) as server:
        yield server, app


def chat(model: str, *, stream: bool = True, **extra: object) -> bytes:
    return json.dumps({"model": model, "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


async def scrape(base: str, c: httpx.AsyncClient | None = None
                 ) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    if c is None:
        async with client() as c:
            return await scrape(base, c)
    text = (await c.get(base + "/metrics")).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def wait_metric(base: str, name: str, expected: float, within: float = AT_ONCE_S,
                      **labels: str) -> float:
    """Poll ``/metrics`` until the sample reaches ``expected`` (the record is made in the
    request's ``finally``, just after the client saw the end), bounded by ``within`` s."""
    deadline = time.monotonic() + within
    async with client() as c:
        while True:
            value = metric(await scrape(base, c), name, **labels)
            if value >= expected or time.monotonic() > deadline:
                return value
            await anyio.sleep(0.01)


async def outcome_is(base: str, outcome: str, model: str) -> None:
    value = await wait_metric(base, "llm_proxy_stream_outcomes_total", 1, outcome=outcome,
                              model=model)
    assert value == 1, f"outcome {outcome!r} not recorded for model {model!r}"


async def still_serves(base: str) -> None:
    """A normal streamed chat completion through the official SDK gets every token."""
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0,
                                  timeout=10) as client:
        stream = await client.chat.completions.create(
            model="ok", messages=[{"role": "user", "content": "hi"}], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == " tok0 tok1 tok2"


async def read_stream(base: str, body: bytes, *, until: Callable[[bytes], bool] | None = None,
                      then: Callable[[], None] | None = None
                      ) -> tuple[int, dict[str, str], bytes, BaseException | None]:
    """POST and read the raw body until it ends or breaks; ``then`` runs once ``until`` holds."""
    got = bytearray()
    error: BaseException | None = None
    async with client() as c, c.stream(
            "POST", base + CHAT, content=body,
            headers={"content-type": "application/json"}) as r:
        try:
            async for part in r.aiter_raw():
                got += part
                if until is not None and then is not None and until(bytes(got)):
                    then()
                    then = None
        except httpx.HTTPError as exc:
            error = exc
        return r.status_code, dict(r.headers), bytes(got), error


async def read_until(parts: AsyncIterator[bytes], got: bytearray, done: Callable[[bytes], bool]) -> None:
    """Read from one long-lived ``aiter_raw()`` iterator until ``done(got)``.

    Never ``break`` out of ``async for`` over ``aiter_raw()``: the abandoned generator is
    finalized at once, which closes the connection, i.e. a client disconnect.
    """
    while not done(bytes(got)):
        got += await parts.__anext__()


def openai_error(body: bytes) -> dict[str, object]:
    err = json.loads(body)["error"]
    assert set(err) >= {"message", "type", "code"}
    return err  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------
# Upstream faults before the response headers


async def test_upstream_refuses_connection_502_within_connect_timeout() -> None:
    port = closed_port()
    with run_proxy(f"http://127.0.0.1:{port}", connect_timeout=NEVER_S) as (proxy, _):
        t = time.perf_counter()
        status, _, body, _ = await read_stream(proxy.url, chat("refused"))
        elapsed = time.perf_counter() - t
        assert status == 502
        assert openai_error(body)["code"] == "upstream_unreachable"
        assert elapsed < AT_ONCE_S  # not after the connect timeout
        await outcome_is(proxy.url, "upstream_unreachable", "refused")
        # The upstream comes up on that port: the proxy serves it (no poisoned pool).
        with RawUpstream(port=port).running():
            await still_serves(proxy.url)


async def test_upstream_dns_failure_502_within_connect_timeout() -> None:
    with run_proxy("http://upstream.invalid", connect_timeout=NEVER_S) as (proxy, _):
        for _ in range(2):  # and again: the proxy keeps answering promptly
            t = time.perf_counter()
            status, _, body, _ = await read_stream(proxy.url, chat("dns"))
            assert status == 502 and time.perf_counter() - t < AT_ONCE_S
            assert openai_error(body)["code"] == "upstream_unreachable"
        await wait_metric(proxy.url, "llm_proxy_stream_outcomes_total", 2,
                          outcome="upstream_unreachable")
        async with client() as c:
            assert (await c.get(proxy.url + "/healthz")).status_code == 200


async def test_upstream_never_sends_headers_504_after_read_timeout() -> None:
    async def silent(conn: Conn) -> None:
        await conn.until_closed(NEVER_S)

    upstream = RawUpstream({"silent": silent})
    with upstream.running(), run_proxy(upstream.url, read_timeout=0.5) as (proxy, _):
        t = time.perf_counter()
        status, _, body, _ = await read_stream(proxy.url, chat("silent"))
        elapsed = time.perf_counter() - t
        assert status == 504
        assert openai_error(body)["code"] == "upstream_timeout"
        assert 0.5 <= elapsed < 0.5 + AT_ONCE_S
        # The proxy gave up on the upstream request: the upstream sees its connection close.
        seen = upstream.seen("silent")[0]
        assert await anyio.to_thread.run_sync(seen.closed.wait, AT_ONCE_S)
        await outcome_is(proxy.url, "upstream_timeout", "silent")
        await still_serves(proxy.url)


@pytest.mark.parametrize(("how", "outcome"), [
    ("hangs-up", "upstream_interrupted"),  # the request arrived; the upstream closed, no answer
    ("resets", "upstream_interrupted"),  # ... or reset (a crash during prefill)
    ("not-http", "upstream_error"),  # something answered, but not in HTTP
])
async def test_upstream_fails_before_headers_502(how: str, outcome: str) -> None:
    async def fail(conn: Conn) -> None:
        if how == "hangs-up":
            conn.close()
        elif how == "resets":
            conn.reset()
        else:
            await conn.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
            await conn.until_closed(30)

    upstream = RawUpstream({how: fail})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        status, _, body, _ = await read_stream(proxy.url, chat(how))
        assert (status, openai_error(body)["code"]) == (502, "upstream_failed")
        await outcome_is(proxy.url, outcome, how)
        await still_serves(proxy.url)


# ---------------------------------------------------------------------------
# Upstream faults mid-stream


async def test_upstream_stalls_mid_stream_client_keeps_bytes_outcome_upstream_timeout() -> None:
    sent = stream_events(2, usage=False)[:3]  # role chunk and two tokens, then silence

    async def stall(conn: Conn) -> None:
        await conn.head(200)
        for ev in sent:
            await conn.chunk(ev)
        await conn.until_closed(NEVER_S)

    upstream = RawUpstream({"stall": stall})
    with upstream.running(), run_proxy(upstream.url, read_timeout=0.5) as (proxy, _):
        status, headers, got, error = await read_stream(proxy.url, chat("stall"))
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert got == b"".join(sent)
        assert error is not None, "the stream must end broken, not as if complete"
        assert await anyio.to_thread.run_sync(upstream.seen("stall")[0].closed.wait, AT_ONCE_S)
        await outcome_is(proxy.url, "upstream_timeout", "stall")
        await still_serves(proxy.url)


@pytest.mark.parametrize("how", ["rst", "fin"])
async def test_upstream_drops_mid_stream_client_keeps_bytes(how: str) -> None:
    first = stream_events(3, usage=False)[:2]
    second = [content_event(" late")]
    gate = Gate()

    async def drop(conn: Conn) -> None:
        await conn.head(200)
        for ev in first:
            await conn.chunk(ev)
        if how == "rst":
            # An RST may discard data still in flight, so reset only once the client
            # has what was sent: then every byte sent so far must have reached it.
            await gate.wait()
            conn.reset()
        else:
            for ev in second:
                await conn.chunk(ev)
            conn.close()  # FIN in the middle of the chunked body

    upstream = RawUpstream({"drop": drop})
    expected = b"".join(first) + (b"".join(second) if how == "fin" else b"")
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        status, _, got, error = await read_stream(
            proxy.url, chat("drop"), until=lambda b: b == b"".join(first), then=gate.open)
        assert status == 200
        assert got == expected
        assert error is not None, "the client must see the stream break, as the upstream broke it"
        await outcome_is(proxy.url, "upstream_interrupted", "drop")
        await still_serves(proxy.url)


@pytest.mark.parametrize(("status", "content_type", "body"), [
    (400, "application/json", b'{"error":{"message":"bad model","type":"invalid_request_error",'
                              b'"param":"model","code":"model_not_found"}}'),
    (429, "application/json", b'{"error":{"message":"slow down","type":"rate_limit_error"}}'),
    (500, "text/html", b"<html><body>Internal Server Error</body></html>"),
    (503, "text/plain", b"upstream overloaded\n\xff\xfe not even utf-8"),
])
async def test_upstream_error_status_passes_through_unchanged(
        status: int, content_type: str, body: bytes) -> None:
    async def fail(conn: Conn) -> None:
        await conn.head(status, content_type=content_type, length=len(body),
                        extra=(("retry-after", "7"), ("x-upstream-marker", "m1")))
        await conn.write(body)

    upstream = RawUpstream({"fail": fail})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        got_status, headers, got, error = await read_stream(proxy.url, chat("fail"))
        assert (got_status, got, error) == (status, body, None)
        assert headers["content-type"] == content_type
        assert headers["retry-after"] == "7" and headers["x-upstream-marker"] == "m1"
        await outcome_is(proxy.url, "upstream_4xx" if status < 500 else "upstream_5xx", "fail")
        await wait_metric(proxy.url, "llm_proxy_requests_total", 1, code=str(status))
        await still_serves(proxy.url)


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br"])
async def test_a_stream_compressed_though_asked_for_identity_is_measured_as_sent(
        coding: str) -> None:
    """An upstream that gzips its event stream although the proxy asked for identity:
    the client gets the bytes as sent (and decodes them itself), and the stream is
    measured on a decoded copy: completed, its first token, its tokens from the usage
    inside. Before, nothing was parsed and a stream that completed read as
    upstream_interrupted. A coding the proxy cannot undo (br) goes unmeasured, completed."""
    events = stream_events(5, usage=True, prompt=11)
    packer = zlib.compressobj(wbits=31 if coding != "deflate" else 15)
    packed = [packer.compress(event) + packer.flush(zlib.Z_SYNC_FLUSH) for event in events]
    packed[-1] += packer.flush()
    sent = b"".join(packed)

    async def compressed(conn: Conn) -> None:
        await conn.head(200, extra=(("content-encoding", coding),))
        for part in packed:
            await conn.chunk(part)
        await conn.end()

    upstream = RawUpstream({"packed": compressed})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        async with client() as c, c.stream("POST", proxy.url + CHAT,
                                           content=chat("packed")) as r:
            assert r.headers["content-encoding"] == coding
            got = b"".join([part async for part in r.aiter_raw()])  # not decoded
        assert got == sent
        await outcome_is(proxy.url, "completed", "packed")
        samples = await scrape(proxy.url)
        ttft = metric(samples, "llm_proxy_time_to_first_token_seconds_count", model="packed")
        tokens = metric(samples, "llm_proxy_completion_tokens_sum", model="packed")
        assert (ttft, tokens) == ((0, 0) if coding == "br" else (1, 5))
        await still_serves(proxy.url)


@pytest.mark.parametrize("status", [600, 999])
async def test_an_upstream_status_past_599_is_a_502_in_openai_shape(status: int) -> None:
    """RFC 9110 has no status past 599 (httptools reads up to 999): the client gets the
    proxy's 502 ``upstream_failed``, as for any answer that is not HTTP, where uvicorn
    used to fail on the status and the client got no answer at all."""
    async def odd(conn: Conn) -> None:
        await conn.write(b"HTTP/1.1 %d Weird\r\ncontent-type: application/json\r\n"
                         b"content-length: 2\r\n\r\n{}" % status)

    upstream = RawUpstream({"odd": odd})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        got_status, _, got, error = await read_stream(proxy.url, chat("odd"))
        assert (got_status, error) == (502, None)
        err = openai_error(got)
        assert err["code"] == "upstream_failed" and f"status {status}" in str(err["message"])
        await wait_metric(proxy.url, "llm_proxy_requests_total", 1, code="502")
        samples = await scrape(proxy.url)
        assert metric(samples, "llm_proxy_requests_total", code=str(status)) == 0
        await still_serves(proxy.url)


@pytest.mark.parametrize("status", [204, 304])
async def test_a_bodiless_answer_with_a_length_reaches_the_client_whole(
        status: int, caplog: pytest.LogCaptureFixture) -> None:
    """A 304 may carry the length its 200 would have (RFC 9110, 8.6), and some servers
    put one on a 204: the client gets the status and headers, with no length and no
    body, the connection stays open for the next request, and no error is logged (uvicorn
    waited for the body the length described and failed the response)."""
    async def bodiless(conn: Conn) -> None:
        await conn.write(b"HTTP/1.1 %d X\r\netag: \"v1\"\r\ncontent-length: 10\r\n\r\n" % status)

    upstream = RawUpstream({"bodiless": bodiless})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _), caplog.at_level(logging.ERROR):
        async with client() as c:
            r = await c.post(proxy.url + CHAT, content=chat("bodiless", stream=False))
            assert (r.status_code, r.content, r.headers["etag"]) == (status, b"", '"v1"')
            assert "content-length" not in r.headers
            again = await c.post(proxy.url + CHAT, content=chat("ok", stream=False))
            assert again.status_code == 200
        await still_serves(proxy.url)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


# ---------------------------------------------------------------------------
# Hostile stream contents


def _garbage(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


HOSTILE = {
    "malformed": [
        b"data: {not json\n\n", b"event: x\nid: 1\nretry: nope\ndata: [\ndata: 1\n\n",
        b": a comment\n\n", b"data:{\"choices\":5}\n\n", b"data: {\"choices\":[{\"delta\":7}]}\r\n\r\n",
        b"\r\r\n\n\n", b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\r\rdata",
        b": no blank line at the end",
    ],
    "10mb_event": [b"data: {\"choices\":[{\"delta\":{\"content\":\"" + b"x" * (10 << 20)
                   + b"\"}}]}\n\n", content_event(" after")],
    "binary": [_garbage(6, 300_000), b"\n\n", _garbage(7, 50_000)],
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
async def test_hostile_stream_forwarded_unchanged(kind: str) -> None:
    parts = HOSTILE[kind]

    async def hostile(conn: Conn) -> None:
        await conn.head(200)
        for part in parts:
            await conn.chunk(part)
        await conn.end()

    upstream = RawUpstream({"hostile": hostile})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        status, _, got, error = await read_stream(proxy.url, chat("hostile"))
        assert (status, error) == (200, None)
        assert got == b"".join(parts)
        # no [DONE] and no finish reason among them: an answer that never ended
        await outcome_is(proxy.url, "upstream_interrupted", "hostile")
        await still_serves(proxy.url)

    # The same bytes, cut the way a socket might cut them, keep the parser's memory bounded.
    parser, data = SSEParser(), b"".join(parts)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(0, len(data), 65536):
            parser.feed(data[i:i + 65536])
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak <= 2 * DEFAULT_MAX_EVENT_BYTES + 2 * 65536


# ---------------------------------------------------------------------------
# Upstream framing faults: what the upstream's client (proxy/wire.py) must not take as sent


FLOOD_LINE = b"x-flood: " + b"v" * 1013 + b"\r\n"  # 1 KiB of header field


@pytest.mark.parametrize("how", ["complete", "endless"])
async def test_upstream_header_flood_gets_502_and_its_connection_closed(how: str) -> None:
    """100 KiB of response headers (then a stream), or headers that never end."""
    closed = threading.Event()  # the proxy closed the flooding connection

    async def flood(conn: Conn) -> None:
        try:
            await conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
            if how == "complete":
                await conn.write(FLOOD_LINE * 100 + b"transfer-encoding: chunked\r\n\r\n")
                await conn.chunk(content_event(" flooded"))
                await conn.end()
                if await conn.until_closed(10):
                    closed.set()
                return
            while True:  # until the proxy closes: then the write fails
                await conn.write(FLOOD_LINE * 64)
        except ConnectionError:  # the proxy closed (with an RST) while this was writing
            closed.set()
            raise

    upstream = RawUpstream({"flood": flood})
    with upstream.running(), run_proxy(upstream.url, read_timeout=5.0) as (proxy, _):
        t = time.perf_counter()
        status, _, body, _ = await read_stream(proxy.url, chat("flood"))
        assert status == 502 and time.perf_counter() - t < 5.0  # not at the read timeout
        error = openai_error(body)
        assert error["code"] == "upstream_headers_too_large"
        assert "larger than 64 KiB" in str(error["message"])
        assert await anyio.to_thread.run_sync(closed.wait, 5)
        await outcome_is(proxy.url, "upstream_error", "flood")
        await still_serves(proxy.url)


async def test_upstream_answering_twice_first_answer_stands_connection_closed(
        caplog: pytest.LogCaptureFixture) -> None:
    """A whole stream, then (in the same read) a second response's head and part of its
    body: the client gets the stream as sent and nothing of the second, the outcome is
    ``completed``, the connection is closed (not pooled part-way through a message), one
    warning names the upstream, and the next request goes on a fresh connection."""
    events = stream_events(2, usage=True)
    first = b"".join(b"%x\r\n%s\r\n" % (len(ev), ev) for ev in events) + b"0\r\n\r\n"
    second = b"HTTP/1.1 200 OK\r\nx-second: 1\r\ncontent-length: 50\r\n\r\nnot for anyone"
    closed = threading.Event()

    async def twice(conn: Conn) -> None:
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"x-first: 1\r\ntransfer-encoding: chunked\r\n\r\n" + first + second)
        if await conn.until_closed(10):
            closed.set()

    upstream = RawUpstream({"twice": twice})
    with caplog.at_level(logging.WARNING, logger="proxy.wire"), upstream.running(), \
            run_proxy(upstream.url) as (proxy, _):
        status, headers, got, error = await read_stream(proxy.url, chat("twice"))
        assert (status, error) == (200, None)
        assert headers["x-first"] == "1" and "x-second" not in headers
        assert got == b"".join(events[:-2] + events[-1:])  # the usage event the proxy asked for
        assert await anyio.to_thread.run_sync(closed.wait, 5)
        await outcome_is(proxy.url, "completed", "twice")
        await still_serves(proxy.url)
        assert upstream.connections == 2
    warned = [r.getMessage() for r in caplog.records if r.name == "proxy.wire"]
    assert len(warned) == 1 and f"upstream 127.0.0.1:{upstream.port} sent bytes after" in warned[0]


@pytest.mark.parametrize("fields", ["gzip, chunked", "gzip"])
async def test_upstream_transfer_coding_is_undone_and_the_stream_measured(fields: str) -> None:
    """A stream gzipped as a transfer coding, flushed per event: chunked last (RFC 9112
    section 6.3: de-chunked, then the gzip undone) or not (the body ends at the close).
    Transfer codings are hop-by-hop, so the client gets the events decoded in the
    proxy's own framing, exactly, and they are measured as any stream."""
    events = stream_events(3, usage=True)
    chunked = fields.endswith("chunked")

    async def coded(conn: Conn) -> None:
        z = zlib.compressobj(wbits=31)  # gzip
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: %s\r\n\r\n" % fields.encode())
        pieces = [z.compress(ev) + z.flush(zlib.Z_SYNC_FLUSH) for ev in events] + [z.flush()]
        for piece in pieces:
            await (conn.chunk(piece) if chunked else conn.write(piece))
        if chunked:
            await conn.end()
        else:
            conn.close()

    upstream = RawUpstream({"coded": coded})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        status, headers, got, error = await read_stream(proxy.url, chat("coded"))
        assert (status, error) == (200, None)
        assert headers["transfer-encoding"] == "chunked" and "content-encoding" not in headers
        assert got == b"".join(events[:-2] + events[-1:])  # less the usage the proxy asked for
        await outcome_is(proxy.url, "completed", "coded")
        assert await wait_metric(proxy.url, "llm_proxy_time_to_first_token_seconds_count", 1,
                                 model="coded") == 1
        assert await wait_metric(proxy.url, "llm_proxy_completion_tokens_sum", 3,
                                 model="coded") == 3  # from the upstream's usage
        await still_serves(proxy.url)


@pytest.mark.parametrize("content_type", ["Text/Event-Stream; charset=utf-8", "TEXT/EVENT-STREAM"])
async def test_a_stream_typed_in_capitals_is_measured_and_stripped(content_type: str) -> None:
    """Media types are case-insensitive (RFC 9110, 8.3.1): a stream so typed is measured,
    and the usage event the proxy asked for is taken out, as for ``text/event-stream``."""
    events = stream_events(3, usage=True)

    async def shouting(conn: Conn) -> None:
        await conn.head(200, content_type=content_type)
        for event in events:
            await conn.chunk(event)
        await conn.end()

    upstream = RawUpstream({"shouting": shouting})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        status, headers, got, error = await read_stream(proxy.url, chat("shouting"))
        assert (status, error) == (200, None)
        assert got == b"".join(events[:-2] + events[-1:])  # less the usage the proxy asked for
        assert headers["x-accel-buffering"] == "no"
        assert await wait_metric(proxy.url, "llm_proxy_time_to_first_token_seconds_count", 1,
                                 model="shouting") == 1
        assert await wait_metric(proxy.url, "llm_proxy_completion_tokens_sum", 3,
                                 model="shouting") == 3


async def test_a_stream_opening_with_a_byte_order_mark_is_measured_from_its_first_event() -> None:
    """A BOM before the first event (SSE ignores one): relayed as it came, and the first
    event is the first token, where it used to be lost to the measurement."""
    events = [content_event(" first"), *stream_events(3, usage=True)]
    bom = b"\xef\xbb\xbf"

    async def marked(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(bom + events[0])  # the first token's event, after the mark
        for event in events[1:]:
            await conn.chunk(event)
        await conn.end()

    upstream = RawUpstream({"marked": marked})
    with upstream.running(), run_proxy(upstream.url, inject_usage=False) as (proxy, _):
        status, _, got, error = await read_stream(proxy.url, chat("marked"))
        assert (status, error) == (200, None)
        assert got == bom + b"".join(events)  # every byte, unchanged
        await outcome_is(proxy.url, "completed", "marked")
        samples = await scrape(proxy.url)
        outputs = sum(b" tok" in e or b" first" in e for e in events)
        assert metric(samples, "llm_proxy_time_to_first_token_seconds_count", model="marked") == 1
        assert metric(samples, "llm_proxy_inter_token_latency_seconds_count",
                      model="marked") == outputs - 1


@pytest.mark.parametrize("ending", ["tokens", "finish", "done"])
async def test_a_stream_that_ends_before_its_last_event_is_interrupted(ending: str) -> None:
    """A body that ends well (its chunked terminator) after tokens alone, with no
    ``[DONE]`` and no finish reason, is an answer cut short: ``upstream_interrupted``,
    with no token count made up from its events. A finish reason without ``[DONE]``
    ends the answer (a server that omits the marker); ``[DONE]`` alone does too."""
    events = {
        "tokens": [content_event(" a"), content_event(" b")],
        "finish": stream_events(2, usage=False)[:-1],
        "done": [content_event(" a"), content_event(" b"), b"data: [DONE]\n\n"],
    }[ending]

    async def short(conn: Conn) -> None:
        await conn.head(200)
        for event in events:
            await conn.chunk(event)
        await conn.end()

    upstream = RawUpstream({"short": short})
    with upstream.running(), run_proxy(upstream.url, inject_usage=False) as (proxy, _):
        status, _, got, error = await read_stream(proxy.url, chat("short"))
        assert (status, got, error) == (200, b"".join(events), None)
        cut = ending == "tokens"
        await outcome_is(proxy.url, "upstream_interrupted" if cut else "completed", "short")
        samples = await scrape(proxy.url)
        counted = metric(samples, "llm_proxy_completion_tokens_count", model="short")
        assert counted == (0 if cut else 1)
        assert metric(samples, "llm_proxy_time_to_first_token_seconds_count", model="short") == 1
        await still_serves(proxy.url)


async def test_time_to_first_byte_ends_when_bytes_reach_the_client_not_the_proxy() -> None:
    """The first event split across two writes 0.2 s apart, the usage the proxy asked for
    to be taken out: its first half waits in the proxy until the event is whole, so the
    client's first byte, and the time to it, comes with the second half."""
    events = stream_events(2, usage=True)
    first = events[0]
    pause = 0.2

    async def split(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(first[:10])
        await asyncio.sleep(pause)  # the upstream's schedule: the subject of the test
        await conn.chunk(first[10:])
        for event in events[1:]:
            await conn.chunk(event)
        await conn.end()

    upstream = RawUpstream({"split": split})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        status, _, got, error = await read_stream(proxy.url, chat("split"))
        assert (status, error) == (200, None)
        assert got == b"".join(events[:-2] + events[-1:])  # less the usage it asked for
        await outcome_is(proxy.url, "completed", "split")
        samples = await scrape(proxy.url)
        assert metric(samples, "llm_proxy_time_to_first_byte_seconds_count", model="split") == 1
        assert metric(samples, "llm_proxy_time_to_first_byte_seconds_sum", model="split") >= pause


@pytest.mark.parametrize("how", ["client_left", "upstream_broke", "empty_answer"])
async def test_a_stream_that_ends_before_its_first_token_is_a_wait_without_one(how: str) -> None:
    """A stream answered 200 that ends before any output event is not in the TTFT
    histogram, which only knows first tokens: it goes to the wait without a first token,
    as long as the client had waited, unless it completed (an empty answer is an answer)."""
    role = stream_events(0, usage=False)[0]
    gate = Gate()

    async def silent(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(role)
        if how == "empty_answer":
            await conn.chunk(DONE)
            await conn.end()
        elif how == "upstream_broke":
            await gate.wait(within=10)
            conn.close()
        else:
            await conn.until_closed(10)

    upstream = RawUpstream({"silent": silent})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        t0 = time.perf_counter()
        async with client() as c, c.stream("POST", proxy.url + CHAT, content=chat("silent")) as r:
            parts = r.aiter_raw()
            await read_until(parts, bytearray(), lambda b: role in b)
            if how == "upstream_broke":
                gate.open()
            if how != "client_left":
                with contextlib.suppress(httpx.HTTPError, StopAsyncIteration):
                    while True:
                        await parts.__anext__()
        waited = time.perf_counter() - t0
        outcome = {"client_left": "client_disconnected", "upstream_broke": "upstream_interrupted",
                   "empty_answer": "completed"}[how]
        await outcome_is(proxy.url, outcome, "silent")
        samples = await scrape(proxy.url)
        name = "llm_proxy_wait_without_first_token_seconds"
        assert metric(samples, "llm_proxy_time_to_first_token_seconds_count", model="silent") == 0
        if how == "empty_answer":
            assert metric(samples, f"{name}_count", model="silent") == 0
        else:
            assert metric(samples, f"{name}_count", model="silent") == 1
            assert 0 < metric(samples, f"{name}_sum", model="silent") <= waited
            # and diagnose names them, where it said "No measured requests"
            done = await anyio.to_thread.run_sync(lambda: subprocess.run(
                [sys.executable, "-m", "proxy", "diagnose", "--url", proxy.url, "--json",
                 "--model", "silent"], capture_output=True, text=True, timeout=60, check=False))
            assert done.returncode == 0, done.stderr
            (selection,) = json.loads(done.stdout)["selections"]
            assert selection["no_first_token_streams"] == 1
            assert 0 < selection["no_first_token_wait_ms"] <= waited * 1000


async def test_an_error_event_the_client_leaves_at_is_the_upstreams_error() -> None:
    """An error event in a 200 stream, then a pause before the upstream's ``[DONE]`` (as
    vLLM and the simulator send them): the official SDK raises on the error and closes
    at once. The outcome is the upstream's error, not a client that left."""
    error = sse({"error": {"message": "engine died", "type": "internal_error", "code": 500}})

    async def failing(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(content_event(" first"))
        await conn.chunk(error)
        await conn.until_closed(10)  # [DONE] would come later: the client has gone

    upstream = RawUpstream({"failing": failing})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test",
                                      max_retries=0, timeout=10) as sdk:
            stream = await sdk.chat.completions.create(
                model="failing", messages=[{"role": "user", "content": "hi"}], stream=True)
            with pytest.raises(openai.APIError, match="engine died"):
                async for _ in stream:
                    pass
        await outcome_is(proxy.url, "upstream_error", "failing")
        samples = await scrape(proxy.url)
        assert metric(samples, "llm_proxy_stream_outcomes_total", model="failing",
                      outcome="client_disconnected") == 0
        await still_serves(proxy.url)


# ---------------------------------------------------------------------------
# Client faults


async def test_client_disconnect_closes_upstream_within_100ms() -> None:
    async def endless(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(content_event(" first"))
        await conn.until_closed(10)

    upstream = RawUpstream({"endless": endless})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        async with client() as c, c.stream("POST", proxy.url + CHAT, content=chat("endless")) as r:
            parts = r.aiter_raw()
            await read_until(parts, bytearray(), lambda b: b" first" in b)
            t_disconnect = time.perf_counter()
            # leaving the block closes the unfinished response's connection
        seen = upstream.seen("endless")[0]
        assert await anyio.to_thread.run_sync(seen.closed.wait, AT_ONCE_S), "upstream left open"
        assert seen.closed_at is not None
        assert seen.closed_at - t_disconnect < 0.100
        await outcome_is(proxy.url, "client_disconnected", "endless")
        # the client had the first bytes and token before it left: both are counted
        for name in ("time_to_first_byte", "time_to_first_token"):
            assert await wait_metric(proxy.url, f"llm_proxy_{name}_seconds_count", 1,
                                     model="endless") == 1, name
        await still_serves(proxy.url)


# ---------------------------------------------------------------------------
# A client that stops reading (--client-write-timeout)

FLOOD_EVENT = content_event("x" * 16_000)
FLOOD_LIMIT = 512 << 20  # a bound for a broken proxy; a working one stops reading long before


@dataclass
class Flood:
    """An upstream answer streamed as fast as the proxy takes it, until the proxy closes
    the connection (or ``FLOOD_LIMIT`` bytes, then it ends normally). ``last_write``:
    when the proxy's side last took a chunk (``time.perf_counter()``); the proxy paused
    its reading at the latest then. ``longest_wait``: the longest the proxy held a
    chunk back (its reading paused: the client was not reading)."""

    limit: int = FLOOD_LIMIT
    sent: int = 0
    last_write: float = 0.0
    longest_wait: float = 0.0
    ended: bool = False

    async def __call__(self, conn: Conn) -> None:
        await conn.head(200)
        while self.sent < self.limit:
            t = time.perf_counter()
            await conn.chunk(FLOOD_EVENT)
            self.last_write = time.perf_counter()
            self.longest_wait = max(self.longest_wait, self.last_write - t)
            self.sent += len(FLOOD_EVENT)
        await conn.chunk(DONE)
        await conn.end()
        self.ended = True


async def raw_request(port: int, body: bytes, *,
                      rcvbuf: int | None = 4096) -> tuple[socket.socket, bytes]:
    """POST ``body`` on a raw socket whose receive buffer is ``rcvbuf`` bytes (set before
    connecting, so the window it advertises stays small; None: the kernel's, autotuned),
    read up to the end of the response head and return the socket and the head; the
    caller decides what to read."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                % (len(body), body))
        head = b""
        async with asyncio.timeout(10):
            while b"\r\n\r\n" not in head:
                part = await loop.sock_recv(sock, 1)  # byte by byte: no body byte is taken
                assert part, "the proxy closed before the response head"
                head += part
    except BaseException:
        sock.close()
        raise
    return sock, head


async def read_to_end(sock: socket.socket, *,
                      pace: Callable[[int], Awaitable[None]] | None = None,
                      within: float = 30.0) -> tuple[bytes, BaseException | None]:
    """Everything the socket still delivers until the peer closes it (EOF or a reset);
    ``pace(bytes so far)`` runs between reads (a slow client)."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    async with asyncio.timeout(within):
        while True:
            try:
                part = await loop.sock_recv(sock, 1 << 20)
            except ConnectionError as exc:
                return bytes(got), exc
            if not part:
                return bytes(got), None
            got += part
            if pace is not None:
                await pace(len(got))


def dechunk(body: bytes) -> bytes:
    """A chunked body's content (which must be complete)."""
    out, at = bytearray(), 0
    while True:
        eol = body.index(b"\r\n", at)
        size = int(body[at:eol], 16)
        if size == 0:
            return bytes(out)
        out += body[eol + 2:eol + 2 + size]
        at = eol + 2 + size
        assert body[at:at + 2] == b"\r\n"
        at += 2


async def gauge_at_most(base: str, name: str, value: float, within: float) -> float:
    """Poll ``/metrics`` until gauge ``name`` is at most ``value``; the
    ``time.perf_counter()`` when it was seen so, bounded by ``within`` seconds."""
    deadline = time.monotonic() + within
    async with client() as c:
        while True:
            if metric(await scrape(base, c), name) <= value:
                return time.perf_counter()
            assert time.monotonic() < deadline, f"{name} still above {value} after {within} s"
            await anyio.sleep(0.01)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_client_that_stops_reading_is_closed_and_frees_the_upstream(
        loop: str, caplog: pytest.LogCaptureFixture) -> None:
    timeout = 1.0
    flood = Flood()
    gate = Gate()
    steady_events = stream_events(20, usage=False)

    async def steady(conn: Conn) -> None:
        await conn.head(200)
        for ev in steady_events[:10]:
            await conn.chunk(ev)
        await gate.wait(within=120)
        for ev in steady_events[10:]:
            await conn.chunk(ev)
        await conn.end()

    upstream = RawUpstream({"flood": flood, "steady": steady})
    caplog.set_level(logging.WARNING, logger="proxy")
    with upstream.running(), run_proxy(upstream.url, loop=loop, client_write_timeout=timeout,
                                       max_concurrency=2) as (proxy, app):
        async with client() as c, c.stream("POST", proxy.url + CHAT,
                                           content=chat("steady")) as other:
            # Another stream is under way, and stays so while the stall happens.
            parts, got = other.aiter_raw(), bytearray()
            await read_until(parts, got, lambda b: b == b"".join(steady_events[:10]))
            sock, head = await raw_request(proxy.port, chat("flood"))
            with sock:
                t_stopped = time.perf_counter()  # and the client reads nothing more
                assert head.startswith(b"HTTP/1.1 200 ")
                match = re.search(rb"(?i)\r\nx-request-id: *([0-9a-f]+)\r\n", head)
                assert match is not None
                request_id = match[1].decode()
                t_freed = await gauge_at_most(proxy.url, "llm_proxy_in_flight_requests", 1,
                                              within=timeout + 30)
                assert metric(await scrape(proxy.url), "llm_proxy_stream_outcomes_total",
                              model="steady") == 0  # the one that ended is the stalled one
                # Not before the timeout, and within a second of the proxy's last read.
                assert t_freed - t_stopped >= timeout - 0.05
                assert t_freed - flood.last_write < timeout + 1.0
                assert app.admission.active == 1  # only the other stream holds a slot
                seen = upstream.seen("flood")[0]
                assert await anyio.to_thread.run_sync(seen.closed.wait, 5), "upstream left open"
                assert not flood.ended
                await outcome_is(proxy.url, "client_stalled", "flood")
                # The client's connection is closed too: what is left ends, and the body
                # does not (no last chunk).
                rest, _ = await read_to_end(sock, within=10)
                assert not (head + rest).endswith(b"0\r\n\r\n")
            gate.open()
            got += b"".join([p async for p in parts])
            assert bytes(got) == b"".join(steady_events)  # every byte of the other stream
        await outcome_is(proxy.url, "completed", "steady")
        assert app.admission.active == 0
        await still_serves(proxy.url)
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "proxy" and r.levelno == logging.WARNING]
    assert [w for w in warnings if w.startswith("client stalled:")] == [
        w for w in warnings if f"client stalled: request_id={request_id} " in w]
    assert any(f"client stalled: request_id={request_id} " in w for w in warnings), warnings


async def test_slow_client_that_keeps_reading_is_never_cut() -> None:
    """Three times the client reads nothing for three read timeouts, so the proxy holds
    the upstream back that long (the flood never pauses by itself: every gap in what the
    proxy hands on is the client's); the client write timeout is longer. Neither timeout
    cuts the stream: it completes, every byte in order."""
    read_timeout, write_timeout, gap = 0.5, 5.0, 1.5
    flood = Flood(limit=12 << 20)
    upstream = RawUpstream({"flood": flood})
    with upstream.running(), run_proxy(upstream.url, loop="uvloop", read_timeout=read_timeout,
                                       client_write_timeout=write_timeout,
                                       itl_buckets=(read_timeout,)) as (proxy, _):
        sock, _ = await raw_request(proxy.port, chat("flood"), rcvbuf=256 << 10)
        gaps = 0

        async def pace(received: int) -> None:
            nonlocal gaps
            if gaps < 3 and received > (gaps + 1) * (2 << 20):
                gaps += 1
                await anyio.sleep(gap)  # the slow client under test: it reads nothing

        with sock:
            body, error = await read_to_end(sock, pace=pace, within=120)
        assert error is None and gaps == 3
        assert flood.ended
        assert dechunk(body) == FLOOD_EVENT * (flood.sent // len(FLOOD_EVENT)) + DONE
        await outcome_is(proxy.url, "completed", "flood")
        # The proxy really held the stream back longer than the read timeout, three times.
        samples = await scrape(proxy.url)
        itl = "llm_proxy_inter_token_latency_seconds_bucket"
        longer = (metric(samples, itl, model="flood", le="+Inf")
                  - metric(samples, itl, model="flood", le=str(read_timeout)))
        assert longer >= 3


async def test_a_client_reading_slowly_all_along_is_never_cut() -> None:
    """A client that reads all the time, more slowly than the upstream sends: the
    kernel's send queue to it grows to megabytes, and the socket becomes writable again
    only once a good part of that drained, which takes longer than the client write
    timeout at this pace. The client took bytes all along, so it is not cut: every
    byte, completed. Before, only the transport's own buffer counted as progress, and
    such a client was cut as client_stalled with the end of its answer lost."""
    write_timeout, rate = 0.5, 800_000  # bytes a second the client takes
    flood = Flood(limit=6 << 20)
    upstream = RawUpstream({"flood": flood})
    with upstream.running(), run_proxy(upstream.url, loop="uvloop",
                                       client_write_timeout=write_timeout) as (proxy, _):
        sock, _ = await raw_request(proxy.port, chat("flood"), rcvbuf=None)
        loop, got, error = asyncio.get_running_loop(), bytearray(), None
        started = time.perf_counter()
        with sock:  # the slow client under test: 16 KiB at a time, at ``rate``
            async with asyncio.timeout(120):
                while True:
                    try:
                        part = await loop.sock_recv(sock, 16 << 10)
                    except ConnectionError as exc:
                        error = exc
                        break
                    if not part:
                        break
                    got += part
                    await anyio.sleep(max(0.0, started + len(got) / rate - time.perf_counter()))
        body = bytes(got)
        assert error is None and flood.ended
        assert dechunk(body) == FLOOD_EVENT * (flood.sent // len(FLOOD_EVENT)) + DONE
        await outcome_is(proxy.url, "completed", "flood")


def held_until(gate: Gate) -> Callable[[Conn], Awaitable[None]]:
    """An upstream handler that sends one token, then waits for ``gate`` to finish."""

    async def hold(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(content_event(" held"))
        await gate.wait()
        await conn.chunk(b"data: [DONE]\n\n")
        await conn.end()

    return hold


async def test_client_disconnect_while_queued_makes_no_upstream_request() -> None:
    gate = Gate()
    hold = held_until(gate)
    upstream = RawUpstream({"hold": hold})
    with upstream.running(), run_proxy(upstream.url, max_concurrency=1, max_queue=10) as (proxy, app):
        async with client() as c, c.stream(
                "POST", proxy.url + CHAT, content=chat("hold")) as holder:
            parts, got = holder.aiter_raw(), bytearray()
            await read_until(parts, got, lambda b: b" held" in b)
            # A second request waits for the only slot ...
            _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            body = chat("queued")
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
            assert await wait_metric(proxy.url, "llm_proxy_in_flight_requests", 2) == 2
            assert app.admission.active == 1
            # ... and its client gives up.
            writer.close()
            await outcome_is(proxy.url, "client_disconnected", "queued")
            assert metric(await scrape(proxy.url), "llm_proxy_in_flight_requests") == 1
            gate.open()
            got += b"".join([p async for p in parts])
            assert got.endswith(b"data: [DONE]\n\n")
        assert upstream.seen("queued") == []
        assert app.admission.waiting == 0
        await still_serves(proxy.url)  # the slot was handed back
        assert app.admission.active == 0


@pytest.mark.parametrize("body", [
    b"this is not json", b"[1, 2, 3]", b'{"model": "\xff\xfe", "stream": true}', b"",
    b'"just a string"', b'{"model": ' * 5000,
], ids=["text", "array", "invalid-utf8", "empty", "string", "deep"])
async def test_bad_request_bodies_are_forwarded_not_500(body: bytes) -> None:
    async def reject(conn: Conn) -> None:  # what a real upstream does with such a body
        payload = b'{"error":{"message":"invalid body","type":"invalid_request_error"}}'
        await conn.head(400, content_type="application/json", length=len(payload))
        await conn.write(payload)

    upstream = RawUpstream({"": reject})
    with upstream.running(), run_proxy(upstream.url) as (proxy, _):
        async with client() as c:
            r = await c.post(proxy.url + CHAT, content=body,
                             headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "invalid body"
        assert [s.body for s in upstream.requests] == [body]  # unchanged
        await wait_metric(proxy.url, "llm_proxy_requests_total", 1, model="unknown", code="400")
        await still_serves(proxy.url)


async def _raw_exchange(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send ``head`` (without its blank line) and ``body`` on a raw socket with
    ``connection: close``; return the status and the de-chunked response body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + b"connection: close\r\n\r\n" + body)
        await writer.drain()
        async with asyncio.timeout(10):
            response = await reader.read()  # until the proxy closes
    finally:
        writer.close()
    top, _, rest = response.partition(b"\r\n\r\n")
    if re.search(rb"(?i)transfer-encoding: *chunked", top):
        out = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            out, rest = out + rest[:size], rest[size + 2:]
        rest = out
    return int(top.split(b" ", 2)[1]), rest


@pytest.mark.parametrize("how", ["declared", "declared-huge-unsent", "chunked"])
async def test_body_above_limit_gets_413(how: str) -> None:
    upstream = RawUpstream()
    with upstream.running(), run_proxy(upstream.url, max_body_bytes=1024) as (proxy, _):
        port = proxy.port
        big = chat("big", padding="x" * 2000)
        if how == "declared":
            status, resp = await _raw_exchange(
                port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-length: %d\r\n" % len(big), big)
        elif how == "declared-huge-unsent":  # answered without waiting for the body
            status, resp = await _raw_exchange(
                port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-length: 10000000000\r\n")
        else:
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + 100]), big[i:i + 100])
                              for i in range(0, len(big), 100)) + b"0\r\n\r\n"
            status, resp = await _raw_exchange(
                port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"transfer-encoding: chunked\r\n", chunks)
        assert status == 413
        assert openai_error(resp)["code"] == "request_too_large"
        assert upstream.requests == []
        await wait_metric(proxy.url, "llm_proxy_requests_total", 1, code="413")
        await still_serves(proxy.url)


async def test_slow_body_gets_408() -> None:
    upstream = RawUpstream()
    with upstream.running(), run_proxy(upstream.url, body_timeout=0.5) as (proxy, _):
        t = time.perf_counter()
        status, resp = await _raw_exchange(
            proxy.port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-length: 100\r\n", b'{"model": "sl')  # ... and nothing more
        assert status == 408 and time.perf_counter() - t >= 0.5
        assert openai_error(resp)["code"] == "body_timeout"
        assert upstream.requests == []
        await wait_metric(proxy.url, "llm_proxy_requests_total", 1, code="408")
        await still_serves(proxy.url)


async def test_a_refusal_that_leaves_the_body_unread_closes_the_connection() -> None:
    """A keep-alive client whose body is too slow (408) or too large (413): the answer
    has its length and says connection: close, and the proxy closes (as nginx does),
    rather than keep a connection whose unread body it would go on receiving."""
    upstream = RawUpstream()
    with upstream.running(), run_proxy(upstream.url, body_timeout=0.5,
                                       max_body_bytes=1024) as (proxy, _):
        for head, body, status in [
                (b"content-length: 100\r\n", b'{"model": "sl', 408),
                (b"content-length: 10000000000\r\n", b"", 413)]:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + head
                             + b"\r\n" + body)
                await writer.drain()
                async with asyncio.timeout(AT_ONCE_S):
                    response = await reader.read()  # until the proxy closes
            finally:
                writer.close()
            top, _, rest = response.partition(b"\r\n\r\n")
            assert top.startswith(b"HTTP/1.1 %d " % status)
            assert re.search(rb"(?i)\r\nconnection: *close\r\n", top + b"\r\n"), top
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", top)
            assert length is not None and int(length[1]) == len(rest), top
            assert openai_error(rest)["code"] in ("body_timeout", "request_too_large")
        await still_serves(proxy.url)


async def test_headers_above_limit_get_431() -> None:
    upstream = RawUpstream()
    with upstream.running(), run_proxy(upstream.url, max_header_bytes=2048) as (proxy, _):
        status, resp = await _raw_exchange(
            proxy.port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-filler: %s\r\n" % (b"f" * 3000))
        assert status == 431
        assert openai_error(resp)["code"] == "headers_too_large"
        assert upstream.requests == []
        await still_serves(proxy.url)


async def test_upstream_connection_limit_holds() -> None:
    """With every upstream connection busy, a request waits for one at most the connect
    timeout, then gets an OpenAI-shaped error; the proxy never opens more than the limit."""
    gate = Gate()
    hold = held_until(gate)
    upstream = RawUpstream({"hold": hold})
    with upstream.running(), run_proxy(upstream.url, max_upstream_connections=1,
                                       connect_timeout=0.5) as (proxy, _):
        async with client() as c, c.stream("POST", proxy.url + CHAT, content=chat("hold")) as r:
            parts, got = r.aiter_raw(), bytearray()
            await read_until(parts, got, lambda b: b" held" in b)
            t = time.perf_counter()
            status, _, body, _ = await read_stream(proxy.url, chat("waits"))
            assert time.perf_counter() - t < 0.5 + AT_ONCE_S  # not until a connection frees
            # A wait for a free connection is told apart from a failed connect.
            assert (status, openai_error(body)["code"]) == (504, "upstream_pool_timeout")
            await outcome_is(proxy.url, "pool_timeout", "waits")
            assert upstream.connections == 1
            gate.open()
            got += b"".join([p async for p in parts])
            assert got.endswith(b"data: [DONE]\n\n")
        await still_serves(proxy.url)
        assert upstream.seen("waits") == []


# ---------------------------------------------------------------------------
# SIGTERM with streams in flight (the real command in a subprocess)


async def test_sigterm_stops_accepting_lets_streams_finish_exits_0() -> None:
    gate = Gate()
    events = stream_events(4, usage=True)

    async def hold(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(events[0] + events[1])
        await gate.wait()
        for ev in events[2:]:
            await conn.chunk(ev)
        await conn.end()

    upstream = RawUpstream({"hold": hold})
    with upstream.running():
        async with proxy_process(upstream.url, "--graceful-timeout", "10",
                                 "--log-requests", "-") as (proc, port, out):
            base = f"http://127.0.0.1:{port}"
            async with client() as c, c.stream(
                    "POST", base + CHAT, content=chat("hold")) as r:
                parts, got = r.aiter_raw(), bytearray()
                await read_until(parts, got, lambda b: b == events[0] + events[1])
                proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + AT_ONCE_S
                while not refuses(port):  # waiting for the signal to take effect
                    assert time.monotonic() < deadline, "still accepting after SIGTERM"
                    await anyio.sleep(0.01)
                assert proc.poll() is None, "exited with a stream in flight"
                gate.open()
                async for part in parts:
                    got += part
            # The client never asked for usage, so the proxy removed the usage event.
            usage_event = events[-2]
            assert bytes(got) == b"".join(e for e in events if e != usage_event)
            code = await anyio.to_thread.run_sync(proc.wait, AT_ONCE_S)
            assert code == 0
        records = [json.loads(line) for line in out if line.startswith("{")]
        assert [(r["model"], r["outcome"], r["status"]) for r in records] == [("hold", "completed", 200)]


async def test_a_client_that_gives_up_while_queued_still_counts_its_wait() -> None:
    """--max-concurrency 1, one stream holding the slot: a second stream's client gives
    up while queued. Its wait is a queue time (the queue histogram under overload held
    only those that got a slot, the ones that waited least) and a wait without a first
    token (the TTFT SLO's miss); before, neither saw it, only a 499."""
    async def stuck(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(content_event(" stuck"))
        await conn.until_closed(NEVER_S)

    upstream = RawUpstream({"stuck": stuck})
    with upstream.running(), run_proxy(upstream.url, max_concurrency=1) as (proxy, _):
        async with client() as c, c.stream("POST", proxy.url + CHAT,
                                           content=chat("stuck")) as r:
            parts = r.aiter_raw()  # kept: an iterator dropped closes the stream
            await read_until(parts, bytearray(), lambda b: b" stuck" in b)
            body = chat("queued")
            with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                             b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
                await wait_metric(proxy.url, "llm_proxy_in_flight_requests", 2)  # it waits
            # closed: the client gave up
            await outcome_is(proxy.url, "client_disconnected", "queued")
            samples = await scrape(proxy.url)
        assert upstream.seen("queued") == []
        assert metric(samples, "llm_proxy_queue_time_seconds_count", model="queued") == 1
        assert metric(samples, "llm_proxy_queue_time_seconds_sum", model="queued") > 0
        assert metric(samples, "llm_proxy_wait_without_first_token_seconds_count",
                      model="queued") == 1


async def test_sigterm_grace_period_ends_stuck_streams_exits_0() -> None:
    """A stream stuck past the grace period is cut, and a request still queued behind it
    (--max-concurrency 1) gets a 503 in the OpenAI shape; neither makes a traceback.
    Before, the queued client got uvicorn's plain-text 500 (while the metrics said 503)
    and each cut request logged "Exception in ASGI application"."""
    async def stuck(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(content_event(" stuck"))
        await conn.until_closed(NEVER_S)

    upstream = RawUpstream({"stuck": stuck})
    with upstream.running():
        async with proxy_process(upstream.url, "--graceful-timeout", "1",
                                 "--max-concurrency", "1") as (proc, port, out):
            base = f"http://127.0.0.1:{port}"
            async with client() as c, c.stream("POST", base + CHAT, content=chat("stuck")) as r:
                parts = r.aiter_raw()
                await read_until(parts, bytearray(), lambda b: b" stuck" in b)
                queued = asyncio.ensure_future(c.post(base + CHAT, content=chat("queued")))
                await wait_metric(base, "llm_proxy_in_flight_requests", 2)  # queued, or relaying
                t = time.perf_counter()
                proc.send_signal(signal.SIGTERM)
                # well short of the upstream's NEVER_S: only the grace period ends it
                code = await anyio.to_thread.run_sync(proc.wait, 2 * AT_ONCE_S)
                elapsed = time.perf_counter() - t
                answer = await queued
            assert code == 0
            assert 1.0 <= elapsed < 1.0 + AT_ONCE_S
            stuck_conn = upstream.seen("stuck")[0]
            assert await anyio.to_thread.run_sync(stuck_conn.closed.wait, AT_ONCE_S)
            assert answer.status_code == 503
            assert openai_error(answer.content)["code"] == "proxy_shutting_down"
            assert upstream.seen("queued") == []
    assert not [line for line in out if "Exception in ASGI application" in line], "".join(out)
