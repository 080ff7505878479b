"""Lines written to a file by one thread of their own, never by the event loop.

What the request log (:mod:`proxy.reqlog`) and the workload capture (:mod:`proxy.workload_capture`)
share: the loop hands each item over (:meth:`LineWriter.offer`, which never blocks) and
a daemon thread turns them into lines and writes them in batches (``emit``, up to
:data:`MAX_BATCH` items a call). A write to a slow disk blocks that thread only; on the
loop it would stall every stream the proxy relays.

**Batches, not a wake-up per line.** An item goes onto a deque (an append, no lock); only
the first item after a batch was taken signals the thread, which then waits
:data:`BATCH_S` (0.1 s) for more before it takes them all (sooner when the buffer is
half full, or at close). A thread woken for every line asks for the interpreter lock
once per request, in the middle of the loop's relaying of other streams. With batches
it wakes at most ten times a second however busy the proxy is, and not at all when it
is idle; a line reaches the file within about 0.1 s of its request's end. An owner whose
lines nobody tails may gather longer (``gather_s``: the workload capture's), which
costs less still: the thread's code runs warm for more lines in a row. Measured at
64 streams (``benchmarks/RESULTS.md``, "2026-12-02 (later)"): the capture writer's wait
for a CPU fell from 24 to 10 ms per second; CPU per event did not move measurably.

A full buffer means the disk has been slower than the requests for a while: the line is
**dropped, not waited for**, counted (``dropped``, the owner's metric) and said in a
warning (the first drop, then at most one every :data:`DROP_WARNING_S` seconds, with
the total). A batch ``emit`` fails on (a full disk, a closed pipe) is dropped the same
way, with the error as the reason, and the thread goes on with the next.
:meth:`LineWriter.close` writes every line still buffered, then runs ``finish`` (closing
the file) in the thread, after its last write; a disk that takes nothing for the whole
timeout ends the wait with a warning naming the lines not written, and the file is
left to the thread, never closed under its feet.

What a line is, how a batch is written and where, is the owner's: ``emit`` turns items
into lines as it likes.
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
