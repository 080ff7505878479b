"""The pool and the exchange: keep-alive connections per endpoint, LIFO (warm ones stay
warm), ``max_connections`` slots in all, expiry and the liveness check before reuse, and
the one resend of a request the upstream's idle close met
(``docs/design/upstream-client.md``, "The pool" and "Reusing an idle connection safely").
"""

from __future__ import annotations

import asyncio
import logging
import ssl

from proxy.logs import RateLimitedLog
from proxy.wire.connection import Connection
from proxy.wire.endpoint import Endpoint, tunnel
from proxy.wire.errors import (
    ConnectError,
    ConnectTimeout,
    PoolTimeout,
    ResetBeforeAnswer,
    UpstreamTimeout,
)
from proxy.wire.keepalive import IdleLimits
from proxy.wire.response import WireBody, WireResponse

# Sent again once on a fresh connection when a pooled one turns out closed before any
# byte of the answer came back (RFC 9110 section 9.2.2). Any other method only when the
# upstream reset it (ResetBeforeAnswer): a closed one may have read the request and
# started a generation.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})

log = logging.getLogger("proxy.wire")


class WireTransport:
    """The pool and the exchange: ``await exchange(method, endpoint, payload)``.

    Parameters:
        max_connections: connections open at once, over all endpoints.
        connect_timeout: seconds to connect (tunnel included), and to wait for a slot.
        read_timeout: seconds of upstream silence that end an exchange.
        write_timeout: seconds to write a request.
        keepalive_expiry: seconds an idle connection may wait for reuse, at most.
        ssl_context: for ``https`` endpoints; the system's default context if None.
        resend_on_reset: send a non-idempotent request again after
            :class:`ResetBeforeAnswer` (``--upstream-resend-on-reset``; off when a
            middlebox may have forwarded it already).
    """

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout: float,
        read_timeout: float,
        write_timeout: float = 30.0,
        keepalive_expiry: float = 4.0,
        ssl_context: ssl.SSLContext | None = None,
        resend_on_reset: bool = True,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.resend_on_reset = resend_on_reset
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.idle_limits = IdleLimits(keepalive_expiry=keepalive_expiry)
        self._ssl = ssl_context
        self.warnings = RateLimitedLog(log, per_interval=10, interval_s=10.0)
        self._slots = asyncio.Semaphore(max_connections)
        self.idle: dict[Endpoint, list[Connection]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def exchange(self, method: str, endpoint: Endpoint, payload: bytes) -> WireResponse:
        """Send ``payload`` (a whole serialized request, :func:`~proxy.wire.http11.serialize`) to
        ``endpoint``; return at the response headers."""
        if self._slots.locked():
            try:
                async with asyncio.timeout(self.connect_timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise PoolTimeout("no upstream connection became free in time") from None
        else:
            await self._slots.acquire()  # free slot: returns at once
        conn: Connection | None = None
        try:
            head = method == "HEAD"
            for attempt in range(2):
                conn, reused = await self._connection(endpoint)
                ex = conn.start(payload, head)
                while not ex.headers_done and not ex.finished:
                    await ex.wait(self.loop)
                if (
                    ex.error is not None
                    and reused
                    and not ex.received
                    and attempt == 0
                    and not isinstance(ex.error, UpstreamTimeout)
                    and (
                        method in IDEMPOTENT
                        or (self.resend_on_reset and isinstance(ex.error, ResetBeforeAnswer))
                    )
                ):
                    conn.release(ex)  # the upstream closed the idle connection as we used it
                    conn = None
                    continue
                break
            assert conn is not None
            if ex.error is not None and not ex.headers_done:
                raise ex.error  # after the headers, errors come with the body (pipe)
        except BaseException:
            if conn is not None:
                conn.release(conn.ex)  # not finished cleanly: closed, never pooled
            self._slots.release()
            raise
        return WireResponse(ex.status, ex.raw_headers, WireBody(conn, ex, self._slots.release))

    async def _connection(self, endpoint: Endpoint) -> tuple[Connection, bool]:
        """A pooled connection (True) or a new one (False)."""
        idle = self.idle.get(endpoint)
        if idle:
            now = self.loop.time()
            limits = self.idle_limits
            expiry = limits.expiry(endpoint)
            outlived = False
            while idle and now - idle[0].idle_since > expiry:
                conn = idle.pop(0)  # the longest idle (LIFO: at the bottom) expired: close it
                outlived = outlived or (endpoint in limits.learned and conn.still_open())
                conn.abort()
            if outlived:  # one per pass: a burst's connections expire together
                limits.outlived(endpoint)
            while idle:
                conn = idle.pop()
                if conn.idle_and_alive(now, expiry):
                    return conn, True
                conn.abort()
        return await self._connect(endpoint), False

    async def _connect(self, endpoint: Endpoint) -> Connection:
        ssl_context: ssl.SSLContext | None = None
        if endpoint.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        host, port, via = endpoint.host, endpoint.port, endpoint.via
        target = f"{host}:{port}" + (f" through the proxy {via.host}:{via.port}" if via else "")
        loop = self.loop

        def connection() -> Connection:
            return Connection(
                loop=loop,
                endpoint=endpoint,
                idle=self.idle.setdefault(endpoint, []),
                limits=self.idle_limits,
                read_timeout=self.read_timeout,
                write_timeout=self.write_timeout,
                warnings=self.warnings,
            )

        server_hostname = host if ssl_context is not None else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                if via is not None:
                    sock = await tunnel(loop, via, host, port)
                    _, conn = await loop.create_connection(
                        connection, sock=sock, ssl=ssl_context, server_hostname=server_hostname
                    )
                else:
                    _, conn = await loop.create_connection(
                        connection, host, port, ssl=ssl_context, server_hostname=server_hostname
                    )
        except TimeoutError:
            raise ConnectTimeout(f"connecting to {target} timed out") from None
        except OSError as exc:  # refused, unreachable, DNS (socket.gaierror), TLS
            raise ConnectError(f"cannot connect to {target}: {exc}") from exc
        return conn

    async def aclose(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.abort()
            conns.clear()  # in place: each connection holds its endpoint's list
