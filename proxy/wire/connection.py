"""One upstream connection: an :class:`asyncio.Protocol` fed to httptools' parser, whose
callbacks fill the current :class:`~proxy.wire.http11.Exchange` and hand each read's body
bytes to its sink inside ``data_received`` (no buffer, future or task switch per read).
Its state, timeouts, liveness check and release to the pool are here as well.
"""

from __future__ import annotations

import asyncio
import errno
import select
import socket
from enum import IntEnum
from typing import cast

import httptools

from proxy.logs import RateLimitedLog
from proxy.wire.endpoint import Endpoint
from proxy.wire.errors import (
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    ResetBeforeAnswer,
    ResponseHeadTooLarge,
    SinkStopped,
    UpstreamError,
    WriteTimeout,
)
from proxy.wire.http11 import (
    GO,
    MAX_HEAD_BYTES,
    PAUSE,
    TOO_LARGE,
    TRAILERS_TOO_LARGE,
    Decoding,
    Exchange,
    body_framing,
)
from proxy.wire.keepalive import IdleLimits

# A reset of a pooled connection this soon after the request was written, before any
# byte of the answer, is an idle close that met the request (ResetBeforeAnswer).
RESET_UNREAD_S = 1.0
# How long such a connection, closed with a FIN, waits for the reset that may follow it:
# on a network the reset of a request written behind the FIN comes a round trip later.
RESET_WAIT_S = 0.2
RESET_POLL_S = 0.01  # how often it looks
# Bytes held for a response whose body nobody reads yet, before upstream reading pauses.
HOLD_BUFFER = 256 * 1024


class ConnectionState(IntEnum):
    NEW = 0  # connected, no request yet
    ACTIVE = 1  # carrying an exchange (which may have ended, not yet released)
    IDLE = 2  # in the pool's idle list
    CLOSED = 3  # aborted here or closed by the upstream


# Members as module names: reading one through its class is a metaclass lookup, and
# pause/resume run per read when the client is slow.
_ACTIVE, _IDLE, _CLOSED = ConnectionState.ACTIVE, ConnectionState.IDLE, ConnectionState.CLOSED


class _AfterTheEnd(Exception):
    """Raised in the parser's callback when a second response begins after the current
    one ended, so the parser stops there (see :meth:`Connection._after_the_end`)."""


class Connection(asyncio.Protocol):
    """One upstream connection and httptools' parser callbacks.

    Parameters:
        loop: the event loop, for its clock and timers.
        endpoint: where the connection goes (named in warnings, taught to ``limits``).
        idle: the pool's idle list for ``endpoint``; :meth:`release` appends to it.
        limits: the learned idle limits, taught by the upstream's idle closes.
        read_timeout, write_timeout: seconds (``docs/design/upstream-client.md``).
        warnings: the rate-limited log for an upstream that misbehaves.
    """

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        endpoint: Endpoint,
        idle: list[Connection],
        limits: IdleLimits,
        read_timeout: float,
        write_timeout: float,
        warnings: RateLimitedLog,
    ) -> None:
        self.loop = loop
        self.time = loop.time  # bound once: read per upstream read
        self.endpoint = endpoint
        self.idle = idle
        self.limits = limits
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.warnings = warnings
        self.state = ConnectionState.NEW
        self.transport: asyncio.Transport | None = None
        self.sock: socket.socket | None = None  # the transport's view of it (getsockopt)
        self.fileno: int | None = None
        self.reset_after_fin = False  # eof_received saw a reset behind the upstream's FIN
        self.parser = httptools.HttpResponseParser(self)
        self.ex: Exchange | None = None
        self.idle_since = 0.0  # when it last went into the idle list
        self.read_paused = False
        self.paused_at = 0.0  # when reading was paused, for the read timeout's credit
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.sock = sock
            self.fileno = sock.fileno()

    def data_received(self, data: bytes) -> None:
        ex = self.ex
        if ex is None or ex.finished:  # bytes nobody asked for: not reusable
            if ex is not None and ex.error is None:  # after the end, before the release
                self._after_the_end(ex)
            else:
                self.abort()  # idle (a 408 before a close, say) or failed: closed, no warning
            return
        ex.last_read = self.time()
        if not ex.headers_done:
            self._head_received(ex, data)
            return
        ex.unframed += len(data)  # on_body sets it back to 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._parse_failed(ex, exc)
            return
        if ex.unframed > MAX_HEAD_BYTES and not ex.message_done:
            # Reads with no body byte: a trailer section (or chunk extensions) that does
            # not end. httptools gathers a field's pieces until it ends, so its memory
            # would grow with it: bounded as a head is, the response fails.
            self.fail(ex, ResponseHeadTooLarge(TRAILERS_TOO_LARGE))
            return
        self.flush(ex)
        if ex.message_done and not ex.finished:
            self._finish(ex)

    def _head_received(self, ex: Exchange, data: bytes) -> None:
        """``data_received`` before the response headers are complete: the same, plus
        the bound on the head's size (kept off the per-read path of the body)."""
        ex.received = True
        ex.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._parse_failed(ex, exc)
            return
        if not ex.headers_done and ex.head_bytes > MAX_HEAD_BYTES:
            self.fail(ex, ResponseHeadTooLarge(TOO_LARGE))
            return
        self.flush(ex)
        if ex.message_done and not ex.finished:
            self._finish(ex)

    def _parse_failed(self, ex: Exchange, exc: httptools.HttpParserError) -> None:
        """The parser stopped: at invalid HTTP, or at an error a callback raised."""
        self.flush(ex)
        if ex.message_done:  # the response had ended: what came after belongs to no request
            self._after_the_end(ex)
            return
        cause = exc.__context__  # what a callback raised, e.g. ResponseHeadTooLarge
        self.fail(
            ex,
            cause
            if isinstance(cause, UpstreamError)
            else RemoteProtocolError(f"invalid HTTP from the upstream: {exc}"),
        )

    def eof_received(self) -> bool | None:
        """The upstream's FIN. If it ends a request written onto a pooled connection
        with no byte of the answer yet, the upstream may have closed the connection
        before the request reached it (the FIN crossed the liveness check, or was on
        the way): its kernel then answers the request with a reset, which the read of
        the FIN hides, but the socket's pending error says (``EPIPE``). The connection
        waits for it up to :data:`RESET_WAIT_S` (on a network it comes a round trip
        after the FIN), then closes: :meth:`connection_lost` decides. True: the wait
        keeps the transport open."""
        ex = self.ex
        if ex is None or self.sock is None or self._idle_close_met(ex) is None:
            return None
        if self._reset_pending():
            return None
        self.loop.call_later(RESET_POLL_S, self._wait_for_reset, self.loop.time() + RESET_WAIT_S)
        return True

    def _idle_close_met(self, ex: Exchange) -> float | None:
        """How long the connection was idle before ``ex`` was written onto it, if a
        reset now would be the upstream's idle close meeting the request it never read
        (a pooled connection, no byte of the answer, within :data:`RESET_UNREAD_S` of
        the write); else None."""
        if ex.received or self.loop.time() - ex.write_started >= RESET_UNREAD_S:
            return None
        return ex.idle_s

    def _reset_pending(self) -> bool:
        """Did a reset follow the FIN (the socket's pending error)? Remembered."""
        assert self.sock is not None
        try:
            pending = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except OSError:
            pending = 0
        self.reset_after_fin = pending in (errno.EPIPE, errno.ECONNRESET)
        return self.reset_after_fin

    def _wait_for_reset(self, until: float) -> None:
        transport = self.transport
        if self.state is _CLOSED or transport is None or transport.is_closing():
            return  # failed meanwhile (a timeout, the client gone): closed already
        if not self._reset_pending() and self.loop.time() < until:
            self.loop.call_later(RESET_POLL_S, self._wait_for_reset, until)
            return
        transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        was_idle = self.state is _IDLE
        self.state = _CLOSED
        self._cancel_timer()
        if was_idle:  # closed by the upstream while idle in the pool
            self.limits.learn(self.endpoint, self.loop.time() - self.idle_since)
            return
        ex = self.ex
        if ex is None or ex.finished:
            return
        self.flush(ex)
        if ex.headers_done and not ex.has_length and exc is None and not ex.informational:
            self._finish(ex)  # a body delimited by the connection's end is complete
            return
        detail = (
            f": {exc}" if exc is not None else " (after its FIN)" if self.reset_after_fin else ""
        )
        reset = self.reset_after_fin or isinstance(exc, (ConnectionResetError, BrokenPipeError))
        idle = self._idle_close_met(ex) if reset else None
        if idle is not None:
            # The upstream closed the idle connection with our request unread (a kernel
            # resets a socket closed with bytes unread, RFC 2525 section 2.17): it was
            # idle about as long as the upstream keeps one.
            self.limits.learn(self.endpoint, idle)
            self.fail(ex, ResetBeforeAnswer(f"upstream reset the connection{detail}"))
            return
        self.fail(ex, ReadError(f"upstream closed the connection{detail}"))

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        ex = self.ex
        if ex is not None and ex.message_done:
            raise _AfterTheEnd  # a second response to one request: parse none of it

    def on_header(self, name: bytes, value: bytes) -> None:
        ex = self.ex
        assert ex is not None
        if ex.headers_done:
            # A trailer field after a chunked body (RFC 9112 section 7.1.2): httptools
            # reports it here too. Dropped: the response's headers went to the client
            # already, and no trailer may change what they said (x-queue-time included).
            # Counted as a head's fields are, so a flood fails however the reads fall.
            ex.trailer_bytes += len(name) + len(value) + 4
            if ex.trailer_bytes > MAX_HEAD_BYTES:
                raise ResponseHeadTooLarge(TRAILERS_TOO_LARGE)
            return
        ex.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.ex
        assert ex is not None
        status = self.parser.get_status_code()
        if not 100 <= status <= 599:  # RFC 9110 section 15: outside, invalid (uvicorn refuses it)
            raise RemoteProtocolError(f"invalid HTTP from the upstream: status {status}")
        if 100 <= status < 200 and status != 101:
            ex.informational = True  # 100 Continue, 103 Early Hints: skip, wait for the answer
            ex.raw_headers = []
            return
        if (
            ex.head_bytes > MAX_HEAD_BYTES
            and sum(len(k) + len(v) + 4 for k, v in ex.raw_headers) > MAX_HEAD_BYTES
        ):
            raise ResponseHeadTooLarge(TOO_LARGE)  # the reads held more than the head: count it
        ex.status = status
        ex.keep_alive = self.parser.should_keep_alive() and not ex.head
        ex.has_length, coding = body_framing(ex.head, status, ex.raw_headers)
        if coding is not None:
            ex.decoding = Decoding(coding, ex, self.fail)
        ex.headers_done = True
        if ex.head:
            ex.message_done = True  # the parser does not know the request was HEAD
        ex.wake()

    def on_body(self, body: bytes) -> None:
        ex = self.ex
        assert ex is not None
        ex.unframed = 0
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

    def start(self, payload: bytes, head: bool) -> Exchange:
        assert self.transport is not None and self.ex is None
        now = self.loop.time()
        state = self.state
        ex = self.ex = Exchange(head, now, now - self.idle_since if state is _IDLE else None)
        if state is not _CLOSED:
            self.state = _ACTIVE
        self.transport.write(payload)
        self._arm(now)
        return ex

    def idle_and_alive(self, now: float, expiry: float) -> bool:
        """May this pooled connection carry the next request? Not when it expired or
        the upstream is done with it (``docs/design/upstream-client.md``)."""
        transport = self.transport
        if (
            self.state is not _IDLE
            or transport is None
            or transport.is_closing()
            or now - self.idle_since > expiry
        ):
            return False
        if self.readable():  # EOF, a reset or stray bytes: the upstream is done with it
            self.limits.learn(self.endpoint, now - self.idle_since)
            return False
        return True

    def still_open(self) -> bool:
        """Had the upstream kept this idle connection open, as far as the socket says?"""
        transport = self.transport
        return not (
            self.state is _CLOSED or transport is None or transport.is_closing() or self.readable()
        )

    def readable(self) -> bool:
        """Something to read on the socket (one ``poll()``, no wait): a FIN, an RST or
        bytes that the event loop has not processed yet."""
        if self.fileno is None:
            return False
        poller = select.poll()
        poller.register(self.fileno, select.POLLIN)
        return bool(poller.poll(0))

    def flush(self, ex: Exchange) -> None:
        """Hand the body bytes read so far to the sink, and act on its verdict."""
        parts = ex.parts
        sink = ex.sink
        if not parts:
            return
        if sink is None:
            if sum(map(len, parts)) > HOLD_BUFFER:
                self.pause_reading()  # no reader yet: hold at most HOLD_BUFFER bytes
            return
        chunk = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        try:
            verdict = sink(chunk)
        except Exception as exc:  # a failing sink must not take the event loop's callback down
            self.fail(ex, ReadError(f"relay failed: {exc!r}"))
            return
        if verdict is GO:
            return
        if verdict is PAUSE:
            self.pause_reading()
        elif ex.finished:  # the whole body had arrived, but the sink did not take it
            if ex.error is None:
                ex.error = SinkStopped("the client went away")
        else:
            self.fail(ex, SinkStopped("the client went away"))
        ex.wake()

    def _after_the_end(self, ex: Exchange) -> None:
        """Response bytes after the end of the response, before another request was sent
        on this connection: an upstream that answers one request twice (RFC 9112 section
        6.3: a client must not take such bytes as a response). The response as it ended
        stands; nothing of what followed is parsed or passed on, and the connection is
        closed, never pooled: it is part-way through a message nobody asked for."""
        self.warnings.warning(
            "upstream %s sent bytes after the end of a response, before another request: "
            "the response stands as it ended, the connection is closed",
            self.endpoint,
        )
        ex.keep_alive = False
        if not ex.finished:
            self._finish(ex)
        self.abort()

    def _finish(self, ex: Exchange) -> None:
        ex.finished = True
        self._cancel_timer()
        ex.wake()

    def fail(self, ex: Exchange, error: UpstreamError | SinkStopped) -> None:
        """End ``ex`` with ``error`` and close the connection."""
        if ex.finished:
            return
        ex.error = error
        ex.finished = True
        ex.keep_alive = False
        self.abort()
        ex.wake()

    def pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None and self.state is not _CLOSED:
            self.read_paused = True
            self.paused_at = self.time()
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and self.transport is not None and self.state is not _CLOSED:
            self.read_paused = False
            ex = self.ex
            if ex is not None and not ex.finished:
                now = self.time()
                ex.last_read += now - self.paused_at  # the pause was not the upstream's silence
                if self.timer is None:  # it lapsed while paused
                    self.timer = self.loop.call_at(
                        ex.last_read + self.read_timeout, self._check_timeouts
                    )
            self.transport.resume_reading()

    def _arm(self, now: float) -> None:
        self._cancel_timer()
        self.timer = self.loop.call_at(
            now + min(self.read_timeout, self.write_timeout), self._check_timeouts
        )

    def _check_timeouts(self) -> None:
        """The lazy timer: it fires when a deadline may have passed, never once per read."""
        self.timer = None
        ex = self.ex
        if ex is None or ex.finished:
            return
        if self.read_paused:
            return  # nothing is read, so nothing to judge: resume_reading() re-arms
        now = self.loop.time()
        read_timeout, write_timeout = self.read_timeout, self.write_timeout
        sending = (
            not ex.headers_done
            and self.transport is not None
            and self.transport.get_write_buffer_size() > 0
        )
        if sending and now - ex.write_started >= write_timeout:
            self.fail(
                ex, WriteTimeout(f"request not sent to the upstream within {write_timeout:g} s")
            )
            return
        if now - ex.last_read >= read_timeout:
            what = "response headers" if not ex.headers_done else "more of the body"
            self.fail(ex, ReadTimeout(f"no {what} from the upstream within {read_timeout:g} s"))
            return
        due = ex.last_read + read_timeout
        if sending:
            due = min(due, ex.write_started + write_timeout)
        self.timer = self.loop.call_at(max(due, now + 0.001), self._check_timeouts)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def abort(self) -> None:
        self.state = _CLOSED
        self._cancel_timer()
        if self.transport is not None:
            self.transport.abort()

    def release(self, ex: Exchange | None) -> None:
        """``ex`` is done with: the connection goes back to the idle list if ``ex`` ended
        cleanly, else it is closed. A no-op unless ``ex`` is the connection's current
        exchange (closing a response twice must not touch the next request's)."""
        if ex is not self.ex:
            return
        self.ex = None
        self._cancel_timer()
        if (
            ex is not None
            and ex.finished
            and ex.error is None
            and ex.keep_alive
            and self.state is not _CLOSED
            and self.transport is not None
            and not self.transport.is_closing()
        ):
            self.resume_reading()  # it may have ended while the client was slow
            self.park()
            self.idle.append(self)
        else:
            self.abort()

    def park(self) -> None:
        """Idle from now on; the caller puts it in the idle list."""
        self.idle_since = self.loop.time()
        self.state = _IDLE
