"""Admission: the per-upstream limit on in-flight upstream requests, and its FIFO queue.

The wait is the queue time the proxy measures; a full queue is refused at once (429); a
cancelled waiter leaves the queue, passing on a slot it was just handed. Without a
limit ``acquire`` returns at once (``docs/design/request-path.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class QueueFull(Exception):
    """No slot free and the queue is at its bound."""


class Admission:
    __slots__ = ("_active", "_limit", "_max_queue", "_waiters")

    def __init__(self, limit: int, max_queue: int) -> None:
        self._limit = limit  # 0: unlimited
        self._max_queue = max_queue
        self._active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def limited(self) -> bool:
        return self._limit > 0

    @property
    def active(self) -> int:
        return self._active

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self) -> None:
        if not self._limit:
            return
        if self._active < self._limit and not self._waiters:
            self._active += 1
            return
        if len(self._waiters) >= self._max_queue:
            raise QueueFull
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # we were handed a slot just as we were cancelled
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        if not self._limit:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; _active unchanged
                return
        self._active -= 1
