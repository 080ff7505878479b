"""The proxy's view of a run, read from its ``/metrics`` before and after, and set
beside the client's (client minus proxy).

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proxy.buckets import histogram_quantile

from .stats import align_columns, ms

if TYPE_CHECKING:
    from .client import RequestResult
    from .stats import Summary

Labels = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, Labels]
Snapshot = dict[SeriesKey, float]

PREFIX = "llm_proxy_"
TTFT = "llm_proxy_time_to_first_token_seconds"
FIRST_ANSWER = "llm_proxy_time_to_first_answer_token_seconds"
FIRST_BYTE = "llm_proxy_time_to_first_byte_seconds"
ITL = "llm_proxy_inter_token_latency_seconds"
TPOT = "llm_proxy_time_per_output_token_seconds"
QUEUE = "llm_proxy_queue_time_seconds"
UPSTREAM_QUEUE = "llm_proxy_upstream_queue_time_seconds"
DURATION = "llm_proxy_request_duration_seconds"
PROMPT_TOKENS = "llm_proxy_prompt_tokens"
CACHED_TOKENS = "llm_proxy_cached_prompt_tokens"
COMPLETION_TOKENS = "llm_proxy_completion_tokens"
REQUESTS = "llm_proxy_requests_total"
OUTCOMES = "llm_proxy_stream_outcomes_total"
IN_FLIGHT = "llm_proxy_in_flight_requests"

# What prometheus_client's parser raises on a line it cannot read.
_MALFORMED = (ValueError, IndexError)


def _samples(text: str) -> Snapshot:
    out: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def _readable(line: str) -> bool:
    try:
        for _ in text_string_to_metric_families(line):
            pass
    except _MALFORMED:
        return False
    return True


def parse(text: str) -> Snapshot:
    """Samples of a text exposition as ``{(name, sorted labels): value}``.

    Malformed lines are skipped rather than fatal: a scrape is a side view, and one
    odd line must not stop a benchmark. The parser stops at the first bad line, so
    only then is the text read a second time, without the lines it cannot read alone.
    """
    try:
        return _samples(text)
    except _MALFORMED:
        return _samples("\n".join(line for line in text.splitlines() if _readable(line)))


LabelFilter = Callable[[Mapping[str, str]], bool]


def label_filter(**wanted: str) -> LabelFilter:
    def match(labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in wanted.items())

    return match


_any = label_filter()


def total(snapshot: Snapshot, name: str, where: LabelFilter = _any) -> float:
    return math.fsum(v for (n, labels), v in snapshot.items() if n == name and where(dict(labels)))


def by_label(
    snapshot: Snapshot, name: str, label: str, where: LabelFilter = _any
) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in snapshot.items():
        if n != name:
            continue
        mapping = dict(labels)
        if where(mapping) and label in mapping:
            out[mapping[label]] = out.get(mapping[label], 0.0) + v
    return out


@dataclass(frozen=True, slots=True)
class Histogram:
    """One histogram summed over series: cumulative counts per upper edge, sum, count."""

    buckets: tuple[tuple[float, float], ...]  # (le, cumulative count), ascending, +Inf last
    sum: float
    count: float

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count > 0 else math.nan

    def __sub__(self, before: Histogram) -> Histogram:
        earlier = dict(before.buckets)
        return Histogram(
            tuple((le, c - earlier.get(le, 0.0)) for le, c in self.buckets),
            self.sum - before.sum,
            self.count - before.count,
        )

    def quantile(self, q: float) -> float:
        return histogram_quantile(q, self.buckets)


def histogram(snapshot: Snapshot, name: str, where: LabelFilter = _any) -> Histogram:
    """Sum the ``name`` histogram's series that pass ``where`` (``le`` is ignored there)."""
    buckets: dict[float, float] = {}
    for (n, labels), v in snapshot.items():
        if n != name + "_bucket":
            continue
        mapping = dict(labels)
        le = mapping.pop("le", None)
        if le is None or not where(mapping):
            continue
        try:
            edge = float(le)  # "+Inf" included
        except ValueError:
            continue
        buckets[edge] = buckets.get(edge, 0.0) + v
    return Histogram(
        tuple(sorted(buckets.items())),
        total(snapshot, name + "_sum", where),
        total(snapshot, name + "_count", where),
    )


async def scrape(
    client: httpx.AsyncClient, url: str, headers: tuple[tuple[str, str], ...] = ()
) -> Snapshot:
    """GET ``url`` and parse it; raises ``httpx.HTTPError`` on transport or HTTP errors.
    ``headers``: a client key, for a proxy that checks them (its main port's ``/metrics``
    then takes one)."""
    response = await client.get(url, headers=[("Accept", "text/plain"), *headers])
    response.raise_for_status()
    return parse(response.text)


def has_proxy_metrics(snapshot: Snapshot) -> bool:
    return any(name.startswith(PREFIX) for name, _ in snapshot)


def metrics_url_for(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port/metrics`` (the proxy's default place)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + "/metrics"


@dataclass(frozen=True, slots=True)
class ProxyView:
    """What the proxy measured between two scrapes."""

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    queue: Histogram
    requests: float
    outcomes: dict[str, float]

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot, where: LabelFilter = _any) -> ProxyView:
        outcomes_after = by_label(after, OUTCOMES, "outcome", where)
        outcomes_before = by_label(before, OUTCOMES, "outcome", where)
        return cls(
            ttft=histogram(after, TTFT, where) - histogram(before, TTFT, where),
            itl=histogram(after, ITL, where) - histogram(before, ITL, where),
            tpot=histogram(after, TPOT, where) - histogram(before, TPOT, where),
            queue=histogram(after, QUEUE, where) - histogram(before, QUEUE, where),
            requests=total(after, REQUESTS, where) - total(before, REQUESTS, where),
            outcomes={
                k: v - outcomes_before.get(k, 0.0)
                for k, v in outcomes_after.items()
                if v - outcomes_before.get(k, 0.0)
            },
        )


def proxy_filter(snapshot: Snapshot, model: str | None, route: str) -> LabelFilter:
    """The route's series; only the bench's model's when the proxy labels it."""
    if model is not None and any(
        dict(labels).get("model") == model for name, labels in snapshot if name.startswith(PREFIX)
    ):
        return label_filter(model=model, route=route)
    return label_filter(route=route)


def proxy_extra(before: Snapshot, after: Snapshot, where: LabelFilter) -> dict[str, Histogram]:
    """TTFB and first-answer histograms over the run, for those the proxy exports at all
    (on any route: a proxy that has them but saw none of the bench's route shows 0)."""
    out = {}
    for label, name in (("TTFB", FIRST_BYTE), ("first answer", FIRST_ANSWER)):
        if histogram(after, name).count > 0:
            out[label] = histogram(after, name, where) - histogram(before, name, where)
    return out


def format_comparison(
    summary: Summary,
    results: tuple[RequestResult, ...],
    view: ProxyView,
    extra: dict[str, Histogram] | None = None,
    route: str = "/v1/chat/completions",
) -> str:
    """Client and proxy side by side; the difference is client minus proxy, and a figure
    the proxy has no observation of shows as ``-`` (``extra``: its TTFB and first-answer
    histograms, when it exports them).
    """
    extra = extra or {}
    timed = view.ttft.count > 0 or view.itl.count > 0
    rows: list[tuple[str, str, str, str]] = [("", "client", "proxy", "diff")]

    def add(name: str, client: float, proxy: float, unit: str = "ms") -> None:
        if unit == "ms":
            diff = client - proxy if not (math.isnan(client) or math.isnan(proxy)) else math.nan
            rows.append((f"{name} {unit}", ms(client), ms(proxy), ms(diff)))
        else:
            rows.append((name, f"{client:g}", f"{proxy:g}", f"{client - proxy:+g}"))

    compared = [("TTFT", summary.ttft, view.ttft)]
    if "TTFB" in extra:
        compared.insert(0, ("TTFB", summary.ttfb, extra["TTFB"]))
    if "first answer" in extra:
        compared.append(("first answer", summary.first_answer, extra["first answer"]))
    compared += [("ITL", summary.itl, view.itl), ("TPOT", summary.tpot, view.tpot)]
    for label, dist, hist in compared if timed else ():
        add(f"{label} mean", dist.mean, hist.mean)
        for q, value in ((0.5, dist.p50), (0.9, dist.p90), (0.99, dist.p99)):
            add(f"{label} p{round(q * 100)}", value, hist.quantile(q))
        add(f"{label} count", float(dist.count), hist.count, unit="")
    sent = float(len(results))
    add("requests", sent, view.requests, unit="")
    lines = align_columns(rows)
    if view.requests == 0 and not timed:
        lines.append(
            f"the proxy has no figures for {route}: it does not measure this route "
            "(yet), or none of these requests went through it"
        )
    elif not timed:
        lines.append(
            f"the proxy counted the {route} requests but has no token timings for them: "
            "it does not measure this route (yet)"
        )
    if view.outcomes:
        lines.append(
            "proxy outcomes: " + ", ".join(f"{k} {v:g}" for k, v in sorted(view.outcomes.items()))
        )
    if view.queue.sum > 0:  # all zeros without --max-concurrency: nothing to say
        lines.append(
            f"proxy queue time: mean {ms(view.queue.mean)} ms, p99 {ms(view.queue.quantile(0.99))} ms"
        )
    lines.append(
        "(proxy percentiles are interpolated within histogram buckets; means and counts are exact)"
    )
    return "\n".join(lines)
