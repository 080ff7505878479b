"""The upstream client (:mod:`proxy.wire`) on real loopback sockets.

Each test scripts an upstream as an asyncio server on the test's own event loop: a
handler per accepted connection that writes exact bytes, so framing, keep-alive, resets
and stalls are real socket events, and the server counts the connections it accepted.
Sharing one loop keeps the order deterministic: what the server wrote is readable by
the client on the loop's next turn, and "the client has seen these bytes" is an
``asyncio.Event`` set from the client's own callback, never a sleep.

Requests are built with :func:`proxy.wire.http11.serialize` and sent with
:meth:`WireTransport.exchange`, as :class:`proxy.upstream.UpstreamClient` does; bodies are read
with :meth:`WireBody.pipe` (a sink per read) or :meth:`WireBody.read` (all at once).

The last test runs the proxy under real uvicorn and proves the relay's direct path
(:class:`proxy.uvicorn_writer.DirectWriter`) engages with the installed uvicorn, so an
upgrade that changes uvicorn's internals fails here instead of silently taking the slow
path.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import re
import socket
import struct
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

import proxy.relay
import proxy.routes
from proxy.app import create_app
from proxy.config import Settings, single_spec
from proxy.upstream import UpstreamClient
from proxy.uvicorn_writer import DirectWriter
from proxy.wire.connection import HOLD_BUFFER, ConnectionState
from proxy.wire.endpoint import Endpoint
from proxy.wire.errors import (
    ConnectError,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    ResponseHeadTooLarge,
    SinkStopped,
    UpstreamError,
)
from proxy.wire.http11 import DECODE_PIECE, GO, MAX_HEAD_BYTES, PAUSE, STOP, serialize
from proxy.wire.pool import WireTransport
from proxy.wire.response import WireResponse
from tests.raw_upstream import Conn, RawUpstream, closed_port, content_event
from tests.servers import serve_in_thread

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]

# The most one data_received call brings: 256 KiB for asyncio's selector transport,
# 256,000 bytes for uvloop's.
READ_MAX = 256 * 1024
# Large enough for every whole body read in this file.
LIMIT = 64 * 1024 * 1024

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
                   "http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture(params=[pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
                        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """Both loops: the proxy serves on uvloop (``proxy.serve``), tests elsewhere on asyncio."""
    return request.param  # type: ignore[no-any-return]


def no_environment_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy set in the test machine's environment must not reroute the upstream."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------
# A scripted upstream on the test's loop


@dataclass
class Scripted:
    port: int = 0
    accepted: int = 0
    requests: list[tuple[int, bytes]] = field(default_factory=list)  # (connection, raw request)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint("http", "127.0.0.1", self.port)

    def paths(self, connection: int | None = None) -> list[bytes]:
        return [raw.split(b" ", 2)[1] for n, raw in self.requests
                if connection is None or n == connection]

    async def read_request(self, n: int, reader: asyncio.StreamReader) -> bytes | None:
        """One request's exact bytes (head and Content-Length body); None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)\r\n", head)
        raw = head + (await reader.readexactly(int(length[1])) if length else b"")
        self.requests.append((n, raw))
        return raw


Handler = Callable[[Scripted, int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[Scripted]:
    """Serve ``handler(upstream, n, reader, writer)`` for the n-th accepted connection."""
    up = Scripted()
    tasks: set[asyncio.Task[Any]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(up, up.accepted, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # the test is over: drop what was not sent
            writer.transport.abort()
        finally:
            tasks.discard(task)
            writer.close()  # a FIN once what was written is sent

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    up.port = server.sockets[0].getsockname()[1]
    try:
        yield up
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        async with asyncio.timeout(5):  # uvloop waits for open connections here
            await server.wait_closed()


def ok(body: bytes, *headers: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), b"".join(h + b"\r\n" for h in headers), body)


def answering(respond: Callable[[bytes], bytes] = lambda raw: ok(raw.split(b" ", 2)[1])) -> Handler:
    """Keep-alive: answer every request on the connection with ``respond(raw request)``."""

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        while (raw := await up.read_request(n, reader)) is not None:
            writer.write(respond(raw))
            await writer.drain()

    return handler


async def until_eof(reader: asyncio.StreamReader, closed: asyncio.Event) -> None:
    """Read until the client closes (FIN or RST), then set ``closed``."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(65536):
            pass
    closed.set()


def reset(writer: asyncio.StreamWriter) -> None:
    """Abort with an RST (SO_LINGER 0)."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def settled(value: Callable[[], object], *, turns: int = 50, within: float = 5.0) -> None:
    """Return once ``value()`` has stayed the same for ``turns`` turns of the loop in a row
    (the scripted server is stuck: nothing it waits for is happening)."""
    async with asyncio.timeout(within):
        last, same = value(), 0
        while same < turns:
            await asyncio.sleep(0)  # one turn of the loop, not a wait for time to pass
            now = value()
            same = same + 1 if now == last else 0
            last = now


async def until(condition: Callable[[], bool], *, within: float = 5.0) -> None:
    """Return once ``condition()`` holds, checked once per turn of the loop."""
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 (the client's own state: it has no event)
            await asyncio.sleep(0)


class Raised:
    """Equal to any exception of ``cls``: compares a (body, error) pair in one assert."""

    def __init__(self, cls: type[BaseException]) -> None:
        self.cls = cls

    def __eq__(self, other: object) -> bool:
        return isinstance(other, self.cls)

    def __repr__(self) -> str:
        return f"<any {self.cls.__name__}>"




# ---------------------------------------------------------------------------
# The client side


def request(method: str, endpoint: Endpoint, target: str, body: bytes = b"",
            headers: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    """A request as ``UpstreamClient.open`` builds it: ``serialize``, Host from the endpoint."""
    return serialize(method, target.encode(), str(endpoint).encode(), list(headers), body)


class Wire:
    """A WireTransport with the test's defaults: one connection, 2 s timeouts."""

    def __init__(self, **options: Any) -> None:
        self.transport = WireTransport(**{"max_connections": 1, "connect_timeout": 2.0,
                                          "read_timeout": 2.0, **options})

    async def send(self, method: str, endpoint: Endpoint, target: str,
                   body: bytes = b"") -> WireResponse:
        return await self.transport.exchange(method, endpoint,
                                             request(method, endpoint, target, body))

    async def fetch(self, method: str, endpoint: Endpoint, target: str,
                    body: bytes = b"") -> tuple[int, bytes]:
        response = await self.send(method, endpoint, target, body)
        try:
            return response.status_code, await response.body.read(LIMIT)
        finally:
            await response.aclose()


@contextlib.asynccontextmanager
async def wire(**options: Any) -> AsyncIterator[Wire]:
    w = Wire(**options)
    try:
        yield w
    finally:
        await w.transport.aclose()


async def consume(response: WireResponse, mode: str = "pipe",
                  on_chunk: Callable[[bytes], None] | None = None
                  ) -> tuple[bytes, UpstreamError | None]:
    """The body, read by ``pipe`` with a sink that never pauses or by ``read``, and the
    error that ended it. ``read`` hands on nothing when the body fails: it is all or
    nothing."""
    got = bytearray()

    def sink(chunk: bytes) -> int:
        got.extend(chunk)
        if on_chunk is not None:
            on_chunk(bytes(got))
        return GO

    error: UpstreamError | None = None
    try:
        if mode == "pipe":
            assert await response.body.pipe(sink), "pipe paused though the sink never did"
        else:
            got += await response.body.read(LIMIT)
    except UpstreamError as exc:
        error = exc
    finally:
        await response.aclose()
    return bytes(got), error


@pytest.fixture(params=["pipe", "read"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def before_failure(mode: str, got: bytes) -> bytes:
    """What ``consume`` returns of a body that failed after ``got`` arrived."""
    return got if mode == "pipe" else b""


# ---------------------------------------------------------------------------
# The pool


async def test_sequential_requests_reuse_one_connection(mode: str) -> None:
    async with scripted(answering()) as up, wire() as w:
        for path in ("/a", "/b", "/c"):
            response = await w.send("GET", up.endpoint, path)
            assert await consume(response, mode) == (path.encode(), None)
        assert up.accepted == 1
        assert up.paths(1) == [b"/a", b"/b", b"/c"]


async def test_concurrent_requests_open_connections_then_reuse_them() -> None:
    async with scripted(answering()) as up, wire(max_connections=2) as w:
        for _ in range(3):
            first, second = await asyncio.gather(w.send("GET", up.endpoint, "/1"),
                                                 w.send("GET", up.endpoint, "/2"))
            assert [await consume(r) for r in (first, second)] == [(b"/1", None), (b"/2", None)]
        assert up.accepted == 2
        assert sorted(up.paths()) == [b"/1"] * 3 + [b"/2"] * 3


async def test_connection_close_header_is_not_reused() -> None:
    closed = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        writer.write(ok(b"bye", b"connection: close") if n == 1 else ok(b"hello"))
        await until_eof(reader, closed)  # the socket stays open: only the header says close

    async with scripted(handler) as up, wire() as w:
        assert await w.fetch("GET", up.endpoint, "/1") == (200, b"bye")
        async with asyncio.timeout(5):
            await closed.wait()  # the client closed it ...
        assert await w.fetch("GET", up.endpoint, "/2") == (200, b"hello")
        assert up.accepted == 2  # ... and opened a new one


@pytest.mark.parametrize("read_first", [False, True], ids=["headers-only", "part-of-body"])
async def test_abandoned_response_closes_its_connection(read_first: bool) -> None:
    closed = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if n == 1:
            await up.read_request(n, reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345")
            await until_eof(reader, closed)
        else:
            await answering()(up, n, reader, writer)

    async with scripted(handler) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/abandoned")
        if read_first:
            got: list[bytes] = []
            assert not await response.body.pipe(lambda chunk: got.append(chunk) or PAUSE)
            assert got == [b"12345"]
        await response.aclose()
        async with asyncio.timeout(5):
            await closed.wait()
        assert await w.fetch("GET", up.endpoint, "/next") == (200, b"/next")
        assert up.accepted == 2


async def test_idle_connection_closed_by_upstream_is_not_reused() -> None:
    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        writer.write(ok(b"once"))
        await writer.drain()
        writer.close()  # keep-alive answer, then the upstream closes the idle connection

    async with scripted(handler) as up, wire() as w:
        assert await w.fetch("GET", up.endpoint, "/1") == (200, b"once")
        closed = ConnectionState.CLOSED
        await settled(lambda: all(c.state is closed for c in w.transport.idle.get(up.endpoint, [])))
        assert all(c.state is closed for c in w.transport.idle[up.endpoint])
        # Not even a POST fails: the pool noticed the close and connects afresh.
        assert await w.fetch("POST", up.endpoint, "/2", b"{}") == (200, b"once")
        assert up.accepted == 2


async def test_body_larger_than_the_read_limit_is_a_read_error() -> None:
    async with scripted(answering(lambda raw: ok(b"x" * 100))) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/")
        with pytest.raises(ReadError, match="larger than 99 bytes"):
            await response.body.read(99)
        await response.aclose()
        assert await w.fetch("GET", up.endpoint, "/") == (200, b"x" * 100)
        assert up.accepted == 2  # the half-read connection was not reused


# ---------------------------------------------------------------------------
# Framing


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
async def test_bodies_arrive_complete(framing: str, mode: str) -> None:
    parts = [b"first part,", b"second part,", b"x" * 70_000, b"last"]
    body = b"".join(parts)

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        while await up.read_request(n, reader) is not None:
            if framing == "length":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
            elif framing == "chunked":
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            else:  # no length: the body ends when the connection does
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n")
            for part in parts:
                await writer.drain()
                writer.write(b"%x;ext=1\r\n%s\r\n" % (len(part), part) if framing == "chunked"
                             else part)
            if framing == "chunked":
                writer.write(b"0\r\nx-trailer: t\r\n\r\n")
            await writer.drain()
            if framing == "close":
                return

    async with scripted(handler) as up, wire() as w:
        for _ in range(2):
            response = await w.send("GET", up.endpoint, "/")
            assert response.status_code == 200
            assert await consume(response, mode) == (body, None)
        assert up.accepted == (2 if framing == "close" else 1)


# ---------------------------------------------------------------------------
# Transfer codings other than plain chunked (RFC 9112 section 6.3)


EVENTS = [b"data: {\"n\": %d, \"text\": \"%s\"}\n\n" % (i, b"tok" * i) for i in range(40)]


def coded(parts: Sequence[bytes], coding: str) -> list[bytes]:
    """``parts`` under a transfer coding, flushed after each part (as a streaming server
    flushes its compressor per event), so each coded piece decodes to exactly its part."""
    if coding == "gzip-members":  # one gzip member per part, concatenated
        return [gzip.compress(part) for part in parts]
    wbits = {"gzip": 31, "deflate": 15, "raw-deflate": -15}[coding]
    z = zlib.compressobj(wbits=wbits)
    pieces = [z.compress(part) + z.flush(zlib.Z_SYNC_FLUSH) for part in parts]
    pieces[-1] += z.flush()
    return pieces


CODINGS = [  # (Transfer-Encoding fields, how the body is coded, chunked last)
    ([b"gzip, chunked"], "gzip", True),
    ([b"gzip, chunked", b"chunked"], "gzip", True),  # chunked named twice, applied once
    ([b"x-gzip, chunked"], "gzip", True),
    ([b"Gzip ,CHUNKED"], "gzip", True),
    ([b"gzip", b"chunked"], "gzip", True),  # two fields: one list
    ([b"gzip, chunked"], "gzip-members", True),
    ([b"deflate, chunked"], "deflate", True),
    ([b"deflate, chunked"], "raw-deflate", True),
    ([b"gzip"], "gzip", False),  # not chunked last: the body ends with the connection
    ([b"deflate"], "deflate", False),
    ([b"identity, gzip"], "gzip", False),
]


@pytest.mark.parametrize(("fields", "coding", "chunked"), CODINGS,
                         ids=[f"{b'+'.join(f).decode()}-{c}" for f, c, _ in CODINGS])
async def test_transfer_codings_are_undone_as_the_body_arrives(
        fields: list[bytes], coding: str, chunked: bool) -> None:
    """Each coded piece is decoded and handed on when it arrives (the upstream sends the
    next one only once the client has the last), not when the body ends; a chunked body
    leaves its connection reusable, a close-delimited one ends with it."""
    pieces = coded(EVENTS, coding)
    have: asyncio.Queue[int] = asyncio.Queue()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        while await up.read_request(n, reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         + b"".join(b"transfer-encoding: %s\r\n" % f for f in fields) + b"\r\n")
            for i, piece in enumerate(pieces):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                await writer.drain()
                async with asyncio.timeout(5):
                    while await have.get() < i:  # the client decoded event i
                        pass
            if not chunked:
                return
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    def seen(got: bytes) -> None:
        have.put_nowait(sum(got.startswith(b"".join(EVENTS[:k + 1])) for k in range(len(EVENTS))) - 1)

    async with scripted(handler) as up, wire() as w:
        for _ in range(2):
            response = await w.send("GET", up.endpoint, "/")
            assert response.status_code == 200
            assert await consume(response, "pipe", seen) == (b"".join(EVENTS), None)
        assert up.accepted == (1 if chunked else 2)


@pytest.mark.parametrize("fault", ["cut-at-close", "cut-in-chunked", "corrupt", "after-deflate"])
async def test_a_broken_transfer_coding_fails_the_body_after_what_decoded(
        fault: str, mode: str) -> None:
    """What decoded before the fault is handed on (pipe; the fault comes in a read of its
    own, as the output of a read whose coded data is invalid is lost with it); the body
    fails (a cut coding is a ReadError: the upstream stopped early; invalid data a
    RemoteProtocolError), and the connection is not pooled."""
    pieces = coded(EVENTS[:3], "deflate" if fault == "after-deflate" else "gzip")
    if fault == "corrupt":
        pieces[2] = b"\xff" * len(pieces[2])
    elif fault == "after-deflate":
        pieces.append(b"more")
    else:
        pieces.pop()  # the end of the coded data never comes
    good = b"".join(EVENTS[:2 if fault != "after-deflate" else 3])
    chunked = fault != "cut-at-close"
    fields = b"%s%s" % (b"deflate" if fault == "after-deflate" else b"gzip",
                        b", chunked" if chunked else b"")
    decoded = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if n > 1:
            await answering()(up, n, reader, writer)
            return
        await up.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: %s\r\n\r\n" % fields)
        for i, piece in enumerate(pieces):
            if i == 2 and fault in ("corrupt", "after-deflate") and mode == "pipe":
                await decoded.wait()  # the client has what came before the fault
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await until_eof(reader, asyncio.Event())

    async with scripted(handler) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/")
        got, error = await consume(response, mode, lambda got: decoded.set()
                                   if got == b"".join(EVENTS[:2]) else None)
        assert got == before_failure(mode, good)
        expected = RemoteProtocolError if fault in ("corrupt", "after-deflate") else ReadError
        assert type(error) is expected
        assert await w.fetch("GET", up.endpoint, "/next") == (200, b"/next")
        assert up.accepted == 2


async def test_chunked_named_twice_is_read_as_chunked() -> None:
    """``Transfer-Encoding: chunked`` repeated (frameworks do it), the body chunked once."""
    answer = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked"
              b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    async with scripted(answering(lambda raw: answer)) as up, wire() as w:
        for _ in range(2):
            assert await w.fetch("GET", up.endpoint, "/") == (200, b"hello")
        assert up.accepted == 1


@pytest.mark.parametrize("fields", [b"br, chunked", b"compress", b"zstd", b"chunked, gzip",
                                    b"gzip, gzip, chunked", b"chunked;ext=1",
                                    b"gzip;level=9, chunked"])
async def test_an_unsupported_transfer_coding_is_refused_before_the_body(fields: bytes) -> None:
    answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: %s\r\n\r\n3\r\nabc\r\n0\r\n\r\n" % fields
    async with scripted(answering(lambda raw: answer)) as up, wire() as w:
        for _ in range(2):  # and the slot came back
            with pytest.raises(RemoteProtocolError, match="unsupported transfer coding"):
                await w.send("GET", up.endpoint, "/")


@pytest.mark.parametrize("lines", [[b"chunked, identity"], [b"chunked", b"identity"],
                                   [b"chunked, "], [b"chunked\t"], [b"chunked ,"]],
                         ids=["identity-last", "identity-line", "comma-last", "tab", "space-comma"])
async def test_chunked_not_last_to_the_parser_is_refused_before_the_body(
        lines: list[bytes]) -> None:
    """The parser reads each of these until the close, not as chunked (``chunked,
    identity`` ends in identity; llhttp's own corners for the others): a client that
    decided "chunked" from its own reading of the value handed the chunk framing on as
    content and called a complete answer interrupted. Refused, like any coding with
    chunked not last, before a byte goes to the client."""
    fields = b"".join(b"transfer-encoding: %s\r\n" % v for v in lines)
    answer = b"HTTP/1.1 200 OK\r\n%s\r\n3\r\nabc\r\n0\r\n\r\n" % fields
    async with scripted(answering(lambda raw: answer if raw.startswith(b"GET /te")
                                  else ok(b"after"))) as up, wire() as w:
        with pytest.raises(RemoteProtocolError, match="transfer coding"):
            await w.send("GET", up.endpoint, "/te")
        assert await w.fetch("GET", up.endpoint, "/after") == (200, b"after")


@pytest.mark.parametrize("fields", [b"identity, chunked", b"Chunked", b", chunked", b"CHUNKED "])
async def test_chunked_last_to_the_parser_is_read_as_chunked(fields: bytes) -> None:
    answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: %s\r\n\r\n3\r\nabc\r\n0\r\n\r\n" % fields
    async with scripted(answering(lambda raw: answer)) as up, wire() as w:
        for _ in range(2):
            assert await w.fetch("GET", up.endpoint, "/") == (200, b"abc")
        assert up.accepted == 1


TRAILERS = b"x-queue-time: 5000\r\nx-trailer: 1\r\n\r\n"


@pytest.mark.parametrize("together", [True, False], ids=["same-read", "later-read"])
async def test_trailers_never_become_response_headers(together: bool) -> None:
    """Trailer fields after a chunked body are read and dropped: none joins the
    response's headers (those in the head's read would reach the client as headers), and
    the connection, its response complete, is reused."""
    head = b"HTTP/1.1 200 OK\r\nx-head: 1\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"5\r\nhello\r\n0\r\n"

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        while await up.read_request(n, reader) is not None:
            parts = [head + body + TRAILERS] if together else [head, body, TRAILERS]
            for part in parts:
                writer.write(part)
                await writer.drain()
                for _ in range(3):
                    await asyncio.sleep(0)  # let the client read each part on its own

    async with scripted(handler) as up, wire() as w:
        for _ in range(2):
            response = await w.send("GET", up.endpoint, "/")
            assert await consume(response) == (b"hello", None)
            assert response.headers.raw == [(b"x-head", b"1"), (b"transfer-encoding", b"chunked")]
            assert response.headers.get("x-queue-time") == ""
        assert up.accepted == 1


@pytest.mark.parametrize("how", ["many-fields", "one-endless-field"])
async def test_a_trailer_flood_fails_at_the_cap_and_closes_the_connection(how: str) -> None:
    """Trailers that do not end: the body is handed on whole, then the response fails
    once 64 KiB came without a body byte, the connection is closed, and nothing of the
    flood was kept (the parser gathers one field's pieces until it ends, so one endless
    field is a flood too)."""
    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if n > 1:
            await answering()(up, n, reader, writer)
            return
        await up.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n")
        if how == "one-endless-field":
            writer.write(b"x-endless: ")
        while True:  # until the client closes: then the write fails
            piece = header_lines(8192) if how == "many-fields" else b"v" * 8192
            writer.write(piece)
            await writer.drain()

    tracemalloc.start()
    try:
        async with scripted(handler) as up, wire(read_timeout=30.0) as w:
            response = await w.send("GET", up.endpoint, "/flood")
            async with asyncio.timeout(10):  # stopped at the cap, not at the read timeout
                got, error = await consume(response)
            peak = tracemalloc.get_traced_memory()[1]
            assert got == b"hello"
            assert isinstance(error, ResponseHeadTooLarge)
            assert response.headers.raw == [(b"transfer-encoding", b"chunked")]
            assert await w.fetch("GET", up.endpoint, "/next") == (200, b"/next")
            assert up.accepted == 2
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024  # a flood kept whole passes this within the timeout


async def test_a_decompression_bomb_is_held_back_by_a_paused_sink() -> None:
    """16 MiB of zeros in a 16 KiB gzip body: the sink gets it in pieces of at most
    DECODE_PIECE, one per pipe while it pauses, and the connection stays reusable."""
    size = 16 * 1024 * 1024
    bomb = gzip.compress(b"\0" * size)
    answer = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
              b"%x\r\n%s\r\n0\r\n\r\n" % (len(bomb), bomb))
    async with scripted(answering(lambda raw: answer if raw.startswith(b"GET /bomb")
                                  else ok(b"after"))) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/bomb")
        calls: list[int] = []

        def sink(chunk: bytes) -> int:
            assert chunk == b"\0" * len(chunk)
            calls.append(len(chunk))
            return PAUSE

        pipes = 1
        while not await response.body.pipe(sink):
            assert len(calls) == pipes  # one piece per pipe: the pause holds the rest
            pipes += 1
        await response.aclose()
        assert sum(calls) == size and max(calls) <= DECODE_PIECE
        assert await w.fetch("GET", up.endpoint, "/after") == (200, b"after")
        assert up.accepted == 1


# An upstream that answers one request twice: the second answer's head, and part of
# its body (the connection would be left part-way through a message).
SECOND = b"HTTP/1.1 200 OK\r\nx-second: 1\r\ncontent-length: 50\r\n\r\nnot for anyone"
AFTER_THE_END = "sent bytes after the end of a response, before another request"


def after_the_end_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "proxy.wire" and AFTER_THE_END in r.getMessage()]


@pytest.mark.parametrize("extra", [SECOND, b"garbage\r\n\r\n"], ids=["second-response", "garbage"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_bytes_after_the_end_in_the_same_read(
        framing: str, extra: bytes, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    """The response stands as it ended, nothing after it is parsed into it (no second
    set of headers), and the connection is closed, never pooled."""
    body = b"data: first\n\n"
    first = (ok(body, b"x-first: 1") if framing == "length" else
             b"HTTP/1.1 200 OK\r\nx-first: 1\r\ntransfer-encoding: chunked\r\n\r\n"
             b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    closed = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if n > 1:
            await answering()(up, n, reader, writer)
            return
        await up.read_request(n, reader)
        writer.write(first + extra)  # one write: one read on the client's side
        await until_eof(reader, closed)

    async with scripted(handler) as up, wire() as w:
        with caplog.at_level(logging.WARNING, logger="proxy.wire"):
            response = await w.send("GET", up.endpoint, "/")
            length = [(b"content-length", b"%d" % len(body))] if framing == "length" else [
                (b"transfer-encoding", b"chunked")]
            assert sorted(response.headers.raw) == sorted([(b"x-first", b"1"), *length])
            assert await consume(response, mode) == (body, None)
        async with asyncio.timeout(5):
            await closed.wait()
        assert await w.fetch("GET", up.endpoint, "/next") == (200, b"/next")
        assert up.accepted == 2
    assert after_the_end_warnings(caplog) == [
        f"upstream 127.0.0.1:{up.port} {AFTER_THE_END}: the response stands as it ended, "
        "the connection is closed"]


@pytest.mark.parametrize("when", ["before-release", "idle"])
async def test_bytes_after_the_end_in_a_later_read(
        when: str, caplog: pytest.LogCaptureFixture) -> None:
    """The second answer comes in a read of its own: after the response ended but before
    the caller released it, or while the connection is idle in the pool. Either way the
    connection is closed; only the first is an upstream fault worth a warning (a server
    may send a 408 on an idle connection before it closes it)."""
    send_second = asyncio.Event()
    closed = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if n > 1:
            await answering()(up, n, reader, writer)
            return
        await up.read_request(n, reader)
        writer.write(ok(b"first"))
        await send_second.wait()
        writer.write(SECOND)
        await until_eof(reader, closed)

    async with scripted(handler) as up, wire() as w:
        with caplog.at_level(logging.WARNING, logger="proxy.wire"):
            response = await w.send("GET", up.endpoint, "/")
            assert await response.body.read(LIMIT) == b"first"
            conn = response.body._conn
            if when == "idle":
                await response.aclose()
                assert w.transport.idle[up.endpoint] == [conn]
            send_second.set()
            await until(lambda: conn.state is ConnectionState.CLOSED)
            await response.aclose()
        async with asyncio.timeout(5):
            await closed.wait()
        assert await w.fetch("GET", up.endpoint, "/next") == (200, b"/next")
        assert up.accepted == 2
    assert len(after_the_end_warnings(caplog)) == (1 if when == "before-release" else 0)


async def test_head_response_finishes_and_the_next_request_works() -> None:
    async with scripted(answering(lambda raw: b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n"
                                  if raw.startswith(b"HEAD") else ok(b"after head"))) as up, \
            wire(read_timeout=5.0) as w:
        response = await w.send("HEAD", up.endpoint, "/")
        assert response.headers.get("content-length") == "100"
        async with asyncio.timeout(2):  # finished at the headers, not at a read timeout
            assert await consume(response, "read") == (b"", None)
        assert await w.fetch("GET", up.endpoint, "/") == (200, b"after head")


@pytest.mark.parametrize("together", [True, False], ids=["one-write", "separate-writes"])
async def test_informational_responses_are_skipped(together: bool) -> None:
    interim = [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"]
    final = ok(b"done", b"x-final: 1")

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        while await up.read_request(n, reader) is not None:
            if together:
                writer.write(b"".join(interim) + final)
            else:
                for part in [*interim, final]:
                    writer.write(part)
                    await writer.drain()
                    for _ in range(3):
                        await asyncio.sleep(0)  # let the client read each part on its own
            await writer.drain()

    async with scripted(handler) as up, wire() as w:
        for _ in range(2):
            response = await w.send("POST", up.endpoint, "/", b"{}")
            assert response.status_code == 200
            assert response.headers.raw == [(b"content-length", b"4"), (b"x-final", b"1")]
            assert await consume(response, "read") == (b"done", None)
        assert up.accepted == 1


# ---------------------------------------------------------------------------
# The one retry


def close_on_second_request(answer_second_connection: bytes = b"") -> Handler:
    """Connection 1: answer the first request (keep-alive), read the second, close
    without a byte of answer (the upstream dropped the idle connection as it was reused).
    Connection 2 onwards: answer normally."""

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if n > 1:
            await answering()(up, n, reader, writer)
            return
        await up.read_request(n, reader)
        writer.write(ok(b"first"))
        await writer.drain()
        await up.read_request(n, reader)
        if answer_second_connection:
            writer.write(answer_second_connection)
            await writer.drain()
        writer.close()

    return handler


@pytest.mark.parametrize("method", ["GET", "HEAD", "DELETE"])
async def test_idempotent_request_retried_once_on_a_new_connection(method: str) -> None:
    async with scripted(close_on_second_request()) as up, wire() as w:
        assert await w.fetch("GET", up.endpoint, "/first") == (200, b"first")
        status, body = await w.fetch(method, up.endpoint, "/again")
        assert status == 200
        assert body == (b"" if method == "HEAD" else b"/again")
        assert up.accepted == 2
        assert up.paths(1) == [b"/first", b"/again"]  # sent, never answered
        assert up.paths(2) == [b"/again"]  # sent once more


async def test_a_post_the_upstream_read_and_closed_on_is_never_sent_twice() -> None:
    """A close (FIN) after reading it: the generation may have started."""
    async with scripted(close_on_second_request()) as up, wire() as w:
        assert await w.fetch("GET", up.endpoint, "/first") == (200, b"first")
        with pytest.raises(ReadError):
            await w.send("POST", up.endpoint, "/generate", b'{"model":"m"}')
        assert up.accepted == 1
        assert up.paths() == [b"/first", b"/generate"]
        # The slot came back (max_connections=1) and a new connection works.
        assert await w.fetch("GET", up.endpoint, "/later") == (200, b"/later")


async def test_no_retry_once_part_of_the_answer_came() -> None:
    async with scripted(close_on_second_request(b"HTTP/1.1 200 OK\r\ncontent-le")) as up, \
            wire() as w:
        assert await w.fetch("GET", up.endpoint, "/first") == (200, b"first")
        with pytest.raises(ReadError):
            await w.send("GET", up.endpoint, "/again")
        assert up.accepted == 1


async def test_no_retry_on_a_fresh_connection() -> None:
    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)  # and close without an answer

    async with scripted(handler) as up, wire() as w:
        with pytest.raises(ReadError):
            await w.send("GET", up.endpoint, "/")
        assert up.accepted == 1


# ---------------------------------------------------------------------------
# Timeouts and failures


async def test_no_headers_within_read_timeout() -> None:
    closed = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if n == 1:
            await up.read_request(n, reader)
            await until_eof(reader, closed)  # silence
        else:
            await answering()(up, n, reader, writer)

    async with scripted(handler) as up, wire(read_timeout=0.2) as w:
        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(ReadTimeout, match="no response headers"):
            await w.send("GET", up.endpoint, "/silent")
        # uvloop's clock counts whole milliseconds: 0.2 s may read as 0.19999...
        assert 0.2 - 0.002 <= loop.time() - t < 2.0
        async with asyncio.timeout(5):
            await closed.wait()  # the client gave up on the connection
        assert await w.fetch("GET", up.endpoint, "/next") == (200, b"/next")  # slot back
        assert up.paths() == [b"/silent", b"/next"]  # not retried


async def test_stall_mid_body_is_a_read_timeout_after_every_byte(mode: str) -> None:
    sent = b"data: one\n\n", b"data: two\n\n"
    closed = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in sent:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        await until_eof(reader, closed)

    async with scripted(handler) as up, wire(read_timeout=0.2) as w:
        response = await w.send("GET", up.endpoint, "/")
        got, error = await consume(response, mode)
        assert got == before_failure(mode, b"".join(sent))
        assert isinstance(error, ReadTimeout)
        async with asyncio.timeout(5):
            await closed.wait()


async def test_a_paused_reader_is_not_a_read_timeout() -> None:
    """While the sink holds the upstream back, the upstream's silence is not its fault."""
    parts = [b"data: %d\n\n" % i for i in range(3)]
    start, paused = asyncio.Event(), asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(b"".join(parts)))
        await writer.drain()
        await start.wait()
        writer.write(parts[0])
        await paused.wait()
        writer.write(b"".join(parts[1:]))  # there long before the client reads it
        await until_eof(reader, asyncio.Event())

    async with scripted(handler) as up, wire(read_timeout=0.1) as w:
        response = await w.send("GET", up.endpoint, "/")
        got = bytearray()
        verdict = PAUSE

        def sink(chunk: bytes) -> int:
            got.extend(chunk)
            return verdict

        start.set()
        assert not await response.body.pipe(sink)  # paused after the first part
        assert bytes(got) == parts[0]
        paused.set()
        conn = response.body._conn
        await asyncio.sleep(0.35)  # the slow client under test: paused for 3.5 read timeouts
        assert conn.read_paused and conn.state is not ConnectionState.CLOSED
        verdict = GO
        assert await response.body.pipe(sink)
        await response.aclose()
        assert bytes(got) == b"".join(parts)


async def test_time_paused_never_counts_against_the_upstream() -> None:
    """The read timeout measures the upstream only. Paused for most of two read timeouts
    (so the timer fires once while paused), the client resumes; the upstream, silent all
    along, answers half a read timeout after that. Counting any of the pause would have
    judged it silent for a whole read timeout before it answered."""
    read_timeout = 1.0
    first, rest = b"data: first\n\n", b"data: rest\n\n"
    resumed = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(first + rest), first))
        await writer.drain()
        await resumed.wait()
        await asyncio.sleep(read_timeout / 2)  # the upstream's own silence, under test
        writer.write(rest)
        await until_eof(reader, asyncio.Event())

    async with scripted(handler) as up, wire(read_timeout=read_timeout) as w:
        response = await w.send("GET", up.endpoint, "/")
        got = bytearray()
        verdict = PAUSE

        def sink(chunk: bytes) -> int:
            got.extend(chunk)
            return verdict

        assert not await response.body.pipe(sink)  # the first part, then paused
        assert bytes(got) == first
        await asyncio.sleep(read_timeout * 1.8)  # the slow client under test
        verdict = GO
        resumed.set()
        assert await response.body.pipe(sink)  # not a ReadTimeout
        await response.aclose()
        assert bytes(got) == first + rest


async def test_connect_refused_is_connect_error() -> None:
    async with wire() as w:
        endpoint = Endpoint("http", "127.0.0.1", closed_port())
        for _ in range(2):  # and the slot came back: not a PoolTimeout the second time
            with pytest.raises(ConnectError, match=f"127.0.0.1:{endpoint.port}"):
                await w.send("GET", endpoint, "/")


async def test_pool_exhausted_is_pool_timeout_after_connect_timeout() -> None:
    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if n == 1:
            await up.read_request(n, reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nheld")
            await until_eof(reader, asyncio.Event())
        else:
            await answering()(up, n, reader, writer)

    async with scripted(handler) as up, wire(max_connections=1, connect_timeout=0.2) as w:
        held = await w.send("GET", up.endpoint, "/held")
        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(PoolTimeout):
            await w.send("GET", up.endpoint, "/waits")
        # uvloop's clock counts whole milliseconds: 0.2 s may read as 0.19999...
        assert 0.2 - 0.002 <= loop.time() - t < 2.0
        assert (up.accepted, up.paths()) == (1, [b"/held"])
        await held.aclose()
        assert await w.fetch("GET", up.endpoint, "/after") == (200, b"/after")


def unfinished_answer(part: bytes, framing: str) -> bytes:
    """A 200 head and ``part`` of a body that promises more (Content-Length or chunked)."""
    if framing == "length":
        return b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + part
    return (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            b"%x\r\n%s\r\n" % (len(part), part))


@pytest.mark.parametrize("framing", ["length", "chunked"])
@pytest.mark.parametrize("how", ["rst", "fin"])
async def test_upstream_breaks_mid_body_after_every_byte(how: str, framing: str) -> None:
    part = b"data: before the break\n\n"
    received = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if n > 1:
            await answering()(up, n, reader, writer)
            return
        await up.read_request(n, reader)
        writer.write(unfinished_answer(part, framing))
        await writer.drain()
        # An RST may discard bytes in flight: break only once the client has them.
        await received.wait()
        if how == "rst":
            reset(writer)
        else:
            writer.close()

    async with scripted(handler) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/")
        got, error = await consume(response, "pipe",
                                   lambda got: received.set() if got == part else None)
        assert got == part
        assert isinstance(error, ReadError)
        assert await w.fetch("GET", up.endpoint, "/next") == (200, b"/next")


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_bytes_before_a_break_reach_a_reader_that_comes_late(framing: str, mode: str) -> None:
    """The upstream sent part of the body and closed before anyone read the body."""
    part = b"data: early\n\n"

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        writer.write(unfinished_answer(part, framing))
        await writer.drain()
        writer.close()

    async with scripted(handler) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/")
        conn = response.body._conn
        await until(lambda: conn.state is ConnectionState.CLOSED)  # the close came before the read
        assert await consume(response, mode) == (before_failure(mode, part), Raised(ReadError))


@pytest.mark.parametrize("answer", [
    b"garbage\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab",
], ids=["status-line", "content-length", "two-lengths"])
async def test_malformed_head_is_remote_protocol_error(answer: bytes) -> None:
    async with scripted(answering(lambda raw: answer)) as up, wire() as w:
        with pytest.raises(RemoteProtocolError):
            await w.send("GET", up.endpoint, "/")
        with pytest.raises(RemoteProtocolError):  # the slot came back
            await w.send("GET", up.endpoint, "/")


def header_lines(size: int) -> bytes:
    """``size`` bytes of header fields (rounded down to whole KiB), 1 KiB each."""
    return b"".join(b"x-flood-%04d: %s\r\n" % (i, b"v" * 1008) for i in range(size // 1024))


@pytest.mark.parametrize("how", ["one-write", "endless"])
async def test_response_head_over_the_cap_is_an_error_and_closes_the_connection(
        how: str) -> None:
    """A header flood: in one write with a body after it, or a head that never ends. The
    client stops at the cap (it does not wait for the end) and drops the connection."""
    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if n > 1:
            await answering()(up, n, reader, writer)
            return
        await up.read_request(n, reader)
        if how == "one-write":
            writer.write(b"HTTP/1.1 200 OK\r\n" + header_lines(MAX_HEAD_BYTES + 1024)
                         + b"content-length: 2\r\n\r\nok")
            await until_eof(reader, asyncio.Event())
            return
        writer.write(b"HTTP/1.1 200 OK\r\n")
        while True:  # until the client closes: then the write fails
            writer.write(header_lines(8192))
            await writer.drain()

    async with scripted(handler) as up, wire(read_timeout=30.0) as w:
        with pytest.raises(ResponseHeadTooLarge, match="larger than 64 KiB"):
            await w.send("GET", up.endpoint, "/flood")
        assert await w.fetch("GET", up.endpoint, "/next") == (200, b"/next")
        assert up.accepted == 2  # the flooded connection was dropped


async def test_large_head_under_the_cap_with_a_body_in_the_same_read() -> None:
    """The cap counts the head, not the body bytes that came in the same read."""
    body = b"b" * (200 * 1024)
    head = b"HTTP/1.1 200 OK\r\n" + header_lines(MAX_HEAD_BYTES - 4096)
    answer = head + b"content-length: %d\r\n\r\n" % len(body) + body
    async with scripted(answering(lambda raw: answer)) as up, wire() as w:
        for _ in range(2):
            response = await w.send("GET", up.endpoint, "/")
            assert len(response.headers.raw) == (MAX_HEAD_BYTES - 4096) // 1024 + 1
            assert await consume(response) == (body, None)
        assert up.accepted == 1


async def test_malformed_chunk_is_remote_protocol_error_after_every_byte(mode: str) -> None:
    have_headers = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await have_headers.wait()
        writer.write(b"zz\r\nmore")
        await until_eof(reader, asyncio.Event())

    async with scripted(handler) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/")
        have_headers.set()
        got, error = await consume(response, mode)
        assert (response.status_code, got) == (200, before_failure(mode, b"hello"))
        assert isinstance(error, RemoteProtocolError)


async def test_malformed_chunk_in_the_first_read_still_returns_the_response() -> None:
    answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\nmore"
    async with scripted(answering(lambda raw: answer)) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/")
        got, error = await consume(response)
        assert (response.status_code, got) == (200, b"hello")
        assert isinstance(error, RemoteProtocolError)


# ---------------------------------------------------------------------------
# Flow control


TOTAL = 8 * 1024 * 1024
PAYLOAD = b"".join(b"%015d\n" % i for i in range(TOTAL // 16))


def big_body(progress: dict[str, int], start: asyncio.Event | None = None,
             *, with_head: int = 0) -> Handler:
    """``PAYLOAD`` as a Content-Length body in 64 KiB writes, as fast as the client lets
    it; ``progress["sent"]`` is how much the kernel took. ``with_head`` bytes go out with
    the head; the rest once ``start`` is set."""

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                     % (TOTAL, PAYLOAD[:with_head]))
        await writer.drain()
        if start is not None:
            await start.wait()
        for i in range(with_head, TOTAL, 65536):
            writer.write(PAYLOAD[i:i + 65536])
            await writer.drain()
            progress["sent"] = min(i + 65536, TOTAL)
        await until_eof(reader, asyncio.Event())

    return handler


@pytest.mark.parametrize("with_head", [0, 4096], ids=["body-after-head", "body-with-head"])
async def test_pipe_pause_holds_the_upstream_until_the_caller_resumes(with_head: int) -> None:
    progress = {"sent": 0}
    start = asyncio.Event()
    got = bytearray()
    calls: list[int] = []  # len(got) after each sink call
    verdict = PAUSE

    def sink(chunk: bytes) -> int:
        got.extend(chunk)
        calls.append(len(got))
        return verdict

    async with scripted(big_body(progress, start, with_head=with_head)) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/")
        start.set()
        try:
            async with asyncio.timeout(5):
                assert not await response.body.pipe(sink), "pipe did not return on PAUSE"
            await settled(lambda: progress["sent"])  # the upstream cannot send any more
            assert len(calls) == 1, "the sink was called again after it asked to pause"
            assert progress["sent"] < TOTAL
            verdict = GO  # the client caught up: the caller resumes by piping again
            async with asyncio.timeout(10):
                assert await response.body.pipe(sink)
        finally:
            await response.aclose()
        assert bytes(got) == PAYLOAD
        assert progress["sent"] == TOTAL


async def test_body_nobody_reads_yet_holds_at_most_hold_buffer() -> None:
    progress = {"sent": 0}
    async with scripted(big_body(progress)) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/")
        await settled(lambda: progress["sent"])  # no reader: the upstream is held
        assert progress["sent"] < TOTAL
        held = sum(map(len, response.body._ex.parts))  # read from the socket, not handed on
        assert HOLD_BUFFER < held <= HOLD_BUFFER + READ_MAX
        got = bytearray()
        peak = 0

        def sink(chunk: bytes) -> int:
            nonlocal peak
            got.extend(chunk)
            peak = max(peak, len(chunk))
            return GO

        assert await response.body.pipe(sink)
        await response.aclose()
        assert peak == held  # the held bytes in the first call; later reads are smaller
        assert bytes(got) == PAYLOAD


@pytest.mark.parametrize("complete", [False, True], ids=["mid-body", "body-complete"])
async def test_sink_stop_raises_client_gone_and_closes_the_connection(complete: bool) -> None:
    """STOP is never lost, even when the whole body had arrived before anyone read it."""
    closed = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"b\r\ndata: one\n\n\r\n" + (b"0\r\n\r\n" if complete else b""))
            await until_eof(reader, closed)
        else:
            writer.write(ok(b"fresh"))
            await writer.drain()

    async with scripted(handler) as up, wire() as w:
        response = await w.send("GET", up.endpoint, "/")
        if complete:
            await until(lambda: response.body._ex.finished)
        got: list[bytes] = []

        def sink(chunk: bytes) -> int:
            got.append(chunk)
            return STOP

        with pytest.raises(SinkStopped):
            await response.body.pipe(sink)
        assert got == [b"data: one\n\n"]
        async with asyncio.timeout(5):
            if not complete:  # still generating: the stop itself drops the connection
                await closed.wait()
            await response.aclose()
            await closed.wait()  # not pooled
        assert await w.fetch("GET", up.endpoint, "/") == (200, b"fresh")
        assert up.accepted == 2


async def test_response_finished_while_paused_keeps_its_connection() -> None:
    start = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        while await up.read_request(n, reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
            await writer.drain()
            await start.wait()
            start.clear()
            writer.write(b"x" * 100)  # read by the pipe's data_received
            await writer.drain()

    async with scripted(handler) as up, wire() as w:
        for _ in range(2):
            response = await w.send("GET", up.endpoint, "/")
            got = bytearray()

            def sink(chunk: bytes, got: bytearray = got) -> int:
                got.extend(chunk)
                return PAUSE  # the client's buffer is full just as the body ends

            start.set()
            assert await response.body.pipe(sink), "the body had ended: nothing to resume"
            await response.aclose()
            assert bytes(got) == b"x" * 100
        assert up.accepted == 1


async def test_closing_a_response_twice_leaves_the_next_request_alone() -> None:
    closed_twice = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        writer.write(ok(b"first"))
        await up.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\n")
        await writer.drain()
        await closed_twice.wait()
        writer.write(b"second")
        await until_eof(reader, asyncio.Event())

    async with scripted(handler) as up, wire(read_timeout=1.0) as w:
        payload = request("GET", up.endpoint, "/")
        first = await w.transport.exchange("GET", up.endpoint, payload)
        assert await first.body.read(LIMIT) == b"first"
        await first.aclose()
        second = await w.transport.exchange("GET", up.endpoint, payload)  # same connection
        await first.aclose()  # again
        closed_twice.set()
        try:
            async with asyncio.timeout(2):  # twice the read timeout
                assert await second.body.read(LIMIT) == b"second"
        finally:
            await second.aclose()
        assert up.accepted == 1


# ---------------------------------------------------------------------------
# The request on the wire


async def test_request_bytes_are_exactly_as_serialized() -> None:
    body = b'{"model":"m","messages":[]}'
    headers = [(b"X-Mixed-Case", b"A"), (b"x-mixed-case", b"B"),
               (b"content-type", b"application/json")]
    async with scripted(answering()) as up, wire() as w:
        host = b"127.0.0.1:%d" % up.port
        post = serialize("POST", b"/v1/chat/completions?api-version=2&x=%2F", host, headers, body)
        get = serialize("GET", b"/v1/models", host, [], b"")
        for method, payload, target in [("POST", post, b"/v1/chat/completions?api-version=2&x=%2F"),
                                        ("GET", get, b"/v1/models")]:
            response = await w.transport.exchange(method, up.endpoint, payload)
            assert await consume(response) == (target, None)
    assert post == (b"POST /v1/chat/completions?api-version=2&x=%2F HTTP/1.1\r\n"
                    b"Host: " + host + b"\r\nX-Mixed-Case: A\r\nx-mixed-case: B\r\n"
                    b"content-type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert get == b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\n\r\n"
    assert [raw for _, raw in up.requests] == [post, get]


async def test_upstream_open_writes_the_request_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The production seam: ``UpstreamClient`` builds the target, Host and framing itself."""
    no_environment_proxy(monkeypatch)
    body = b'{"model":"m","messages":[]}'
    async with scripted(answering()) as up:
        upstream = UpstreamClient(single_spec(Settings(upstream=up.url + "/base/v1")))
        try:
            assert upstream.endpoint == up.endpoint
            for method, subpath, query, content in [
                    ("POST", b"/chat/completions", b"api-version=2&x=%2F", body),
                    ("GET", b"/models", b"", b""),
                    ("POST", b"/empty", b"", b"")]:
                response = await upstream.open(
                    method, subpath, query,
                    [(b"X-Mixed-Case", b"A"), (b"x-mixed-case", b"B")], content)
                assert response.status_code == 200
                got = await response.body.read(LIMIT)
                await response.aclose()
                assert got == b"/base/v1" + subpath + (b"?" + query if query else b"")
        finally:
            await upstream.aclose()
    head = b"Host: 127.0.0.1:%d\r\nX-Mixed-Case: A\r\nx-mixed-case: B\r\n" % up.port
    assert [raw for _, raw in up.requests] == [
        b"POST /base/v1/chat/completions?api-version=2&x=%2F HTTP/1.1\r\n" + head
        + b"Content-Length: %d\r\n\r\n" % len(body) + body,
        b"GET /base/v1/models HTTP/1.1\r\n" + head + b"\r\n",
        b"POST /base/v1/empty HTTP/1.1\r\n" + head + b"Content-Length: 0\r\n\r\n",
    ]
    assert up.accepted == 1


# ---------------------------------------------------------------------------
# The relay's direct path under the installed uvicorn


@pytest.mark.e2e
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the proxy's loop is its own thread's
@pytest.mark.parametrize("client_usage", [False, True], ids=["strip-mode", "plain-mode"])
async def test_direct_writer_engages_under_uvicorn(client_usage: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    events = [content_event(f" t{i}") for i in range(5)] + [b"data: [DONE]\n\n"]
    expected = b"".join(events)

    async def stream(conn: Conn) -> None:
        await conn.head(200)
        for ev in events:
            await conn.chunk(ev)
        await conn.end()

    made: list[DirectWriter | None] = []
    written: list[bytes] = []  # what went straight to uvicorn's transport, chunk-framed
    real_direct_writer = proxy.relay.direct_writer

    def spy_direct_writer(send: Any) -> DirectWriter | None:
        writer = real_direct_writer(send)
        made.append(writer)
        if writer is not None:
            real_write = writer.transport_write

            def spy_write(data: bytes) -> None:
                written.append(data)
                real_write(data)

            writer.transport_write = spy_write
        return writer

    no_environment_proxy(monkeypatch)
    monkeypatch.setattr(proxy.relay, "direct_writer", spy_direct_writer)
    body = {"model": "direct", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    if client_usage:
        body["stream_options"] = {"include_usage": True}

    upstream = RawUpstream({"direct": stream})
    with upstream.running():
        app = create_app(Settings(upstream=upstream.url + "/v1"), registry=CollectorRegistry())
        assert isinstance(app.upstream.transport, WireTransport)
        with serve_in_thread(app, http="httptools", timeout_graceful_shutdown=2) as server:
            async with httpx.AsyncClient(timeout=10) as client:
                local: set[object] = set()
                for n in (1, 2):
                    async with client.stream("POST", server.url + "/v1/chat/completions",
                                             json=body) as r:
                        got = b"".join([part async for part in r.aiter_raw()])
                        local.add(r.extensions["network_stream"].get_extra_info("client_addr"))
                    assert r.status_code == 200
                    assert r.headers["transfer-encoding"] == "chunked"
                    assert got == expected
                    assert len(made) == n and isinstance(made[-1], DirectWriter), \
                        "the relay fell back to ASGI send: uvicorn's internals changed?"
                    assert dechunk(b"".join(written)) == expected * n
                # Both on one keep-alive connection: uvicorn's state was left as its own
                # ``send`` would have left it.
                assert len(local) == 1


@pytest.mark.e2e
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the proxy's loop is its own thread's
async def test_whole_body_is_read_without_a_timer_under_uvicorn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose body came with its head is read without ``asyncio.timeout``: the
    check of uvicorn's cycle says the body is in hand. Fails when the installed uvicorn's
    internals change (the read then falls back to the bounded one, which still works)."""
    seen: list[bool] = []
    real = proxy.routes.body_in_hand

    def spy(receive: Any) -> bool:
        seen.append(real(receive))
        return seen[-1]

    async def answer(conn: Conn) -> None:
        await conn.head(200, content_type="application/json", length=2)
        await conn.write(b"{}")

    no_environment_proxy(monkeypatch)
    monkeypatch.setattr(proxy.routes, "body_in_hand", spy)
    upstream = RawUpstream({"whole": answer})
    with upstream.running():
        app = create_app(Settings(upstream=upstream.url + "/v1"), registry=CollectorRegistry())
        with serve_in_thread(app, http="httptools") as server:
            body = b'{"model": "whole", "messages": []}'
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"  # one write
                         b"content-type: application/json\r\ncontent-length: %d\r\n"
                         b"connection: close\r\n\r\n%s" % (len(body), body))
            answer = await reader.read()
            writer.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert seen == [True], "uvicorn's cycle no longer says the body is in hand"


def dechunk(framed: bytes) -> bytes:
    """The payload of back-to-back HTTP/1.1 chunks (``<hex size>\\r\\n<data>\\r\\n``)."""
    out, pos = bytearray(), 0
    while pos < len(framed):
        eol = framed.index(b"\r\n", pos)
        size = int(framed[pos:eol], 16)
        out += framed[eol + 2 : eol + 2 + size]
        assert framed[eol + 2 + size : eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size
    return bytes(out)
