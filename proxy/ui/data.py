"""What the live page shows, computed from the proxy's own registry when it is asked.

Nothing here runs per event or per request: :meth:`LiveData.answer` reads the registry
(``collect()``, no text exposition in between) when ``/ui/data`` is requested, at most
once per ``MIN_COLLECT_S`` however many pages poll (a faster poller gets the figures of
the last collection), so open pages cost the relay at most two collections a second and
a closed page costs nothing. A collection costs about a quarter of a ``/metrics`` scrape
of the same registry (only the samples used here are built).

Series are grouped by the three labels the page selects on, ``route``, ``model`` and
``upstream``, and every other label (``stream``, ``code``, ``le``, ``outcome``, and
whatever a later version adds, such as a client label) is summed over, generically: a
new label changes nothing here. ``le`` and ``outcome`` are summed within their own
bucket or outcome; the request duration is read for streams only (``stream="true"``)
where that label exists, since the time split below is of streamed requests.

"Last minute" and "over time" come from a small ring of the collections themselves, kept
as the registry's cumulative counts: one a second for the last minute (the minute is the
difference between now and the oldest of those within 60 s), and one every 5 s for the
last 5 minutes (each point over time is the difference between two of those). The ring
fills only while a page polls: after the page was closed, the first points cover the gap
(drawn as a break in the lines). Memory is bounded by the ring's length times the series
that changed: a collection reuses the previous one's arrays for every histogram that
did not move, so an idle series costs a pointer per collection.

Percentiles are bucket estimates, by the same interpolation as PromQL's
``histogram_quantile`` (:mod:`proxy.buckets`), so the page, the demo, the bench and
Grafana agree on what p99 means.

Where the time goes: the means of one streamed request's parts, as shares of its mean
duration: queue time, proxy overhead (both counted from the proxy receiving the request),
the rest of the time to first token (the upstream's prefill and whatever precedes it),
and decoding (duration minus time to first token). Means, because they add up; they are
exact (``_sum / _count``), no bucket estimate involved.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from operator import add, sub
from typing import Any, Protocol

from proxy.buckets import fraction_at_most, histogram_quantile
from proxy.measure import Outcome

TTFT = "llm_proxy_time_to_first_token_seconds"
TTFA = "llm_proxy_time_to_first_answer_token_seconds"
ITL = "llm_proxy_inter_token_latency_seconds"
TPOT = "llm_proxy_time_per_output_token_seconds"
HISTOGRAMS = (TTFT, TTFA, ITL, TPOT)  # buckets kept: percentiles and charts
DURATION = "llm_proxy_request_duration_seconds"
QUEUE = "llm_proxy_queue_time_seconds"
OVERHEAD = "llm_proxy_overhead_seconds"
PROMPT = "llm_proxy_prompt_tokens"
CACHED = "llm_proxy_cached_prompt_tokens"
COMPLETION = "llm_proxy_completion_tokens"
SUMMED = (DURATION, QUEUE, OVERHEAD, PROMPT, CACHED, COMPLETION)  # only _sum and _count
REQUESTS = "llm_proxy_requests_total"
OUTCOMES = "llm_proxy_stream_outcomes_total"
IN_FLIGHT = "llm_proxy_in_flight_requests"
SELECTORS = ("route", "model", "upstream")

READING_PACE_S = 0.2  # one token per 0.2 s: 5 tok/s, about reading pace
FAST_S = 0.05  # 20 tok/s
QUANTILES = (0.5, 0.9, 0.99)

MIN_COLLECT_S = 0.5
FINE_S, FINE_KEEP_S = 1.0, 61.0
COARSE_S, COARSE_KEEP = 5.0, 60
WINDOW_S = 60.0
_MEMO_MAX = 8  # aggregates and points remembered per collection: a few selections

_OUTCOME_NAMES = tuple(str(o) for o in Outcome if o is not Outcome.REJECTED)
_CODES = ("2xx", "3xx", "4xx", "5xx")
# Scalars of one series, in this order in its array.
_SCALARS: tuple[str, ...] = (
    "requests",
    *(f"{name}_{part}" for name in SUMMED for part in ("sum", "count")),
    *(f"code_{c}" for c in (*_CODES, "other")),
    *(f"outcome_{o}" for o in (*_OUTCOME_NAMES, "other")),
)
_AT = {name: i for i, name in enumerate(_SCALARS)}
SAMPLE_NAMES = frozenset(
    [REQUESTS, OUTCOMES, IN_FLIGHT]
    + [f"{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "sum", "count")]
    + [f"{h}_{s}" for h in SUMMED for s in ("sum", "count")]
)

Key = tuple[str, str, str]  # route, model, upstream
Selection = tuple[str, str, str]  # "" selects every value


class Registry(Protocol):
    """What is read of a prometheus_client registry (this module does not import it)."""

    def collect(self) -> Iterable[Any]: ...


class BadSelection(ValueError):
    """A selector names a label value the registry does not have."""


@dataclass(slots=True)
class Series:
    """Cumulative figures of one (route, model, upstream), or of a sum of them.

    ``hists[name]`` holds the cumulative bucket counts in the order of that histogram's
    edges, then its sum and count; ``scalars`` follows ``_SCALARS``."""

    hists: dict[str, array[float]]
    scalars: array[float]

    @classmethod
    def empty(cls) -> Series:
        return cls({}, array("d", bytes(8 * len(_SCALARS))))

    def plus(self, other: Series) -> Series:
        hists = dict(self.hists)
        for name, values in other.hists.items():
            mine = hists.get(name)
            hists[name] = values if mine is None else array("d", map(add, mine, values))
        return Series(hists, array("d", map(add, self.scalars, other.scalars)))

    def minus(self, before: Series) -> Series:
        """The change since ``before``; a count that went down (a restarted worker's
        files) counts as no change rather than a negative one."""
        hists = {}
        for name, values in self.hists.items():
            old = before.hists.get(name)
            hists[name] = values if old is None else _nonnegative(map(sub, values, old))
        return Series(hists, _nonnegative(map(sub, self.scalars, before.scalars)))

    def get(self, name: str) -> float:
        return self.scalars[_AT[name]]


def _nonnegative(values: Iterable[float]) -> array[float]:
    return array("d", (v if v > 0.0 else 0.0 for v in values))


@dataclass(slots=True)
class Collection:
    """One reading of the registry."""

    t: float
    series: dict[Key, Series]
    in_flight: dict[str, float]  # by upstream
    memo: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def remember(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        found = self.memo.get(key)
        if found is None:
            found = compute()
            if len(self.memo) < _MEMO_MAX:
                self.memo[key] = found
        return found

    def total(self, selection: Selection) -> Series:
        def compute() -> Series:
            out = Series.empty()
            for key, series in self.series.items():
                if _matches(selection, key):
                    out = out.plus(series)
            return out

        found: Series = self.remember(("total", selection), compute)
        return found


def _matches(selection: Selection, key: Key) -> bool:
    return all(not want or want == have for want, have in zip(selection, key, strict=True))


class _Reader:
    """Accumulates one collect() into per-series temporaries, then arrays."""

    def __init__(self) -> None:
        self.buckets: dict[tuple[Key, str], dict[float, float]] = {}
        self.hsums: dict[tuple[Key, str, str], float] = {}
        self.scalars: dict[Key, list[float]] = {}
        self.in_flight: dict[str, float] = {}

    def scalar(self, key: Key, name: str, value: float) -> None:
        row = self.scalars.get(key)
        if row is None:
            row = self.scalars[key] = [0.0] * len(_SCALARS)
        row[_AT[name]] += value

    def sample(self, name: str, labels: dict[str, str], value: float) -> None:
        key = (labels.get("route", ""), labels.get("model", ""), labels.get("upstream", ""))
        base, _, part = name.rpartition("_")
        if part == "bucket":
            if base not in HISTOGRAMS:
                return
            edges = self.buckets.setdefault((key, base), {})
            le = _edge(labels.get("le", ""))
            if le is not None:
                edges[le] = edges.get(le, 0.0) + value
        elif base in HISTOGRAMS:
            hkey = (key, base, part)
            self.hsums[hkey] = self.hsums.get(hkey, 0.0) + value
        elif base in SUMMED:
            if base != DURATION or labels.get("stream", "true") == "true":
                self.scalar(key, f"{base}_{part}", value)
        elif name == REQUESTS:
            self.scalar(key, "requests", value)
            code = labels.get("code", "")
            klass = f"{code[0]}xx" if len(code) == 3 and code[0] in "2345" else "other"
            self.scalar(key, f"code_{klass}", value)
        elif name == OUTCOMES:
            outcome = labels.get("outcome", "")
            self.scalar(key, f"outcome_{outcome if outcome in _OUTCOME_NAMES else 'other'}", value)
        elif name == IN_FLIGHT:
            upstream = key[2]
            self.in_flight[upstream] = self.in_flight.get(upstream, 0.0) + value

    def series(
        self, edges: dict[str, tuple[float, ...]], previous: dict[Key, Series]
    ) -> dict[Key, Series]:
        out: dict[Key, Series] = {}
        for key, row in self.scalars.items():
            old = previous.get(key)
            scalars = array("d", row)
            if old is not None and old.scalars == scalars:
                scalars = old.scalars
            out[key] = Series({}, scalars)
        for (key, name), counts in self.buckets.items():
            known = edges.get(name)
            if known is None or any(le not in counts for le in known):
                known = edges[name] = tuple(sorted(counts))
            values = array("d", [counts.get(le, 0.0) for le in known])
            values.append(self.hsums.get((key, name, "sum"), 0.0))
            values.append(self.hsums.get((key, name, "count"), 0.0))
            series = out.get(key)
            if series is None:
                series = out[key] = Series({}, array("d", bytes(8 * len(_SCALARS))))
            old = previous.get(key)
            if old is not None and old.hists.get(name) == values:
                values = old.hists[name]
            series.hists[name] = values
        return out


def _edge(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class LiveData:
    """The live page's figures, from ``registry``, with the ring described above."""

    def __init__(
        self,
        registry: Registry,
        *,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
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
            reader = _Reader()
            for family in self.registry.collect():
                for sample in family.samples:
                    if sample.name in SAMPLE_NAMES:
                        reader.sample(sample.name, sample.labels, float(sample.value))
            previous = last.series if last is not None else {}
            current = Collection(now, reader.series(self.edges, previous), reader.in_flight)
            self.last = current
            if not self.fine or now - self.fine[-1].t >= FINE_S:
                self.fine.append(current)
            while len(self.fine) > 1 and now - self.fine[0].t > FINE_KEEP_S:
                self.fine.popleft()
            if not self.coarse or now - self.coarse[-1].t >= COARSE_S:
                self.coarse.append(current)
            return current

    def choices(self, collection: Collection) -> dict[str, list[str]]:
        values: list[set[str]] = [set(), set(), set()]
        for key in collection.series:
            for i, value in enumerate(key):
                if value:
                    values[i].add(value)
        return {name: sorted(found) for name, found in zip(SELECTORS, values, strict=True)}

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
        base = self._window_base(now_c)
        total = now_c.total(selection)
        window_s = now_c.t - base.t
        window = total.minus(base.total(selection)) if window_s > 0 else None
        up = now_c.t - self.started
        upstream = selection[2]
        in_flight = sum(v for k, v in now_c.in_flight.items() if not upstream or k == upstream)
        return {
            "generated_ms": round(self.wall_clock() * 1000),
            "uptime_s": up,
            "selection": dict(zip(SELECTORS, selection, strict=True)),
            "choices": choices,
            "window_s": window_s,
            "refresh_s": FINE_S,
            "figures": {
                "window": self._figures(window, window_s) if window is not None else None,
                "total": self._figures(total, up),
            },
            "hist": {name: self._histogram(name, window, total) for name in (TTFT, ITL)},
            "series": self._over_time(selection, now_c),
            "in_flight": in_flight,
            "slow": slow or [],
            "bands": {"reading_pace_s": READING_PACE_S, "fast_s": FAST_S},
        }

    def _window_base(self, now_c: Collection) -> Collection:
        for collection in list(self.fine):  # a copy: other threads may append
            if now_c.t - collection.t <= WINDOW_S + 0.5:
                return collection
        return now_c

    # -- figures ---------------------------------------------------------------------

    def _dist(self, series: Series, name: str) -> dict[str, Any] | None:
        values = series.hists.get(name)
        edges = self.edges.get(name)
        if values is None or edges is None or values[-1] <= 0:
            return None
        pairs = list(zip(edges, values[:-2], strict=True))
        count, total = values[-1], values[-2]
        out: dict[str, Any] = {"n": count, "mean": total / count}
        for q in QUANTILES:
            out[f"p{round(q * 100)}"] = _finite(histogram_quantile(q, pairs))
        if name == TPOT:
            out["below_reading_pace"] = _finite(1.0 - fraction_at_most(READING_PACE_S, pairs))
            out["above_fast"] = _finite(fraction_at_most(FAST_S, pairs))
        return out

    def _figures(self, s: Series, seconds: float) -> dict[str, Any]:
        def mean(name: str) -> float | None:
            count = s.get(f"{name}_count")
            return s.get(f"{name}_sum") / count if count > 0 else None

        ttft = self._dist(s, TTFT)
        prompt = s.get(f"{PROMPT}_sum")
        return {
            "seconds": seconds,
            "requests": s.get("requests"),
            "requests_per_s": s.get("requests") / seconds if seconds > 0 else None,
            "output_tokens": s.get(f"{COMPLETION}_sum"),
            "output_tokens_per_s": s.get(f"{COMPLETION}_sum") / seconds if seconds > 0 else None,
            "cache_hit_ratio": s.get(f"{CACHED}_sum") / prompt if prompt > 0 else None,
            "ttft": ttft,
            "ttfa": self._dist(s, TTFA),
            "itl": self._dist(s, ITL),
            "tpot": self._dist(s, TPOT),
            "outcomes": {o: v for o in (*_OUTCOME_NAMES, "other") if (v := s.get(f"outcome_{o}"))},
            "codes": {c: v for c in (*_CODES, "other") if (v := s.get(f"code_{c}"))},
            "time": _time_split(
                mean(DURATION), mean(QUEUE), mean(OVERHEAD), ttft["mean"] if ttft else None
            ),
        }

    def _histogram(self, name: str, window: Series | None, total: Series) -> dict[str, Any]:
        edges = self.edges.get(name, ())

        def per_bucket(series: Series | None) -> list[float] | None:
            values = series.hists.get(name) if series is not None else None
            if values is None:
                return None
            counts = values[:-2]
            return [c - (counts[i - 1] if i else 0.0) for i, c in enumerate(counts)]

        return {
            "edges": [e for e in edges if math.isfinite(e)],
            "window": per_bucket(window),
            "total": per_bucket(total),
        }

    def _over_time(self, selection: Selection, now_c: Collection) -> dict[str, Any]:
        """Points every ``COARSE_S`` over the ring, the last one up to now; ``None``
        where the ring has a gap (no page polled), so the lines break there."""
        points: list[Collection] = list(self.coarse)
        if points and points[-1] is not now_c and now_c.t - points[-1].t >= FINE_S:
            points.append(now_c)
        out: dict[str, list[Any]] = {"t": []}
        keys = [f"{h}.p{round(q * 100)}" for h in ("ttft", "ttfa", "itl") for q in QUANTILES]
        for k in (*keys, "requests_per_s", "output_tokens_per_s"):
            out[k] = []
        for before, after in _pairs(points):
            point = after.remember(
                ("point", selection, before.t), partial(self._point, selection, before, after)
            )
            if after.t - before.t > 2.5 * COARSE_S:  # a gap: break the lines
                out["t"].append(before.t - now_c.t + COARSE_S)
                for k in out:
                    if k != "t":
                        out[k].append(None)
            out["t"].append(after.t - now_c.t)
            for k, v in point.items():
                out[k].append(v)
        return out

    def _point(self, selection: Selection, before: Collection, after: Collection) -> dict[str, Any]:
        d = after.total(selection).minus(before.total(selection))
        seconds = after.t - before.t
        point: dict[str, Any] = {}
        for short, name in (("ttft", TTFT), ("ttfa", TTFA), ("itl", ITL)):
            dist = self._dist(d, name)
            for q in QUANTILES:
                p = f"p{round(q * 100)}"
                point[f"{short}.{p}"] = dist[p] if dist else None
        point["requests_per_s"] = d.get("requests") / seconds
        point["output_tokens_per_s"] = d.get(f"{COMPLETION}_sum") / seconds
        return point


def _pairs(items: list[Collection]) -> Iterator[tuple[Collection, Collection]]:
    return itertools.pairwise(items)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _time_split(
    duration: float | None, queue: float | None, overhead: float | None, ttft: float | None
) -> dict[str, Any] | None:
    """Mean streamed request time in four parts that add up to it (see the module
    docstring); ``None`` until there is a streamed request with a first token."""
    if duration is None or ttft is None or duration <= 0:
        return None
    queue = min(queue or 0.0, ttft)
    overhead = min(overhead or 0.0, ttft - queue)
    first = max(ttft - queue - overhead, 0.0)
    decode = max(duration - ttft, 0.0)
    whole = queue + overhead + first + decode
    parts = {"queue": queue, "overhead": overhead, "first_token": first, "decode": decode}
    return {
        "request_s": duration,
        "parts_s": parts,
        "shares": {k: v / whole for k, v in parts.items()} if whole > 0 else None,
    }
