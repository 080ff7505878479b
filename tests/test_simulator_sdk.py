"""The official ``openai`` and ``anthropic`` SDKs against the simulator's Responses and
Messages routes, served by a real uvicorn on loopback.

Both SDKs build typed objects from every event (``openai.types.responses``,
``anthropic.types``) and their stream helpers accumulate a final object from the
deltas, checking the order of events as they go; a missing field, an event out of
order or a wrong index shows up here as an exception or a wrong final text. Timing is
not asserted (tests/test_simulator_e2e.py does that); zero latencies keep these fast.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import anthropic
import openai
import pytest

from proxy.simulator.app import VOCAB, create_simulator_app
from proxy.simulator.model import SimConfig
from tests.servers import RunningServer, serve_in_thread

pytestmark = pytest.mark.e2e

CONFIG = SimConfig(
    prefill_overhead=0.0,
    itl=0.0,
    jitter=0.0,
    output_tokens=7,
    output_dist="fixed",
    reasoning_tokens=5,
    seed=5,
)
MODEL = "sim-llm"
SYSTEM = "You are a careful assistant who answers briefly. " * 40  # 2 000 chars: 31 blocks


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(create_simulator_app(CONFIG)) as running:
        yield running


_OPENED: list[openai.OpenAI | anthropic.Anthropic] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPENED:
        _OPENED.pop().close()


def openai_client(server: RunningServer) -> openai.OpenAI:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-sim", max_retries=0, timeout=30)
    _OPENED.append(client)
    return client


def anthropic_client(server: RunningServer, key: str = "sk-ant-sim") -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=30)
    _OPENED.append(client)
    return client


def is_words(text: str, count: int) -> bool:
    pieces = text.split(" ")[1:]
    return len(pieces) == count and all(" " + p in VOCAB for p in pieces)


# ---------------------------------------------------------------------------
# OpenAI Responses


def test_openai_responses_stream_events_parse_and_carry_usage(server: RunningServer) -> None:
    client = openai_client(server)
    events = list(
        client.responses.create(
            model=MODEL,
            instructions=SYSTEM,
            input="What is 2+2?",
            reasoning={"effort": "low"},
            stream=True,
        )
    )
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * 5,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 7,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Typed, not just dicts: the SDK recognised every event.
    assert type(events[0]).__name__ == "ResponseCreatedEvent"
    assert type(events[4]).__name__ == "ResponseReasoningTextDeltaEvent"
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thoughts = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert is_words(answer, 7) and is_words(thoughts, 5)
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "completed" and final.output_text == answer
    assert final.output[0].type == "reasoning"
    assert final.output[0].content[0].text == thoughts  # type: ignore[union-attr,index]
    usage = final.usage
    assert usage is not None
    assert (usage.output_tokens, usage.output_tokens_details.reasoning_tokens) == (12, 5)
    assert usage.total_tokens == usage.input_tokens + 12
    assert usage.input_tokens > 500


def test_openai_responses_stream_helper_and_cached_tokens(server: RunningServer) -> None:
    client = openai_client(server)
    usages = []
    for question in ("First question?", "Second question?"):
        with client.responses.stream(
            model=MODEL, instructions="Cache me. " * 300, input=question
        ) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert final.output_text == "".join(deltas) and is_words(final.output_text, 7)
        assert final.usage is not None
        assert final.usage.output_tokens_details.reasoning_tokens == 0
        usages.append(final.usage)
    first, second = usages
    assert first.input_tokens_details.cached_tokens == 0
    # "<|system|>\n" + 3 000 characters + "\n<|user|>\n" are shared: 3 021 characters,
    # 47 whole 64-character blocks of 16 tokens, which the first request wrote.
    assert second.input_tokens_details.cached_tokens == 47 * 16
    assert first.input_tokens_details.cache_write_tokens == 47 * 16
    assert second.input_tokens_details.cache_write_tokens == 0  # nothing new to store


def test_openai_responses_non_stream_and_max_output_tokens(server: RunningServer) -> None:
    client = openai_client(server)
    response = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "Hi"}], reasoning={"effort": "high"}
    )
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert is_words(response.output_text, 7)
    assert response.usage is not None and response.usage.output_tokens == 12

    # max_output_tokens covers reasoning and answer; reaching it makes the response
    # "incomplete", streamed or not, as OpenAI does.
    truncated = client.responses.create(
        model=MODEL, input="Hi", reasoning={"effort": "low"}, max_output_tokens=8
    )
    assert truncated.status == "incomplete"
    assert truncated.incomplete_details is not None
    assert truncated.incomplete_details.reason == "max_output_tokens"
    assert is_words(truncated.output_text, 3)
    events = list(
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True)
    )
    assert events[-1].type == "response.incomplete"
    assert events[-2].item.status == "incomplete"  # type: ignore[union-attr]
    assert events[-1].response.usage.output_tokens == 4  # type: ignore[union-attr]


# ---------------------------------------------------------------------------
# Anthropic Messages


def test_anthropic_messages_stream_with_thinking(server: RunningServer) -> None:
    client = anthropic_client(server)
    with client.messages.stream(
        model=MODEL,
        max_tokens=12,
        system=SYSTEM,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "What is 2+2?"}],
    ) as stream:
        raw = []
        for event in stream:
            raw.append(event.type)
        final = stream.get_final_message()
    # The stream helper adds its own "text"/"thinking"/"signature" events after each delta.
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert raw.count("thinking") == 5 and raw.count("text") == 7
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert [block.type for block in final.content] == ["thinking", "text"]
    thinking, text = final.content
    assert is_words(thinking.thinking, 5) and thinking.signature  # type: ignore[union-attr]
    assert is_words(text.text, 7)  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"  # 12 = 5 thinking + 7 answer tokens
    usage = final.usage
    assert usage.output_tokens == 12
    assert usage.output_tokens_details is not None
    assert usage.output_tokens_details.thinking_tokens == 5
    # Anthropic's input_tokens excludes cache reads and writes.
    assert usage.cache_read_input_tokens is not None
    assert usage.cache_creation_input_tokens is not None
    assert (
        usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens > 500
    )


def test_anthropic_messages_create_and_cache_reads(server: RunningServer) -> None:
    client = anthropic_client(server)
    system = "Another cached system prompt. " * 100
    messages: list[Any] = [{"role": "user", "content": "Hello"}]
    first = client.messages.create(model=MODEL, max_tokens=30, system=system, messages=messages)
    second = client.messages.create(model=MODEL, max_tokens=30, system=system, messages=messages)
    assert first.type == "message" and first.role == "assistant"
    assert [b.type for b in first.content] == ["text"]
    assert is_words(first.content[0].text, 30)  # type: ignore[union-attr]
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 30
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens > 0
    total = [
        u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
        for u in (first.usage, second.usage)
    ]
    assert total[0] == total[1]  # same prompt: only its split between the three changes
    # What the first wrote, the second read; what is left is the same in both.
    assert second.usage.cache_creation_input_tokens == 0
    assert second.usage.input_tokens == first.usage.input_tokens
    with client.messages.stream(model=MODEL, max_tokens=3, messages=messages) as stream:
        assert is_words("".join(stream.text_stream), 3)


# ---------------------------------------------------------------------------
# Errors inside a 200 stream, and keys


def test_stream_errors_reach_both_sdks() -> None:
    app = create_simulator_app(replace(CONFIG, stream_error_rate=1.0))
    with serve_in_thread(app) as running:
        events = list(openai_client(running).responses.create(model=MODEL, input="x", stream=True))
        assert events[-1].type == "response.failed"
        failed = events[-1].response  # type: ignore[union-attr]
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "server_error"
        with (
            pytest.raises(anthropic.APIStatusError) as caught,
            anthropic_client(running).messages.stream(
                model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "x"}]
            ) as stream,
        ):
            for _ in stream:
                pass
        assert caught.value.body == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "Overloaded"},
        }
        with pytest.raises(openai.APIError):
            for _ in openai_client(running).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
            ):
                pass


def test_api_key_is_accepted_as_x_api_key() -> None:
    app = create_simulator_app(replace(CONFIG, api_key="sk-right"))
    with serve_in_thread(app) as running:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            anthropic_client(running, key="sk-wrong").messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
        assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        ok = anthropic_client(running, key="sk-right").messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
        assert ok.usage.output_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai_client(running).responses.create(model=MODEL, input="x")


def test_dropped_streams_break_both_sdks_reads() -> None:
    app = create_simulator_app(replace(CONFIG, drop_rate=1.0, output_tokens=50))
    with serve_in_thread(app) as running:
        with pytest.raises(openai.APIConnectionError):
            for _ in openai_client(running).responses.create(model=MODEL, input="x", stream=True):
                pass
        # The anthropic SDK lets its HTTP library's error through from a stream's read.
        with (
            pytest.raises(Exception, match="incomplete chunked read"),
            anthropic_client(running).messages.stream(
                model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "x"}]
            ) as stream,
        ):
            for _ in stream:
                pass
