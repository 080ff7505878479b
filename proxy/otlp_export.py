"""What the OTLP exporters say when the collector is down, and how long they may hold
the process at shutdown. Shared by :mod:`proxy.tracing` and :mod:`proxy.otel_metrics`;
like them, it is only used when OpenTelemetry is on.

Design: ``docs/design/opentelemetry.md``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("proxy")

SHUTDOWN_WAIT_S = 2.0  # for the last export at shutdown
QUIET_S = 60.0  # at least this long between two "failing" lines

# The exporter's lines about a failed export, by the start of their format string
# (opentelemetry-exporter-otlp-proto-http 1.27 to 1.45).
_NOISE = ("Transient error", "Failed to export", "Shutdown in progress",
          "Exporter already shutdown", "OTLP client already shutdown")
_ERRNO = re.compile(r"\[Errno -?\d+\] [^'\"()\[\]]+")
_REASON_MAX = 120


class _Reason(threading.local):
    """Why the current thread's export failed, as the exporter logged it. Each exporter
    exports from its own thread, so a thread's last line belongs to its own export."""

    text = ""


_reason = _Reason()


class _ExporterNoise(logging.Filter):
    """Drops the exporter's retry and failure lines, keeping their reason for
    :class:`ExportWatch`; passes every other line (an encoding error, a dropped
    oversized batch)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(_NOISE):
            return True
        reason = _record_reason(record)
        if reason:
            _reason.text = reason
        return False


_FILTER = _ExporterNoise()


def quiet(logger_name: str) -> None:
    """Drop the retry and failure lines of the exporter that logs as ``logger_name``."""
    logger = logging.getLogger(logger_name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


def short_reason(text: str) -> str:
    """The part of an exporter's error text a person needs: the OS error
    (``[Errno 111] Connection refused``) when there is one, else the text, shortened."""
    errors = _ERRNO.findall(text)
    if errors:
        return str(errors[-1]).strip()
    text = " ".join(text.split())
    return text if len(text) <= _REASON_MAX else text[: _REASON_MAX - 3] + "..."


def _record_reason(record: logging.LogRecord) -> str:
    args = record.args if isinstance(record.args, tuple) else ()
    if record.msg.startswith("Transient error") and args:
        return short_reason(str(args[0]))  # the exception, or the status's reason phrase
    codes = [a for a in args if isinstance(a, int) and 100 <= a <= 599]
    if codes:
        return f"HTTP {codes[0]}"
    return ""  # "due to timeout, max retries or shutdown": the retries' reason stands


class ExportWatch:
    """The outcome of each export, said once per change: a "failing" line (at most one
    per :data:`QUIET_S`) and an "again" line after a failing one."""

    def __init__(self, what: str, endpoint: str, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what  # "spans", "OTLP metrics"
        self.endpoint = endpoint
        self.clock = clock
        self.down = False
        self.failed = 0  # exports failed since the last success
        self._said_at: float | None = None  # when the last "failing" line was written
        self._said = False  # whether this outage has had its line
        self._lock = threading.Lock()

    def call(self, export: Callable[[], Any], success: Any, failure: Any) -> Any:
        """``export()``'s result, noted; an exception is a failed export (the batch
        processor would log its traceback), returned as ``failure``."""
        _reason.text = ""
        try:
            result = export()
        except Exception as exc:  # any exporter failure: said once, never raised
            self.note(False, short_reason(f"{type(exc).__name__}: {exc}"))
            return failure
        self.note(result == success, _reason.text or "the export failed")
        return result

    def note(self, ok: bool, reason: str = "") -> None:
        with self._lock:
            if not ok:
                self.failed += 1
                if self.down:
                    return
                self.down = True
                now = self.clock()
                self._said = self._said_at is None or now - self._said_at >= QUIET_S
                if self._said:
                    self._said_at = now
                    log.warning("%s cannot be exported to %s (%s); the exporter keeps trying "
                                "and drops what it cannot send; one line when it works again",
                                self.what, self.endpoint, reason)
                return
            if self.down:
                self.down = False
                if self._said:
                    log.warning("%s reach %s again (%d export%s failed meanwhile)", self.what,
                                self.endpoint, self.failed, "" if self.failed == 1 else "s")
            self.failed = 0


class Exporting:
    """What :class:`proxy.tracing.Tracing` and :class:`proxy.otel_metrics.OtelMetrics`
    share: their SDK provider, where it exports (``description``, for the start-up line),
    and one shutdown whose last export is bounded."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.description = ""
        self.stop_exporter: Callable[[], Any] = lambda: None  # ends its retries at shutdown

    def shutdown(self) -> None:
        """Export what is still queued, then stop the exporter's thread. With the
        collector down, after :data:`SHUTDOWN_WAIT_S` ``stop_exporter`` ends the
        exporter's retries, so the last export fails at once and the rest of the queue is
        dropped. In a daemon thread, so an export stuck in a connect that ignores the stop
        cannot hold the process either."""
        worker = threading.Thread(target=self.provider.shutdown, name="otlp-shutdown", daemon=True)
        worker.start()
        worker.join(SHUTDOWN_WAIT_S)
        if worker.is_alive():
            self.stop_exporter()
            worker.join(SHUTDOWN_WAIT_S)


def watched(exporter_class: Any, watch: ExportWatch, success: Any, failure: Any) -> Any:
    """``exporter_class`` (an OTLP exporter) whose exports report to ``watch``. A
    subclass rather than a wrapper: the metric reader reads the exporter's temporality
    and aggregation preferences from the instance."""

    class Watched(exporter_class):  # type: ignore[misc]
        def export(self, *args: Any, **kwargs: Any) -> Any:
            return watch.call(lambda: exporter_class.export(self, *args, **kwargs),
                              success, failure)

    Watched.__name__ = Watched.__qualname__ = exporter_class.__name__
    return Watched
