"""The evidence the levers read (:class:`proxy.diagnosis.levers.Evidence`), from wherever
the proxy's counters live: its ``/metrics`` text, its own registry (the live page), or a
Prometheus server's answers (a fleet).

Design: ``docs/design/evidence.md``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.diagnosis.dist import Dist
from proxy.diagnosis.fit import SAMPLES as FIT_SAMPLES
from proxy.diagnosis.fit import SKIPPED_SAMPLE, FitSums, fit
from proxy.diagnosis.levers import Evidence

Key = tuple[str, str, str]  # route, model, upstream
SELECTORS = ("route", "model", "upstream")

TTFT = "llm_proxy_time_to_first_token_seconds"
QUEUE = "llm_proxy_queue_time_seconds"
UPSTREAM_QUEUE = "llm_proxy_upstream_queue_time_seconds"
ITL = "llm_proxy_inter_token_latency_seconds"
TPOT = "llm_proxy_time_per_output_token_seconds"
COMPLETION = "llm_proxy_completion_tokens"
MISSED_PER_REQUEST = "llm_proxy_prompt_cache_missed_tokens_per_request"
REQUESTS = "llm_proxy_requests_total"
FINISH = "llm_proxy_finish_reasons_total"
MISSED = "llm_proxy_prompt_cache_missed_tokens_total"
UNMARKED = "llm_proxy_prompt_cache_missed_unmarked_tokens_total"
ESTIMATED = "llm_proxy_prefill_fit_estimated_requests_total"
ENGINE_PREFILL = "llm_proxy_upstream_prefill_seconds"
NO_FIRST_TOKEN = "llm_proxy_wait_without_first_token_seconds"

SUMMED = (TTFT, QUEUE, UPSTREAM_QUEUE, ITL, TPOT, COMPLETION, MISSED_PER_REQUEST,
          ENGINE_PREFILL, NO_FIRST_TOKEN)
BUCKETED = (TPOT, COMPLETION)  # their buckets are read too
COUNTERS = (REQUESTS, MISSED, UNMARKED, SKIPPED_SAMPLE, ESTIMATED, *FIT_SAMPLES)
SAMPLE_NAMES: frozenset[str] = frozenset(
    [*COUNTERS, FINISH]
    + [f"{h}_{part}" for h in SUMMED for part in ("sum", "count")]
    + [f"{h}_bucket" for h in BUCKETED]
)
_BUCKET_OF = {f"{h}_bucket": h for h in BUCKETED}
_STREAMS_ONLY = (QUEUE,)  # histograms with a stream label: read for streams

# The recording rules holding the fit's sums over a window (prometheus/rules/recording.yml).
RULE_RANGES = ("5m", "1h")
_RULE_LEVEL = "upstream_model_route"


def fit_rule(sample: str, range_: str) -> str:
    """The recorded series holding ``increase(sample[range_])`` summed by the level's
    labels: ``llm_proxy_prefill_fit_xy_total`` -> ``upstream_model_route:
    llm_proxy_prefill_fit_xy:increase1h``."""
    return f"{_RULE_LEVEL}:{sample.removesuffix('_total')}:increase{range_}"


# -- one selection's samples --------------------------------------------------------


@dataclass(slots=True)
class Figures:
    """The samples of one (route, model, upstream): ``values`` by sample name (counters,
    histogram ``_sum`` and ``_count``), ``buckets[histogram][le]`` cumulative counts, and
    ``finish[finish_reason]``."""

    values: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    finish: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def minus(self, before: Figures) -> Figures:
        """The change since ``before``. A count that went down means the counters were
        reset (a restarted process): the window is then everything since the reset, as
        PromQL's ``increase`` takes it."""
        counts = [REQUESTS, *(f"{h}_count" for h in SUMMED), *FIT_SAMPLES]
        if any(self.get(c) < before.get(c) for c in counts if c in before.values):
            return self
        values = {k: v - before.values.get(k, 0.0) for k, v in self.values.items()}
        buckets = {}
        for name, edges in self.buckets.items():
            old = before.buckets.get(name, {})
            buckets[name] = {le: c - old.get(le, 0.0) for le, c in edges.items()}
        finish = {k: v - before.finish.get(k, 0.0) for k, v in self.finish.items()}
        return Figures(values, buckets, finish)

    def measured(self) -> bool:
        return any(self.get(n) > 0 for n in (
            f"{TTFT}_count", f"{COMPLETION}_count", f"{TPOT}_count",
            "llm_proxy_prefill_fit_requests_total", f"{NO_FIRST_TOKEN}_count"))


@dataclass(frozen=True, slots=True)
class Reading:
    """Figures per (route, model, upstream); cumulative, or a window."""

    figures: Mapping[Key, Figures]

    def minus(self, before: Reading | None) -> Reading:
        """The window from ``before`` to this reading (this reading itself without one)."""
        if before is None:
            return self
        return Reading({key: figs.minus(before.figures[key]) if key in before.figures
                        else figs for key, figs in self.figures.items()})


class ReadingBuilder:
    """Accumulates samples (name, labels, value) into a :class:`Reading`."""

    def __init__(self) -> None:
        self._figures: dict[Key, Figures] = {}

    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None:
        if name not in SAMPLE_NAMES or not math.isfinite(value):
            return
        if name.startswith(_STREAMS_ONLY) and labels.get("stream", "true") != "true":
            return  # the queue time is of streams, as the first token is
        key = (labels.get("route", ""), labels.get("model", ""), labels.get("upstream", ""))
        figs = self._figures.get(key)
        if figs is None:
            figs = self._figures[key] = Figures()
        histogram = _BUCKET_OF.get(name)
        if histogram is not None:
            le = bucket_edge(labels.get("le", ""))
            if le is not None:
                edges = figs.buckets.setdefault(histogram, {})
                edges[le] = edges.get(le, 0.0) + value
        elif name == FINISH:
            reason = labels.get("finish_reason", "other")
            figs.finish[reason] = figs.finish.get(reason, 0.0) + value
        else:
            figs.values[name] = figs.values.get(name, 0.0) + value

    def build(self, previous: Reading | None = None) -> Reading:
        """The reading; a selection whose figures equal ``previous``'s keeps that
        object, so a ring of readings shares what did not change."""
        old = previous.figures if previous is not None else {}
        figures = self._figures.items()
        return Reading({key: old[key] if old.get(key) == figs else figs for key, figs in figures})


def bucket_edge(le: str) -> float | None:
    """A histogram bucket's ``le`` label as a number (``+Inf`` included); None if not one."""
    try:
        return float(le)
    except ValueError:
        return None


# -- the three sources ------------------------------------------------------------------


class Registry(Protocol):
    """What is read of a prometheus_client registry (this module does not import it)."""

    def collect(self) -> Iterable[Any]: ...


def read_registry(registry: Registry, previous: Reading | None = None, *,
                  also: Callable[[str, Mapping[str, str], float], None] | None = None,
                  names: frozenset[str] = SAMPLE_NAMES) -> Reading:
    """One ``collect()`` of the proxy's own registry (with workers, the multiprocess
    registry that reads every worker's files), cumulative. ``also`` gets every sample
    named in ``names`` (a superset of :data:`SAMPLE_NAMES`), so that the live page reads
    its own figures in the same walk."""
    builder = ReadingBuilder()
    for family in registry.collect():
        for sample in family.samples:
            name = sample.name
            if name in names:
                value = float(sample.value)
                if also is not None:
                    also(name, sample.labels, value)
                builder.sample(name, sample.labels, value)
    return builder.build(previous)


def read_snapshot(snapshot: Mapping[tuple[str, tuple[tuple[str, str], ...]], float]) -> Reading:
    """A proxy's ``/metrics`` as :func:`proxy.bench.promscrape.parse` parsed it (malformed
    lines skipped), cumulative."""
    builder = ReadingBuilder()
    for (name, labels), value in snapshot.items():
        builder.sample(name, dict(labels), value)
    return builder.build()


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL query and the sample name its answers stand for."""

    sample: str
    expr: str
    rule: bool = False  # reads a recording rule's series


def matchers(route: str | None = None, model: str | None = None,
             upstream: str | None = None) -> str:
    """``route="...",model="..."`` for the filters given (exact values, escaped)."""
    given = {"route": route, "model": model, "upstream": upstream}
    return ",".join(f'{name}="{_escape(value)}"' for name, value in given.items() if value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _selector(name: str, where: str) -> str:
    return f"{name}{{{where}}}" if where else name


def prometheus_queries(range_: str, where: str = "", *, fit_from_rules: bool = True
                       ) -> list[Query]:
    """The queries for a window of ``range_`` (a PromQL duration) with label matchers
    ``where`` (see :func:`matchers`). With ``fit_from_rules`` and a range the recording
    rules keep, the fit's sums read the rules' series."""
    by = "route, model, upstream"
    out = []
    for name in sorted(SAMPLE_NAMES):
        extra = where
        if name.startswith(_STREAMS_ONLY):
            extra = ",".join(x for x in ('stream="true"', where) if x)
        labels = by + (", le" if name in _BUCKET_OF else "") + (
            ", finish_reason" if name == FINISH else "")
        if fit_from_rules and range_ in RULE_RANGES and name in FIT_SAMPLES:
            out.append(Query(name, _selector(fit_rule(name, range_), where), rule=True))
            continue
        s, r = _selector(name, extra), range_
        # a series with a sample at the range's start: the difference between the two
        # (its increase where it reset within); one born inside the range on a target
        # Prometheus scraped at its start (a new model, upstream or client): all of its
        # count, which increase() would lose up to its first scrape; any other
        # (Prometheus began scraping within the range): what it gained between its first
        # and last scrapes, since what it held at the first may predate the range. No
        # extrapolation: increase() stretches each series by its own factor, and a
        # histogram's buckets, its sum and its count then disagree (docs/diagnose.md)
        out.append(Query(name, f"sum by ({labels}) ((({s} - {s} offset {r}) and "
                               f"(resets({s}[{r}]) == 0)) or (increase({s}[{r}]) and {s} "
                               f"offset {r}) or (({s} unless {s} offset {r}) and on (job, "
                               f"instance) up offset {r}) or (max_over_time({s}[{r}]) - "
                               f"min_over_time({s}[{r}])))"))
    return out


SAMPLE_LABEL = "diagnose_sample"  # names the sample each series of the one query stands for


def prometheus_query(queries: Sequence[Query]) -> str:
    """The queries as one: each series tagged with the sample it stands for
    (:data:`SAMPLE_LABEL`), joined with ``or``. Prometheus evaluates one query over one
    view of its data at one instant; several queries, even at the same ``time``, can
    each see a scrape the one before did not, and the fit's slope and fixed part, as
    differences of products of its sums, magnify the difference."""
    return " or ".join(
        f'label_replace({q.expr}, "{SAMPLE_LABEL}", "{q.sample}", "", "")' for q in queries)


def reading_from_prometheus(result: Iterable[Mapping[str, Any]]) -> Reading:
    """A window from Prometheus: the ``result`` list of :func:`prometheus_query`'s
    instant vector (``{"metric": {...}, "value": [t, "v"]}`` items)."""
    builder = ReadingBuilder()
    for item in result:
        labels = dict(item["metric"])
        sample = labels.pop(SAMPLE_LABEL, "")
        builder.sample(sample, labels, float(item["value"][1]))
    return builder.build()


def has_fit(result: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the answer holds any of the fit's sums (the rules may not be loaded)."""
    return any(item["metric"].get(SAMPLE_LABEL) in FIT_SAMPLES for item in result)


_DURATION = re.compile(r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?"
                       r"(?:(\d+)ms)?$")
_UNIT_S = (365 * 86400, 7 * 86400, 86400, 3600, 60, 1, 0.001)


def duration_seconds(text: str) -> float | None:
    """A PromQL duration (``1h``, ``90m``, ``1h30m``, ``2d``) in seconds; None if it is
    not one or is zero."""
    found = _DURATION.match(text.strip())
    if not text.strip() or found is None:
        return None
    seconds = sum(int(n) * unit for n, unit in zip(found.groups(), _UNIT_S, strict=True) if n)
    return seconds if seconds > 0 else None


# -- evidence -------------------------------------------------------------------------


def evidence(now: Reading, before: Reading | None = None, *, route: str | None = None,
             model: str | None = None, upstream: str | None = None) -> list[Evidence]:
    """One :class:`Evidence` per selection measured in the window from ``before`` to
    ``now`` (since start without ``before``), narrowed by the filters given (exact
    values; None or "" is any), the busiest first."""
    window = now.minus(before)
    wanted = (route, model, upstream)
    out = [
        _evidence(key, figs) for key, figs in window.figures.items()
        if figs.measured() and all(not w or w == have for w, have in zip(wanted, key, strict=True))
    ]
    out.sort(key=lambda ev: (-ev.requests, ev.route, ev.model, ev.upstream))
    return out


def stream_total(ttft_sum: float, streams: float, gaps_sum: float) -> float | None:
    """The mean time of the streams that had a first token: the first token, then
    decoding from it to the last output event (the sum of their gaps, ``ITL``); None
    without one. Not the request duration's mean, which also holds the streams answered
    an error, or cut before a first token, and would understate it."""
    return (ttft_sum + gaps_sum) / streams if streams > 0 else None


def _mean(figs: Figures, histogram: str) -> float | None:
    count = figs.get(f"{histogram}_count")
    return figs.get(f"{histogram}_sum") / count if count > 0 else None


def _dist(figs: Figures, histogram: str) -> Dist | None:
    edges = figs.buckets.get(histogram)
    if not edges or math.inf not in edges:
        return None
    return Dist(tuple(sorted(edges.items())), figs.get(f"{histogram}_sum"))


def _missed(figs: Figures, fitted: float, name: str = MISSED) -> float | None:
    if name not in figs.values:
        return None
    examined = (figs.get(f"{MISSED_PER_REQUEST}_count")
                if f"{MISSED_PER_REQUEST}_count" in figs.values else fitted)
    return figs.get(name) / examined if examined > 0 else None


def _evidence(key: Key, figs: Figures) -> Evidence:
    sums = FitSums.from_samples((name, figs.get(name)) for name in FIT_SAMPLES)
    return Evidence(
        route=key[0], model=key[1], upstream=key[2],
        requests=round(figs.get(REQUESTS)),
        fit=fit(sums),
        streams=round(figs.get(f"{TTFT}_count")),
        ttft_mean_s=_mean(figs, TTFT),
        queue_mean_s=_mean(figs, QUEUE),
        upstream_queue_mean_s=_mean(figs, UPSTREAM_QUEUE),
        missed_cache_tokens=_missed(figs, sums.n),
        unmarked_cache_tokens=_missed(figs, sums.n, UNMARKED),
        fit_skipped=round(figs.get(SKIPPED_SAMPLE)),
        fit_estimated=round(figs.get(ESTIMATED)),
        engine_prefill_mean_s=_mean(figs, ENGINE_PREFILL),
        engine_prefill_requests=round(figs.get(f"{ENGINE_PREFILL}_count")),
        duration_mean_s=stream_total(figs.get(f"{TTFT}_sum"), figs.get(f"{TTFT}_count"),
                                     figs.get(f"{ITL}_sum")),
        tpot=_dist(figs, TPOT),
        completion=_dist(figs, COMPLETION),
        finish={k: v for k, v in figs.finish.items() if v > 0},
        no_first_token=round(figs.get(f"{NO_FIRST_TOKEN}_count")),
        no_first_token_wait_s=_mean(figs, NO_FIRST_TOKEN),
    )


def known_values(reading: Reading) -> dict[str, list[str]]:
    """Every route, model and upstream the reading has (for a filter that matched none)."""
    keys = [key for key, figs in reading.figures.items() if figs.measured()]
    return {name: sorted({key[i] for key in keys}) for i, name in enumerate(SELECTORS)}
