"""HTTP/1.1 without the socket: the sink's verdict, request bytes, one exchange's state,
how its body is framed, and the transfer coding undone on the way to the sink.

The socket side, and httptools' callbacks that fill an :class:`Exchange`, are
:mod:`proxy.wire.connection`'s.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from enum import IntEnum

import httptools

from proxy.wire.errors import ReadError, RemoteProtocolError, SinkStopped, UpstreamError


class Verdict(IntEnum):
    """What a sink answers for each chunk: flow control, travelling back as a value."""

    GO = 0
    PAUSE = 1  # the client cannot take more now: reading pauses until the next pipe
    STOP = 2  # the client is gone: the body ends with SinkStopped


# Module names for the members, so per-chunk code reads one global, not an attribute.
GO, PAUSE, STOP = Verdict.GO, Verdict.PAUSE, Verdict.STOP

Sink = Callable[[bytes], Verdict]

# The most a response head (status line, header fields, any 1xx heads before it) may take;
# the same bound as for an HTTP proxy's answer to CONNECT.
MAX_HEAD_BYTES = 64 * 1024
TOO_LARGE = f"response headers larger than {MAX_HEAD_BYTES // 1024} KiB"
TRAILERS_TOO_LARGE = (
    f"response trailers, or chunk framing without a body byte, larger "
    f"than {MAX_HEAD_BYTES // 1024} KiB"
)
# Decoded bytes handed to the sink per call, at most, when a transfer coding is undone: a
# few KiB of gzip can decode to gigabytes, and the sink's PAUSE must stop it in between.
DECODE_PIECE = 256 * 1024

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def serialize(
    method: str, target: bytes, host: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes:
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


class Exchange:
    """One request/response on one connection; owned by the connection while active."""

    __slots__ = (
        "decoding", "error", "finished", "has_length", "head", "head_bytes", "headers_done",
        "idle_s", "informational", "keep_alive", "last_read", "message_done", "parts",
        "raw_headers", "received", "sink", "status", "trailer_bytes", "unframed", "waiter",
        "write_started",
    )  # fmt: skip

    def __init__(self, head: bool, now: float, idle_s: float | None) -> None:
        self.head = head
        self.idle_s = idle_s  # how long its pooled connection was idle (None: a new one)
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
        # trailer section after the last chunk (bounded like a head)
        self.unframed = 0
        self.trailer_bytes = 0  # trailer fields read, as a head's fields are counted
        self.decoding: Decoding | None = None  # a transfer coding other than chunked

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


def body_framing(
    head: bool, status: int, raw_headers: list[tuple[bytes, bytes]]
) -> tuple[bool, bytes | None]:
    """Is the body delimited (no body, ``Content-Length`` or chunked; else it ends when
    the connection does), and which transfer coding is left to undo, if any?"""
    if head or status in (204, 304):
        return True, None  # no body
    has_length = False
    codings: list[bytes] = []
    for k, v in raw_headers:
        name = k.lower()
        if name == b"content-length":
            has_length = True
        elif name == b"transfer-encoding":
            codings.append(v)
    if codings == [b"chunked"]:
        return True, None
    if codings:
        return transfer_codings(codings)
    return has_length, None


# The codings the proxy undoes (zlib's window bits): transfer codings here, and the
# content codings of an event stream its upstream compressed (proxy.measure.DecodedMeter)
DECODABLE = {
    b"gzip": 16 + zlib.MAX_WBITS,
    b"x-gzip": 16 + zlib.MAX_WBITS,
    b"deflate": zlib.MAX_WBITS,
}


def transfer_codings(lines: list[bytes]) -> tuple[bool, bytes | None]:
    """A ``Transfer-Encoding`` other than plain ``chunked``, its field lines as received:
    is ``chunked`` the final coding (RFC 9112 section 6.3: else the body ends when the
    connection does), and which one coding is left to undo? Anything else is a
    :class:`RemoteProtocolError` before any byte goes to the client. Whether the body is
    chunked is the parser's decision, not this function's reading of the value
    (``docs/design/upstream-client.md``, "Transfer codings")."""
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
    if len(rest) > 1 or (rest and rest[0] not in DECODABLE):
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
    message only if it de-chunks (llhttp's rule has corners: ``chunked, `` is not)."""
    probe = _Ended()
    parser = httptools.HttpResponseParser(probe)
    head = b"".join(b"Transfer-Encoding: " + v + b"\r\n" for v in lines)
    try:
        parser.feed_data(b"HTTP/1.1 200 OK\r\n" + head + b"\r\n0\r\n\r\n")
    except httptools.HttpParserError:
        return False  # the real parser refused the same lines already
    return probe.done


class Decoding:
    """The transfer coding left on a body once it is de-chunked (``gzip``, ``deflate``),
    undone between the connection and the caller's sink: it is hop-by-hop (RFC 9112
    section 6.1), so it ends here as the chunk framing does. Only a response with such a
    coding has one: :meth:`WireBody.pipe` puts :meth:`feed` in front of the sink.

    Output goes to the sink in pieces of at most :data:`DECODE_PIECE` bytes; when the
    sink pauses, the coded bytes not yet decoded go back to the exchange's ``parts``
    (the pipe resumes them first), so a decompression bomb keeps the client's pace."""

    __slots__ = ("coding", "ex", "fail", "fed", "sink", "wbits", "z")

    def __init__(
        self, coding: bytes, ex: Exchange, fail: Callable[[Exchange, UpstreamError], None]
    ) -> None:
        self.coding = coding.decode("latin-1")
        self.wbits = DECODABLE[coding]
        self.z = zlib.decompressobj(self.wbits)
        self.ex = ex
        self.fail = fail  # the connection's: ends the exchange and closes the connection
        self.fed = False  # any coded byte taken yet
        self.sink: Sink | None = None

    def feed(self, chunk: bytes) -> Verdict:
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
                return self._fail(
                    RemoteProtocolError(
                        f"invalid {self.coding} transfer coding from the upstream: {exc}"
                    )
                )
            self.fed = True
            data = z.unconsumed_tail
            after: UpstreamError | None = None
            if z.eof and z.unused_data:
                if self.wbits == DECODABLE[b"gzip"]:  # another gzip member follows
                    data = z.unused_data + data
                    self.z = zlib.decompressobj(self.wbits)
                else:
                    after = RemoteProtocolError(
                        f"bytes after the end of the {self.coding} data from the upstream"
                    )
            more = bool(data) or len(out) == DECODE_PIECE  # input left, or output pending
            if out:
                verdict = sink(out)
                if after is not None:
                    return self._fail(after)
                if verdict is not GO:
                    if more and verdict is PAUSE:
                        self.ex.parts.append(data)  # resumed by the next pipe (b"": output)
                    return verdict
            if after is not None:
                return self._fail(after)
            if not more:
                return GO

    def _fail(self, error: UpstreamError) -> Verdict:
        """The coded data is invalid: the body fails, also if it had all arrived."""
        ex = self.ex
        if ex.finished:
            if ex.error is None:
                ex.error = error
                ex.keep_alive = False
        else:
            self.fail(ex, error)
        return STOP

    def end(self) -> None:
        """The body ended: so must the coded data, or the upstream cut it short."""
        sink = self.sink
        tail = self.z.flush()
        if tail and sink is not None and sink(tail) is STOP:
            self.ex.error = SinkStopped("the client went away")
            self.ex.keep_alive = False
            raise self.ex.error
        if self.fed and not self.z.eof:
            error = ReadError(f"the upstream's body ended inside its {self.coding} coding")
            self.ex.error = error
            self.ex.keep_alive = False
            raise error
