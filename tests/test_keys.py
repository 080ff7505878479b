"""Keys, labels and what the proxy exposes, on the production path (the real ``serve``
command or the app under uvicorn with httptools, the default upstream client, the
suite's scripted upstream on loopback):

* a request refused for its key takes no ``client`` label value, so wrong keys cannot
  fill ``--max-clients`` and push real clients into ``other``; with keys passed through,
  a key the upstream refuses (401/403) takes none either;
* with client keys on, ``/metrics``, ``/ui`` and ``/ui/data`` on the main port take a
  client key (Bearer, ``x-api-key``, ``api-key`` or the password of HTTP Basic auth)
  and answer 401 with a Basic challenge without one; ``--metrics-port`` takes none
  (a real Prometheus scraping with ``authorization`` credentials: tests marked slow;
  the page in a real browser: ``tests/test_ui_browser.py``); the bench sends its key
  with its scrape of the proxy's view, to the proxy's own origin only;
* ``SIGHUP`` re-reads ``--client-keys-file`` (with one process and with ``--workers 2``:
  the supervisor reads it once and tells every worker only if it loads): a revoked key
  is refused from then on, a file that does not load keeps the running keys and says
  so in one line;
* credentials in an upstream URL (``--upstream``, ``LLM_PROXY_UPSTREAM``, an
  ``[[upstream]]`` table's ``url``) stop start-up with a line that says to use
  ``api_key_env`` and does not print them.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import ProxyApp, create_app
from proxy.clients import fingerprint
from proxy.config import Settings
from tests.fake_upstream import Conn, RawUpstream, ScriptedUpstream, normal
from tests.servers import ROOT, RunningServer, closed_port, proxy_process, serve_in_thread
from tests.test_faults import chat, client
from tests.test_observability import require_tool
from tests.test_startup import BANNER, serving

pytestmark = pytest.mark.anyio

SECRET = "fp-secret-for-tests"
WRONG_KEYS = 60  # more than --max-clients (50)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def requests_by_client(text: str) -> dict[tuple[str, str], float]:
    """``llm_proxy_requests_total`` summed per (client, code), of the codes answered (a
    label set's failure codes are made at 0 with its first request)."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "llm_proxy_requests_total" and s.value:
                key = (s.labels["client"], s.labels["code"])
                out[key] = out.get(key, 0.0) + s.value
    return out


async def wait_counted(url: str, total: float, c: httpx.AsyncClient,
                       headers: dict[str, str] | None = None) -> dict[tuple[str, str], float]:
    """The counts once ``total`` requests are recorded (each is recorded just after its
    client saw the end), polled with a deadline."""
    for _ in range(500):
        counts = requests_by_client((await c.get(url, headers=headers)).text)
        if sum(counts.values()) >= total:
            return counts
        await anyio.sleep(0.01)
    raise AssertionError(f"never counted {total}: {counts}")


@contextlib.contextmanager
def served(upstream_url: str, **settings: Any) -> Iterator[tuple[RunningServer, ProxyApp]]:
    """The proxy (fresh registry) under uvicorn with httptools, as ``serve`` runs it."""
    app = create_app(Settings(upstream=upstream_url + "/v1", **settings),
                     registry=CollectorRegistry())
    with serve_in_thread(app, http="httptools", timeout_graceful_shutdown=2) as server:
        yield server, app


def wrong_key_headers(i: int) -> dict[str, str]:
    key = "sk-" + secrets.token_hex(12)
    return [{"authorization": f"Bearer {key}"}, {"x-api-key": key}, {"api-key": key}][i % 3]


# ---------------------------------------------------------------------------
# Refused requests take no client label


@pytest.mark.e2e
async def test_wrong_keys_do_not_fill_the_client_labels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    valid = "cli-" + secrets.token_hex(12)
    keys = tmp_path / "keys"
    keys.write_text(digest(valid) + "\n")
    monkeypatch.setenv("TEST_KEYS_UPSTREAM_KEY", "srv-" + secrets.token_hex(8))
    monkeypatch.setenv("LLM_PROXY_FINGERPRINT_SECRET", SECRET)
    metrics_port = closed_port()
    upstream = RawUpstream()
    with upstream.running():
        async with proxy_process(
                upstream.url, "--upstream-api-key-env", "TEST_KEYS_UPSTREAM_KEY",
                "--client-keys-file", str(keys), "--client-label-from", "key",
                "--max-clients", "50", "--metrics-port", str(metrics_port)) as (_, port, _out):
            base = f"http://127.0.0.1:{port}"
            async with client() as c:
                for i in range(WRONG_KEYS):
                    r = await c.post(base + "/v1/chat/completions", content=chat("ok"),
                                     headers=wrong_key_headers(i))
                    assert r.status_code == 401
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=valid,
                                          max_retries=0) as sdk:
                for _ in range(3):
                    stream = await sdk.chat.completions.create(
                        model="ok", messages=[{"role": "user", "content": "hi"}], stream=True)
                    assert "".join([ch.choices[0].delta.content or "" async for ch in stream
                                    if ch.choices]) == " tok0 tok1 tok2"
            async with client() as c:
                counts = await wait_counted(f"http://127.0.0.1:{metrics_port}/metrics",
                                            WRONG_KEYS + 3, c)
    assert len(upstream.requests) == 3
    label = fingerprint(SECRET.encode(), valid.encode())
    assert counts.get((label, "200")) == 3, "the valid key lost its own label"
    # the refused requests are counted, without a client label value (empty = absent)
    assert counts == {("", "401"): WRONG_KEYS, (label, "200"): 3}, counts


async def test_keys_the_upstream_refuses_take_no_client_label(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys passed through (no server-held key): the upstream decides, and a request it
    answers 401 or 403 takes no label value; a header label is kept whatever the status."""
    valid = "sk-good-" + secrets.token_hex(8)

    async def check_key(conn: Conn) -> None:
        if conn.request.header("authorization") == f"Bearer {valid}":
            await normal(conn)
            return
        body = b'{"error":{"message":"Incorrect API key provided","type":"invalid_request_error"}}'
        await conn.head(401, content_type="application/json", length=len(body))
        await conn.write(body)

    monkeypatch.setenv("LLM_PROXY_FINGERPRINT_SECRET", SECRET)
    upstream = ScriptedUpstream(behaviour=check_key)
    with upstream.running(), served(upstream.url, client_label_from="key") as (proxy, _):
        async with client() as c:
            for i in range(WRONG_KEYS):
                r = await c.post(proxy.url + "/v1/chat/completions", content=chat("ok"),
                                 headers=wrong_key_headers(i))
                assert r.status_code == 401
            for _ in range(2):
                r = await c.post(proxy.url + "/v1/chat/completions", content=chat("ok"),
                                 headers={"authorization": f"Bearer {valid}"})
                assert r.status_code == 200
            counts = await wait_counted(proxy.url + "/metrics", WRONG_KEYS + 2, c)
    label = fingerprint(SECRET.encode(), valid.encode())
    assert counts.get((label, "200")) == 2, "the valid key lost its own label"
    assert counts == {("", "401"): WRONG_KEYS, (label, "200"): 2}, counts


async def test_requests_the_proxy_refuses_take_no_client_label_with_keys_passed_through(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys passed through: a request the proxy answers itself (413 for its size, 502
    for an upstream that broke before answering) never reached the upstream's key check,
    so its key, random or not, takes none of ``--max-clients``' values; a key earns one
    only with an answer of the upstream's other than 401/403."""
    valid = "sk-good-" + secrets.token_hex(8)

    async def check_key(conn: Conn) -> None:
        if conn.request.model == "broken":
            conn.reset()  # before any byte of an answer: a 502
            return
        await normal(conn)

    monkeypatch.setenv("LLM_PROXY_FINGERPRINT_SECRET", SECRET)
    upstream = ScriptedUpstream(behaviour=check_key)
    with upstream.running(), served(upstream.url, client_label_from="key", max_clients=3,
                                    max_body_bytes=4096) as (proxy, _):
        async with client() as c:
            for i in range(5):
                r = await c.post(proxy.url + "/v1/chat/completions",
                                 content=chat("ok", pad="x" * 8192),
                                 headers=wrong_key_headers(i))
                assert r.status_code == 413
            for i in range(2):
                r = await c.post(proxy.url + "/v1/chat/completions", content=chat("broken"),
                                 headers=wrong_key_headers(i))
                assert r.status_code == 502
            for _ in range(2):
                r = await c.post(proxy.url + "/v1/chat/completions", content=chat("ok"),
                                 headers={"authorization": f"Bearer {valid}"})
                assert r.status_code == 200
            counts = await wait_counted(proxy.url + "/metrics", 9, c)
    label = fingerprint(SECRET.encode(), valid.encode())
    assert counts == {("", "413"): 5, ("", "502"): 2, (label, "200"): 2}, counts


# ---------------------------------------------------------------------------
# Credentials in an upstream URL


@pytest.mark.parametrize("given", ["flag", "env", "config"])
def test_credentials_in_an_upstream_url_stop_start_up(given: str, tmp_path: Path) -> None:
    password = "pw-" + secrets.token_hex(8)
    url = f"https://ops:{password}@api.example.com/v1"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_PROXY_")}
    argv = [sys.executable, "-m", "proxy", "serve", "--port", "0"]
    if given == "flag":
        argv += ["--upstream", url]
        named = "invalid setting --upstream='https://***@api.example.com/v1':"
    elif given == "env":
        env["LLM_PROXY_UPSTREAM"] = url
        named = "invalid setting LLM_PROXY_UPSTREAM='https://***@api.example.com/v1' (--upstream):"
    else:
        config = tmp_path / "proxy.toml"
        config.write_text(f'[[upstream]]\nname = "openai"\nurl = "{url}"\ndefault = true\n')
        argv += ["--config", str(config)]
        named = f"config {config}: upstream 'openai': url:"
    try:  # a proxy that starts instead never exits by itself: the timeout fails the test
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=30, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the proxy started with credentials in its upstream URL")
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert "must not carry credentials" in line and "api_key_env" in line, line
    assert "--upstream-api-key-env" in line and named in line, line
    assert password not in done.stderr + done.stdout


# ---------------------------------------------------------------------------
# SIGHUP re-reads the client keys


def status_with(port: int, key: str) -> int:
    """A chat completion on a connection of its own (so, with workers, any of them may
    take it) with ``key``; its status."""
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=chat("ok", stream=False),
                      headers={"authorization": f"Bearer {key}"}, timeout=10).status_code


KEYS_RELOADED = re.compile(r"client keys reloaded from .*: 2 keys$")
STARTED = re.compile(r"Application startup complete")  # uvicorn's, one line a worker
KEYS_REFUSED = re.compile(r"client keys reload refused, the running client keys stay: "
                          r"invalid setting --client-keys-file: line 2 is not a SHA-256 hex digest")


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_rereads_the_client_keys(
        workers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = ("cli-" + secrets.token_hex(12) for _ in range(3))
    keys = tmp_path / "keys"
    keys.write_text(f"{digest(a)}\n{digest(b)}\n")
    monkeypatch.setenv("TEST_KEYS_UPSTREAM_KEY", "srv-" + secrets.token_hex(8))
    upstream = RawUpstream()
    with upstream.running(), serving(
            "--upstream", upstream.url + "/v1", "--upstream-api-key-env", "TEST_KEYS_UPSTREAM_KEY",
            "--client-keys-file", str(keys), "--port", "0", "--workers", str(workers)) as proc:
        port = int(proc.wait_for(BANNER)[1])
        # every worker up (with workers, their lines follow the banner): one still
        # importing would die of the SIGHUP, and its replacement says nothing of a reload
        for _ in range(workers if workers > 1 else 0):
            proc.wait_for(STARTED)
        assert (status_with(port, a), status_with(port, b), status_with(port, c)) == (200, 200, 401)
        keys.write_text(f"{digest(b)}\n{digest(c)}\n")  # a revoked, c added
        proc.popen.send_signal(signal.SIGHUP)
        for _ in range(workers):  # one line from each process that relays
            proc.wait_for(KEYS_RELOADED)
        for _ in range(2 * workers):
            assert status_with(port, a) == 401
            assert status_with(port, b) == 200
            assert status_with(port, c) == 200
        keys.write_text(f"{digest(b)}\nnot-a-digest\n{digest(a)}\n")
        proc.popen.send_signal(signal.SIGHUP)
        proc.wait_for(KEYS_REFUSED)
        for _ in range(2 * workers):  # the running keys stay
            assert status_with(port, a) == 401
            assert status_with(port, c) == 200
        assert proc.stop() == 0
    assert sum(bool(KEYS_REFUSED.search(line)) for line in proc.lines) == 1, proc.lines
    assert sum(bool(KEYS_RELOADED.search(line)) for line in proc.lines) == workers, proc.lines


# ---------------------------------------------------------------------------
# /metrics and /ui when the proxy checks client keys

EXPOSED = ("/metrics", "/ui", "/ui/", "/ui/data")


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.e2e
async def test_metrics_and_ui_on_the_main_port_take_a_client_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    valid = "cli-" + secrets.token_hex(12)
    keys = tmp_path / "keys"
    keys.write_text(digest(valid) + "\n")
    monkeypatch.setenv("TEST_KEYS_UPSTREAM_KEY", "srv-" + secrets.token_hex(8))
    upstream = RawUpstream()
    with upstream.running():
        async with proxy_process(
                upstream.url, "--upstream-api-key-env", "TEST_KEYS_UPSTREAM_KEY",
                "--client-keys-file", str(keys), "--client-label-from", "header:X-Team"
                ) as (_, port, _out), client() as c:
            base = f"http://127.0.0.1:{port}"
            r = await c.post(base + "/v1/chat/completions", content=chat("ok", stream=False),
                             headers={"authorization": f"Bearer {valid}", "x-team": "search"})
            assert r.status_code == 200
            for path in EXPOSED:
                for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"},
                                {"authorization": basic("ops", "wrong")},
                                {"authorization": basic(valid, "")},
                                {"authorization": "Basic !!not-base64"}):
                    r = await c.get(base + path, headers=headers)
                    assert r.status_code == 401, (path, headers)
                    assert r.headers["www-authenticate"].startswith('Basic realm="llm-latency-proxy"')
                    assert r.json()["error"]["code"] == "invalid_api_key"
                    assert "search" not in r.text and "llm_proxy_" not in r.text
            for headers in ({"authorization": f"Bearer {valid}"}, {"x-api-key": valid},
                            {"api-key": valid}, {"authorization": basic("prometheus", valid)}):
                r = await c.get(base + "/metrics", headers=headers)
                assert r.status_code == 200 and 'client="search"' in r.text, headers
            page = await c.get(base + "/ui", headers={"authorization": basic("ops", valid)})
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            data = await c.get(base + "/ui/data", headers={"authorization": basic("", valid)})
            assert data.status_code == 200 and data.json()["selection"] is not None
            assert (await c.get(base + "/healthz")).status_code == 200  # probes need no key


@pytest.mark.e2e
async def test_with_a_metrics_port_the_main_port_never_serves_them_and_the_port_takes_no_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    valid = "cli-" + secrets.token_hex(12)
    keys = tmp_path / "keys"
    keys.write_text(digest(valid) + "\n")
    monkeypatch.setenv("TEST_KEYS_UPSTREAM_KEY", "srv-" + secrets.token_hex(8))
    metrics_port = closed_port()
    upstream = RawUpstream()
    with upstream.running():
        async with proxy_process(
                upstream.url, "--upstream-api-key-env", "TEST_KEYS_UPSTREAM_KEY",
                "--client-keys-file", str(keys), "--metrics-port", str(metrics_port)
                ) as (_, port, _out), client() as c:
            for path in EXPOSED:
                r = await c.get(f"http://127.0.0.1:{port}{path}",
                                headers={"authorization": f"Bearer {valid}"})
                assert r.status_code == 404, path
                r = await c.get(f"http://127.0.0.1:{metrics_port}{path}")
                assert r.status_code == 200, path


@pytest.mark.slow
@pytest.mark.integration
async def test_prometheus_scrapes_the_main_port_with_a_key_and_not_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real Prometheus, two jobs on the same proxy: the one with ``authorization``
    credentials (a key file, as a Secret would be mounted) scrapes, the other gets 401."""
    from tests.test_prometheus_integration import background, free_port, poll

    prometheus = require_tool("prometheus")
    valid = "prom-" + secrets.token_hex(12)
    keys = tmp_path / "keys"
    keys.write_text(digest(valid) + "\n")
    key_file = tmp_path / "scrape-key"
    key_file.write_text(valid + "\n")
    monkeypatch.setenv("TEST_KEYS_UPSTREAM_KEY", "srv-" + secrets.token_hex(8))
    upstream = RawUpstream()
    with upstream.running():
        async with proxy_process(
                upstream.url, "--upstream-api-key-env", "TEST_KEYS_UPSTREAM_KEY",
                "--client-keys-file", str(keys)) as (_, port, _out):
            target = {"static_configs": [{"targets": [f"127.0.0.1:{port}"]}],
                      "scrape_interval": "1s", "scrape_timeout": "1s"}
            config = tmp_path / "prometheus.yml"
            config.write_text(yaml.safe_dump({"scrape_configs": [
                {"job_name": "with-key", **target,
                 "authorization": {"type": "Bearer", "credentials_file": str(key_file)}},
                {"job_name": "without-key", **target}]}))
            prom_port = free_port()
            log = tmp_path / "prometheus.log"
            argv = [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"]
            with background(argv, log):
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{prom_port}",
                                             timeout=10) as pc:
                    health: dict[str, tuple[str, str]] = {}

                    async def both_scraped() -> bool:
                        try:
                            r = await pc.get("/api/v1/targets")
                        except httpx.TransportError:
                            return False
                        if r.status_code != 200:  # not ready yet
                            return False
                        for t in r.json()["data"]["activeTargets"]:
                            health[t["labels"]["job"]] = (t["health"], t["lastError"])
                        return len(health) == 2 and "unknown" not in {h for h, _ in health.values()}

                    await poll("both jobs to be scraped", both_scraped, log)
                    r = await pc.get("/api/v1/query", params={
                        "query": 'count by (job) ({__name__=~"llm_proxy_.+"})'})
    assert health["with-key"] == ("up", ""), health
    assert health["without-key"][0] == "down" and "401" in health["without-key"][1], health
    assert [s["metric"]["job"] for s in r.json()["data"]["result"]] == ["with-key"]


@pytest.mark.e2e
def test_the_bench_shows_the_proxys_view_of_a_proxy_that_checks_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import main
    from proxy.simulator.app import create_simulator_app
    from proxy.simulator.model import SimConfig

    valid = "cli-" + secrets.token_hex(12)
    keys = tmp_path / "keys"
    keys.write_text(digest(valid) + "\n")
    monkeypatch.setenv("TEST_KEYS_UPSTREAM_KEY", "srv-" + secrets.token_hex(8))
    sim_app = create_simulator_app(SimConfig(slots=4, itl=0.002, seed=1))
    with serve_in_thread(sim_app) as sim, served(
            sim.url, upstream_api_key_env="TEST_KEYS_UPSTREAM_KEY",
            client_keys_file=str(keys)) as (proxy, _):
        argv = ["bench", "--base-url", proxy.url + "/v1", "--model", "sim-llm", "--requests", "4",
                "--concurrency", "2", "--max-tokens", "3", "--no-progress", "--api-key", valid]
        assert main(argv) == 0
        out = capsys.readouterr()
        # the same key pointed at another origin's /metrics is not sent there
        elsewhere = f"http://localhost:{proxy.port}/metrics"
        assert main([*argv, "--compare-metrics", elsewhere]) == 2
        refused = capsys.readouterr()
    assert "proxy's view" in out.out and "cannot scrape" not in out.err, out.err
    assert re.search(r"^requests\s+4\s+4\s+\+0$", out.out, re.MULTILINE), out.out
    assert "cannot scrape" in refused.err and "401" in refused.err
