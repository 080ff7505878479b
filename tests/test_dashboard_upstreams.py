"""The "compare upstreams" and "clients" panels, and the rules' upstream and client
labels, against a real Prometheus: right values per upstream and per client, not just
data.

A real Prometheus (Debian's ``prometheus``) loads the shipped recording and alert rules
and scrapes, every second, a target that serves known series in the proxy's metric
names, labels and bucket edges: model ``m`` on two upstreams, ``fast`` and ``slow``,
called by clients ``alice``, ``bob`` (both upstreams) and ``carol`` (``slow`` only);
model ``n`` on ``fast`` only; and upstream ``legacy`` whose series have no ``client``
label, as a proxy without client labelling exports them. Every counter and bucket
grows at its own fixed rate from zero, so within one scrape all series share the
timestamp and every rate Prometheus computes is the same multiple of the series' own
rate: ratios and percentiles come out exactly as worked out here from the rates
(``histogram_quantile`` redone in Python below, and a few values by hand in comments).

Then each panel query of the two rows (Grafana macros substituted) must return, per
upstream and model or per client, those values: with *All* selected, and with one
client picked (client metrics narrow, queue time does not). The client-level TTFT
recording rules must carry the client label (absent for ``legacy``), and the TTFT
alerts, pending in Prometheus itself, must name the slow upstream and each of its
clients, never the fast one, with the client in their text only when labelled.

The "Prompt caching" row likewise: the doctor's counters (no client label) and the
prompt and cached tokens (with one) of each upstream and model, and prefill-fit sums of
a known line, give each panel's values; LLMProxyPromptCacheMissed, pending, names the
one upstream and model above its threshold.

Skipped without a ``prometheus`` binary, except in CI (``CI=true``). Waiting is on
Prometheus's own API (bounded polls), never on a fixed sleep.
"""

from __future__ import annotations

import bisect
import math
import re
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from proxy.config import ITL_BUCKETS, QUEUE_BUCKETS, TTFT_BUCKETS
from tests.servers import serve_in_thread
from tests.test_observability import (
    ALERT_RULES,
    ALL,
    RECORDING_RULES,
    load_dashboard,
    require_tool,
    substitute_macros,
)
from tests.test_prometheus_integration import background, free_port, poll

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.anyio]

CHAT = "/v1/chat/completions"
TTFT = "llm_proxy_time_to_first_token_seconds"
TTFA = "llm_proxy_time_to_first_answer_token_seconds"
ITL = "llm_proxy_inter_token_latency_seconds"
QUEUE = "llm_proxy_queue_time_seconds"
REQUESTS = "llm_proxy_requests_total"
EDGES = {TTFT: TTFT_BUCKETS, TTFA: TTFT_BUCKETS, ITL: ITL_BUCKETS, QUEUE: QUEUE_BUCKETS}
COMPARE_ROW, CLIENTS_ROW, PROMPT_ROW = "Compare upstreams", "Clients", "Prompt caching"

Labels = dict[str, str]


@dataclass(frozen=True)
class Hist:
    """A histogram series: observations per second, by the bucket edge they fall under."""

    metric: str
    labels: tuple[tuple[str, str], ...]
    per_second: tuple[tuple[float, float], ...]  # (upper edge, observations per second)

    def cumulative(self) -> list[tuple[float, float]]:
        edges = [*EDGES[self.metric], math.inf]
        counts = [0.0] * len(edges)
        for edge, n in self.per_second:
            counts[edges.index(edge)] += n
        total = 0.0
        out = []
        for edge, n in zip(edges, counts, strict=True):
            total += n
            out.append((edge, total))
        return out


def L(upstream: str, model: str = "m", client: str | None = None) -> tuple[tuple[str, str], ...]:
    labels = {"route": CHAT, "model": model, "upstream": upstream}
    if client is not None:
        labels["client"] = client
    return tuple(sorted(labels.items()))


FAST_M = ((0.1, 80.0), (0.15, 20.0))  # p50 = 0.075 + 0.025 * 50/80 = 0.090625; p95 = 0.1375
BOB_FAST_M = ((0.2, 100.0),)  # all in (0.15, 0.2]
SLOW_M = ((1.0, 50.0), (3.0, 50.0))  # p50 = 0.8 + 0.2 * 50/50 = 1.0; p95 = 2 + 45/50 = 2.9
FAST_N = ((2.0, 100.0),)  # model n: p95 = 1.5 + 0.5 * 0.95 = 1.975 (kept apart from m)
LEGACY = ((5.0, 100.0),)  # p95 = 3 + 2 * 0.95 = 4.9

HISTOGRAMS = [
    Hist(TTFT, L("fast", client="alice"), FAST_M),
    Hist(TTFT, L("fast", client="bob"), BOB_FAST_M),
    Hist(TTFT, L("slow", client="alice"), SLOW_M),
    Hist(TTFT, L("slow", client="bob"), SLOW_M),
    Hist(TTFT, L("slow", client="carol"), tuple((e, 2 * n) for e, n in SLOW_M)),
    Hist(TTFT, L("fast", "n", client="alice"), FAST_N),
    Hist(TTFT, L("legacy"), LEGACY),
    # First answer token: fast p95 = 0.2 + 0.1 * 0.95 = 0.295, slow 3 + 2 * 0.95 = 4.9.
    Hist(TTFA, L("fast", client="alice"), ((0.3, 100.0),)),
    Hist(TTFA, L("fast", client="bob"), ((0.3, 100.0),)),
    Hist(TTFA, L("slow", client="alice"), ((5.0, 100.0),)),
    Hist(TTFA, L("slow", client="bob"), ((5.0, 100.0),)),
    Hist(TTFA, L("slow", client="carol"), ((5.0, 200.0),)),
    Hist(TTFA, L("fast", "n", client="alice"), ((2.0, 100.0),)),
    Hist(TTFA, L("legacy"), LEGACY),
    # ITL: fast p95 = 0.01 + 0.005 * 0.95 = 0.01475, slow 0.04 + 0.01 * 0.95 = 0.0495.
    Hist(ITL, L("fast", client="alice"), ((0.015, 1000.0),)),
    Hist(ITL, L("fast", client="bob"), ((0.015, 1000.0),)),
    Hist(ITL, L("slow", client="alice"), ((0.05, 500.0),)),
    Hist(ITL, L("slow", client="bob"), ((0.05, 500.0),)),
    Hist(ITL, L("slow", client="carol"), ((0.05, 1000.0),)),
    Hist(ITL, L("fast", "n", client="alice"), ((0.015, 1000.0),)),
    Hist(ITL, L("legacy"), ((0.05, 100.0),)),
    # Queue time carries no client label: fast never waits; on slow 40 % wait, p95 =
    # 0.5 + 0.5 * (95 - 60) / 40 = 0.9375.
    Hist(QUEUE, L("fast"), ((0.0005, 200.0),)),
    Hist(QUEUE, L("slow"), ((0.0005, 240.0), (1.0, 160.0))),
    Hist(QUEUE, L("fast", "n"), ((0.0005, 100.0),)),
    Hist(QUEUE, L("legacy"), ((0.0005, 100.0),)),
]
# Requests per second by client and code: 10 % of slow's answers are 503s.
COUNTERS = [
    ({**dict(L("fast", client="alice")), "stream": "true", "code": "200"}, 100.0),
    ({**dict(L("fast", client="bob")), "stream": "true", "code": "200"}, 100.0),
    ({**dict(L("slow", client="alice")), "stream": "true", "code": "200"}, 90.0),
    ({**dict(L("slow", client="alice")), "stream": "true", "code": "503"}, 10.0),
    ({**dict(L("slow", client="bob")), "stream": "true", "code": "200"}, 90.0),
    ({**dict(L("slow", client="bob")), "stream": "true", "code": "503"}, 10.0),
    ({**dict(L("slow", client="carol")), "stream": "true", "code": "200"}, 180.0),
    ({**dict(L("slow", client="carol")), "stream": "true", "code": "503"}, 20.0),
    ({**dict(L("fast", "n", client="alice")), "stream": "true", "code": "200"}, 100.0),
    ({**dict(L("legacy")), "stream": "true", "code": "200"}, 100.0),
]


# The prompt-cache doctor's counters and the series beside them, per second. Prompt and
# cached tokens carry the client label as the proxy exports them; the doctor's counters
# (repeated, missed, examined requests, breaks) have none.
@dataclass(frozen=True)
class Doctor:
    prompt: dict[str | None, float]  # by client
    cached: dict[str | None, float]  # by client
    repeated: float
    missed: float
    examined: float  # requests


PROMPT_CACHE = {
    ("fast", "m"): Doctor({"alice": 600.0, "bob": 400.0}, {"alice": 300.0, "bob": 200.0},
                          700.0, 150.0, 2.0),  # missed share 15 %: under the alert's 20 %
    ("slow", "m"): Doctor({"alice": 1000.0, "bob": 500.0, "carol": 500.0},
                          {"alice": 100.0, "bob": 100.0, "carol": 0.0},
                          1400.0, 1000.0, 4.0),  # 50 %: the alert is pending
    ("fast", "n"): Doctor({"alice": 500.0}, {"alice": 0.0}, 0.0, 0.0, 1.0),
    ("legacy", "m"): Doctor({None: 100.0}, {None: 50.0}, 60.0, 10.0, 0.5),  # 10 %
}
BREAKS = {  # (upstream, model, reason, part): breaks per second
    ("fast", "m", "variable_before_stable", "system"): 0.5,
    ("fast", "m", "first_seen", "none"): 0.125,
    ("slow", "m", "system_changed", "system"): 1.0,
    ("fast", "n", "first_seen", "none"): 0.25,
}
# The prefill fit's sums per second: two requests, x = 1 and 3 thousand uncached tokens,
# y = fixed + slope * x; slope 0.1 s per 1,000 tokens on fast, 0.4 on slow (legacy has
# no fit: the cost panel has no line for it).
FIT_LINES = {("fast", "m"): (0.02, 0.1), ("slow", "m"): (0.5, 0.4), ("fast", "n"): (0.02, 0.1)}


def fit_sums(fixed: float, slope: float) -> dict[str, float]:
    points = [(x, fixed + slope * x) for x in (1.0, 3.0)]
    return {
        "requests": len(points),
        "uncached_ktokens": sum(x for x, _ in points),
        "first_token_seconds": sum(y for _, y in points),
        "xy": sum(x * y for x, y in points),
        "xx": sum(x * x for x, _ in points),
        "yy": sum(y * y for _, y in points),
    }


class Known:
    """A collector whose every counter is its rate times the seconds since start."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def collect(self) -> Iterator[Metric]:
        elapsed = time.monotonic() - self.start  # one clock reading per scrape
        for metric in (TTFT, TTFA, ITL, QUEUE):
            family = Metric(metric, "known series", "histogram")
            for h in (h for h in HISTOGRAMS if h.metric == metric):
                labels = dict(h.labels)
                total = 0.0
                for edge, cumulative in h.cumulative():
                    le = floatToGoString(edge)
                    family.add_sample(
                        f"{metric}_bucket", {**labels, "le": le}, cumulative * elapsed
                    )
                    total = cumulative
                family.add_sample(f"{metric}_count", labels, total * elapsed)
                family.add_sample(f"{metric}_sum", labels, total * elapsed)  # unused
            yield family
        requests = Metric("llm_proxy_requests", "known series", "counter")
        for labels, per_second in COUNTERS:
            requests.add_sample(REQUESTS, labels, per_second * elapsed)
        yield requests
        yield from self.prompt_cache(elapsed)

    @staticmethod
    def prompt_cache(elapsed: float) -> Iterator[Metric]:
        def labels(upstream: str, model: str, client: str | None = None) -> dict[str, str]:
            return dict(L(upstream, model, client))

        for name, field in (("llm_proxy_prompt_tokens", "prompt"),
                            ("llm_proxy_cached_prompt_tokens", "cached")):
            family = Metric(name, "known series", "histogram")
            for (upstream, model), figures in PROMPT_CACHE.items():
                by_client: dict[str | None, float] = getattr(figures, field)
                for client, per_second in by_client.items():
                    family.add_sample(f"{name}_sum", labels(upstream, model, client),
                                      per_second * elapsed)
                    family.add_sample(f"{name}_count", labels(upstream, model, client), elapsed)
            yield family
        for name, field in (("llm_proxy_prompt_repeated_tokens", "repeated"),
                            ("llm_proxy_prompt_cache_missed_tokens", "missed")):
            family = Metric(name, "known series", "counter")
            for (upstream, model), figures in PROMPT_CACHE.items():
                family.add_sample(f"{name}_total", labels(upstream, model),
                                  getattr(figures, field) * elapsed)
            yield family
        name = "llm_proxy_prompt_cache_missed_tokens_per_request"
        family = Metric(name, "known series", "histogram")
        for (upstream, model), figures in PROMPT_CACHE.items():
            family.add_sample(f"{name}_count", labels(upstream, model), figures.examined * elapsed)
        yield family
        family = Metric("llm_proxy_prompt_prefix_breaks", "known series", "counter")
        for (upstream, model, reason, part), per_second in BREAKS.items():
            family.add_sample("llm_proxy_prompt_prefix_breaks_total",
                              {**labels(upstream, model), "reason": reason, "part": part},
                              per_second * elapsed)
        yield family
        for field in ("requests", "uncached_ktokens", "first_token_seconds", "xy", "xx", "yy"):
            family = Metric(f"llm_proxy_prefill_fit_{field}", "known series", "counter")
            for (upstream, model), line in FIT_LINES.items():
                family.add_sample(f"llm_proxy_prefill_fit_{field}_total", labels(upstream, model),
                                  fit_sums(*line)[field] * elapsed)
            yield family


def metrics_app(registry: CollectorRegistry) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()  # startup
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = generate_latest(registry)
        headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


# ---------------------------------------------------------------------------
# What the queries should give, from the rates above


def quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over (upper edge, cumulative count) pairs."""
    total = cumulative[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    counts = [c for _, c in cumulative[:-1]]
    b = bisect.bisect_left(counts, rank)
    if b == len(cumulative) - 1:
        return cumulative[-2][0]
    start = 0.0 if b == 0 else cumulative[b - 1][0]
    below = 0.0 if b == 0 else cumulative[b - 1][1]
    end, count = cumulative[b]
    return start + (end - start) * (rank - below) / (count - below)


def picked(labels: Labels, pick: Labels) -> bool:
    """Whether a series matches ``pick``: label -> regular expression, matched in full as
    Prometheus does (a missing label matches only what matches "")."""
    return all(re.fullmatch(v, labels.get(k, "")) for k, v in pick.items())


def summed(
    metric: str, by: tuple[str, ...], pick: Labels
) -> dict[tuple[str, ...], list[tuple[float, float]]]:
    """Cumulative buckets of ``metric`` summed by ``by`` over the series ``pick`` selects."""
    out: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    for h in HISTOGRAMS:
        labels = dict(h.labels)
        if h.metric != metric or not picked(labels, pick):
            continue
        key = tuple(labels.get(k, "") for k in by)
        cum = h.cumulative()
        if key in out:
            cum = [(e, a + b) for (e, a), (_, b) in zip(out[key], cum, strict=True)]
        out[key] = cum
    return out


def expected_quantiles(
    metric: str, q: float, by: tuple[str, ...], pick: Labels
) -> dict[tuple[str, ...], float]:
    return {k: quantile(q, cum) for k, cum in summed(metric, by, pick).items()}


def requests_by(
    by: tuple[str, ...], pick: Labels, code: str | None = None
) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for labels, per_second in COUNTERS:
        if not picked(labels, pick):
            continue
        if code is not None and not labels["code"].startswith(code):
            continue
        key = tuple(labels.get(k, "") for k in by)
        out[key] = out.get(key, 0.0) + per_second
    return out


# ---------------------------------------------------------------------------
# Prometheus


class Prom:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.at: float | None = None

    async def series(self, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
        params: dict[str, Any] = {"query": expr}
        if self.at is not None:
            params["time"] = self.at
        response = await self.client.get("/api/v1/query", params=params)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (body, expr)
        assert body["data"]["resultType"] == "vector", expr
        return {
            tuple(sorted(item["metric"].items())): float(item["value"][1])
            for item in body["data"]["result"]
        }


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # module-wide, so that one Prometheus serves every test here


@pytest.fixture(scope="module")
async def prom(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Prom]:
    prometheus = require_tool("prometheus")
    tmp_path = tmp_path_factory.mktemp("prometheus")
    registry = CollectorRegistry()
    registry.register(Known())
    with serve_in_thread(metrics_app(registry)) as target:
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(RECORDING_RULES), str(ALERT_RULES)],
            "scrape_configs": [
                {
                    "job_name": "llm-latency-proxy",
                    "static_configs": [{"targets": [f"127.0.0.1:{target.port}"]}],
                }
            ],
        }
        config_path = tmp_path / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        log = tmp_path / "prometheus.log"
        argv = [
            prometheus,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ]
        with background(argv, log) as proc:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as pc:
                api = Prom(pc)

                async def ready() -> bool:
                    assert proc.poll() is None, log.read_text()
                    try:
                        return (await pc.get("/-/ready")).status_code == 200
                    except httpx.TransportError:
                        return False

                await poll("Prometheus to be ready", ready, log)

                async def enough_data() -> bool:
                    # Three scrapes in the window, and the rules evaluated over them.
                    got = await api.series(f"count_over_time({REQUESTS}[1m])")
                    recorded = await api.series(
                        "upstream_model_route_client:llm_proxy_ttft_slo_errors:ratio_rate5m"
                    )
                    return bool(got) and min(got.values()) >= 3 and len(recorded) == 7

                await poll("three scrapes and the recording rules", enough_data, log)
                api.at = time.time()
                yield api


# ---------------------------------------------------------------------------
# The panels


def panels_of(row: str) -> list[dict[str, Any]]:
    panels = load_dashboard()["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == row)
    out = []
    for panel in panels[start + 1 :]:
        if panel["type"] == "row":
            break
        out.append(panel)
    assert out, row
    return out


def queries(panel: dict[str, Any], variables: Labels) -> Iterable[tuple[str, str, str]]:
    """(refId, column or legend, PromQL) of each target."""
    for target in panel["targets"]:
        yield target["refId"], target["legendFormat"], substitute_macros(target["expr"], variables)


def by_keys(
    result: dict[tuple[tuple[str, str], ...], float], keys: tuple[str, ...]
) -> dict[tuple[str, ...], float]:
    out = {}
    for labels, value in result.items():
        d = dict(labels)
        d.pop("__name__", None)
        assert set(d) <= set(keys), (d, keys)  # no label beyond the ones grouped by
        out[tuple(d.get(k, "") for k in keys)] = value
    return out


def approx(values: dict[Any, float]) -> Any:
    return pytest.approx(values, rel=1e-6, abs=1e-9, nan_ok=True)


def compare_expectations(pick: Labels) -> dict[str, dict[tuple[str, ...], float]]:
    """Per column of the side-by-side table (and per panel below it): (upstream, model)
    -> value, for the series ``pick`` selects (client picks narrow client metrics only)."""
    um = ("upstream", "model")
    queue_pick = {k: v for k, v in pick.items() if k != "client"}
    errors = requests_by(um, pick, code="5")
    total = requests_by(um, pick)
    queued = summed(QUEUE, um, queue_pick)
    return {
        "TTFT p50": expected_quantiles(TTFT, 0.5, um, pick),
        "TTFT p95": expected_quantiles(TTFT, 0.95, um, pick),
        "First answer p95": expected_quantiles(TTFA, 0.95, um, pick),
        "ITL p95": expected_quantiles(ITL, 0.95, um, pick),
        "5xx share": {k: errors.get(k, 0.0) / v for k, v in total.items()},
        "Queued share": {k: 1 - dict(c)[0.001] / c[-1][1] for k, c in queued.items()},
        "Queue p95": expected_quantiles(QUEUE, 0.95, um, queue_pick),
        "Requests/s": total,
    }


async def check_compare_row(prom: Prom, variables: Labels, pick: Labels) -> None:
    expected = compare_expectations(pick)
    um = ("upstream", "model")
    (table,) = [p for p in panels_of(COMPARE_ROW) if p["type"] == "table"]
    rates: dict[tuple[str, ...], float] = {}
    for _, column, expr in queries(table, variables):
        got = by_keys(await prom.series(expr), um)
        if column == "Requests/s":
            rates = got  # a rate's absolute value depends on the window: compare ratios
            continue
        assert got == approx(expected[column]), (column, pick)
    # Requests per second: the same proportions as the counters' rates.
    base = ("fast", "m")
    assert {k: v / rates[base] for k, v in rates.items()} == approx(
        {k: v / expected["Requests/s"][base] for k, v in expected["Requests/s"].items()}
    )
    # Each time series panel: the same numbers as the table's column it charts.
    charts = {
        "TTFT p50 / p95 per upstream": {"p50": "TTFT p50", "p95": "TTFT p95"},
        "Time to first answer token p95 per upstream": {"p95": "First answer p95"},
        "Inter-token latency p95 per upstream": {"p95": "ITL p95"},
        "Error ratio (5xx) per upstream": {"": "5xx share"},
        "Share of requests queued in the proxy per upstream": {"": "Queued share"},
        "Proxy queue time p95 per upstream": {"p95": "Queue p95"},
    }
    seen = set()
    for panel in panels_of(COMPARE_ROW):
        if panel["type"] == "table":
            continue
        columns = charts[panel["title"]]
        seen.add(panel["title"])
        for _, legend, expr in queries(panel, variables):
            assert legend.endswith("{{upstream}} {{model}}"), panel["title"]
            column = columns[legend.split("{{")[0].strip()]
            got = by_keys(await prom.series(expr), um)
            assert got == approx(expected[column]), (panel["title"], legend, pick)
    assert seen == set(charts)


async def test_compare_upstreams_row_gives_each_upstreams_own_figures(prom: Prom) -> None:
    # Spot checks of the worked-out values, by hand (see the rates above).
    expected = compare_expectations({})
    assert expected["TTFT p95"][("slow", "m")] == pytest.approx(2.9)
    assert expected["TTFT p95"][("fast", "n")] == pytest.approx(1.975)
    assert expected["5xx share"][("slow", "m")] == pytest.approx(0.1)
    assert expected["Queued share"][("slow", "m")] == pytest.approx(0.4)
    assert expected["Queue p95"][("slow", "m")] == pytest.approx(0.9375)
    await check_compare_row(prom, ALL, {})
    # Upstreams and model picked as Grafana writes a multi-value selection.
    two = {**ALL, "upstream": "(fast|slow)", "model": "(m)"}
    await check_compare_row(prom, two, {"upstream": "fast|slow", "model": "m"})
    # One client picked: TTFT, first answer, ITL and errors follow it; queue time has
    # no client label and still shows (it is not emptied by the pick).
    only_alice = compare_expectations({"client": "alice"})
    assert only_alice["TTFT p95"][("fast", "m")] == pytest.approx(0.1375)  # bob's 0.2 s left out
    await check_compare_row(prom, {**ALL, "client": "(alice)"}, {"client": "alice"})


async def test_ttft_per_client_table(prom: Prom) -> None:
    (table,) = panels_of(CLIENTS_ROW)
    assert table["type"] == "table" and table["title"] == "TTFT per client"
    for variables, upstreams in (
        (ALL, None),
        ({**ALL, "upstream": "(slow|legacy)"}, {"slow", "legacy"}),
    ):

        def keep(h: Hist, upstreams: set[str] | None = upstreams) -> bool:
            return upstreams is None or dict(h.labels)["upstream"] in upstreams

        rows: dict[str, dict[tuple[str, ...], float]] = {}
        for _, column, expr in queries(table, variables):
            rows[column] = by_keys(await prom.series(expr), ("client",))
        clients = set(rows["TTFT p95"])
        # Series without a client label (legacy) make the "(none)" row.
        wanted = {(dict(h.labels).get("client", "(none)"),) for h in HISTOGRAMS if keep(h)}
        assert clients == wanted, clients
        for column, metric, q in (
            ("TTFT p50", TTFT, 0.5),
            ("TTFT p95", TTFT, 0.95),
            ("TTFT p99", TTFT, 0.99),
            ("First answer p95", TTFA, 0.95),
        ):
            want: dict[tuple[str, ...], list[tuple[float, float]]] = {}
            for h in HISTOGRAMS:
                if h.metric != metric or not keep(h):
                    continue
                key = (dict(h.labels).get("client", "(none)"),)
                cum = h.cumulative()
                if key in want:
                    cum = [(e, a + b) for (e, a), (_, b) in zip(want[key], cum, strict=True)]
                want[key] = cum
            assert rows[column] == approx({k: quantile(q, c) for k, c in want.items()}), column
        # Streams per second: in the proportions of the TTFT histograms' counts.
        counts: dict[tuple[str, ...], float] = {}
        for h in HISTOGRAMS:
            if h.metric == TTFT and keep(h):
                key = (dict(h.labels).get("client", "(none)"),)
                counts[key] = counts.get(key, 0.0) + h.cumulative()[-1][1]
        streams = rows["Streams/s"]
        assert {k: v / streams[("carol",)] for k, v in streams.items()} == approx(
            {k: v / counts[("carol",)] for k, v in counts.items()}
        )
    # By hand: carol only uses slow (p95 2.9 s); alice's mix of fast and slow on m and n
    # sits between.
    rows_all = by_keys(
        await prom.series(next(e for _, c, e in queries(table, ALL) if c == "TTFT p95")),
        ("client",),
    )
    assert rows_all[("carol",)] == pytest.approx(2.9)
    assert rows_all[("(none)",)] == pytest.approx(4.9)


async def test_ttft_rules_and_pending_alerts_name_the_slow_upstream_and_its_clients(
    prom: Prom,
) -> None:
    recorded = await prom.series(
        "upstream_model_route_client:llm_proxy_time_to_first_token_seconds:p95_rate5m"
    )
    keys = ("upstream", "model", "route", "client")
    per_client = expected_quantiles(TTFT, 0.95, ("upstream", "model", "client"), {})
    want = {
        (upstream, model, CHAT, client): v for (upstream, model, client), v in per_client.items()
    }
    assert by_keys(recorded, keys) == approx(want)
    legacy = [dict(labels) for labels in recorded if dict(labels)["upstream"] == "legacy"]
    assert legacy and all("client" not in labels for labels in legacy)
    ratio = by_keys(
        await prom.series("upstream_model_route_client:llm_proxy_ttft_slo_errors:ratio_rate5m"),
        keys,
    )
    assert ratio == approx(
        {
            ("fast", "m", CHAT, "alice"): 0.0,
            ("fast", "m", CHAT, "bob"): 0.0,
            ("fast", "n", CHAT, "alice"): 0.0,  # 2.0 s is within the target
            ("slow", "m", CHAT, "alice"): 0.5,
            ("slow", "m", CHAT, "bob"): 0.5,
            ("slow", "m", CHAT, "carol"): 0.5,
            ("legacy", "m", CHAT, ""): 1.0,
        }
    )

    # The alerts themselves, evaluated by Prometheus: pending ('for' has not elapsed).
    async def pending() -> list[dict[str, Any]]:
        body = (await prom.client.get("/api/v1/alerts")).json()
        alerts: list[dict[str, Any]] = body["data"]["alerts"]
        return alerts

    async def p95_pending() -> bool:
        names = {a["labels"]["alertname"] for a in await pending()}
        return {
            "LLMProxyTTFTP95High",
            "LLMProxyTTFTBudgetBurnFast",
            "LLMProxyErrorRateHigh",
        } <= names

    await poll("the TTFT and error-rate alerts to be pending", p95_pending)
    alerts = await pending()
    for name in ("LLMProxyTTFTP95High", "LLMProxyTTFTBudgetBurnFast"):
        mine = [a for a in alerts if a["labels"]["alertname"] == name]
        got = {(a["labels"]["upstream"], a["labels"].get("client")) for a in mine}
        assert got == {("slow", "alice"), ("slow", "bob"), ("slow", "carol"), ("legacy", None)}, (
            name,
            got,
        )
        for alert in mine:
            summary = alert["annotations"]["summary"]
            client = alert["labels"].get("client")
            assert f"via {alert['labels']['upstream']}" in summary, summary
            if client:
                assert f"for client {client}" in summary, summary
                assert f"(client {client})" in alert["annotations"]["description"]
            else:
                assert (
                    "client" not in summary and "client" not in alert["annotations"]["description"]
                )
    p95 = {
        a["labels"].get("client"): a
        for a in alerts
        if a["labels"]["alertname"] == "LLMProxyTTFTP95High"
    }
    assert p95["carol"]["annotations"]["summary"] == (
        f"TTFT p95 for m on {CHAT} via slow for client carol is 2.9s"
    )
    assert p95[None]["annotations"]["summary"] == f"TTFT p95 for m on {CHAT} via legacy is 4.9s"
    # The error-rate alert is per upstream and route, without a client.
    errors = [a for a in alerts if a["labels"]["alertname"] == "LLMProxyErrorRateHigh"]
    assert [
        (a["labels"]["upstream"], a["labels"]["route"], a["labels"].get("client")) for a in errors
    ] == [("slow", CHAT, None)]
    assert not [a for a in alerts if a["labels"].get("upstream") == "fast"]


async def test_prompt_caching_row_gives_each_upstreams_own_figures(prom: Prom) -> None:
    """Per upstream and model: repeated, reported cached and missed tokens per second in
    the proportions of the known rates, the missed share, the breaks by reason and part,
    and the missed cache's first-token cost (missed per examined request x the fitted
    slope); a client picked does not narrow the row (the doctor's counters carry no
    client label; the rules sum the prompt and cached tokens over clients); and the
    alert is pending for the upstream and model above 20 % only."""
    um = ("upstream", "model")
    prompt = {k: sum(v.prompt.values()) for k, v in PROMPT_CACHE.items()}
    lines = {
        "repeated": {k: v.repeated for k, v in PROMPT_CACHE.items()},
        "reported cached": {k: sum(v.cached.values()) for k, v in PROMPT_CACHE.items()},
        "missed": {k: v.missed for k, v in PROMPT_CACHE.items()},
    }
    assert lines["missed"][("slow", "m")] / prompt[("slow", "m")] == 0.5  # by hand
    panels = {p["title"]: p for p in panels_of(PROMPT_ROW)}
    assert len(panels) == 4
    for variables in (ALL, {**ALL, "client": "(alice)"}):
        tokens = panels["Prompt tokens per second: repeated, reported cached and missed, "
                        "per upstream and model"]
        got: dict[str, dict[tuple[str, ...], float]] = {}
        for _, legend, expr in queries(tokens, variables):
            got[legend.split(" {{")[0]] = by_keys(await prom.series(expr), um)
        base = got["repeated"][("fast", "m")] / lines["repeated"][("fast", "m")]
        for line, values in lines.items():  # a rate's size depends on the window: in proportion
            assert {k: v / base for k, v in got[line].items()} == approx(values), line
        ((_, _, expr),) = queries(panels["Missed share of prompt tokens per upstream and model"],
                                  variables)
        assert by_keys(await prom.series(expr), um) == approx(
            {k: lines["missed"][k] / prompt[k] for k in prompt})
        ((_, _, expr),) = queries(panels["Prompt prefix breaks per second by reason and part"],
                                  variables)
        breaks = by_keys(await prom.series(expr), ("reason", "part"))
        want: dict[tuple[str, ...], float] = {}
        for (_, _, reason, part), per_second in BREAKS.items():
            want[(reason, part)] = want.get((reason, part), 0.0) + per_second
        scale = breaks[("system_changed", "system")] / want[("system_changed", "system")]
        assert {k: v / scale for k, v in breaks.items()} == approx(want)
        cost = panels["What the missed cache costs in first-token time, per request (missed "
                      "tokens x fitted prefill cost)"]
        ((_, _, expr),) = queries(cost, variables)
        assert by_keys(await prom.series(expr), ("upstream", "model", "route")) == approx({
            (upstream, model, CHAT): PROMPT_CACHE[(upstream, model)].missed
            / PROMPT_CACHE[(upstream, model)].examined / 1000 * slope
            for (upstream, model), (_, slope) in FIT_LINES.items()
        })
    # By hand: slow misses 1,000 tokens/s over 4 requests/s, 250 tokens at 0.4 s per 1,000.
    ((_, _, expr),) = queries(cost, ALL)
    assert by_keys(await prom.series(expr), ("upstream", "model", "route"))[
        ("slow", "m", CHAT)] == pytest.approx(0.1)

    async def alerts() -> list[dict[str, Any]]:
        body = (await prom.client.get("/api/v1/alerts")).json()
        found: list[dict[str, Any]] = body["data"]["alerts"]
        return [a for a in found if a["labels"]["alertname"] == "LLMProxyPromptCacheMissed"]

    async def missed_pending() -> bool:
        return bool(await alerts())

    await poll("LLMProxyPromptCacheMissed to be pending", missed_pending)
    (alert,) = await alerts()
    assert alert["state"] == "pending"
    assert {k: alert["labels"][k] for k in ("upstream", "model", "route")} == {
        "upstream": "slow", "model": "m", "route": CHAT}
    assert alert["annotations"]["summary"] == (
        f"50% of prompt tokens for m on {CHAT} via slow missed the prompt cache")
