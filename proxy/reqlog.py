"""Per-request log: one JSON line per finished request (``--log-requests``).

Every measured field, the request id, route, model label, status and outcome. The
record it writes holds no headers, no key and no prompt text, so nothing secret can
reach the file.

The file is written by one thread of its own, never by the event loop: a write to a
slow disk (a full page cache, network storage, a pipe nobody reads fast enough) blocks
the writer, and on the loop it would have stalled every stream the proxy relays. The
loop only formats the line (a few microseconds) and hands it over.

Between them is a bounded buffer of ``--log-requests-buffer`` lines (10,000 by default,
a few MB: a line is a few hundred bytes). A disk that is slower than the requests for
a moment is absorbed by it. A disk that stays slower than the requests for long fills
it, and then new lines are **dropped, not waited for**: the proxy keeps serving at full
speed and says what it lost, in ``llm_proxy_request_log_dropped_lines_total`` and in a
warning (the first drop, then at most one every ``DROP_WARNING_S`` seconds, with the
total). Blocking instead would hand the disk's latency to every stream; growing
without bound would trade it for the process's memory. The metrics are the record of
every request either way.

Lines are written whole: a batch goes to a file opened with ``O_APPEND`` in one
``write`` (the lines of several ``--workers`` processes never interleave mid-line), and
to standard output (``-``) one line per write, flushed. At shutdown :meth:`close`
writes every buffered line before the file is closed, the process exits after that
(on SIGTERM too, through the lifespan shutdown); a disk that takes nothing for
``CLOSE_TIMEOUT_S`` seconds ends the wait with a warning naming the lines not written.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

from proxy.measure import RequestRecord

log = logging.getLogger("proxy")

DEFAULT_BUFFER = 10_000
MAX_BATCH = 512  # lines per write to a file
DROP_WARNING_S = 10.0
CLOSE_TIMEOUT_S = 30.0

_STOP = None  # after the last line: the writer ends


class RequestLog:
    """The per-request log of one process: :meth:`write` on the event loop (never
    blocks), a writer thread, :meth:`close` at shutdown."""

    def __init__(self, target: str, *, buffer: int = DEFAULT_BUFFER,
                 dropped: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._own = target not in ("-", "stdout")
        # Opened here, before the server listens: a path that cannot be written fails
        # start-up rather than the first request.
        self._fd = (os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
                    if self._own else -1)
        self._queue: queue.Queue[str | None] = queue.Queue(buffer)
        self._on_drop = dropped
        self._clock = clock
        self._lock = threading.Lock()  # the drop count and warning: loop and writer
        self.dropped = 0
        self._dropped_said = 0
        self._said_at = -DROP_WARNING_S
        self._closed = False
        self._writer = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._writer.start()

    def write(self, record: RequestRecord) -> None:
        """Hand one request's line to the writer; drop it (and count it) if the buffer
        is full or the log already closed."""
        line = record.as_log()
        line["time"] = time.time()  # wall-clock timestamp of the line, not a duration
        text = json.dumps(line, separators=(",", ":")) + "\n"
        if self._closed:
            self._drop(1, "the log was already closed")
            return
        try:
            self._queue.put_nowait(text)
        except queue.Full:
            self._drop(1, "the disk is slower than the requests")

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write every buffered line, then close the file (not standard output). Blocks
        until done or ``timeout`` seconds: call it off the event loop."""
        if self._closed:
            return
        self._closed = True
        deadline = self._clock() + timeout
        try:
            self._queue.put(_STOP, timeout=timeout)
            self._writer.join(max(0.0, deadline - self._clock()))
        except queue.Full:
            pass
        if self._writer.is_alive():
            left = self._queue.qsize()
            log.warning("request log: gave up after %g s at shutdown: at least %d lines "
                        "not written (the file took nothing)", timeout, left)
            return  # the writer may still hold the file: not closed under its feet
        if self._own:
            os.close(self._fd)
        else:
            sys.stdout.flush()

    # -- the writer thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch: list[str] = []
            item = self._queue.get()
            while item is not _STOP:
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
                    self._drop(len(batch), f"writing failed: {type(exc).__name__}: {exc}")
            if item is _STOP:
                return

    def _emit(self, lines: list[str]) -> None:
        if not self._own:
            out = sys.stdout
            for line in lines:
                out.write(line)
                out.flush()
            return
        data = memoryview("".join(lines).encode())
        while data:  # one write unless the kernel takes less
            written = os.write(self._fd, data)
            data = data[written:]

    def _drop(self, count: int, why: str) -> None:
        if self._on_drop is not None:
            self._on_drop(count)
        with self._lock:
            self.dropped += count
            now = self._clock()
            if self._dropped_said and now - self._said_at < DROP_WARNING_S:
                return
            self._said_at, self._dropped_said = now, self.dropped
            total = self.dropped
        log.warning("request log: %d lines dropped so far (%s); see "
                    "llm_proxy_request_log_dropped_lines_total and --log-requests-buffer",
                    total, why)
