"""``diagnose`` end to end: the lever a workload was built to have comes out on top, with
the numbers the proxy's ``/metrics`` holds, read from the proxy itself and from a real
Prometheus that scrapes it with the shipped recording rules.

Everything runs as users run it, each in its own process: the simulator (``python -m
proxy simulate``), the proxy (``python -m proxy serve``: uvloop, httptools, the production
upstream client), Prometheus (Debian's, the shipped ``prometheus.yml`` and rules at 1 s
intervals), and ``python -m proxy diagnose``; the official ``openai`` SDK sends the
requests.

* Prefill on top: prompts of 500 to 8,000 uncached tokens (each starts with its own salt,
  so nothing is cached) at the simulator's 20,000 tokens/s, one at a time, four output
  tokens at 4 ms: the first token is mostly prefill (25-400 ms against a 20 ms fixed
  cost), nothing queues, decoding is far above reading pace and every answer has the
  same length. The prefill lever must be first and the only one worth acting on, and
  the numbers behind its sentence must be the fit and means computed here from the
  proxy's own ``/metrics``.
* Queueing at the upstream on top: one decode slot at the simulator (``--slots 1``) and
  four clients at once, prompts all of one length: the first token is mostly waiting for
  that slot, which the simulator reports (``--vllm-metrics``); the fit has no spread of
  lengths and says so.
* The prompt cache on top: every prompt starts with the same 4,000-token system message
  and ends with its own question of 100 to 2,000 tokens, and the simulator caches
  nothing (``--cache-blocks 0``, reporting 0 cached tokens): the proxy's prompt-cache
  doctor counts the repeated prefix as missed, and the card must rank what those
  missed hits cost (the fitted slope times the missed tokens per request, as the
  doctor's counters say) above the prefill of the rest.
* The same from Prometheus (``diagnose --prometheus``): the same ranking as ``--url``;
  and the numbers of the window Prometheus saw (from its first sample of the series to
  the end, read from the proxy's /metrics as ``--url --window`` reads it): counts within
  ``increase()``'s extrapolation to the window's edges, means and the fit to 1 %; and
  the dashboard's "What to fix" row gives the card's numbers.

Without a ``prometheus`` binary the Prometheus test is skipped on a developer machine and
fails in CI (``CI=true``). Waiting is on the servers' own state (bounded polls), never on
a fixed sleep.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from proxy.bench.promscrape import parse
from proxy.diagnosis.fit import SAMPLES, FitSums, fit
from proxy.diagnosis.levers import diagnose
from proxy.evidence import evidence, read_snapshot
from tests.servers import ROOT
from tests.test_diagnose import check_contract
from tests.test_observability import ALL, load_dashboard, require_tool, substitute_macros
from tests.test_prefill_truth import simulator_process
from tests.test_prometheus_integration import background, free_port, prometheus_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "sim-llm"
CHAT = "/v1/chat/completions"
WAIT_S = 30.0
PREFILL = ["--prefill-rate", "20000", "--prefill-overhead", "0.02", "--itl", "0.004",
           "--itl-growth", "0", "--jitter", "0", "--slots", "4", "--output-tokens", "4",
           "--output-dist", "fixed", "--vllm-metrics", "--seed", "3"]
QUEUEING = ["--prefill-rate", "50000", "--prefill-overhead", "0.02", "--itl", "0.01",
            "--itl-growth", "0", "--jitter", "0", "--slots", "1", "--output-tokens", "4",
            "--output-dist", "fixed", "--vllm-metrics", "--seed", "3"]
NO_CACHE = [*PREFILL, "--cache-blocks", "0"]
STREAMS = 44  # the prefill workload's streams
# Sent before Prometheus starts, so its first sample of every counter of the selection
# holds nearly as much as the window adds after it: increase() then extrapolates every
# one of them to the window's start by the same half scrape interval. (A counter whose
# first sample is a small share of what the window adds is extrapolated only to where
# it would reach zero, which differs from counter to counter: on a loaded machine, with
# scrapes spread out, that moves the fit's small differences of large sums by far more
# than rounding. Series older than the window, as in production, are not extrapolated
# at its start at all.) The 24 after it are enough for the window's own fit.
PRE = 20


def wait_for(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling a server's state, not timing anything


def text_of(tokens: int, salt: str) -> str:
    """About ``tokens`` tokens at the simulator's 4 characters a token, ``salt`` first so
    no prefix is shared with another request."""
    words = ("alpha", "bravo", "charlie", "delta", "echo")
    body = salt + " " + " ".join(words[i % 5] for i in range(tokens))
    return body[: tokens * 4]


def ask(client: OpenAI, tokens: int, rng: random.Random, model: str = MODEL) -> None:
    stream = client.chat.completions.create(
        model=model, max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": text_of(tokens, f"{rng.getrandbits(64):016x}")}])
    for _ in stream:
        pass


def samples(proxy: str) -> dict[str, float]:
    """The proxy's /metrics summed over the series of the one selection."""
    text = httpx.get(proxy + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") == MODEL and s.labels.get("route") == CHAT:
                if s.name.startswith("llm_proxy_request_duration") and s.labels["stream"] != "true":
                    continue
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def counted(proxy: str, n: int) -> None:
    """The proxy records a request just after the client saw its end."""
    wait_for(f"the proxy to count {n} requests",
             lambda: samples(proxy).get("llm_proxy_requests_total", 0) >= n)


def run_diagnose(*args: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "proxy", "diagnose", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    return done.returncode, done.stdout, done.stderr


def selection(doc: dict[str, Any]) -> dict[str, Any]:
    check_contract(doc)
    (found,) = [s for s in doc["selections"] if s["model"] == MODEL]
    assert (found["route"], found["upstream"]) == (CHAT, "sim")
    out: dict[str, Any] = found
    return out


def levers(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {lv["name"]: lv for lv in s["levers"]}


@dataclass
class Stack:
    """The proxy's URL and, when asked for, Prometheus's."""

    proxy: str
    prometheus: str | None
    before: str = ""  # the proxy's /metrics as Prometheus started


@contextlib.contextmanager
def proxy_in_front_of(simulator: str, tmp: Path) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "proxy", "serve", "--upstream", simulator + "/v1",
            "--upstream-name", "sim", "--host", "127.0.0.1", "--port", str(port),
            "--prefix-doctor"]
    with background(argv, tmp / "proxy.log") as proc:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, (tmp / "proxy.log").read_text()
            try:
                return httpx.get(url + "/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for("the proxy's /healthz", healthy)
        yield url


@contextlib.contextmanager
def prometheus_scraping(proxy: str, tmp: Path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary is not None
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(int(proxy.rsplit(":", 1)[1]))))
    port = free_port()
    argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    with background(argv, tmp / "prometheus.log") as proc:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()
            try:
                return httpx.get(url + "/-/ready", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for("Prometheus to be ready", ready)
        wait_for("Prometheus to scrape the proxy",
                 lambda: prom_value(url, 'up{job="llm-latency-proxy"}') == 1)
        yield url


def prom_value(url: str, expr: str) -> float | None:
    body = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=5).json()
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


@contextlib.contextmanager
def prefill_workload(tmp: Path, *, with_prometheus: bool) -> Iterator[Stack]:
    """The prefill workload through the proxy, all of it counted; with Prometheus
    scraping the proxy from before the workload, every request scraped and the rules
    evaluated after the last scrape."""
    rng = random.Random(5)
    sizes = [round(500 + 7500 * i / (STREAMS - 1)) for i in range(STREAMS)]
    rng.shuffle(sizes)  # a drift of the machine's speed does not line up with length
    with contextlib.ExitStack() as stack:
        simulator = stack.enter_context(simulator_process(*PREFILL))
        proxy = stack.enter_context(proxy_in_front_of(simulator, tmp))
        client = OpenAI(base_url=proxy + "/v1", api_key="sk-sim", max_retries=0, timeout=30)
        # the first request of a process pays for lazy imports: another model's selection
        ask(client, 100, rng, model="warm-up")
        for size in sizes[:PRE]:
            ask(client, size, rng)
        counted(proxy, PRE)
        # Prometheus starts once nothing is being recorded, so its first sample of each
        # series is whole (a scrape while a request is being recorded can hold its sum
        # and not yet its count)
        prom, before = None, ""
        if with_prometheus:
            before = httpx.get(proxy + "/metrics", timeout=10).text
            prom = stack.enter_context(prometheus_scraping(proxy, tmp))
            fit_n = f'sum(llm_proxy_prefill_fit_requests_total{{model="{MODEL}"}})'
            wait_for("Prometheus's first sample of the series",
                     lambda: prom_value(prom, fit_n) == PRE)
        for size in sizes[PRE:]:
            ask(client, size, rng)
        counted(proxy, STREAMS)
        if prom is not None:
            final = float(STREAMS)
            rule = f'upstream_model_route:llm_proxy_prefill_fit_requests:increase1h{{model="{MODEL}"}}'
            raw = f'llm_proxy_prefill_fit_requests_total{{model="{MODEL}"}}'

            # a scrape's samples carry the time it started but are seen once it is
            # committed: a rule evaluated in between is stamped later than the last
            # scrape and yet misses it. So: the last scrape seen, then an evaluation that
            # started after that moment.
            wait_for("Prometheus to scrape every request",
                     lambda: prom_value(prom, raw) == final)
            seen = prom_value(prom, "vector(time())")
            assert seen is not None

            def evaluated_after() -> bool:
                evaluated = prom_value(prom, f"timestamp({rule})")
                return evaluated is not None and evaluated > seen

            wait_for("Prometheus to evaluate the rules after the last scrape", evaluated_after)
        yield Stack(proxy, prom, before)


def test_prefill_on_top_with_the_numbers_of_the_proxys_metrics(tmp_path: Path) -> None:
    with prefill_workload(tmp_path, with_prometheus=False) as stack:
        proxy = stack.proxy
        code, out, err = run_diagnose("--url", proxy, "--json")
        assert code == 0, err
        m = samples(proxy)
        code, card, err = run_diagnose("--url", proxy, "--model", MODEL)
        assert code == 0, err
    s = selection(json.loads(out))
    got = s["levers"]
    assert got[0]["name"] == "prefill" and got[0]["status"] == "lever", got
    named = levers(s)
    for name in ("proxy_queue", "upstream_queue", "decode", "output_length"):
        assert named[name]["status"] == "not_a_lever", named[name]
    # the fixed part (a 20 ms configured cost, timers and loopback) is far below prefill
    assert named["fixed"]["saves_ms"] < got[0]["saves_ms"] / 3

    # the numbers behind the sentence, worked out here from the proxy's /metrics
    line = fit(FitSums.from_samples((name, m.get(name, 0.0)) for name in SAMPLES))
    assert line.ms_per_1k_tokens is not None and line.mean_uncached_tokens is not None
    ttft_ms = 1000 * m["llm_proxy_time_to_first_token_seconds_sum"] / m[
        "llm_proxy_time_to_first_token_seconds_count"]
    prefill_ms = line.ms_per_1k_tokens * line.mean_uncached_tokens / 1000
    top = got[0]
    numbers = top["numbers"]
    assert numbers["requests"] == line.requests == STREAMS == s["requests"]
    assert numbers["mean_uncached_tokens"] == pytest.approx(line.mean_uncached_tokens, rel=1e-3)
    assert numbers["ms_per_1k_tokens"] == pytest.approx(line.ms_per_1k_tokens, rel=1e-3)
    assert numbers["first_token_ms"] == pytest.approx(ttft_ms, rel=1e-3)
    assert top["saves_ms"] == pytest.approx(prefill_ms, rel=1e-3)
    assert s["prefill_ms_per_1k_tokens"] == pytest.approx(line.ms_per_1k_tokens, rel=1e-3)
    assert s["fixed_ms"] == pytest.approx(line.fixed_ms, rel=1e-3)
    assert s["first_token"]["prefill_ms"] == pytest.approx(prefill_ms, rel=1e-3)
    # the simulator's 20,000 tokens/s is 50 ms per 1,000 tokens (tests/test_prefill_truth.py
    # holds the fit to 10 % of that)
    assert 40 < line.ms_per_1k_tokens < 60
    # ... and the sentence says them
    assert top["sentence"].startswith(
        f"Prefill: {fmt_tokens(line.mean_uncached_tokens)} uncached prompt tokens at "
        f"{line.ms_per_1k_tokens / 1000:.3f} ms per token are {prefill_ms:.0f} ms of the "
        f"{ttft_ms:.0f} ms first token. Shorten the prompt"), top["sentence"]

    # the card says the same, prefill first
    lines = card.splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip().startswith("1. "))
    assert lines[first - 1] == "  Worth acting on, most valuable first:"
    assert lines[first].startswith(f"   1. prefill: would save {prefill_ms:.0f} ms of the first")
    assert lines[first + 1].strip().startswith("Prefill: ")


def fmt_tokens(value: float) -> str:
    value = round(value)
    if value >= 1000:
        scale = 10 ** (len(str(value)) - 2)
        value = round(value / scale) * scale
    return f"{value:,}"


@pytest.mark.integration
@pytest.mark.slow
def test_prometheus_gives_the_same_ranking_and_numbers(tmp_path: Path) -> None:
    require_tool("prometheus")
    with prefill_workload(tmp_path, with_prometheus=True) as stack:
        assert stack.prometheus is not None
        code, out, err = run_diagnose("--url", stack.proxy, "--json")
        assert code == 0, err
        url = selection(json.loads(out))
        code, out, err = run_diagnose("--prometheus", stack.prometheus, "--json")
        assert code == 0, err
        # a range without recording rules reads increase() of the counters
        code30, out30, err30 = run_diagnose("--prometheus", stack.prometheus, "--range", "30m",
                                            "--json", "--model", MODEL)
        prometheus, stack_before = stack.prometheus, stack.before
        after = httpx.get(stack.proxy + "/metrics", timeout=10).text
        panels = {key: prom_value(prometheus, expr) for key, expr in row_queries(
            "What to fix", {**ALL, "model": f"({MODEL})"}).items()}
    doc = json.loads(out)
    assert doc["source"] == {"kind": "prometheus", "url": prometheus,
                             "window": "range", "range": "1h", "window_s": 3600,
                             "fit_from": "recording_rules"}
    prom = selection(doc)
    # what the proxy's /metrics says of the window Prometheus saw: from its first sample
    # (the proxy as Prometheus started) to the end, as ``diagnose --url --window`` reads it
    (expected,) = [d.as_json() for d in map(diagnose, evidence(
        read_snapshot(parse(after)), read_snapshot(parse(stack_before)), model=MODEL))]
    print("\nurl:       ", compact(url), "\nwindow:    ", compact(expected),
          "\nprometheus:", compact(prom))

    # the same levers worth acting on, in the same order, and every lever's status the
    # same (levers that save next to nothing may trade places)
    assert ranking(prom) == ranking(expected) == ranking(url)
    assert ranking(prom)[0][0] == "prefill"
    # increase() over the range: the window's requests, extrapolated to the range's edges
    # (half a scrape interval at the start, up to 1.1 at the end, over the seconds the
    # series was sampled) by one factor for every counter of the selection ...
    assert expected["requests"] == STREAMS - PRE
    assert STREAMS - PRE <= prom["requests"] <= (STREAMS - PRE) * 1.3, prom["requests"]
    # ... which cancels from every mean and from the fit
    for part, name in (("", "prefill_ms_per_1k_tokens"), ("", "fixed_ms"),
                       ("first_token", "mean_ms"), ("first_token", "prefill_ms"),
                       ("first_token", "rest_ms"), ("output", "mean_tokens"),
                       ("output", "ms_per_token"), ("output", "mean_total_ms")):
        a = expected[part][name] if part else expected[name]
        b = prom[part][name] if part else prom[name]
        assert b == pytest.approx(a, rel=0.01, abs=0.2), (part, name, a, b)
    assert prom["levers"][0]["saves_ms"] == pytest.approx(
        expected["levers"][0]["saves_ms"], rel=0.01)
    # (a bucket below every answer's value starts at 0 and is extrapolated less: a
    # percentile can move a little)
    assert prom["decode"]["median_tokens_per_s"] == pytest.approx(
        expected["decode"]["median_tokens_per_s"], rel=0.05)

    # The dashboard's "What to fix" row, on the same Prometheus, says what the card says
    # (the first-token split's parts are means over 5 minutes, the rest over the
    # dashboard's rate interval: the whole workload or the latest of it).
    print("panels:", {f"{title[:24]} [{ref}]": v for (title, ref), v in panels.items()})
    ft = prom["first_token"]
    expected = {
        ("Prefill cost per 1,000", "A"): (prom["prefill_ms_per_1k_tokens"], 0.01, 0),
        ("Prefill cost per 1,000", "B"): (prom["prefill_ms_per_1k_tokens"], 0.01, 0),
        ("Fixed part of the first token", "A"): (prom["fixed_ms"] / 1000, 0.01, 0),
        ("Fixed part of the first token", "B"): (prom["fixed_ms"] / 1000, 0.01, 0),
        ("First token split", "A"): (ft["proxy_queue_ms"] / 1000, 0, 1e-4),
        ("First token split", "B"): (ft["upstream_queue_ms"] / 1000, 0, 1e-3),
        ("First token split", "C"): (ft["prefill_ms"] / 1000, 0.02, 0),
        ("First token split", "D"): (ft["rest_ms"] / 1000, 0, 0.002),
        ("Decode rate", "A"): (prom["decode"]["median_tokens_per_s"], 0.05, 0),
        ("Output length", "A"): (prom["output"]["mean_tokens"], 0.01, 0),
        ("Output length", "C"): (prom["output"]["decode_ms"] / 1000, 0.05, 0),
        ("Answers cut off", "A"): (prom["output"]["length_limited_share"], 0.01, 0),
    }
    for (start, ref), (want, rel, tol) in expected.items():
        (got,) = [v for (title, r), v in panels.items() if title.startswith(start) and r == ref]
        assert got == pytest.approx(want, rel=rel, abs=tol), (start, ref, got, want)
    assert code30 == 0, err30
    raw = json.loads(out30)
    assert raw["source"]["fit_from"] == "increase"
    assert selection(raw)["prefill_ms_per_1k_tokens"] == pytest.approx(
        prom["prefill_ms_per_1k_tokens"], rel=0.02)


def ranking(s: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The levers worth acting on in order, and every lever's status."""
    return ([lv["name"] for lv in s["levers"] if lv["status"] == "lever"],
            {lv["name"]: lv["status"] for lv in s["levers"]})


def row_queries(row: str, variables: dict[str, str]) -> dict[tuple[str, str], str]:
    """(panel title, refId) -> query (macros substituted) of the panels under ``row``."""
    out: dict[tuple[str, str], str] = {}
    under = False
    for panel in load_dashboard()["panels"]:
        if panel["type"] == "row":
            under = panel["title"] == row
        elif under:
            for target in panel["targets"]:
                out[(panel["title"], target["refId"])] = substitute_macros(target["expr"],
                                                                           variables)
    assert out, row
    return out


def compact(s: dict[str, Any]) -> str:
    top = s["levers"][0]
    return (f"requests {s['requests']}, slope {s['prefill_ms_per_1k_tokens']} ms/1k, fixed "
            f"{s['fixed_ms']} ms, first token {s['first_token']['mean_ms']} ms, top "
            f"{top['name']} {top['saves_ms']} ms")


def test_queueing_at_the_upstream_on_top_when_its_one_slot_is_busy(tmp_path: Path) -> None:
    clients, each = 4, 6
    with simulator_process(*QUEUEING) as simulator, \
            proxy_in_front_of(simulator, tmp_path) as proxy:
        client = OpenAI(base_url=proxy + "/v1", api_key="sk-sim", max_retries=0, timeout=30)
        ask(client, 100, random.Random(0), model="warm-up")
        failures: list[BaseException] = []

        def one_client(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(each):
                    ask(client, 400, rng)  # one length: 400 tokens, its own salt first
            except BaseException as exc:  # surfaced below
                failures.append(exc)

        threads = [threading.Thread(target=one_client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert not failures, failures
        counted(proxy, clients * each)
        code, out, err = run_diagnose("--url", proxy, "--json", "--model", MODEL)
        assert code == 0, err
        m = samples(proxy)
    s = selection(json.loads(out))
    top = s["levers"][0]
    assert (top["name"], top["status"]) == ("upstream_queue", "lever"), s["levers"]
    queue_ms = 1000 * m["llm_proxy_upstream_queue_time_seconds_sum"] / m[
        "llm_proxy_upstream_queue_time_seconds_count"]
    ttft_ms = 1000 * m["llm_proxy_time_to_first_token_seconds_sum"] / m[
        "llm_proxy_time_to_first_token_seconds_count"]
    assert top["saves_ms"] == pytest.approx(queue_ms, rel=1e-3)
    assert top["numbers"]["first_token_ms"] == pytest.approx(ttft_ms, rel=1e-3)
    assert s["first_token"]["upstream_queue_ms"] == pytest.approx(queue_ms, rel=1e-3)
    assert queue_ms > 0.5 * ttft_ms  # the workload was built for it
    assert top["sentence"] == (f"Queueing: {queue_ms:.0f} ms of the {ttft_ms:.0f} ms first "
                               "token is waiting for a slot at the upstream. This is "
                               "capacity, not the model.")
    # prompts of one length: the prefill cost cannot be told from the fixed part
    prefill = levers(s)["prefill"]
    assert prefill["status"] == "too_little_data"
    assert prefill["sentence"].startswith("Prefill: the prompts all have about one length")
    assert s["prefill_ms_per_1k_tokens"] is None and s["fixed_ms"] is None


def test_missed_prompt_cache_on_top_when_the_upstream_caches_nothing(tmp_path: Path) -> None:
    rng = random.Random(9)
    system = text_of(4000, "You are the assistant of the diagnose test, version 1.")
    tails = [round(100 + 1900 * i / 23) for i in range(24)]
    rng.shuffle(tails)
    with simulator_process(*NO_CACHE) as simulator, \
            proxy_in_front_of(simulator, tmp_path) as proxy:
        client = OpenAI(base_url=proxy + "/v1", api_key="sk-sim", max_retries=0, timeout=30)
        ask(client, 100, rng, model="warm-up")
        for tail in tails:
            stream = client.chat.completions.create(
                model=MODEL, max_tokens=4, stream=True, stream_options={"include_usage": True},
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": text_of(tail, f"{rng.getrandbits(64):016x}")}])
            for _ in stream:
                pass
        counted(proxy, len(tails))
        code, out, err = run_diagnose("--url", proxy, "--json", "--model", MODEL)
        assert code == 0, err
        m = samples(proxy)
    s = selection(json.loads(out))
    top = s["levers"][0]
    assert (top["name"], top["status"]) == ("prompt_cache", "lever"), s["levers"]
    # the numbers behind it: the doctor's counters and the fit, from the proxy's /metrics
    missed = m["llm_proxy_prompt_cache_missed_tokens_total"] / m[
        "llm_proxy_prompt_cache_missed_tokens_per_request_count"]
    assert missed > 3000  # every request but the first repeats the 4,000-token system part
    line = fit(FitSums.from_samples((name, m.get(name, 0.0)) for name in SAMPLES))
    assert line.ms_per_1k_tokens is not None and line.mean_uncached_tokens is not None
    assert top["numbers"]["missed_cache_tokens"] == pytest.approx(missed, rel=1e-3)
    assert top["numbers"]["ms_per_1k_tokens"] == pytest.approx(line.ms_per_1k_tokens, rel=1e-3)
    saves = line.ms_per_1k_tokens * missed / 1000
    assert top["saves_ms"] == pytest.approx(saves, rel=1e-3)
    assert s["first_token"]["missed_cache_ms"] == pytest.approx(saves, rel=1e-3)
    # the prefill of the rest: the uncached prompt less the missed part
    rest_tokens = line.mean_uncached_tokens - missed
    assert s["first_token"]["prefill_ms"] == pytest.approx(
        line.ms_per_1k_tokens * rest_tokens / 1000, rel=1e-3)
    assert levers(s)["prefill"]["saves_ms"] < top["saves_ms"]
    assert top["sentence"].startswith(f"Prompt cache: {fmt_tokens(missed)} prompt tokens a "
                                      "request could have read from the cache were computed "
                                      f"again: {saves:.0f} ms of the "), top["sentence"]
