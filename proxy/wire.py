"""The proxy's own HTTP/1.1 client for the upstream: bytes in, callbacks out.

Why (issue 5, ``benchmarks/profile.md``): with aiohttp under the relay, every upstream
read went data_received -> aiohttp parser -> StreamReader -> future -> task wake-up ->
``readany`` -> the relay loop, about 35 us of CPU per SSE event before the proxy did any
work of its own. Here an upstream connection is an :class:`asyncio.Protocol` fed to
httptools' C parser (the parser uvicorn uses), and the body bytes of each read are
handed to a callback *inside* ``data_received``: no buffer, no future, no task switch.

The seam is unchanged: :class:`WireTransport` is an httpx transport (``Upstream`` still
builds ``httpx.Request`` objects, tests can still inject ``httpx.MockTransport``, errors
are httpx's exception classes). Its responses carry a :class:`WireBody`, which reads
two ways:

* ``await body.pipe(sink, drain)``: the fast path. ``sink(chunk)`` runs in the
  connection's ``data_received`` with the body bytes of that read and returns
  :data:`GO`, :data:`PAUSE` (the client's buffer is full: upstream reading stops until
  ``drain()`` returns) or :data:`STOP` (the client is gone).
* ``async for chunk in body``: like any httpx stream, for non-stream answers and for
  servers other than uvicorn; at most :data:`ITER_BUFFER` bytes are held before upstream
  reading pauses.

What the client does, and does not do:

* Requests are written exactly as built: the request line, ``request.headers.raw``
  (httpx adds ``Host`` and ``Content-Length``) and the body. No automatic headers, no
  decompression, no redirects, no cookies. The one retry: an idempotent request whose
  pooled connection closed before any byte of the answer is sent once more on a new
  connection (the upstream closed an idle connection just as it was reused). A POST
  is never sent twice.
* Bodies are de-chunked (``Transfer-Encoding: chunked``), sized by ``Content-Length``,
  or read until the upstream closes; 1xx responses are skipped. The bytes of one read
  reach the sink as one ``bytes`` object.
* A pool of keep-alive connections per origin (LIFO, so warm connections stay warm),
  ``max_connections`` in total: waiting longer than the connect timeout for a free
  connection is ``httpx.PoolTimeout`` (504). Idle connections are dropped after
  ``keepalive_expiry`` or as soon as the upstream closes them. A connection is reused
  only after a complete response that allowed keep-alive.
* Timeouts, checked lazily (one timer per request, re-armed only when it fires, not per
  read): no bytes for ``read_timeout`` -> ``httpx.ReadTimeout`` (504 before the headers,
  outcome ``timeout`` after); the request not written within ``write_timeout`` ->
  ``httpx.WriteTimeout``; connecting: ``httpx.ConnectTimeout``/``ConnectError`` (502).
* A connection that breaks mid-body raises ``httpx.RemoteProtocolError`` after every
  byte received before the break was handed on.
* ``https://`` upstreams use ``ssl.create_default_context()`` (system CAs, SNI, hostname
  checks). An ``HTTP(S)_PROXY`` environment proxy is not spoken here: ``Upstream``
  uses the aiohttp client when one applies to the upstream.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import cast

import httptools
import httpx

GO, PAUSE, STOP = 0, 1, 2
# Sent again once on a fresh connection when a pooled one turns out closed before any
# byte of the answer came back. Never POST: it may have started a generation.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
ITER_BUFFER = 256 * 1024

Sink = Callable[[bytes], int]
Origin = tuple[str, str, int]


class _Exchange:
    """One request/response on one connection; owned by the connection while active."""

    __slots__ = (
        "buffered", "error", "finished", "has_length", "head", "headers_done", "informational",
        "keep_alive", "last_read", "message_done", "parts", "raw_headers", "received", "sink",
        "status", "waiter", "write_started",
    )  # fmt: skip

    def __init__(self, head: bool, now: float) -> None:
        self.head = head
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.informational = False
        self.has_length = False  # Content-Length or chunked: else the body ends at close
        self.keep_alive = False
        self.message_done = False  # the parser saw the end of the response
        self.finished = False  # done, by completion or failure; the connection is released
        self.error: httpx.TransportError | None = None
        self.parts: list[bytes] = []  # body bytes not yet handed to a sink
        self.buffered = 0
        self.sink: Sink | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.last_read = now
        self.write_started = now
        self.received = False  # any byte of the response yet

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until the next :meth:`wake` (headers, data in iteration, pause, end, failure)."""
        self.waiter = loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class _Connection(asyncio.Protocol):
    """One upstream connection: an asyncio protocol and httptools' parser callbacks."""

    def __init__(self, transport_owner: WireTransport, origin: Origin) -> None:
        self.owner = transport_owner
        self.time = transport_owner.loop.time  # bound once: read per upstream read
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.ex: _Exchange | None = None
        self.lost = False
        self.idle_since = 0.0
        self.read_paused = False
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        ex = self.ex
        if ex is None or ex.finished:
            self._abort()  # bytes nobody asked for: this connection is not reusable
            return
        ex.last_read = self.time()
        ex.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._flush(ex)
            self._fail(ex, httpx.RemoteProtocolError(f"invalid HTTP from the upstream: {exc}"))
            return
        self._flush(ex)
        if ex.message_done and not ex.finished:
            self._finish(ex)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._cancel_timer()
        ex = self.ex
        if ex is None or ex.finished:
            return
        self._flush(ex)
        if ex.headers_done and not ex.has_length and exc is None and not ex.informational:
            self._finish(ex)  # a body delimited by the connection's end is complete
            return
        detail = f": {exc}" if exc is not None else ""
        self._fail(ex, httpx.RemoteProtocolError(f"upstream closed the connection{detail}"))

    # -- httptools callbacks -----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.ex is not None
        self.ex.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.ex
        assert ex is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            ex.informational = True  # 100 Continue, 103 Early Hints: skip, wait for the answer
            ex.raw_headers = []
            return
        ex.status = status
        ex.keep_alive = self.parser.should_keep_alive() and not ex.head
        ex.has_length = ex.head or status in (204, 304) or any(
            k.lower() in (b"content-length", b"transfer-encoding") for k, _ in ex.raw_headers)
        ex.headers_done = True
        if ex.head:
            ex.message_done = True  # the parser does not know the request was HEAD
        ex.wake()

    def on_body(self, body: bytes) -> None:
        ex = self.ex
        assert ex is not None
        if not ex.message_done:
            ex.parts.append(body)

    def on_message_complete(self) -> None:
        ex = self.ex
        assert ex is not None
        if ex.informational:
            ex.informational = False
            return
        ex.message_done = True

    # -- exchange life cycle -------------------------------------------------------------

    def start(self, payload: bytes, head: bool) -> _Exchange:
        assert self.transport is not None and self.ex is None
        now = self.owner.loop.time()
        ex = self.ex = _Exchange(head, now)
        self.transport.write(payload)
        self._arm(now)
        return ex

    def _flush(self, ex: _Exchange) -> None:
        parts = ex.parts
        sink = ex.sink
        if not parts or sink is None:
            if sink is None and ex.buffered + sum(map(len, parts)) > ITER_BUFFER:
                self.pause_reading()  # no reader yet: hold at most ITER_BUFFER bytes
            return
        chunk = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        try:
            verdict = sink(chunk)
        except Exception as exc:  # a failing sink must not take the event loop's callback down
            self._fail(ex, httpx.ReadError(f"relay failed: {exc!r}"))
            return
        if verdict == GO:
            return
        if verdict == PAUSE:
            self.pause_reading()
        else:
            self._fail(ex, SinkStopped("the client went away"))
        ex.wake()

    def _finish(self, ex: _Exchange) -> None:
        ex.finished = True
        self._cancel_timer()
        ex.wake()

    def _fail(self, ex: _Exchange, error: httpx.TransportError) -> None:
        if ex.finished:
            return
        ex.error = error
        ex.finished = True
        ex.keep_alive = False
        self._abort()
        ex.wake()

    def pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None and not self.lost:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and self.transport is not None and not self.lost:
            self.read_paused = False
            self.transport.resume_reading()

    def _arm(self, now: float) -> None:
        self._cancel_timer()
        owner = self.owner
        self.timer = owner.loop.call_at(now + min(owner.read_timeout, owner.write_timeout),
                                        self._check_timeouts)

    def _check_timeouts(self) -> None:
        """The lazy timer: it fires when a deadline may have passed, never once per read."""
        self.timer = None
        ex = self.ex
        if ex is None or ex.finished:
            return
        owner = self.owner
        now = owner.loop.time()
        if self.read_paused:
            ex.last_read = now  # a paused read is the client's slowness, not the upstream's
        sending = (not ex.headers_done and self.transport is not None
                   and self.transport.get_write_buffer_size() > 0)
        if sending and now - ex.write_started >= owner.write_timeout:
            self._fail(ex, httpx.WriteTimeout("request not sent to the upstream in time"))
            return
        if now - ex.last_read >= owner.read_timeout:
            what = "response headers" if not ex.headers_done else "more of the body"
            self._fail(ex, httpx.ReadTimeout(
                f"no {what} from the upstream within {owner.read_timeout:g} s"))
            return
        due = ex.last_read + owner.read_timeout
        if sending:
            due = min(due, ex.write_started + owner.write_timeout)
        self.timer = owner.loop.call_at(max(due, now + 0.001), self._check_timeouts)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _abort(self) -> None:
        self.lost = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()

    def release(self, ex: _Exchange | None) -> None:
        """``ex`` is done with: the connection goes back to the pool if ``ex`` ended
        cleanly, else it is closed. A no-op unless ``ex`` is the connection's current
        exchange (closing a response twice must not touch the next request's)."""
        if ex is not self.ex:
            return
        self.ex = None
        self._cancel_timer()
        if (ex is not None and ex.finished and ex.error is None and ex.keep_alive
                and not self.lost and self.transport is not None
                and not self.transport.is_closing()):
            self.resume_reading()  # it may have ended while the client was slow
            self.idle_since = self.owner.loop.time()
            self.owner.idle.setdefault(self.origin, []).append(self)
        else:
            self._abort()


class SinkStopped(httpx.TransportError):
    """Raised by :meth:`WireBody.pipe` when the sink said STOP (the client is gone)."""


class WireTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, max_connections: int, connect_timeout: float, read_timeout: float,
                 write_timeout: float = 30.0, keepalive_expiry: float = 30.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.keepalive_expiry = keepalive_expiry
        self._ssl = ssl_context
        self._slots = asyncio.Semaphore(max_connections)
        self.idle: dict[Origin, list[_Connection]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """The httpx transport interface (tests, and any caller holding an httpx.Request)."""
        try:
            response = await self.exchange(request.method, origin_of(request.url),
                                           _serialize(request))
        except httpx.TransportError as exc:
            exc.request = request
            raise
        response.stream._request = request
        return httpx.Response(response.status_code, headers=response.headers.raw,
                              stream=response.stream, request=request)

    async def exchange(self, method: str, origin: Origin, payload: bytes) -> WireResponse:
        """Send ``payload`` (a whole serialized request) to ``origin``; return at the headers.

        The proxy's own path: ``Upstream`` serializes the request itself (see
        :func:`serialize`), so no ``httpx.Request``/``URL``/``Response`` is built per
        request (about 0.3 ms of the proxy's overhead before the upstream saw a request,
        measured in-process on the benchmark machine).
        """
        if self._slots.locked():
            try:
                async with asyncio.timeout(self.connect_timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no upstream connection became free in time") from None
        else:
            await self._slots.acquire()  # free slot: returns at once
        conn: _Connection | None = None
        try:
            head = method == "HEAD"
            for attempt in range(2):
                conn, reused = await self._connection(origin)
                ex = conn.start(payload, head)
                while not ex.headers_done and not ex.finished:
                    await ex.wait(self.loop)
                if (ex.error is not None and reused and not ex.received and attempt == 0
                        and method in IDEMPOTENT and not isinstance(ex.error, httpx.TimeoutException)):
                    conn.release(ex)  # the upstream closed the idle connection as we used it
                    conn = None
                    continue
                break
            assert conn is not None
            if ex.error is not None and not ex.headers_done:
                raise ex.error  # after the headers, errors come with the body (pipe, iteration)
        except BaseException:
            if conn is not None:
                conn.release(conn.ex)  # not finished cleanly: closed, never pooled
            self._slots.release()
            raise
        return WireResponse(ex.status, ex.raw_headers, WireBody(conn, ex, self._slots.release))

    async def _connection(self, origin: Origin) -> tuple[_Connection, bool]:
        """A pooled connection (True) or a new one (False)."""
        idle = self.idle.get(origin)
        now = self.loop.time()
        while idle and now - idle[0].idle_since > self.keepalive_expiry:
            idle.pop(0)._abort()  # the longest idle (LIFO: at the bottom) expired: close it
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if (conn.lost or transport is None or transport.is_closing()
                    or now - conn.idle_since > self.keepalive_expiry):
                conn._abort()
                continue
            return conn, True
        scheme, host, port = origin
        ssl_context: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self, origin), host, port, ssl=ssl_context,
                    server_hostname=host if ssl_context is not None else None)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:  # refused, unreachable, DNS (socket.gaierror), TLS
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn, False

    async def aclose(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn._abort()
        self.idle.clear()


class WireBody(httpx.AsyncByteStream):
    """The body of a :class:`WireTransport` response; see the module docstring."""

    __slots__ = ("_conn", "_ex", "_release", "_request")

    def __init__(self, conn: _Connection, ex: _Exchange, release: Callable[[], None]) -> None:
        self._conn = conn
        self._ex = ex
        self._request: httpx.Request | None = None  # set when used under httpx's interface
        self._release: Callable[[], None] | None = release

    async def pipe(self, sink: Sink, drain: Callable[[], Awaitable[None]]) -> None:
        """Hand every body read to ``sink`` as it arrives; return when the body ended.

        Raises the httpx error that ended the body early (after handing on every byte
        received before it), or :class:`SinkStopped` when ``sink`` returned STOP.
        """
        ex, conn = self._ex, self._conn
        loop = conn.owner.loop
        ex.sink = sink
        conn.resume_reading()  # in case bytes were held back while there was no reader
        conn._flush(ex)  # bytes that came with the headers (the sink may pause again)
        while True:
            if ex.finished:
                self._raise_error()
                return
            if conn.read_paused:
                await drain()
                conn.resume_reading()
                continue
            await ex.wait(loop)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        ex, conn = self._ex, self._conn
        queue: deque[bytes] = deque()

        def enqueue(chunk: bytes) -> int:
            queue.append(chunk)
            ex.buffered += len(chunk)
            ex.wake()
            return PAUSE if ex.buffered > ITER_BUFFER else GO

        ex.sink = enqueue
        conn.resume_reading()
        conn._flush(ex)
        while True:
            while queue:
                chunk = queue.popleft()
                ex.buffered -= len(chunk)
                if conn.read_paused and ex.buffered <= ITER_BUFFER // 2:
                    conn.resume_reading()
                yield chunk
            if ex.finished:
                self._raise_error()
                return
            conn.resume_reading()
            await ex.wait(conn.owner.loop)

    def _raise_error(self) -> None:
        error = self._ex.error
        if error is not None:
            if self._request is not None:
                error.request = self._request
            raise error

    async def aclose(self) -> None:
        self._ex.sink = None
        self._conn.release(self._ex)
        release = self._release
        if release is not None:  # the connection slot, exactly once
            self._release = None
            release()


class Headers:
    """Response headers as received (``raw``), with the one lookup the proxy needs."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str = "") -> str:
        key = name.lower().encode("latin-1")
        for k, v in self.raw:
            if k.lower() == key:
                return v.decode("latin-1")
        return default


class WireResponse:
    """What :meth:`WireTransport.exchange` returns: the shape of ``httpx.Response`` the
    relay uses (``status_code``, ``headers.get``/``.raw``, ``stream``, ``aclose``)."""

    __slots__ = ("headers", "status_code", "stream")

    def __init__(self, status: int, raw_headers: list[tuple[bytes, bytes]], stream: WireBody) -> None:
        self.status_code = status
        self.headers = Headers(raw_headers)
        self.stream = stream

    async def aclose(self) -> None:
        await self.stream.aclose()


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def origin_of(url: httpx.URL) -> Origin:
    """``(scheme, host, port)``, the port defaulted from the scheme: a pool key."""
    return url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80)


def serialize(method: str, target: bytes, host: bytes, headers: list[tuple[bytes, bytes]],
              body: bytes) -> bytes:
    """A request as HTTP/1.1 bytes: request line, ``Host``, ``headers`` as given,
    ``Content-Length`` (for a body, or an empty POST/PUT/PATCH), then the body.

    ``headers`` must not hold Host, Content-Length or Transfer-Encoding (the relay's
    header filter removes them, see ``proxy.upstream.forward_headers``).
    """
    fields = [(b"Host", host), *headers]
    if body or method in _BODY_METHODS:
        fields.append((b"Content-Length", str(len(body)).encode()))
    return _http11(method, target, fields, body)


def _serialize(request: httpx.Request) -> bytes:
    """An ``httpx.Request`` as HTTP/1.1 bytes: exactly the headers it carries."""
    return _http11(request.method, request.url.raw_path, request.headers.raw, request.content)


def _http11(method: str, target: bytes, fields: Iterable[tuple[bytes, bytes]], body: bytes) -> bytes:
    parts = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
    for name, value in fields:
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    if body:
        parts.append(body)
    return b"".join(parts)
