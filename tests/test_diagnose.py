"""``llm-latency-proxy diagnose`` (proxy/diagnose.py): its arguments and exit codes, the
card, and the ``--json`` contract of docs/diagnose.md.

The contract is checked field by field (names, types, the order of the levers) against
what the command prints for a live proxy (uvicorn with httptools, a fresh registry, the
simulator behind it, both on loopback), and every field it prints must be documented.
Sources that cannot be read (nothing listening, not a proxy, not Prometheus, a proxy
that checks client keys and gets none) exit 1 with one line; bad arguments exit 2.
``--window`` is run as users run it, in its own process, with requests sent between its
two scrapes. The end-to-end checks of the ranking itself, against a live proxy and a
real Prometheus, are in tests/test_diagnose_e2e.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.cli import main
from proxy.diagnose import WIDTH, as_document, render
from proxy.diagnosis.levers import diagnose
from proxy.simulator.app import create_simulator_app
from proxy.simulator.model import SimConfig
from tests.servers import ROOT, closed_port, serve_in_thread
from tests.test_diagnosis_levers import example
from tests.test_keys import digest, served

DOC = ROOT / "docs" / "diagnose.md"
MODEL = "sim-llm"
CHAT = "/v1/chat/completions"
LEVER_NAMES = {"prefill", "prompt_cache", "proxy_queue", "upstream_queue", "fixed", "decode",
               "output_length"}
STATUS_ORDER = ["lever", "not_a_lever", "too_little_data", "unknown"]


# ---------------------------------------------------------------------------
# The contract


def check_contract(doc: dict[str, Any]) -> None:
    """Every field docs/diagnose.md promises, with its type, and the levers' order."""
    assert doc["version"] == 1
    source = doc["source"]
    assert source["kind"] in ("proxy", "prometheus")
    assert isinstance(source["url"], str)
    assert source["window"] in ("since_start", "between_scrapes", "range")
    assert source["window_s"] is None or isinstance(source["window_s"], int | float)
    assert source["fit_from"] in ("counters", "recording_rules", "increase")
    if source["kind"] == "prometheus":
        assert isinstance(source["range"], str)
    selections = doc["selections"]
    assert isinstance(selections, list)
    keys = [(-s["requests"], s["route"], s["model"], s["upstream"]) for s in selections]
    assert keys == sorted(keys), "the busiest selection first"
    for s in selections:
        for name in ("route", "model", "upstream"):
            assert isinstance(s[name], str)
        assert isinstance(s["requests"], int)
        assert (s["prefill_ms_per_1k_tokens"] is None) == (s["fixed_ms"] is None)
        for name in ("prefill_ms_per_1k_tokens", "fixed_ms"):
            assert s[name] is None or isinstance(s[name], float)
        assert set(s["first_token"]) == {"mean_ms", "proxy_queue_ms", "upstream_queue_ms",
                                         "prefill_ms", "missed_cache_ms", "rest_ms",
                                         "prefill_from", "capped"}
        assert s["first_token"].pop("prefill_from") in ("fit", "engine", None)
        assert isinstance(s["first_token"].pop("capped"), bool)
        assert s["fit_model"] in ("line", "through_zero", None)
        assert isinstance(s["fit_note"], str) and s["fit_note"]
        share = s["tokens_estimated_share"]
        assert share is None or 0 <= share <= 1
        for part in ("prefill_ms", "missed_cache_ms", "rest_ms"):
            value = s["first_token"][part]
            assert value is None or 0 <= value <= s["first_token"]["mean_ms"], part
        assert set(s["decode"]) == {"streams", "median_tokens_per_s",
                                    "below_reading_pace_share", "above_fast_share", "slow_ms"}
        assert set(s["output"]) == {"responses", "mean_tokens", "p50_tokens", "p95_tokens",
                                    "ms_per_token", "decode_ms", "capped_saving_ms",
                                    "mean_total_ms", "length_limited_share", "cap_tokens"}
        for part in ("first_token", "decode", "output"):
            for name, value in s[part].items():
                assert value is None or isinstance(value, int | float), (part, name)
        assert isinstance(s["decode"]["streams"], int)
        assert isinstance(s["output"]["responses"], int)
        levers = s["levers"]
        names = [lv["name"] for lv in levers]
        assert len(names) == len(set(names)) and set(names) <= LEVER_NAMES
        assert LEVER_NAMES - {"prompt_cache"} <= set(names)
        ranks = [(STATUS_ORDER.index(lv["status"]),
                  -(lv["saves_ms"] or 0.0)) for lv in levers]
        assert ranks == sorted(ranks), "most valuable first"
        for lv in levers:
            assert set(lv) == {"name", "status", "acts_on", "saves_ms", "sentence", "numbers"}
            assert lv["acts_on"] in ("first_token", "total")
            assert lv["saves_ms"] is None or isinstance(lv["saves_ms"], int | float)
            if lv["status"] in ("lever", "not_a_lever"):
                assert lv["saves_ms"] is not None
            assert isinstance(lv["sentence"], str) and lv["sentence"].endswith(".")
            assert isinstance(lv["numbers"], dict) and lv["numbers"]
            for value in lv["numbers"].values():
                assert value is None or isinstance(value, int | float)


def documented_fields() -> set[str]:
    """The names in the first column of the document's tables."""
    found: set[str] = set()
    for first in re.findall(r"^\| ([^|]+) \|", DOC.read_text(), re.MULTILINE):
        found.update(re.findall(r"`([a-z_0-9]+)`", first))
    return found


def field_names(value: Any, under: str = "") -> Iterator[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            if under != "numbers":  # the numbers' names are the levers' own, documented there
                yield k
            yield from field_names(v, k)
    elif isinstance(value, list):
        for item in value:
            yield from field_names(item, under)


def test_every_field_printed_is_documented() -> None:
    doc = as_document([diagnose(example())], {
        "kind": "prometheus", "url": "http://p:9090", "window": "range", "range": "1h",
        "window_s": 3600.0, "fit_from": "recording_rules"})
    check_contract(doc)
    missing = set(field_names(doc)) - documented_fields()
    assert not missing, f"fields not in {DOC.name}: {sorted(missing)}"
    text = DOC.read_text()
    for name in LEVER_NAMES:
        assert f"**{name}**" in text, name


# ---------------------------------------------------------------------------
# The card


SOURCE = {"kind": "proxy", "url": "http://127.0.0.1:8080/metrics", "window": "since_start",
          "window_s": None, "fit_from": "counters"}


def test_the_card_ranks_the_levers_with_their_sentences_and_numbers() -> None:
    d = diagnose(example())
    card = render([d, d], SOURCE)
    assert "\x1b" not in card  # no colour: readable in a log or a pipe
    assert card.startswith("What to fix: http://127.0.0.1:8080/metrics\n  window: since the "
                           "proxy started")
    blocks = card.split("\n\n")[1:]
    assert len(blocks) == 2  # one block per selection
    block = blocks[0]
    assert block.startswith(f"{CHAT}   model m   upstream u   (200 requests)")
    assert "prefill 130.4 ms per 1,000 uncached prompt tokens, fixed part 614 ms" in block
    assert "first token 1.8 s = queue in the proxy 0 ms + queue at the upstream 400 ms +\n" \
           "    prefill 1.2 s + rest 213 ms\n" in block
    flat = " ".join(block.split())
    positions = []
    for rank, lever in enumerate(d.levers, 1):
        head = f"{rank}. {lever.name}"
        assert head in flat, head
        positions.append(flat.index(head))
        assert " ".join(lever.sentence.split()) in flat, lever.sentence
        for name in lever.numbers:
            assert f"{name}=" in flat, name
    assert positions == sorted(positions)
    assert flat.index("Worth acting on") < flat.index("1. output_length")
    assert flat.index("Measured, not worth acting on") < flat.index("5. proxy_queue")
    assert "1. output_length: would save 14.0 s of the total time" in flat
    assert "2. prefill: would save 1.2 s of the first token" in flat
    assert max(len(line) for line in card.splitlines()) <= WIDTH


def test_an_empty_card_says_nothing_was_measured() -> None:
    card = render([], {**SOURCE, "window": "between_scrapes", "window_s": 30.0})
    assert "the 30 s between two scrapes" in card
    assert "No measured requests in this window" in card


# ---------------------------------------------------------------------------
# Arguments


@pytest.mark.parametrize(("argv", "says"), [
    ([], "one of the arguments --url --prometheus is required"),
    (["--url", "http://a", "--prometheus", "http://b"], "not allowed with"),
    (["--prometheus", "http://b", "--window", "5"], "--window goes with --url"),
    (["--url", "http://a", "--range", "1h"], "--range goes with --prometheus"),
    (["--prometheus", "http://b", "--range", "1 hour"], "--range must be a PromQL duration"),
    (["--prometheus", "http://b", "--range", "0m"], "--range must be a PromQL duration"),
    (["--url", "http://a", "--window", "0"], "--window must be a positive number"),
    (["--url", "http://a", "--window", "nan"], "--window must be a positive number"),
    (["--url", "http://a", "--window", "soon"], "invalid float value"),
    (["--url", "127.0.0.1:8080"], "--url must be an http:// or https:// URL"),
    (["--prometheus", "ftp://p"], "--prometheus must be an http:// or https:// URL"),
    (["--url", "http://a", "--timeout", "-1"], "--timeout must be a positive number"),
])
def test_bad_arguments_exit_2(argv: list[str], says: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["diagnose", *argv])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


# ---------------------------------------------------------------------------
# Sources that cannot be read


def fixed_app(status: int, body: bytes, content_type: bytes = b"text/plain") -> Any:
    """An ASGI app answering every request with one response."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.mark.e2e
@pytest.mark.parametrize(("flag", "app", "says"), [
    ("--url", fixed_app(200, b"# TYPE up gauge\nup 1\n"),
     r"/metrics has no llm_proxy_ metrics: is it the proxy's /metrics\?"),
    ("--url", fixed_app(503, b"busy"), r"/metrics answered HTTP 503"),
    ("--prometheus", fixed_app(404, b"404 page not found"),
     r"/api/v1/query answered HTTP 404 without the Prometheus API's JSON"),
    ("--prometheus", fixed_app(
        400, b'{"status":"error","errorType":"bad_data","error":"parse error at char 3"}',
        b"application/json"),
     r"/api/v1/query refused the query \(400\): parse error at char 3"),
])
def test_a_source_that_is_not_one_exits_1_with_one_line(
        flag: str, app: Any, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with serve_in_thread(app) as server:
        assert main(["diagnose", flag, server.url]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert re.fullmatch(r"diagnose: [^\n]*" + says + r"[^\n]*\n", out.err), out.err


@pytest.mark.parametrize("flag", ["--url", "--prometheus"])
def test_nothing_listening_exits_1_with_one_line(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    assert main(["diagnose", flag, url, "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(rf"diagnose: cannot read {re.escape(url)}/\S+: ConnectError: .*\n", err), err


@pytest.mark.parametrize("flag", ["--url", "--prometheus"])
def test_credentials_in_a_url_are_never_printed(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    port = closed_port()
    assert main(["diagnose", flag, f"http://ops:s3cret@127.0.0.1:{port}", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert "s3cret" not in err and "ops" not in err
    assert f"cannot read http://***@127.0.0.1:{port}/" in err


def test_shown_masks_only_credentials() -> None:
    from proxy.config import redact  # how diagnose prints a URL

    assert redact("https://u:p@prom.example:9090/x") == "https://***@prom.example:9090/x"
    assert redact("http://127.0.0.1:8080/metrics") == "http://127.0.0.1:8080/metrics"


# ---------------------------------------------------------------------------
# A live proxy


SIM = SimConfig(slots=8, prefill_rate=50_000.0, prefill_overhead=0.005, itl=0.002,
                itl_growth=0.0, jitter=0.0, output_tokens=4, output_dist="fixed",
                vllm_metrics=True, seed=1)
STREAMS = 24


def prompt(tokens: int, i: int) -> str:
    return (f"request {i} {secrets.token_hex(8)}: " + "lorem ipsum dolor sit amet " * tokens)[
        : tokens * 4]


def send(base: str, i: int, *, stream: bool = True, headers: dict[str, str] | None = None,
         model: str = MODEL) -> None:
    body = {"model": model, "stream": stream, "max_tokens": 4,
            "messages": [{"role": "user", "content": prompt(200 + 250 * i, i)}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", base + "/v1/chat/completions",
                                                 json=body, headers=headers) as r:
        assert r.status_code == 200
        for _ in r.iter_bytes():
            pass


def counted(base: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(base + "/metrics", headers=headers, timeout=10).text
    found = re.findall(r"^llm_proxy_requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in found)


def wait_counted(base: str, n: int, headers: dict[str, str] | None = None) -> None:
    """The proxy records a request just after its client saw the end: poll its counter."""
    deadline = time.monotonic() + 20
    while counted(base, headers) < n:
        assert time.monotonic() < deadline, f"the proxy never counted {n} requests"
        time.sleep(0.01)  # polling the proxy's counter, not timing anything


@contextlib.contextmanager
def live_proxy(**settings: Any) -> Iterator[str]:
    with serve_in_thread(create_simulator_app(SIM)) as sim, \
            served(sim.url, upstream_name="sim", **settings) as (proxy, _):
        yield proxy.url


@pytest.fixture(scope="module")
def live() -> Iterator[str]:
    """A proxy that has served STREAMS streams of growing prompts and two answers not
    streamed, all counted."""
    with live_proxy(prefix_doctor=True) as url:  # the missed cache is known: 0
        for i in range(STREAMS):
            send(url, i)
        send(url, 1, stream=False)
        send(url, 2, stream=False)
        wait_counted(url, STREAMS + 2)
        yield url


@pytest.mark.e2e
def test_json_against_a_live_proxy(live: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "--url", live + "/v1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    check_contract(doc)
    assert doc["source"] == {"kind": "proxy", "url": live + "/metrics", "window": "since_start",
                             "window_s": None, "fit_from": "counters"}
    (s,) = doc["selections"]
    assert (s["route"], s["model"], s["upstream"]) == (CHAT, MODEL, "sim")
    assert s["requests"] == STREAMS + 2
    assert s["decode"]["streams"] == STREAMS and s["output"]["responses"] == STREAMS + 2
    assert s["first_token"]["mean_ms"] is not None
    assert s["first_token"]["upstream_queue_ms"] is not None  # --vllm-metrics reports it
    # the prompt-cache doctor (on by default) found no prefix repeated: nothing missed
    assert s["first_token"]["missed_cache_ms"] == 0
    assert levers_named(s)["prompt_cache"]["numbers"]["missed_cache_tokens"] == 0


def levers_named(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {lv["name"]: lv for lv in s["levers"]}


@pytest.mark.e2e
def test_card_and_filters_against_a_live_proxy(live: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diagnose", "--url", live + "/metrics", "--model", MODEL]) == 0
    card = capsys.readouterr().out
    assert card.startswith(f"What to fix: {live}/metrics\n")
    assert f"{CHAT}   model {MODEL}   upstream sim   ({STREAMS + 2} requests)" in card
    assert " 1. " in card and " 7. " in card  # seven levers, the prompt-cache doctor's too
    assert "prompt_cache" in card
    assert main(["diagnose", "--url", live, "--route", "/v1/completions", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["selections"] == []
    assert out.err == ("diagnose: no measured requests match --route /v1/completions "
                       f"(routes: {CHAT})\n")


@pytest.mark.e2e
def test_window_counts_the_requests_between_its_two_scrapes(live: str) -> None:
    """``--window`` in its own process: three requests sent after its first scrape (its
    stderr line says when) are the window, the 26 before are not."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "diagnose", "--url", live, "--window", "4", "--json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line == f"diagnose: scraped {live}/metrics; the second scrape in 4 s\n", line
        for i in range(3):
            send(live, 30 + i)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    doc = json.loads(out)
    check_contract(doc)
    assert doc["source"]["window"] == "between_scrapes" and doc["source"]["window_s"] == 4
    (s,) = doc["selections"]
    assert s["requests"] == 3 and s["decode"]["streams"] == 3
    # three streams are too few to advise on: each lever says so
    assert {lv["status"] for lv in s["levers"]} == {"too_little_data"}
    assert all("too little data" in lv["sentence"] or "not known yet" in lv["sentence"]
               for lv in s["levers"]), s["levers"]


# ---------------------------------------------------------------------------
# A proxy that checks client keys


@pytest.mark.e2e
def test_a_proxy_that_checks_client_keys_takes_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    key = "cli-" + secrets.token_hex(12)
    keys = tmp_path / "keys"
    keys.write_text(digest(key) + "\n")
    monkeypatch.setenv("TEST_DIAGNOSE_UPSTREAM_KEY", "srv-" + secrets.token_hex(8))
    monkeypatch.delenv("LLM_PROXY_API_KEY", raising=False)
    auth = {"authorization": f"Bearer {key}"}
    with live_proxy(upstream_api_key_env="TEST_DIAGNOSE_UPSTREAM_KEY",
                    client_keys_file=str(keys)) as url:
        send(url, 3, headers=auth)
        wait_counted(url, 1, auth)
        assert main(["diagnose", "--url", url]) == 1
        err = capsys.readouterr().err
        assert err == (f"diagnose: {url}/metrics answered 401: the proxy checks client keys "
                       "and none was given; pass one with --api-key or LLM_PROXY_API_KEY\n")
        assert main(["diagnose", "--url", url, "--api-key", "wrong"]) == 1
        assert "the key given was refused" in capsys.readouterr().err
        assert main(["diagnose", "--url", url, "--api-key", key, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["selections"][0]["requests"] == 1
        monkeypatch.setenv("LLM_PROXY_API_KEY", key)
        assert main(["diagnose", "--url", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["selections"][0]["requests"] == 1


def test_importing_the_command_or_the_evidence_imports_no_client_or_metric_library() -> None:
    """``--help`` stays quick, and the live page may import :mod:`proxy.evidence` on the
    serving path, where prometheus_client must not be imported before the multiprocess
    directory is set."""
    code = ("import sys, proxy.diagnose, proxy.evidence; "
            "print(sorted(m for m in ('httpx', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert out == "[]\n", out
