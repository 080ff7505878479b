"""Three replicas add up to one: what the dashboard and the rules say about three proxies
behind one Service equals what they would say about one proxy that saw all traffic.

Three proxy processes (``python -m proxy serve``, configured by the Kubernetes base's
ConfigMap, ``deploy/kubernetes/base/config.env``: two workers each and /metrics on its
own port) stand in front of one simulator (``python -m proxy simulate``). A known
workload is split 60/30/10 % across them, as uneven as a Service's connections can be.

Two real Prometheus servers load the shipped rules:

- *replicas* scrapes the three metrics ports as one job, as the ServiceMonitor does
  with three pods;
- *one* scrapes a single target that serves the sum of the three proxies' latest
  samples: exactly the counters and buckets one process would hold had it seen all
  the traffic (kept current by a thread, so a scrape never waits on the three).

Both start after a warm-up has created every series the workload touches and both
have scraped it, so a rate over any window sees the same increments in both (a series
born between two scrapes loses what happened before its first sample, differently per
target). Then every panel query and every recording rule's expression, evaluated at
one instant by which both servers have committed every scrape (see
:func:`latest_common_scrape`), must give the same series with the same values in both:
exactly over the counters as they stand (rate and increase taken out), and as written
within what rate's extrapolation to the window's edges lets two equal histories differ
by, each target being scraped at its own moments (bounded from the samples the servers
hold, see :func:`rate_tolerance`; percentiles as written are left to the TTFT
comparison). Request and stream counts must equal what the client sent; TTFT p50 and
p95 from the summed histogram (the panel's query and the recording rule's) must lie
within one bucket width of the same percentiles of every TTFT the proxies logged, and
not above the client's own by more than that.

Then the 10 % replica gets SIGTERM with streams in flight, as a pod does when deleted:
every one of its streams completes, it keeps its metrics port up for the ConfigMap's
``LLM_PROXY_METRICS_LINGER`` (shortened here to fit this test's 0.5 s scrape interval),
it exits 0, and Prometheus has scraped every request it served, the streams that
finished during the drain included; they stay in the totals over the dashboard's
windows (its series end, they are not dropped).

Waiting is on the servers' own state (bounded polls), never on a fixed sleep, and
nothing compared depends on how fast this machine runs: on a loaded 2-core machine
scrapes fail or come late, and the comparisons read what Prometheus recorded.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
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
from tests.servers import CLIENT_LIMITS, serve_in_thread
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
    # Three proxies, a summed target and two Prometheus servers on two cores: beside
    # another xdist worker's test it failed once (a breaks panel's rate over 1m, about
    # three events, 48 % apart), which it has not done alone; not yet explained.
    pytest.mark.serial,
]

CONFIG_ENV = ROOT / "deploy" / "kubernetes" / "base" / "config.env"
JOB = "llm-latency-proxy"
UPSTREAM_NAME = "sim"
SHARES = (6, 3, 1)  # of every 10 requests: 60 / 30 / 10 %
MAIN_REQUESTS = 300
CONCURRENCY = 10
WAIT_S = 30.0
SCRAPE_INTERVAL = "500ms"  # short, so that rate extrapolation differs little
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


async def poll(
    what: str,
    check: Callable[[], Awaitable[bool]],
    explain: Callable[[], Awaitable[str]] | None = None,
) -> None:
    """Wait until ``check()`` is true, at most WAIT_S; on time-out, say what ``explain``
    finds (what Prometheus recorded about its scrapes)."""
    deadline = time.monotonic() + WAIT_S
    while not await check():
        if time.monotonic() > deadline:
            detail = f"\n{await explain()}" if explain is not None else ""
            pytest.fail(f"timed out waiting for {what}{detail}")
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
    requests: Path  # its request log: one JSON line per finished request

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


class SummedTarget:
    """The target of the *one* Prometheus: /metrics serves the sum of every replica's
    latest samples.

    A thread keeps the sum current (fetch the three expositions, parse, add up, render)
    and a scrape only hands over the bytes last made. Summing at scrape time instead put
    three expositions, three parses and a render behind one 0.5 s scrape timeout: on a
    loaded 2-core machine every scrape of this target timed out, and since the server
    went on serving the scrapes Prometheus had given up on, their work piled up to
    seconds per request and no scrape succeeded again. The sum lags the replicas by a
    refresh, which the comparisons allow for: they read counters once everything is
    counted, and rates between plateaus before and after the workload.

    A replica that has exited keeps its last samples: one process would not forget them.
    """

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.body = b""
        self.ready = threading.Event()  # set once every replica has been read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="summed-target", daemon=True)

    def _refresh(self) -> None:
        last: dict[str, dict[Key, float]] = {}
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                for r in self.replicas:
                    if r.name in last and r.proc.poll() is not None:
                        # exited: keep what it said last. Never ask its port again: another
                        # test's server may listen there by now (under xdist, ports are
                        # reused), and its smaller counts would read as a counter reset
                        continue
                    try:
                        response = client.get(f"http://127.0.0.1:{r.metrics_port}/metrics")
                        response.raise_for_status()
                    except httpx.HTTPError:
                        continue  # stopped: keep what it said last
                    last[r.name] = parse_samples(response.text)
                if len(last) == len(self.replicas):
                    total: dict[Key, float] = {}
                    for samples in last.values():
                        for key, value in samples.items():
                            total[key] = total.get(key, 0.0) + value
                    self.body = render(total).encode()
                    self.ready.set()
                self._stop.wait(0.25)  # the refresh cadence: half a scrape interval

    def __enter__(self) -> SummedTarget:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain; version=0.0.4")],
            }
        )
        await send({"type": "http.response.body", "body": self.body})


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

    async def targets(self) -> list[dict[str, Any]]:
        response = await self.client.get("/api/v1/targets")
        targets: list[dict[str, Any]] = response.json()["data"]["activeTargets"]
        return targets

    async def scrapes(self) -> str:
        """Each target's latest scrape as Prometheus reports it."""
        return "\n".join(
            f"{self.name} {t['scrapeUrl']}: {t['health']}, last scrape {t['lastScrape']} "
            f"took {t['lastScrapeDuration']:.3f} s, error {t['lastError']!r}"
            for t in await self.targets()
        )


async def explain_scrapes(*proms: Prom) -> str:
    return "\n".join([await prom.scrapes() for prom in proms])


async def latest_common_scrape(proms: tuple[Prom, ...], targets: int) -> float | None:
    """The latest instant by which every target of every server has been scraped: the
    earliest of their latest scrape timestamps (None until each has been scraped).

    Prometheus stamps a scrape's samples with the moment it began and commits them when
    it ends, up to a scrape timeout later (a failed scrape as staleness markers); one
    target's scrapes run one after another, and a query sees only committed samples. So
    a query at the wall clock's now can change its answer a moment later, when a scrape
    that began before now lands; at this instant every sample either server will ever
    hold at or before it is already committed, and a query at it keeps its answer.
    """
    stamps: list[float] = []
    for prom in proms:
        got = await prom.at(f'timestamp(up{{job="{JOB}"}})', time.time())
        stamps += got.values()
    return min(stamps) if len(stamps) == targets else None


async def rate_tolerance(
    proms: tuple[Prom, ...], when: float, window: str, before: float
) -> tuple[float, int]:
    """How far rate() or increase() over ``window`` at ``when`` may put two equal
    histories apart, from the samples the servers hold; and the fewest samples a series
    has in the window.

    Every series must have a sample in the window at or before ``before``, an instant by
    which both servers had committed what they scraped before the workload: then each
    server's increase runs from the same counts before the workload to the same counts
    after it, whatever moments its scrapes fell on. Within the window a series has n
    samples spanning n - 1 of its average intervals (failed scrapes leave gaps, so this
    is not the configured interval). Prometheus extrapolates the increase between the
    first and last sample towards each edge of the window by at most 1.1 average
    intervals, so each server's value is the true increase times a factor in
    [1, 1 + 2.2 / (n - 1)]; two servers' values, and sums over targets, are at most that
    far apart.
    """
    counts = []
    for prom in proms:
        response = await prom.client.get(
            "/api/v1/query", params={"query": f"llm_proxy_requests_total[{window}]", "time": when}
        )
        for item in response.json()["data"]["result"]:
            first = float(item["values"][0][0])
            assert first <= before, (
                f"{prom.name} {item['metric']}: its first sample over {window} is "
                f"{first - before:.1f} s later than the scrape of the warm-up: the workload "
                "outlasted the window, so rates over it no longer compare whole histories"
            )
            counts.append(len(item["values"]))
    fewest = min(counts)
    return 2.2 / (fewest - 1), fewest


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


def stop_together(procs: list[subprocess.Popen[bytes]]) -> None:
    """TERM every process still running, then wait for each (at most 10 s; whatever is
    left is ended by its ``background`` context, TERM then KILL)."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


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
            requests = tmp_path / f"requests-{name}.jsonl"
            env["LLM_PROXY_LOG_REQUESTS"] = str(requests)  # for the proxies' own TTFTs
            log = tmp_path / f"proxy-{name}.log"
            proc = stack.enter_context(
                background([sys.executable, "-m", "proxy", "serve"], log, env)
            )
            out.append(Replica(name, port, metrics_port, proc, log, requests))
        # Each replica keeps its metrics port up for the linger after SIGTERM: stop them
        # all at once, then wait, rather than one linger after another on the way out.
        stack.callback(stop_together, [r.proc for r in out])
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
    async with httpx.AsyncClient(timeout=30, limits=CLIENT_LIMITS) as client:
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
            target = stack.enter_context(SummedTarget(replicas))
            assert await anyio.to_thread.run_sync(target.ready.wait, WAIT_S), (
                "the summed target never read all three replicas"
            )
            summed = stack.enter_context(serve_in_thread(target))
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
                both = (many, one)
                targets = len(replicas) + 1

                verified_at: list[float] = []

                async def scraped(counts: dict[str, int]) -> bool:
                    """Both servers hold ``counts`` (by the names of COUNT_QUERIES) at an
                    instant by which every target's scrape is committed, the last scrape of
                    each at or before it having succeeded (no staleness marker in the way);
                    that instant is kept for the queries below. Every count is waited for at
                    once: a worker's scrape reads each metric's file in turn, so one scrape
                    may catch a request's finish between two of them."""
                    expected = [(expr, counts[name]) for name, expr in COUNT_QUERIES
                                if name in counts]
                    try:
                        at = await latest_common_scrape(both, targets)
                        if at is None:
                            return False
                        for prom in both:
                            for expr, count in expected:
                                got = await prom.at(expr, at)
                                if list(got.values()) != [count]:
                                    return False
                            up = await prom.at(f'up{{job="{JOB}"}}', at)
                            if list(up.values()) != [1.0] * (targets - 1 if prom is many else 1):
                                return False
                    except (httpx.TransportError, ValueError):
                        return False  # not serving queries yet
                    verified_at.append(at)
                    return True

                def explain() -> Awaitable[str]:
                    return explain_scrapes(many, one)

                await poll(
                    "both Prometheus servers to scrape the warm-up",
                    lambda: scraped({"requests": warm}),
                    explain,
                )
                warm_at = verified_at[-1]  # scraped before the workload, in every series
                workload_began = time.time()

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
                    "both Prometheus servers to scrape every request",
                    lambda: scraped(client_counts(sent)),
                    explain,
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
                measured = proxy_ttfts(replicas, workload_began)
                assert len(measured) == streams, (len(measured), streams)

                mismatches, report = await compare_everything(many, one, when, warm_at)
                ttft = await ttft_percentiles(many, one, sent, measured, when)
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

                await sigterm_mid_stream(client, replicas, both, sent, counter, warm_at)


_RATE = re.compile(r"\b(?:rate|increase)\(([^()]*?)\[[^\]]+\]\)")


_WINDOW = re.compile(r"\[(\d+)([smhd])\]")


def seconds(window: str) -> int:
    """A range selector's window, ``[5m]``, in seconds."""
    match = _WINDOW.fullmatch(window)
    assert match, window
    return int(match[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


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
    many: Prom, one: Prom, when: float, before: float
) -> tuple[list[str], list[str]]:
    """Every panel query and recording rule's expression, at one instant, on both.

    Twice: over the counters as they stand (rate and increase removed), which must be
    equal exactly, since the sum over three targets holds the same numbers as the one;
    and as written, within what rate's extrapolation to the window's edges lets two
    equal histories differ by over the shortest window any of them uses (see
    :func:`rate_tolerance`; ``before`` is an instant both servers had scraped before the
    workload), once for an expression with one rate or increase and compounded for a
    ratio of two. Percentiles as written are left to the client comparison (a percentile
    near a bucket with many observations moves a whole bucket for a 1 % change in one
    bucket's rate). So are the prompt-cache doctor's breaks as written: a series per
    (reason, part) is born on a replica the first time that reason happens there, which
    no warm-up can force for every reason on every replica (whether two turns of a
    conversation were concurrent depends on when each one's first token came), and a
    series born between two scrapes of the three targets loses a different share of its
    first increments than the summed target's; over the counters they are exact. So is
    the prefill fit as written: its slope and fixed part are
    differences of products of increases, which each target's own extrapolation factor
    does not scale alike once summed (the rules' comment in
    prometheus/rules/recording.yml: series younger than the window, as all of this
    test's are), so a slope near zero can differ by far more than any rate tolerance;
    over the counters it must be exact, and prometheus/tests/prefill_fit_test.yml proves
    the rules' sum over two replicas at fixed sample times. So is a remainder of rates
    (``clamp_min`` of a total less its parts: where the time goes, the rest): a small
    difference of large rates, which each rate's extrapolation moves by far more than the
    tolerance; over the counters it is exact. Panels that read recorded
    series are compared with the rules' expressions in their place (:func:`inline_rules`).
    """
    exprs = [(f"panel {title} [{ref}]", inline_rules(expr))
             for title, ref, expr in dashboard_queries(ALL)]
    exprs += [(f"rule {r['record']}", r["expr"]) for r in load_rules(RECORDING_RULES)]
    window = min((m.group(0) for _, e in exprs for m in _WINDOW.finditer(e)), key=seconds)
    tolerance, fewest = await rate_tolerance((many, one), when, window[1:-1], before)
    mismatches = []
    report = [f"rate tolerance {tolerance:.1%} ({fewest} samples over {window}, the shortest)"]
    compared: list[tuple[str, list[tuple[str, str, float]]]] = []
    for where, expr in exprs:
        if "scalar(" in expr and ":" in expr:
            continue  # reads recorded series, whose evaluation times differ: see its rule
        variants = [("counters", without_rate(expr), 0.0)]
        if (not is_quantile(expr) and "llm_proxy_prefill_fit_" not in expr
                and "llm_proxy_prompt_prefix_breaks_total" not in expr
                and "clamp_min(" not in expr):
            # each rate or increase moves by a factor in [1, 1 + tolerance]; a ratio of
            # two, by up to that squared either way
            moved = (1 + tolerance) ** min(2, len(_RATE.findall(expr))) - 1
            variants.append(("as written", expr, moved))
        compared.append((where, variants))
    # Every query at the one instant ``when``, so their order does not matter: a few at a
    # time on each server rather than one after another.
    queries = sorted({query for _, variants in compared for _, query, _ in variants})
    answers: dict[tuple[str, str], dict[tuple[tuple[str, str], ...], float]] = {}
    limit = anyio.Semaphore(8)

    async def ask(prom: Prom, query: str) -> None:
        async with limit:
            answers[prom.name, query] = await prom.at(query, when)

    async with anyio.create_task_group() as tg:
        for query in queries:
            for prom in (many, one):
                tg.start_soon(ask, prom, query)
    for where, variants in compared:
        for variant, query, tol in variants:
            a, b = answers[many.name, query], answers[one.name, query]
            if set(a) != set(b):
                mismatches.append(
                    f"{where} ({variant}): series differ\n  replicas {sorted(a)}\n  one {sorted(b)}"
                )
                continue
            # data is required of the last variant (as written, or over the counters for
            # what is compared only there)
            if variant == variants[-1][0] and not any(math.isfinite(v) for v in a.values()):
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


def proxy_ttfts(replicas: list[Replica], since: float) -> list[float]:
    """The TTFT every replica measured for each stream that finished after ``since``,
    from their request logs: what their histograms observed, one value per request."""
    out = []
    for r in replicas:
        for line in r.requests.read_text().splitlines():
            record = json.loads(line)
            if record["time"] >= since and record["ttft_s"] is not None:
                out.append(float(record["ttft_s"]))
    return out


async def ttft_percentiles(
    many: Prom, one: Prom, sent: Sent, measured: list[float], when: float
) -> dict[str, Any]:
    """TTFT p50 and p95 from the summed histograms (the panel's query on both servers and
    the recording rule's) against the same percentile of every TTFT the three proxies
    measured: a histogram quantile lies in the bucket that holds the true one, so within
    that bucket's width of it.

    And against the client's own: a proxy's TTFT runs from receiving the request to
    handing on the first token, inside the client's, so no percentile of the proxies'
    exceeds the client's; the histogram's lies at most a bucket width above it. How much
    longer the client's are depends on how fast this machine runs the client (on a
    loaded 2-core machine, 200 ms at p95), so that side is not bounded.
    """
    lines, failures = [], []
    rules = {r["record"]: r["expr"] for r in load_rules(RECORDING_RULES)}
    lines.append(
        f"{'TTFT':6} {'client':>9} {'proxies':>9} {'replicas':>9} {'one':>9} {'rule':>9} "
        f"{'bucket':>7}"
    )
    for q, name in ((0.5, "p50"), (0.95, "p95")):
        client_value = percentile(sent.ttft, q)
        true_value = percentile(measured, q)
        width = bucket_width(true_value)
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
            f"{name:6} {client_value * 1000:7.1f}ms {true_value * 1000:7.1f}ms "
            + " ".join(f"{got[k] * 1000:7.1f}ms" for k in ("replicas", "one", "rule"))
            + f" {width * 1000:5.0f}ms"
        )
        if true_value > client_value:
            failures.append(
                f"TTFT {name}: the proxies measured {true_value:.4f} s, "
                f"more than the client's {client_value:.4f} s"
            )
        for k, v in got.items():
            if not abs(v - true_value) <= width:
                failures.append(
                    f"TTFT {name} {k}: {v:.4f} s vs the proxies' {true_value:.4f} s "
                    f"(bucket width {width} s)"
                )
            if not v <= client_value + width:
                failures.append(
                    f"TTFT {name} {k}: {v:.4f} s, above the client's {client_value:.4f} s "
                    f"by more than the bucket width {width} s"
                )
    return {"lines": lines, "failures": failures}


async def sigterm_mid_stream(
    client: httpx.AsyncClient,
    replicas: list[Replica],
    both: tuple[Prom, Prom],
    sent: Sent,
    counter: Any,
    warm_at: float,
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
        # 3 s of decoding: still running at SIGTERM, even when the four first tokens
        # reach the client far apart on a loaded machine
        body["max_tokens"] = 300
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
    many, one = both
    victim_target = f"127.0.0.1:{victim.metrics_port}"
    settled: list[float] = []

    async def victim_down() -> bool:
        """An instant by which every scrape is committed, at which Prometheus has
        already recorded the stopped replica down."""
        at = await latest_common_scrape(both, len(replicas) + 1)
        if at is None:
            return False
        up = await many.at(f'up{{job="{JOB}", instance="{victim_target}"}}', at)
        if list(up.values()) != [0.0]:
            return False
        settled.append(at)
        return True

    await poll(
        "Prometheus to see the stopped replica down",
        victim_down,
        lambda: explain_scrapes(many, one),
    )
    when = settled[-1]
    increase = "sum(increase(llm_proxy_requests_total[5m]))"
    window_many = next(iter((await many.at(increase, when)).values()))
    window_one = next(iter((await one.at(increase, when)).values()))
    last_scraped = await many.at(
        f'max_over_time(llm_proxy_requests_total{{instance="{victim_target}"}}[5m])', when
    )
    victim_counted = sum(last_scraped.values())
    drained_uncounted = sent.per_replica[victim.name] - victim_counted
    tolerance, fewest = await rate_tolerance(both, when, "5m", warm_at)
    after_warm_up = total - len(MIX) * len(replicas)
    print(
        f"after SIGTERM: victim sent {sent.per_replica[victim.name]} ({in_flight} in flight "
        f"at SIGTERM, all completed), last scraped {victim_counted:.0f} "
        f"(linger {LINGER_S} s); "
        f"sum(increase(requests[5m])): replicas {window_many:.1f}, one {window_one:.1f}; "
        f"sent after the warm-up {after_warm_up}; tolerance {tolerance:.1%} ({fewest} samples)"
    )
    # Everything the victim served, the streams that finished during the drain
    # included, was scraped while its metrics port lingered, and stays in the totals
    # over the window after its target is gone: each server's increase is what was sent
    # after the warm-up, extrapolated up by at most the tolerance.
    assert victim_counted >= victim_before
    assert drained_uncounted == 0, "the linger let no scrape see the drained streams"
    for name, window in (("replicas", window_many), ("one", window_one)):
        assert after_warm_up - 1e-9 <= window <= after_warm_up * (1 + tolerance), (
            name,
            window,
            after_warm_up,
        )
