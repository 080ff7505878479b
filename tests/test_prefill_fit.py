"""The prefill fit's counters, exactly as scripted (the proxy in process, the suite's
scripted upstream on loopback behind it, the production upstream client between).

Each stream's x (uncached prompt tokens / 1000) and y (time to first token less the
proxy's queue time) are known from the script, so every sum is checked to the last
bit, and the fit read back from the counters is the fit of those points.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.diagnosis.fit import SAMPLES, SKIPPED_SAMPLE, FitSums, fit
from tests.test_proxy_inprocess import (
    OUTPUT_TIMES,
    T0,
    BodyClock,
    chat_script,
    client_for,
    sse_upstream,
    stream_request,
    until_queued,
)
from tests.upstream_fakes import (
    CHAT,
    SSE_HEADERS,
    FakeUpstream,
    ScriptedClock,
    chunk_json,
    labels,
    lazy,
    make_app,
    sse,
    usage_json,
)

pytestmark = pytest.mark.anyio


def sums(registry: CollectorRegistry, **extra: str) -> FitSums:
    lbl = labels(**extra)
    return FitSums.from_samples(
        (name, registry.get_sample_value(name, lbl) or 0.0) for name in SAMPLES)


def skipped(registry: CollectorRegistry) -> float:
    return registry.get_sample_value(SKIPPED_SAMPLE, labels()) or 0.0


async def test_a_stream_adds_its_uncached_tokens_and_first_token_time() -> None:
    clock = ScriptedClock()
    up = sse_upstream(clock, chat_script(usage=usage_json(13_000, 21, cached=8_000)))
    app, registry = make_app(up, clock)
    async with app:
        async with client_for(BodyClock(app, clock)) as client:
            response = await client.post(CHAT, json=stream_request())
        assert response.status_code == 200
    x, y = (13_000 - 8_000) / 1000, OUTPUT_TIMES[0] - T0  # 5.0, 0.5: exact in binary
    assert sums(registry) == FitSums(1, x, y, x * y, x * x, y * y, x * x * x, (x * x) * (x * x), x * x * y)
    assert skipped(registry) == 0


async def test_usage_without_cached_tokens_counts_the_whole_prompt() -> None:
    clock = ScriptedClock()
    up = sse_upstream(clock, chat_script(usage=usage_json(3_000, 21)))
    app, registry = make_app(up, clock)
    async with app, client_for(BodyClock(app, clock)) as client:
        await client.post(CHAT, json=stream_request())
    assert sums(registry).sx == 3.0


async def test_queue_time_in_the_proxy_is_not_first_token_time() -> None:
    """Two streams through one admission slot: the second waits in the proxy while the
    first runs (0.5 s), which its TTFT includes and its y does not."""
    clock = ScriptedClock()
    gate = asyncio.Event()

    async def respond(request: httpx.Request) -> httpx.Response:
        first = request.headers["x-test"] == "a"

        async def body() -> AsyncIterator[bytes]:
            if first:  # a: admitted at T0, first token at T0 + 0.25, ends at T0 + 0.5
                await gate.wait()
                clock.now = T0 + 0.25
            else:  # b: admitted when a ended, first token 0.25 s later
                clock.now = T0 + 0.75
            yield sse(chunk_json({"content": "x"}))
            if first:
                clock.now = T0 + 0.5
            yield sse(usage_json(2_000 if first else 6_000, 1))
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers=SSE_HEADERS, content=body())

    app, registry = make_app(FakeUpstream(respond), clock, max_concurrency=1)
    async with app:
        clock.now = T0
        async with client_for(app) as client:
            a = asyncio.create_task(client.post(CHAT, json=stream_request(),
                                                headers={"x-test": "a"}))
            b = asyncio.create_task(client.post(CHAT, json=stream_request(),
                                                headers={"x-test": "b"}))
            await until_queued(app)  # both arrived at T0
            gate.set()
            await asyncio.gather(a, b)
    first_token, waited = 0.25, 0.5
    queue_sum = registry.get_sample_value("llm_proxy_queue_time_seconds_sum",
                                         {**labels(), "stream": "true"})
    assert queue_sum == waited
    ttft_sum = registry.get_sample_value("llm_proxy_time_to_first_token_seconds_sum", labels())
    assert ttft_sum == first_token + (waited + first_token)
    assert sums(registry) == FitSums.of([(2_000.0, first_token), (6_000.0, first_token)])
    line = fit(sums(registry))
    assert line.ms_per_1k_tokens == 0 and line.fixed_ms == first_token * 1000


async def test_streams_without_usage_are_fitted_with_the_estimate_and_counted() -> None:
    """No usage (an upstream that ignores the request for it): the prompt tokens are the
    proxy's estimate from the body, fitted and counted as estimated, so the fit of such
    an upstream is not empty (it was: every request was skipped)."""
    clock = ScriptedClock()
    up = sse_upstream(clock, chat_script(usage=None))
    app, registry = make_app(up, clock, inject_usage=False)
    body = stream_request()
    async with app, client_for(BodyClock(app, clock)) as client:
        await client.post(CHAT, json=body)
    assert registry.get_sample_value("llm_proxy_prompt_tokens_count", labels()) == 1
    estimate = registry.get_sample_value("llm_proxy_prompt_tokens_sum", labels())
    assert estimate is not None and estimate > 0
    x, y = estimate / 1000, OUTPUT_TIMES[0] - T0
    assert sums(registry) == FitSums(1, x, y, x * y, x * x, y * y, x * x * x, (x * x) * (x * x), x * x * y)
    assert skipped(registry) == 0
    assert registry.get_sample_value(
        "llm_proxy_prefill_fit_estimated_requests_total", labels()) == 1


async def test_non_streamed_answers_have_no_first_token_and_stay_out() -> None:
    clock = ScriptedClock()
    body = {"id": "x", "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7000, "completion_tokens": 3}}

    async def respond(request: httpx.Request) -> httpx.Response:
        clock.now = T0 + 0.75
        return httpx.Response(200, headers={"content-type": "application/json"},
                              content=lazy(json.dumps(body).encode()))

    app, registry = make_app(FakeUpstream(respond), clock)
    async with app, client_for(BodyClock(app, clock)) as client:
        await client.post(CHAT, json={"model": "m", "messages": []})
    assert sums(registry) == FitSums()
    assert skipped(registry) == 0


async def test_help_texts_state_the_scaling_and_units() -> None:
    clock = ScriptedClock()
    app, registry = make_app(sse_upstream(clock, chat_script()), clock)
    async with app:
        helps: dict[str, Any] = {
            f.name: f.documentation for f in registry.collect()
            if f.name.startswith("llm_proxy_prefill_fit")}
    assert {f"{name}_total" for name in helps} == {
        *SAMPLES, SKIPPED_SAMPLE, "llm_proxy_prefill_fit_estimated_requests_total"}
    for name, text in helps.items():
        if name + "_total" in SAMPLES:
            assert "uncached prompt tokens / 1000" in text, name
            assert "minus the proxy's queue time, in seconds" in text, name
            assert "(n*Sxy - Sx*Sy) / (n*Sxx - Sx^2)" in text, name
