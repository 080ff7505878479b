"""What the live page shows (``/ui/data``), computed from the proxy's own registry when
a page asks: never per event or per request, at most once per ``MIN_COLLECT_S`` however
many pages poll. A small ring of those readings (:mod:`proxy.ui.collect`), kept only
while a page polls, gives the last minute and the points over time; each panel in
:data:`proxy.ui.panels.PANELS` is a function of a view of them. Percentiles use PromQL's
``histogram_quantile`` interpolation (:mod:`proxy.buckets`), so the page and Grafana
agree. What each panel means: docs/design/live-page.md.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from proxy import evidence as ev
from proxy.buckets import fraction_at_most, histogram_quantile
from proxy.diagnosis.wording import finite
from proxy.evidence import SELECTORS, TPOT, Registry
from proxy.ui.breaks import RecentBreaks
from proxy.ui.collect import (
    COARSE_S,
    FINE_S,
    QUANTILES,
    SAMPLE_NAMES,
    WINDOW_S,
    Collection,
    Reader,
    Selection,
    Series,
)
from proxy.ui.panels import PANELS, View

READING_PACE_S = 0.2  # seconds per output token at about reading pace
FAST_S = 0.05  # seconds per output token that reads as fast
MIN_COLLECT_S = 0.5
FINE_KEEP_S = 61.0
COARSE_KEEP = 60


class BadSelection(ValueError):
    """A selector names a label value the registry does not have."""


class LiveData:
    """The live page's figures, from ``registry``, with the ring described above."""

    def __init__(
        self,
        registry: Registry,
        *,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
        breaks: RecentBreaks | None = None,
    ) -> None:
        self.registry = registry
        self.breaks = breaks  # where recent prompts broke, in this process (proxy.ui.breaks)
        self.clock = clock
        self.wall_clock = wall_clock
        self.started = clock()
        self.edges: dict[str, tuple[float, ...]] = {}
        self.last: Collection | None = None
        self.fine: deque[Collection] = deque()
        self.coarse: deque[Collection] = deque(maxlen=COARSE_KEEP)
        self._lock = threading.Lock()  # the metrics port serves from several threads

    def collection(self) -> Collection:
        """The registry now, or as read less than ``MIN_COLLECT_S`` ago."""
        with self._lock:
            now = self.clock()
            last = self.last
            if last is not None and now - last.t < MIN_COLLECT_S:
                return last
            reader = Reader()
            reading = ev.read_registry(
                self.registry,
                last.reading if last is not None else None,
                also=reader.sample,
                names=SAMPLE_NAMES,
            )
            previous = last.series if last is not None else {}
            current = Collection(
                now,
                reader.series(self.edges, previous),
                reader.in_flight,
                reader.missed_measured,
                reading,
            )
            self.last = current
            if not self.fine or now - self.fine[-1].t >= FINE_S:
                self.fine.append(current)
            while len(self.fine) > 1 and now - self.fine[0].t > FINE_KEEP_S:
                self.fine.popleft()
            if not self.coarse or now - self.coarse[-1].t >= COARSE_S:
                self.coarse.append(current)
            return current

    def choices(self, collection: Collection) -> dict[str, list[str]]:
        keys = collection.series
        return {name: sorted({k[i] for k in keys if k[i]}) for i, name in enumerate(SELECTORS)}

    def answer(
        self, selection: Selection, slow: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The page's JSON for ``selection``; raises :class:`BadSelection` for a label
        value the registry does not have."""
        now_c = self.collection()
        choices = self.choices(now_c)
        for name, want in zip(SELECTORS, selection, strict=True):
            if want and want not in choices[name]:
                raise BadSelection(
                    f"unknown {name} {want[:200]!r}; known: " + ", ".join(choices[name][:20])
                )
        # the oldest collection within the minute (list(): other threads may append)
        base = next((c for c in list(self.fine) if now_c.t - c.t <= WINDOW_S + 0.5), now_c)
        view = View(self, now_c, base, selection)
        answer: dict[str, Any] = {
            "generated_ms": round(self.wall_clock() * 1000),
            "uptime_s": view.uptime_s,
            "selection": dict(zip(SELECTORS, selection, strict=True)),
            "choices": choices,
            "window_s": view.window_s,
            "span": view.span(),
            "refresh_s": FINE_S,
            "slow": slow or [],
            "bands": {"reading_pace_s": READING_PACE_S, "fast_s": FAST_S},
        }
        for name, panel in PANELS:
            answer[name] = panel(view)
        return answer

    def dist(self, series: Series, name: str) -> dict[str, Any] | None:
        """Count, mean and bucket percentiles of histogram ``name`` in ``series``."""
        pairs = self.pairs(series, name)
        if pairs is None:
            return None
        total, count = series.sum_count(name)
        out: dict[str, Any] = {"n": count, "mean": total / count}
        for q in QUANTILES:
            out[f"p{round(q * 100)}"] = finite(histogram_quantile(q, pairs))
        if name == TPOT:
            out["below_reading_pace"] = finite(1.0 - fraction_at_most(READING_PACE_S, pairs))
            out["above_fast"] = finite(fraction_at_most(FAST_S, pairs))
        return out

    def pairs(self, series: Series, name: str) -> list[tuple[float, float]] | None:
        """Histogram ``name``'s cumulative ``(le, count)`` pairs; None without observations."""
        values = series.hists.get(name)
        edges = self.edges.get(name)
        if values is None or edges is None or values[-1] <= 0:
            return None
        return list(zip(edges, values[:-2], strict=True))

    def quantile(self, series: Series, name: str, q: float) -> float | None:
        pairs = self.pairs(series, name)
        return None if pairs is None else finite(histogram_quantile(q, pairs))
