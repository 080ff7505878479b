"""What an exchange returns: status, headers, and the body, read by handing each read to
a sink (:meth:`WireBody.pipe`) whose verdict is the flow control."""

from __future__ import annotations

from collections.abc import Callable

from proxy.wire.connection import Connection
from proxy.wire.errors import ReadError, SinkStopped
from proxy.wire.http11 import GO, STOP, Exchange, Sink, Verdict


class WireBody:
    """The body of a :class:`WireResponse`, on the connection that carries it."""

    __slots__ = ("_conn", "_ex", "_release")

    def __init__(self, conn: Connection, ex: Exchange, release: Callable[[], None]) -> None:
        self._conn = conn
        self._ex = ex
        self._release: Callable[[], None] | None = release

    async def pipe(self, sink: Sink) -> bool:
        """Hand every body read to ``sink`` as it arrives. Returns True when the body
        ended, False when ``sink`` returned PAUSE (call again when the client can take
        more). Raises the :class:`UpstreamError` that ended the body early (after handing
        on every byte received before it), or :class:`SinkStopped` on STOP."""
        ex, conn = self._ex, self._conn
        decoding = ex.decoding
        if decoding is None:
            ex.sink = sink
        else:
            decoding.sink = sink
            ex.sink = decoding.feed
        conn.resume_reading()
        conn.flush(ex)  # bytes that came with the headers or while paused
        while True:
            if ex.parts:  # held back by the decoding when the sink paused
                return False
            if ex.finished:
                if ex.error is not None:
                    raise ex.error
                if decoding is not None:
                    decoding.end()
                return True
            if conn.read_paused:
                return False
            await ex.wait(conn.loop)

    async def read(self, limit: int) -> bytes:
        """The whole body (at most ``limit`` bytes, else :class:`ReadError`), for callers
        that need it at once rather than relayed."""
        parts: list[bytes] = []
        size = 0

        def collect(chunk: bytes) -> Verdict:
            nonlocal size
            size += len(chunk)
            if size > limit:
                return STOP
            parts.append(chunk)
            return GO

        try:
            await self.pipe(collect)
        except SinkStopped:
            raise ReadError(f"upstream body larger than {limit} bytes") from None
        return b"".join(parts)

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
    """What :meth:`WireTransport.exchange` returns: status, headers, the body, and
    ``setup_s``: seconds from taking a connection slot until the request was written,
    a new connection's set-up (TCP, TLS, a proxy's tunnel) and a resend included."""

    __slots__ = ("body", "headers", "setup_s", "status_code")

    def __init__(
        self,
        status: int,
        raw_headers: list[tuple[bytes, bytes]],
        body: WireBody,
        setup_s: float = 0.0,
    ) -> None:
        self.status_code = status
        self.headers = Headers(raw_headers)
        self.body = body
        self.setup_s = setup_s

    async def aclose(self) -> None:
        await self.body.aclose()
