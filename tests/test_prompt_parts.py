"""Prompt parts: each API's request body as the ordered pieces its provider renders, the
bytes the prompt-cache doctor hashes (``Dialect.prompt_parts``, ``cache_scope``).

Every expectation is an exact value; the bodies follow the official SDKs' request types
(``openai.types.chat``, ``openai.types.responses``, ``anthropic.types``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy.dialects import (
    CHAT,
    COMPLETIONS,
    DIALECTS,
    MESSAGES,
    PART_KINDS,
    RESPONSES,
    PromptPart,
    cache_scope,
)

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
OTHER_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,R0lGODlh"}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def compact(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def opaque(kind: str, value: Any) -> bytes:
    return b"\x00" + kind.encode() + b":" + hashlib.blake2b(
        compact(value), digest_size=16).hexdigest().encode() + b"\x00"


def shape(parts: tuple[PromptPart, ...]) -> list[tuple[str, int, str]]:
    return [(p.kind, p.index, p.role) for p in parts]


# ---------------------------------------------------------------------------
# chat completions


def test_chat_renders_tools_then_messages_in_order() -> None:
    body = {
        "model": "gpt-4o",
        "tools": [TOOL, {"type": "function", "function": {"name": "f"}}],
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": "Plain text."},
            {"role": "user", "content": "héllo"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "7 degrees"},
        ],
    }
    parts = CHAT.prompt_parts(body)
    assert shape(parts) == [
        ("tools", 0, ""), ("tools", 1, ""), ("system", 0, "developer"), ("system", 1, "system"),
        ("message", 2, "user"), ("message", 3, "assistant"), ("message", 4, "tool")]
    assert parts[0].data == compact(TOOL)
    assert parts[4].data == "héllo".encode()  # UTF-8: an offset is an offset into the text
    assert len(parts[4].data) == 6
    assert parts[5].data == b"\x00" + compact({"tool_calls": body["messages"][3]["tool_calls"]})
    assert parts[6].data == b"7 degrees\x00" + compact({"tool_call_id": "call_1"})


def test_chat_content_parts_concatenate_and_an_image_enters_as_a_hash_of_its_json() -> None:
    def user(*content: Any) -> PromptPart:
        body = {"messages": [{"role": "user", "content": list(content)}]}
        return CHAT.prompt_parts(body)[0]

    part = user({"type": "text", "text": "Look: "}, IMAGE, {"type": "text", "text": "what?"})
    assert part.data == b"Look: " + opaque("image_url", IMAGE) + b"what?"
    assert len(part.data) < 80  # the image's bytes are not in it, only a digest
    again = user({"type": "text", "text": "Look: "}, IMAGE, {"type": "text", "text": "what?"})
    assert again == part
    changed = user({"type": "text", "text": "Look: "}, OTHER_IMAGE, {"type": "text", "text": "what?"})
    assert changed.data != part.data
    assert changed.data[:6] == part.data[:6] and changed.data.endswith(b"what?")
    # Audio and files cannot be read either; a refusal part is structured JSON.
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    assert user(audio).data == opaque("input_audio", audio)
    assert user({"type": "refusal", "refusal": "no"}).data == compact(
        {"type": "refusal", "refusal": "no"})


def test_chat_ignores_cache_control_and_reads_legacy_functions() -> None:
    plain = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    marked = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}
    assert CHAT.prompt_parts(plain) == CHAT.prompt_parts(marked)
    functions = CHAT.prompt_parts({"functions": [{"name": "f"}], "messages": []})
    assert functions == (PromptPart("tools", 0, "", b'{"name":"f"}'),)


def test_chat_tool_key_order_is_part_of_the_prompt() -> None:
    # A provider renders a schema's keys in the order given: a reordering is a change.
    a = CHAT.prompt_parts({"tools": [{"name": "f", "description": "d"}]})
    b = CHAT.prompt_parts({"tools": [{"description": "d", "name": "f"}]})
    assert a[0].data != b[0].data


# ---------------------------------------------------------------------------
# Responses


def test_responses_renders_instructions_tools_context_then_input() -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    image = {"type": "input_image", "image_url": "https://example.com/cat.png"}
    body = {
        "model": "gpt-4.1",
        "instructions": "You are terse.",
        "tools": [tool],
        "previous_response_id": "resp_123",
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is this? "}, image]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "7"},
        ],
    }
    parts = RESPONSES.prompt_parts(body)
    assert shape(parts) == [
        ("instructions", 0, ""), ("tools", 0, ""), ("context", 0, "previous_response"),
        ("system", 0, "developer"), ("input", 1, "user"), ("input", 2, "function_call"),
        ("input", 3, "function_call_output")]
    assert parts[0].data == b"You are terse."
    assert parts[1].data == compact(tool)
    assert parts[2].data == b"resp_123"
    assert parts[4].data == b"What is this? " + opaque("input_image", image)
    assert parts[5].data == compact(body["input"][2])


def test_responses_string_input_and_conversation() -> None:
    parts = RESPONSES.prompt_parts({"input": "hi", "conversation": {"id": "conv_9"}})
    assert parts == (PromptPart("context", 0, "conversation", b"conv_9"),
                     PromptPart("input", 0, "user", b"hi"))


# ---------------------------------------------------------------------------
# Messages


def test_messages_renders_tools_system_then_messages() -> None:
    tool = {"name": "get_weather", "input_schema": {"type": "object"},
            "cache_control": {"type": "ephemeral"}}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "tools": [tool],
        "system": [{"type": "text", "text": "You are terse. "},
                   {"type": "text", "text": "Use metric.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [image, {"type": "text", "text": "Weather here?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "tu_1", "name": "get_weather", "input": {"c": "x"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "tu_1", "content": "7 degrees",
                 "cache_control": {"type": "ephemeral"}}]},
        ],
    }
    parts = MESSAGES.prompt_parts(body)
    assert shape(parts) == [("tools", 0, ""), ("system", 0, "system"), ("message", 0, "user"),
                            ("message", 1, "assistant"), ("message", 2, "user")]
    assert parts[0].data == compact({"name": "get_weather", "input_schema": {"type": "object"}})
    assert parts[1].data == b"You are terse. Use metric."
    assert parts[2].data == opaque("image", image) + b"Weather here?"
    assert parts[3].data == b"Checking." + compact(body["messages"][1]["content"][1])
    assert parts[4].data == compact({"type": "tool_result", "tool_use_id": "tu_1"}) + b"7 degrees"
    # A string system prompt and the same text as one block are the same prompt.
    assert MESSAGES.prompt_parts({"system": "You are terse. Use metric."})[0] == parts[1]


def test_messages_tool_result_content_blocks_are_read_like_content() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "found:"}, image]}]}]}
    assert MESSAGES.prompt_parts(body)[0].data == (
        compact({"type": "tool_result", "tool_use_id": "t"}) + b"found:" + opaque("image", image))


# ---------------------------------------------------------------------------
# completions


@pytest.mark.parametrize(("prompt", "expected"), [
    ("Once upon", [b"Once upon"]),
    (["Once upon"], [b"Once upon"]),
    ([1, 2, 30], [b"1 2 30"]),
    ([[1, 2], [3]], [b"1 2", b"3"]),
    (["a", "b"], [b"a", b"b"]),
    (None, []),
])
def test_completions_prompt(prompt: Any, expected: list[bytes]) -> None:
    parts = COMPLETIONS.prompt_parts({"prompt": prompt})
    assert [p.data for p in parts] == expected
    assert [(p.kind, p.index) for p in parts] == [("prompt", i) for i in range(len(expected))]


# ---------------------------------------------------------------------------
# scope, and nothing raises


def test_cache_scope_reads_model_and_cache_keys() -> None:
    assert cache_scope({"model": "m"}) == ("m", "")
    assert cache_scope({"model": "m", "prompt_cache_key": "user-1"}) == ("m", "user-1")
    assert cache_scope({"model": "m", "cache_salt": "s"}) == ("m", "s")
    assert cache_scope({"model": 3, "prompt_cache_key": "k", "cache_salt": "s"}) == ("", "k\x00s")


def test_lone_surrogates_and_roles_are_bounded_not_raised() -> None:
    body = json.loads('{"messages":[{"role":"' + "r" * 100 + '","content":"\\ud800x"}]}')
    (part,) = CHAT.prompt_parts(body)
    assert part.role == "r" * 32
    assert part.data == "\ud800x".encode("utf-8", "surrogatepass")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["tools", "functions", "messages", "role", "content", "type", "text",
                         "system", "instructions", "input", "prompt", "tool_calls", "image_url",
                         "tool_result", "conversation", "id", "previous_response_id",
                         "cache_control", "model"]) | st.text(max_size=3),
        inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(
    st.sampled_from(["tools", "functions", "messages", "system", "instructions", "input",
                     "prompt", "conversation", "previous_response_id", "model",
                     "prompt_cache_key", "cache_salt"]), JSON, max_size=6))
@example({"system": {"type": [], "text": ""}})  # a content part whose type is a list
def test_prompt_parts_never_raise(body: dict[str, Any]) -> None:
    for dialect in DIALECTS.values():
        for part in dialect.prompt_parts(body):
            assert part.kind in PART_KINDS
            assert isinstance(part.data, bytes) and isinstance(part.index, int)
            assert isinstance(part.role, str) and len(part.role) <= 32
    model, key = cache_scope(body)
    assert isinstance(model, str) and isinstance(key, str)


def test_deep_nesting_does_not_raise() -> None:
    deep: Any = "x"
    for _ in range(500):
        deep = [deep]
    for dialect in DIALECTS.values():
        dialect.prompt_parts({"messages": [{"role": "user", "content": deep}], "input": deep,
                              "system": deep, "prompt": deep})


# ---------------------------------------------------------------------------
# settings: ahead of every part, one per setting given, named, absent ones add nothing


def test_settings_parts_come_first_named_and_only_when_given() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "service_tier": "flex", "response_format": {"type": "json_object"}}
    parts = CHAT.prompt_parts(body)
    assert [(p.kind, p.index, p.role) for p in parts] == [
        ("settings", 0, "response_format"), ("settings", 1, "service_tier"),
        ("message", 0, "user")]
    assert parts[0].data == b'{"type":"json_object"}'
    assert [p.kind for p in CHAT.prompt_parts({"messages": body["messages"]})] == ["message"]
    responses = RESPONSES.prompt_parts({"input": "hi", "text": {"verbosity": "low"},
                                        "reasoning": {"summary": "auto"}})
    assert [(p.kind, p.role) for p in responses] == [("settings", "text.verbosity"),
                                                     ("input", "user")]
    messages = MESSAGES.prompt_parts({"tool_choice": {"type": "any"}, "system": "s",
                                      "thinking": {"type": "adaptive"}, "messages": []})
    assert [(p.kind, p.role) for p in messages] == [
        ("settings", "tool_choice"), ("settings", "thinking"), ("system", "system")]
