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

The span the page leads with (its tiles, its table by upstream and model) is the last
minute once the ring holds one (``span.kind == "minute"``), and since start until then
(``"start"``, with ``figures.window`` None): a page opened during traffic shows figures
at once, and says which they are, rather than a partial window labelled as a minute.
Each point over time is a whole interval between two 5 s collections; the interval still
running is not drawn (a rate or a percentile of its first second is noise, and its
counts are short: the right-most point would drop toward zero).

Percentiles are bucket estimates, by the same interpolation as PromQL's
``histogram_quantile`` (:mod:`proxy.buckets`), so the page, the demo, the bench and
Grafana agree on what p99 means.

Where the time goes: the means of one streamed request's parts, as shares of its mean
duration: queue time, proxy overhead (both counted from the proxy receiving the request),
the rest of the time to first token (the upstream's prefill and whatever precedes it),
and decoding (duration minus time to first token). Means, because they add up; they are
exact (``_sum / _count``), no bucket estimate involved.

By upstream and model (``table``): one row per (upstream, model), per route too when more
than one route has traffic, over the span, by requests. Decode rate is the median of
1 / TPOT, tokens per second per stream as the bench reports it; since 1 / x is
decreasing, that is 1 / (median TPOT), read from the TPOT histogram. Errors are the
requests the upstream or the proxy failed: streams that ended in any outcome but
``completed`` and the client's own (``client_disconnected``, ``client_stalled``), and
requests not streamed that were answered 5xx (no outcome is recorded for those, and a
4xx there cannot be told from the proxy refusing the request itself). Requests the
proxy refused (``rejected``: bad key, too large, queue full) are not errors of the
upstream and have no outcome. Missed cache is the prompt-cache doctor's
``llm_proxy_prompt_cache_missed_tokens_total`` (prompt tokens an earlier prompt had
sent that the provider's cache did not serve) over the prompt tokens; None, "not
measured", while the registry has no sample of the doctor's counters.

What to fix (``fix``): the levers of ``llm-latency-proxy diagnose``
(:mod:`proxy.diagnosis.levers`) per (route, model, upstream) in the selection, from the
same evidence (:mod:`proxy.evidence`), gathered in the same walk over the registry and
kept in each collection of the ring as a cumulative reading, so the last minute is the
difference of two readings, as for every other figure. Prompt caching (``prompt_cache``):
the doctor's counters per span, priced by each selection's prefill fit since start, and the break
reasons by count, each with the latest example this process kept
(:mod:`proxy.ui.breaks`). The page says what a per-process index cannot see (the
answer's ``prefix_index``, :func:`proxy.ui.index_scope`) unless the index is shared.

Panels: the answer is a few fixed fields and one entry per panel in :data:`PANELS`,
each a function of a :class:`View` (one answer's collections, selection and span). A
panel is added as a function and a line there, its section in ``static/ui.html`` and
its drawing function in ``static/ui.js``'s ``PANELS``.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from operator import add, sub
from typing import Any, Protocol

from proxy import evidence as ev
from proxy.buckets import fraction_at_most, histogram_quantile
from proxy.diagnosis import levers
from proxy.doctor.examine import REASONS
from proxy.doctor.report import explain_break
from proxy.measure import Outcome
from proxy.ui.breaks import BreakExample, RecentBreaks

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
MISSED = "llm_proxy_prompt_cache_missed_tokens_total"  # the prompt-cache doctor's
REPEATED = "llm_proxy_prompt_repeated_tokens_total"
BREAKS = "llm_proxy_prompt_prefix_breaks_total"
EXAMINED = "llm_proxy_prompt_cache_missed_tokens_per_request_count"  # with the cached field
SELECTORS = ("route", "model", "upstream")

READING_PACE_S = 0.2  # one token per 0.2 s: 5 tok/s, about reading pace
FAST_S = 0.05  # 20 tok/s
QUANTILES = (0.5, 0.9, 0.99)
MINUTE, START = "minute", "start"  # the span the page leads with

MIN_COLLECT_S = 0.5
FINE_S, FINE_KEEP_S = 1.0, 61.0
COARSE_S, COARSE_KEEP = 5.0, 60
WINDOW_S = 60.0
# The ring holds a minute once its oldest collection within WINDOW_S is at least this
# old: collections are kept at most every FINE_S, so a page polling once a second
# leaves gaps of up to two FINE_S.
FULL_WINDOW_S = WINDOW_S - 2 * FINE_S
_MEMO_MAX = 16  # aggregates, points and diagnoses remembered per collection
TABLE_MAX_ROWS = 60  # of the table by upstream and model; the rest are counted
CARD_MAX = 4  # selections on the "What to fix" card; the rest are counted
BREAKS_MAX = 4  # break reasons on the "Prompt caching" panel, the most frequent first

_OUTCOME_NAMES = tuple(str(o) for o in Outcome if o is not Outcome.REJECTED)
_CLIENT_LEFT = (str(Outcome.CLIENT_DISCONNECTED), str(Outcome.CLIENT_STALLED))
FAILED = tuple(o for o in _OUTCOME_NAMES if o != Outcome.COMPLETED and o not in _CLIENT_LEFT)
NOT_STREAMED_5XX = "5xx, not streamed"  # the errors' other part, as the row names it
_CODES = ("2xx", "3xx", "4xx", "5xx")
# Scalars of one series, in this order in its array.
_SCALARS: tuple[str, ...] = (
    "requests",
    *(f"{name}_{part}" for name in SUMMED for part in ("sum", "count")),
    *(f"code_{c}" for c in (*_CODES, "other")),
    *(f"outcome_{o}" for o in (*_OUTCOME_NAMES, "other")),
    "nonstream_5xx",
    "missed_tokens",
    "repeated_tokens",
    "examined",
    *(f"break_{r}" for r in (*REASONS, "other")),
)
_AT = {name: i for i, name in enumerate(_SCALARS)}
_REASONS = frozenset(REASONS)
# What the page reads: its own figures, and the evidence the "What to fix" card's levers
# read (proxy.evidence), gathered in the same walk over the registry.
SAMPLE_NAMES = frozenset(
    [REQUESTS, OUTCOMES, IN_FLIGHT, MISSED, REPEATED, BREAKS, EXAMINED]
    + [f"{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "sum", "count")]
    + [f"{h}_{s}" for h in SUMMED for s in ("sum", "count")]
) | ev.SAMPLE_NAMES

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
    missed_measured: bool = False  # the registry has samples of the doctor's counters
    reading: ev.Reading | None = None  # the levers' evidence, cumulative
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
        self.missed_measured = False

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
            if klass == "5xx" and labels.get("stream") == "false":
                self.scalar(key, "nonstream_5xx", value)
        elif name == OUTCOMES:
            outcome = labels.get("outcome", "")
            self.scalar(key, f"outcome_{outcome if outcome in _OUTCOME_NAMES else 'other'}", value)
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
            reader = _Reader()
            builder = ev.ReadingBuilder()
            wants = ev.SAMPLE_NAMES
            for family in self.registry.collect():
                for sample in family.samples:
                    name = sample.name
                    if name in SAMPLE_NAMES:
                        value = float(sample.value)
                        reader.sample(name, sample.labels, value)
                        if name in wants:
                            builder.sample(name, sample.labels, value)
            previous = last.series if last is not None else {}
            current = Collection(
                now, reader.series(self.edges, previous), reader.in_flight, reader.missed_measured,
                builder.build(last.reading if last is not None else None),
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
        view = View(self, now_c, self._window_base(now_c), selection)
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

    def _window_base(self, now_c: Collection) -> Collection:
        for collection in list(self.fine):  # a copy: other threads may append
            if now_c.t - collection.t <= WINDOW_S + 0.5:
                return collection
        return now_c

    def dist(self, series: Series, name: str) -> dict[str, Any] | None:
        """Count, mean and bucket percentiles of histogram ``name`` in ``series``."""
        pairs = self.pairs(series, name)
        if pairs is None:
            return None
        values = series.hists[name]
        count, total = values[-1], values[-2]
        out: dict[str, Any] = {"n": count, "mean": total / count}
        for q in QUANTILES:
            out[f"p{round(q * 100)}"] = _finite(histogram_quantile(q, pairs))
        if name == TPOT:
            out["below_reading_pace"] = _finite(1.0 - fraction_at_most(READING_PACE_S, pairs))
            out["above_fast"] = _finite(fraction_at_most(FAST_S, pairs))
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
        return None if pairs is None else _finite(histogram_quantile(q, pairs))


class View:
    """One answer as its panels read it: the collection now, the one the last minute
    starts from, the selection, and the span the page leads with (module docstring)."""

    __slots__ = ("base", "data", "minute", "now", "selection", "total", "window")

    def __init__(self, data: LiveData, now: Collection, base: Collection, selection: Selection):
        self.data, self.now, self.base, self.selection = data, now, base, selection
        self.minute = now.t - base.t >= FULL_WINDOW_S
        self.total = now.total(selection)
        self.window = self.total.minus(base.total(selection)) if self.minute else None

    @property
    def uptime_s(self) -> float:
        return self.now.t - self.data.started

    @property
    def window_s(self) -> float:
        return self.now.t - self.base.t

    def span(self) -> dict[str, Any]:
        if self.minute:
            return {"kind": MINUTE, "label": "last minute", "seconds": self.window_s}
        return {
            "kind": START,
            "label": "since start",
            "seconds": self.uptime_s,
            "minute_in_s": max(FULL_WINDOW_S - self.window_s, 0.0),
        }


# ---------------------------------------------------------------------------------------
# Panels: one function of a View each, listed in PANELS (module docstring).


def figures(view: View) -> dict[str, Any]:
    """Tiles, percentiles, outcomes, where the time goes: the last minute (None until the
    ring holds one) and since start."""
    window = view.window
    return {
        "window": _figures(view.data, window, view.window_s) if window is not None else None,
        "total": _figures(view.data, view.total, view.uptime_s),
    }


def histograms(view: View) -> dict[str, Any]:
    """TTFT and ITL counts per bucket."""
    return {name: _histogram(view.data, name, view.window, view.total) for name in (TTFT, ITL)}


def in_flight(view: View) -> float:
    """Requests in flight now, of the selected upstream (the gauge has no other label)."""
    upstream = view.selection[2]
    return sum(v for k, v in view.now.in_flight.items() if not upstream or k == upstream)


def over_time(view: View) -> dict[str, Any]:
    """Points every ``COARSE_S`` over the ring, each a whole interval between two of its
    collections (the one still running is left out); ``None`` where the ring has a gap
    (no page polled), so the lines break there."""
    now_t, selection = view.now.t, view.selection
    # (a copy, without what another thread's answer collected since this one's)
    points = [c for c in list(view.data.coarse) if c.t <= now_t]
    out: dict[str, list[Any]] = {"t": []}
    keys = [f"{h}.p{round(q * 100)}" for h in ("ttft", "ttfa", "itl") for q in QUANTILES]
    for k in (*keys, "requests_per_s", "output_tokens_per_s"):
        out[k] = []
    for before, after in itertools.pairwise(points):
        point = after.remember(
            ("point", selection, before.t), partial(_point, view.data, selection, before, after)
        )
        if after.t - before.t > 2.5 * COARSE_S:  # a gap: break the lines
            out["t"].append(before.t - now_t + COARSE_S)
            for k in out:
                if k != "t":
                    out[k].append(None)
        out["t"].append(after.t - now_t)
        for k, v in point.items():
            out[k].append(v)
    return out


def by_upstream(view: View) -> dict[str, Any]:
    """One row per (upstream, model), and route when more than one has traffic, over the
    span, whatever is selected (it is how one selects); the most requests first."""
    key = ("table", view.base.t if view.minute else None)
    found: dict[str, Any] = view.now.remember(key, partial(_table, view))
    return found


def _evidence(view: View, span: str) -> list[levers.Evidence]:
    """The levers' evidence of each (route, model, upstream) in the selection, over the
    span (``"window"``: the last minute, once the ring holds one; ``"total"``: since
    start), busiest first; computed once per reading."""
    now, base = view.now, view.base
    if now.reading is None or (span == "window" and (not view.minute or base.reading is None)):
        return []
    before = base.reading if span == "window" else None
    route, model, upstream = (value or None for value in view.selection)

    def compute() -> list[levers.Evidence]:
        return ev.evidence(now.reading or ev.Reading({}), before, route=route, model=model,
                           upstream=upstream)

    found: list[levers.Evidence] = now.remember(
        ("evidence", view.selection, span, base.t if span == "window" else None), compute)
    return found


def _fit(evidence: levers.Evidence) -> dict[str, Any]:
    fit = evidence.fit
    return {
        "requests": fit.requests,
        "status": fit.status,
        "usable": levers.usable_fit(fit),
        "ms_per_1k_tokens": fit.ms_per_1k_tokens,
        "stderr_ms_per_1k_tokens": fit.stderr_ms_per_1k_tokens,
        "fixed_ms": fit.fixed_ms,
        "mean_uncached_tokens": fit.mean_uncached_tokens,
        "model": fit.model,  # "line", or "through_zero" (proxy.diagnosis.fit)
        "line_fixed_ms": fit.line_fixed_ms,
        "skipped": evidence.fit_skipped,  # streams with no prompt token count at all
        # of the fit's requests, those with the proxy's own token estimate (no usage)
        "estimated_requests": evidence.fit_estimated,
        "note": levers.fit_note(evidence),
    }


def what_to_fix(view: View) -> dict[str, Any]:
    """The "What to fix" card: the levers of ``llm-latency-proxy diagnose``
    (:mod:`proxy.diagnosis.levers`) for each (route, model, upstream) in the selection,
    busiest first, at most ``CARD_MAX``. The levers are ranked over since start, as the
    command ranks them by default: a minute of one selection rarely holds the
    ``levers.MIN_REQUESTS`` streams a lever needs. The prefill fit is given for both
    spans, so a change in the last minute shows beside the whole run."""

    def compute() -> dict[str, Any]:
        total = _evidence(view, "total")
        window = {(e.route, e.model, e.upstream): e for e in _evidence(view, "window")}
        out = []
        for evidence in total[:CARD_MAX]:
            key = (evidence.route, evidence.model, evidence.upstream)
            found = levers.diagnose(evidence)
            recent = window.get(key)
            out.append({
                "route": found.route,
                "model": found.model,
                "upstream": found.upstream,
                "requests": found.requests,
                "fit": {"total": _fit(evidence),
                        "window": _fit(recent) if recent is not None else None},
                "first_token": found.first_token.as_json(),
                "levers": [lever.as_json() for lever in found.levers],
            })
        return {"selections": out, "more": max(len(total) - CARD_MAX, 0)}

    found: dict[str, Any] = view.now.remember(
        ("fix", view.selection, view.base.t if view.minute else None), compute)
    return found


def prompt_cache(view: View) -> dict[str, Any]:
    """Prompt caching, per span: prompt tokens, the repeated prefix the prompt-cache
    doctor found, the cached tokens the upstream reported and the missed ones (repeated,
    not reported cached), per second and as shares of the prompt tokens; what the missed
    ones cost in first-token time by the prefill fit (since start, in both spans: the
    most data); and the top break reasons, each
    with the latest example this process kept (:mod:`proxy.ui.breaks`) and one sentence.
    ``measured`` is False while the registry has no sample of the doctor's counters."""

    def compute() -> dict[str, Any]:
        fits = {(e.route, e.model, e.upstream): e.fit for e in _evidence(view, "total")}
        breaks = view.data.breaks
        examples = (breaks.latest(partial(_matches, view.selection))
                    if breaks is not None else {})
        clock = breaks.clock() if breaks is not None else 0.0
        out: dict[str, Any] = {
            "measured": view.now.missed_measured,
            "total": _prompt_span(view, "total", fits, examples, clock),
            "window": _prompt_span(view, "window", fits, examples, clock) if view.minute
            else None,
            "examples": breaks is not None,
        }
        return out

    found: dict[str, Any] = view.now.remember(
        ("prompt", view.selection, view.base.t if view.minute else None), compute)
    return found


def _prompt_span(view: View, span: str, fits: dict[Key, Any],
                 examples: dict[str, tuple[Key, BreakExample]], clock: float) -> dict[str, Any]:
    before = view.base.series if span == "window" else {}
    seconds = view.window_s if span == "window" else view.uptime_s
    s = Series.empty()
    missed_ms_sum = missed_fitted = examined_fitted = 0.0
    for key, series in view.now.series.items():
        if not _matches(view.selection, key):
            continue
        old = before.get(key)
        change = series.minus(old) if old is not None else series
        s = s.plus(change)
        fit = fits.get(key)
        if fit is not None and levers.usable_fit(fit) and change.get("examined") > 0:
            missed = change.get("missed_tokens")
            missed_ms_sum += fit.prefill_ms(missed) or 0.0
            missed_fitted += missed
            examined_fitted += change.get("examined")
    prompt = s.get(f"{PROMPT}_sum")
    missed_all = s.get("missed_tokens")

    def per_s(value: float) -> float | None:
        return value / seconds if seconds > 0 else None

    figures: dict[str, Any] = {"seconds": seconds}
    for name, value in (("prompt", prompt), ("repeated", s.get("repeated_tokens")),
                        ("cached", s.get(f"{CACHED}_sum")), ("missed", missed_all)):
        figures[name] = {"tokens": value, "per_s": per_s(value),
                         "share": value / prompt if prompt > 0 else None}
    figures["examined"] = s.get("examined")
    # Missed tokens per examined request at each selection's fitted prefill cost; the
    # share of missed tokens whose selection has a usable fit says what it covers.
    figures["missed_ms"] = missed_ms_sum / examined_fitted if examined_fitted > 0 else None
    figures["missed_ms_covers"] = missed_fitted / missed_all if missed_all > 0 else None
    counts = sorted(((s.get(f"break_{r}"), r) for r in (*REASONS, "other")), reverse=True)
    figures["breaks"] = [
        _break(reason, count, per_s(count), examples.get(reason), fits, clock)
        for count, reason in counts[:BREAKS_MAX] if count > 0
    ]
    figures["breaks_total"] = math.fsum(count for count, _ in counts)
    return figures


def _break(reason: str, count: float, per_s: float | None,
           found: tuple[Key, BreakExample] | None, fits: dict[Key, Any], clock: float
           ) -> dict[str, Any]:
    out: dict[str, Any] = {"reason": reason, "count": count, "per_s": per_s, "example": None,
                           "saves_ms": None}
    if found is None:
        out["sentence"] = explain_break(reason)
        return out
    key, example = found
    fit = fits.get(key)
    tokens = example.stable_tokens if reason == "variable_before_stable" else None
    saves = (fit.prefill_ms(tokens) if tokens is not None and fit is not None
             and levers.usable_fit(fit) else None)
    out["example"] = {"route": key[0], "model": key[1], "upstream": key[2],
                      **example.as_json(clock), "stable_tokens": tokens}
    out["saves_ms"] = saves
    out["sentence"] = explain_break(
        reason, part=example.part, index=example.index, role=example.role, route=key[0],
        offset=example.offset, part_bytes=example.part_bytes,
        changed_bytes=example.changed_bytes, stable_bytes=example.stable_bytes,
        stable_tokens=tokens, saves_ms=saves)
    return out


PANELS: tuple[tuple[str, Callable[[View], Any]], ...] = (
    ("figures", figures),
    ("hist", histograms),
    ("series", over_time),
    ("in_flight", in_flight),
    ("table", by_upstream),
    ("fix", what_to_fix),
    ("prompt_cache", prompt_cache),
)


def _figures(data: LiveData, s: Series, seconds: float) -> dict[str, Any]:
    def mean(name: str) -> float | None:
        count = s.get(f"{name}_count")
        return s.get(f"{name}_sum") / count if count > 0 else None

    ttft = data.dist(s, TTFT)
    prompt = s.get(f"{PROMPT}_sum")
    return {
        "seconds": seconds,
        "requests": s.get("requests"),
        "requests_per_s": s.get("requests") / seconds if seconds > 0 else None,
        "output_tokens": s.get(f"{COMPLETION}_sum"),
        "output_tokens_per_s": s.get(f"{COMPLETION}_sum") / seconds if seconds > 0 else None,
        "cache_hit_ratio": s.get(f"{CACHED}_sum") / prompt if prompt > 0 else None,
        "ttft": ttft,
        "ttfa": data.dist(s, TTFA),
        "itl": data.dist(s, ITL),
        "tpot": data.dist(s, TPOT),
        "outcomes": {o: v for o in (*_OUTCOME_NAMES, "other") if (v := s.get(f"outcome_{o}"))},
        "codes": {c: v for c in (*_CODES, "other") if (v := s.get(f"code_{c}"))},
        "time": _time_split(
            mean(DURATION), mean(QUEUE), mean(OVERHEAD), ttft["mean"] if ttft else None
        ),
    }


def _histogram(data: LiveData, name: str, window: Series | None, total: Series) -> dict[str, Any]:
    edges = data.edges.get(name, ())

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


def _point(
    data: LiveData, selection: Selection, before: Collection, after: Collection
) -> dict[str, Any]:
    d = after.total(selection).minus(before.total(selection))
    seconds = after.t - before.t
    point: dict[str, Any] = {}
    for short, name in (("ttft", TTFT), ("ttfa", TTFA), ("itl", ITL)):
        dist = data.dist(d, name)
        for q in QUANTILES:
            p = f"p{round(q * 100)}"
            point[f"{short}.{p}"] = dist[p] if dist else None
    point["requests_per_s"] = d.get("requests") / seconds
    point["output_tokens_per_s"] = d.get(f"{COMPLETION}_sum") / seconds
    return point


def _table(view: View) -> dict[str, Any]:
    before = view.base.series if view.minute else {}
    moved: dict[Key, Series] = {}
    for key, series in view.now.series.items():
        old = before.get(key)
        change = series.minus(old) if old is not None else series
        if change.get("requests") > 0:
            moved[key] = change
    by_route = len({key[0] for key in moved}) > 1
    rows: dict[Key, Series] = {}
    for (route, model, upstream), change in moved.items():
        key = (route if by_route else "", model, upstream)
        found = rows.get(key)
        rows[key] = change if found is None else found.plus(change)
    ordered = sorted(
        rows.items(), key=lambda kv: (-kv[1].get("requests"), kv[0][2], kv[0][1], kv[0][0])
    )
    return {
        "by_route": by_route,
        "missed_measured": view.now.missed_measured,
        "rows": [_row(view, key, s) for key, s in ordered[:TABLE_MAX_ROWS]],
        "more": max(len(ordered) - TABLE_MAX_ROWS, 0),
    }


def _row(view: View, key: Key, s: Series) -> dict[str, Any]:
    route, model, upstream = key
    q = partial(view.data.quantile, s)
    requests = s.get("requests")
    tpot = q(TPOT, 0.5)
    errors_by = {o: v for o in FAILED if (v := s.get(f"outcome_{o}"))}
    if not_streamed := s.get("nonstream_5xx"):
        errors_by[NOT_STREAMED_5XX] = not_streamed
    errors = math.fsum(errors_by.values())
    prompt = s.get(f"{PROMPT}_sum")
    missed = s.get("missed_tokens") if view.now.missed_measured else None
    return {
        "route": route,
        "model": model,
        "upstream": upstream,
        "requests": requests,
        "ttft_p50": q(TTFT, 0.5),
        "ttft_p95": q(TTFT, 0.95),
        "ttfa_p50": q(TTFA, 0.5),
        "itl_p50": q(ITL, 0.5),
        "decode_tok_s": 1.0 / tpot if tpot else None,  # median of 1 / TPOT
        "errors": errors,
        "error_share": errors / requests,
        "errors_by": errors_by,
        "missed_cache": missed / prompt if missed is not None and prompt > 0 else None,
        "missed_tokens": missed,
        "prompt_tokens": prompt,
    }


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
