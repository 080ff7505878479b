"""Proof that the dashboard and the rules are not decorative.

A real Prometheus (Debian's ``prometheus``) scrapes a real proxy every second while
varied traffic flows through it to the simulator; then every Grafana panel query
(macros substituted) and every recording rule of the shipped files goes through
Prometheus's HTTP API and must parse and return data.

The proxy runs as the container runs it: ``llm-latency-proxy serve`` (``python -m
proxy serve``) configured only by the Dockerfile's ``LLM_PROXY_*`` environment
(host narrowed to loopback), and the Dockerfile's ``HEALTHCHECK`` command is run
against it. The traffic covers what the panels show: two models, streamed and not,
all four measured APIs (chat and completions from the simulator; Responses and
Messages streams with a reasoning phase before the answer and reasoning and
cache-write tokens in their usage), a shared prompt prefix (cache hits), injected
upstream errors and mid-stream drops, a request the upstream rejects, a client that
hangs up, and more concurrent requests than both the proxy's ``--max-concurrency`` and
the simulator's slots, so queue time is non-zero at the proxy and as the upstream
reports it. The upstreams come from a config file (``LLM_PROXY_CONFIG``): the simulator
under two names, one per model, with a client label from an ``X-Team`` header sent by
two teams, so every panel that splits by upstream or client must show both upstreams
and both teams.

Without a ``prometheus`` binary the test is skipped on a developer machine and fails in
CI (``CI=true``). Waiting is on Prometheus's own API (bounded polls), never on a fixed
sleep.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.simulator.app import create_simulator_app
from proxy.simulator.model import SimConfig
from tests.servers import CLIENT_LIMITS, end_process, serve_in_thread
from tests.test_dialect_routes import T0, messages_script, responses_script
from tests.test_observability import (
    ALERT_RULES,
    ALL,
    PROMETHEUS_DIR,
    PROMETHEUS_YML,
    RECORDING_RULES,
    ROOT,
    dashboard_queries,
    dockerfile_env,
    dockerfile_healthcheck_argv,
    load_rules,
    require_tool,
    selectors,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.anyio]

MODELS = ("sim-a", "sim-b")
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"
ROUTES = {"/v1/chat/completions", "/v1/completions", RESPONSES, MESSAGES}
UPSTREAM_NAME = "sim"
# The proxy runs from a config file with two upstreams (the same simulator under two
# names, one per model) and a client label from a header, so the "compare upstreams" and
# "clients" panels and the per-upstream, per-client rules run on the proxy's own series.
SECOND_UPSTREAM = "sim-2"
UPSTREAMS = {UPSTREAM_NAME: "sim-a", SECOND_UPSTREAM: "sim-b"}
TEAMS = ("search", "ads")
TRAFFIC_SECONDS = 6.0
CLIENTS = 8  # > proxy --max-concurrency (4) > simulator slots (3): both queue
PROXY_MAX_CONCURRENCY = 4
SIM_CONFIG = SimConfig(
    slots=3,
    prefill_rate=50_000.0,
    prefill_overhead=0.02,
    itl=0.01,
    itl_growth=0.0,
    jitter=0.2,
    output_tokens=24,
    output_dist="uniform",
    max_model_len=8192,
    error_rate=0.1,
    error_status=503,
    drop_rate=0.2,
    vllm_metrics=True,
    models=MODELS,
    seed=11,
)
# Long enough to span several 64-character cache blocks: repeated, it is served from
# the simulator's prefix cache, so cached_tokens > 0.
SYSTEM_PROMPT = "You are a terse assistant for the latency dashboard test. " * 40
WAIT_S = 20.0  # bound on every poll of Prometheus or the proxy


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def background(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A child process with its output in ``log``; ended (TERM, then KILL) on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            yield proc
        finally:
            end_process(proc)


async def poll(what: str, check: Callable[[], Awaitable[bool]], log: Path | None = None) -> None:
    """Wait until ``check()`` is true, at most WAIT_S; polling a server's state."""
    deadline = time.monotonic() + WAIT_S
    while not await check():
        if time.monotonic() > deadline:
            detail = ""
            if log is not None:
                text = await anyio.Path(log).read_text(errors="replace")
                detail = f"\n--- {log.name} ---\n{text[-3000:]}"
            pytest.fail(f"timed out waiting for {what}{detail}")
        await anyio.sleep(0.1)


# ---------------------------------------------------------------------------
# Upstream: the simulator, and scripted Responses and Messages streams

# The suite's Responses and Messages scripts (tests/test_dialect_routes.py), played
# ten times faster: first bytes after 12.5 ms, reasoning from 50 ms, the answer 25 ms
# after the last reasoning event, then usage with reasoning tokens (Responses) or
# cache-write tokens (Messages). Played at those offsets by the upstream itself, so the
# proxy sees a reasoning wait between first token and first answer token.
SCRIPT_SPEED = 10.0
REASONING_EVENTS = 3


class ASGIApp(Protocol):
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None: ...


def dialect_script(path: str, i: int) -> list[tuple[float, bytes]]:
    """(seconds after the request, bytes) of the i-th scripted stream for ``path``."""
    answer = 4 + i % 8
    if path == RESPONSES:
        script, _, _ = responses_script(REASONING_EVENTS, answer)
        tokens = b'"input_tokens":40,'
    else:
        script, _, _ = messages_script(REASONING_EVENTS, answer)
        tokens = b'"input_tokens":10,'
    # Prompts of four lengths in the usage, as the simulator's routes have: the prefill
    # fit's rules and panels have a spread of lengths to fit on these routes too.
    # (i alone would not do: each route and model sees every second or fourth i)
    extra = 300 * random.Random(i).randrange(4)
    longer = b'"input_tokens":%d,' % (int(tokens.split(b":")[1].rstrip(b",")) + extra)
    assert any(tokens in chunk for _, chunk in script)
    return [((t - T0) / SCRIPT_SPEED, chunk.replace(tokens, longer)) for t, chunk in script]


def with_dialect_routes(simulator: ASGIApp) -> ASGIApp:
    """The simulator, with /v1/responses and /v1/messages answered by scripted streams.

    Kept apart from the simulator so that this test knows exactly what those streams
    hold (a reasoning phase, reasoning and cache-write tokens) whatever the simulator
    serves. The ``x-queue-time`` header (ms, as TGI sends it) gives these routes an
    upstream-reported queue time too.
    """
    counter = itertools.count()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in (RESPONSES, MESSAGES):
            await simulator(scope, receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        start = anyio.current_time()
        script = dialect_script(scope["path"], next(counter))
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-queue-time", b"3")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for offset, chunk in script:
            await anyio.sleep_until(start + offset)  # the stream's schedule, not a wait
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


# ---------------------------------------------------------------------------
# Traffic


@dataclass
class Tally:
    sent: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    transport_errors: int = 0


def request_body(route: str, model: str, stream: bool, i: int, max_tokens: int) -> dict[str, Any]:
    # Questions of four lengths after the shared system prompt: the uncached part of the
    # prompt varies, so the prefill fit's rules have a spread of lengths to fit.
    question = f"Question number {i}: " + "how long is a piece of string? " * (1 + i % 4)
    body: dict[str, Any] = {"model": model, "stream": stream}
    if route == "/responses":
        body.update(instructions=SYSTEM_PROMPT, input=question, max_output_tokens=max_tokens)
        return body
    body["max_tokens"] = max_tokens
    if route == "/chat/completions":
        body["messages"] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ]
    elif route == "/messages":
        body["system"] = SYSTEM_PROMPT
        body["messages"] = [{"role": "user", "content": question}]
    else:
        body["prompt"] = SYSTEM_PROMPT + question
    return body


async def one_request(
    client: httpx.AsyncClient, route: str, body: dict[str, Any], tally: Tally, team: str = ""
) -> None:
    tally.sent += 1
    try:
        headers = {"x-team": team} if team else {}
        async with client.stream("POST", route, json=body, headers=headers) as response:
            async for _ in response.aiter_bytes():
                pass
        tally.by_status[response.status_code] = tally.by_status.get(response.status_code, 0) + 1
    except httpx.HTTPError:  # an injected mid-stream drop reaches the client as one
        tally.transport_errors += 1


MIX = [  # (route, model, stream): both models, streamed and not, all four APIs
    ("/chat/completions", "sim-a", True),
    ("/chat/completions", "sim-b", False),
    ("/responses", "sim-a", True),
    ("/completions", "sim-b", True),
    ("/messages", "sim-a", True),
    ("/chat/completions", "sim-b", True),
    ("/completions", "sim-a", False),
    ("/responses", "sim-b", True),
    ("/chat/completions", "sim-a", True),
    ("/messages", "sim-b", True),
]


async def drive_traffic(client: httpx.AsyncClient, seconds: float) -> Tally:
    tally = Tally()
    counter = itertools.count()
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        while time.monotonic() < deadline:
            i = next(counter)
            route, model, stream = MIX[i % len(MIX)]
            await one_request(
                client, route, request_body(route, model, stream, i, 8 + i % 24), tally,
                TEAMS[i % len(TEAMS)],
            )

    async def hang_up() -> None:
        """A client that leaves after the first token of a long answer."""
        body = request_body("/chat/completions", "sim-a", True, -1, 400)
        tally.sent += 1
        async with client.stream("POST", "/chat/completions", json=body) as response:
            async for chunk in response.aiter_bytes():
                if b'"content":"' in chunk and b'"content":""' not in chunk:
                    break

    async def too_long() -> None:
        """max_tokens beyond the simulator's context: the upstream answers 400."""
        body = request_body("/chat/completions", "sim-b", True, -2, SIM_CONFIG.max_model_len + 1)
        await one_request(client, "/chat/completions", body, tally)

    async with anyio.create_task_group() as tg:
        tg.start_soon(hang_up)
        tg.start_soon(too_long)
        for _ in range(CLIENTS):
            tg.start_soon(worker)
    return tally


# ---------------------------------------------------------------------------
# Prometheus


class PromAPI:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def query(self, expr: str) -> dict[str, Any]:
        response = await self.client.get("/api/v1/query", params={"query": expr})
        body: dict[str, Any] = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise AssertionError(
                f"query failed ({response.status_code}): {body.get('error')}\n{expr}"
            )
        data: dict[str, Any] = body["data"]
        return data

    async def series(self, expr: str) -> list[tuple[dict[str, str], float]]:
        data = await self.query(expr)
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        assert data["resultType"] == "vector", data["resultType"]
        return [(item["metric"], float(item["value"][1])) for item in data["result"]]


def prometheus_config(proxy_port: int) -> dict[str, Any]:
    """The shipped prometheus.yml, aimed at the loopback proxy with 1 s intervals."""
    config: dict[str, Any] = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / path) for path in config["rule_files"]]
    config.pop("alerting", None)  # no Alertmanager in this test
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "llm-latency-proxy"]
    job.update(scrape_interval="1s", scrape_timeout="1s")
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{proxy_port}"]
    config["scrape_configs"] = [job]
    return config


def proxy_environment(upstream: str, port: int, config: Path) -> dict[str, str]:
    """The container's environment: the Dockerfile's LLM_PROXY_* variables, then what
    compose would set; only the host is narrowed to loopback for this test. The
    upstreams come from a config file written to ``config``: the simulator under two
    names, one per model, and a client label from the X-Team header."""
    config.write_text(
        'client_label_from = "header:X-Team"\n'
        + "".join(
            f'[[upstream]]\nname = "{name}"\nurl = "{upstream}"\nmodels = ["{model}"]\n'
            + ("default = true\n" if name == UPSTREAM_NAME else "")
            for name, model in UPSTREAMS.items()
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_PROXY_")}
    image_env = dockerfile_env()
    env.update({k: v for k, v in image_env.items() if k.startswith(("LLM_PROXY_", "PYTHON"))})
    assert image_env["LLM_PROXY_HOST"] == "0.0.0.0"
    env.update(
        LLM_PROXY_HOST="127.0.0.1",
        LLM_PROXY_PORT=str(port),
        LLM_PROXY_CONFIG=str(config),
        LLM_PROXY_MAX_CONCURRENCY=str(PROXY_MAX_CONCURRENCY),
        LLM_PROXY_GRACEFUL_TIMEOUT="5",
        LLM_PROXY_PREFIX_DOCTOR="true",  # as docker-compose.yml: the Prompt caching row
    )
    return env


def exposition_totals(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def label_values(
    totals: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, label: str
) -> set[str]:
    return {dict(labels)[label] for labels, value in totals.get(name, {}).items() if value > 0}


def route_total(
    totals: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, route: str
) -> float:
    return sum(v for labels, v in totals.get(name, {}).items() if dict(labels)["route"] == route)


@pytest.fixture
async def stack(
    tmp_path: Path,
) -> AsyncIterator[tuple[PromAPI, httpx.AsyncClient, subprocess.Popen[bytes], int]]:
    prometheus = require_tool("prometheus")
    with serve_in_thread(with_dialect_routes(create_simulator_app(SIM_CONFIG))) as sim:
        proxy_port = free_port()
        proxy_log = tmp_path / "proxy.log"
        argv = [sys.executable, "-m", "proxy", "serve"]
        env = proxy_environment(sim.url + "/v1", proxy_port, tmp_path / "proxy.toml")
        with background(argv, proxy_log, env) as proxy:
            config_path = tmp_path / "prometheus.yml"
            config_path.write_text(yaml.safe_dump(prometheus_config(proxy_port)))
            prom_port = free_port()
            prom_log = tmp_path / "prometheus.log"
            prom_argv = [
                prometheus,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--log.level=warn",
            ]
            with background(prom_argv, prom_log) as prom:
                proxy_url = f"http://127.0.0.1:{proxy_port}"
                async with (
                    httpx.AsyncClient(base_url=proxy_url + "/v1", timeout=30,
                                      limits=CLIENT_LIMITS) as client,
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{prom_port}", timeout=10) as pc,
                ):

                    async def proxy_healthy() -> bool:
                        assert proxy.poll() is None, proxy_log.read_text()
                        try:
                            return (await client.get(proxy_url + "/healthz")).status_code == 200
                        except httpx.TransportError:
                            return False

                    async def prometheus_ready() -> bool:
                        assert prom.poll() is None, prom_log.read_text()
                        try:
                            return (await pc.get("/-/ready")).status_code == 200
                        except httpx.TransportError:
                            return False

                    await poll("the proxy's /healthz", proxy_healthy, proxy_log)
                    await poll("Prometheus to be ready", prometheus_ready, prom_log)
                    yield PromAPI(pc), client, proxy, proxy_port


async def test_every_panel_and_recording_rule_returns_data(
    stack: tuple[PromAPI, httpx.AsyncClient, subprocess.Popen[bytes], int],
) -> None:
    prom, client, proxy, proxy_port = stack
    proxy_url = f"http://127.0.0.1:{proxy_port}"

    async def scraping() -> bool:
        return any(v == 1 for _, v in await prom.series('up{job="llm-latency-proxy"}'))

    await poll("Prometheus to scrape the proxy (up == 1)", scraping)

    tally = await drive_traffic(client, TRAFFIC_SECONDS)
    totals: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}

    async def proxy_counted_all() -> bool:
        # The proxy records a request in its own 'finally', which can run a moment
        # after the client saw the end (or the break) of the response.
        totals.clear()
        totals.update(exposition_totals((await client.get(proxy_url + "/metrics")).text))
        return sum(totals.get("llm_proxy_requests_total", {}).values()) == tally.sent

    await poll(f"the proxy to count all {tally.sent} requests", proxy_counted_all)
    answered = sum(totals["llm_proxy_requests_total"].values())

    # The traffic really had the variety the panels are meant to show.
    outcomes = label_values(totals, "llm_proxy_stream_outcomes_total", "outcome")
    assert {
        "completed",
        "client_disconnected",
        "upstream_4xx",
        "upstream_5xx",
        "upstream_interrupted",
    } <= outcomes, outcomes
    codes = label_values(totals, "llm_proxy_requests_total", "code")
    assert {"200", "400", "503"} <= codes, codes
    assert label_values(totals, "llm_proxy_requests_total", "model") == set(MODELS)
    assert label_values(totals, "llm_proxy_requests_total", "upstream") == set(UPSTREAMS)
    assert set(TEAMS) <= label_values(totals, "llm_proxy_time_to_first_token_seconds_count",
                                      "client")
    assert label_values(totals, "llm_proxy_requests_total", "route") == ROUTES
    assert label_values(totals, "llm_proxy_time_to_first_token_seconds_count", "route") == ROUTES
    assert sum(totals["llm_proxy_queue_time_seconds_sum"].values()) > 0
    assert sum(totals["llm_proxy_upstream_queue_time_seconds_sum"].values()) > 0
    assert sum(totals["llm_proxy_cached_prompt_tokens_sum"].values()) > 0
    assert route_total(totals, "llm_proxy_reasoning_tokens_sum", RESPONSES) > 0
    assert route_total(totals, "llm_proxy_cache_write_prompt_tokens_sum", MESSAGES) > 0
    for route in (RESPONSES, MESSAGES):  # a reasoning phase: the answer starts later
        mean = {
            name: route_total(totals, f"llm_proxy_{name}_seconds_sum", route)
            / route_total(totals, f"llm_proxy_{name}_seconds_count", route)
            for name in ("time_to_first_byte", "time_to_first_token", "time_to_first_answer_token")
        }
        assert (
            mean["time_to_first_byte"]
            < mean["time_to_first_token"]
            < mean["time_to_first_answer_token"]
        ), (route, mean)

    # Every metric the dashboard reads is in the proxy's /metrics, with samples.
    recorded = {rule["record"] for rule in load_rules(RECORDING_RULES)}
    for title, ref, expr in dashboard_queries():
        for sel in selectors(expr):
            assert sel.name in totals or sel.name in recorded, f"{title} {ref}: {sel.name}"

    async def scraped_everything() -> bool:
        got = await prom.series("sum(llm_proxy_requests_total)")
        return bool(got) and got[0][1] == answered

    await poll(f"Prometheus to see all {answered} requests", scraped_everything)

    async def rules_recorded() -> bool:
        for name in sorted(recorded):
            if not await prom.series(name):
                return False
        return True

    await poll("every recording rule to have a recorded series", rules_recorded)

    # Every panel query, with All selected ...
    report: list[str] = []
    failures: list[str] = []
    for title, ref, expr in dashboard_queries():
        result = await prom.series(expr)
        values = [value for _, value in result if math.isfinite(value)]
        finite = len(values)
        example = f"{values[0]:.4g}" if values else "-"
        report.append(
            f"{len(result):3d} series ({finite:2d} finite, e.g. {example:>8})  {title} [{ref}]"
        )
        if not finite:
            failures.append(f"{title} [{ref}]: {len(result)} series, none finite\n    {expr}")
        # a panel that splits by upstream or client shows every one of them
        upstreams = {labels["upstream"] for labels, _ in result if "upstream" in labels}
        if upstreams and upstreams != set(UPSTREAMS):
            failures.append(f"{title} [{ref}]: upstreams {sorted(upstreams)}")
        clients = {labels["client"] for labels, _ in result if "client" in labels}
        if clients and not set(TEAMS) <= clients:
            failures.append(f"{title} [{ref}]: clients {sorted(clients)}")
    # ... with one model and one upstream picked (Grafana's multi-value format) ...
    for title, ref, expr in dashboard_queries(
        {**ALL, "model": "(sim-a)", "upstream": f"({UPSTREAM_NAME})"}
    ):
        result = await prom.series(expr)
        models = {labels.get("model") for labels, _ in result} - {None}
        if not result or models - {"sim-a"}:
            failures.append(
                f"{title} [{ref}] with model=sim-a: {len(result)} series, models {models}"
            )
    # ... and with the Responses and Messages routes picked: every panel has data from
    # those two APIs, and from no other.
    picked = {RESPONSES, MESSAGES}
    for title, ref, expr in dashboard_queries({**ALL, "route": f"({RESPONSES}|{MESSAGES})"}):
        result = await prom.series(expr)
        routes = {labels.get("route") for labels, _ in result} - {None}
        if not any(math.isfinite(value) for _, value in result) or routes - picked:
            failures.append(
                f"{title} [{ref}] with route={sorted(picked)}: {len(result)} series, "
                f"routes {routes}"
            )

    # Every recording rule's expression evaluates to data too, and every alert parses.
    for rule in load_rules(RECORDING_RULES):
        result = await prom.series(rule["expr"])
        values = [value for _, value in result if math.isfinite(value)]
        finite = len(values)
        example = f"{values[0]:.4g}" if values else "-"
        report.append(
            f"{len(result):3d} series ({finite:2d} finite, e.g. {example:>8})  rule {rule['record']}"
        )
        if not finite:
            failures.append(f"rule {rule['record']}: {len(result)} series, none finite")
    for rule in load_rules(ALERT_RULES):
        await prom.query(rule["expr"])  # raises if Prometheus rejects it

    # The template variables' queries (label_values) find the traffic's labels.
    for label, match, expected in (
        ("upstream", "llm_proxy_requests_total", set(UPSTREAMS)),
        ("client", "llm_proxy_requests_total", set(TEAMS)),
        ("model", 'llm_proxy_requests_total{upstream=~".*"}', set(MODELS)),
        ("route", "llm_proxy_requests_total", ROUTES),
    ):
        response = await prom.client.get(f"/api/v1/label/{label}/values", params={"match[]": match})
        assert expected <= set(response.json()["data"]), (label, response.text)

    print(
        f"\nrequests sent {tally.sent}, by status {tally.by_status}, "
        f"client-side transport errors {tally.transport_errors}"
    )
    print("\n".join(report))
    assert not failures, "\n".join(failures)

    # The image's HEALTHCHECK command passes against the running proxy ...
    argv = dockerfile_healthcheck_argv()
    if argv[0] == "python":
        argv[0] = sys.executable
    with anyio.fail_after(10):
        health = await anyio.run_process(
            argv, env={**os.environ, "LLM_PROXY_PORT": str(proxy_port)}, check=False
        )
    assert health.returncode == 0, health.stderr.decode(errors="replace")
    # ... and SIGTERM (docker stop) ends the proxy cleanly.
    proxy.send_signal(signal.SIGTERM)
    assert proxy.wait(15) == 0
