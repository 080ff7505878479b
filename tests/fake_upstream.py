"""The suite's scripted upstream: a real loopback HTTP/1.1 server driven by a handler.

In-process proxy tests must run the client users run (:mod:`proxy.wire`), so the fake
upstream is reached the way a real one is: over a TCP socket on 127.0.0.1, on the
test's own event loop. What it answers is scripted by a *handler*: an async function
that gets the request exactly as it arrived (an ``httpx.Request``, a convenient
container, nothing more) and returns an ``httpx.Response`` whose body is either fixed
(``content=``/``json=``, written with its ``Content-Length``) or an async iterator of
chunks (written with chunked framing, one socket write per chunk, as servers do).

Time is scripted, never measured. The handler's body iterator sets the
:class:`ScriptedClock` right before it yields each chunk; the server writes the chunk
and then waits until the proxy has read the clock once more, which the relay does
exactly once per upstream read, after handing that read on. So every read is seen at
exactly its scripted time, and every expected metric can be computed from the script.

Faults: a body iterator that raises ends the response mid-body (the connection is
closed without the chunked terminator: what a crashed upstream looks like; an
``ConnectionResetError`` resets it with an RST instead); one that waits on an event
stalls. When the proxy closes the connection early, the iterator is closed, so its
``finally`` (e.g. ``timed_body``'s ``closed`` event) tells the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable

import httptools
import httpx

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class ScriptedClock:
    """A monotonic clock that only moves when a test (or a fake upstream) moves it.

    It counts its reads, so a scripted upstream can wait until the proxy has seen a
    chunk (:meth:`read_after`) before it moves time on.
    """

    def __init__(self, now: float = 64.0) -> None:
        self.now = now
        self.reads = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        self.reads += 1
        if self._waiters:
            for count, waiter in self._waiters:
                if self.reads > count and not waiter.done():
                    waiter.set_result(None)
            self._waiters = [(c, w) for c, w in self._waiters if not w.done()]
        return self.now

    async def read_after(self, count: int) -> None:
        """Until the clock has been read more than ``count`` times."""
        if self.reads > count:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((count, waiter))
        await waiter


class _Request:
    """httptools request parser callbacks, collecting one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.url = b""
        self.done: list[tuple[str, bytes, list[tuple[bytes, bytes]], bytes]] = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        self.done.append((method, self.url, self.headers, b"".join(self.body)))
        self.url, self.headers, self.body = b"", [], []


class ScriptedUpstream:
    """``async with ScriptedUpstream(handler, clock) as up:`` serves on ``up.url``.

    ``up.connections`` counts accepted connections; ``up.url`` is the base URL with
    ``/v1``.
    """

    def __init__(self, handler: Handler, clock: ScriptedClock | None = None) -> None:
        self.handler = handler
        self.clock = clock
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        if self._server is None and not self._closed:
            self._server = await asyncio.start_server(self._serve, sock=self.sock)

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        else:
            self.sock.close()

    async def __aenter__(self) -> ScriptedUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        request = _Request()
        eof = asyncio.Event()
        arrived = asyncio.Event()

        async def read_loop() -> None:
            try:
                while data := await reader.read(65536):
                    request.parser.feed_data(data)
                    if request.done:
                        arrived.set()
            except (ConnectionError, httptools.HttpParserError):
                pass
            finally:
                eof.set()

        reading = asyncio.ensure_future(read_loop())
        try:
            while True:
                while not request.done:
                    if eof.is_set():
                        return
                    arrived.clear()
                    await _first(arrived.wait(), eof.wait())
                method, target, headers, body = request.done.pop(0)
                if not await self._answer(method, target, headers, body, eof, writer):
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            reading.cancel()
            self._tasks.discard(task)
            writer.close()

    async def _answer(self, method: str, target: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes, eof: asyncio.Event, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must close."""
        host = next((v for k, v in headers if k.lower() == b"host"), b"upstream").decode()
        url = httpx.URL(f"http://{host}{target.decode('latin-1')}")
        request = httpx.Request(method, url, headers=headers, content=body)
        try:
            response = await self.handler(request)
        except ConnectionResetError:
            _reset(writer)  # no answer at all
            return False
        raw = list(response.headers.raw)
        sized = any(k.lower() == b"content-length" for k, _ in raw)
        framed = not sized and method != "HEAD" and response.status_code not in (204, 304)
        if framed:
            raw.append((b"transfer-encoding", b"chunked"))
        reason = httpx.codes.get_reason_phrase(response.status_code) or "Status"
        head = [f"HTTP/1.1 {response.status_code} {reason}\r\n".encode()]
        head += [k + b": " + v + b"\r\n" for k, v in raw]
        writer.write(b"".join(head) + b"\r\n")
        closes = any(k.lower() == b"connection" and v.lower() == b"close" for k, v in raw)
        stream = response.stream
        lost = asyncio.ensure_future(eof.wait())
        try:
            iterator = stream.__aiter__()  # type: ignore[union-attr]
            while True:
                next_chunk = asyncio.ensure_future(iterator.__anext__())
                done, _ = await asyncio.wait({next_chunk, lost},
                                             return_when=asyncio.FIRST_COMPLETED)
                if next_chunk not in done:
                    next_chunk.cancel()
                    with contextlib.suppress(BaseException):
                        await next_chunk
                    return False  # the proxy went away while the script was waiting
                try:
                    chunk = next_chunk.result()
                except StopAsyncIteration:
                    break
                except ConnectionResetError:
                    _reset(writer)
                    return False
                except Exception:
                    return False  # end mid-body: closed without the terminator
                if not chunk:
                    continue
                mark = self.clock.reads if self.clock is not None else 0
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if framed else chunk)
                await writer.drain()
                if self.clock is not None:
                    waiting = asyncio.ensure_future(self.clock.read_after(mark))
                    done, _ = await asyncio.wait({waiting, lost},
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if waiting not in done:
                        waiting.cancel()
                        return False
            if framed:
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            lost.cancel()
            aclose = getattr(response.stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()
        return not closes


async def _first(*waits: Awaitable[object]) -> None:
    """Until the first of ``waits`` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN, as a crashed host's kernel would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
