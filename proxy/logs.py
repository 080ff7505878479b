"""A warning log that a failing upstream cannot flood, and uvicorn's line for a response
left unfinished on purpose kept out of the log.

Design: ``docs/design/upstream-client.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    __slots__ = (
        "_clock",
        "_interval",
        "_logger",
        "_per",
        "_suppressed",
        "_window_start",
        "_written",
    )

    def __init__(self, logger: logging.Logger, *, per_interval: int, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._per = per_interval
        self._interval = interval_s
        self._clock = clock
        self._window_start = -interval_s - 1.0
        self._written = 0
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = self._clock()
        if now - self._window_start >= self._interval:
            if self._suppressed:
                self._logger.warning("%d upstream failure lines were suppressed (at most %d "
                                     "per %g s)", self._suppressed, self._per, self._interval)
            self._window_start = now
            self._written = 0
            self._suppressed = 0
        if self._written < self._per:
            self._written += 1
            self._logger.warning(message, *args)
        else:
            self._suppressed += 1


# uvicorn's error line for an ASGI call that returned before the response's last body
# message: the proxy does so on purpose when the upstream broke its stream (so that the
# client sees the same break), and says why in its own warning; the simulator, when it
# drops a connection on purpose.
UNFINISHED_RESPONSE = "ASGI callable returned without completing response."


class NotUnfinishedOnPurpose(logging.Filter):
    """Drops uvicorn's :data:`UNFINISHED_RESPONSE` line; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != UNFINISHED_RESPONSE


def quiet_unfinished_responses(logger: logging.Logger | None = None) -> None:
    """Install (once) :class:`NotUnfinishedOnPurpose` on uvicorn's error logger."""
    logger = logger or logging.getLogger("uvicorn.error")
    if not any(isinstance(f, NotUnfinishedOnPurpose) for f in logger.filters):
        logger.addFilter(NotUnfinishedOnPurpose())
