"""The proxy's one upstream HTTP/1.1 client: bytes in, callbacks out.

An upstream connection is an :class:`asyncio.Protocol` fed to httptools' C parser (the
parser uvicorn uses), and the body bytes of each read are handed to a *sink* callback
inside ``data_received``: no buffer, no future, no task switch per read. A general
client (httpx, aiohttp) puts a stream reader, a future and a task wake-up between the
socket and the relay on every read; at SSE rates that was most of the proxy's CPU per
event (``benchmarks/profile.md``).

Reading a body is one call, :meth:`WireBody.pipe`: ``sink(chunk)`` runs with the body
bytes of each read and returns :data:`GO` or :data:`PAUSE` (the client cannot take more
now) or :data:`STOP` (the client is gone). ``pipe`` returns ``True`` when the body ended
and ``False`` when the sink paused it; the caller waits for its client and calls
``pipe`` again. Flow control thus travels one way, as the sink's return value.

What the client does, and does not do:

* Requests are written exactly as given (:func:`serialize`): no automatic headers, no
  decompression, no redirects, no cookies.
* Bodies are de-chunked (``Transfer-Encoding: chunked``), sized by ``Content-Length``,
  or read until the upstream closes; 1xx responses are skipped.
* Other transfer codings follow RFC 9112 section 6.3: with ``chunked`` the final coding
  the body is de-chunked, else it is read until the upstream closes (whether
  ``chunked`` is last is asked of the parser itself, :func:`_parser_reads_chunked`); the
  one coding left (``gzip``, ``x-gzip``, ``deflate``) is then undone here
  (:class:`_Decoding`), not passed on. A transfer coding is hop-by-hop (RFC 9112
  section 6.1): it belongs to the upstream's connection, which ends here, and the proxy
  frames the body anew for its own client without forwarding ``Transfer-Encoding``. Passing ``gzip`` on would need
  ``Transfer-Encoding: gzip, chunked`` towards the client, which uvicorn cannot write
  and h11 (httpx, the openai SDK) refuses; nginx 1.22 (tried here) drops the coding's
  name and hands its client gzip bytes that look like content. Relabelling it
  ``Content-Encoding`` would change the representation (RFC 9110 section 8.4.1).
  Undoing it changes no content byte, as de-chunking does not. So on measured routes
  (``Accept-Encoding: identity``, and no ``TE`` is sent, so a gzip transfer coding is
  the upstream's own idea) the events are decoded before the relay and measured as any
  stream, each when its decoded bytes are handed on. Anything else (``compress``,
  ``br``, two codings, ``chunked`` not last, parameters) is a
  :class:`RemoteProtocolError` before any byte is sent; coded data that stops early is
  a :class:`ReadError`, invalid coded data a :class:`RemoteProtocolError`. Responses
  without such a coding pay nothing for this: the decoder exists only when needed.
* A pool of keep-alive connections per endpoint, LIFO (warm connections stay warm),
  ``max_connections`` in total; waiting longer than the connect timeout for a free
  connection is :class:`PoolTimeout`. A connection is reused only after a complete
  response that allowed keep-alive.
* Bytes after the end of a response, before another request was sent on its
  connection (an upstream answering one request twice, by bug or malice), belong to no
  request: RFC 9112 section 6.3 forbids taking them as a response. Whether they come in
  the same read (the parser's ``on_message_begin`` for a second message, or a parse
  error after the end) or a later one, the response stands as it ended (complete, if it
  was), nothing after it is parsed into its headers or body, the connection is closed,
  never pooled part-way through a message, and a warning names the upstream. Bytes on
  an idle pooled connection close it without a warning: a server may send a 408 before
  it closes an idle connection.
* **Reusing an idle connection safely.** An upstream may close an idle connection at
  the moment the proxy reuses it; a POST then fails with no answer and must not be sent
  twice (it may have started a generation). uvicorn closes idle connections after 5 s,
  and vLLM, SGLang and llama-cpp-python serve with uvicorn, so sparse traffic meets that
  moment. Three defences, cheapest first:

  1. *Expiry below the upstream's*: an idle connection older than
     ``keepalive_expiry`` (default 4 s, below uvicorn's 5 s) is closed, not reused.
  2. *Learning the upstream's limit*: when the upstream closes an idle connection
     after ``t`` seconds, connections to that endpoint are retired after ``0.75 t``
     from then on (never below 0.25 s). A restart of the upstream closes every idle
     connection at once and teaches that floor, so the limit also recovers: a
     connection the pool retires at the learned limit while the upstream still has
     it open (its socket quiet) outlived it, and after three such retirements with no
     idle close in between the limit doubles, up to ``keepalive_expiry``, where the
     learned limit is forgotten. A doubling past the upstream's real limit is undone
     by its next idle close, and the next attempt then needs twice the run (up to 48).
  3. *A liveness check before reuse*: ``poll()`` on the socket, one system call. An
     idle connection has nothing to read; if it is readable, the upstream's FIN (or
     stray bytes) arrived but the event loop has not processed it yet, and the
     connection is dropped. This is what closes the window that the first two leave
     when the loop is busy.

  What remains is a close and a request crossing, before the proxy has learned the
  limit: within one network round trip, or, on a busy upstream whose event loop runs
  its idle timer late, while the request waits unread in its socket. That request is
  sent again, once, on a new connection, whatever its method, in one case only: the
  connection came from the pool, not one byte of the answer arrived, and the upstream
  *reset* it (``ECONNRESET``, or ``EPIPE`` while writing: :class:`ResetBeforeAnswer`)
  within :data:`RESET_UNREAD_S` (1 s) of the request.
  A reset is what a kernel sends when a socket is closed with bytes unread (RFC 2525,
  section 2.17), so the upstream closed it with the request in its buffer: no
  generation started (an HTTP server needs the whole body before it dispatches, and
  one that read the whole request and then closed would send a FIN, not a reset).
  This is RFC 9110 section 9.2.2's "some means to detect that the original request
  was never applied", and what browsers do on a reused connection. The reset also
  teaches the idle limit (the connection was idle as long as the upstream keeps one).
  A plain close (EOF) before any byte of the answer is not proof: the upstream may
  have read the request and died, so only idempotent methods (GET, HEAD, ...) are
  sent again then, and a POST fails with a 502; so does a POST reset later than 1 s
  (a middlebox, a crash in mid-prefill: the request may have been read). What is left
  is an upstream that reads a whole request and then resets within that second without
  a byte of answer, which servers do not do: that POST would be sent twice. A load
  balancer or another proxy between here and the server breaks the argument: the reset
  is then its own, and it may have forwarded the request before it; so the resend of a
  non-idempotent request is a setting (``resend_on_reset``,
  ``--upstream-resend-on-reset``), on by default, and off such a POST fails with a 502
  like a plain close. The client's clock runs throughout: the second connection's
  set-up is in the TTFT this proxy measures, as it is in the wait the client sees.
* Timeouts, checked lazily (one timer per request, re-armed only when it fires): no
  bytes for ``read_timeout`` -> :class:`ReadTimeout`; the request not written within
  ``write_timeout`` -> :class:`WriteTimeout`; connecting -> :class:`ConnectTimeout`.
  The read timeout measures the upstream only: while reading is paused for a slow
  client, nothing the upstream sends is read, so that time is not silence. The timer
  lapses while paused and each pause's length is credited on resume; bounding a client
  that stops reading altogether is the relay's business (``--client-write-timeout``).
* A connection that breaks mid-body raises :class:`ReadError` after every byte received
  before the break was handed on; invalid HTTP raises :class:`RemoteProtocolError`.
* A response head (status line and header fields, with any 1xx heads before it) may
  take :data:`MAX_HEAD_BYTES` (64 KiB, as an HTTP proxy's answer to ``CONNECT``); past
  that, :class:`ResponseHeadTooLarge` as soon as the bytes are read, so a header flood
  neither grows the parser's memory nor waits for the read timeout. The count is kept
  on the head's reads only (``_head_received``); a head that arrives whole in one read
  with body bytes after it is measured by its header fields.
* Trailer fields after a chunked body are read and dropped, never added to the
  response's headers (those went to the client already, and ``x-queue-time`` must not
  come from a trailer). They are counted as a head's fields are, and reads that bring
  :data:`MAX_HEAD_BYTES` without a body byte (one endless trailer field, chunk
  extensions) are a flood too: either is a :class:`ResponseHeadTooLarge` after every
  body byte was handed on, and the connection is closed.
* ``https://`` upstreams use ``ssl.create_default_context()`` (system CAs, SNI,
  hostname checks). Through an HTTP proxy (:class:`Endpoint` ``via``), an ``https``
  upstream is reached with ``CONNECT`` and TLS inside the tunnel; a plain ``http``
  upstream is asked in absolute form by the caller (see ``proxy.upstream``).

Errors are this module's own small set (:class:`UpstreamError` and its subclasses),
modelled on httpcore's split of pool, connection and protocol failures;
``proxy.upstream.error_response`` maps them once to the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import select
import socket
import ssl
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import httptools

from proxy.logs import RateLimitedLog

GO, PAUSE, STOP = 0, 1, 2
# Sent again once on a fresh connection when a pooled one turns out closed before any
# byte of the answer came back. Any other method only when the upstream reset it
# (ResetBeforeAnswer): a closed one may have read the request and started a generation.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
# A reset of a pooled connection this soon after the request was written, before any
# byte of the answer, is an idle close that met the request (ResetBeforeAnswer): an
# idle timer runs late by milliseconds. A later reset is something else (a crash, a
# middlebox) that may come after the request started a generation.
RESET_UNREAD_S = 1.0
# Bytes held for a response whose body nobody reads yet, before upstream reading pauses.
HOLD_BUFFER = 256 * 1024
# The most a response head (status line, header fields, any 1xx heads before it) may take;
# the same bound as for an HTTP proxy's answer to CONNECT.
MAX_HEAD_BYTES = 64 * 1024
# Decoded bytes handed to the sink per call, at most, when a transfer coding is undone: a
# few KiB of gzip can decode to gigabytes, and the sink's PAUSE must stop it in between.
DECODE_PIECE = 256 * 1024
# A learned idle limit is used at this fraction, and never below MIN_LEARNED_EXPIRY.
LEARNED_MARGIN = 0.75
MIN_LEARNED_EXPIRY = 0.25
# A learned idle limit doubles (back toward keepalive_expiry) after this many idle
# connections in a row outlived it; each doubling the upstream undoes doubles the run
# the next one needs, up to MAX_RECOVERY_RUN.
RECOVERY_RUN = 3
MAX_RECOVERY_RUN = 48

Sink = Callable[[bytes], int]

log = logging.getLogger("proxy.wire")

_TOO_LARGE = f"response headers larger than {MAX_HEAD_BYTES // 1024} KiB"
_TRAILERS_TOO_LARGE = (f"response trailers, or chunk framing without a body byte, larger "
                       f"than {MAX_HEAD_BYTES // 1024} KiB")


class UpstreamError(Exception):
    """The exchange with the upstream failed. Subclasses say where."""


class ConnectError(UpstreamError):
    """No connection: refused, unreachable, DNS, TLS, or a proxy that refused CONNECT."""


class ConnectTimeout(ConnectError):
    """Connecting (and, through a proxy, tunnelling) took longer than the connect timeout."""


class PoolTimeout(UpstreamError):
    """Every connection slot stayed busy for longer than the connect timeout."""


class UpstreamTimeout(UpstreamError):
    """The upstream went silent (a read) or would not take the request (a write)."""


class ReadTimeout(UpstreamTimeout):
    pass


class WriteTimeout(UpstreamTimeout):
    pass


class ReadError(UpstreamError):
    """The connection closed or was reset before the response was complete."""


class ResetBeforeAnswer(ReadError):
    """The upstream reset a connection it had taken from the pool before any byte of its
    answer: it closed the socket with the request unread (see the module docstring)."""


class RemoteProtocolError(UpstreamError):
    """The upstream sent something that is not HTTP/1.1."""


class ResponseHeadTooLarge(RemoteProtocolError):
    """The upstream's response head passed :data:`MAX_HEAD_BYTES` (a header flood)."""


class SinkStopped(Exception):
    """The sink said STOP: whoever the body was going to takes no more of it (the
    client is gone, or :meth:`WireBody.read` has its limit)."""


class _AfterTheEnd(Exception):
    """Raised in the parser's callback when a second response begins after the current
    one ended, so the parser stops there (see ``_Connection._after_the_end``)."""


@dataclass(frozen=True, slots=True)
class ProxyEndpoint:
    """An HTTP proxy to tunnel through (``HTTPS_PROXY`` for an https upstream)."""

    host: str
    port: int
    authorization: bytes = b""  # the Proxy-Authorization value, from the proxy URL's user info

    @classmethod
    def from_url(cls, url: str) -> ProxyEndpoint:
        from urllib.parse import unquote, urlsplit

        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme != "http" or not parts.hostname:
            shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
            raise ValueError(f"only http:// proxies are supported, not {shown!r}")  # no password
        auth = b""
        if parts.username is not None:
            user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            auth = b"Basic " + base64.b64encode(user.encode())
        return cls(parts.hostname, parts.port or 80, auth)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a connection goes: a pool key."""

    scheme: str
    host: str
    port: int
    via: ProxyEndpoint | None = None  # CONNECT tunnel through this proxy (https only)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class _Exchange:
    """One request/response on one connection; owned by the connection while active."""

    __slots__ = (
        "decoding", "error", "finished", "has_length", "head", "head_bytes", "headers_done",
        "idle_s", "informational", "keep_alive", "last_read", "message_done", "parts",
        "raw_headers", "received", "sink", "status", "trailer_bytes", "unframed", "waiter",
        "write_started",
    )  # fmt: skip

    def __init__(self, head: bool, now: float, idle_s: float = -1.0) -> None:
        self.head = head
        self.idle_s = idle_s  # how long the connection was idle before it (-1: a new one)
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.informational = False
        self.has_length = False  # Content-Length or chunked: else the body ends at close
        self.keep_alive = False
        self.message_done = False  # the parser saw the end of the response
        self.finished = False  # done, by completion or failure; the connection is released
        self.error: UpstreamError | SinkStopped | None = None
        self.parts: list[bytes] = []  # body bytes not yet handed to a sink
        self.sink: Sink | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.last_read = now
        self.write_started = now
        self.received = False  # any byte of the response yet
        self.head_bytes = 0  # bytes read before the headers were complete
        # bytes read after the headers since the last body byte: chunk framing, and a
        # trailer section after the last chunk (bounded like a head, see data_received)
        self.unframed = 0
        self.trailer_bytes = 0  # trailer fields read, as a head's fields are counted
        self.decoding: _Decoding | None = None  # a transfer coding other than chunked

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, loop: asyncio.AbstractEventLoop) -> None:
        """Until the next :meth:`wake` (headers, pause, end, failure)."""
        self.waiter = loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class _Connection(asyncio.Protocol):
    """One upstream connection: an asyncio protocol and httptools' parser callbacks."""

    def __init__(self, owner: WireTransport, endpoint: Endpoint) -> None:
        self.owner = owner
        self.time = owner.loop.time  # bound once: read per upstream read
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.fileno = -1
        self.parser = httptools.HttpResponseParser(self)
        self.ex: _Exchange | None = None
        self.lost = False
        self.idle_since = -1.0  # >= 0 while idle in the pool
        self.read_paused = False
        self.paused_at = 0.0  # when reading was paused, for the read timeout's credit
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.fileno = sock.fileno()

    def data_received(self, data: bytes) -> None:
        ex = self.ex
        if ex is None or ex.finished:  # bytes nobody asked for: not reusable
            if ex is not None and ex.error is None:  # after the end, before the release
                self._after_the_end(ex)
            else:
                self._abort()
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
            self._fail(ex, ResponseHeadTooLarge(_TRAILERS_TOO_LARGE))
            return
        self._flush(ex)
        if ex.message_done and not ex.finished:
            self._finish(ex)

    def _head_received(self, ex: _Exchange, data: bytes) -> None:
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
            self._fail(ex, ResponseHeadTooLarge(_TOO_LARGE))
            return
        self._flush(ex)
        if ex.message_done and not ex.finished:
            self._finish(ex)

    def _parse_failed(self, ex: _Exchange, exc: httptools.HttpParserError) -> None:
        """The parser stopped: at invalid HTTP, or at an error a callback raised."""
        self._flush(ex)
        if ex.message_done:  # the response had ended: what came after belongs to no request
            self._after_the_end(ex)
            return
        cause = exc.__context__  # what a callback raised, e.g. ResponseHeadTooLarge
        self._fail(ex, cause if isinstance(cause, UpstreamError)
                   else RemoteProtocolError(f"invalid HTTP from the upstream: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._cancel_timer()
        if self.idle_since >= 0:  # closed by the upstream while idle in the pool
            self.owner.learn_idle_limit(self.endpoint, self.owner.loop.time() - self.idle_since)
            return
        ex = self.ex
        if ex is None or ex.finished:
            return
        self._flush(ex)
        if ex.headers_done and not ex.has_length and exc is None and not ex.informational:
            self._finish(ex)  # a body delimited by the connection's end is complete
            return
        detail = f": {exc}" if exc is not None else ""
        if (ex.idle_s >= 0 and not ex.received
                and isinstance(exc, (ConnectionResetError, BrokenPipeError))
                and self.owner.loop.time() - ex.write_started < RESET_UNREAD_S):
            # the upstream closed the idle connection with our request unread: it was
            # idle about as long as the upstream keeps one
            self.owner.learn_idle_limit(self.endpoint, ex.idle_s)
            self._fail(ex, ResetBeforeAnswer(f"upstream reset the connection{detail}"))
            return
        self._fail(ex, ReadError(f"upstream closed the connection{detail}"))

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
                raise ResponseHeadTooLarge(_TRAILERS_TOO_LARGE)
            return
        ex.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.ex
        assert ex is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            ex.informational = True  # 100 Continue, 103 Early Hints: skip, wait for the answer
            ex.raw_headers = []
            return
        if ex.head_bytes > MAX_HEAD_BYTES and sum(
                len(k) + len(v) + 4 for k, v in ex.raw_headers) > MAX_HEAD_BYTES:
            raise ResponseHeadTooLarge(_TOO_LARGE)  # the reads held more than the head: count it
        ex.status = status
        ex.keep_alive = self.parser.should_keep_alive() and not ex.head
        if ex.head or status in (204, 304):
            ex.has_length = True  # no body
        else:
            codings: list[bytes] = []
            for k, v in ex.raw_headers:
                name = k.lower()
                if name == b"content-length":
                    ex.has_length = True
                elif name == b"transfer-encoding":
                    codings.append(v)
            if codings == [b"chunked"]:
                ex.has_length = True
            elif codings:
                ex.has_length, coding = _transfer_codings(codings)
                if coding is not None:
                    ex.decoding = _Decoding(coding, self, ex)
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

    def start(self, payload: bytes, head: bool) -> _Exchange:
        assert self.transport is not None and self.ex is None
        now = self.owner.loop.time()
        ex = self.ex = _Exchange(head, now,
                                 now - self.idle_since if self.idle_since >= 0 else -1.0)
        self.idle_since = -1.0
        self.transport.write(payload)
        self._arm(now)
        return ex

    def idle_and_alive(self, now: float, expiry: float) -> bool:
        """May this pooled connection carry the next request? See the module docstring."""
        transport = self.transport
        if (self.lost or transport is None or transport.is_closing()
                or now - self.idle_since > expiry):
            return False
        if self.readable():  # EOF, a reset or stray bytes: the upstream is done with it
            self.owner.learn_idle_limit(self.endpoint, now - self.idle_since)
            return False
        return True

    def still_open(self) -> bool:
        """Had the upstream kept this idle connection open, as far as the socket says?"""
        transport = self.transport
        return not (self.lost or transport is None or transport.is_closing()
                    or self.readable())

    def readable(self) -> bool:
        """Something to read on the socket (one ``poll()``, no wait): a FIN, an RST or
        bytes that the event loop has not processed yet."""
        if self.fileno < 0:
            return False
        poller = select.poll()
        poller.register(self.fileno, select.POLLIN)
        return bool(poller.poll(0))

    def _flush(self, ex: _Exchange) -> None:
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
            self._fail(ex, ReadError(f"relay failed: {exc!r}"))
            return
        if verdict == GO:
            return
        if verdict == PAUSE:
            self.pause_reading()
        elif ex.finished:  # the whole body had arrived, but the sink did not take it
            if ex.error is None:
                ex.error = SinkStopped("the client went away")
        else:
            self._fail(ex, SinkStopped("the client went away"))
        ex.wake()

    def _after_the_end(self, ex: _Exchange) -> None:
        """Response bytes after the end of the response, before another request was sent
        on this connection: an upstream that answers one request twice (RFC 9112 section
        6.3: a client must not take such bytes as a response). The response as it ended
        stands; nothing of what followed is parsed or passed on, and the connection is
        closed, never pooled: it is part-way through a message nobody asked for."""
        self.owner.warnings.warning(
            "upstream %s sent bytes after the end of a response, before another request: "
            "the response stands as it ended, the connection is closed", self.endpoint)
        ex.keep_alive = False
        if not ex.finished:
            self._finish(ex)
        self._abort()

    def _finish(self, ex: _Exchange) -> None:
        ex.finished = True
        self._cancel_timer()
        ex.wake()

    def _fail(self, ex: _Exchange, error: UpstreamError | SinkStopped) -> None:
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
            self.paused_at = self.time()
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and self.transport is not None and not self.lost:
            self.read_paused = False
            ex = self.ex
            if ex is not None and not ex.finished:
                now = self.time()
                ex.last_read += now - self.paused_at  # the pause was not the upstream's silence
                if self.timer is None:  # it lapsed while paused
                    self.timer = self.owner.loop.call_at(
                        ex.last_read + self.owner.read_timeout, self._check_timeouts)
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
        if self.read_paused:
            return  # nothing is read, so nothing to judge: resume_reading() re-arms
        owner = self.owner
        now = owner.loop.time()
        sending = (not ex.headers_done and self.transport is not None
                   and self.transport.get_write_buffer_size() > 0)
        if sending and now - ex.write_started >= owner.write_timeout:
            self._fail(ex, WriteTimeout(
                f"request not sent to the upstream within {owner.write_timeout:g} s"))
            return
        if now - ex.last_read >= owner.read_timeout:
            what = "response headers" if not ex.headers_done else "more of the body"
            self._fail(ex, ReadTimeout(
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
        self.idle_since = -1.0
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
            self.owner.idle.setdefault(self.endpoint, []).append(self)
        else:
            self._abort()


_DECODABLE = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS,
              b"deflate": zlib.MAX_WBITS}


def _transfer_codings(lines: list[bytes]) -> tuple[bool, bytes | None]:
    """A ``Transfer-Encoding`` other than plain ``chunked`` (RFC 9112 section 6.3), its
    field lines as received: is ``chunked`` the final coding (else the body ends when the
    connection does), and which one coding is left to undo (``gzip``, ``x-gzip`` or
    ``deflate``)? Anything else (``compress``, ``br``, two codings, ``chunked`` not last,
    parameters) is a :class:`RemoteProtocolError` before any byte goes to the client.

    Whether the body is chunked is what the parser decides, not what this module reads
    into the value: llhttp's rule has corners (``chunked, `` and ``chunked\t`` are not
    chunked to it, ``, chunked`` is), and a client and its parser that disagree hand the
    chunk framing on as content. So the parser is asked (:func:`_parser_reads_chunked`),
    and a value whose list of codings says otherwise is refused."""
    chunked = _parser_reads_chunked(lines)
    value = b",".join(lines)
    codings = [c.strip(b" \t").lower() for c in value.split(b",")]
    codings = [c for c in codings if c]
    if chunked != (bool(codings) and codings[-1] == b"chunked"):
        shown = value.decode("latin-1")[:100]
        raise RemoteProtocolError(f"ambiguous transfer coding from the upstream: {shown!r}")
    while codings[-2:] == [b"chunked", b"chunked"]:  # the header repeated, the body chunked
        codings.pop()  # once: the parser reads it so, and so does every client
    rest = codings[:-1] if chunked else codings
    # identity is no coding at all; it is dropped only here, after the decision above, so
    # that "chunked, identity" (not chunked, to the parser) is the refusal below
    rest = [c for c in rest if c != b"identity"]
    if len(rest) > 1 or (rest and rest[0] not in _DECODABLE):
        shown = value.decode("latin-1")[:100]
        raise RemoteProtocolError(f"unsupported transfer coding from the upstream: {shown!r}")
    return chunked, rest[0] if rest else None


class _Ended:
    """Callbacks of :func:`_parser_reads_chunked`'s probe."""

    done = False

    def on_message_complete(self) -> None:
        self.done = True


def _parser_reads_chunked(lines: list[bytes]) -> bool:
    """Does httptools read a body with these ``Transfer-Encoding`` field lines as
    chunked? Asked of a new parser with a last chunk as the body: it completes the
    message only if it de-chunks. Paid only by responses with an unusual coding."""
    probe = _Ended()
    parser = httptools.HttpResponseParser(probe)
    head = b"".join(b"Transfer-Encoding: " + v + b"\r\n" for v in lines)
    try:
        parser.feed_data(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n0\r\n\r\n")
    except httptools.HttpParserError:
        return False  # the real parser refused the same lines already
    return probe.done


class _Decoding:
    """The transfer coding left on a body once it is de-chunked (``gzip``, ``deflate``),
    undone between the connection and the caller's sink. Only a response with such a
    coding has one: :meth:`WireBody.pipe` puts :meth:`feed` in front of the sink, so
    the per-read path of every other response is untouched.

    Output goes to the sink in pieces of at most :data:`DECODE_PIECE` bytes; when the
    sink pauses, the coded bytes not yet decoded go back to the exchange's ``parts``
    (the pipe returns and resumes them first), so a decompression bomb is held back by
    the client's pace like any other body."""

    __slots__ = ("coding", "conn", "ex", "fed", "sink", "wbits", "z")

    def __init__(self, coding: bytes, conn: _Connection, ex: _Exchange) -> None:
        self.coding = coding.decode("latin-1")
        self.wbits = _DECODABLE[coding]
        self.z = zlib.decompressobj(self.wbits)
        self.conn = conn
        self.ex = ex
        self.fed = False  # any coded byte taken yet
        self.sink: Sink | None = None

    def feed(self, chunk: bytes) -> int:
        """The sink the connection calls: ``chunk`` is coded bytes (or, empty, the call
        to hand on output that a paused sink left inside the decompressor)."""
        sink = self.sink
        assert sink is not None
        data = chunk
        while True:
            z = self.z
            try:
                out = z.decompress(data, DECODE_PIECE)
            except zlib.error as exc:
                if not self.fed and self.wbits == zlib.MAX_WBITS:
                    # "deflate" sent as raw DEFLATE, without the zlib wrapper: some
                    # servers do; decoders (browsers, httpx) accept it, so does this one.
                    self.wbits = -zlib.MAX_WBITS
                    self.z = zlib.decompressobj(self.wbits)
                    continue
                return self._fail(RemoteProtocolError(
                    f"invalid {self.coding} transfer coding from the upstream: {exc}"))
            self.fed = True
            data = z.unconsumed_tail
            after: UpstreamError | None = None
            if z.eof and z.unused_data:
                if self.wbits == _DECODABLE[b"gzip"]:  # another gzip member follows
                    data = z.unused_data + data
                    self.z = zlib.decompressobj(self.wbits)
                else:
                    after = RemoteProtocolError(
                        f"bytes after the end of the {self.coding} data from the upstream")
            more = bool(data) or len(out) == DECODE_PIECE  # input left, or output pending
            if out:
                verdict = sink(out)
                if after is not None:
                    return self._fail(after)
                if verdict != GO:
                    if more and verdict == PAUSE:
                        self.ex.parts.append(data)  # resumed by the next pipe (b"": output)
                    return verdict
            if after is not None:
                return self._fail(after)
            if not more:
                return GO

    def _fail(self, error: UpstreamError) -> int:
        """The coded data is invalid: the body fails, also if it had all arrived."""
        ex = self.ex
        if ex.finished:
            if ex.error is None:
                ex.error = error
                ex.keep_alive = False
        else:
            self.conn._fail(ex, error)
        return STOP

    def end(self) -> None:
        """The body ended: so must the coded data, or the upstream cut it short."""
        sink = self.sink
        tail = self.z.flush()
        if tail and sink is not None and sink(tail) == STOP:
            self.ex.error = SinkStopped("the client went away")
            self.ex.keep_alive = False
            raise self.ex.error
        if self.fed and not self.z.eof:
            error = ReadError(f"the upstream's body ended inside its {self.coding} coding")
            self.ex.error = error
            self.ex.keep_alive = False
            raise error


@dataclass(slots=True)
class _Recovery:
    """How one endpoint's learned idle limit climbs back (``outlived_limit``)."""

    run: int = 0  # idle connections in a row that outlived the limit
    needed: int = RECOVERY_RUN  # the run that doubles it
    raised: bool = False  # the limit in use is a doubling no idle close has undone


class WireTransport:
    """The pool and the exchange: ``await exchange(method, endpoint, payload)``."""

    def __init__(self, *, max_connections: int, connect_timeout: float, read_timeout: float,
                 write_timeout: float = 30.0, keepalive_expiry: float = 4.0,
                 ssl_context: ssl.SSLContext | None = None, resend_on_reset: bool = True) -> None:
        self.connect_timeout = connect_timeout
        # A non-idempotent request is sent again after ResetBeforeAnswer only with this on
        # (--upstream-resend-on-reset): off when a middlebox may have forwarded it already.
        self.resend_on_reset = resend_on_reset
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.keepalive_expiry = keepalive_expiry
        # Per endpoint: the idle limit learned from the upstream closing idle connections,
        # and how it climbs back (outlived_limit).
        self.learned_expiry: dict[Endpoint, float] = {}
        self.recovery: dict[Endpoint, _Recovery] = {}
        self._ssl = ssl_context
        self.warnings = RateLimitedLog(log, per_interval=10, interval_s=10.0)
        self._slots = asyncio.Semaphore(max_connections)
        self.idle: dict[Endpoint, list[_Connection]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def expiry(self, endpoint: Endpoint) -> float:
        return self.learned_expiry.get(endpoint, self.keepalive_expiry)

    def learn_idle_limit(self, endpoint: Endpoint, idle_s: float) -> None:
        """The upstream closed a connection that had been idle ``idle_s`` seconds: the
        limit goes down if this one is lower, and a run of connections that outlived
        the limit (:meth:`outlived_limit`) starts over either way."""
        recovery = self.recovery.get(endpoint)
        if recovery is not None:
            recovery.run = 0
        limit = max(MIN_LEARNED_EXPIRY, idle_s * LEARNED_MARGIN)
        if limit >= self.expiry(endpoint):
            return
        self.learned_expiry[endpoint] = limit
        if recovery is None:
            self.recovery[endpoint] = _Recovery()
        elif recovery.raised:  # the last doubling went past the upstream's own limit
            recovery.needed = min(2 * recovery.needed, MAX_RECOVERY_RUN)
            recovery.raised = False

    def outlived_limit(self, endpoint: Endpoint) -> None:
        """An idle connection to ``endpoint`` outlived the learned limit: the pool
        retired it at that age and the upstream still had it open. After
        :data:`RECOVERY_RUN` such retirements with no idle close in between, the limit
        doubles, up to ``keepalive_expiry`` (where the learned limit is forgotten), so
        one restart of the upstream, which closes every idle connection at once, does
        not end reuse for good. Should a doubling overshoot the upstream's own limit,
        its next idle close lowers it again (the liveness check covers the connections
        in between, as before anything was learned), and the next doubling needs twice
        the run: against an upstream whose limit is real, the attempts thin out."""
        limit = self.learned_expiry.get(endpoint)
        recovery = self.recovery.get(endpoint)
        if limit is None or recovery is None:
            return
        recovery.run += 1
        if recovery.run < recovery.needed:
            return
        recovery.run = 0
        if 2 * limit >= self.keepalive_expiry:
            del self.learned_expiry[endpoint]
            del self.recovery[endpoint]
        else:
            self.learned_expiry[endpoint] = 2 * limit
            recovery.raised = True

    async def exchange(self, method: str, endpoint: Endpoint, payload: bytes) -> WireResponse:
        """Send ``payload`` (a whole serialized request, :func:`serialize`) to
        ``endpoint``; return at the response headers."""
        if self._slots.locked():
            try:
                async with asyncio.timeout(self.connect_timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise PoolTimeout("no upstream connection became free in time") from None
        else:
            await self._slots.acquire()  # free slot: returns at once
        conn: _Connection | None = None
        try:
            head = method == "HEAD"
            for attempt in range(2):
                conn, reused = await self._connection(endpoint)
                ex = conn.start(payload, head)
                while not ex.headers_done and not ex.finished:
                    await ex.wait(self.loop)
                if (ex.error is not None and reused and not ex.received and attempt == 0
                        and not isinstance(ex.error, UpstreamTimeout)
                        and (method in IDEMPOTENT or (self.resend_on_reset and isinstance(
                            ex.error, ResetBeforeAnswer)))):
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

    async def _connection(self, endpoint: Endpoint) -> tuple[_Connection, bool]:
        """A pooled connection (True) or a new one (False)."""
        idle = self.idle.get(endpoint)
        if idle:
            now = self.loop.time()
            expiry = self.expiry(endpoint)
            outlived = False
            while idle and now - idle[0].idle_since > expiry:
                conn = idle.pop(0)  # the longest idle (LIFO: at the bottom) expired: close it
                outlived = outlived or (endpoint in self.learned_expiry and conn.still_open())
                conn._abort()
            if outlived:  # one per pass: a burst's connections expire together
                self.outlived_limit(endpoint)
            while idle:
                conn = idle.pop()
                if conn.idle_and_alive(now, expiry):
                    return conn, True
                conn._abort()
        return await self._connect(endpoint), False

    async def _connect(self, endpoint: Endpoint) -> _Connection:
        ssl_context: ssl.SSLContext | None = None
        if endpoint.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        host, port, via = endpoint.host, endpoint.port, endpoint.via
        target = f"{host}:{port}" + (f" through the proxy {via.host}:{via.port}" if via else "")
        try:
            async with asyncio.timeout(self.connect_timeout):
                sock = await self._tunnel(via, host, port) if via is not None else None
                if sock is not None:
                    _, conn = await self.loop.create_connection(
                        lambda: _Connection(self, endpoint), sock=sock, ssl=ssl_context,
                        server_hostname=host if ssl_context is not None else None)
                else:
                    _, conn = await self.loop.create_connection(
                        lambda: _Connection(self, endpoint), host, port, ssl=ssl_context,
                        server_hostname=host if ssl_context is not None else None)
        except TimeoutError:
            raise ConnectTimeout(f"connecting to {target} timed out") from None
        except OSError as exc:  # refused, unreachable, DNS (socket.gaierror), TLS
            raise ConnectError(f"cannot connect to {target}: {exc}") from exc
        return conn

    async def _tunnel(self, via: ProxyEndpoint, host: str, port: int) -> socket.socket:
        """A socket connected to ``host:port`` through ``via`` with ``CONNECT``."""
        loop = self.loop
        infos = await loop.getaddrinfo(via.host, via.port, type=socket.SOCK_STREAM)
        last: OSError | None = None
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
                break
            except OSError as exc:
                sock.close()
                last = exc
            except BaseException:  # cancelled or timed out while connecting: close it now,
                sock.close()  # not whenever the last reference to the error goes
                raise
        else:
            raise last or OSError(f"no address for {via.host}")
        try:
            authority = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode("idna")
            request = b"CONNECT %b HTTP/1.1\r\nHost: %b\r\n" % (authority, authority)
            if via.authorization:
                request += b"Proxy-Authorization: " + via.authorization + b"\r\n"
            await loop.sock_sendall(sock, request + b"\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                part = await loop.sock_recv(sock, 4096)
                if not part or len(head) > MAX_HEAD_BYTES:
                    raise OSError("the proxy closed the connection during CONNECT")
                head += part
            status_line = head.split(b"\r\n", 1)[0]
            fields = status_line.split(b" ", 2)
            if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or fields[1] != b"200":
                raise OSError(f"the proxy refused CONNECT: {status_line.decode('latin-1')[:200]}")
            if not head.endswith(b"\r\n\r\n"):
                raise OSError("the proxy sent bytes after its CONNECT answer")
        except BaseException:
            sock.close()
            raise
        return sock

    async def aclose(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn._abort()
        self.idle.clear()


class WireBody:
    """The body of a :class:`WireTransport` response; see the module docstring."""

    __slots__ = ("_conn", "_ex", "_release")

    def __init__(self, conn: _Connection, ex: _Exchange, release: Callable[[], None]) -> None:
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
        conn._flush(ex)  # bytes that came with the headers or while paused
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
            await ex.wait(conn.owner.loop)

    async def read(self, limit: int) -> bytes:
        """The whole body (at most ``limit`` bytes, else :class:`ReadError`), for callers
        that need it at once rather than relayed."""
        parts: list[bytes] = []
        size = 0

        def collect(chunk: bytes) -> int:
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
    """What :meth:`WireTransport.exchange` returns: status, headers, and the body."""

    __slots__ = ("body", "headers", "status_code")

    def __init__(self, status: int, raw_headers: list[tuple[bytes, bytes]], body: WireBody) -> None:
        self.status_code = status
        self.headers = Headers(raw_headers)
        self.body = body

    async def aclose(self) -> None:
        await self.body.aclose()


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def serialize(method: str, target: bytes, host: bytes, headers: list[tuple[bytes, bytes]],
              body: bytes) -> bytes:
    """A request as HTTP/1.1 bytes: request line, ``Host``, ``headers`` as given,
    ``Content-Length`` (for a body, or an empty POST/PUT/PATCH), then the body.

    ``headers`` must not hold Host, Content-Length or Transfer-Encoding (the proxy's
    header filter removes them, see ``proxy.upstream.forward_headers``).
    """
    parts = [method.encode("ascii"), b" ", target, b" HTTP/1.1\r\nHost: ", host, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if body or method in _BODY_METHODS:
        parts += (b"Content-Length: ", str(len(body)).encode(), b"\r\n")
    parts.append(b"\r\n")
    if body:
        parts.append(body)
    return b"".join(parts)
