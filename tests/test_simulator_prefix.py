"""The simulator's prefix cache as the prompt-cache doctor sees it: rendered in the
doctor's part order, keyed by model and cache key, and able to under-report cached
tokens (``--cached-tokens-factor``) or not report them (``--no-report-cached-tokens``).

Requests go through the simulator's HTTP app in process (``httpx.ASGITransport``, all
latencies zero); the usage is read with the proxy's own dialects, and the same bodies
go through the doctor (``proxy.doctor``), as the proxy will do.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any

import httpx
import pytest

from proxy.dialects import DIALECTS, Usage, cache_scope
from proxy.doctor.examine import PrefixDoctor, PrefixReport
from proxy.doctor.index import LruPrefixIndex
from proxy.doctor.report import cache_tokens
from proxy.simulator import cli as sim_cli
from proxy.simulator.app import create_simulator_app
from proxy.simulator.model import ConfigError, LatencyModel, SimConfig
from proxy.sse import SSEParser

pytestmark = pytest.mark.anyio

FAST = SimConfig(prefill_overhead=0.0, itl=0.0, jitter=0.0, output_tokens=3,
                 output_dist="fixed", seed=3)
EXACT = SimConfig(prefill_rate=1000.0, jitter=0.0, output_tokens=4, output_dist="fixed")

STABLE = " ".join(f"Rule {i}: answer as a patient teacher would, in plain words." for i in range(80))
TOOLS = [{"name": f"tool_{i}", "description": f"Tool {i} does one careful thing. " * 40,
          "input_schema": {"type": "object"}} for i in range(3)]


def client(config: SimConfig = FAST) -> httpx.AsyncClient:
    app = create_simulator_app(config)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")


async def usage_of(c: httpx.AsyncClient, route: str, body: dict[str, Any]) -> tuple[
        dict[str, Any], Usage]:
    """The raw usage of a non-streamed answer and the proxy's reading of it."""
    response = await c.post(route, json=body)
    assert response.status_code == 200, response.text
    raw = response.json()["usage"]
    return raw, DIALECTS[route].usage(raw)


BODIES: dict[str, Any] = {
    "/v1/chat/completions": lambda text, **kw: {
        "model": "m", "messages": [{"role": "system", "content": text},
                                   {"role": "user", "content": "hi"}], **kw},
    "/v1/completions": lambda text, **kw: {"model": "m", "prompt": text, **kw},
    "/v1/responses": lambda text, **kw: {"model": "m", "instructions": text, "input": "hi", **kw},
    "/v1/messages": lambda text, **kw: {"model": "m", "max_tokens": 3, "system": text,
                                        "messages": [{"role": "user", "content": "hi"}], **kw},
}


# ---------------------------------------------------------------------------
# The knobs


def test_the_model_under_reports_or_hides_cached_tokens_but_still_caches() -> None:
    text = "lorem ipsum dolor sit amet " * 240  # 6,480 characters, 1,620 tokens
    full = LatencyModel(EXACT)
    half = LatencyModel(replace(EXACT, cached_tokens_factor=0.3))
    hidden = LatencyModel(replace(EXACT, report_cached_tokens=False))
    for model in (full, half, hidden):
        model.prefilled(model.plan(text))
    plans = [model.plan(text) for model in (full, half, hidden)]
    cached = plans[0].cached_tokens
    assert cached == 1616 and plans[0].reported_cached_tokens == cached
    assert [p.cached_tokens for p in plans] == [cached] * 3  # the cache works the same
    assert [p.prefill_compute_s for p in plans] == [plans[0].prefill_compute_s] * 3
    assert plans[1].reported_cached_tokens == math.floor(cached * 0.3) == 484
    assert plans[2].reported_cached_tokens is None


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_cached_tokens_factor_is_a_share(value: float) -> None:
    with pytest.raises(ConfigError, match="--cached-tokens-factor"):
        SimConfig(cached_tokens_factor=value)


def test_flags_set_the_knobs() -> None:
    parser = argparse.ArgumentParser()
    sim_cli.add_parser(parser.add_subparsers())
    config = sim_cli.config_from_args(parser.parse_args(
        ["simulate", "--cached-tokens-factor", "0.25", "--no-report-cached-tokens"]))
    assert (config.cached_tokens_factor, config.report_cached_tokens) == (0.25, False)
    default = sim_cli.config_from_args(parser.parse_args(["simulate"]))
    assert (default.cached_tokens_factor, default.report_cached_tokens) == (1.0, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--cached-tokens-factor", "2"])


@pytest.mark.parametrize("route", list(BODIES))
async def test_each_api_reports_hides_or_under_reports_cached_tokens(route: str) -> None:
    body = BODIES[route](STABLE)
    async with client() as c:
        await usage_of(c, route, body)
        _, full = await usage_of(c, route, body)
    async with client(replace(FAST, cached_tokens_factor=0.5)) as c:
        await usage_of(c, route, body)
        _, half = await usage_of(c, route, body)
    async with client(replace(FAST, report_cached_tokens=False)) as c:
        await usage_of(c, route, body)
        raw, hidden = await usage_of(c, route, body)
    assert full.cached_prompt_tokens is not None and full.cached_prompt_tokens > 1000
    assert half.cached_prompt_tokens == full.cached_prompt_tokens // 2
    assert half.prompt_tokens == hidden.prompt_tokens == full.prompt_tokens  # same prompt
    assert hidden.cached_prompt_tokens is None  # absent, so unknown: never 0
    assert hidden.cache_write_tokens is None
    assert not {"prompt_tokens_details", "input_tokens_details", "cache_read_input_tokens",
                "cache_creation_input_tokens", "cache_creation"} & set(raw)


async def test_a_messages_stream_without_cache_fields() -> None:
    body = {**BODIES["/v1/messages"](STABLE), "stream": True}
    async with client(replace(FAST, report_cached_tokens=False)) as c:
        await c.post("/v1/messages", json=body)
        stream = (await c.post("/v1/messages", json=body)).content
    usage: dict[str, Any] = {}
    for event in SSEParser().feed(stream):
        info = DIALECTS["/v1/messages"].classify(event.event, event.data)
        assert not info.error
        if info.usage is not None:
            usage.update(info.usage)
    read = DIALECTS["/v1/messages"].usage(usage)
    assert read.cached_prompt_tokens is None and read.prompt_tokens is not None
    assert read.prompt_tokens > 1000 and "cache_read_input_tokens" not in usage


# ---------------------------------------------------------------------------
# Keying and order


@pytest.mark.parametrize("route", list(BODIES))
async def test_the_cache_is_per_model_and_cache_key(route: str) -> None:
    async with client() as c:
        base = BODIES[route](STABLE)
        await usage_of(c, route, base)
        assert (await usage_of(c, route, base))[1].cached_prompt_tokens
        for changed in ({"model": "other"}, {"prompt_cache_key": "user-2"},
                        {"cache_salt": "tenant-2"}):
            first = (await usage_of(c, route, {**base, **changed}))[1]
            assert first.cached_prompt_tokens == 0, changed
            again = (await usage_of(c, route, {**base, **changed}))[1]
            assert again.cached_prompt_tokens, changed


async def test_responses_renders_instructions_before_tools() -> None:
    tool = {"type": "function", "name": "f", "description": "Looks things up. " * 200}
    other = {**tool, "description": "Finds things. " * 200}
    async with client() as c:
        route = "/v1/responses"
        await usage_of(c, route, {"instructions": STABLE, "tools": [tool], "input": "hi"})
        tools_changed = (await usage_of(
            c, route, {"instructions": STABLE, "tools": [other], "input": "hi"}))[1]
        # The instructions come first, so they still hit when only the tools change.
        cached = tools_changed.cached_prompt_tokens
        assert cached is not None and len(STABLE) // 4 - 16 <= cached <= (len(STABLE) + 80) // 4
        instructions_changed = (await usage_of(
            c, route, {"instructions": "Be brief. " + STABLE, "tools": [other], "input": "hi"}))[1]
        assert instructions_changed.cached_prompt_tokens == 0


async def test_cache_control_markers_do_not_change_the_prompt() -> None:
    def body(marked: int) -> dict[str, Any]:
        blocks: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": f"t{i}", "content": STABLE[:900]}
            for i in range(3)]
        blocks[marked]["cache_control"] = {"type": "ephemeral"}
        return {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": blocks}]}

    async with client() as c:
        first = (await usage_of(c, "/v1/messages", body(0)))[1]
        moved = (await usage_of(c, "/v1/messages", body(2)))[1]
    assert first.prompt_tokens == moved.prompt_tokens
    assert moved.cached_prompt_tokens is not None
    assert moved.cached_prompt_tokens >= (moved.prompt_tokens or 0) - 16


# ---------------------------------------------------------------------------
# The simulator's cache against the doctor's repeated prefix


class Both:
    """Each request to the simulator and, as the proxy will, through the doctor."""

    def __init__(self, c: httpx.AsyncClient) -> None:
        self.c = c
        self.doctor = PrefixDoctor(LruPrefixIndex())
        self.now = 0

    async def send(self, route: str, body: dict[str, Any]) -> tuple[PrefixReport, Usage]:
        self.now += 1_000
        model, key = cache_scope(body)
        looked = self.doctor.look(DIALECTS[route].prompt_parts(body), upstream="sim",
                                  model=model, cache_key=key, now_ms=self.now)
        assert looked is not None
        return looked[1], (await usage_of(self.c, route, body))[1]


def messages_body(now: str, question: str = "What changed?", tools: Any = TOOLS,
                  model: str = "claude-sonnet-4-5") -> dict[str, Any]:
    return {"model": model, "max_tokens": 3, "tools": tools,
            "system": f"Current time is {now}.\n" + STABLE,
            "messages": [{"role": "user", "content": question}]}


async def test_cached_tokens_drop_where_the_doctor_says_the_prefix_broke() -> None:
    async with client() as c:
        both = Both(c)
        await both.send("/v1/messages", messages_body("15:09:20"))
        again, again_usage = await both.send("/v1/messages", messages_body("15:09:20"))
        report, usage = await both.send("/v1/messages", messages_body("15:09:21"))
    assert again.reason is None and again_usage.cached_prompt_tokens is not None
    assert again_usage.cached_prompt_tokens > 0.9 * (again_usage.prompt_tokens or 0)
    assert report.reason == "variable_before_stable" and report.part == "system"
    tokens = cache_tokens(report, usage.prompt_tokens, usage.cached_prompt_tokens)
    # The simulator's hits stop where the doctor's repeated prefix stops (the tools),
    # within the doctor's block and the simulator's framing.
    assert tokens.repeated is not None and usage.cached_prompt_tokens is not None
    assert tokens.repeated > 900  # the tools: about 3,900 bytes
    assert abs(usage.cached_prompt_tokens - tokens.repeated) <= 64 + 16
    assert tokens.missed is not None and tokens.missed <= 16


@pytest.mark.parametrize(("config", "expected"), [
    (FAST, "none"),
    (replace(FAST, cached_tokens_factor=0.5), "half"),
    (replace(FAST, report_cached_tokens=False), "unknown"),
])
async def test_the_doctor_finds_what_the_simulator_did_not_report(
        config: SimConfig, expected: str) -> None:
    async with client(config) as c:
        both = Both(c)
        turn1 = {"model": "m", "messages": [{"role": "system", "content": STABLE},
                                            {"role": "user", "content": "First question?"}]}
        await both.send("/v1/chat/completions", turn1)
        turn2 = {"model": "m", "messages": [*turn1["messages"],
                                            {"role": "assistant", "content": "An answer."},
                                            {"role": "user", "content": "And then?"}]}
        report, usage = await both.send("/v1/chat/completions", turn2)
    assert report.reason is None  # a conversation grew: not a break
    tokens = cache_tokens(report, usage.prompt_tokens, usage.cached_prompt_tokens,
                          minimum_tokens=1024)
    assert tokens.repeated is not None and tokens.repeated > 1024
    if expected == "none":
        assert tokens.missed is not None and tokens.missed <= 16
    elif expected == "half":
        assert tokens.missed is not None
        assert abs(tokens.missed - tokens.repeated / 2) <= 16 + 8
    else:
        assert tokens.reported is None and tokens.missed is None


async def test_other_breaks_leave_the_simulator_nothing_to_hit() -> None:
    async with client() as c:
        both = Both(c)
        await both.send("/v1/messages", messages_body("15:09:20"))
        model, model_usage = await both.send("/v1/messages",
                                             messages_body("15:09:20", model="claude-opus-4-1"))
        tools, tools_usage = await both.send(
            "/v1/messages", messages_body("15:09:20", tools=[TOOLS[1], TOOLS[0], TOOLS[2]]))
    assert (model.reason, model.repeated_bytes, model_usage.cached_prompt_tokens) == (
        "model_changed", 0, 0)
    assert (tools.reason, tools.repeated_bytes, tools_usage.cached_prompt_tokens) == (
        "tools_changed", 0, 0)

