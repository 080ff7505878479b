"""Per-request log: one JSON line per finished request (``--log-requests``).

Every measured field, the request id, route, model label, status and outcome. The
record it writes holds no headers, no key and no prompt text, so nothing secret can
reach the file.

The file is written by one thread of its own, never by the event loop: a write to a
slow disk (a full page cache, network storage, a pipe nobody reads fast enough) blocks
the writer, and on the loop it would have stalled every stream the proxy relays. The
loop only hands the record over (the thread formats it, in batches about 0.1 s apart).
The buffer, the thread, the drops and the close are
:class:`proxy.line_writer.LineWriter`'s (the workload capture's writer too); what a line
holds and where it goes are this module's.

Between them is a bounded buffer of ``--log-requests-buffer`` lines (10,000 by default,
a few MB: a line is a few hundred bytes). A disk that is slower than the requests for
a moment is absorbed by it. A disk that stays slower than the requests for long fills
it, and then new lines are **dropped, not waited for**: the proxy keeps serving at full
speed and says what it lost, in ``llm_proxy_request_log_dropped_lines_total`` and in a
warning (the first drop, then at most one every ten seconds, with the total). Blocking
instead would hand the disk's latency to every stream; growing without bound would
trade it for the process's memory. The metrics are the record of every request either
way.

Lines are written whole: a batch goes to a file opened with ``O_APPEND`` in one
``write`` (the lines of several ``--workers`` processes never interleave mid-line), and
to standard output (``-``) one line per write, flushed. At shutdown :meth:`close`
writes every buffered line before the file is closed, the process exits after that
(on SIGTERM too, through the lifespan shutdown); a disk that takes nothing for 30
seconds (``CLOSE_TIMEOUT_S``) ends the wait with a warning naming the lines not
written, and leaves the file open to the writer.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

from proxy.line_writer import CLOSE_TIMEOUT_S, LineWriter
from proxy.measure import RequestRecord

DEFAULT_BUFFER = 10_000


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
        self._lines = LineWriter[tuple[RequestRecord, float]](
            self._emit, label="request log", buffer=buffer, dropped=dropped, clock=clock,
            closed="the log was already closed", finish=self._finish,
            see="llm_proxy_request_log_dropped_lines_total and --log-requests-buffer")

    @property
    def dropped(self) -> int:
        """Lines dropped so far."""
        return self._lines.dropped

    def write(self, record: RequestRecord) -> None:
        """Hand one request's line to the writer; drop it (and count it) if the buffer
        is full or the log already closed."""
        self._lines.offer((record, time.time()))  # formatted in the writer thread

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write every buffered line, then close the file (not standard output). Blocks
        until done or ``timeout`` seconds: call it off the event loop."""
        self._lines.close(timeout)

    # -- the writer thread --------------------------------------------------------------

    def _emit(self, items: list[tuple[RequestRecord, float]]) -> None:
        lines: list[str] = []
        for record, wall in items:
            fields = record.as_log()
            fields["time"] = wall  # wall-clock timestamp of the request's end, not a duration
            lines.append(json.dumps(fields, separators=(",", ":")) + "\n")
        if not self._own:
            out = sys.stdout
            for text in lines:
                out.write(text)
                out.flush()
            return
        data = memoryview("".join(lines).encode())
        while data:  # one write unless the kernel takes less
            written = os.write(self._fd, data)
            data = data[written:]

    def _finish(self) -> None:
        if self._own:
            os.close(self._fd)
        else:
            sys.stdout.flush()
