"""Two upstreams end to end: the official ``openai`` and ``anthropic`` SDKs -> the proxy
as users run it (``llm-latency-proxy serve --config FILE``, a real process) -> two
simulators on loopback with different schedules.

The ``fast`` upstream answers its first token ``FAST`` after the request arrives, the
``slow`` one ``SLOW`` after; the proxy's TTFT under each ``upstream`` label must sit just
above that upstream's own figure, and the ``client`` label must carry the team header.
Then ``SIGHUP`` with a stream in flight, with one process and with two workers: the
stream completes, and the next request goes where the rewritten file says.
"""

from __future__ import annotations

import http.client
import re
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.simulator.app import create_simulator_app
from proxy.simulator.model import SimConfig
from tests.servers import RunningServer, serve_in_thread
from tests.test_startup import BANNER, serving

pytestmark = pytest.mark.e2e

FAST, SLOW = 0.05, 0.4  # each upstream's time to first token (its fixed prefill)
ITL = 0.01
OUTPUT = 6
SLACK = 0.06  # loopback, two simulators and a proxy on a shared 2-core machine


def sim(prefill: float, output: int = OUTPUT, itl: float = ITL) -> Iterator[RunningServer]:
    config = SimConfig(prefill_rate=1e9, prefill_overhead=prefill, itl=itl, itl_growth=0.0,
                       jitter=0.0, output_tokens=output, output_dist="fixed",
                       reasoning_tokens=0, models=("gpt-4o", "claude-3", "sim-llm"), seed=1)
    with serve_in_thread(create_simulator_app(config)) as server:
        yield server


@pytest.fixture(scope="module")
def fast() -> Iterator[RunningServer]:
    yield from sim(FAST)


@pytest.fixture(scope="module")
def slow() -> Iterator[RunningServer]:
    yield from sim(SLOW, output=40, itl=0.025)  # long enough to reload under a stream


def config_text(fast_url: str, slow_url: str, gpt_to: str = "fast") -> str:
    gpt_fast = '"gpt-*", ' if gpt_to == "fast" else ""
    gpt_slow = ', "gpt-*"' if gpt_to == "slow" else ""
    return textwrap.dedent(f"""
        client_label_from = "header:X-Team"

        [[upstream]]
        name = "fast"
        url = "{fast_url}/v1"
        models = [{gpt_fast}"sim-llm"]
        default = true

        [[upstream]]
        name = "slow"
        url = "{slow_url}/v1"
        models = ["claude-*"{gpt_slow}]
        """)


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **where: str) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and set(where.items()) <= labels)


def test_each_upstream_label_carries_its_own_ttft_for_both_sdks(
        fast: RunningServer, slow: RunningServer, tmp_path: Path) -> None:
    path = tmp_path / "proxy.toml"
    path.write_text(config_text(fast.url, slow.url))
    with serving("--config", str(path), "--port", "0") as proc:
        port = int(proc.wait_for(BANNER)[1])
        base = f"http://127.0.0.1:{port}"
        team = {"X-Team": "search"}
        with openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0,
                           timeout=30, default_headers=team) as client:
            for _ in range(3):
                stream = client.chat.completions.create(
                    model="gpt-4o", stream=True, messages=[{"role": "user", "content": "hi"}])
                assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) == OUTPUT
            models = {m.id for m in client.models.list()}
        assert {"gpt-4o", "claude-3"} <= models  # the union of both upstreams' lists
        with anthropic.Anthropic(base_url=base, api_key="sk-ant-test", max_retries=0,
                                 timeout=30, default_headers={"X-Team": "ads"}) as aclient:
            for _ in range(3):
                with aclient.messages.stream(model="claude-3", max_tokens=64, messages=[
                        {"role": "user", "content": "hi"}]) as mstream:
                    text = "".join(mstream.text_stream)
                assert text
        samples = scrape(port)
        assert proc.stop() == 0
    ttft = "llm_proxy_time_to_first_token_seconds"
    figures = {}
    for upstream, route, client_ in (("fast", "/v1/chat/completions", "search"),
                                     ("slow", "/v1/messages", "ads")):
        count = total(samples, ttft + "_count", upstream=upstream, route=route, client=client_)
        mean = total(samples, ttft + "_sum", upstream=upstream, route=route,
                     client=client_) / count
        figures[upstream] = mean
        assert count == 3
    print(f"TTFT per upstream (mean of 3, proxy-measured): fast {figures['fast'] * 1000:.1f} ms "
          f"(schedule {FAST * 1000:.0f} ms), slow {figures['slow'] * 1000:.1f} ms "
          f"(schedule {SLOW * 1000:.0f} ms)")
    assert FAST <= figures["fast"] < FAST + SLACK
    assert SLOW <= figures["slow"] < SLOW + SLACK
    # nothing went to the wrong upstream
    assert total(samples, ttft + "_count", upstream="fast", route="/v1/messages") == 0
    assert total(samples, ttft + "_count", upstream="slow", route="/v1/chat/completions") == 0


RELOADED = re.compile(r"config reloaded from ")


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_reloads_with_a_stream_in_flight(
        fast: RunningServer, slow: RunningServer, tmp_path: Path, workers: int) -> None:
    path = tmp_path / "proxy.toml"
    path.write_text(config_text(fast.url, slow.url))
    with serving("--config", str(path), "--port", "0", "--workers", str(workers)) as proc:
        port = int(proc.wait_for(BANNER)[1])
        base = f"http://127.0.0.1:{port}"
        with anthropic.Anthropic(base_url=base, api_key="sk-ant-test", max_retries=0,
                                 timeout=30) as aclient, \
                openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0,
                              timeout=30) as client:
            with aclient.messages.stream(model="claude-3", max_tokens=64, messages=[
                    {"role": "user", "content": "hi"}]) as mstream:
                pieces = mstream.text_stream
                first = next(pieces)  # the stream is flowing from the slow upstream
                path.write_text(config_text(fast.url, slow.url, gpt_to="slow"))
                proc.popen.send_signal(signal.SIGHUP)
                for _ in range(workers):
                    proc.wait_for(RELOADED)
                rest = "".join(pieces)
                final = mstream.get_final_message()
            assert first and rest
            # the whole answer arrived: the simulator writes max_tokens tokens here
            assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 64
            # the next request follows the new table: gpt-* now lives on the slow upstream
            for _ in range(workers * 2):  # reaches every worker with high probability
                client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
            # a bad file is refused and the running table stays
            path.write_text("[[upstream]\n")
            proc.popen.send_signal(signal.SIGHUP)
            proc.wait_for(re.compile(r"config reload refused, the running upstreams stay"))
            client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        samples = scrape(port)
        assert proc.stop() == 0
    requests = "llm_proxy_requests_total"
    assert total(samples, requests, upstream="slow", route="/v1/chat/completions") == workers * 2 + 1
    assert total(samples, requests, upstream="fast", route="/v1/chat/completions") == 0
    assert total(samples, "llm_proxy_stream_outcomes_total", upstream="slow",
                 route="/v1/messages", outcome="completed") == 1
