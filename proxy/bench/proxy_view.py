"""The proxy's view of a bench run beside the client's: which of the proxy's series are
the run's, and the side-by-side table (client minus proxy)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from . import promscrape
from .stats import align_columns, ms

if TYPE_CHECKING:
    from .client import RequestResult
    from .promscrape import Histogram, ProxyView, Snapshot
    from .stats import Summary


def proxy_filter(snapshot: Snapshot, model: str | None, route: str) -> promscrape.LabelFilter:
    """The route's series; only the bench's model's when the proxy labels it."""
    if model is not None and any(
        dict(labels).get("model") == model
        for name, labels in snapshot
        if name.startswith(promscrape.PREFIX)
    ):
        return promscrape.label_filter(model=model, route=route)
    return promscrape.label_filter(route=route)


def proxy_extra(
    before: Snapshot, after: Snapshot, where: promscrape.LabelFilter
) -> dict[str, Histogram]:
    """TTFB and first-answer histograms over the run, for those the proxy exports at all
    (on any route: a proxy that has them but saw none of the bench's route shows 0)."""
    out = {}
    for label, name in (("TTFB", promscrape.FIRST_BYTE), ("first answer", promscrape.FIRST_ANSWER)):
        if promscrape.histogram(after, name).count > 0:
            out[label] = promscrape.histogram(after, name, where) - promscrape.histogram(
                before, name, where
            )
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
