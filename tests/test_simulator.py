"""The simulator: its latency model driven by scripted times, and its HTTP answers.

Model tests pass times in by hand (the model has no clock), so they never sleep. App
tests run the FastAPI app in process through ``httpx.ASGITransport`` with all
latencies set to zero: they check shapes, event sequences and usage, not timing
(ASGITransport joins the body). The exact schedule of each streaming API is checked
in virtual time, through the ASGI app with a clock that only its sleep moves forward.
Timing over real sockets is in tests/test_simulator_e2e.py; the official SDKs parse
the Responses and Messages streams in tests/test_simulator_sdk.py.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from proxy.dialects import CHAT, COMPLETIONS, EventInfo, upstream_queue_seconds
from proxy.simulator import cli as sim_cli
from proxy.simulator.app import VOCAB, create_simulator_app
from proxy.simulator.model import (
    ConfigError,
    ContextTooLong,
    LatencyModel,
    PrefixCache,
    RequestPlan,
    SimConfig,
)
from proxy.sse import SSEParser

pytestmark = pytest.mark.anyio

def inspect_event(data: bytes, *, text_route: bool) -> EventInfo:
    """The proxy's own reading of one event (what the simulator's events must satisfy)."""
    return (COMPLETIONS if text_route else CHAT).classify(b"", data)


# Zero jitter so that step times are exact; tests that need jitter say so.
EXACT = SimConfig(
    slots=4,
    prefill_rate=1000.0,
    prefill_overhead=0.01,
    itl=0.02,
    itl_growth=0.1,
    jitter=0.0,
    output_tokens=10,
    output_dist="fixed",
    seed=7,
)


def words(n_chars: int, salt: str = "") -> str:
    """Deterministic filler text of exactly ``n_chars`` characters."""
    base = (salt + "lorem ipsum dolor sit amet consectetur adipiscing elit ") * (n_chars // 40 + 2)
    return base[:n_chars]


def server_ttft(
    model: LatencyModel, text: str, now: float = 0.0, **kw: Any
) -> tuple[float, RequestPlan]:
    """Admit at ``now`` (a slot must be free) and return the first-token delay; its
    prefill done then, its blocks are cached for the next request."""
    plan = model.plan(text, **kw)
    ticket = model.arrive(now)
    assert ticket.admitted
    ttft = model.start_prefill(plan, now) - now
    model.prefilled(plan)
    return ttft, plan


def computed(model: LatencyModel, text: str) -> RequestPlan:
    """A request planned and its prefill done (its blocks cached), as one sent alone."""
    plan = model.plan(text)
    model.prefilled(plan)
    return plan


# ---------------------------------------------------------------------------
# Latency model: prompt length, prefix cache, queueing


def test_prompt_tokens_are_estimated_from_characters() -> None:
    model = LatencyModel(EXACT)
    assert model.count_tokens("x") == 1
    assert model.count_tokens("x" * 400) == 100
    assert model.count_tokens("x" * 401) == 101
    assert LatencyModel(replace(EXACT, chars_per_token=2.0)).count_tokens("x" * 400) == 200


def test_ttft_grows_with_prompt_length() -> None:
    ttfts = []
    for chars in (400, 4_000, 40_000):
        model = LatencyModel(EXACT)  # fresh: nothing cached, lane free
        ttft, plan = server_ttft(model, words(chars))
        assert plan.cached_tokens == 0
        ttfts.append(ttft)
        assert ttft == pytest.approx(
            EXACT.prefill_overhead + plan.prompt_tokens / EXACT.prefill_rate
        )
    assert ttfts[0] < ttfts[1] < ttfts[2]
    # 9 900 more tokens at 1 000 tokens/s: 9.9 s more.
    assert ttfts[2] - ttfts[0] == pytest.approx(9.9)


def test_cached_prefix_is_reported_and_costs_no_prefill() -> None:
    model = LatencyModel(EXACT)
    shared = words(6_400)  # 100 blocks of 64 characters = 1 600 tokens
    first_ttft, first = server_ttft(model, shared + " first question?")
    second_ttft, second = server_ttft(model, shared + " second question, a bit longer?", now=100.0)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 1600
    assert second.prompt_tokens > first.prompt_tokens
    assert second_ttft < first_ttft
    assert second_ttft == pytest.approx(
        EXACT.prefill_overhead + (second.prompt_tokens - 1600) / EXACT.prefill_rate
    )
    # An uncached prompt of the same length pays the whole prefill.
    cold_ttft, cold = server_ttft(LatencyModel(EXACT), words(len(shared) + 31, salt="x"))
    assert cold.prompt_tokens == second.prompt_tokens
    assert cold_ttft - second_ttft == pytest.approx(1600 / EXACT.prefill_rate)


def test_prefix_cache_matches_whole_blocks_from_the_start_only() -> None:
    model = LatencyModel(EXACT)
    text = words(640)  # 10 blocks
    computed(model, text)
    # Same text again: every block but the one holding the last token.
    assert model.plan(text).cached_tokens == 9 * 16
    # First 100 characters identical: one whole block (64 chars) is reused.
    assert model.plan(text[:100] + "Z" * 540).cached_tokens == 16
    # One changed character at the start: nothing matches (blocks chain).
    assert model.plan("Q" + text[1:]).cached_tokens == 0
    # Prompts shorter than a block are never cached.
    model.plan("short")
    assert model.plan("short").cached_tokens == 0


def test_prefix_cache_forgets_least_recently_used_blocks() -> None:
    cache = PrefixCache(block_chars=4, capacity_blocks=4)

    def seen(text: str) -> int:  # the hits, then the blocks stored, as a prefill does
        hits, hashes = cache.lookup(text)
        cache.insert(hashes)
        return hits

    assert seen("aaaabbbb") == 0
    assert seen("ccccdddd") == 0
    assert len(cache) == 4
    assert seen("aaaabbbb") == 2  # touched: now the most recent
    assert seen("eeee") == 0  # evicts the oldest block: c...'s tail
    assert seen("aaaabbbb") == 2
    assert seen("ccccdddd") == 1  # its head survived, its tail did not
    empty = PrefixCache(block_chars=4, capacity_blocks=0)
    assert empty.lookup("aaaa" * 4) == (0, ())


def test_a_prompt_in_prefill_is_not_cached_yet() -> None:
    """The same prompt sent while the first is still in prefill finds nothing: a server
    caches the blocks it computed (the prompt-cache doctor's "concurrent"); once the
    first token is out, a later request finds them."""
    model = LatencyModel(EXACT)
    text = words(640)  # 10 blocks
    first = model.plan(text)
    assert model.plan(text).cached_tokens == 0  # arrived during the first's prefill
    model.prefilled(first)
    assert model.plan(text).cached_tokens == 9 * 16


def test_cache_off_reports_nothing() -> None:
    model = LatencyModel(replace(EXACT, cache_blocks=0))
    model.plan(words(6400))
    assert model.plan(words(6400)).cached_tokens == 0


def test_prefill_lane_is_shared_so_a_burst_queues_behind_itself() -> None:
    model = LatencyModel(EXACT)
    long_a = model.plan(words(8000, "a"))  # 2 000 tokens: 2 s of prefill
    long_b = model.plan(words(8000, "b"))
    model.arrive(0.0)
    model.arrive(0.0)
    first_a = model.start_prefill(long_a, 0.0)
    first_b = model.start_prefill(long_b, 0.0)
    assert first_a == pytest.approx(2.0 + 0.01)
    assert first_b == pytest.approx(4.0 + 0.01)  # waited for a's prefill


def test_slots_queue_in_fifo_order_and_queue_time_is_the_wait() -> None:
    model = LatencyModel(replace(EXACT, slots=2))
    admitted: list[int] = []
    tickets = [model.arrive(0.0, on_admit=lambda t, i=i: admitted.append(i)) for i in range(5)]
    assert [t.admitted for t in tickets] == [True, True, False, False, False]
    assert (model.active, model.queued) == (2, 3)
    model.release(tickets[1], 1.5)
    assert admitted == [2]
    assert tickets[2].admitted_at - tickets[2].arrival == pytest.approx(1.5)
    model.release(tickets[3], 1.6)  # a queued request gives up: nobody is admitted
    assert admitted == [2] and model.queued == 1
    model.release(tickets[0], 2.0)
    assert admitted == [2, 4]
    assert tickets[4].admitted_at - tickets[4].arrival == pytest.approx(2.0)
    model.release(tickets[0], 2.5)  # idempotent
    assert model.active == 2
    for t in (tickets[2], tickets[4]):
        model.release(t, 3.0)
    assert (model.active, model.queued) == (0, 0)


def test_itl_grows_with_active_streams_and_jitter_stays_in_bounds() -> None:
    model = LatencyModel(EXACT)
    rng = model.plan("x").rng
    model.arrive(0.0)
    one = model.step_seconds(rng)
    for _ in range(3):
        model.arrive(0.0)
    four = model.step_seconds(rng)
    assert one == pytest.approx(0.02)
    assert four == pytest.approx(0.02 * (1 + 0.1 * 3))

    jittery = LatencyModel(replace(EXACT, jitter=0.25))
    jittery.arrive(0.0)
    steps = [jittery.step_seconds(rng) for _ in range(2000)]
    assert min(steps) >= 0.02 * 0.75 and max(steps) <= 0.02 * 1.25
    assert max(steps) - min(steps) > 0.02 * 0.4  # it does vary
    assert sum(steps) / len(steps) == pytest.approx(0.02, rel=0.02)


def run_schedule(
    config: SimConfig, arrivals: list[tuple[float, str, int]]
) -> list[dict[str, float]]:
    """A discrete-event run of the model: requests (arrival, prompt, max_tokens) in, times out.

    This is what the web app does with real sleeps, with a priority queue instead.
    """
    model = LatencyModel(config)
    results: list[dict[str, float]] = [{} for _ in arrivals]
    events: list[tuple[float, int, int, str]] = []  # (time, seq, request, kind)
    seq = 0

    def push(t: float, i: int, kind: str) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, i, kind))
        seq += 1

    plans: dict[int, RequestPlan] = {}
    tickets: dict[int, Any] = {}
    left: dict[int, int] = {}
    for i, (t, _, _) in enumerate(arrivals):
        push(t, i, "arrive")
    while events:
        now, _, i, kind = heapq.heappop(events)
        if kind == "arrive":
            _, text, max_tokens = arrivals[i]
            plans[i] = model.plan(text, max_tokens=max_tokens)
            left[i] = plans[i].output_tokens
            results[i]["arrival"] = now

            def admitted(ticket: Any, i: int = i) -> None:
                push(ticket.admitted_at, i, "admitted")

            tickets[i] = model.arrive(now, on_admit=admitted)
            if tickets[i].admitted:
                push(now, i, "admitted")
        elif kind == "admitted":
            results[i]["queue"] = now - results[i]["arrival"]
            push(model.start_prefill(plans[i], now), i, "token")
        elif kind == "token":
            results[i].setdefault("ttft", now - results[i]["arrival"])
            left[i] -= 1
            if left[i] == 0:
                results[i]["end"] = now
                model.release(tickets[i], now)
            else:
                push(now + model.step_seconds(plans[i].rng), i, "token")
    return results


def test_schedule_ttft_grows_with_queueing_when_slots_are_full() -> None:
    config = replace(EXACT, slots=2, jitter=0.1)
    prompt = words(400)  # 100 tokens, 0.1 s prefill (cached after the first)
    burst = run_schedule(config, [(0.0, prompt + f" #{i}", 20) for i in range(6)])
    queue = [r["queue"] for r in burst]
    ttft = [r["ttft"] for r in burst]
    assert queue[:2] == [0.0, 0.0]
    assert all(q > 0 for q in queue[2:])
    # Each pair waits for the pair before it to finish 20 tokens.
    assert queue[2] < queue[4] and queue[3] < queue[5]
    assert ttft[4] > ttft[2] > ttft[0]
    assert burst[2]["queue"] == pytest.approx(min(burst[0]["end"], burst[1]["end"]))
    # The same requests spread out never queue, and their TTFT stays low.
    spread = run_schedule(config, [(10.0 * i, prompt + f" #{i}", 20) for i in range(6)])
    assert all(r["queue"] == 0 for r in spread)
    assert max(r["ttft"] for r in spread) < min(ttft[2:])


def test_schedule_is_deterministic_given_the_seed() -> None:
    config = replace(
        EXACT,
        jitter=0.2,
        output_dist="uniform",
        output_tokens=30,
        stall_rate=0.3,
        stall_seconds=0.5,
    )
    arrivals = [(0.01 * i, words(100 + 37 * i), 50 if i % 2 else None) for i in range(10)]
    a = run_schedule(config, arrivals)  # type: ignore[arg-type]
    assert a == run_schedule(config, arrivals)  # type: ignore[arg-type]
    assert a != run_schedule(replace(config, seed=8), arrivals)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Output length and faults


def test_max_tokens_is_generated_exactly_unless_stop_early() -> None:
    model = LatencyModel(replace(EXACT, output_tokens=5))
    plan = model.plan("hi", max_tokens=40)
    assert (plan.output_tokens, plan.finish_reason) == (40, "length")
    early = LatencyModel(replace(EXACT, output_tokens=5, stop_early=True))
    plan = early.plan("hi", max_tokens=40)
    assert (plan.output_tokens, plan.finish_reason) == (5, "stop")
    plan = early.plan("hi", max_tokens=3)
    assert (plan.output_tokens, plan.finish_reason) == (3, "length")
    plan = model.plan("hi")
    assert (plan.output_tokens, plan.finish_reason) == (5, "stop")


def test_reasoning_comes_first_and_max_tokens_covers_it() -> None:
    model = LatencyModel(replace(EXACT, output_tokens=5, reasoning_tokens=16))
    # No max_tokens: exactly --reasoning-tokens, then the answer's drawn length.
    plan = model.plan("hi", reasoning=True)
    assert (plan.reasoning_tokens, plan.output_tokens, plan.finish_reason) == (16, 21, "stop")
    # max_tokens covers both, as in the real APIs.
    plan = model.plan("hi", max_tokens=20, reasoning=True)
    assert (plan.reasoning_tokens, plan.output_tokens, plan.finish_reason) == (16, 20, "length")
    # Thinking is cut short only when it would leave no answer token.
    plan = model.plan("hi", max_tokens=10, reasoning=True)
    assert (plan.reasoning_tokens, plan.output_tokens) == (9, 10)
    assert model.plan("hi", max_tokens=1, reasoning=True).reasoning_tokens == 0
    # Not asked for, or turned off: no reasoning.
    assert model.plan("hi", max_tokens=20).reasoning_tokens == 0
    off = LatencyModel(replace(EXACT, output_tokens=5, reasoning_tokens=0))
    assert off.plan("hi", reasoning=True).reasoning_tokens == 0
    # --stop-early compares max_tokens with reasoning plus the drawn answer.
    early = LatencyModel(replace(EXACT, output_tokens=5, reasoning_tokens=16, stop_early=True))
    plan = early.plan("hi", max_tokens=40, reasoning=True)
    assert (plan.output_tokens, plan.finish_reason) == (21, "stop")


@pytest.mark.parametrize(
    ("per_chunk", "reasoning", "chunks"),
    [(1, True, (5, 4)), (2, True, (3, 2)), (8, True, (1, 1)), (3, False, (0, 3))],
)
async def test_steps_never_mix_reasoning_and_answer(
    per_chunk: int, reasoning: bool, chunks: tuple[int, int]
) -> None:
    """5 reasoning and 4 answer tokens: with 2 a chunk, 2+2+1 reasoning, 2+2 answer."""
    config = replace(FAST, reasoning_tokens=5, tokens_per_chunk=per_chunk)
    effort = {"reasoning_effort": "low"} if reasoning else {}
    async with make_client(config) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(stream=True, max_tokens=9, **effort))
    deltas = [json.loads(e)["choices"][0]["delta"] for e in sse_events(r.content)[:-1]]
    thought = sum(bool(d.get("reasoning_content")) for d in deltas)
    answer = sum(bool(d.get("content")) for d in deltas)
    assert (thought, answer) == chunks
    assert not any(d.get("reasoning_content") and d.get("content") for d in deltas)


def test_cache_writes_are_the_new_full_blocks() -> None:
    model = LatencyModel(EXACT)  # 16-token blocks of 64 characters
    text = words(650)  # 10 full blocks and 10 characters: 163 tokens
    first = computed(model, text)
    assert (first.prompt_tokens, first.cached_tokens, first.cache_write_tokens) == (163, 0, 160)
    again = model.plan(text)
    assert (again.cached_tokens, again.cache_write_tokens) == (160, 0)
    longer = model.plan(text[:640] + "Z" * 200)  # 13 full blocks, 10 of them cached
    assert (longer.cached_tokens, longer.cache_write_tokens) == (160, 48)
    assert LatencyModel(replace(EXACT, cache_blocks=0)).plan(text).cache_write_tokens == 0


def test_stream_error_rate_draws_only_when_enabled() -> None:
    """Old seeds keep their words and schedules: the new fault takes no random number
    while it is off. Off: the error, drop and stall decisions; on (rate 1): also the
    stream error's decision and its position (a subclass that overrides ``random``
    makes ``randrange`` call it too)."""

    class Counting(random.Random):
        calls = 0

        def random(self) -> float:
            Counting.calls += 1
            return super().random()

    for rate, draws in ((0.0, 3), (1.0, 5)):
        Counting.calls = 0
        model = LatencyModel(replace(EXACT, stream_error_rate=rate), rng_factory=Counting)
        model.plan("hi")
        assert Counting.calls == draws, rate
    failing = LatencyModel(replace(EXACT, stream_error_rate=0.25))
    plans = [failing.plan("hi", max_tokens=10) for _ in range(4000)]
    share = sum(p.error_after_tokens is not None for p in plans) / 4000
    assert share == pytest.approx(0.25, abs=0.02)
    assert {p.error_after_tokens for p in plans} - {None} == set(range(10))


@pytest.mark.parametrize(
    ("dist", "low", "high"), [("uniform", 50, 150), ("exponential", 1, math.inf)]
)
def test_output_length_distributions(dist: str, low: float, high: float) -> None:
    model = LatencyModel(replace(EXACT, output_tokens=100, output_dist=dist))
    lengths = [model.plan("hi").output_tokens for _ in range(3000)]
    assert low <= min(lengths) and max(lengths) <= high
    assert sum(lengths) / len(lengths) == pytest.approx(100, rel=0.08)
    assert len(set(lengths)) > 50


def test_context_length_is_enforced() -> None:
    model = LatencyModel(replace(EXACT, max_model_len=100))
    with pytest.raises(ContextTooLong, match="maximum context length is 100"):
        model.plan("x" * 400)  # 100 tokens, no room left
    with pytest.raises(ContextTooLong):
        model.plan("x" * 200, max_tokens=51)
    assert model.requests == 0  # refused requests leave no trace
    plan = model.plan("x" * 200, max_tokens=50)
    assert plan.output_tokens == 50
    capped = LatencyModel(replace(EXACT, max_model_len=100, output_tokens=500)).plan("x" * 200)
    assert (capped.output_tokens, capped.finish_reason) == (50, "length")


def test_fault_rates_are_honoured() -> None:
    model = LatencyModel(replace(EXACT, error_rate=0.1, drop_rate=0.2, stall_rate=0.3))
    plans = [model.plan("hi", max_tokens=10) for _ in range(4000)]
    assert sum(p.error for p in plans) / 4000 == pytest.approx(0.1, abs=0.02)
    assert sum(p.drop_after_tokens is not None for p in plans) / 4000 == pytest.approx(
        0.2, abs=0.02
    )
    assert sum(p.stall_before_token is not None for p in plans) / 4000 == pytest.approx(
        0.3, abs=0.02
    )
    assert {p.drop_after_tokens for p in plans} - {None} == set(range(10))
    clean = LatencyModel(EXACT)
    assert not any(
        p.error or p.drop_after_tokens is not None or p.stall_before_token is not None
        for p in (clean.plan("hi") for _ in range(500))
    )


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("slots", 0, "--slots"),
        ("prefill_rate", 0.0, "--prefill-rate"),
        ("itl", -1.0, "--itl"),
        ("jitter", 1.5, "--jitter"),
        ("drop_rate", -0.1, "--drop-rate"),
        ("output_dist", "normal", "--output-dist"),
        ("error_status", 200, "--error-status"),
        ("cache_blocks", -1, "--cache-blocks"),
        ("reasoning_tokens", -1, "--reasoning-tokens"),
        ("stream_error_rate", 1.5, "--stream-error-rate"),
        ("models", (), "--models"),
    ],
)
def test_bad_settings_name_their_flag(field: str, value: Any, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        SimConfig(**{field: value})


# ---------------------------------------------------------------------------
# Command line


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sim_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["simulate", *argv])


def test_cli_defaults_are_the_config_defaults_and_every_knob_is_a_flag() -> None:
    args = parse()
    assert sim_cli.config_from_args(args) == SimConfig()
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    args = parse(
        "--slots",
        "3",
        "--itl",
        "0.005",
        "--drop-rate",
        "0.5",
        "--vllm-metrics",
        "--models",
        "a,b",
        "--output-dist",
        "fixed",
        "--seed",
        "11",
        "--stop-early",
    )
    config = sim_cli.config_from_args(args)
    assert (
        config.slots,
        config.itl,
        config.drop_rate,
        config.vllm_metrics,
        config.models,
        config.output_dist,
        config.seed,
        config.stop_early,
    ) == (3, 0.005, 0.5, True, ("a", "b"), "fixed", 11, True)


def test_cli_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    text = capsys.readouterr().out
    for name in SimConfig.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in text


@pytest.mark.parametrize(
    "argv", [("--slots", "0"), ("--jitter", "2"), ("--itl", "abc"), ("--output-dist", "normal")]
)
def test_cli_rejects_bad_values(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_cli_reports_a_config_error_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli import main

    assert main(["simulate", "--error-status", "600"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llm-latency-proxy simulate: error: ") and "--error-status" in err


# ---------------------------------------------------------------------------
# HTTP answers (in process)

FAST = SimConfig(
    prefill_overhead=0.0, itl=0.0, jitter=0.0, output_tokens=6, output_dist="fixed", seed=3
)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with make_client(FAST) as c:
        yield c


def make_client(config: SimConfig) -> httpx.AsyncClient:
    app = create_simulator_app(config)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")


def sse_events(body: bytes) -> list[bytes]:
    """Event payloads through the proxy's own parser, checking OpenAI framing first."""
    assert b"\r" not in body  # LF line endings, like OpenAI's
    assert body.endswith(b"data: [DONE]\n\n")
    for raw in body.split(b"\n\n")[:-1]:
        assert raw.startswith(b"data: ") and b"\n" not in raw
    return [e.data for e in SSEParser().feed(body)]


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m1", "messages": [{"role": "user", "content": "Say something."}], **extra}


async def test_chat_stream_has_the_shape_of_a_real_server(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json=chat_body(stream=True, max_tokens=5, stream_options={"include_usage": True}),
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == b"[DONE]"
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m1" for c in chunks)
    role, tokens, finish, usage = chunks[0], chunks[1:6], chunks[6], chunks[7]
    assert len(chunks) == 8
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    for chunk in tokens:
        (choice,) = chunk["choices"]
        assert choice["delta"]["content"] in VOCAB and choice["finish_reason"] is None
    assert finish["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "metrics" not in usage["usage"]
    # What the proxy's measurement makes of it: the role chunk is not a token.
    infos = [inspect_event(e, text_route=False) for e in events]
    assert [i.outputs for i in infos] == [0, 1, 1, 1, 1, 1, 0, 0, 0]
    assert infos[7].usage_only and not any(i.usage_only for i in infos[:7])


async def test_stream_without_include_usage_has_no_usage_chunk(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    chunks = [json.loads(e) for e in sse_events(r.content)[:-1]]
    assert len(chunks) == 1 + 6 + 1  # role, output_tokens=6 tokens, finish
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("usage" in c for c in chunks)


async def test_completions_stream_and_non_stream(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        json={
            "model": "m1",
            "prompt": "Once upon a time",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(r.content)
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert [c["choices"][0]["text"] in VOCAB for c in chunks[:4]] == [True] * 4
    assert chunks[4]["choices"][0] == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "length",
    }
    assert chunks[5]["choices"] == [] and chunks[5]["usage"]["completion_tokens"] == 4
    assert [inspect_event(e, text_route=True).outputs for e in events] == [1, 1, 1, 1, 0, 0, 0]

    r = await client.post(
        "/v1/completions", json={"model": "m1", "prompt": [[1, 2, 3, 4, 5]], "max_tokens": 3}
    )
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == 5  # token ids are counted exactly
    assert len(body["choices"][0]["text"].split()) == 3


async def test_non_stream_chat_carries_usage(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body(max_completion_tokens=7))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 7
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 7


async def test_n_choices_and_tokens_per_chunk() -> None:
    async with make_client(replace(FAST, tokens_per_chunk=3)) as c:
        r = await c.post(
            "/v1/chat/completions",
            json=chat_body(stream=True, n=2, max_tokens=7, stream_options={"include_usage": True}),
        )
    chunks = [json.loads(e) for e in sse_events(r.content)[:-1]]
    by_index: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            content = choice["delta"].get("content")
            if content:
                by_index[choice["index"]].append(content)
    # 7 tokens in steps of 3, 3 and 1 words, for each choice.
    assert [[len(p.split()) for p in parts] for parts in by_index.values()] == [[3, 3, 1]] * 2
    assert chunks[-1]["usage"]["completion_tokens"] == 14
    finishes = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(ch["index"] for ch in finishes) == [0, 1]


async def test_repeated_prompt_reports_cached_tokens(client: httpx.AsyncClient) -> None:
    long_chat = chat_body(
        messages=[{"role": "system", "content": words(3000)}, {"role": "user", "content": "first"}]
    )
    first = (await client.post("/v1/chat/completions", json=long_chat)).json()["usage"]
    long_chat["messages"][1]["content"] = "second, different question"
    second = (await client.post("/v1/chat/completions", json=long_chat)).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 700 <= cached < second["prompt_tokens"] and cached % 16 == 0


async def test_vllm_metrics_are_in_the_usage_object() -> None:
    async with make_client(replace(FAST, vllm_metrics=True)) as c:
        r = await c.post(
            "/v1/chat/completions",
            json=chat_body(stream=True, max_tokens=2, stream_options={"include_usage": True}),
        )
        plain = (await c.post("/v1/chat/completions", json=chat_body())).json()
    events = sse_events(r.content)
    usage_chunk = json.loads(events[-2])
    metrics = usage_chunk["usage"]["metrics"]
    assert set(metrics) == {
        "queue_time_ms",
        "prefill_time_ms",
        "time_to_first_token_ms",
        "decode_time_ms",
        "e2e_time_ms",
    }
    assert all(v >= 0 for v in metrics.values())
    info = inspect_event(events[-2], text_route=False)
    assert info.upstream_queue_s == metrics["queue_time_ms"] / 1000
    assert upstream_queue_seconds(plain) is not None


async def test_same_seed_same_words() -> None:
    texts = []
    for _ in range(2):
        async with make_client(FAST) as c:
            texts.append(
                [
                    (await c.post("/v1/chat/completions", json=chat_body(max_tokens=20))).json()[
                        "choices"
                    ][0]["message"]["content"]
                    for _ in range(3)
                ]
            )
    assert texts[0] == texts[1]
    assert len(set(texts[0])) == 3


@pytest.mark.parametrize(
    ("method", "path", "content", "status", "code"),
    [
        ("POST", "/v1/chat/completions", b"{not json", 400, None),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400, None),
        ("POST", "/v1/chat/completions", b'{"model": "m"}', 400, None),
        (
            "POST",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
            400,
            None,
        ),
        (
            "POST",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "n": "2"}',
            400,
            None,
        ),
        ("POST", "/v1/completions", b'{"prompt": ["a", "b"]}', 400, None),
        (
            "POST",
            "/v1/completions",
            b'{"prompt": "x", "max_tokens": 200000}',
            400,
            "context_length_exceeded",
        ),
        ("POST", "/v1/embeddings", b"{}", 404, "not_found"),
        ("GET", "/nothing/here", b"", 404, "not_found"),
        ("GET", "/v1/chat/completions", b"", 405, "method_not_allowed"),
        ("GET", "/v1/models/unknown", b"", 404, "model_not_found"),
    ],
)
async def test_errors_have_the_openai_shape(
    client: httpx.AsyncClient, method: str, path: str, content: bytes, status: int, code: str | None
) -> None:
    r = await client.request(method, path, content=content)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == code


async def test_injected_errors_strict_models_and_api_key() -> None:
    async with make_client(replace(FAST, error_rate=1.0, error_status=503)) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(stream=True))
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "server_error"
    async with make_client(replace(FAST, models=("a", "b"), strict_models=True)) as c:
        assert (await c.post("/v1/chat/completions", json=chat_body(model="a"))).status_code == 200
        r = await c.post("/v1/chat/completions", json=chat_body(model="zzz"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        listed = (await c.get("/v1/models")).json()
        assert [m["id"] for m in listed["data"]] == ["a", "b"] and listed["object"] == "list"
        assert (await c.get("/v1/models/b")).json()["id"] == "b"
    async with make_client(replace(FAST, api_key="sk-sim")) as c:
        r = await c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await c.post(
            "/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sk-sim"}
        )
        assert r.status_code == 200
        assert (await c.get("/healthz")).status_code == 200  # no key needed


async def test_healthz_and_slots_are_freed(client: httpx.AsyncClient) -> None:
    for stream in (False, True):
        await client.post("/v1/chat/completions", json=chat_body(stream=stream))
    health = (await client.get("/healthz")).json()
    assert health == {"status": "ok", "active": 0, "queued": 0, "requests": 2}


def test_docs_describe_every_flag() -> None:
    from pathlib import Path

    parser = argparse.ArgumentParser()
    sim_cli.add_parser(parser.add_subparsers())
    docs = (Path(__file__).parent.parent / "docs" / "simulator.md").read_text()
    simulate = parser._subparsers._group_actions[0].choices["simulate"]  # type: ignore[union-attr]
    flags = [opt for action in simulate._actions for opt in action.option_strings]
    missing = [
        f
        for f in flags
        if f.startswith("--")
        and not f.startswith("--no-")
        and f != "--help"
        and f"`{f}" not in docs
    ]
    assert not missing


# ---------------------------------------------------------------------------
# Reasoning, Responses and Messages (in process)

THINKING = replace(FAST, reasoning_tokens=3)


def framed_events(body: bytes) -> list[dict[str, Any]]:
    """A Responses or Messages stream's events, checking the framing first: each is
    ``event: <type>`` then ``data: <json>``, LF only, no ``[DONE]``."""
    assert b"\r" not in body and body.endswith(b"\n\n") and b"[DONE]" not in body
    out = []
    for raw in body.split(b"\n\n")[:-1]:
        name, data = raw.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        payload = json.loads(data[len(b"data: ") :])
        assert payload["type"] == name[len(b"event: ") :].decode()
        out.append(payload)
    return out


def responses_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m1", "input": "Say something.", **extra}


def messages_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m1",
        "max_tokens": 9,
        "messages": [{"role": "user", "content": "Say something."}],
        **extra,
    }


def joined(events: list[dict[str, Any]], kind: str, key: str = "delta") -> str:
    return "".join(e[key] for e in events if e["type"] == kind)


async def test_chat_reasoning_comes_as_reasoning_content_before_the_answer() -> None:
    async with make_client(THINKING) as c:
        r = await c.post(
            "/v1/chat/completions",
            json=chat_body(
                stream=True, reasoning_effort="low", stream_options={"include_usage": True}
            ),
        )
        plain = (
            await c.post("/v1/chat/completions", json=chat_body(reasoning_effort="low"))
        ).json()
        none = (
            await c.post("/v1/chat/completions", json=chat_body(reasoning_effort="none"))
        ).json()
    events = sse_events(r.content)
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
    assert [list(d) for d in deltas] == [["reasoning_content"]] * 3 + [["content"]] * 6
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 9
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 3}
    # The proxy counts a reasoning chunk as output: TTFT is the first reasoning token.
    assert [inspect_event(e, text_route=False).outputs for e in events[1:10]] == [1] * 9
    message = plain["choices"][0]["message"]
    assert len(message["reasoning_content"].split()) == 3 and len(message["content"].split()) == 6
    assert plain["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert "reasoning_content" not in none["choices"][0]["message"]
    assert "completion_tokens_details" not in none["usage"]


async def test_responses_stream_event_sequence_without_reasoning(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/responses", json=responses_body(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = framed_events(r.content)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 6,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created = events[0]["response"]
    assert (
        created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    )
    assert created["id"].startswith("resp_") and created["object"] == "response"
    assert created["model"] == "m1"
    item = events[2]["item"]
    assert item == {
        "id": item["id"],
        "type": "message",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    assert events[3]["part"] == {
        "type": "output_text",
        "annotations": [],
        "logprobs": [],
        "text": "",
    }
    text = joined(events, "response.output_text.delta")
    assert [len(e["delta"].split()) for e in events[4:10]] == [1] * 6
    assert all(
        (e.get("item_id", item["id"]), e.get("output_index", 0)) == (item["id"], 0)
        for e in events[2:-1]
    )
    assert events[10]["text"] == text and events[11]["part"]["text"] == text
    assert events[12]["item"]["status"] == "completed"
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["id"] == created["id"]
    assert done["output"] == [events[12]["item"]]
    # The prompt is "<|user|>\nSay something.\n<|assistant|>\n": 38 characters, 10 tokens.
    assert done["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 6,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 16,
    }


async def test_responses_stream_event_sequence_with_reasoning() -> None:
    async with make_client(THINKING) as c:
        r = await c.post(
            "/v1/responses", json=responses_body(stream=True, reasoning={"effort": "low"})
        )
    events = framed_events(r.content)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * 3,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 6,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    reasoning, message = events[2]["item"], events[10]["item"]
    assert (reasoning["type"], reasoning["status"], events[2]["output_index"]) == (
        "reasoning",
        "in_progress",
        0,
    )
    assert (message["type"], events[10]["output_index"]) == ("message", 1)
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    thoughts = joined(events, "response.reasoning_text.delta")
    assert events[7]["text"] == thoughts and events[8]["part"]["text"] == thoughts
    assert events[9]["item"]["content"] == [{"type": "reasoning_text", "text": thoughts}]
    assert all(e["output_index"] == 1 for e in events[10:-1])
    done = events[-1]["response"]
    assert [o["type"] for o in done["output"]] == ["reasoning", "message"]
    assert done["reasoning"] == {"effort": "low"}  # the request's fields are echoed
    usage = done["usage"]
    assert (usage["output_tokens"], usage["output_tokens_details"]) == (9, {"reasoning_tokens": 3})


async def test_responses_usage_counts_the_prefix_cache_and_non_stream_body() -> None:
    async with make_client(THINKING) as c:
        system = words(3000)  # "<|system|>\n" + 3 000 characters: 47 whole blocks shared
        first = (await c.post("/v1/responses", json=responses_body(instructions=system))).json()
        second = (
            await c.post(
                "/v1/responses",
                json=responses_body(instructions=system, input="Another question, longer."),
            )
        ).json()
        truncated = (
            await c.post("/v1/responses", json=responses_body(max_output_tokens=5, reasoning={}))
        ).json()
    assert first["object"] == "response" and first["status"] == "completed"
    assert first["incomplete_details"] is None and isinstance(first["completed_at"], int)
    assert [o["type"] for o in first["output"]] == ["message"]
    text = first["output"][0]["content"][0]["text"]
    assert len(text.split()) == 6 and all(" " + w in VOCAB for w in text.split())
    details = [u["usage"]["input_tokens_details"] for u in (first, second)]
    assert details[0] == {"cached_tokens": 0, "cache_write_tokens": 47 * 16}
    assert details[1]["cached_tokens"] == 47 * 16
    # max_output_tokens covers reasoning and answer; reaching it is "incomplete".
    assert truncated["status"] == "incomplete"
    assert truncated["incomplete_details"] == {"reason": "max_output_tokens"}
    assert truncated["output"][1]["status"] == "incomplete"
    assert truncated["usage"]["output_tokens"] == 5
    assert truncated["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}


async def test_messages_stream_event_sequence_without_thinking(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/messages", json=messages_body(stream=True, max_tokens=6))
    events = framed_events(r.content)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * 6,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    message = events[0]["message"]
    assert message["id"].startswith("msg_01") and message["type"] == "message"
    assert (message["role"], message["model"], message["content"]) == ("assistant", "m1", [])
    assert (message["stop_reason"], message["stop_sequence"]) == (None, None)
    assert message["usage"]["output_tokens"] == 1  # as Anthropic's message_start says
    assert events[1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert all(e["index"] == 0 and e["delta"]["type"] == "text_delta" for e in events[3:9])
    assert events[9] == {"type": "content_block_stop", "index": 0}
    assert events[10]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[10]["usage"]["output_tokens"] == 6
    assert "output_tokens_details" not in events[10]["usage"]


async def test_messages_stream_event_sequence_with_thinking() -> None:
    async with make_client(THINKING) as c:
        r = await c.post(
            "/v1/messages",
            json=messages_body(stream=True, thinking={"type": "enabled", "budget_tokens": 1024}),
        )
    async with make_client(replace(THINKING, stop_early=True)) as c:
        natural = await c.post(
            "/v1/messages",
            json=messages_body(stream=True, max_tokens=100, thinking={"type": "adaptive"}),
        )
    events = framed_events(r.content)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * 4,  # 3 thinking deltas and the signature
        "content_block_stop",
        "content_block_start",
        *["content_block_delta"] * 6,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert [e["delta"]["type"] for e in events[3:7]] == ["thinking_delta"] * 3 + ["signature_delta"]
    assert all(e["index"] == 0 for e in events[3:8])
    assert events[8] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "text", "text": ""},
    }
    assert all(e["index"] == 1 and e["delta"]["type"] == "text_delta" for e in events[9:15])
    assert events[15] == {"type": "content_block_stop", "index": 1}
    usage = events[16]["usage"]
    assert (usage["output_tokens"], usage["output_tokens_details"]) == (9, {"thinking_tokens": 3})
    assert events[16]["delta"]["stop_reason"] == "max_tokens"  # 9 = max_tokens
    last = framed_events(natural.content)[-2]
    assert last["delta"]["stop_reason"] == "end_turn" and last["usage"]["output_tokens"] == 9


async def test_messages_input_tokens_exclude_cache_reads_and_writes() -> None:
    from proxy.simulator.messages import render_messages_prompt

    body = messages_body(system=words(3000), messages=[{"role": "user", "content": "Hello"}])
    text = render_messages_prompt(body)
    prompt, blocks = math.ceil(len(text) / 4), len(text) // 64
    assert len(text) % 64  # so the second request reads every block the first wrote
    async with make_client(THINKING) as c:
        first = (await c.post("/v1/messages", json=body)).json()
        second = (await c.post("/v1/messages", json={**body, "stream": True})).content
    start = framed_events(second)[0]["message"]["usage"]
    assert first["usage"] == {
        "input_tokens": prompt - blocks * 16,
        "cache_creation_input_tokens": blocks * 16,
        "cache_read_input_tokens": 0,
        "cache_creation": {
            "ephemeral_5m_input_tokens": blocks * 16,
            "ephemeral_1h_input_tokens": 0,
        },
        "output_tokens": 9,
        "service_tier": "standard",
    }
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (
        prompt - blocks * 16,
        blocks * 16,
    )
    assert start["cache_creation_input_tokens"] == 0
    assert first["type"] == "message" and first["stop_reason"] == "max_tokens"
    assert [b["type"] for b in first["content"]] == ["text"]
    assert len(first["content"][0]["text"].split()) == 9


async def test_messages_non_stream_with_thinking() -> None:
    async with make_client(THINKING) as c:
        body = (
            await c.post(
                "/v1/messages",
                json=messages_body(thinking={"type": "enabled", "budget_tokens": 1024}),
            )
        ).json()
    thinking, text = body["content"]
    assert thinking["type"] == "thinking" and len(thinking["thinking"].split()) == 3
    assert thinking["signature"]
    assert text["type"] == "text" and len(text["text"].split()) == 6
    assert body["usage"]["output_tokens_details"] == {"thinking_tokens": 3}


@pytest.mark.parametrize(
    ("path", "body", "status", "kind"),
    [
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "x"}]},
            400,
            "invalid_request_error",
        ),
        ("/v1/messages", {"max_tokens": 5}, 400, "invalid_request_error"),
        (
            "/v1/messages",
            {"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
            400,
            "invalid_request_error",
        ),
        ("/v1/messages/count_tokens", {}, 404, "not_found_error"),
    ],
)
async def test_messages_errors_have_the_anthropic_shape(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], status: int, kind: str
) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == status
    assert r.json() == {
        "type": "error",
        "error": {"type": kind, "message": r.json()["error"]["message"]},
    }
    assert r.json()["error"]["message"]


async def test_injected_errors_and_keys_on_the_new_routes() -> None:
    async with make_client(replace(FAST, error_rate=1.0, error_status=529)) as c:
        r = await c.post("/v1/messages", json=messages_body(stream=True))
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
        r = await c.post("/v1/responses", json=responses_body(stream=True))
        assert r.status_code == 529 and r.json()["error"]["type"] == "server_error"
    async with make_client(replace(FAST, api_key="sk-sim")) as c:
        r = await c.post("/v1/messages", json=messages_body())
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        for headers in ({"x-api-key": "sk-sim"}, {"Authorization": "Bearer sk-sim"}):
            r = await c.post(
                "/v1/messages",
                json=messages_body(),
                headers={**headers, "anthropic-version": "2023-06-01"},
            )
            assert r.status_code == 200, headers
        assert (
            await c.post("/v1/responses", json=responses_body(), headers={"x-api-key": "sk-sim"})
        ).status_code == 200
        r = await c.post("/v1/responses", json=responses_body())
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    async with make_client(FAST) as c:
        r = await c.post("/v1/responses", json={"model": "m1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"


async def test_stream_errors_are_each_apis_error_event() -> None:
    async with make_client(replace(THINKING, stream_error_rate=1.0, seed=11)) as c:
        chat = (await c.post("/v1/chat/completions", json=chat_body(stream=True))).content
        responses = (await c.post("/v1/responses", json=responses_body(stream=True))).content
        messages = (await c.post("/v1/messages", json=messages_body(stream=True))).content
        plain = await c.post("/v1/chat/completions", json=chat_body())  # not a stream: unharmed
    events = sse_events(chat)
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert not any(b'finish_reason":"' in e for e in events)
    last = framed_events(responses)[-1]
    assert last["type"] == "response.failed"
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "server_error"
    assert framed_events(messages)[-1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "stop"


# -- the exact schedule, in virtual time -------------------------------------------


class VirtualTime:
    """A clock that only ``sleep`` moves: one stream's schedule runs without waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


async def timed_writes(
    config: SimConfig, path: str, body: dict[str, Any]
) -> list[tuple[float, bytes]]:
    """Each body write of one streamed answer with the virtual time it went out, through
    the ASGI app itself (httpx's ASGITransport would join the writes)."""
    vt = VirtualTime()
    app = create_simulator_app(config, clock=vt.clock, sleep=vt.sleep)
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"sim"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("sim", 80),
    }
    requested = False
    never = asyncio.Event()
    writes: list[tuple[float, bytes]] = []

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            writes.append((vt.now, message["body"]))

    await app(scope, receive, send)
    return writes


SCHEDULED = SimConfig(
    prefill_rate=1000.0,
    prefill_overhead=0.01,
    itl=0.02,
    itl_growth=0.0,
    jitter=0.0,
    output_tokens=4,
    output_dist="fixed",
    reasoning_tokens=3,
    seed=1,
)


@pytest.mark.parametrize(
    ("path", "body", "first_answer_kind"),
    [
        (
            "/v1/responses",
            responses_body(stream=True, reasoning={"effort": "low"}),
            b"response.output_text.delta",
        ),
        (
            "/v1/messages",
            messages_body(
                stream=True, max_tokens=7, thinking={"type": "enabled", "budget_tokens": 1024}
            ),
            b'"text_delta"',
        ),
        ("/v1/chat/completions", chat_body(stream=True, reasoning_effort="low"), b'{"content":"'),
    ],
)
@pytest.mark.parametrize("per_chunk", [1, 2])
async def test_the_schedule_follows_from_the_config_exactly(
    path: str, body: dict[str, Any], first_answer_kind: bytes, per_chunk: int
) -> None:
    """Opening events when the slot is granted (t = 0 here); the first reasoning delta
    after the prefill, T = prompt tokens / prefill rate + overhead; one step per ITL;
    the first answer delta ceil(3 / K) steps after T; the closing events with the last
    step. Every write is one step (or the opening, or the end)."""
    config = replace(SCHEDULED, tokens_per_chunk=per_chunk)
    writes = await timed_writes(config, path, body)
    from proxy.simulator.chat import render_chat_prompt
    from proxy.simulator.messages import render_messages_prompt
    from proxy.simulator.responses import render_responses_prompt

    render = {
        "/v1/responses": render_responses_prompt,
        "/v1/messages": render_messages_prompt,
        "/v1/chat/completions": render_chat_prompt,
    }[path]
    ttft = math.ceil(len(render(body)) / 4) / 1000.0 + 0.01
    reasoning_steps, answer_steps = -(-3 // per_chunk), -(-4 // per_chunk)
    times = [t for t, _ in writes]
    expected = [0.0] + [ttft + i * 0.02 for i in range(reasoning_steps + answer_steps)]
    # The closing events go out with no wait; chat writes its finish chunk and [DONE]
    # separately, as it always has.
    expected += [expected[-1]] * (2 if path == "/v1/chat/completions" else 1)
    assert times == pytest.approx(expected)
    first_answer = next(i for i, (_, w) in enumerate(writes) if first_answer_kind in w)
    assert first_answer == 1 + reasoning_steps
    assert times[first_answer] == pytest.approx(ttft + reasoning_steps * 0.02)
