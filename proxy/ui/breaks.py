"""Where recent prompts stopped repeating, for the live page's "Prompt caching" panel:
the latest break of each (route, model, upstream, reason), fed once per finished request
(a watcher of :class:`proxy.metrics.Metrics`), never per event. Presentation only: it
reads the doctor's finding in the record (:class:`proxy.measure.PrefixRecord`).

Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from proxy.measure import RequestRecord

MAX_KEYS = 1024

Key = tuple[str, str, str, str]  # route, model, upstream, reason
_NOT_SHOWN = ("at", "tokens_per_byte")  # the page shows ago_s and stable_tokens


@dataclass(frozen=True, slots=True)
class BreakExample:
    """The latest break of one (route, model, upstream, reason)."""

    at: float  # clock time it was recorded
    part: str  # the part's kind ("" for the reasons about the whole prompt)
    index: int | None
    role: str
    offset: int | None  # byte offset in the part of the block where it broke
    part_bytes: int | None
    changed_bytes: int | None  # variable_before_stable: the changed run, block-rounded
    stable_bytes: int | None  # variable_before_stable: the bytes after it seen before
    prompt_bytes: int
    prompt_tokens: int | None  # the usage's, when it said them
    tokens_per_byte: float | None  # this request's, or the last one's of the key that said

    @property
    def stable_tokens(self) -> float | None:
        """The stable bytes in tokens, at the request's own ratio (as the doctor counts
        tokens), or the key's previous one when this request's usage said none (it
        failed, or its usage was estimated)."""
        if self.stable_bytes is None or self.tokens_per_byte is None:
            return None
        return self.stable_bytes * self.tokens_per_byte

    def as_json(self, now: float) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_SHOWN}
        out["ago_s"] = max(0.0, now - self.at)
        return out


class RecentBreaks:
    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, max_keys: int = MAX_KEYS
    ) -> None:
        self.clock = clock
        self.max_keys = max_keys
        self._latest: OrderedDict[Key, BreakExample] = OrderedDict()
        self._lock = threading.Lock()  # the page reads from another thread

    def add(self, record: RequestRecord) -> None:
        """One finished request; only one whose prompt broke is kept."""
        p = record.prefix
        if p is None or not p.break_reason:
            return
        key = (record.route, record.model, record.upstream, p.break_reason)
        tokens = None if record.tokens_estimated else record.prompt_tokens
        ratio = tokens / p.prompt_bytes if tokens and p.prompt_bytes > 0 else None
        with self._lock:
            latest = self._latest
            if ratio is None and (before := latest.get(key)) is not None:
                ratio = before.tokens_per_byte
            example = BreakExample(
                self.clock(),
                p.break_part,
                p.break_index,
                p.break_role,
                p.break_offset,
                p.break_part_bytes,
                p.changed_bytes,
                p.stable_bytes,
                p.prompt_bytes,
                tokens,
                ratio,
            )
            latest[key] = example
            latest.move_to_end(key)
            if len(latest) > self.max_keys:
                latest.popitem(last=False)

    def latest(
        self, match: Callable[[tuple[str, str, str]], bool]
    ) -> dict[str, tuple[tuple[str, str, str], BreakExample]]:
        """Per reason, the latest example among the (route, model, upstream) that
        ``match`` accepts, with its key."""
        with self._lock:
            items = list(self._latest.items())
        out: dict[str, tuple[tuple[str, str, str], BreakExample]] = {}
        for (route, model, upstream, reason), example in items:
            key = (route, model, upstream)
            if match(key):
                found = out.get(reason)
                if found is None or example.at >= found[1].at:
                    out[reason] = (key, example)
        return out
