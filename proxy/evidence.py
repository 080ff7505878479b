"""The evidence the levers read (:class:`proxy.diagnosis.levers.Evidence`), gathered from
wherever the proxy's counters live: a proxy's ``/metrics`` text, the proxy's own registry
(the live page), or a Prometheus server's answers (a fleet).

All three come down to one shape, a :class:`Reading`: per (route, model, upstream), the
samples the diagnosis needs, each summed over every other label (``stream``, ``code``,
``client``, ``outcome``, and whatever a later version adds), keeping only ``le`` for the
two histograms whose buckets are read and ``finish_reason`` for why answers ended. A
reading of a registry or a scrape is cumulative (since each process started); the
difference of two readings (:meth:`Reading.minus`) is a window; a reading of Prometheus
is already a window, built from ``increase()`` over a range. :func:`evidence` turns any
of them into one :class:`Evidence` per selection.

What each figure is read from (means are ``_sum / _count``, exact):

* ``requests``: ``llm_proxy_requests_total`` (every answered request of the selection,
  any status, streamed or not);
* ``streams`` and the mean first token: ``llm_proxy_time_to_first_token_seconds``;
* the prefill fit: the ``llm_proxy_prefill_fit_*`` sums (:mod:`proxy.diagnosis.fit`);
* queue in the proxy, queue the upstream reported: the two queue-time histograms (the
  upstream's is None when it reported none, never 0);
* mean total time: ``llm_proxy_request_duration_seconds`` of streams (``stream="true"``);
* decode rate: the time-per-output-token histogram, buckets and sum;
* output length: the completion-token histogram, buckets and sum;
* why answers ended: ``llm_proxy_finish_reasons_total`` by ``finish_reason``;
* prompt tokens a cache should have served and did not, per request:
  ``llm_proxy_prompt_cache_missed_tokens_total`` over the requests the prompt-cache doctor
  examined (``llm_proxy_prompt_cache_missed_tokens_per_request_count``; the fit's
  requests when that histogram is absent); None when the proxy exports neither (the
  doctor is off, or a version without it);
* streams left out of the fit (no prompt token count at all) and the fit's requests whose
  prompt tokens are the proxy's estimate: ``llm_proxy_prefill_fit_skipped_total`` and
  ``llm_proxy_prefill_fit_estimated_requests_total``, so the card can say why a fit is
  missing and that its tokens were estimated;
* the engine's own prefill time (llama.cpp's timings): the mean of
  ``llm_proxy_upstream_prefill_seconds``.

A selection is listed when the window holds a measured request of it (a first token, an
output-token count or a fitted stream): a route the proxy only relays, or a selection
idle over the window, has nothing to diagnose.

The live page: one :func:`read_registry` per reading of its ring, each reusing the
previous reading's figures for every selection that did not change (an idle selection
then costs a pointer per reading, as the ring's own series do); the card for the last
minute is ``evidence(now, before=reading_a_minute_ago)``, since start ``evidence(now)``.
:class:`ReadingBuilder` lets a caller that already walks ``registry.collect()`` feed the
same loop (``builder.wants(name)`` then ``builder.sample(...)``) instead of collecting
twice. Reading the registry runs nothing per request or per event.

Prometheus: :func:`prometheus_queries` lists the queries (sum by route, model and upstream
of ``increase()`` of each series, so replicas and workers add up and a restart's reset is
handled as PromQL handles it), :func:`prometheus_query` joins them into the one query
sent (one instant, one view of the data), and :func:`reading_from_prometheus` takes its
answer.
The fit's six sums come from the recording rules
(``upstream_model_route:llm_proxy_prefill_fit_*:increase5m`` and ``...:increase1h``)
when the range is one of theirs, so the command shows the numbers Grafana shows;
otherwise, or when those rules are not loaded, from ``increase()`` of the counters.

Nothing here does network I/O: the command (:mod:`proxy.diagnose`) fetches. Parsing
the text format uses prometheus_client's parser through :mod:`proxy.bench.promscrape`,
imported only when text is read, so importing this module pulls in no metric library
(the serving path sets up multiprocess storage before prometheus_client is imported).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.diagnosis.fit import SAMPLES as FIT_SAMPLES
from proxy.diagnosis.fit import SKIPPED_SAMPLE, FitSums, fit
from proxy.diagnosis.levers import Dist, Evidence

Key = tuple[str, str, str]  # route, model, upstream
SELECTORS = ("route", "model", "upstream")

TTFT = "llm_proxy_time_to_first_token_seconds"
QUEUE = "llm_proxy_queue_time_seconds"
UPSTREAM_QUEUE = "llm_proxy_upstream_queue_time_seconds"
DURATION = "llm_proxy_request_duration_seconds"
TPOT = "llm_proxy_time_per_output_token_seconds"
COMPLETION = "llm_proxy_completion_tokens"
MISSED_PER_REQUEST = "llm_proxy_prompt_cache_missed_tokens_per_request"
REQUESTS = "llm_proxy_requests_total"
FINISH = "llm_proxy_finish_reasons_total"
MISSED = "llm_proxy_prompt_cache_missed_tokens_total"
ESTIMATED = "llm_proxy_prefill_fit_estimated_requests_total"
ENGINE_PREFILL = "llm_proxy_upstream_prefill_seconds"

SUMMED = (TTFT, QUEUE, UPSTREAM_QUEUE, DURATION, TPOT, COMPLETION, MISSED_PER_REQUEST,
          ENGINE_PREFILL)
BUCKETED = (TPOT, COMPLETION)  # their buckets are read too
COUNTERS = (REQUESTS, MISSED, SKIPPED_SAMPLE, ESTIMATED, *FIT_SAMPLES)
SAMPLE_NAMES: frozenset[str] = frozenset(
    [*COUNTERS, FINISH]
    + [f"{h}_{part}" for h in SUMMED for part in ("sum", "count")]
    + [f"{h}_bucket" for h in BUCKETED]
)
_BUCKET_OF = {f"{h}_bucket": h for h in BUCKETED}

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
        PromQL's ``increase`` takes it, and so is :meth:`FitSums.minus`."""
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
        return any(self.get(n) > 0 for n in (f"{TTFT}_count", f"{COMPLETION}_count",
                                             f"{TPOT}_count", "llm_proxy_prefill_fit_requests_total"))


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

    @staticmethod
    def wants(name: str) -> bool:
        return name in SAMPLE_NAMES

    def sample(self, name: str, labels: Mapping[str, str], value: float) -> None:
        if name not in SAMPLE_NAMES or not math.isfinite(value):
            return
        if name.startswith(DURATION) and labels.get("stream", "true") != "true":
            return  # the mean total time is of streams, as the first token is
        key = (labels.get("route", ""), labels.get("model", ""), labels.get("upstream", ""))
        figs = self._figures.get(key)
        if figs is None:
            figs = self._figures[key] = Figures()
        histogram = _BUCKET_OF.get(name)
        if histogram is not None:
            le = _edge(labels.get("le", ""))
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
        if previous is None:
            return Reading(dict(self._figures))
        out: dict[Key, Figures] = {}
        for key, figs in self._figures.items():
            old = previous.figures.get(key)
            out[key] = old if old is not None and old == figs else figs
        return Reading(out)


def _edge(text: str) -> float | None:
    try:
        return float(text)  # "+Inf" included
    except ValueError:
        return None


# -- the three sources ------------------------------------------------------------------


class Registry(Protocol):
    """What is read of a prometheus_client registry (this module does not import it)."""

    def collect(self) -> Iterable[Any]: ...


def read_registry(registry: Registry, previous: Reading | None = None) -> Reading:
    """One ``collect()`` of the proxy's own registry (with workers, the multiprocess
    registry that reads every worker's files), cumulative."""
    builder = ReadingBuilder()
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in SAMPLE_NAMES:
                builder.sample(sample.name, sample.labels, float(sample.value))
    return builder.build(previous)


def read_text(text: str) -> Reading:
    """A proxy's ``/metrics`` (the text exposition), cumulative. Malformed lines are
    skipped (:func:`proxy.bench.promscrape.parse`)."""
    from proxy.bench.promscrape import parse

    return read_snapshot(parse(text))


def read_snapshot(snapshot: Mapping[tuple[str, tuple[tuple[str, str], ...]], float]) -> Reading:
    """A parsed exposition (:func:`proxy.bench.promscrape.parse`'s samples), cumulative."""
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
    rules keep, the fit's six sums read the rules' series."""
    by = "route, model, upstream"
    out = []
    for name in sorted(SAMPLE_NAMES):
        extra = where
        if name.startswith(DURATION):
            extra = ",".join(x for x in ('stream="true"', where) if x)
        labels = by + (", le" if name in _BUCKET_OF else "") + (
            ", finish_reason" if name == FINISH else "")
        if fit_from_rules and range_ in RULE_RANGES and name in FIT_SAMPLES:
            out.append(Query(name, _selector(fit_rule(name, range_), where), rule=True))
            continue
        out.append(Query(name, f"sum by ({labels}) (increase({_selector(name, extra)}[{range_}]))"))
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


def evidence_from_registry(registry: Registry, before: Reading | None = None,
                           **filters: str | None) -> list[Evidence]:
    """The live page's one call: the evidence of ``registry`` since start, or since
    ``before`` (a :func:`read_registry` the caller kept)."""
    return evidence(read_registry(registry), before, **filters)


def _mean(figs: Figures, histogram: str) -> float | None:
    count = figs.get(f"{histogram}_count")
    return figs.get(f"{histogram}_sum") / count if count > 0 else None


def _dist(figs: Figures, histogram: str) -> Dist | None:
    edges = figs.buckets.get(histogram)
    if not edges or math.inf not in edges:
        return None
    return Dist(tuple(sorted(edges.items())), figs.get(f"{histogram}_sum"))


def _missed(figs: Figures, fitted: float) -> float | None:
    if MISSED not in figs.values:
        return None
    examined = (figs.get(f"{MISSED_PER_REQUEST}_count")
                if f"{MISSED_PER_REQUEST}_count" in figs.values else fitted)
    return figs.get(MISSED) / examined if examined > 0 else None


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
        fit_skipped=round(figs.get(SKIPPED_SAMPLE)),
        fit_estimated=round(figs.get(ESTIMATED)),
        engine_prefill_mean_s=_mean(figs, ENGINE_PREFILL),
        engine_prefill_requests=round(figs.get(f"{ENGINE_PREFILL}_count")),
        duration_mean_s=_mean(figs, DURATION),
        tpot=_dist(figs, TPOT),
        completion=_dist(figs, COMPLETION),
        finish={k: v for k, v in figs.finish.items() if v > 0},
    )


def known_values(reading: Reading) -> dict[str, list[str]]:
    """Every route, model and upstream the reading has (for a filter that matched none)."""
    found: list[set[str]] = [set(), set(), set()]
    for key, figs in reading.figures.items():
        if figs.measured():
            for i, value in enumerate(key):
                found[i].add(value)
    return {name: sorted(values) for name, values in zip(SELECTORS, found, strict=True)}
