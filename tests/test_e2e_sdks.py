"""End to end for the Responses and Messages APIs: the official SDKs -> proxy -> simulator.

All three are real: the ``openai`` and ``anthropic`` SDKs as clients, the proxy under
uvicorn (httptools, so the relay's direct writer is the path under test), the
simulator under uvicorn. The simulator runs a fixed schedule (no jitter, no decode
slow-down, a prefill so fast that only its fixed overhead counts): opening events at
once, the first reasoning delta ``PREFILL`` after the request arrived, then one output
event every ``ITL``, the answer starting after ``REASONING`` reasoning deltas. So the
proxy's TTFT must sit just above ``PREFILL``, its time to first answer token just above
``PREFILL + REASONING x ITL``, it must see exactly one ITL gap per pair of output
events, and its tokens must be exactly the usage the SDK reports. The simulator records
the bytes it sent and when it sent them, so a raw client through the proxy can be
compared byte for byte, and the proxy's figures are held against what the simulator
did, not only against its schedule: on a loaded machine the simulator's own wake-ups
come late (a first token due at 100 ms sent at 190 ms, with other test runs on both
cores), and the proxy must only add its own small delay to that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings
from proxy.simulator.app import create_simulator_app
from proxy.simulator.model import SimConfig
from tests.servers import RunningServer, serve_in_thread

pytestmark = pytest.mark.e2e

PREFILL = 0.5
ITL = 0.1
OUTPUT = 8  # output tokens, reasoning included
REASONING = 3
MODEL = "sim-llm"
# The proxy's own delay on top of what the simulator did: typically 1-3 ms, but the
# proxy, the simulator and the client share this process, and under a CPU burner on both
# cores of a 2-core machine the proxy's TTFT came 164 ms after the simulator's. A proxy
# that took an opening event for a token would be early, which the lower bounds catch
# exactly; one that held events back would be late by whole ITLs (the stream lasts 0.7 s
# after its first token); one that took the first token for its first byte, late by
# PREFILL.
SLACK = 0.3
OUTPUT_EVENTS = (b'"type":"response.reasoning_text.delta"', b'"type":"response.output_text.delta"',
                 b'"type":"thinking_delta"', b'"type":"text_delta"')
ANSWER_EVENTS = (b'"type":"response.output_text.delta"', b'"type":"text_delta"')

CONFIG = SimConfig(prefill_rate=1e9, prefill_overhead=PREFILL, itl=ITL, itl_growth=0.0,
                   jitter=0.0, output_tokens=OUTPUT, output_dist="fixed",
                   reasoning_tokens=REASONING, seed=3)


@dataclass(frozen=True)
class Sent:
    """What the simulator did for one request, from the moment its app was called."""

    start: float
    parts: tuple[tuple[float, bytes], ...]  # each body part, as it was handed to the server

    def first(self, markers: tuple[bytes, ...]) -> float:
        return next(t for t, body in self.parts if any(m in body for m in markers)) - self.start

    def last(self, markers: tuple[bytes, ...]) -> float:
        found = [t for t, body in self.parts if any(m in body for m in markers)]
        return found[-1] - self.start


class Recorder:
    """ASGI wrapper keeping the body bytes the simulator sent, per request, and when."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[bytes] = []
        self.sent: list[Sent] = []

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()  # the proxy's clock (create_app's default)
        parts: list[tuple[float, bytes]] = []

        async def recording_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.body":
                parts.append((time.perf_counter(), message.get("body", b"")))
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.sent.append(Sent(start, tuple(parts)))
            self.bodies.append(b"".join(body for _, body in parts))

    def wait_for(self, count: int) -> Sent:
        """The ``count``-th request's record (1-based), once its handler has ended."""
        flag = threading.Event()
        deadline = time.monotonic() + 10
        while len(self.sent) < count:  # the simulator records when its handler ends
            assert time.monotonic() < deadline, "the simulator never finished the request"
            flag.wait(0.005)  # polling the recorder, not timing anything
        return self.sent[count - 1]


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Recorder, RunningServer, CollectorRegistry]]:
    recorder = Recorder(create_simulator_app(CONFIG))
    registry = CollectorRegistry()
    with serve_in_thread(recorder) as sim:
        settings = Settings(upstream=sim.url + "/v1", upstream_name="sim")
        with serve_in_thread(create_app(settings, registry=registry)) as proxy:
            yield recorder, proxy, registry


def value(registry: CollectorRegistry, name: str, route: str, **extra: str) -> float:
    return registry.get_sample_value(
        name, {"route": route, "model": MODEL, "upstream": "sim", **extra}) or 0.0


def wait_counted(registry: CollectorRegistry, route: str, stream: str, count: float) -> None:
    """The SDK may finish reading before the proxy has recorded the request: wait (bounded)
    for ``llm_proxy_requests_total``, which the proxy increments after every other
    observation of the request."""
    flag = threading.Event()
    deadline = time.monotonic() + 10
    while value(registry, "llm_proxy_requests_total", route, stream=stream, code="200") < count:
        assert time.monotonic() < deadline, "the request was never recorded"
        flag.wait(0.005)  # polling the registry, not timing anything


class Histograms:
    """Count and sum of each timing histogram for one route, before and after a request."""

    NAMES = ("time_to_first_token_seconds", "time_to_first_answer_token_seconds",
             "time_to_first_byte_seconds", "inter_token_latency_seconds",
             "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "reasoning_tokens",
             "cache_write_prompt_tokens")

    def __init__(self, registry: CollectorRegistry, route: str) -> None:
        self.values = {n: (value(registry, f"llm_proxy_{n}_count", route),
                           value(registry, f"llm_proxy_{n}_sum", route)) for n in self.NAMES}

    def delta(self, after: Histograms, name: str) -> tuple[float, float]:
        (c0, s0), (c1, s1) = self.values[name], after.values[name]
        return c1 - c0, s1 - s0


def assert_schedule(before: Histograms, after: Histograms, sim: Sent) -> None:
    """The simulator kept its schedule, never early (it may be late); the proxy's figures
    contain what the simulator did (the proxy receives the request before the simulator
    and hands each event on after it), with at most SLACK of its own delay."""
    sim_ttft, sim_ttfa = sim.first(OUTPUT_EVENTS), sim.first(ANSWER_EVENTS)
    sim_last = sim.last(OUTPUT_EVENTS)
    sim_gaps = sim_last - sim_ttft
    # Each event is due on a schedule from the request's start: a late one does not
    # move the next (so the gaps may add up to less than their due length).
    assert sim_ttft >= PREFILL
    assert sim_ttfa >= PREFILL + REASONING * ITL
    assert sim_last >= PREFILL + (OUTPUT - 1) * ITL - 0.001  # timer slack
    count, ttft = before.delta(after, "time_to_first_token_seconds")
    assert count == 1
    assert sim_ttft <= ttft < sim_ttft + SLACK, (ttft, sim_ttft)
    count, ttfa = before.delta(after, "time_to_first_answer_token_seconds")
    assert count == 1
    assert sim_ttfa <= ttfa < sim_ttfa + SLACK, (ttfa, sim_ttfa)
    count, ttfb = before.delta(after, "time_to_first_byte_seconds")
    assert count == 1
    # The proxy, which received the request before the simulator, had its first byte
    # before the simulator sent a token: the opening events, sent at once.
    assert ttfb < sim_ttft, (ttfb, sim_ttft)
    count, itl_sum = before.delta(after, "inter_token_latency_seconds")
    assert count == OUTPUT - 1  # one gap per pair of output events
    assert abs(itl_sum - sim_gaps) < SLACK, (itl_sum, sim_gaps)


def test_openai_responses_stream_through_the_proxy(
        stack: tuple[Recorder, RunningServer, CollectorRegistry]) -> None:
    recorder, proxy, registry = stack
    route = "/v1/responses"
    before = Histograms(registry, route)
    served = len(recorder.sent)
    with openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0,
                       timeout=30) as client:
        stream = client.responses.create(model=MODEL, input="Say something.",
                                         max_output_tokens=OUTPUT,
                                         reasoning={"effort": "low"}, stream=True)
        types = [event.type for event in stream]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types.count("response.reasoning_text.delta") == REASONING
    assert types.count("response.output_text.delta") == OUTPUT - REASONING
    # max_output_tokens reached: the model stopped for a reason the client sees
    assert types[-1] == "response.incomplete"
    wait_counted(registry, route, "true", 1)
    after = Histograms(registry, route)
    assert_schedule(before, after, recorder.wait_for(served + 1))
    assert before.delta(after, "completion_tokens") == (1, OUTPUT)
    assert before.delta(after, "reasoning_tokens") == (1, REASONING)
    assert before.delta(after, "prompt_tokens")[0] == 1
    assert value(registry, "llm_proxy_stream_outcomes_total", route, outcome="completed") == 1


def test_openai_responses_non_stream_usage(
        stack: tuple[Recorder, RunningServer, CollectorRegistry]) -> None:
    _, proxy, registry = stack
    route = "/v1/responses"
    before = Histograms(registry, route)
    count_before = value(registry, "llm_proxy_requests_total", route, stream="false", code="200")
    with openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0,
                       timeout=30) as client:
        response = client.responses.create(model=MODEL, input="Say something.")
    assert response.usage is not None
    wait_counted(registry, route, "false", count_before + 1)
    after = Histograms(registry, route)
    assert before.delta(after, "prompt_tokens") == (1, response.usage.input_tokens)
    assert before.delta(after, "completion_tokens") == (1, response.usage.output_tokens)
    assert before.delta(after, "cached_prompt_tokens") == (
        1, response.usage.input_tokens_details.cached_tokens)
    assert before.delta(after, "time_to_first_token_seconds")[0] == 0  # streams only


def test_anthropic_messages_stream_through_the_proxy(
        stack: tuple[Recorder, RunningServer, CollectorRegistry]) -> None:
    recorder, proxy, registry = stack
    route = "/v1/messages"
    before = Histograms(registry, route)
    served = len(recorder.sent)
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0,
                             timeout=30) as client, client.messages.stream(
            model=MODEL, max_tokens=OUTPUT, messages=[{"role": "user", "content": "Hi."}],
            thinking={"type": "enabled", "budget_tokens": 32}) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    wait_counted(registry, route, "true", 1)
    after = Histograms(registry, route)
    assert_schedule(before, after, recorder.wait_for(served + 1))
    usage = message.usage
    prompt = (usage.input_tokens + (usage.cache_read_input_tokens or 0)
              + (usage.cache_creation_input_tokens or 0))
    assert before.delta(after, "prompt_tokens") == (1, prompt)
    assert before.delta(after, "completion_tokens") == (1, usage.output_tokens)
    assert before.delta(after, "cached_prompt_tokens") == (1, usage.cache_read_input_tokens or 0)


def test_anthropic_messages_create_usage(
        stack: tuple[Recorder, RunningServer, CollectorRegistry]) -> None:
    _, proxy, registry = stack
    route = "/v1/messages"
    before = Histograms(registry, route)
    count_before = value(registry, "llm_proxy_requests_total", route, stream="false", code="200")
    with anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-test", max_retries=0,
                             timeout=30) as client:
        message = client.messages.create(model=MODEL, max_tokens=OUTPUT,
                                         messages=[{"role": "user", "content": "Hi."}])
    wait_counted(registry, route, "false", count_before + 1)
    after = Histograms(registry, route)
    usage = message.usage
    prompt = (usage.input_tokens + (usage.cache_read_input_tokens or 0)
              + (usage.cache_creation_input_tokens or 0))
    assert before.delta(after, "prompt_tokens") == (1, prompt)
    assert before.delta(after, "completion_tokens") == (1, usage.output_tokens)


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/responses", {"model": MODEL, "input": "Hi.", "stream": True,
                       "max_output_tokens": OUTPUT, "reasoning": {"effort": "low"}}),
    ("/v1/messages", {"model": MODEL, "max_tokens": OUTPUT, "stream": True,
                      "messages": [{"role": "user", "content": "Hi."}],
                      "thinking": {"type": "enabled", "budget_tokens": 32}}),
    ("/v1/chat/completions", {"model": MODEL, "stream": True, "reasoning_effort": "low",
                              "max_tokens": OUTPUT,
                              "stream_options": {"include_usage": True},
                              "messages": [{"role": "user", "content": "Hi."}]}),
])
def test_client_bytes_are_the_upstreams_bytes(
        stack: tuple[Recorder, RunningServer, CollectorRegistry], route: str,
        body: dict[str, Any]) -> None:
    recorder, proxy, _ = stack
    sent_before = len(recorder.bodies)
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", proxy.url + route, json=body,
            headers={"x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200
        got = b"".join(response.iter_raw())
    flag = threading.Event()
    deadline = time.monotonic() + 10
    while len(recorder.bodies) <= sent_before:  # the simulator records when its handler ends
        assert time.monotonic() < deadline
        flag.wait(0.005)
    assert got == recorder.bodies[sent_before]
    assert got.count(b"\n\n") > OUTPUT  # a whole stream, not an empty answer
