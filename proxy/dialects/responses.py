"""``/v1/responses``: what an OpenAI Responses API event, and a response, mean.

Design: ``docs/design/dialects.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.dialects.base import (
    _TYPE_PREFIX,
    ANSWER,
    END,
    ERROR,
    NO_RESPONSE,
    NOT_COUNTED,
    REASONING,
    EventInfo,
    ResponseInfo,
    Usage,
    _event_name,
    _loads,
    _openai_usage,
    _single_response,
    _usage_of,
    report_of,
)
from proxy.dialects.prompt import (
    _ITEM_SKIP,
    RESPONSES_SETTINGS,
    Caching,
    Prompt,
    PromptPart,
    _message,
    _settings_parts,
    _tool_parts,
    _utf8,
    explicit_marks,
)

RESPONSES_OUTPUT: dict[str, EventInfo] = {
    "response.output_text.delta": ANSWER,
    "response.refusal.delta": ANSWER,
    "response.function_call_arguments.delta": ANSWER,
    "response.custom_tool_call_input.delta": ANSWER,
    "response.mcp_call_arguments.delta": ANSWER,
    "response.code_interpreter_call_code.delta": ANSWER,
    "response.shell_call_command.delta": ANSWER,
    "response.audio.delta": ANSWER,
    "response.audio.transcript.delta": ANSWER,
    "response.reasoning_text.delta": REASONING,
    "response.reasoning_summary_text.delta": REASONING,
}
_RESPONSES_OUTPUT_B = {name.encode(): info for name, info in RESPONSES_OUTPUT.items()}
_RESPONSES_USAGE = frozenset(("response.completed", "response.incomplete", "response.failed"))
_RESPONSES_USAGE_B = frozenset(name.encode() for name in _RESPONSES_USAGE)


def _data_type(data: bytes) -> bytes:
    """The event name written first in compact data (``{"type":"NAME",...``), when it is
    the data's only ``"type"`` key and needs no unescaping; else ``b""``."""
    if data[:9] != _TYPE_PREFIX:
        return b""
    end = data.find(b'"', 9)
    name = data[9:end]
    if end < 0 or b"\\" in name or data.count(b'"type"') != 1:
        return b""
    return name


@dataclass(frozen=True, slots=True)
class ResponsesDialect:
    """``/v1/responses``.

    Design: ``docs/design/dialects.md``, "The Responses byte check".
    """

    name: str = "responses"
    route: str = "/v1/responses"
    injects_usage: bool = False
    token_keys: tuple[bytes, ...] = (b'"delta":"',)

    def classify(self, event: bytes, data: bytes) -> EventInfo:
        name = event or _data_type(data)
        if not name:
            return self.classify_payload(event, _loads(data))
        info = _RESPONSES_OUTPUT_B.get(name)
        if info is not None:
            if data[:1] == b"{" and data[-1:] == b"}" and data.count(b'"delta"') == 1:
                at = data.find(b'"delta":"') + 9
                if at >= 9 and data[at : at + 1] != b'"':
                    return info
            return self.classify_payload(event, _loads(data))
        if name == b"error":
            return ERROR
        if name in _RESPONSES_USAGE_B:
            return self.classify_payload(event, _loads(data))
        return NOT_COUNTED

    def classify_payload(self, event: bytes, payload: Any) -> EventInfo:
        name = _event_name(event, payload)
        info = RESPONSES_OUTPUT.get(name)
        if info is not None:
            if isinstance(payload, dict):
                delta = payload.get("delta")
                if isinstance(delta, str) and delta:
                    return info
            return NOT_COUNTED
        if name == "error":
            return ERROR
        if name in _RESPONSES_USAGE:
            final = payload.get("response") if isinstance(payload, dict) else None
            usage = _usage_of(final)
            response = _responses_response(final)
            report = report_of(final)  # prompt_cache_diagnostics, when the app asked
            if name == "response.failed":
                return EventInfo(usage=usage, error=True, response=response, end=True,
                                 report=report)
            if usage is None and response is None and report is None:
                return END
            return EventInfo(usage=usage, response=response, end=True, report=report)
        if not name and isinstance(payload, dict) and payload.get("error"):
            return ERROR
        return NOT_COUNTED

    def body_usage(self, payload: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return _usage_of(payload)

    def body_response(self, payload: Mapping[str, Any]) -> ResponseInfo:
        return _responses_response(payload) or NO_RESPONSE

    def output_response(self, data: bytes) -> ResponseInfo | None:
        return None  # the final event (always decoded) says it all

    def usage(self, raw: Mapping[str, Any] | None) -> Usage:
        return _openai_usage(raw, "input", "output")

    def prompt_parts(self, payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
        return _responses_prompt(payload).parts

    def prompt(self, payload: Mapping[str, Any]) -> Prompt:
        return _responses_prompt(payload)


def _responses_response(response: Any) -> ResponseInfo | None:
    """A Responses API ``Response``: the API has no per-output finish reason, so the
    reason is ``incomplete_details.reason`` when the response is incomplete
    (``max_output_tokens``, ``content_filter``), else its ``status``
    (``completed``, ``failed``, ``cancelled``), as the API words them."""
    if not isinstance(response, Mapping):
        return None
    status = response.get("status")
    details = response.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, Mapping) else None
    return _single_response(response, reason if isinstance(reason, str) and reason else status)


def _responses_prompt(payload: Mapping[str, Any]) -> Prompt:
    parts = _settings_parts(payload, RESPONSES_SETTINGS)
    marks = explicit_marks(payload)
    instructions = payload.get("instructions")
    if isinstance(instructions, str):
        parts.append(PromptPart("instructions", 0, "", _utf8(instructions)))
    elif isinstance(instructions, list):
        parts.extend(_message(m, i, "instructions", _ITEM_SKIP, marks)
                     for i, m in enumerate(instructions))
    parts.extend(_tool_parts(payload, "tools"))
    previous = payload.get("previous_response_id")
    if isinstance(previous, str) and previous:
        parts.append(PromptPart("context", 0, "previous_response", _utf8(previous)))
    conversation = payload.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    if isinstance(conversation, str) and conversation:
        parts.append(PromptPart("context", 0, "conversation", _utf8(conversation)))
    items = payload.get("input")
    if isinstance(items, str):
        parts.append(PromptPart("input", 0, "user", _utf8(items)))
    elif isinstance(items, list):
        parts.extend(_message(m, i, "input", _ITEM_SKIP, marks) for i, m in enumerate(items))
    return Prompt(tuple(parts)) if marks is None else marks.prompt(parts, Caching.MARKED)


RESPONSES = ResponsesDialect()
