"""The one change the proxy makes to a stream: removing the usage event it asked for.

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import re

from proxy.dialects import EventInfo
from proxy.measure import Meter
from proxy.sse import SSEEvent

# Only chat and completions streams are ever stripped (the only dialects that inject the
# usage request), and their usage event has ``"choices"`` as a key (an unescaped quote
# on both sides) with an empty list as value: a regex finds candidates without decoding.
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]').search


class UsageStripper:
    __slots__ = ("_answer", "_chunk", "_events", "_infos", "_one", "meter", "pending",
                 "pending_start", "removed_end")

    _TEMPLATE_MATCH = EventInfo(1, True)  # a marker: the last chunk matched the token template

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.pending = b""  # bytes not yet forwarded
        self.pending_start = 0  # stream offset of pending[0]
        self.removed_end = -1  # stream offset where the removed event ended
        self._chunk = b""
        # a chunk that was one event: its (name, data) (decoded after the send), or what it
        # said if that was known before; None: a list of events (``_events``)
        self._one: tuple[bytes, bytes] | EventInfo | None = None
        self._events: list[SSEEvent] = []
        self._infos: list[EventInfo | None] = []
        self._answer = True

    def take(self, chunk: bytes) -> bytes:
        """Every complete event except the usage-only one; the rest stays pending.

        Only an event whose bytes hold ``"choices"`` followed by an empty list can be the
        usage-only event; a regex finds those without decoding JSON, and only they are
        decoded before the send. Every other event is decoded after it was handed on.
        """
        meter = self.meter
        parser, timer = meter.parser, meter.timer
        if not self.pending:  # the common cases: one whole event, nothing held back
            self._chunk = chunk
            known = meter.template.match(chunk)
            if known is not None and parser.skip(len(chunk)):
                self.pending_start += len(chunk)
                self._one = self._TEMPLATE_MATCH  # a token event: never the usage event
                self._answer = known.answer
                return chunk
            one = parser.single(chunk)
            if one is not None:
                self.pending_start += len(chunk)
                if not _EMPTY_CHOICES(one[1]):
                    self._one = one  # decoded after the send
                    return chunk
                first = self._one = timer.dialect.classify(*one)
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
                info = timer.dialect.classify(event.event, event.data)
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
            # Forward it as it comes rather than hold all of it (bounded memory).
            self.pending_start += len(data)
            self.pending = b""
            return out + rest
        self.pending_start += boundary
        self.pending = rest
        return out

    def observe(self, t: float) -> None:
        """The events of the last :meth:`take`, handed on at ``t``."""
        meter = self.meter
        timer = meter.timer
        one = self._one
        if one is self._TEMPLATE_MATCH:  # the common event: one output, nothing else
            timer.token(t, self._answer)
            return
        if isinstance(one, EventInfo):  # classified before the send
            timer.observe(one, t)
            return
        if one is not None:  # the chunk was one event, classified now
            meter.single(self._chunk, one[0], one[1], t)
            return
        for event, info in zip(self._events, self._infos, strict=True):
            if info is not None:
                timer.observe(info, t)
            elif not event.oversize:
                timer.event(event.event, event.data, t)

    def tail(self) -> bytes:
        """What is still held back when the body ends, however it ended."""
        pending, self.pending = self.pending, b""
        return pending
