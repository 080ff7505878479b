"""Dialects: what each API's events mean, usage normalisation, the byte checks against the
full decode, and the token template against the full path.

The recorded streams follow the official SDKs' event types (``openai.types.responses``
and ``anthropic.types``: the event names, field names and nesting) and the layouts the
APIs write (compact JSON, ``event:`` line first for Responses and Messages). Every
expectation is an exact value.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st

from proxy.dialects import (
    ANSWER,
    CHAT,
    COMPLETIONS,
    DIALECTS,
    END,
    ERROR,
    MESSAGES,
    NOT_COUNTED,
    REASONING,
    RESPONSES,
    AnswerInfo,
    Dialect,
    EventInfo,
    ResponseInfo,
    TokenTemplate,
    Usage,
    merge_usage,
    read_answer,
    upstream_queue_seconds,
)
from proxy.sse import SSEParser


def dumps(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def chat(*deltas: dict[str, Any], **extra: Any) -> bytes:
    """A chat.completion.chunk with one choice per delta."""
    choices = [{"index": i, "delta": d, "finish_reason": None} for i, d in enumerate(deltas)]
    return json.dumps({"object": "chat.completion.chunk", "choices": choices, **extra}).encode()


def text(*texts: str) -> bytes:
    choices = [{"index": i, "text": t} for i, t in enumerate(texts)]
    return json.dumps({"object": "text_completion", "choices": choices}).encode()


def usage_chunk(prompt: int, completion: int, **extra: Any) -> bytes:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    usage.update(extra)
    return json.dumps({"object": "chat.completion.chunk", "choices": [], "usage": usage}).encode()


def read(dialect: Dialect, events: Iterable[tuple[str, dict[str, Any]]]) -> list[EventInfo]:
    """Classify a recorded stream of ``(event name, payload)``, written as the API does."""
    return [dialect.classify(name.encode(), dumps(payload)) for name, payload in events]


def first(infos: Sequence[EventInfo], *, answer: bool) -> int | None:
    """Index of the first output event (TTFT), or of the first answer event."""
    for i, info in enumerate(infos):
        if info.outputs and (info.answer or not answer):
            return i
    return None


def stream_usage(dialect: Dialect, infos: Iterable[EventInfo]) -> Usage:
    """What the stream timer will do: merge every event's usage, normalise once."""
    acc: dict[str, Any] | None = None
    for info in infos:
        if info.usage is not None:
            acc = merge_usage(acc, info.usage)
    return dialect.usage(acc)


def test_the_four_dialects() -> None:
    assert {route: (d.name, d.injects_usage) for route, d in DIALECTS.items()} == {
        "/v1/chat/completions": ("chat", True),
        "/v1/completions": ("completions", True),
        "/v1/responses": ("responses", False),
        "/v1/messages": ("messages", False),
    }
    constants = (ANSWER, REASONING, NOT_COUNTED, ERROR)
    assert constants == (
        EventInfo(1, True),
        EventInfo(1, False),
        EventInfo(),
        EventInfo(error=True),
    )


# ---------------------------------------------------------------------------
# chat completions and completions


@pytest.mark.parametrize(
    ("delta", "expected"),
    [
        ({"role": "assistant"}, NOT_COUNTED),
        ({"role": "assistant", "content": ""}, NOT_COUNTED),
        ({"content": ""}, NOT_COUNTED),
        ({}, NOT_COUNTED),
        ({"content": None}, NOT_COUNTED),
        ({"content": "Hi"}, ANSWER),
        ({"role": "assistant", "content": "Hi"}, ANSWER),
        ({"reasoning_content": "thinking"}, REASONING),
        ({"reasoning": "thinking"}, REASONING),
        ({"reasoning_content": "", "content": ""}, NOT_COUNTED),
        ({"content": None, "reasoning_content": "x"}, REASONING),
        ({"content": "", "reasoning": "x"}, REASONING),
        ({"refusal": "I can't"}, ANSWER),
        ({"refusal": None}, NOT_COUNTED),
        ({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}, ANSWER),
        ({"tool_calls": []}, NOT_COUNTED),
        ({"function_call": {"name": "f", "arguments": ""}}, ANSWER),
        ({"function_call": None}, NOT_COUNTED),
        ({"content": "a", "reasoning_content": "b"}, ANSWER),  # one choice: one output
        ({"reasoning_content": "b", "refusal": "no"}, ANSWER),
        ({"reasoning_content": "b", "tool_calls": [{"index": 0}]}, ANSWER),
        ({"reasoning": "b", "function_call": {"arguments": "x"}}, ANSWER),
    ],
)
def test_chat_delta(delta: dict[str, Any], expected: EventInfo) -> None:
    assert CHAT.classify(b"", chat(delta)) == expected
    assert CHAT.classify_payload(b"", json.loads(chat(delta))) == expected


@pytest.mark.parametrize(
    ("texts", "expected"),
    [(("",), NOT_COUNTED), (("x",), ANSWER), (("x", "", "y"), EventInfo(2, True))],
)
def test_completions_text(texts: tuple[str, ...], expected: EventInfo) -> None:
    assert COMPLETIONS.classify(b"", text(*texts)) == expected
    assert CHAT.classify(b"", text(*texts)) == NOT_COUNTED  # no delta: no chat output


def test_chat_delta_is_not_text_output() -> None:
    assert COMPLETIONS.classify(b"", chat({"content": "x"})) == NOT_COUNTED


@pytest.mark.parametrize(
    ("deltas", "expected"),
    [
        (({"content": "a"}, {"role": "assistant"}, {"content": "c"}), EventInfo(2, True)),
        (({"reasoning_content": "a"}, {"content": "b"}), EventInfo(2, True)),
        (({"reasoning": "a"}, {"reasoning_content": "b"}), EventInfo(2, False)),
        (({"role": "assistant"}, {"reasoning": "b"}), REASONING),
        (({}, {}), NOT_COUNTED),
    ],
)
def test_n_greater_than_one_counts_choices(
    deltas: tuple[dict[str, Any], ...], expected: EventInfo
) -> None:
    assert CHAT.classify(b"", chat(*deltas)) == expected


def test_reasoning_then_answer_chat_stream() -> None:
    events = [
        chat({"role": "assistant", "content": ""}),
        chat({"reasoning_content": "Let"}),
        chat({"reasoning_content": " me"}),
        chat({"content": "Yes"}),
        chat({}, finish_reason="stop"),
        usage_chunk(9, 3, completion_tokens_details={"reasoning_tokens": 2}),
        b"[DONE]",
    ]
    infos = [CHAT.classify(b"", e) for e in events]
    assert infos[:5] == [NOT_COUNTED, REASONING, REASONING, ANSWER, NOT_COUNTED]
    assert infos[6] == END  # [DONE]: the stream's own last event
    assert (first(infos, answer=False), first(infos, answer=True)) == (1, 3)
    assert stream_usage(CHAT, infos) == Usage(9, None, 3, 2, None)


def test_usage_chunk_is_usage_only() -> None:
    data = usage_chunk(
        11, 7, prompt_tokens_details={"cached_tokens": 4, "cache_write_tokens": 5},
        completion_tokens_details={"reasoning_tokens": 3},
    )  # fmt: skip
    info = CHAT.classify(b"", data)
    assert info == EventInfo(0, False, json.loads(data)["usage"], True)
    assert CHAT.usage(info.usage) == Usage(11, 4, 7, 3, 5)
    assert COMPLETIONS.usage(info.usage) == Usage(11, 4, 7, 3, 5)


def test_usage_on_a_content_chunk_is_not_usage_only() -> None:
    """Some servers put usage on the last content chunk: keep it, never strip it."""
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    info = CHAT.classify(b"", chat({"content": "end"}, usage=usage))
    assert info == EventInfo(1, True, usage, False)
    assert CHAT.usage(info.usage) == Usage(3, None, 2)


def test_usage_without_choices_key_is_not_usage_only() -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 1}
    assert CHAT.classify(b"", dumps({"usage": usage})) == EventInfo(usage=usage)


def test_usage_null_on_every_chunk_is_no_usage() -> None:
    assert CHAT.classify(b"", chat({"content": "x"}, usage=None)) == ANSWER
    assert CHAT.classify(b"", chat({"role": "assistant"}, usage=None)) == NOT_COUNTED


def test_cumulative_usage_on_every_chunk_last_wins() -> None:
    """vLLM's ``continuous_usage_stats`` puts the running usage on every chunk."""
    events = [
        chat({"content": "a"}, usage={"prompt_tokens": 5, "completion_tokens": 1}),
        chat({"content": "b"}, usage={"prompt_tokens": 5, "completion_tokens": 2}),
        usage_chunk(5, 2),
    ]
    infos = [CHAT.classify(b"", e) for e in events]
    assert [i.outputs for i in infos] == [1, 1, 0]
    assert stream_usage(CHAT, infos) == Usage(5, None, 2)


@pytest.mark.parametrize(
    "payload",
    [
        # vLLM: the ErrorResponse inside "error"
        {"error": {"object": "error", "message": "boom", "type": "BadRequestError",
                   "param": None, "code": 400}},
        {"error": "Request failed during generation", "error_type": "generation"},  # TGI
        {"id": "c", "choices": [], "error": {"message": "overloaded"}},
        {"id": "c", "choices": [{"index": 0, "delta": {}}], "error": {"message": "x"}},
    ],
)  # fmt: skip
def test_chat_error_inside_the_stream(payload: dict[str, Any]) -> None:
    for dialect in (CHAT, COMPLETIONS):
        assert dialect.classify(b"", dumps(payload)) == ERROR
        assert dialect.classify(b"", json.dumps(payload).encode()) == ERROR


def test_chat_error_with_usage_is_never_usage_only() -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 0}
    data = dumps({"choices": [], "usage": usage, "error": {"message": "x"}})
    assert CHAT.classify(b"", data) == EventInfo(usage=usage, error=True)


@pytest.mark.parametrize(
    "payload",
    [
        {"choices": [{"index": 0, "delta": {"content": "x"}}], "error": None},
        {"choices": [{"index": 0, "delta": {"content": "x"}}], "error": {}},
        {"choices": [{"index": 0, "delta": {"content": "x"}}], "error": {"message": "y"}},
        {"choices": [{"index": 0, "delta": {"content": "x", "error": "no"}}]},
    ],
)
def test_chat_output_is_never_an_error(payload: dict[str, Any]) -> None:
    assert CHAT.classify(b"", dumps(payload)) == ANSWER


@pytest.mark.parametrize(
    "payload", [{"error": None}, {"error": {}}, {"error": ""}, {"error": False}, {"errors": [1]}]
)
def test_chat_falsy_error_is_no_error(payload: dict[str, Any]) -> None:
    assert CHAT.classify(b"", dumps(payload)) == NOT_COUNTED


def test_chat_event_name_is_ignored_but_error() -> None:
    data = chat({"content": "x"})
    assert CHAT.classify(b"message", data) == ANSWER
    assert CHAT.classify(b"error", data) == ERROR
    assert CHAT.classify(b"error", b"upstream went away") == ERROR


def test_leading_whitespace_before_json_is_tolerated() -> None:
    assert CHAT.classify(b"", b"  " + chat({"content": "x"})) == ANSWER
    assert CHAT.classify(b"", chat({"content": "x"}) + b"\n") == ANSWER


def test_vllm_queue_time() -> None:
    data = usage_chunk(5, 5, metrics={"queue_time_ms": 250})
    info = CHAT.classify(b"", data)
    assert (info.upstream_queue_s, info.usage_only) == (0.25, True)
    top = dumps({"choices": [], "usage": {"prompt_tokens": 1}, "metrics": {"queue_time_ms": 12.5}})
    assert CHAT.classify(b"", top).upstream_queue_s == 0.0125
    alone = CHAT.classify(b"", b'{"metrics": {"queue_time_ms": 8}}')
    assert alone == EventInfo(upstream_queue_s=0.008)


@pytest.mark.parametrize("value", [-1, "12", None, True, [], float("nan"), float("inf")])
def test_bad_queue_time_is_ignored(value: Any) -> None:
    payload = {"usage": {"metrics": {"queue_time_ms": value}}}
    assert upstream_queue_seconds(payload) is None
    assert CHAT.classify(b"", json.dumps(payload).encode()).upstream_queue_s is None


def test_chat_usage_rejects_bad_values() -> None:
    assert CHAT.usage(None) == Usage()
    assert CHAT.usage({}) == Usage()
    bad = {
        "prompt_tokens": "3", "completion_tokens": 2.0,
        "prompt_tokens_details": {"cached_tokens": False, "cache_write_tokens": -1},
        "completion_tokens_details": {"reasoning_tokens": None},
    }  # fmt: skip
    assert CHAT.usage(bad) == Usage()
    assert CHAT.usage({"prompt_tokens": 3, "prompt_tokens_details": None}) == Usage(3)
    assert CHAT.usage({"prompt_tokens": 0, "completion_tokens": 0}) == Usage(0, None, 0)


def test_chat_non_stream_body_usage() -> None:
    usage = {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}
    body = {"id": "c", "object": "chat.completion", "choices": [], "usage": usage}
    assert CHAT.body_usage(body) == usage
    assert CHAT.usage(CHAT.body_usage(body)) == Usage(9, None, 12)
    assert CHAT.body_usage({"usage": None}) is None
    assert CHAT.body_usage({}) is None


# ---------------------------------------------------------------------------
# Responses: a recorded text stream, then every event type


def resp(kind: str, seq: int, **fields: Any) -> tuple[str, dict[str, Any]]:
    return kind, {"type": kind, "sequence_number": seq, **fields}


def response_object(status: str, usage: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "resp_1", "object": "response", "created_at": 1741290958, "status": status,
        "error": None, "incomplete_details": None, "model": "gpt-4.1-2025-04-14",
        "output": [], "parallel_tool_calls": True, "text": {"format": {"type": "text"}},
        "tools": [], "usage": usage, **extra,
    }  # fmt: skip


RESPONSE_USAGE = {
    "input_tokens": 37,
    "input_tokens_details": {"cached_tokens": 12, "cache_write_tokens": 20},
    "output_tokens": 11,
    "output_tokens_details": {"reasoning_tokens": 4},
    "total_tokens": 48,
}


def text_delta(seq: int, delta: str) -> tuple[str, dict[str, Any]]:
    return resp(
        "response.output_text.delta", seq, item_id="msg_1", output_index=0, content_index=0,
        delta=delta, logprobs=[], obfuscation="x" * (seq % 7),
    )  # fmt: skip


RESPONSES_TEXT_STREAM = [
    resp("response.created", 0, response=response_object("in_progress", None)),
    resp("response.in_progress", 1, response=response_object("in_progress", None)),
    resp("response.output_item.added", 2, output_index=0, item={
        "id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant",
        "content": []}),
    resp("response.content_part.added", 3, item_id="msg_1", output_index=0, content_index=0,
         part={"type": "output_text", "text": "", "annotations": []}),
    text_delta(4, "Hi"),
    text_delta(5, ""),
    text_delta(6, " there"),
    resp("response.output_text.done", 7, item_id="msg_1", output_index=0, content_index=0,
         text="Hi there", logprobs=[]),
    resp("response.content_part.done", 8, item_id="msg_1", output_index=0, content_index=0,
         part={"type": "output_text", "text": "Hi there", "annotations": []}),
    resp("response.output_item.done", 9, output_index=0, item={
        "id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": "Hi there", "annotations": []}]}),
    resp("response.completed", 10, response=response_object("completed", RESPONSE_USAGE)),
]  # fmt: skip


RESPONSE_INFO = ResponseInfo("resp_1", "gpt-4.1-2025-04-14", ((0, "completed"),))


def test_responses_text_stream() -> None:
    infos = read(RESPONSES, RESPONSES_TEXT_STREAM)
    usage_event = EventInfo(usage=RESPONSE_USAGE, response=RESPONSE_INFO, end=True)
    assert infos == [NOT_COUNTED] * 4 + [ANSWER, NOT_COUNTED, ANSWER] + [NOT_COUNTED] * 3 + [
        usage_event
    ]
    assert (first(infos, answer=False), first(infos, answer=True)) == (4, 4)
    assert stream_usage(RESPONSES, infos) == Usage(37, 12, 11, 4, 20)


def test_responses_reasoning_then_answer() -> None:
    events = [
        resp("response.created", 0, response=response_object("in_progress", None)),
        resp("response.output_item.added", 1, output_index=0,
             item={"id": "rs_1", "type": "reasoning", "summary": []}),
        resp("response.reasoning_summary_part.added", 2, item_id="rs_1", output_index=0,
             summary_index=0, part={"type": "summary_text", "text": ""}),
        resp("response.reasoning_summary_text.delta", 3, item_id="rs_1", output_index=0,
             summary_index=0, delta="**Plan**"),
        resp("response.reasoning_text.delta", 4, item_id="rs_1", output_index=0,
             content_index=0, delta="think"),
        resp("response.reasoning_summary_text.done", 5, item_id="rs_1", output_index=0,
             summary_index=0, text="**Plan**"),
        resp("response.output_item.done", 6, output_index=0,
             item={"id": "rs_1", "type": "reasoning", "summary": []}),
        text_delta(7, "Answer"),
        resp("response.completed", 8, response=response_object("completed", RESPONSE_USAGE)),
    ]  # fmt: skip
    infos = read(RESPONSES, events)
    assert [i.outputs for i in infos] == [0, 0, 0, 1, 1, 0, 0, 1, 0]
    assert [i.answer for i in infos] == [False] * 7 + [True, False]
    assert (first(infos, answer=False), first(infos, answer=True)) == (3, 7)


def test_responses_tool_call_stream() -> None:
    item = {"id": "fc_1", "type": "function_call", "status": "in_progress", "arguments": "",
            "call_id": "call_1", "name": "get_weather"}  # fmt: skip
    events = [
        resp("response.output_item.added", 1, output_index=0, item=item),
        resp("response.function_call_arguments.delta", 2, item_id="fc_1", output_index=0,
             delta='{"location":'),
        resp("response.function_call_arguments.delta", 3, item_id="fc_1", output_index=0,
             delta='"Paris"}'),
        resp("response.function_call_arguments.done", 4, item_id="fc_1", output_index=0,
             arguments='{"location":"Paris"}', name="get_weather"),
    ]  # fmt: skip
    assert read(RESPONSES, events) == [NOT_COUNTED, ANSWER, ANSWER, NOT_COUNTED]


RESPONSES_OUTPUT_TYPES = [
    ("response.output_text.delta", ANSWER),
    ("response.refusal.delta", ANSWER),
    ("response.function_call_arguments.delta", ANSWER),
    ("response.custom_tool_call_input.delta", ANSWER),
    ("response.mcp_call_arguments.delta", ANSWER),
    ("response.code_interpreter_call_code.delta", ANSWER),
    ("response.shell_call_command.delta", ANSWER),
    ("response.audio.delta", ANSWER),
    ("response.audio.transcript.delta", ANSWER),
    ("response.reasoning_text.delta", REASONING),
    ("response.reasoning_summary_text.delta", REASONING),
]


@pytest.mark.parametrize(("kind", "expected"), RESPONSES_OUTPUT_TYPES)
def test_responses_output_delta_types(kind: str, expected: EventInfo) -> None:
    fields = {"item_id": "x_1", "output_index": 0}
    assert read(RESPONSES, [resp(kind, 5, delta="abc", **fields)]) == [expected]
    assert read(RESPONSES, [resp(kind, 5, delta="", **fields)]) == [NOT_COUNTED]
    assert read(RESPONSES, [resp(kind, 5, **fields)]) == [NOT_COUNTED]  # no delta at all
    assert read(RESPONSES, [resp(kind, 5, delta=None, **fields)]) == [NOT_COUNTED]


@pytest.mark.parametrize(
    "kind",
    [
        "response.created", "response.in_progress", "response.queued",
        "response.output_item.added", "response.output_item.done",
        "response.content_part.added", "response.content_part.done",
        "response.output_text.done", "response.refusal.done",
        "response.function_call_arguments.done", "response.reasoning_text.done",
        "response.reasoning_summary_part.added", "response.reasoning_summary_text.done",
        "response.audio.done", "response.audio.transcript.done",
        "response.custom_tool_call_input.done", "response.mcp_call_arguments.done",
        "response.code_interpreter_call_code.done", "response.shell_call_command.added",
        "response.shell_call_output_content.delta", "response.output_text.annotation.added",
        "response.image_generation_call.partial_image", "response.web_search_call.searching",
        "response.compaction.compacting", "response.unknown.delta",
    ],
)  # fmt: skip
def test_responses_events_that_are_never_output(kind: str) -> None:
    # even with a non-empty "delta" (shell output carries one)
    assert read(RESPONSES, [resp(kind, 5, delta="abc", item_id="x")]) == [NOT_COUNTED]
    assert read(RESPONSES, [resp(kind, 5, delta={"stdout": "x"})]) == [NOT_COUNTED]


@pytest.mark.parametrize(
    ("kind", "error"),
    [("response.completed", False), ("response.incomplete", False), ("response.failed", True)],
)
def test_responses_usage_events(kind: str, error: bool) -> None:
    response = response_object(kind.split(".")[1], RESPONSE_USAGE)
    infos = read(RESPONSES, [resp(kind, 9, response=response)])
    said = ResponseInfo("resp_1", "gpt-4.1-2025-04-14", ((0, kind.split(".")[1]),))
    assert infos == [EventInfo(usage=RESPONSE_USAGE, error=error, response=said, end=True)]
    assert RESPONSES.usage(infos[0].usage) == Usage(37, 12, 11, 4, 20)
    no_usage = read(RESPONSES, [resp(kind, 9, response=response_object(kind, None))])
    assert no_usage == [EventInfo(error=error, response=said._replace(finish=((0, kind),)),
                                  end=True)]


def test_responses_usage_only_from_the_final_events() -> None:
    """``response.created`` carries the response object too; its usage is not the total."""
    early = response_object("in_progress", RESPONSE_USAGE)
    assert read(RESPONSES, [resp("response.created", 0, response=early)]) == [NOT_COUNTED]
    assert read(RESPONSES, [resp("response.in_progress", 1, response=early)]) == [NOT_COUNTED]


def test_responses_error_events() -> None:
    error = resp("error", 3, code="server_error", message="The server had an error", param=None)
    nested = resp("error", 3, error={"type": "server_error", "code": None, "message": "x"})
    failed = response_object(
        "failed", None, error={"code": "server_error", "message": "Something went wrong"}
    )
    incomplete = response_object(
        "incomplete", RESPONSE_USAGE, incomplete_details={"reason": "max_output_tokens"}
    )
    infos = read(
        RESPONSES,
        [error, nested, resp("response.failed", 4, response=failed),
         resp("response.incomplete", 5, response=incomplete)],
    )  # fmt: skip
    assert infos == [
        ERROR, ERROR,
        EventInfo(error=True, response=RESPONSE_INFO._replace(finish=((0, "failed"),)),
                  end=True),
        EventInfo(usage=RESPONSE_USAGE,
                  response=RESPONSE_INFO._replace(finish=((0, "max_output_tokens"),)), end=True),
    ]  # fmt: skip
    # with no name at all, a chat-style error object still says error
    assert RESPONSES.classify(b"", b'{"error":{"message":"boom"}}') == ERROR
    assert RESPONSES.classify(b"", b"not json") == NOT_COUNTED


def test_responses_usage_rejects_bad_values() -> None:
    assert RESPONSES.usage(None) == Usage()
    bad = {"input_tokens": True, "input_tokens_details": [], "output_tokens": -2,
           "output_tokens_details": {"reasoning_tokens": "4"}}  # fmt: skip
    assert RESPONSES.usage(bad) == Usage()
    assert RESPONSES.usage({"input_tokens": 3, "output_tokens": 0}) == Usage(3, None, 0)


def test_responses_non_stream_body_usage() -> None:
    body = response_object("completed", RESPONSE_USAGE)
    assert RESPONSES.usage(RESPONSES.body_usage(body)) == Usage(37, 12, 11, 4, 20)
    assert RESPONSES.body_usage(response_object("completed", None)) is None


# ---------------------------------------------------------------------------
# Messages


def msg(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return kind, {"type": kind, **fields}


def block_delta(index: int, **delta: Any) -> tuple[str, dict[str, Any]]:
    return msg("content_block_delta", index=index, delta=delta)


def message_start(usage: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return msg("message_start", message={
        "id": "msg_1", "type": "message", "role": "assistant", "content": [],
        "model": "claude-sonnet-4-5", "stop_reason": None, "stop_sequence": None,
        "usage": usage})  # fmt: skip


START_USAGE = {
    "input_tokens": 472,
    "cache_creation_input_tokens": 100,
    "cache_read_input_tokens": 2000,
    "output_tokens": 2,
}

MESSAGES_STREAM = [
    message_start(START_USAGE),
    msg("content_block_start", index=0, content_block={"type": "thinking", "thinking": ""}),
    ("ping", {"type": "ping"}),
    block_delta(0, type="thinking_delta", thinking="Let me"),
    block_delta(0, type="thinking_delta", thinking=" think"),
    block_delta(0, type="signature_delta", signature="EqQBCgIYAhIM1gbcDa9GJwZA2b3h"),
    msg("content_block_stop", index=0),
    msg("content_block_start", index=1, content_block={"type": "text", "text": ""}),
    block_delta(1, type="text_delta", text="Hello"),
    block_delta(1, type="text_delta", text=""),
    block_delta(1, type="citations_delta", citation={
        "type": "char_location", "cited_text": "x", "document_index": 0,
        "document_title": "d", "start_char_index": 0, "end_char_index": 1}),
    block_delta(1, type="text_delta", text="!"),
    msg("content_block_stop", index=1),
    msg("content_block_start", index=2, content_block={
        "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}),
    block_delta(2, type="input_json_delta", partial_json=""),
    block_delta(2, type="input_json_delta", partial_json='{"location": "San Fra'),
    msg("content_block_stop", index=2),
    msg("message_delta", delta={"stop_reason": "tool_use", "stop_sequence": None},
        usage={"output_tokens": 40}),
    msg("message_delta", delta={"stop_reason": "tool_use", "stop_sequence": None},
        usage={"input_tokens": 472, "cache_creation_input_tokens": 100,
               "cache_read_input_tokens": 2000, "output_tokens": 89,
               "output_tokens_details": {"thinking_tokens": 30}}),
    msg("message_stop"),
]  # fmt: skip


def test_messages_stream() -> None:
    infos = read(MESSAGES, MESSAGES_STREAM)
    placeholder = {k: v for k, v in START_USAGE.items() if k != "output_tokens"}
    start = EventInfo(usage=placeholder, response=ResponseInfo("msg_1", "claude-sonnet-4-5"))
    stopped = ResponseInfo(finish=((0, "tool_use"),))
    delta1, delta2 = (EventInfo(usage=MESSAGES_STREAM[i][1]["usage"], response=stopped)
                      for i in (17, 18))
    assert infos == [
        start, NOT_COUNTED, NOT_COUNTED, REASONING, REASONING, NOT_COUNTED, NOT_COUNTED,
        NOT_COUNTED, ANSWER, NOT_COUNTED, NOT_COUNTED, ANSWER, NOT_COUNTED, NOT_COUNTED,
        NOT_COUNTED, ANSWER, NOT_COUNTED, delta1, delta2, END,
    ]  # fmt: skip
    assert (first(infos, answer=False), first(infos, answer=True)) == (3, 8)
    # cumulative counts: the last value of each field wins, never a sum
    assert stream_usage(MESSAGES, infos) == Usage(472 + 2000 + 100, 2000, 89, 30, 100)


def test_messages_usage_last_value_wins() -> None:
    events = [
        message_start({"input_tokens": 25, "output_tokens": 1}),
        block_delta(0, type="text_delta", text="Hi"),
        msg("message_delta", delta={}, usage={"output_tokens": 5}),
        msg("message_delta", delta={}, usage={"output_tokens": 15}),
        msg("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 12}),
    ]
    assert stream_usage(MESSAGES, read(MESSAGES, events)) == Usage(25, None, 12)
    # cut before any message_delta: message_start's output_tokens is a placeholder
    assert stream_usage(MESSAGES, read(MESSAGES, events[:2])) == Usage(25)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"input_tokens": 25, "output_tokens": 1}, Usage(25, None, 1)),
        ({"input_tokens": 25, "cache_read_input_tokens": None, "output_tokens": 1},
         Usage(25, None, 1)),
        ({"input_tokens": 25, "cache_read_input_tokens": 5}, Usage(30, 5)),
        ({"input_tokens": 25, "cache_creation_input_tokens": 7},
         Usage(32, None, None, None, 7)),
        ({"cache_read_input_tokens": 5, "cache_creation_input_tokens": 7, "output_tokens": 3},
         Usage(None, 5, 3, None, 7)),
        ({"input_tokens": "25", "output_tokens": True}, Usage()),
        ({"input_tokens": 1, "output_tokens": 9, "output_tokens_details": {"thinking_tokens": 4}},
         Usage(1, None, 9, 4)),
        ({}, Usage()),
    ],
)  # fmt: skip
def test_messages_usage_normalisation(raw: dict[str, Any], expected: Usage) -> None:
    assert MESSAGES.usage(raw) == expected


def test_messages_error_events() -> None:
    payload = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert MESSAGES.classify(b"error", dumps(payload)) == ERROR
    assert MESSAGES.classify(b"", dumps(payload)) == ERROR
    assert MESSAGES.classify(b"", json.dumps(payload).encode()) == ERROR
    assert MESSAGES.classify(b"error", b"") == ERROR
    assert MESSAGES.classify(b"", b'{"error":{"type":"api_error"}}') == ERROR  # no name
    assert MESSAGES.classify(b"ping", b'{"type": "ping"}') == NOT_COUNTED


def test_messages_non_stream_body_usage() -> None:
    body = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [],
        "usage": {"input_tokens": 10, "cache_read_input_tokens": 4, "output_tokens": 20},
    }
    assert MESSAGES.usage(MESSAGES.body_usage(body)) == Usage(14, 4, 20)  # fmt: skip


# ---------------------------------------------------------------------------
# Response info: id, model, finish reasons, from events without output only


def chunk(*choices: dict[str, Any], **extra: Any) -> bytes:
    """A compact chat chunk as OpenAI and vLLM write it (id and model on every chunk)."""
    return dumps({"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1,
                  "model": "gpt-4o-2024-08-06", "choices": list(choices), **extra})


CHUNK_INFO = ResponseInfo("chatcmpl-9", "gpt-4o-2024-08-06")


@pytest.mark.parametrize("compact", [True, False])
def test_chat_finish_chunk_says_why(compact: bool) -> None:
    """OpenAI ends each choice with an empty delta and its finish_reason: decoded (one
    per choice per stream); the role chunk before it is not."""
    data = chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"})
    if not compact:
        data = json.dumps(json.loads(data)).encode()
    finished = CHUNK_INFO._replace(finish=((0, "length"),))
    assert CHAT.classify(b"", data) == EventInfo(response=finished)
    role = chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                  "finish_reason": None})
    assert CHAT.classify(b"", role) == NOT_COUNTED


def test_chat_usage_chunk_names_the_response() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    info = CHAT.classify(b"", chunk(usage=usage))
    assert info == EventInfo(0, False, usage, True, response=CHUNK_INFO)


def test_chat_finish_of_every_choice_in_choice_order() -> None:
    data = chunk({"index": 1, "delta": {}, "finish_reason": "stop"},
                 {"index": 0, "delta": {}, "finish_reason": "tool_calls"})
    info = CHAT.classify(b"", data)
    assert info.response is not None
    assert info.response.finish_reasons == ("tool_calls", "stop")


def test_completions_finish_chunk() -> None:
    data = dumps({"id": "cmpl-1", "object": "text_completion", "model": "m",
                  "choices": [{"index": 0, "text": "", "logprobs": None,
                               "finish_reason": "stop"}]})
    assert COMPLETIONS.classify(b"", data) == EventInfo(
        response=ResponseInfo("cmpl-1", "m", ((0, "stop"),)))


def test_finish_on_the_last_token_is_read_at_the_end() -> None:
    """vLLM puts the reason on the last token's event: the byte check reads it as a token
    without decoding, and output_response decodes it once, at the end."""
    data = chunk({"index": 0, "delta": {"content": "."}, "logprobs": None,
                  "finish_reason": "length", "stop_reason": None})
    assert CHAT.classify(b"", data) == ANSWER
    assert CHAT.output_response(data) == CHUNK_INFO._replace(finish=((0, "length"),))
    assert CHAT.output_response(b"not json") is None
    assert RESPONSES.output_response(data) is None
    assert MESSAGES.output_response(data) is None


def test_response_info_is_bounded() -> None:
    data = chunk({"index": 0, "delta": {}, "finish_reason": "x" * 1000}, id="i" * 1000)
    info = CHAT.classify(b"", data).response
    assert info is not None
    assert (len(info.id), len(info.finish_reasons[0])) == (256, 64)


@pytest.mark.parametrize(("dialect", "body", "expected"), [
    (CHAT, {"id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o-mini-2024-07-18",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                         "finish_reason": "stop"},
                        {"index": 1, "message": {"role": "assistant", "content": "y"},
                         "finish_reason": "length"}]},
     ResponseInfo("chatcmpl-1", "gpt-4o-mini-2024-07-18", ((0, "stop"), (1, "length")))),
    (COMPLETIONS, {"id": "cmpl-1", "object": "text_completion", "model": "m",
                   "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]},
     ResponseInfo("cmpl-1", "m", ((0, "length"),))),
    (RESPONSES, response_object("incomplete", RESPONSE_USAGE,
                                incomplete_details={"reason": "content_filter"}),
     RESPONSE_INFO._replace(finish=((0, "content_filter"),))),
    (RESPONSES, response_object("completed", RESPONSE_USAGE), RESPONSE_INFO),
    (MESSAGES, {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                "model": "claude-sonnet-4-5", "stop_reason": "max_tokens",
                "usage": {"input_tokens": 1, "output_tokens": 2}},
     ResponseInfo("msg_1", "claude-sonnet-4-5", ((0, "max_tokens"),))),
    (CHAT, {"error": {"message": "x"}}, ResponseInfo()),
])  # fmt: skip
def test_non_stream_body_response(dialect: Dialect, body: dict[str, Any],
                                  expected: ResponseInfo) -> None:
    assert dialect.body_response(body) == expected


def test_a_non_stream_answer_read_whole() -> None:
    """What the finish reads of a non-stream answer's bytes: usage, vLLM's queue time
    and response info as the dialect reads them; nothing from a body that is not a
    JSON object."""
    usage = {"prompt_tokens": 9, "completion_tokens": 12}
    body = {"id": "c1", "model": "m", "usage": usage, "metrics": {"queue_time_ms": 250},
            "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}]}
    assert read_answer(CHAT, json.dumps(body).encode()) == AnswerInfo(
        usage, 0.25, ResponseInfo("c1", "m", ((0, "stop"),)))
    message = {"id": "msg_1", "model": "claude", "stop_reason": "end_turn",
               "usage": {"input_tokens": 1, "output_tokens": 2}}
    assert read_answer(MESSAGES, json.dumps(message).encode()) == AnswerInfo(
        message["usage"], None, ResponseInfo("msg_1", "claude", ((0, "end_turn"),)))
    for not_an_object in (b"[1]", b'"x"', b"{", b"\xff", b"[" * 100_000):
        assert read_answer(CHAT, not_an_object) is None


# ---------------------------------------------------------------------------
# Event name: from the ``event:`` line or the data's "type", the same either way

NAMED_STREAMS: list[tuple[Dialect, list[tuple[str, dict[str, Any]]]]] = [
    (RESPONSES, RESPONSES_TEXT_STREAM),
    (RESPONSES, [resp(kind, 1, delta="d") for kind, _ in RESPONSES_OUTPUT_TYPES]),
    (RESPONSES, [resp("error", 2, message="m"),
                 resp("response.failed", 3, response=response_object("failed", None))]),
    (MESSAGES, MESSAGES_STREAM),
    (MESSAGES, [msg("error", error={"type": "overloaded_error", "message": "Overloaded"})]),
]  # fmt: skip


@pytest.mark.parametrize(("dialect", "events"), NAMED_STREAMS)
def test_event_line_or_type_field_read_the_same(
    dialect: Dialect, events: list[tuple[str, dict[str, Any]]]
) -> None:
    both = [dialect.classify(name.encode(), dumps(p)) for name, p in events]
    line_only = [
        dialect.classify(name.encode(), dumps({k: v for k, v in p.items() if k != "type"}))
        for name, p in events
    ]
    type_only = [dialect.classify(b"", dumps(p)) for _, p in events]
    spaced = [dialect.classify(b"", json.dumps(p).encode()) for _, p in events]
    assert both == line_only == type_only == spaced
    assert any(info.outputs or info.usage or info.error for info in both)


def test_event_line_wins_over_the_type_field() -> None:
    data = dumps(text_delta(1, "x")[1])
    assert RESPONSES.classify(b"response.output_text.done", data) == NOT_COUNTED
    assert RESPONSES.classify(b"response.reasoning_text.delta", data) == REASONING


# ---------------------------------------------------------------------------
# Nothing raises, whatever the input

MALFORMED = [
    b"[DONE]", b"", b" ", b"{", b"}", b"{not json}", b'{"choices": "nope"}', b"[1, 2]",
    b"null", b"42", b'"text"', b'{"choices": [null, 1, "x", {"delta": "str"}]}',
    b'{"choices": [{"delta": {"content": 5}}]}', b'{"usage": "many"}', b"\xff\xfe{",
    b"{" * 100_000, b"[" * 100_000, b'{"choices": [{"delta": {"tool_calls": 0}}]}',
    b'{"n": 1' + b"0" * 5000 + b"}",  # int longer than Python's digit limit
    b'{"usage": {"prompt_tokens": -1, "completion_tokens": true}}',
    b'{"type":"response.output_text.delta"', b'{"type":"response.output_text.delta"}',
    b'{"type":"response.output_text.delta","delta":5}', b'{"type":["x"],"delta":"y"}',
    b'{"type":"content_block_delta","delta":{"type":["text_delta"],"text":"x"}}',
    b'{"type":"content_block_delta","delta":"text"}', b'{"type":"message_start"}',
    b'{"type":"message_start","message":{"usage":[]}}', b'{"type":"response.completed"}',
    b'{"type":"response.completed","response":{"usage":7}}', b'{"type":"\\u0000"}',
    b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"\xff"}}',
]  # fmt: skip
NAMES = [b"", b"error", b"message", b"\xff\xfe", b"content_block_delta", b"response.completed",
         b"response.output_text.delta", b"message_start"]  # fmt: skip


@pytest.mark.parametrize("data", MALFORMED)
def test_malformed_events_never_raise(data: bytes) -> None:
    for dialect in DIALECTS.values():
        for name in NAMES:
            info = dialect.classify(name, data)
            assert isinstance(info, EventInfo)
            assert info.outputs == 0 or data.endswith(b"}")
            assert not info.usage_only
            usage = dialect.usage(info.usage)
            assert usage == Usage() or info.usage is None


@pytest.mark.parametrize("raw", [None, {}, [], "x", 3, {"usage": [1]}, {"usage": None}])
def test_usage_of_anything(raw: Any) -> None:
    for dialect in DIALECTS.values():
        assert dialect.usage(raw) == Usage()
        assert dialect.body_usage(raw) is None
    assert merge_usage(None, raw) == ({"usage": [1]} if raw == {"usage": [1]} else {})


# ---------------------------------------------------------------------------
# merge_usage


def test_merge_usage_later_fields_win_and_details_merge() -> None:
    acc = merge_usage(None, {"input_tokens": 5, "output_tokens": 1,
                             "output_tokens_details": {"thinking_tokens": 0, "x": 1}})  # fmt: skip
    acc = merge_usage(acc, {"output_tokens": 7, "output_tokens_details": {"thinking_tokens": 3}})
    acc = merge_usage(acc, {"output_tokens": 9, "cache_read_input_tokens": None})
    assert acc == {
        "input_tokens": 5,
        "output_tokens": 9,
        "output_tokens_details": {"thinking_tokens": 3, "x": 1},
    }


def test_merge_usage_never_aliases_an_event_mapping() -> None:
    raw = {"prompt_tokens_details": {"cached_tokens": 1}, "prompt_tokens": 3}
    acc = merge_usage(None, raw)
    merge_usage(acc, {"prompt_tokens_details": {"cached_tokens": 2}})
    assert raw == {"prompt_tokens_details": {"cached_tokens": 1}, "prompt_tokens": 3}
    assert acc["prompt_tokens_details"] == {"cached_tokens": 2}


def test_merge_usage_replaces_a_non_mapping_and_keeps_nulls_out() -> None:
    acc = merge_usage(None, {"metrics": 5, "server_tool_use": None})
    assert merge_usage(acc, {"metrics": {"queue_time_ms": 3}}) == {"metrics": {"queue_time_ms": 3}}


# ---------------------------------------------------------------------------
# The byte checks agree with the full decode

_texts = st.one_of(
    st.just(""),
    st.text(max_size=8),
    st.sampled_from(
        ['"', "\\", '"content":"x"', '\\"text\\": \\"y', "é", "\n", '"delta":"', "delta",
         "text", "type", '{"type":"', "thinking", '","text":"', "}", '"}', "\u2028"]
    ),
)  # fmt: skip
_separators = st.sampled_from([(",", ":"), (", ", ": "), (",", " : ")])


def _encode(draw: st.DrawFn, payload: Any) -> bytes:
    return json.dumps(
        payload, separators=draw(_separators), ensure_ascii=draw(st.booleans())
    ).encode()


def _ordered(
    draw: st.DrawFn, fields: dict[str, Any], first_key: str | None = None
) -> dict[str, Any]:
    """``fields`` in a drawn order, ``first_key`` first (as the APIs write "type")."""
    keys = [k for k in fields if k != first_key]
    keys = draw(st.permutations(keys))
    if first_key in fields:
        keys = [first_key, *keys]
    return {k: fields[k] for k in keys}


_deltas = st.dictionaries(
    st.sampled_from(["content", "reasoning_content", "reasoning", "refusal", "role", "text"]),
    st.one_of(_texts, st.none()),
    max_size=3,
)
_tool_calls = st.lists(
    st.fixed_dictionaries(
        {"index": st.integers(0, 2), "function": st.fixed_dictionaries({"arguments": _texts})}
    ),
    max_size=2,
)


@st.composite
def choice_chunks(draw: st.DrawFn) -> tuple[Dialect, bytes, bytes]:
    dialect = draw(st.sampled_from([CHAT, COMPLETIONS]))
    choices = []
    for i in range(draw(st.integers(0, 3))):
        if dialect is COMPLETIONS:
            finish = draw(st.sampled_from([None, "stop", "length"]))
            choices.append({"index": i, "text": draw(_texts), "finish_reason": finish})
        else:
            delta = draw(_deltas)
            calls = draw(_tool_calls)
            if calls:
                delta["tool_calls"] = calls
            if draw(st.integers(0, 5)) == 0:
                delta["function_call"] = draw(
                    st.one_of(st.just({}), st.fixed_dictionaries({"arguments": _texts}))
                )
            finish = draw(st.sampled_from([None, "stop", "tool_calls"]))
            choices.append({"index": i, "delta": delta, "finish_reason": finish})
    payload: dict[str, Any] = {"id": "c", "object": "chunk", "choices": choices}
    usage = draw(st.sampled_from(["absent", "null", "object"]))
    if usage == "null":
        payload["usage"] = None
    elif usage == "object":
        payload["usage"] = {"prompt_tokens": 3, "completion_tokens": 2}
        if draw(st.booleans()):
            payload["usage"]["metrics"] = {"queue_time_ms": 5}
    if draw(st.integers(0, 7)) == 0:
        payload["metrics"] = {"queue_time_ms": 7}
    error = draw(st.sampled_from(["absent", "absent", "null", "object", "string", "empty"]))
    if error != "absent":
        payload["error"] = {"null": None, "object": {"message": "x", "code": 500},
                            "string": "failed", "empty": {}}[error]  # fmt: skip
    if choices and draw(st.integers(0, 5)) == 0:
        del payload["choices"][0]["index"]  # servers that omit it
    event = draw(st.sampled_from([b"", b"", b"", b"message", b"error"]))
    return dialect, event, _encode(draw, _ordered(draw, payload))


@settings(max_examples=700, deadline=None)
@given(choice_chunks())
def test_chat_byte_scan_agrees_with_full_decode(case: tuple[Dialect, bytes, bytes]) -> None:
    dialect, event, data = case
    got = dialect.classify(event, data)
    assert got == dialect.classify_payload(event, json.loads(data))
    hypothesis_event(f"{dialect.name}: outputs={got.outputs} answer={got.answer} err={got.error}")


_RESPONSES_NAMES = [kind for kind, _ in RESPONSES_OUTPUT_TYPES] + [
    "response.created", "response.output_text.done", "response.output_item.added",
    "response.completed", "response.incomplete", "response.failed", "error",
    "response.shell_call_output_content.delta",
]  # fmt: skip


@st.composite
def responses_events(draw: st.DrawFn) -> tuple[bytes, bytes]:
    name = draw(st.sampled_from(_RESPONSES_NAMES))
    fields: dict[str, Any] = {"type": name, "sequence_number": draw(st.integers(0, 10**6))}
    if draw(st.integers(0, 9)):
        fields["delta"] = draw(st.one_of(_texts, st.none(), st.just({"stdout": "x"})))
    for key, value in (("item_id", "msg_1"), ("output_index", 0), ("content_index", 0),
                       ("logprobs", []), ("obfuscation", draw(_texts))):  # fmt: skip
        if draw(st.booleans()):
            fields[key] = value
    if name in ("response.completed", "response.incomplete", "response.failed", "response.created"):
        usage = draw(st.sampled_from([None, RESPONSE_USAGE, {"input_tokens": 1}]))
        fields["response"] = response_object("x", usage)
    if draw(st.integers(0, 9)) == 0:
        fields["error"] = {"message": "m"}
    where = draw(st.sampled_from(["both", "both", "type", "event", "other-event"]))
    event = name.encode()
    if where == "type":
        event = b""
    elif where == "event":
        del fields["type"]
    elif where == "other-event":
        event = draw(st.sampled_from(_RESPONSES_NAMES)).encode()
    first_key = "type" if draw(st.integers(0, 3)) else None
    return event, _encode(draw, _ordered(draw, fields, first_key))


@settings(max_examples=700, deadline=None)
@given(responses_events())
def test_responses_byte_check_agrees_with_full_decode(case: tuple[bytes, bytes]) -> None:
    event, data = case
    got = RESPONSES.classify(event, data)
    assert got == RESPONSES.classify_payload(event, json.loads(data))
    hypothesis_event(f"outputs={got.outputs} answer={got.answer} error={got.error}")


_MESSAGES_KINDS = {
    "text_delta": "text",
    "thinking_delta": "thinking",
    "input_json_delta": "partial_json",
    "signature_delta": "signature",
    "citations_delta": "citation",
}


@st.composite
def messages_events(draw: st.DrawFn) -> tuple[bytes, bytes]:
    name = draw(st.sampled_from(
        ["content_block_delta"] * 4
        + ["message_start", "message_delta", "content_block_start", "ping", "error", "x"]))  # fmt: skip
    fields: dict[str, Any] = {"type": name}
    if name == "content_block_delta":
        fields["index"] = draw(st.integers(0, 3))
        kind = draw(st.sampled_from(sorted(_MESSAGES_KINDS)))
        key = draw(st.sampled_from([_MESSAGES_KINDS[kind], "text", "thinking"]))
        delta: dict[str, Any] = {"type": kind, key: draw(st.one_of(_texts, st.none()))}
        if draw(st.integers(0, 4)) == 0:
            delta["extra"] = draw(_texts)
        fields["delta"] = _ordered(draw, delta, "type" if draw(st.integers(0, 3)) else None)
    elif name == "message_start":
        fields["message"] = {"id": "m", "usage": draw(st.sampled_from([START_USAGE, None]))}
    elif name == "message_delta":
        fields["delta"] = {"stop_reason": "end_turn"}
        fields["usage"] = draw(st.sampled_from([{"output_tokens": 3}, None]))
    elif name == "content_block_start":
        fields["content_block"] = {"type": "text", "text": ""}
    elif name == "error":
        fields["error"] = {"type": "overloaded_error", "message": "Overloaded"}
    where = draw(st.sampled_from(["both", "both", "type", "event"]))
    event = b"" if where == "type" else name.encode()
    if where == "event":
        del fields["type"]
    first_key = "type" if draw(st.integers(0, 3)) else None
    return event, _encode(draw, _ordered(draw, fields, first_key))


@settings(max_examples=700, deadline=None)
@given(messages_events())
def test_messages_byte_check_agrees_with_full_decode(case: tuple[bytes, bytes]) -> None:
    event, data = case
    got = MESSAGES.classify(event, data)
    assert got == MESSAGES.classify_payload(event, json.loads(data))
    hypothesis_event(f"outputs={got.outputs} answer={got.answer} error={got.error}")


@pytest.mark.parametrize(
    ("dialect", "event", "data", "expected"),
    [
        # duplicate or nested keys the byte checks must not trust
        (RESPONSES, b"", b'{"type":"response.output_text.delta","delta":"a","delta":""}', NOT_COUNTED),
        (RESPONSES, b"", b'{"type":"response.output_text.delta","delta":"a","type":"error"}', ERROR),
        (RESPONSES, b"", b'{"type":"response.output_text.delt\\u0061","delta":"a"}', ANSWER),
        (MESSAGES, b"", b'{"type":"content_block_delta","delta":{"type":"text_delta","text":"a",'
                        b'"type":"signature_delta"}}', NOT_COUNTED),
        (MESSAGES, b"", b'{"type":"content_block_delta","delta":{"type":"text_delta","text":"a",'
                        b'"text":""}}', NOT_COUNTED),
        (MESSAGES, b"", b'{"type":"content_block_delta","delta":{"type":"text_delta","text":"text"}}',
         ANSWER),
        (CHAT, b"", b'{"choices":[{"delta":{"content":"a"}},{"delta":{"content":"b"}}]}',
         EventInfo(2, True)),
        (COMPLETIONS, b"", b'{"choices":[{"text":"a"},{"text":"b"}]}', EventInfo(2, True)),
        # an escaped quote before the delta's "}" is not the end of the reasoning text
        (CHAT, b"", b'{"choices":[{"delta":{"reasoning":"\\"}","refusal":"no"}}]}', ANSWER),
        (CHAT, b"", b'{"choices":[{"delta":{"reasoning_content":"a\\\\"}}]}', REASONING),
    ],
)  # fmt: skip
def test_byte_checks_decline_what_they_cannot_be_sure_of(
    dialect: Dialect, event: bytes, data: bytes, expected: EventInfo
) -> None:
    assert dialect.classify(event, data) == expected
    assert dialect.classify_payload(event, json.loads(data)) == expected


# ---------------------------------------------------------------------------
# TokenTemplate


def sse(event: str | None, payload: Any) -> bytes:
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + dumps(payload) + b"\n\n"


def test_template_learns_a_named_event_and_returns_its_reading() -> None:
    template = TokenTemplate(MESSAGES.token_keys)
    assert template.match(b"anything") is None
    thinking = sse(*block_delta(0, type="thinking_delta", thinking="Let"))
    template.learn(thinking, REASONING)
    assert template.match(sse(*block_delta(0, type="thinking_delta", thinking=" me"))) is REASONING
    assert template.match(sse(*block_delta(0, type="thinking_delta", thinking=""))) is None
    assert template.match(sse(*block_delta(0, type="thinking_delta", thinking='"'))) is None
    assert template.match(sse(*block_delta(0, type="thinking_delta", thinking="a\\"))) is None
    assert template.match(sse(*block_delta(0, type="text_delta", text="x"))) is None
    for _ in range(8):  # eight misses in a row: learned again from the next token
        template.match(b"data: {}\n\n")
    answer = sse(*block_delta(1, type="text_delta", text="Hi"))
    template.learn(answer, ANSWER)
    assert template.match(sse(*block_delta(1, type="text_delta", text="there"))) is ANSWER


@pytest.mark.parametrize(
    ("chunk", "info"),
    [
        (sse(*block_delta(0, type="text_delta", text="x")), EventInfo(1, True, {"a": 1})),
        (sse(*block_delta(0, type="text_delta", text="x")), EventInfo(1, True, error=True)),
        (sse(*block_delta(0, type="text_delta", text="x")), EventInfo(2, True)),
        (sse(*block_delta(0, type="text_delta", text="x")), NOT_COUNTED),
        (sse(*block_delta(0, type="text_delta", text="x"))[:-1], ANSWER),  # not a whole event
        (sse(*block_delta(0, type="text_delta", text='a"b')), ANSWER),  # escaped quote
        (sse(*block_delta(0, type="text_delta", text="x")).replace(b"data: ", b"id: 1\ndata: "),
         ANSWER),
        (sse(*block_delta(0, type="text_delta", text="x"))
         .replace(b'{"type"', b'{"text":"y","type"'), ANSWER),  # the key twice
    ],
)  # fmt: skip
def test_template_learns_only_from_a_plain_single_output(chunk: bytes, info: EventInfo) -> None:
    template = TokenTemplate(MESSAGES.token_keys)
    template.learn(chunk, info)
    assert template.match(chunk) is None


def test_template_skips_an_empty_key_for_the_next() -> None:
    template = TokenTemplate(CHAT.token_keys)

    def chunk(reasoning: str) -> tuple[str | None, dict[str, Any]]:
        delta = {"content": "", "reasoning_content": reasoning}
        return None, {"id": "c", "choices": [{"index": 0, "delta": delta}]}

    first_one = chunk("r")
    template.learn(sse(*first_one), CHAT.classify(b"", dumps(first_one[1])))
    assert template.match(sse(*chunk("s t"))) is REASONING


_token_texts = st.one_of(
    st.text(min_size=0, max_size=6),
    st.sampled_from(['"', "\\", "\\\\", '\\"', "\n", "é", "}", '"},{', "data: x", " "]),
)


def _chat_stream(draw: st.DrawFn, dialect: Dialect) -> list[bytes]:
    varying = draw(st.booleans())
    events: list[bytes] = []

    def event(choice: dict[str, Any], n: int) -> bytes:
        payload: dict[str, Any] = {"id": "chatcmpl-1", "object": "chunk", "created": 7,
                                   "model": "m", "choices": [choice]}  # fmt: skip
        if varying:
            payload["obfuscation"] = "x" * (n % 3)
        return sse(None, payload)

    if dialect is CHAT:
        events.append(event({"index": 0, "delta": {"role": "assistant", "content": ""}}, 0))
    keys = ["reasoning_content", "content"] if draw(st.booleans()) else ["content"]
    n = 0
    for key in keys:
        for token in draw(st.lists(_token_texts, max_size=12)):
            n += 1
            choice: dict[str, Any] = (
                {"index": 0, "text": token} if dialect is COMPLETIONS
                else {"index": 0, "delta": {key: token}}
            )  # fmt: skip
            events.append(event({**choice, "finish_reason": None}, n))
    events.append(event({"index": 0, "delta": {}, "finish_reason": "stop"}, n + 1))
    if draw(st.booleans()):
        events.append(sse(None, {"id": "chatcmpl-1", "choices": [],
                                 "usage": {"prompt_tokens": 3, "completion_tokens": n}}))  # fmt: skip
    if draw(st.booleans()):
        events.append(sse(None, {"error": {"message": "stopped"}}))
    events.append(b"data: [DONE]\n\n")
    return events


def _responses_stream(draw: st.DrawFn) -> list[bytes]:
    sequenced = draw(st.booleans())  # OpenAI numbers every event; a template never matches
    named = draw(st.booleans())
    events = []
    seq = 0
    for kind in draw(st.sampled_from([["response.reasoning_summary_text.delta",
                                       "response.output_text.delta"],
                                      ["response.output_text.delta"],
                                      ["response.function_call_arguments.delta"]])):  # fmt: skip
        for token in draw(st.lists(_token_texts, max_size=10)):
            seq += 1
            payload: dict[str, Any] = {"type": kind, "item_id": "it_1", "output_index": 0,
                                       "delta": token}  # fmt: skip
            if sequenced:
                payload["sequence_number"] = seq
            events.append(sse(kind if named else None, payload))
    done = {"type": "response.completed",
            "response": response_object("completed", RESPONSE_USAGE)}  # fmt: skip
    events.append(sse("response.completed" if named else None, done))
    return events


def _messages_stream(draw: st.DrawFn) -> list[bytes]:
    events = [sse(*message_start(START_USAGE))]
    for index, (kind, key) in enumerate(draw(st.sampled_from([[("thinking_delta", "thinking"), ("text_delta", "text")],
                                           [("text_delta", "text")],
                                           [("input_json_delta", "partial_json")]]))):  # fmt: skip
        events.append(sse(*msg("content_block_start", index=index, content_block={"type": "x"})))
        if draw(st.booleans()):
            events.append(sse("ping", {"type": "ping"}))
        for token in draw(st.lists(_token_texts, max_size=10)):
            events.append(sse(*block_delta(index, type=kind, **{key: token})))
        if kind == "thinking_delta":
            events.append(sse(*block_delta(index, type="signature_delta", signature="sig")))
        events.append(sse(*msg("content_block_stop", index=index)))
    events.append(sse(*msg("message_delta", delta={}, usage={"output_tokens": 9})))
    events.append(sse(*msg("message_stop")))
    return events


@st.composite
def token_streams(draw: st.DrawFn) -> tuple[Dialect, list[bytes]]:
    """A stream as servers write it, mostly one event per read, sometimes two."""
    dialect = draw(st.sampled_from([CHAT, COMPLETIONS, RESPONSES, MESSAGES]))
    if dialect is RESPONSES:
        events = _responses_stream(draw)
    elif dialect is MESSAGES:
        events = _messages_stream(draw)
    else:
        events = _chat_stream(draw, dialect)
    chunks: list[bytes] = []
    i = 0
    while i < len(events):
        step = 2 if draw(st.integers(0, 4)) == 0 else 1
        chunks.append(b"".join(events[i : i + step]))
        i += step
    return dialect, chunks


def template_path(dialect: Dialect, chunks: list[bytes]) -> tuple[list[EventInfo], int]:
    """What the relay does per read: the template, else ``single``, else ``feed``."""
    template = TokenTemplate(dialect.token_keys)
    parser = SSEParser()
    infos: list[EventInfo] = []
    matched = 0
    for chunk in chunks:
        info = template.match(chunk)
        if info is not None and parser.skip(len(chunk)):
            infos.append(info)
            matched += 1
            continue
        one = parser.single(chunk)
        if one is not None:
            info = dialect.classify(*one)
            template.learn(chunk, info)
            infos.append(info)
            continue
        infos.extend(dialect.classify(e.event, e.data) for e in parser.feed(chunk))
    return infos, matched


def full_path(dialect: Dialect, chunks: list[bytes]) -> list[EventInfo]:
    parser = SSEParser()
    infos = []
    for chunk in chunks:
        for e in parser.feed(chunk):
            try:
                payload = json.loads(e.data)
            except ValueError:  # not JSON ([DONE], keep-alive text): the bytes say it all
                infos.append(dialect.classify(e.event, e.data))
                continue
            infos.append(dialect.classify_payload(e.event, payload))
    return infos


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_streams())
def test_token_template_path_reads_exactly_what_the_full_path_does(
    case: tuple[Dialect, list[bytes]],
) -> None:
    dialect, chunks = case
    infos, matched = template_path(dialect, chunks)
    assert infos == full_path(dialect, chunks)
    hypothesis_event(f"{dialect.name}: template matched {'some' if matched else 'none'}")


def test_token_template_matches_a_steady_stream() -> None:
    """The template path is taken at all (the property above would pass without it)."""
    for dialect, make in [
        (CHAT, lambda t: sse(None, {"id": "c", "choices": [{"index": 0, "delta": {"content": t}}]})),
        (COMPLETIONS, lambda t: sse(None, {"id": "c", "choices": [{"index": 0, "text": t}]})),
        (RESPONSES, lambda t: sse("response.output_text.delta",
                                  {"type": "response.output_text.delta", "delta": t})),
        (MESSAGES, lambda t: sse(*block_delta(0, type="text_delta", text=t))),
    ]:  # fmt: skip
        chunks = [make(t) for t in ["a", "bc", "d e", "f"]]
        infos, matched = template_path(dialect, chunks)
        assert (infos, matched) == ([ANSWER] * 4, 3), dialect.name


def test_without_a_reader_the_finish_chunk_is_not_decoded() -> None:
    """A proxy with no trace, OTLP metrics or request log does not pay the finish chunk's
    decode: the plain variants settle it by the byte checks, and the rest is the same."""
    from proxy.dialects import DIALECTS_WITHOUT_RESPONSE_INFO

    finish = b'{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'
    plain = DIALECTS_WITHOUT_RESPONSE_INFO[CHAT.route]
    assert plain.classify(b"", finish) is NOT_COUNTED
    assert CHAT.classify(b"", finish).response == ResponseInfo("c", "m", ((0, "stop"),))
    token = b'{"id":"c","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}'
    for data in (token, b"[DONE]", b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}'):
        assert plain.classify(b"", data) == CHAT.classify(b"", data)
    assert DIALECTS_WITHOUT_RESPONSE_INFO[RESPONSES.route] is RESPONSES
