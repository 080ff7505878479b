"""The simulator: its latency model driven by scripted times, and its HTTP answers.

Model tests pass times in by hand (the model has no clock), so they never sleep. App
tests run the FastAPI app in process through ``httpx.ASGITransport`` with all
latencies set to zero: they check shapes, not timing (ASGITransport joins the body).
Timing over real sockets is in tests/test_simulator_e2e.py.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from proxy.measure import inspect_event, upstream_queue_seconds
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
    """Admit at ``now`` (a slot must be free) and return the first-token delay."""
    plan = model.plan(text, **kw)
    ticket = model.arrive(now)
    assert ticket.admitted
    return model.start_prefill(plan, now) - now, plan


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
    model.plan(text)
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
    assert cache.lookup_and_insert("aaaabbbb") == 0
    assert cache.lookup_and_insert("ccccdddd") == 0
    assert len(cache) == 4
    assert cache.lookup_and_insert("aaaabbbb") == 2  # touched: now the most recent
    assert cache.lookup_and_insert("eeee") == 0  # evicts the oldest block: c...'s tail
    assert cache.lookup_and_insert("aaaabbbb") == 2
    assert cache.lookup_and_insert("ccccdddd") == 1  # its head survived, its tail did not
    assert PrefixCache(block_chars=4, capacity_blocks=0).lookup_and_insert("aaaa" * 4) == 0


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
    assert tickets[2].queue_s == pytest.approx(1.5)
    model.release(tickets[3], 1.6)  # a queued request gives up: nobody is admitted
    assert admitted == [2] and model.queued == 1
    model.release(tickets[0], 2.0)
    assert admitted == [2, 4]
    assert tickets[4].queue_s == pytest.approx(2.0)
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
    assert sim_cli.run(parse("--error-status", "600")) == 2
    assert "--error-status" in capsys.readouterr().err


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
