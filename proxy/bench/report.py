"""``bench --report FILE``: one run as a self-contained HTML page to look at, not read.

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

from proxy.bench.replay import comparison_rows, notes
from proxy.bench.stats import (
    FAST_DECODE_TOK_S,
    READING_PACE_TOK_S,
    summary_from_json,
    summary_lines,
    table_rows,
)
from proxy.ui.page import inline, script_json

MAX_POINTS = 400
DECODE_BINS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)  # tok/s upper edges
_SETTINGS = (
    "base_url",
    "api",
    "model",
    "requests",
    "duration",
    "concurrency",
    "rate",
    "prompt_tokens",
    "prompt_tokens_max",
    "shared_prefix_tokens",
    "max_tokens",
    "reasoning",
    "seed",
    "timeout",
    "workload_file",
    "speedup",
    "ignore_eos",
    "block_size",
    "simulate",
)


def cdf_points(values: Iterable[float]) -> list[tuple[float, float]]:
    """``(value, share of values <= it)``, at most ``MAX_POINTS`` of them."""
    data = sorted(values)
    n = len(data)
    if n <= MAX_POINTS:
        picks: Sequence[int] = range(n)
    else:
        picks = sorted({round(k * (n - 1) / (MAX_POINTS - 1)) for k in range(MAX_POINTS)})
    return [(data[i], (i + 1) / n) for i in picks]


def proxy_cdf(hist: dict[str, Any] | None) -> list[tuple[float, float]]:
    """The proxy's cumulative bucket shares at its finite edges, over the run, from the
    last edge below every observation to the first edge above them all (the empty
    buckets on either side would only stretch the axis)."""
    if not hist or not hist.get("count") or not hist.get("buckets"):
        return []
    count = hist["count"]
    points = [(le, cum / count) for le, cum in hist["buckets"]]
    first = max((i for i, (_, share) in enumerate(points) if share == 0.0), default=0)
    last = next((i for i, (_, share) in enumerate(points) if share >= 1.0), len(points) - 1)
    return points[first : last + 1]


def agreement(client: Sequence[float], proxy: list[tuple[float, float]]) -> dict[str, Any] | None:
    """Where the client's CDF and the proxy's bucket shares differ most, at a bucket edge
    where either has observations on both sides."""
    if not client or not proxy:
        return None
    data = sorted(client)
    worst: tuple[float, float, float, float] | None = None
    for le, proxy_share in proxy:
        client_share = bisect_right(data, le) / len(data)
        if client_share in (0.0, 1.0) and proxy_share in (0.0, 1.0) and client_share == proxy_share:
            continue
        gap = client_share - proxy_share
        if worst is None or abs(gap) > abs(worst[0]):
            worst = (gap, le, client_share, proxy_share)
    if worst is None:
        return {"gap": 0.0, "at": None, "client": None, "proxy": None}
    gap, le, client_share, proxy_share = worst
    return {"gap": gap, "at": le, "client": client_share, "proxy": proxy_share}


def same_read_share(gaps: Sequence[float]) -> float:
    """The share of the client's ITL gaps that are 0: events that arrived in one read,
    which the client times once (it reads the clock once per read). A log axis cannot
    place 0, so the page says how many there are under the chart."""
    return sum(1 for g in gaps if g <= 0.0) / len(gaps) if gaps else 0.0


def fit(points: Sequence[tuple[float, float]]) -> dict[str, float] | None:
    """Least-squares line ``y = a + b x``; None with fewer than two distinct x."""
    n = len(points)
    if n < 2:
        return None
    mx = math.fsum(x for x, _ in points) / n
    my = math.fsum(y for _, y in points) / n
    sxx = math.fsum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0:
        return None
    slope = math.fsum((x - mx) * (y - my) for x, y in points) / sxx
    return {
        "intercept": my - slope * mx,
        "slope": slope,
        "x0": min(x for x, _ in points),
        "x1": max(x for x, _ in points),
    }


def prefill(requests: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TTFT against prompt tokens, split by the share the prefix cache served."""
    groups: dict[str, list[tuple[float, float]]] = {"uncached": [], "cached": []}
    for r in requests:
        prompt, ttft = r.get("prompt_tokens"), r.get("ttft_s")
        if r.get("outcome") != "completed" or not prompt or ttft is None:
            continue
        cached = (r.get("cached_prompt_tokens") or 0) / prompt
        groups["cached" if cached >= 0.5 else "uncached"].append((float(prompt), float(ttft)))
    return {name: {"points": pts, "fit": fit(pts)} for name, pts in groups.items()}


def decode_rates(requests: Sequence[dict[str, Any]]) -> list[int]:
    """Completed requests per decode-rate bin (``DECODE_BINS`` upper edges, then more)."""
    counts = [0] * (len(DECODE_BINS) + 1)
    for r in requests:
        rate = r.get("decode_rate_tok_s")
        if r.get("outcome") == "completed" and rate is not None:
            counts[bisect_right(DECODE_BINS, rate - 1e-12)] += 1
    return counts


def cdf(client: Sequence[float], hist: dict[str, Any] | None) -> dict[str, Any]:
    """The client's CDF, the proxy's bucket shares, and where they differ most."""
    proxy = proxy_cdf(hist)
    return {"client": cdf_points(client), "proxy": proxy, "agreement": agreement(client, proxy)}


def run_view(payload: dict[str, Any], name: str) -> dict[str, Any]:
    """What the page draws of one run."""
    done = [r for r in payload.get("requests", []) if r.get("outcome") == "completed"]
    ttft = [r["ttft_s"] for r in done if r.get("ttft_s") is not None]
    itl = [gap for r in done for gap in r.get("itl_s") or ()]
    proxy = payload.get("proxy") or {}
    summary = summary_from_json(payload["summary"])
    config = payload.get("config", {})
    cmp = payload.get("replay")
    return {
        "name": name,
        "table": table_rows(summary),
        "lines": summary_lines(summary),
        "settings": {k: config[k] for k in _SETTINGS if config.get(k) is not None},
        "cdf": {
            "ttft": cdf(ttft, proxy.get("ttft")),
            "itl": {**cdf(itl, proxy.get("itl")), "same_read": same_read_share(itl)},
        },
        "proxy": {
            k: {q: proxy[k].get(q) for q in ("count", "p50", "p90", "p99", "mean")}
            for k in ("ttft", "itl")
            if k in proxy
        },
        "prefill": prefill(done),
        "decode": decode_rates(done),
        "errors": summary.error_kinds,
        "outcomes": proxy.get("outcomes") or {},
        "requests": summary.requests,
        "replay": (
            {"headline": cmp["headline"], "rows": comparison_rows(cmp), "notes": notes(cmp)}
            if cmp
            else None  # a run of another workload than a workload file's
        ),
    }


def build(
    payload: dict[str, Any], other: dict[str, Any] | None = None, other_name: str = "other run"
) -> str:
    """The report's HTML: ``payload`` (a bench ``--json`` dictionary), and ``other``
    drawn beside it."""
    runs = [run_view(payload, "this run")]
    if other is not None:
        runs.append(run_view(other, other_name))
    data = {
        "runs": runs,
        "decode_bins": list(DECODE_BINS),
        "reading_pace": READING_PACE_TOK_S,
        "fast": FAST_DECODE_TOK_S,
    }
    page, _ = inline(
        "report.html",
        "llm-latency-proxy · bench report",
        css=["ui.css"],
        js=["charts.js", "report.js"],
        data=script_json(data),
        meta_csp=True,
    )
    return page
