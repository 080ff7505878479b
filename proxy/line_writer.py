"""Lines written to a file by one thread of their own, never by the event loop.

What the request log (:mod:`proxy.reqlog`) and the trace capture (:mod:`proxy.capture`)
share: the loop hands each line over (:meth:`LineWriter.offer`, which never blocks), and
a daemon thread takes them from a bounded queue in batches of up to :data:`MAX_BATCH`
(all that is waiting, without waiting for more) and passes each batch to ``emit``. A
write to a slow disk blocks that thread only; on the loop it would stall every stream
the proxy relays.

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
into lines as it likes (the capture formats them in the thread).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("proxy")

MAX_BATCH = 512  # lines per emit
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
    the warnings' spacing and the close's deadline."""

    def __init__(self, emit: Callable[[list[T]], None], *, label: str, see: str,
                 closed: str, buffer: int, dropped: Callable[[int], None] | None = None,
                 finish: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._emit = emit
        self._finish = finish
        self._on_drop = dropped
        self._clock = clock
        self._closed_why = closed
        self._drop_message = f"{label}: %d lines dropped so far (%s); see {see}"
        self._gave_up_message = (f"{label}: gave up after %g s at shutdown: at least %d "
                                 "lines not written (the file took nothing)")
        self._queue: queue.Queue[T | None] = queue.Queue(buffer)  # None: the last item
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
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.drop(1, "the disk is slower than the requests")
            return False
        return True

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write every buffered item, then let the thread run ``finish``. Blocks until
        done or ``timeout`` seconds: call it off the event loop."""
        if self.closed:
            return
        self.closed = True
        deadline = self._clock() + timeout
        try:
            self._queue.put(None, timeout=timeout)
            self._thread.join(max(0.0, deadline - self._clock()))
        except queue.Full:
            pass
        if self._thread.is_alive():
            log.warning(self._gave_up_message, timeout, self._queue.qsize())

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
                batch: list[T] = []
                item = self._queue.get()
                while item is not None:
                    batch.append(item)
                    if len(batch) >= MAX_BATCH:
                        break
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if batch:
                    try:
                        self._emit(batch)
                    except Exception as exc:  # a full disk, a closed pipe: say so, go on
                        self.drop(len(batch), f"writing failed: {type(exc).__name__}: {exc}")
                if item is None:
                    return
        finally:
            if self._finish is not None:
                try:
                    self._finish()
                except OSError as exc:
                    self.drop(0, f"closing failed: {exc}")
