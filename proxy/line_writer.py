"""Lines written to a file by one thread of their own, never by the event loop.

Design: ``docs/design/relay-and-export.md``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("proxy")

MAX_BATCH = 512  # lines per emit
BATCH_S = 0.1  # how long the thread, once signalled, collects items before it takes them
DROP_WARNING_S = 10.0
CLOSE_TIMEOUT_S = 30.0

T = TypeVar("T")


class LineWriter(Generic[T]):
    """A bounded buffer of ``buffer`` items and the thread that empties it into ``emit``.

    ``label`` starts every warning (``"request log"``) and, hyphenated, names the thread;
    ``see`` ends the drop warning (where the count is kept); ``closed`` is the reason
    given for an item offered after :meth:`close`; ``dropped`` is called with every
    count of dropped lines; ``finish`` runs in the thread after its last batch (an
    ``OSError`` from it is said as a drop of none); ``clock``: monotonic seconds, for
    the warnings' spacing and the close's deadline; ``gather_s``: how long a batch
    gathers (:data:`BATCH_S` by default)."""

    def __init__(self, emit: Callable[[list[T]], None], *, label: str, see: str,
                 closed: str, buffer: int, dropped: Callable[[int], None] | None = None,
                 finish: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 gather_s: float | None = None) -> None:
        self._emit = emit
        self._gather_s = gather_s
        self._finish = finish
        self._on_drop = dropped
        self._clock = clock
        self._closed_why = closed
        self._drop_message = f"{label}: %d lines dropped so far (%s); see {see}"
        self._gave_up_message = (f"{label}: gave up after %g s at shutdown: at least %d "
                                 "lines not written (the file took nothing)")
        self._buffer = buffer
        self._items: deque[T] = deque()  # appended by the loop, taken by the thread
        self._signalled = False  # the thread was told since it last took the items
        self._in_hand = 0  # items the thread took and is writing
        self._wake = threading.Event()  # items are waiting
        self._hurry = threading.Event()  # take the items now (half full, or closing)
        self._lock = threading.Lock()  # the drop count and warning: loop and thread
        self.dropped = 0
        self._dropped_said = 0
        self._said_at = -DROP_WARNING_S
        self.closed = False
        self._thread = threading.Thread(target=self._run, name=label.replace(" ", "-"),
                                        daemon=True)
        self._thread.start()

    def offer(self, item: T) -> bool:
        """Hand ``item`` to the thread; False when it was dropped (and counted) because
        the buffer is full or the writer closed."""
        if self.closed:
            self.drop(1, self._closed_why)
            return False
        items = self._items
        waiting = len(items)
        if waiting >= self._buffer:
            self.drop(1, "the disk is slower than the requests")
            return False
        items.append(item)
        if not self._signalled:
            self._signalled = True
            self._wake.set()
        elif waiting + 1 == self._buffer // 2:
            self._hurry.set()  # half full: take them now rather than at the batch's end
        return True

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write every buffered item, then let the thread run ``finish``. Blocks until
        done or ``timeout`` seconds: call it off the event loop."""
        if self.closed:
            return
        self.closed = True  # the thread takes what is left, then finishes
        self._hurry.set()
        self._wake.set()
        self._thread.join(max(0.0, timeout))
        if self._thread.is_alive():
            log.warning(self._gave_up_message, timeout, len(self._items) + self._in_hand)

    def drop(self, count: int, why: str) -> None:
        """Count ``count`` lines not written, and say why (at most every
        :data:`DROP_WARNING_S` seconds after the first)."""
        if self._on_drop is not None and count:
            self._on_drop(count)
        with self._lock:
            self.dropped += count
            now = self._clock()
            if self._dropped_said and now - self._said_at < DROP_WARNING_S:
                return
            self._said_at, self._dropped_said = now, self.dropped
            total = self.dropped
        log.warning(self._drop_message, total, why)

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait()
                # let a batch gather (cut short: half full, closing)
                self._hurry.wait(BATCH_S if self._gather_s is None else self._gather_s)
                self._wake.clear()
                self._hurry.clear()
                self._signalled = False  # an item appended from here on signals again
                self._take()
                if self.closed:  # offers are refused from now on
                    self._take()  # what came in while taking
                    return
        finally:
            if self._finish is not None:
                try:
                    self._finish()
                except OSError as exc:
                    self.drop(0, f"closing failed: {exc}")

    def _take(self) -> None:
        """Emit every waiting item, in batches of at most :data:`MAX_BATCH`."""
        items = self._items
        while items:
            batch = [items.popleft() for _ in range(min(len(items), MAX_BATCH))]
            self._in_hand = len(batch)
            try:
                self._emit(batch)
            except Exception as exc:  # a full disk, a closed pipe: say so, go on
                self.drop(len(batch), f"writing failed: {type(exc).__name__}: {exc}")
            self._in_hand = 0
