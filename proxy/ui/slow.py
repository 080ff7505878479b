"""The slowest recent streamed requests, for the live page's table.

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

from proxy.measure import RequestRecord

SLOT_S = 10.0
SLOTS = 7  # one minute: six whole slots and the current one
KEEP = 10
_ID_MAX = 64
_wait = attrgetter("wait_s")
_NOT_SHOWN = ("wait_s", "at")  # the page shows ago_s instead


@dataclass(frozen=True, slots=True)
class SlowRequest:
    wait_s: float  # the ranking key: TTFT, or the whole duration of a stream with no token
    at: float  # clock time it finished
    request_id: str
    route: str
    model: str
    upstream: str
    ttft_s: float | None
    ttfa_s: float | None
    duration_s: float
    prompt_tokens: int | None
    cached_prompt_tokens: int | None
    completion_tokens: int | None
    outcome: str

    def as_json(self, now: float) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_SHOWN}
        out["ago_s"] = max(0.0, now - self.at)
        return out


class _Top:
    """The ``KEEP`` slowest of one series in one slot; ``floor`` is the fastest kept."""

    __slots__ = ("floor", "items")

    def __init__(self) -> None:
        self.items: list[SlowRequest] = []
        self.floor = -1.0


Series = tuple[str, str, str]  # route, model, upstream


class SlowRequests:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._slot = -1
        self._current: dict[Series, _Top] = {}
        self._slots: deque[dict[Series, _Top]] = deque(maxlen=SLOTS)

    def add(self, record: RequestRecord) -> None:
        """One finished request; anything but a stream is ignored."""
        if not record.stream:
            return
        wait = record.ttft_s if record.ttft_s is not None else record.duration_s
        now = self.clock()
        slot = int(now // SLOT_S)
        if slot != self._slot:
            self._slot = slot
            self._current = {}
            self._slots.append(self._current)
        key = (record.route, record.model, record.upstream)
        top = self._current.get(key)
        if top is None:
            top = self._current[key] = _Top()
        elif wait <= top.floor and len(top.items) >= KEEP:
            return
        entry = SlowRequest(
            wait,
            now,
            record.request_id[:_ID_MAX],
            record.route,
            record.model,
            record.upstream,
            record.ttft_s,
            record.ttfa_s,
            record.duration_s,
            record.prompt_tokens,
            record.cached_prompt_tokens,
            record.completion_tokens,
            str(record.outcome),
        )
        items = top.items
        if len(items) >= KEEP:
            items.remove(min(items, key=_wait))
        items.append(entry)
        if len(items) >= KEEP:
            top.floor = min(item.wait_s for item in items)

    def slowest(
        self, match: Callable[[Series], bool], n: int = KEEP, horizon_s: float = 60.0
    ) -> list[dict[str, Any]]:
        """The ``n`` slowest requests of the last ``horizon_s`` seconds in the series that
        ``match`` accepts, slowest first. Safe to call from another thread: it reads
        copies (each ``list()`` of a builtin container is one step under the GIL)."""
        now = self.clock()
        found: list[SlowRequest] = []
        for slot in list(self._slots):
            for key, top in list(slot.items()):
                if match(key):
                    found.extend(i for i in list(top.items) if now - i.at <= horizon_s)
        found.sort(key=_wait, reverse=True)
        return [item.as_json(now) for item in found[:n]]
