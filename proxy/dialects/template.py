"""The token template: one stream's token events, matched by the shape learned from the
first (:class:`TokenTemplate`), so that most events cost two byte compares. It can only
make measurement cheaper, never different: an event that does not match takes the
dialect's full reading.
"""

from __future__ import annotations

import re

from proxy.dialects.base import ANSWER, REASONING, EventInfo

# The bytes of a JSON string's body with no quote, no line break, not ending in a backslash.
_PLAIN_TEXT = re.compile(rb'[^"\r\n]*[^"\r\n\\]').fullmatch


class TokenTemplate:
    """The shape of one stream's token events, learned once, matched with two compares.

    Design: ``docs/design/dialects.md``, "The token template".
    """

    __slots__ = ("_head", "_info", "_misses", "_tail", "_width", "keys")

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys
        self._head = b""  # empty: nothing learned
        self._tail = b""
        self._width = 0
        self._misses = 0
        self._info = ANSWER

    def match(self, chunk: bytes) -> EventInfo | None:
        """The learned reading if ``chunk`` is another event of the learned shape."""
        head = self._head
        if not head:
            return None
        if (
            len(chunk) > self._width
            and chunk.startswith(head)
            and chunk.endswith(self._tail)
            and _PLAIN_TEXT(chunk, len(head), len(chunk) - len(self._tail))
        ):
            self._misses = 0
            return self._info
        self._misses += 1
        if self._misses >= 8:
            self._head = b""
        return None

    def learn(self, chunk: bytes, info: EventInfo) -> None:
        """``chunk`` is one whole event (``data:`` line, optionally after an ``event:``
        line) that the full path read as ``info``; learn from it if nothing is learned
        yet and it is a single output with no usage and no error."""
        if (
            self._head
            or info.outputs != 1
            or info.usage is not None
            or info.error
            or info.upstream_queue_s is not None
            or not chunk.endswith(b"\n\n")
        ):
            return
        if chunk.startswith(b"data:"):
            begin = 0
        elif chunk.startswith(b"event:"):
            begin = chunk.find(b"\n") + 1  # the data line must come next
            if not chunk.startswith(b"data:", begin):
                return
        else:
            return
        for key in self.keys:  # the first key with a non-empty value
            at = chunk.find(key, begin)
            if at < 0:
                continue
            start = at + len(key)
            end = chunk.find(b'"', start)
            if end > start:
                break
        else:
            return
        if chunk.find(key, start) >= 0 or b"\\" in chunk[start:end]:
            return
        self._head, self._tail = chunk[:start], chunk[end:]
        self._width = len(self._head) + len(self._tail)
        self._info = ANSWER if info.answer else REASONING
        self._misses = 0
