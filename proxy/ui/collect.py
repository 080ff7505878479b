"""One reading of the registry for the live page: figures per (route, model, upstream),
summed over every other label, in flat arrays that the next reading reuses where nothing
changed (:class:`Collection`). The page's panels read them (:mod:`proxy.ui.panels`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from operator import add, sub
from typing import Any, TypeVar

from proxy.doctor.examine import REASONS
from proxy.evidence import (
    COMPLETION,
    ITL,
    MISSED,
    QUEUE,
    REQUESTS,
    TPOT,
    TTFT,
    Key,
    Reading,
    bucket_edge,
)
from proxy.evidence import (
    SAMPLE_NAMES as EVIDENCE_SAMPLES,
)
from proxy.measure import Outcome

TTFA = "llm_proxy_time_to_first_answer_token_seconds"
HISTOGRAMS = (TTFT, TTFA, ITL, TPOT)  # buckets kept: percentiles and charts
OVERHEAD = "llm_proxy_overhead_seconds"
PROMPT = "llm_proxy_prompt_tokens"
CACHED = "llm_proxy_cached_prompt_tokens"
SUMMED = (QUEUE, OVERHEAD, PROMPT, CACHED, COMPLETION)  # only _sum and _count
OUTCOMES = "llm_proxy_stream_outcomes_total"
IN_FLIGHT = "llm_proxy_in_flight_requests"
REPEATED = "llm_proxy_prompt_repeated_tokens_total"
BREAKS = "llm_proxy_prompt_prefix_breaks_total"
EXAMINED = "llm_proxy_prompt_cache_missed_tokens_per_request_count"  # with the cached field

QUANTILES = (0.5, 0.9, 0.99)
# The ring of collections (proxy.ui.data): one kept every FINE_S for the last minute,
# one every COARSE_S for the points over time.
FINE_S, COARSE_S = 1.0, 5.0
WINDOW_S = 60.0
# The ring holds a minute once its oldest collection within WINDOW_S is at least this
# old: collections are kept at most every FINE_S, so a page polling once a second
# leaves gaps of up to two FINE_S.
FULL_WINDOW_S = WINDOW_S - 2 * FINE_S
_MEMO_MAX = 16  # aggregates, points and diagnoses remembered per collection

OUTCOME_NAMES = tuple(str(o) for o in Outcome if o is not Outcome.REJECTED)
CODES = ("2xx", "3xx", "4xx", "5xx")
# Scalars of one series, in this order in its array.
_SCALARS: tuple[str, ...] = (
    "requests",
    *(f"{name}_{part}" for name in SUMMED for part in ("sum", "count")),
    *(f"code_{c}" for c in (*CODES, "other")),
    *(f"outcome_{o}" for o in (*OUTCOME_NAMES, "other")),
    "nonstream_5xx",
    "missed_tokens",
    "repeated_tokens",
    "examined",
    *(f"break_{r}" for r in (*REASONS, "other")),
    # the prompt tokens of the series whose answers said what they served from cache:
    # the cache hit ratio's denominator, where an upstream that never says is unknown,
    # not a cache that hit nothing (a series whose answers said only at times: all of it)
    "prompt_reported",
)
_AT = {name: i for i, name in enumerate(_SCALARS)}
_REASONS = frozenset(REASONS)
# What the page reads: its own figures, and the evidence the "What to fix" card's levers
# read (proxy.evidence), gathered in the same walk over the registry.
SAMPLE_NAMES = (
    frozenset(
        [REQUESTS, OUTCOMES, IN_FLIGHT, MISSED, REPEATED, BREAKS, EXAMINED]
        + [f"{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "sum", "count")]
        + [f"{h}_{s}" for h in SUMMED for s in ("sum", "count")]
    )
    | EVIDENCE_SAMPLES
)

Selection = tuple[str, str, str]  # "" selects every value
T = TypeVar("T")


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

    def sum_count(self, name: str) -> tuple[float, float]:
        """Histogram ``name``'s sum and count; 0 and 0 without it."""
        values = self.hists.get(name)
        return (values[-2], values[-1]) if values is not None else (0.0, 0.0)


def _nonnegative(values: Iterable[float]) -> array[float]:
    return array("d", (v if v > 0.0 else 0.0 for v in values))


@dataclass(slots=True)
class Collection:
    """One reading of the registry."""

    t: float
    series: dict[Key, Series]
    in_flight: dict[str, float]  # by upstream
    missed_measured: bool = False  # the registry has samples of the doctor's counters
    reading: Reading | None = None  # the levers' evidence, cumulative
    memo: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def remember(self, key: tuple[Any, ...], compute: Callable[[], T]) -> T:
        found: T | None = self.memo.get(key)
        if found is None:
            found = compute()
            if len(self.memo) < _MEMO_MAX:
                self.memo[key] = found
        return found

    def total(self, selection: Selection) -> Series:
        def compute() -> Series:
            out = Series.empty()
            for key, series in self.series.items():
                if matches(selection, key):
                    out = out.plus(series)
            return out

        return self.remember(("total", selection), compute)


def matches(selection: Selection, key: Key) -> bool:
    return all(not want or want == have for want, have in zip(selection, key, strict=True))


class Reader:
    """Accumulates one collect() into per-series temporaries, then arrays."""

    def __init__(self) -> None:
        self.buckets: dict[tuple[Key, str], dict[float, float]] = {}
        self.hsums: dict[tuple[Key, str, str], float] = {}
        self.scalars: dict[Key, list[float]] = {}
        self.in_flight: dict[str, float] = {}
        self.missed_measured = False

    def scalar(self, key: Key, name: str, value: float) -> None:
        row = self.scalars.get(key)
        if row is None:
            row = self.scalars[key] = [0.0] * len(_SCALARS)
        row[_AT[name]] += value

    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None:
        key = (labels.get("route", ""), labels.get("model", ""), labels.get("upstream", ""))
        base, _, part = name.rpartition("_")
        if part == "bucket":
            if base not in HISTOGRAMS:
                return
            edges = self.buckets.setdefault((key, base), {})
            le = bucket_edge(labels.get("le", ""))
            if le is not None:
                edges[le] = edges.get(le, 0.0) + value
        elif base in HISTOGRAMS:
            hkey = (key, base, part)
            self.hsums[hkey] = self.hsums.get(hkey, 0.0) + value
        elif base in SUMMED:
            if base != QUEUE or labels.get("stream", "true") == "true":
                self.scalar(key, f"{base}_{part}", value)
        elif name == REQUESTS:
            self.scalar(key, "requests", value)
            code = labels.get("code", "")
            klass = f"{code[0]}xx" if len(code) == 3 and code[0] in "2345" else "other"
            self.scalar(key, f"code_{klass}", value)
            if klass == "5xx" and labels.get("stream") == "false":
                self.scalar(key, "nonstream_5xx", value)
        elif name == OUTCOMES:
            outcome = labels.get("outcome", "")
            self.scalar(key, f"outcome_{outcome if outcome in OUTCOME_NAMES else 'other'}", value)
        elif name == IN_FLIGHT:
            upstream = key[2]
            self.in_flight[upstream] = self.in_flight.get(upstream, 0.0) + value
        elif name in (MISSED, REPEATED):
            self.missed_measured = True
            self.scalar(key, "missed_tokens" if name == MISSED else "repeated_tokens", value)
        elif name == EXAMINED:
            self.scalar(key, "examined", value)
        elif name == BREAKS:
            reason = labels.get("reason", "")
            self.scalar(key, f"break_{reason if reason in _REASONS else 'other'}", value)

    def series(
        self, edges: dict[str, tuple[float, ...]], previous: dict[Key, Series]
    ) -> dict[Key, Series]:
        out: dict[Key, Series] = {}
        cached, prompt = _AT[f"{CACHED}_count"], _AT[f"{PROMPT}_sum"]
        reported = _AT["prompt_reported"]
        for key, row in self.scalars.items():
            row[reported] = row[prompt] if row[cached] > 0 else 0.0
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
                series = out[key] = Series.empty()
            old = previous.get(key)
            if old is not None and old.hists.get(name) == values:
                values = old.hists[name]
            series.hists[name] = values
        return out
