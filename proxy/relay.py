"""The relay: upstream bytes out to the client as they arrive, events observed on the side.

Per read from the upstream the hot path does three things: hand the bytes on
(``send``), read the clock once, feed the parser and timer. The bytes handed on are
the very ``bytes`` object the upstream read produced: nothing is copied, re-encoded or
buffered. Observation happens *after* the send, so measurement adds no latency to the
chunk it measures, and the time read is the moment the event was handed on.

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
from typing import Any

import httpx

from proxy.measure import EventInfo, Outcome, StreamTimer, inspect_event
from proxy.sse import SSEParser

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


async def relay(
    response: httpx.Response,
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
    """
    collected: list[bytes] | None = [] if collect_limit > 0 else None
    collected_size = 0
    pending = b""  # strip mode only: bytes not yet forwarded
    pending_start = 0  # stream offset of pending[0]
    removed_end = -1  # strip mode: stream offset where the removed event ended
    try:
        async for chunk in response.stream:  # type: ignore[union-attr]
            if not chunk:
                continue
            if parser is not None and timer is not None:
                if strip_usage:
                    pending_start, pending, removed_end = await _send_stripped(
                        chunk, pending, pending_start, removed_end, parser, timer, send, clock)
                    continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                t = clock()
                try:
                    for event in parser.feed(chunk):
                        if not event.oversize:
                            timer.event(event.data, t)
                except Exception:  # pragma: no cover - parser and timer do not raise
                    log.exception("measurement failed; stream continues unmeasured")
                    parser = None
                continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if collected is not None:
                collected_size += len(chunk)
                if collected_size <= collect_limit:
                    collected.append(chunk)
                else:
                    collected = None
        if pending:
            await send({"type": "http.response.body", "body": pending, "more_body": True})
        return RelayResult(Outcome.COMPLETED, True, clock(),
                           b"".join(collected) if collected else None)
    except httpx.TimeoutException:
        outcome = Outcome.TIMEOUT
    except httpx.TransportError:
        outcome = Outcome.UPSTREAM_INTERRUPTED
    if pending:  # what arrived before the failure still reaches the client
        await send({"type": "http.response.body", "body": pending, "more_body": True})
    return RelayResult(outcome, False, clock())


async def _send_stripped(
    chunk: bytes,
    pending: bytes,
    pending_start: int,
    removed_end: int,
    parser: SSEParser,
    timer: StreamTimer,
    send: Send,
    clock: Clock,
) -> tuple[int, bytes, int]:
    """Forward every complete event except the usage-only one; keep the rest pending.

    Only an event whose bytes hold ``"choices"`` followed by an empty list can be the
    usage-only event; a regex finds those without decoding JSON, and only they are
    decoded before the send. Every other event is decoded after it was handed on.
    """
    events = parser.feed(chunk)
    data = pending + chunk if pending else chunk
    boundary = max(parser.boundary - pending_start, 0)  # bytes of data that are complete
    infos: list[EventInfo | None] = []
    cut: list[tuple[int, int]] = []
    if parser.straddling_lf >= 0 and parser.straddling_lf == removed_end:
        # the LF of the removed event's final CRLF came in this read: remove it too
        cut.append((removed_end - pending_start, removed_end - pending_start + 1))
    for event in events:
        info = None
        if not event.oversize and _EMPTY_CHOICES(event.data):
            info = inspect_event(event.data, text_route=timer.text_route)
            if info.usage_only:
                cut.append((event.start - pending_start, event.end - pending_start))
                removed_end = event.end
        infos.append(info)
    if not cut:
        out = data if boundary == len(data) else data[:boundary]
    else:
        parts, pos = [], 0
        for start, end in cut:
            parts.append(data[pos:start])
            pos = end
        parts.append(data[pos:boundary])
        out = b"".join(parts)
    if out:
        await send({"type": "http.response.body", "body": out, "more_body": True})
    t = clock()
    for event, info in zip(events, infos, strict=True):
        if info is not None:
            timer.observe(info, t)
        elif not event.oversize:
            timer.event(event.data, t)
    rest = data[boundary:]
    if len(rest) > parser.max_event_bytes:
        # Already longer than the parser's limit: oversize, so never the event removed.
        # Forward it as it comes rather than hold all of it (bounded memory, issue 6).
        await send({"type": "http.response.body", "body": rest, "more_body": True})
        return pending_start + len(data), b"", removed_end
    return pending_start + boundary, rest, removed_end
