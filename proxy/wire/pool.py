"""The pool and the exchange: keep-alive connections per endpoint, LIFO (warm ones stay
warm), ``max_connections`` slots in all, expiry and the liveness check before reuse, and
the one resend of a request the upstream's idle close met
(``docs/design/upstream-client.md``, "The pool" and "Reusing an idle connection safely").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import Callable

from proxy.logs import RateLimitedLog
from proxy.wire.connection import Connection
from proxy.wire.endpoint import Endpoint, authority, tunnel
from proxy.wire.errors import (
    ConnectError,
    ConnectTimeout,
    PoolTimeout,
    ResetBeforeAnswer,
    UpstreamError,
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
        keep_warm: seconds after an endpoint's last request during which the pool keeps
            one fresh idle connection to it (``--upstream-keep-warm``; 0: off). When the
            last idle connection expires it is replaced, so a request after a pause
            does not wait for a connection's set-up (``docs/design/upstream-client.md``,
            "Keeping a connection warm").
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
        keep_warm: float = 0.0,
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
        self.keep_warm = keep_warm
        self._last_request: dict[Endpoint, float] = {}  # loop time, kept only with keep_warm
        self._tending: dict[Endpoint, asyncio.TimerHandle] = {}
        self._warming: dict[Endpoint, asyncio.Task[None]] = {}
        self._in_flight: dict[Endpoint, int] = {}  # exchanges not yet released, with keep_warm

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def exchange(
        self,
        method: str,
        endpoint: Endpoint,
        payload: bytes,
        clock: Callable[[], float] = time.perf_counter,
    ) -> WireResponse:
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
        release = self._slots.release
        if self.keep_warm:
            self._last_request[endpoint] = self.loop.time()
            self._in_flight[endpoint] = self._in_flight.get(endpoint, 0) + 1
            release = functools.partial(self._released, endpoint)
            if endpoint not in self._tending:
                self._tend_later(endpoint, self.idle_limits.expiry(endpoint))
        conn: Connection | None = None
        setup_s = 0.0
        try:
            head = method == "HEAD"
            for attempt in range(2):
                t_setup = clock()
                conn, reused = await self._connection(endpoint)
                ex = conn.start(payload, head)
                setup_s += clock() - t_setup
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
            release()
            raise
        return WireResponse(ex.status, ex.raw_headers, WireBody(conn, ex, release), setup_s)

    def _expire(self, endpoint: Endpoint, idle: list[Connection], now: float) -> float:
        """Close the connections of ``idle`` that waited longer than the endpoint's idle
        limit; returns that limit."""
        limits = self.idle_limits
        expiry = limits.expiry(endpoint)
        outlived = False
        while idle and now - idle[0].idle_since > expiry:
            conn = idle.pop(0)  # the longest idle (LIFO: at the bottom) expired: close it
            outlived = outlived or (endpoint in limits.learned and conn.still_open())
            conn.abort()
        if outlived:  # one per pass: a burst's connections expire together
            limits.outlived(endpoint)
        return expiry

    async def _connection(self, endpoint: Endpoint) -> tuple[Connection, bool]:
        """A pooled connection (True) or a new one (False)."""
        idle = self.idle.get(endpoint)
        if idle:
            now = self.loop.time()
            expiry = self._expire(endpoint, idle, now)
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
        target = authority(host, port) + (f" through the proxy {authority(via.host, via.port)}"
                                          if via else "")
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

    # -- keeping one connection warm (keep_warm) ------------------------------------------

    def _released(self, endpoint: Endpoint) -> None:
        self._slots.release()
        self._in_flight[endpoint] -= 1

    def _tend_later(self, endpoint: Endpoint, delay: float) -> None:
        self._tending[endpoint] = self.loop.call_later(delay, self._tend, endpoint)

    def _tend(self, endpoint: Endpoint) -> None:
        """Runs when the endpoint's oldest idle connection expires, or an idle limit
        after the last look: expired connections go, and when none is left idle within
        ``keep_warm`` of the endpoint's last request, a new one is opened to wait for the
        next. Stops once the endpoint has had no request for ``keep_warm`` seconds."""
        del self._tending[endpoint]
        now = self.loop.time()
        idle = self.idle.setdefault(endpoint, [])
        expiry = self._expire(endpoint, idle, now)
        if now - self._last_request.get(endpoint, now) >= self.keep_warm:
            self._last_request.pop(endpoint, None)
            return
        if idle:  # look again when the oldest expires
            self._tend_later(endpoint, max(idle[0].idle_since + expiry - now, 0.0) + 0.001)
            return
        if not self._in_flight.get(endpoint) and endpoint not in self._warming:
            # (a connection in use comes back idle when its exchange ends: no spare)
            task = self.loop.create_task(self._warm(endpoint, idle))
            self._warming[endpoint] = task
            task.add_done_callback(lambda _: self._warming.pop(endpoint, None))
        self._tend_later(endpoint, expiry)

    async def _warm(self, endpoint: Endpoint, idle: list[Connection]) -> None:
        try:
            conn = await self._connect(endpoint)
        except UpstreamError as exc:  # the next request connects and reports it
            log.debug("keeping a connection to %s warm failed: %s", endpoint, exc)
            return
        conn.park()
        idle.append(conn)

    async def aclose(self) -> None:
        for handle in self._tending.values():
            handle.cancel()
        self._tending.clear()
        for task in list(self._warming.values()):
            task.cancel()
        for conns in self.idle.values():
            for conn in conns:
                conn.abort()
            conns.clear()  # in place: each connection holds its endpoint's list
