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
import random
import re
import signal
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import anyio
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import ProxyApp, create_app
from proxy.config import Settings
from proxy.sse import DEFAULT_MAX_EVENT_BYTES, SSEParser
from tests.fake_upstream import Conn, Gate, RawUpstream, content_event, stream_events
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
def run_proxy(upstream_url: str, **overrides: object) -> Iterator[tuple[RunningServer, ProxyApp]]:
    """The proxy (fresh registry) in a real uvicorn server in front of ``upstream_url``."""
    settings = Settings(upstream=upstream_url + "/v1", **overrides)  # type: ignore[arg-type]
    app = create_app(settings, registry=CollectorRegistry())
    with serve_in_thread(app, timeout_graceful_shutdown=2) as server:
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
        await outcome_is(proxy.url, "upstream_error", "refused")
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
        await wait_metric(proxy.url, "llm_proxy_stream_outcomes_total", 2, outcome="upstream_error")
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
        await outcome_is(proxy.url, "timeout", "silent")
        await still_serves(proxy.url)


# ---------------------------------------------------------------------------
# Upstream faults mid-stream


async def test_upstream_stalls_mid_stream_client_keeps_bytes_outcome_timeout() -> None:
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
        await outcome_is(proxy.url, "timeout", "stall")
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
        await outcome_is(proxy.url, "upstream_error", "fail")
        await wait_metric(proxy.url, "llm_proxy_requests_total", 1, code=str(status))
        await still_serves(proxy.url)


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
        await outcome_is(proxy.url, "completed", "hostile")
        await still_serves(proxy.url)

    # The same bytes, cut the way a socket might cut them, keep the parser's memory bounded.
    parser, data, peak = SSEParser(), b"".join(parts), 0
    for i in range(0, len(data), 65536):
        parser.feed(data[i:i + 65536])
        peak = max(peak, parser.buffered_bytes)
    assert peak <= DEFAULT_MAX_EVENT_BYTES + 64


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
        await still_serves(proxy.url)


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


async def test_sigterm_grace_period_ends_stuck_streams_exits_0() -> None:
    async def stuck(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(content_event(" stuck"))
        await conn.until_closed(NEVER_S)

    upstream = RawUpstream({"stuck": stuck})
    with upstream.running():
        async with proxy_process(upstream.url, "--graceful-timeout", "1") as (proc, port, _):
            async with client() as c, c.stream(
                    "POST", f"http://127.0.0.1:{port}{CHAT}", content=chat("stuck")) as r:
                parts = r.aiter_raw()
                await read_until(parts, bytearray(), lambda b: b" stuck" in b)
                t = time.perf_counter()
                proc.send_signal(signal.SIGTERM)
                # well short of the upstream's NEVER_S: only the grace period ends it
                code = await anyio.to_thread.run_sync(proc.wait, 2 * AT_ONCE_S)
                elapsed = time.perf_counter() - t
            assert code == 0
            assert 1.0 <= elapsed < 1.0 + AT_ONCE_S
            stuck_conn = upstream.seen("stuck")[0]
            assert await anyio.to_thread.run_sync(stuck_conn.closed.wait, AT_ONCE_S)
