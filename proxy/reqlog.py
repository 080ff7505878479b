"""Per-request log: one JSON line per finished request (``--log-requests``).

Design: ``docs/design/relay-and-export.md``.
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
