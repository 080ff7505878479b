"""A warning log that a failing upstream cannot flood.

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
