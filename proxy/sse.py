"""Incremental server-sent-events parser: bytes in, events out. No I/O, no clock.

Design: ``docs/design/relay-and-export.md``.
"""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_MAX_EVENT_BYTES = 1 << 20
BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark: one leading is not part of the stream


class SSEEvent(NamedTuple):
    """One dispatched event: its data, its span ``[start, end)`` in the stream, and its
    ``event:`` name (``b""`` when it has none, and always for an oversize event).

    A NamedTuple rather than a frozen dataclass: one is made per event on the hot path,
    and a tuple is several times cheaper to build. ``event`` comes last, with a default,
    so code that builds or unpacks the first four fields keeps working.
    """

    data: bytes
    start: int
    end: int
    oversize: bool = False
    event: bytes = b""


class SSEParser:
    """Feed chunks as they arrive; get back the events each chunk completes."""

    __slots__ = (
        "_bom",
        "_data",
        "_data_size",
        "_event",
        "_event_start",
        "_has_data",
        "_line",
        "_max",
        "_offset",
        "_oversize",
        "_pending_cr",
        "straddling_lf",
    )

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._offset = 0  # stream offset of the next byte to be fed
        self._line = bytearray()  # an unterminated line carried over
        self._pending_cr = False  # the previous chunk ended in CR
        self._data: list[bytes] = []
        self._data_size = 0
        self._has_data = False
        self._event = b""  # the current event's name so far
        self._event_start = -1  # offset of the first line of the current event
        self._oversize = False
        self._bom = True  # the stream's first bytes may still be a BOM's
        # Offset of an LF that began the last chunk fed and completed a CRLF whose CR
        # ended the chunk before (so it lies outside the span of an event that CR ended);
        # -1 when the last chunk did not start that way.
        self.straddling_lf = -1

    @property
    def max_event_bytes(self) -> int:
        """Events longer than this (in stream bytes) are reported ``oversize``."""
        return self._max

    @property
    def boundary(self) -> int:
        """Stream offset up to which every byte belongs to a finished line or event."""
        return self._event_start if self._event_start >= 0 else self._offset

    def single(self, chunk: bytes) -> tuple[bytes, bytes] | None:
        """``(event, data)`` if ``chunk`` is exactly one event of one ``data:`` line,
        optionally after one ``event:`` line, LF line endings only; else None. ``event``
        is ``b""`` when there is no ``event:`` line.

        That is the common shape (servers write one event per chunk; the Responses and
        Messages APIs put the name first), and this is the cheap way to take it: no
        event objects, no list. On None nothing was consumed and ``feed`` must be called
        with the same chunk.
        """
        n = len(chunk)
        if chunk[:5] == b"data:":
            if (
                chunk.find(b"\n") != n - 2
                or chunk[-1:] != b"\n"
                or b"\r" in chunk
                or n - 1 > self._max
                or not self.skip(n)
            ):
                return None
            return b"", chunk[6:-2] if chunk[5:6] == b" " else chunk[5:-2]
        if chunk[:6] != b"event:":
            return None
        eol = chunk.find(b"\n")
        if (
            chunk[eol + 1 : eol + 6] != b"data:"
            or chunk.find(b"\n", eol + 1) != n - 2
            or chunk[-1:] != b"\n"
            or b"\r" in chunk
            or n - 1 > self._max
            or not self.skip(n)
        ):
            return None
        name = chunk[7:eol] if chunk[6:7] == b" " else chunk[6:eol]
        at = eol + 6
        return name, chunk[at + 1 : -2] if chunk[at : at + 1] == b" " else chunk[at:-2]

    def skip(self, size: int) -> bool:
        """Consume ``size`` bytes the caller knows to be one whole event (it checked them
        itself: :meth:`single`, ``proxy.relay.TokenTemplate``); False, consuming nothing,
        unless the parser is between events."""
        if self._event_start >= 0 or self._line or self._pending_cr:
            return False
        self.straddling_lf = -1
        self._offset += size
        return True

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if not chunk:
            return []
        self.straddling_lf = -1
        base = self._offset
        self._offset += len(chunk)
        if self._bom:  # the stream's first bytes: a BOM's, or past any (one check)
            if base >= len(BOM):
                self._bom = False
            else:
                chunk, base = self._after_bom(chunk, base)
                if not chunk:
                    return []
        if (
            not self._line
            and not self._pending_cr
            and self._event_start < 0
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
        ):
            fast = self._fast(chunk, base)
            if fast is not None:
                return fast
        return self._slow(chunk, base)

    def _after_bom(self, chunk: bytes, base: int) -> tuple[bytes, int]:
        """``chunk`` (at ``base``) less the part of one leading BOM it holds: the SSE
        standard ignores one, so the event after it is read (its bytes are relayed as
        they came). A stream that opens with part of a BOM and then differs gets those
        bytes back in front of its first line."""
        want = BOM[base:]  # base: the stream's bytes before, all a BOM's so far
        k = min(len(want), len(chunk))
        if chunk[:k] != want[:k]:
            self._bom = False
            return BOM[:base] + chunk, 0
        if k == len(want):
            self._bom = False
        return chunk[k:], base + k

    def _fast(self, chunk: bytes, base: int) -> list[SSEEvent] | None:
        """LF-only chunk made of whole events, each a single ``data:`` line, optionally
        after a single ``event:`` line; None (nothing consumed) for anything else."""
        events: list[SSEEvent] = []
        pos = 0
        for block in chunk[:-2].split(b"\n\n"):
            end = pos + len(block) + 2
            if block.startswith(b"data:") and b"\n" not in block:
                name = b""
                value = block[5:]
            elif block.startswith(b"event:"):
                eol = block.find(b"\n")
                if block[eol + 1 : eol + 6] != b"data:" or block.find(b"\n", eol + 1) >= 0:
                    return None
                name = block[7:eol] if block[6:7] == b" " else block[6:eol]
                value = block[eol + 6 :]
            elif block.startswith(b":") and b"\n" not in block:
                pos = end
                continue  # a comment on its own: no event
            else:
                return None  # anything unusual: let the general parser do it all
            if value[:1] == b" ":
                value = value[1:]
            if len(block) + 1 > self._max:  # event size: up to its blank line
                events.append(SSEEvent(b"", base + pos, base + end, True))
            else:
                events.append(SSEEvent(value, base + pos, base + end, False, name))
            pos = end
        return events

    def _slow(self, chunk: bytes, base: int) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        pos = 0
        n = len(chunk)
        if self._pending_cr:
            self._pending_cr = False
            if chunk[0:1] == b"\n":
                pos = 1  # second half of a CRLF that straddled two chunks
                self.straddling_lf = base
        while pos < n:
            lf = chunk.find(b"\n", pos)
            cr = chunk.find(b"\r", pos)
            if lf < 0 and cr < 0:
                self._carry(chunk[pos:], base + pos)
                break
            if cr < 0 or (0 <= lf < cr):
                eol, nxt = lf, lf + 1
            else:
                eol = cr
                if cr + 1 < n:
                    nxt = cr + 2 if chunk[cr + 1 : cr + 2] == b"\n" else cr + 1
                else:
                    nxt = cr + 1
                    self._pending_cr = True
            line_start = base + pos - len(self._line)
            if self._line:
                self._line += chunk[pos:eol]
                line = bytes(self._line)
                self._line.clear()
            else:
                line = chunk[pos:eol]
            event = self._line_done(line, line_start, base + nxt)
            if event is not None:
                events.append(event)
            pos = nxt
        return events

    def _carry(self, part: bytes, offset: int) -> None:
        """Keep an unterminated line for the next chunk, within the event limit."""
        if self._event_start < 0 and not self._line:
            self._event_start = offset
        if self._oversize or offset + len(part) - self._event_start > self._max:
            # Too long to parse: keep only enough to tell the field name.
            self._oversize = True
            self._data.clear()
            self._data_size = 0
            self._event = b""
            room = 16 - len(self._line)
            if room > 0:
                self._line += part[:room]
            return
        self._line += part

    def _line_done(self, line: bytes, line_start: int, end: int) -> SSEEvent | None:
        if not line:
            if self._event_start < 0:
                return None  # blank line between events
            event = None
            if self._has_data:
                if self._oversize or line_start - self._event_start > self._max:
                    event = SSEEvent(b"", self._event_start, end, True)
                else:
                    data = b"\n".join(self._data)
                    event = SSEEvent(data, self._event_start, end, False, self._event)
            self._reset()
            return event
        if self._event_start < 0:
            self._event_start = line_start
        if line[:1] == b":":
            return None
        name, sep, value = line.partition(b":")
        if name == b"data":
            self._has_data = True
        elif name != b"event":
            return None  # id, retry and unknown fields do not matter here
        if self._oversize:
            return None
        if end - self._event_start > self._max:  # already too long, whatever follows
            self._oversize = True
            self._data.clear()
            self._data_size = 0
            self._event = b""
            return None
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"event":
            self._event = value  # the last event line wins
            return None
        self._data_size += len(value) + 1
        self._data.append(value)
        return None

    def _reset(self) -> None:
        self._data = []
        self._data_size = 0
        self._has_data = False
        self._event = b""
        self._event_start = -1
        self._oversize = False
