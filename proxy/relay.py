"""The relay: upstream bytes out to the client as they arrive, events observed on the side.

Per read from the upstream the hot path does three things: hand the bytes on, read the
clock once, observe the events (:class:`_Forwarder`). Handing on takes one of two ways:
with the built-in upstream client under uvicorn, the read is written to the client's
transport from the upstream socket's callback (:func:`_pipe`, :class:`DirectWriter`);
otherwise the body is iterated and each chunk goes to ASGI ``send``. Either way the body
bytes of each read go out as they are, at once and whole: nothing is re-encoded or held
back (HTTP chunk framing aside). Observation happens *after* the hand-off, so
measurement adds no latency to the chunk it measures, and the time read is the moment
the event was handed on.

The one exception (``strip_usage``): when the proxy itself added
``stream_options.include_usage`` to the request, the usage-only event it caused
(``"choices": []``) is removed. To cut exactly that event the relay must know where
events end before it sends, so in this mode it forwards whole events only: the tail of
a read that ends inside an event waits for the read that completes it. An SSE client
cannot act on half an event anyway, so this costs the client nothing, and with
upstreams that write one event per read (all the common servers) nothing ever waits.

Failures of measurement never break a stream: if the parser or timer raised (they are
written not to), measurement stops for that stream and the bytes keep flowing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from proxy.measure import ONE_OUTPUT, EventInfo, Outcome, StreamTimer, inspect_event
from proxy.sse import SSEEvent, SSEParser
from proxy.wire import GO, PAUSE, STOP, SinkStopped, WireBody

if TYPE_CHECKING:
    from proxy.upstream import UpstreamResponse

log = logging.getLogger("proxy.relay")

# ``"choices"`` as a key (an unescaped quote on both sides) with an empty list as value.
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]').search

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Clock = Callable[[], float]


@dataclass(slots=True)
class RelayResult:
    outcome: Outcome
    complete: bool  # the upstream body ended normally
    t_end: float
    body: bytes | None = None  # the collected body of a non-stream answer (for usage)


# The bytes of a JSON string's body with no quote, no line break, not ending in a backslash.
_PLAIN_TEXT = re.compile(rb'[^"\r\n]*[^"\r\n\\]').fullmatch


class TokenTemplate:
    """The shape of one stream's token events, learned once, matched with two compares.

    Servers write every token event of a stream the same way; only the token text
    changes: ``data: {"id":"x",...,"delta":{"content":"<TEXT>"},...}\n\n``. From the first
    event that the full path classified as one output, this keeps what comes before
    ``<TEXT>`` and what comes after it. A later chunk that starts and ends with exactly
    those bytes, and whose middle holds no quote, no line break and no trailing
    backslash, is the same JSON with another non-empty string in the same place: one
    event, one output. That costs two byte compares instead of a parse and a scan per
    event (issue 5: measurement was a third of the proxy's CPU per event).

    Events that do not match (another key, a varying field such as OpenAI's
    ``obfuscation``, escaped quotes) take the full path, so the template can only make
    measurement cheaper, never different; after 8 misses in a row it is learned again
    (a reasoning model moving from ``reasoning_content`` to ``content``). A property
    test checks the template path against the full one on generated streams.
    """

    __slots__ = ("_head", "_misses", "_tail", "_width", "keys")

    def __init__(self, text_route: bool) -> None:
        self.keys = (b'"text":"',) if text_route else (
            b'"content":"', b'"reasoning_content":"', b'"reasoning":"', b'"refusal":"')
        self._head = b""  # empty: nothing learned
        self._tail = b""
        self._width = 0
        self._misses = 0

    def match(self, chunk: bytes) -> bool:
        head = self._head
        if not head:
            return False
        if (len(chunk) > self._width and chunk.startswith(head) and chunk.endswith(self._tail)
                and _PLAIN_TEXT(chunk, len(head), len(chunk) - len(self._tail))):
            self._misses = 0
            return True
        self._misses += 1
        if self._misses >= 8:
            self._head = b""
        return False

    def learn(self, chunk: bytes) -> None:
        """``chunk`` is one whole ``data:`` event the full path found to be one output."""
        if self._head:
            return
        for key in self.keys:
            at = chunk.find(key)
            if at >= 0:
                break
        else:
            return
        start = at + len(key)
        end = chunk.find(b'"', start)
        if (end <= start or chunk.find(key, start) >= 0 or b"\\" in chunk[start:end]
                or not chunk.startswith(b"data:") or not chunk.endswith(b"\n\n")):
            return
        self._head, self._tail = chunk[:start], chunk[end:]
        self._width = len(self._head) + len(self._tail)
        self._misses = 0


class _Forwarder:
    """The synchronous core of the relay, one per response: what to forward, what to observe.

    ``take(chunk)`` returns the bytes to hand on now; after handing them on, the caller
    reads the clock once and calls ``observe(t)``. Outside strip mode ``take`` does no
    work at all, so parsing never delays the bytes it parses.
    """

    __slots__ = (
        "_chunk",
        "_events",
        "_infos",
        "_one",
        "collect_limit",
        "collected",
        "collected_size",
        "parser",
        "pending",
        "pending_start",
        "removed_end",
        "strip",
        "template",
        "timer",
    )

    def __init__(self, timer: StreamTimer | None, parser: SSEParser | None, strip: bool,
                 collect_limit: int) -> None:
        measured = timer is not None and parser is not None
        self.timer = timer if measured else None
        self.parser = parser if measured else None
        self.strip = strip and measured
        self.collect_limit = collect_limit
        self.collected: list[bytes] | None = [] if collect_limit > 0 else None
        self.collected_size = 0
        self.pending = b""  # strip mode only: bytes not yet forwarded
        self.pending_start = 0  # stream offset of pending[0]
        self.removed_end = -1  # strip mode: stream offset where the removed event ended
        self._chunk = b""
        # strip mode, a chunk that was one event: its data (decoded after the send), or
        # what it said if that was known before; None: a list of events (``_events``)
        self._one: bytes | EventInfo | None = None
        self._events: list[SSEEvent] = []
        self._infos: list[EventInfo | None] = []
        self.template = TokenTemplate(timer.text_route) if timer is not None else None

    def take(self, chunk: bytes) -> bytes:
        if self.strip:
            return self._take_stripped(chunk)
        self._chunk = chunk
        collected = self.collected
        if collected is not None:
            self.collected_size += len(chunk)
            if self.collected_size <= self.collect_limit:
                collected.append(chunk)
            else:
                self.collected = None
        return chunk

    def observe(self, t: float) -> None:
        parser, timer = self.parser, self.timer
        if parser is None or timer is None:
            return
        try:
            if self.strip:
                one = self._one
                if one is ONE_OUTPUT:  # a template match
                    timer.token(t)
                    return
                if one is not None:  # the chunk was one event
                    if isinstance(one, bytes):
                        self._observe_single(timer, one, t)
                    else:
                        timer.observe(one, t)
                    return
                for event, info in zip(self._events, self._infos, strict=True):
                    if info is not None:
                        timer.observe(info, t)
                    elif not event.oversize:
                        timer.event(event.data, t)
                return
            chunk, template = self._chunk, self.template
            if template is not None and template.match(chunk) and parser.skip(len(chunk)):
                timer.token(t)
                return
            data = parser.single(chunk)
            if data is not None:
                self._observe_single(timer, data, t)
                return
            for event in parser.feed(self._chunk):
                if not event.oversize:
                    timer.event(event.data, t)
        except Exception:  # pragma: no cover - parser and timer do not raise
            log.exception("measurement failed; stream continues unmeasured")
            self.parser = None

    def _observe_single(self, timer: StreamTimer, data: bytes, t: float) -> None:
        """The chunk was one event with this data: classify it in full, and learn the
        stream's token template from it if it was a token."""
        if timer.event(data, t) is ONE_OUTPUT and self.template is not None:
            self.template.learn(self._chunk)

    def tail(self) -> bytes:
        """What is still held back (strip mode) when the body ends, however it ended."""
        pending, self.pending = self.pending, b""
        return pending

    def body(self) -> bytes | None:
        return b"".join(self.collected) if self.collected else None

    def _take_stripped(self, chunk: bytes) -> bytes:
        """Every complete event except the usage-only one; the rest stays pending.

        Only an event whose bytes hold ``"choices"`` followed by an empty list can be the
        usage-only event; a regex finds those without decoding JSON, and only they are
        decoded before the send. Every other event is decoded after it was handed on.
        """
        parser, timer = self.parser, self.timer
        assert parser is not None and timer is not None
        if not self.pending:  # the common cases: one whole event, nothing held back
            self._chunk = chunk
            template = self.template
            if template is not None and template.match(chunk) and parser.skip(len(chunk)):
                self.pending_start += len(chunk)
                self._one = ONE_OUTPUT  # a token event: never the usage event
                return chunk
            data = parser.single(chunk)
            if data is not None:
                self.pending_start += len(chunk)
                if not _EMPTY_CHOICES(data):
                    self._one = data  # decoded after the send
                    return chunk
                first = self._one = inspect_event(data, text_route=timer.text_route)
                if not first.usage_only:
                    return chunk
                self.removed_end = self.pending_start
                return b""
        self._one = None
        pending_start, removed_end = self.pending_start, self.removed_end
        events = self._events = parser.feed(chunk)
        data = self.pending + chunk if self.pending else chunk
        boundary = max(parser.boundary - pending_start, 0)  # bytes of data that are complete
        infos: list[EventInfo | None] = []
        cut: list[tuple[int, int]] = []
        if parser.straddling_lf >= 0 and parser.straddling_lf == removed_end:
            # the LF of the removed event's final CRLF came in this read: remove it too
            cut.append((removed_end - pending_start, removed_end - pending_start + 1))
        for event in events:
            info: EventInfo | None = None
            if not event.oversize and _EMPTY_CHOICES(event.data):
                info = inspect_event(event.data, text_route=timer.text_route)
                if info.usage_only:
                    cut.append((event.start - pending_start, event.end - pending_start))
                    removed_end = event.end
            infos.append(info)
        self._infos = infos
        self.removed_end = removed_end
        if not cut:
            out = data if boundary == len(data) else data[:boundary]
        else:
            parts, pos = [], 0
            for start, end in cut:
                parts.append(data[pos:start])
                pos = end
            parts.append(data[pos:boundary])
            out = b"".join(parts)
        rest = data[boundary:]
        if len(rest) > parser.max_event_bytes:
            # Already longer than the parser's limit: oversize, so never the event removed.
            # Forward it as it comes rather than hold all of it (bounded memory, issue 6).
            self.pending_start += len(data)
            self.pending = b""
            return out + rest
        self.pending_start += boundary
        self.pending = rest
        return out


async def relay(
    response: UpstreamResponse,
    send: Send,
    clock: Clock,
    *,
    timer: StreamTimer | None = None,
    parser: SSEParser | None = None,
    strip_usage: bool = False,
    collect_limit: int = 0,
) -> RelayResult:
    """Forward ``response``'s body to ``send``; return how it ended.

    ``timer`` and ``parser`` given: an event stream to observe. ``collect_limit`` > 0:
    keep up to that many bytes of a non-stream body so usage can be read at the end.
    Client disconnects arrive as cancellation and propagate to the caller.

    Two ways to the same bytes: when the upstream client is :mod:`proxy.wire` and the
    server is uvicorn's httptools protocol sending a chunked body, the body is piped
    (each upstream read written to the client's socket from the upstream socket's
    callback, see :func:`direct_writer`); otherwise it is iterated and handed to ASGI
    ``send`` chunk by chunk.
    """
    fwd = _Forwarder(timer, parser, strip_usage, collect_limit)
    stream = response.stream
    if isinstance(stream, WireBody) and collect_limit == 0:
        writer = direct_writer(send)
        if writer is not None:
            return await _pipe(stream, writer, fwd, clock)
    try:
        async for chunk in stream:
            if not chunk:
                continue
            out = fwd.take(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            fwd.observe(clock())
        pending = fwd.tail()
        if pending:
            await send({"type": "http.response.body", "body": pending, "more_body": True})
        return RelayResult(Outcome.COMPLETED, True, clock(), fwd.body())
    except httpx.TimeoutException:
        outcome = Outcome.TIMEOUT
    except httpx.TransportError:
        outcome = Outcome.UPSTREAM_INTERRUPTED
    pending = fwd.tail()
    if pending:  # what arrived before the failure still reaches the client
        await send({"type": "http.response.body", "body": pending, "more_body": True})
    return RelayResult(outcome, False, clock())


async def _pipe(body: WireBody, writer: DirectWriter, fwd: _Forwarder, clock: Clock) -> RelayResult:
    write, take, observe, flow = writer.write, fwd.take, fwd.observe, writer.flow

    def sink(chunk: bytes) -> int:
        out = take(chunk)
        if out and not write(out):
            return STOP
        observe(clock())
        return PAUSE if flow.write_paused else GO

    try:
        await body.pipe(sink, writer.drain)
        outcome, complete = Outcome.COMPLETED, True
    except SinkStopped:
        return RelayResult(Outcome.CLIENT_DISCONNECTED, False, clock())
    except httpx.TimeoutException:
        outcome, complete = Outcome.TIMEOUT, False
    except httpx.TransportError:
        outcome, complete = Outcome.UPSTREAM_INTERRUPTED, False
    pending = fwd.tail()
    if pending:  # what arrived before the end or the failure still reaches the client
        write(pending)
    return RelayResult(outcome, complete, clock())


class DirectWriter:
    """Writes body chunks straight to uvicorn's transport, as uvicorn's own ``send`` would.

    uvicorn's ``RequestResponseCycle.send`` (httptools protocol), for a body chunk of a
    chunked response: wait while the transport is paused, return if the client
    disconnected, else write ``<hex size>\r\n<chunk>\r\n``. This does the same, minus
    the message dict, the state checks and the coroutine per chunk (about 25 us per SSE
    event on the benchmark machine); the waiting moves to :meth:`drain`, which the pipe
    awaits only when the transport asked to pause. The response start and the final
    empty chunk still go through ``send``, so uvicorn's state (keep-alive, access log,
    response completion) is exactly what it would be.
    """

    __slots__ = ("cycle", "flow", "transport_write")

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle  # uvicorn's RequestResponseCycle: .disconnected
        self.transport_write: Callable[[bytes], None] = cycle.transport.write
        self.flow: Any = cycle.flow  # uvicorn's FlowControl: write_paused, drain()

    def write(self, chunk: bytes) -> bool:
        """False: the client is gone (nothing written)."""
        if self.cycle.disconnected:
            return False
        self.transport_write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True

    async def drain(self) -> None:
        await self.flow.drain()


_UVICORN_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"


def direct_writer(send: Send) -> DirectWriter | None:
    """A :class:`DirectWriter` when ``send`` is uvicorn's httptools cycle mid-way through a
    chunked response; None for any other server or state (then ``send`` is used).

    Checked per response against the cycle's documented-by-source attributes; the test
    suite asserts this engages under the pinned uvicorn, so an upgrade that changes them
    fails CI instead of silently taking the slower path.
    """
    cycle = getattr(send, "__self__", None)
    if cycle is None or type(cycle).__module__ != _UVICORN_HTTPTOOLS:
        return None
    try:
        ready = (cycle.response_started and cycle.chunked_encoding is True
                 and not cycle.response_complete and not cycle.disconnected
                 and cycle.scope["method"] != "HEAD" and cycle.flow is not None
                 and cycle.transport is not None)
    except (AttributeError, KeyError):
        return None
    return DirectWriter(cycle) if ready else None
