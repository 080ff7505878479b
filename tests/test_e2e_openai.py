"""End to end: official openai SDK -> proxy (uvicorn) -> scheduled upstream (its own thread).

The upstream's schedule is known (first token ``ttft`` after it got the request, then
one every ``itl``) and it records when it sent each token, so the proxy's TTFT must sit
just above what the upstream did (plus loopback and the proxy's own cost) and its ITL
gaps must add up to the upstream's. The upstream is never early, but on a loaded
machine its wake-ups come late (a first token due at 150 ms sent at about 200 ms under
a CPU burner on both cores), so the bounds are on what it did, not on the schedule.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings
from tests.fake_upstream import Scheduled, ScriptedUpstream
from tests.servers import RunningServer, serve_in_thread

pytestmark = pytest.mark.e2e

TTFT = 0.5
ITL = 0.1
TOKENS = 12
# The proxy's own delay on top of the upstream's: typically a few ms, but the proxy, the
# upstream and the client share this process and, on a loaded 2-core machine, its cores.
# Taking the role-only chunk for a token would make the proxy early (caught exactly);
# holding tokens back would make it late by whole ITLs (the stream lasts 1.1 s).
SLACK = 0.3
# The client may stamp the first token before the proxy does: the proxy reads its clock
# just after its send() returns, and its thread may wait for the GIL or a core meanwhile
# (tests/test_bench.py measured up to 20 ms). Timing the second token would be ITL late.
CLIENT_FIRST_S = 0.05
LABELS = {"route": "/v1/chat/completions", "model": "sched-model", "upstream": "sched"}


@pytest.fixture
def upstream() -> Iterator[tuple[Scheduled, ScriptedUpstream]]:
    fake = Scheduled(ttft=TTFT, itl=ITL, tokens=TOKENS, prompt_tokens=9, cached_tokens=4)
    with ScriptedUpstream(fake).running() as server:
        yield fake, server


@pytest.fixture
def proxied(upstream: tuple[Scheduled, ScriptedUpstream]
            ) -> Iterator[tuple[Scheduled, RunningServer, CollectorRegistry, ScriptedUpstream]]:
    fake, up = upstream
    registry = CollectorRegistry()
    settings = Settings(upstream=up.url + "/v1", upstream_name="sched")
    with serve_in_thread(create_app(settings, registry=registry)) as proxy_server:
        yield fake, proxy_server, registry, up


def sample(registry: CollectorRegistry, name: str, **extra: str) -> float:
    value = registry.get_sample_value(name, {**LABELS, **extra})
    assert value is not None, f"{name} {extra} not exported"
    return value


def wait_recorded(registry: CollectorRegistry, name: str, expected: float, **extra: str) -> None:
    """The SDK stops at ``[DONE]``; the proxy records when the upstream body ends, a moment
    later. Wait (bounded) for the record rather than race it."""
    flag = threading.Event()
    deadline = time.monotonic() + 10.0
    while registry.get_sample_value(name, {**LABELS, **extra}) != expected:
        assert time.monotonic() < deadline, f"{name} never reached {expected}"
        flag.wait(0.005)  # polling the registry, not timing anything


def test_streaming_through_proxy_matches_schedule(
        proxied: tuple[Scheduled, RunningServer, CollectorRegistry, ScriptedUpstream]) -> None:
    fake, server, registry, up = proxied
    client = OpenAI(base_url=server.url + "/v1", api_key="sk-test-not-a-key", max_retries=0)
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="sched-model", messages=[{"role": "user", "content": "hi"}], stream=True)
    pieces = []
    first_seen = None
    for event in stream:
        # The SDK yields parsed chunks; the usage-only chunk the proxy asked for must not appear.
        assert event.choices, "the proxy's own usage event reached the client"
        text = event.choices[0].delta.content
        if text and first_seen is None:
            first_seen = time.perf_counter() - started
        pieces.append(text or "")
    assert "".join(pieces) == "".join(f"t{i} " for i in range(TOKENS))
    assert first_seen is not None and first_seen >= TTFT

    # The upstream was asked for usage on the client's behalf.
    assert up.requests[-1].json["stream_options"] == {"include_usage": True}

    wait_recorded(registry, "llm_proxy_requests_total", 1, stream="true", code="200")
    count = sample(registry, "llm_proxy_time_to_first_token_seconds_count")
    ttft = sample(registry, "llm_proxy_time_to_first_token_seconds_sum")
    assert count == 1
    # TTFT: the upstream's first token is due TTFT after *it* received the request, and
    # the proxy received the request before the upstream did.
    [(arrived, sent)] = fake.streams
    upstream_ttft = sent[0] - arrived
    assert TTFT <= upstream_ttft <= ttft < upstream_ttft + SLACK, (upstream_ttft, ttft)
    assert ttft <= first_seen + CLIENT_FIRST_S  # handed on before the client saw it

    gaps = sample(registry, "llm_proxy_inter_token_latency_seconds_count")
    gap_sum = sample(registry, "llm_proxy_inter_token_latency_seconds_sum")
    assert gaps == TOKENS - 1
    assert abs(gap_sum - (sent[-1] - sent[0])) < SLACK, (gap_sum, sent[-1] - sent[0])
    tpot = sample(registry, "llm_proxy_time_per_output_token_seconds_sum")
    assert abs(tpot - gap_sum / (TOKENS - 1)) < 1e-9  # one token per event here
    assert sample(registry, "llm_proxy_prompt_tokens_sum") == 9
    assert sample(registry, "llm_proxy_cached_prompt_tokens_sum") == 4
    assert sample(registry, "llm_proxy_completion_tokens_sum") == TOKENS
    assert sample(registry, "llm_proxy_stream_outcomes_total", outcome="completed") == 1
    assert sample(registry, "llm_proxy_requests_total", stream="true", code="200") == 1


def test_non_streaming_through_proxy(
        proxied: tuple[Scheduled, RunningServer, CollectorRegistry, ScriptedUpstream]) -> None:
    _fake, server, registry, _ = proxied
    client = OpenAI(base_url=server.url + "/v1", api_key="sk-test-not-a-key", max_retries=0)
    answer = client.chat.completions.create(
        model="sched-model", messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None and answer.usage.completion_tokens == TOKENS
    wait_recorded(registry, "llm_proxy_requests_total", 1, stream="false", code="200")
    assert sample(registry, "llm_proxy_completion_tokens_sum") == TOKENS
    assert sample(registry, "llm_proxy_prompt_tokens_sum") == 9
    duration = sample(registry, "llm_proxy_request_duration_seconds_sum", stream="false")
    assert duration >= TTFT + ITL * (TOKENS - 1)
    assert registry.get_sample_value("llm_proxy_time_to_first_token_seconds_count", LABELS) == 0


def test_client_disconnect_closes_upstream_request(
        proxied: tuple[Scheduled, RunningServer, CollectorRegistry, ScriptedUpstream]) -> None:
    fake, server, registry, _ = proxied
    body = {"model": "sched-model", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client(base_url=server.url, timeout=5) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
        for raw in response.iter_raw():
            if b't0 ' in raw:
                break
        gone = time.perf_counter()
    # Leaving the block closed the client's connection mid-stream.
    assert fake.closed.wait(10.0), "the upstream request was not closed"
    assert fake.closed_at[0] - gone < 0.1
    assert not fake.finished.is_set()
    wait_recorded(registry, "llm_proxy_stream_outcomes_total", 1, outcome="client_disconnected")
