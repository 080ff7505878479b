"""Three replicas add up to one: what the dashboard and the rules say about three proxies
behind one Service equals what they would say about one proxy that saw all traffic.

Three proxy processes (``python -m proxy serve``, configured by the Kubernetes base's
ConfigMap, ``deploy/kubernetes/base/config.env``: two workers each and /metrics on its
own port) stand in front of one simulator (``python -m proxy simulate``). A known
workload is split 60/30/10 % across them, as uneven as a Service's connections can be.

Two real Prometheus servers load the shipped rules:

- *replicas* scrapes the three metrics ports as one job, as the ServiceMonitor does
  with three pods;
- *one* scrapes a single target that serves, at every scrape, the sum of the three
  proxies' samples: exactly the counters and buckets one process would hold had it
  seen all the traffic.

Both start after a warm-up has created every series the workload touches and both
have scraped it, so a rate over any window sees the same increments in both (a series
born between two scrapes loses what happened before its first sample, differently per
target). Then every panel query and every recording rule's expression, evaluated at
the same instant, must give the same series with the same values in both: exactly over
the counters as they stand (rate and increase taken out), and as written within what
rate's extrapolation to the window's edges lets two equal histories differ by, each
target being scraped at its own moment (1.6 scrape intervals over the series' age;
percentiles as written are left to the client comparison). Request and stream counts
must equal what the client sent, and TTFT p50 and p95 from the summed histogram (the
panel's query and the recording rule's) must lie within one bucket width of the
client's own percentiles over all requests.

Then the 10 % replica gets SIGTERM with streams in flight, as a pod does when deleted:
every one of its streams completes, it keeps its metrics port up for the ConfigMap's
``LLM_PROXY_METRICS_LINGER`` (shortened here to fit this test's 0.5 s scrape interval),
it exits 0, and Prometheus has scraped every request it served, the streams that
finished during the drain included; they stay in the totals over the dashboard's
windows (its series end, they are not dropped).

Waiting is on the servers' own state (bounded polls), never on a fixed sleep.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import TTFT_BUCKETS
from tests.servers import serve_in_thread
from tests.test_observability import (
    ALL,
    PROMETHEUS_DIR,
    PROMETHEUS_YML,
    RECORDING_RULES,
    ROOT,
    dashboard_queries,
    load_rules,
    require_tool,
)
from tests.test_prometheus_integration import background, free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.anyio,
    pytest.mark.timeout(300),
]

CONFIG_ENV = ROOT / "deploy" / "kubernetes" / "base" / "config.env"
JOB = "llm-latency-proxy"
UPSTREAM_NAME = "sim"
SHARES = (6, 3, 1)  # of every 10 requests: 60 / 30 / 10 %
MAIN_REQUESTS = 300
CONCURRENCY = 10
WAIT_S = 30.0
SCRAPE_INTERVAL = "500ms"  # short, so that rate extrapolation differs little
SCRAPE_INTERVAL_S = 0.5
LINGER_S = 3
MIX = [  # (route, model, stream); every one is sent to every replica in the warm-up
    ("/chat/completions", "sim-a", True),
    ("/chat/completions", "sim-b", True),
    ("/completions", "sim-a", True),
    ("/chat/completions", "sim-b", False),
]
STREAMED = [m for m in MIX if m[2]]
COUNT_QUERIES = (
    ("requests", "sum(llm_proxy_requests_total)"),
    ("streams", "sum(llm_proxy_time_to_first_token_seconds_count)"),
)
MUST_HAVE_DATA = (
    "Requests per second",
    "In-flight",
    "TTFT p50",
    "Inter-token",
    "Time per output",
    "Token throughput [A]",
    "Stream outcomes",
    "Prefill cost per 1,000",  # the prefill fit's rules, summed across the replicas
    "Fixed part of the first token",
    "First token split: queue in the proxy, queue at the upstream, prefill, rest [C]",
)


async def poll(what: str, check: Callable[[], Awaitable[bool]]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await anyio.sleep(0.1)


def base_settings() -> dict[str, str]:
    """The LLM_PROXY_* variables of the Kubernetes base's ConfigMap."""
    out = {}
    for line in CONFIG_ENV.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split("=", 1)
            out[key] = value
    return out


@dataclass
class Replica:
    name: str
    port: int
    metrics_port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# ---------------------------------------------------------------------------
# "One process that saw all traffic": the three expositions, summed


Key = tuple[str, tuple[tuple[str, str], ...]]


def parse_samples(text: str) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("llm_proxy_"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(samples: dict[Key, float]) -> str:
    lines = []
    for (name, labels), value in sorted(samples.items()):
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
        lines.append(f"{name}{{{inner}}} {value!r}")
    return "\n".join(lines) + "\n"


def summed_metrics_app(replicas: list[Replica]) -> Any:
    """An ASGI app whose /metrics is the sum of every replica's samples. A replica
    that has exited keeps its last samples: one process would not forget them."""
    last: dict[str, dict[Key, float]] = {}

    async def fetch(client: httpx.AsyncClient, r: Replica) -> None:
        try:
            response = await client.get(f"http://127.0.0.1:{r.metrics_port}/metrics")
            last[r.name] = parse_samples(response.text)
        except httpx.TransportError:
            pass  # stopped: keep what it said last

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        async with httpx.AsyncClient(timeout=2) as client, anyio.create_task_group() as tg:
            for r in replicas:
                tg.start_soon(fetch, client, r)
        total: dict[Key, float] = {}
        for samples in last.values():
            for key, value in samples.items():
                total[key] = total.get(key, 0.0) + value
        body = render(total).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain; version=0.0.4")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


# ---------------------------------------------------------------------------
# Prometheus


class Prom:
    def __init__(self, name: str, client: httpx.AsyncClient) -> None:
        self.name = name
        self.client = client

    async def at(self, expr: str, when: float) -> dict[tuple[tuple[str, str], ...], float]:
        response = await self.client.get("/api/v1/query", params={"query": expr, "time": when})
        body = response.json()
        assert body.get("status") == "success", f"{self.name}: {body.get('error')}\n{expr}"
        data = body["data"]
        if data["resultType"] == "scalar":
            return {(): float(data["result"][1])}
        return {
            tuple(sorted(item["metric"].items())): float(item["value"][1])
            for item in data["result"]
        }

    async def scalar(self, expr: str, when: float) -> float | None:
        got = await self.at(expr, when)
        return next(iter(got.values())) if got else None

    async def value(self, expr: str) -> float | None:
        got = await self.at(expr, time.time())
        return next(iter(got.values())) if got else None


def prometheus_config(targets: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(
        scrape_interval=SCRAPE_INTERVAL, scrape_timeout=SCRAPE_INTERVAL, evaluation_interval="1s"
    )
    config["rule_files"] = [str(PROMETHEUS_DIR / path) for path in config["rule_files"]]
    config.pop("alerting", None)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == JOB]
    job.update(scrape_interval=SCRAPE_INTERVAL, scrape_timeout=SCRAPE_INTERVAL)
    job["static_configs"] = [{"targets": targets}]
    config["scrape_configs"] = [job]
    return config


def start_prometheus(stack: ExitStack, tmp: Path, name: str, targets: list[str]) -> int:
    prometheus = require_tool("prometheus")
    config = tmp / f"{name}.yml"
    config.write_text(yaml.safe_dump(prometheus_config(targets)))
    port = free_port()
    stack.enter_context(
        background(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / (name + '-tsdb')}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            tmp / f"{name}.log",
        )
    )
    return port


# ---------------------------------------------------------------------------
# Traffic


@dataclass
class Sent:
    requests: int = 0
    per_replica: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)  # client-side, streamed requests
    incomplete: list[str] = field(default_factory=list)


def body_for(route: str, model: str, stream: bool, i: int) -> dict[str, Any]:
    # The prompt length (and so the simulator's prefill time, hence TTFT) varies from
    # request to request; the number first keeps prompts apart in its prefix cache.
    prompt = f"{i:06d} " + "lorem ipsum dolor sit amet " * (8 + 11 * (i % 17))
    body: dict[str, Any] = {"model": model, "stream": stream, "max_tokens": 6}
    if route == "/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def send_one(
    client: httpx.AsyncClient,
    replica: Replica,
    route: str,
    model: str,
    stream: bool,
    i: int,
    sent: Sent,
    record_ttft: bool,
) -> None:
    sent.requests += 1
    sent.per_replica[replica.name] = sent.per_replica.get(replica.name, 0) + 1
    start = time.perf_counter()
    first: float | None = None
    received = b""
    async with client.stream(
        "POST", f"{replica.url}/v1{route}", json=body_for(route, model, stream, i)
    ) as response:
        assert response.status_code == 200, (replica.name, response.status_code)
        async for chunk in response.aiter_raw():
            if first is None and stream and _has_token(received + chunk):
                first = time.perf_counter()
            received += chunk
    if stream:
        if not received.rstrip().endswith(b"data: [DONE]"):
            sent.incomplete.append(f"{replica.name} #{i}")
        if record_ttft:
            assert first is not None, received[:300]
            sent.ttft.append(first - start)


def _has_token(received: bytes) -> bool:
    # A chat delta with content, or a completion's text: the proxy's first token.
    for marker in (b'"content":"', b'"text":"', b'"content": "', b'"text": "'):
        at = received.find(marker)
        while at >= 0:
            if received[at + len(marker) : at + len(marker) + 1] != b'"':
                return True
            at = received.find(marker, at + 1)
    return False


def client_counts(sent: Sent) -> dict[str, int]:
    streams_main = sum(1 for n in range(MAIN_REQUESTS) if n % 5)
    return {"requests": sent.requests, "streams": streams_main + len(STREAMED) * 3}


def replica_for(i: int, replicas: list[Replica]) -> Replica:
    slot = i % sum(SHARES)
    for replica, share in zip(replicas, SHARES, strict=True):
        if slot < share:
            return replica
        slot -= share
    raise AssertionError


def percentile(values: list[float], q: float) -> float:
    """The q-quantile as Prometheus's histogram_quantile targets it: the value below
    which a share q of the observations lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def bucket_width(value: float) -> float:
    edges = (0.0, *TTFT_BUCKETS)
    for lower, upper in itertools.pairwise(edges):
        if value <= upper:
            return upper - lower
    return math.inf


def same(a: float, b: float, tolerance: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= tolerance * max(abs(a), abs(b)) + 1e-9


# ---------------------------------------------------------------------------
# The test


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[list[Replica]]:
    with ExitStack() as stack:
        sim_port = free_port()
        stack.enter_context(
            background(
                [
                    sys.executable,
                    "-m",
                    "proxy",
                    "simulate",
                    "--port",
                    str(sim_port),
                    "--models",
                    "sim-a,sim-b",
                    "--slots",
                    "64",
                    "--prefill-rate",
                    "20000",
                    "--prefill-overhead",
                    "0.02",
                    "--itl",
                    "0.01",
                    "--itl-growth",
                    "0",
                    "--output-tokens",
                    "6",
                    "--output-dist",
                    "fixed",
                    "--seed",
                    "7",
                ],
                tmp_path / "simulator.log",
            )
        )
        out = []
        for name in ("a", "b", "c"):
            env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_PROXY_")}
            env.update(base_settings())
            tmpdir = tmp_path / f"tmp-{name}"  # the pod's emptyDir
            tmpdir.mkdir()
            port, metrics_port = free_port(), free_port()
            env.update(
                TMPDIR=str(tmpdir),
                LLM_PROXY_HOST="127.0.0.1",
                LLM_PROXY_PORT=str(port),
                LLM_PROXY_METRICS_HOST="127.0.0.1",
                LLM_PROXY_METRICS_PORT=str(metrics_port),
                LLM_PROXY_UPSTREAM=f"http://127.0.0.1:{sim_port}/v1",
                LLM_PROXY_UPSTREAM_NAME=UPSTREAM_NAME,
                LLM_PROXY_GRACEFUL_TIMEOUT="30",
                # six of this test's 0.5 s scrape intervals, instead of two of 15 s
                LLM_PROXY_METRICS_LINGER=str(LINGER_S),
            )
            log = tmp_path / f"proxy-{name}.log"
            proc = stack.enter_context(
                background([sys.executable, "-m", "proxy", "serve"], log, env)
            )
            out.append(Replica(name, port, metrics_port, proc, log))
        async with httpx.AsyncClient(timeout=5) as client:

            async def healthy() -> bool:
                try:
                    if (
                        await client.get(f"http://127.0.0.1:{sim_port}/healthz")
                    ).status_code != 200:
                        return False
                    for r in out:
                        assert r.proc.poll() is None, r.log.read_text()
                        if (await client.get(r.url + "/healthz")).status_code != 200:
                            return False
                        await client.get(f"http://127.0.0.1:{r.metrics_port}/metrics")
                except httpx.TransportError:
                    return False
                return True

            await poll("the simulator and three proxies to be healthy", healthy)
        yield out


async def test_three_replicas_add_up_to_one(replicas: list[Replica], tmp_path: Path) -> None:
    sent = Sent()
    async with httpx.AsyncClient(timeout=30) as client:
        # Warm-up: every series the workload touches exists on every replica before
        # either Prometheus first scrapes.
        counter = itertools.count()
        for replica in replicas:
            for route, model, stream in MIX:
                await send_one(
                    client, replica, route, model, stream, next(counter), sent, record_ttft=False
                )
        warm = sent.requests

        async def replicas_counted(n: int) -> bool:
            total = 0.0
            for r in replicas:
                if r.proc.poll() is None:
                    text = (await client.get(f"http://127.0.0.1:{r.metrics_port}/metrics")).text
                    total += sum(
                        v
                        for (name, _), v in parse_samples(text).items()
                        if name == "llm_proxy_requests_total"
                    )
            return total == n

        await poll("the replicas to count the warm-up", lambda: replicas_counted(warm))

        with ExitStack() as stack:
            summed = stack.enter_context(serve_in_thread(summed_metrics_app(replicas)))
            ports = {
                "replicas": start_prometheus(
                    stack, tmp_path, "replicas", [f"127.0.0.1:{r.metrics_port}" for r in replicas]
                ),
                "one": start_prometheus(stack, tmp_path, "one", [f"127.0.0.1:{summed.port}"]),
            }
            async with AsyncExitStack() as astack:
                proms = {
                    name: Prom(
                        name,
                        await astack.enter_async_context(
                            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)
                        ),
                    )
                    for name, port in ports.items()
                }
                many, one = proms["replicas"], proms["one"]

                verified_at: list[float] = []

                async def scraped(n: int) -> bool:
                    """Both servers hold n requests at one instant, their latest scrape of
                    every target succeeded (no staleness marker in the way); that instant
                    is kept for the queries below."""
                    at = time.time()
                    try:
                        for prom in (many, one):
                            got = await prom.at("sum(llm_proxy_requests_total)", at)
                            if list(got.values()) != [n]:
                                return False
                            up = await prom.at(f'min(up{{job="{JOB}"}})', at)
                            if list(up.values()) != [1.0]:
                                return False
                    except (httpx.TransportError, ValueError):
                        return False
                    verified_at.append(at)
                    return True

                await poll("both Prometheus servers to scrape the warm-up", lambda: scraped(warm))
                scrapes_began = (
                    time.time()
                )  # a first scrape happened by now: series at least this old

                # The workload: MAIN_REQUESTS, split 6/3/1 over the replicas.
                order = iter(range(MAIN_REQUESTS))

                async def worker() -> None:
                    for n in order:
                        route, model, stream = STREAMED[n % len(STREAMED)] if n % 5 else MIX[3]
                        await send_one(
                            client,
                            replica_for(n, replicas),
                            route,
                            model,
                            stream,
                            next(counter),
                            sent,
                            record_ttft=True,
                        )

                async with anyio.create_task_group() as tg:
                    for _ in range(CONCURRENCY):
                        tg.start_soon(worker)
                assert not sent.incomplete, sent.incomplete
                total = sent.requests
                await poll("the replicas to count every request", lambda: replicas_counted(total))
                await poll(
                    "both Prometheus servers to scrape every request", lambda: scraped(total)
                )
                when = verified_at[-1]

                # Counts: the sum over the three targets is what the client sent, split
                # as it was sent.
                assert await many.scalar("sum(llm_proxy_requests_total)", when) == total
                by_target = await many.at("sum by (instance) (llm_proxy_requests_total)", when)
                expected = {
                    f"127.0.0.1:{r.metrics_port}": sent.per_replica[r.name] for r in replicas
                }
                assert {dict(k)["instance"]: v for k, v in by_target.items()} == expected
                main_split = [sent.per_replica[r.name] - len(MIX) for r in replicas]
                assert main_split == [MAIN_REQUESTS * s // sum(SHARES) for s in SHARES]
                streams = sum(1 for n in range(MAIN_REQUESTS) if n % 5)
                assert len(sent.ttft) == streams

                mismatches, report = await compare_everything(many, one, when, when - scrapes_began)
                ttft = await ttft_percentiles(many, one, sent, when)
                print(f"\nsent {total} requests ({warm} warm-up), per replica {sent.per_replica}")
                print("\n".join(report))
                for name, expr in COUNT_QUERIES:
                    counted = (await many.scalar(expr, when), await one.scalar(expr, when))
                    print(
                        f"{name}: client {client_counts(sent)[name]}, replicas {counted[0]}, "
                        f"one {counted[1]}"
                    )
                    assert counted == (client_counts(sent)[name],) * 2, name
                print("\n".join(ttft["lines"]))
                assert not mismatches, "\n".join(mismatches)
                assert not ttft["failures"], "\n".join(ttft["failures"])

                await sigterm_mid_stream(client, replicas, many, one, sent, counter, scrapes_began)


_RATE = re.compile(r"\b(?:rate|increase)\(([^()]*?)\[[^\]]+\]\)")


def without_rate(expr: str) -> str:
    """The query over the counters as they stand: rate(x[w]) and increase(x[w]) -> x."""
    out = _RATE.sub(r"\1", expr)
    assert "rate(" not in out and "increase(" not in out, out
    return out


def inline_rules(expr: str) -> str:
    """A panel query with each recorded series it reads (selected by the dashboard's
    variables, all ``.*`` here) replaced by its rule's expression: the two Prometheus
    servers evaluate their rules at moments of their own, so recorded series cannot be
    compared at one instant, while the expressions can (the burn-rate panel, which also
    divides by a recorded scalar, is left out below)."""
    if "scalar(" in expr:
        return expr
    for rule in sorted(load_rules(RECORDING_RULES), key=lambda r: -len(r["record"])):
        selector = re.compile(re.escape(rule["record"]) + r'\{(?:[a-z_]+=~"\.\*"(?:, )?)*\}')
        inlined = "(" + " ".join(rule["expr"].split()) + ")"
        expr = selector.sub(lambda _, text=inlined: text, expr)
    return expr


def is_quantile(expr: str) -> bool:
    return "histogram_quantile" in expr


async def compare_everything(
    many: Prom, one: Prom, when: float, sampled: float
) -> tuple[list[str], list[str]]:
    """Every panel query and recording rule's expression, at one instant, on both.

    Twice: over the counters as they stand (rate and increase removed), which must be
    equal exactly, since the sum over three targets holds the same numbers as the one;
    and as written, where rate's extrapolation to the window's edges (up to 1.1 scrape
    intervals at the end and half of one at the start, per series, by when each target
    was scraped) lets two equal histories differ by up to 1.6 intervals over the
    ``sampled`` seconds the series have existed. Percentiles as written are left to the
    client comparison (a percentile near a bucket with many observations moves a whole
    bucket for a 1 % change in one bucket's rate). So is the prefill fit as written: its
    slope and fixed part are differences of products of increases, which each target's
    own extrapolation factor does not scale alike once summed (the rules' comment in
    prometheus/rules/recording.yml: series younger than the window, as all of this
    test's are), so a slope near zero can differ by far more than the rate tolerance;
    over the counters it must be exact, and prometheus/tests/prefill_fit_test.yml proves
    the rules' sum over two replicas at fixed sample times.
    """
    tolerance = 1.6 * SCRAPE_INTERVAL_S / sampled
    exprs = [(f"panel {title} [{ref}]", inline_rules(expr))
             for title, ref, expr in dashboard_queries(ALL)]
    exprs += [(f"rule {r['record']}", r["expr"]) for r in load_rules(RECORDING_RULES)]
    mismatches, report = [], [f"rate tolerance {tolerance:.1%} (series {sampled:.0f} s old)"]
    for where, expr in exprs:
        if "scalar(" in expr and ":" in expr:
            continue  # reads recorded series, whose evaluation times differ: see its rule
        variants = [("counters", without_rate(expr), 0.0)]
        if not is_quantile(expr) and "llm_proxy_prefill_fit_" not in expr:
            variants.append(("as written", expr, tolerance))
        for variant, query, tol in variants:
            a, b = await many.at(query, when), await one.at(query, when)
            if set(a) != set(b):
                mismatches.append(
                    f"{where} ({variant}): series differ\n  replicas {sorted(a)}\n  one {sorted(b)}"
                )
                continue
            if variant == "as written" and not any(math.isfinite(v) for v in a.values()):
                report.append(f"{where}: no finite value on either (no such traffic)")
                for required in MUST_HAVE_DATA:
                    if where.startswith(f"panel {required}"):
                        mismatches.append(f"{where}: no data")
            for key in a:
                if not same(a[key], b[key], tol):
                    mismatches.append(
                        f"{where} ({variant}) {dict(key)}: replicas {a[key]!r} vs one {b[key]!r}"
                    )
    return mismatches, report


async def ttft_percentiles(many: Prom, one: Prom, sent: Sent, when: float) -> dict[str, Any]:
    lines, failures = [], []
    rules = {r["record"]: r["expr"] for r in load_rules(RECORDING_RULES)}
    lines.append(f"{'TTFT':6} {'client':>9} {'replicas':>9} {'one':>9} {'rule':>9} {'bucket':>7}")
    for q, name in ((0.5, "p50"), (0.95, "p95")):
        client_value = percentile(sent.ttft, q)
        width = bucket_width(client_value)
        panel = (
            f"histogram_quantile({q}, sum by (le) "
            "(rate(llm_proxy_time_to_first_token_seconds_bucket[1m])))"
        )
        rule_expr = rules[
            f"upstream_model_route_client:llm_proxy_time_to_first_token_seconds:{name}_rate5m"
        ]
        # The rule keeps (upstream, model, route, client); over all of them it is the same
        # expression summed by le alone, which is the panel's query over 5m.
        rule_all = rule_expr.replace("sum by (le, upstream, model, route, client)", "sum by (le)")
        assert rule_all != rule_expr
        values = {
            "replicas": await many.at(panel, when),
            "one": await one.at(panel, when),
            "rule": await many.at(rule_all, when),
        }
        got = {k: next(iter(v.values())) for k, v in values.items()}
        lines.append(
            f"{name:6} {client_value * 1000:7.1f}ms "
            + " ".join(f"{got[k] * 1000:7.1f}ms" for k in ("replicas", "one", "rule"))
            + f" {width * 1000:5.0f}ms"
        )
        for k, v in got.items():
            if not abs(v - client_value) <= width:
                failures.append(
                    f"TTFT {name} {k}: {v:.4f} s vs client {client_value:.4f} s "
                    f"(bucket width {width} s)"
                )
    return {"lines": lines, "failures": failures}


async def sigterm_mid_stream(
    client: httpx.AsyncClient,
    replicas: list[Replica],
    many: Prom,
    one: Prom,
    sent: Sent,
    counter: Any,
    scrapes_began: float,
) -> None:
    """SIGTERM to the 10 % replica with streams in flight: none is lost, the last scrapes
    before it exits count every one, and its requests stay in the totals over the
    dashboard's windows."""
    victim = replicas[2]
    before = sent.requests
    victim_before = sent.per_replica[victim.name]
    in_flight = 4
    started = anyio.Event()
    first_token: set[int] = set()
    finished: set[int] = set()

    async def long_stream(i: int) -> None:
        body = body_for("/chat/completions", "sim-a", True, i)
        body["max_tokens"] = 60  # 0.6 s of decoding: still running at SIGTERM
        sent.requests += 1
        sent.per_replica[victim.name] += 1
        received = b""
        async with client.stream(
            "POST", f"{victim.url}/v1/chat/completions", json=body
        ) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_raw():
                received += chunk
                if i not in first_token and _has_token(received):
                    first_token.add(i)
                    if len(first_token) == in_flight:
                        started.set()
        finished.add(i)
        if not received.rstrip().endswith(b"data: [DONE]"):
            sent.incomplete.append(f"{victim.name} long #{i}")

    async with anyio.create_task_group() as tg:
        for _ in range(in_flight):
            tg.start_soon(long_stream, next(counter))
        await started.wait()
        victim.proc.send_signal(signal.SIGTERM)
        assert not finished, "every stream must be mid-way at SIGTERM"
    assert not sent.incomplete, sent.incomplete
    with anyio.fail_after(WAIT_S):
        code = await anyio.to_thread.run_sync(victim.proc.wait)
    assert code == 0, victim.log.read_text()[-3000:]
    total = sent.requests
    assert total == before + in_flight

    # Once the victim is gone, its series end; over the dashboard's windows its
    # requests are still counted: the requests panel's increase over 5m holds all.
    async def victim_gone() -> bool:
        return await many.value(f'sum(up{{job="{JOB}"}})') == 2

    await poll("Prometheus to see the stopped replica down", victim_gone)
    when = time.time()
    increase = "sum(increase(llm_proxy_requests_total[5m]))"
    window_many = next(iter((await many.at(increase, when)).values()))
    window_one = next(iter((await one.at(increase, when)).values()))
    last_scraped = await many.at(
        f'max_over_time(llm_proxy_requests_total{{instance="127.0.0.1:{victim.metrics_port}"}}[5m])',
        when,
    )
    victim_counted = sum(last_scraped.values())
    drained_uncounted = sent.per_replica[victim.name] - victim_counted
    print(
        f"after SIGTERM: victim sent {sent.per_replica[victim.name]} ({in_flight} in flight "
        f"at SIGTERM, all completed), last scraped {victim_counted:.0f} "
        f"(linger {LINGER_S} s); "
        f"sum(increase(requests[5m])): replicas {window_many:.1f}, one {window_one:.1f}; "
        f"sent after the warm-up {total - len(MIX) * len(replicas)}"
    )
    # Everything the victim served, the streams that finished during the drain
    # included, was scraped while its metrics port lingered, and stays in the totals
    # over the window after its target is gone.
    assert victim_counted >= victim_before
    assert drained_uncounted == 0, "the linger let no scrape see the drained streams"
    tolerance = 1.6 * SCRAPE_INTERVAL_S / (when - scrapes_began)
    assert same(window_many, window_one, tolerance), (window_many, window_one)
    after_warm_up = total - len(MIX) * len(replicas)
    assert window_many >= after_warm_up * (1 - tolerance)
