"""``/v1/chat/completions``: what a chat completion chunk, and a chat completion, mean.

Design: ``docs/design/dialects.md``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from proxy.dialects.base import (
    _CHOICES_MAX,
    _REASON_MAX,
    ANSWER,
    END,
    ERROR,
    NO_RESPONSE,
    NOT_COUNTED,
    REASONING,
    EventInfo,
    ResponseInfo,
    Usage,
    _count,
    _loads,
    _openai_usage,
    _text,
    _usage_of,
    report_of,
    upstream_queue_seconds,
)
from proxy.dialects.prompt import (
    _CHAT_SKIP,
    CHAT_SETTINGS,
    Caching,
    Prompt,
    PromptPart,
    _message,
    _settings_parts,
    _tool_parts,
    explicit_marks,
)


def _usage_is_null(data: bytes) -> bool:
    """No ``"usage"`` key, or only ``"usage": null`` (OpenAI sends that on every chunk of
    a stream that asked for usage)."""
    at = data.find(b'"usage"')
    if at < 0:
        return True
    rest = data[at + 7 : at + 16].lstrip(b" \t\r\n:")
    return rest.startswith(b"null") and data.find(b'"usage"', at + 7) < 0


_NONE = 0  # what one choice carries
_REASONING = 1
_ANSWER = 2


@dataclass(frozen=True, slots=True)
class ChatDialect:
    """``/v1/chat/completions``.

    Design: ``docs/design/dialects.md``, "The chat byte scan".
    """

    name: str = "chat"
    route: str = "/v1/chat/completions"
    injects_usage: bool = True
    token_keys: tuple[bytes, ...] = (
        b'"content":"',
        b'"reasoning_content":"',
        b'"reasoning":"',
        b'"refusal":"',
    )

    _marker: ClassVar[bytes] = b'"delta"'  # one per choice
    _answer_key: ClassVar[bytes] = b'"content"'
    _reasoning_delta: ClassVar[bytes] = b'"delta":{"reasoning'
    _scan: ClassVar[re.Pattern[bytes]] = re.compile(
        rb'"(content|refusal|reasoning_content|reasoning)"\s*:\s*"[^"]'
    )
    _answer_names: ClassVar[frozenset[bytes]] = frozenset((b"content", b"refusal"))
    _containers: ClassVar[tuple[bytes, ...]] = (b'"tool_calls"', b'"function_call"')
    # Decode the chunks that carry a finish reason (and no output) for the response
    # info: only when something reads it (a trace, OTLP metrics, the per-request log);
    # else such a chunk is settled by the byte checks like any chunk without output.
    response_info: bool = True

    def classify(self, event: bytes, data: bytes) -> EventInfo:
        if event == b"error":
            return ERROR
        if data[:1] != b"{" or data[-1:] != b"}":
            data = data.strip()
            if data[:1] != b"{":
                return END if data == b"[DONE]" else NOT_COUNTED  # keep-alive text, garbage
            if data[-1:] != b"}":
                return self.classify_payload(event, _loads(data))
        if data.count(self._marker) == 1 and b'"metrics"' not in data and _usage_is_null(data):
            key = self._answer_key
            at = data.find(key) + len(key)
            if at >= len(key):
                value = data[at : at + 3]  # ':"x' or ': "x'
                if value[:2] == b':"' and value[2:] != b'"':
                    return ANSWER
                if value == b': "' and data[at + 3 : at + 4] != b'"':
                    return ANSWER
            info = self._one_choice(data)
            # a chunk without output may carry llama.cpp's timings (its last one does):
            # decoded then, never on a token's event
            if info is not None and (info is not NOT_COUNTED or b'"timings"' not in data):
                return info
        return self.classify_payload(event, _loads(data))

    def _one_choice(self, data: bytes) -> EventInfo | None:
        """The reading of a payload with one choice, no usage, no metrics, and no
        compact answer in its first ``"content"`` (or ``"text"``); None if unsure."""
        if self._reasoning_delta:
            size = len(self._reasoning_delta)
            at = data.find(self._reasoning_delta) + size
            if at >= size:
                if data.startswith(b'_content":"', at):
                    at += 11
                elif data.startswith(b'":"', at):
                    at += 3
                else:
                    at = 0
                if at and data[at : at + 1] != b'"':
                    end = data.find(b'"', at)
                    if end > at and data[end - 1] != 0x5C and data[end + 1 : end + 2] == b"}":
                        return REASONING  # 0x5C: a backslash, the quote might be escaped
        names: list[bytes] = self._scan.findall(data)
        if names:
            for found in names:
                if found in self._answer_names:
                    return ANSWER
            if not any(key in data for key in self._containers):
                return REASONING
        elif (b'"error"' not in data and not any(key in data for key in self._containers)
              and not (self.response_info and _finish_given(data))):
            return NOT_COUNTED  # role-only or empty chunk
        return None

    @staticmethod
    def _carries(choice: Any) -> int:
        if not isinstance(choice, dict):
            return _NONE
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return _NONE
        for key in ("content", "refusal"):
            value = delta.get(key)
            if isinstance(value, str) and value:
                return _ANSWER
        if delta.get("tool_calls") or delta.get("function_call"):
            return _ANSWER
        for key in ("reasoning_content", "reasoning"):
            value = delta.get(key)
            if isinstance(value, str) and value:
                return _REASONING
        return _NONE

    def classify_payload(self, event: bytes, payload: Any) -> EventInfo:
        if event == b"error":
            return ERROR
        if not isinstance(payload, dict):
            return NOT_COUNTED
        choices = payload.get("choices")
        outputs = 0
        answer = False
        if isinstance(choices, list):
            for choice in choices:
                kind = self._carries(choice)
                if kind:
                    outputs += 1
                    answer = answer or kind == _ANSWER
        usage = payload.get("usage")
        if not isinstance(usage, dict):
            usage = None
        queue = (
            upstream_queue_seconds(payload) if usage is not None or "metrics" in payload else None
        )
        error = not outputs and bool(payload.get("error"))
        response = None if outputs else _chat_response(payload, always=usage is not None)
        report = report_of(payload) if "timings" in payload else None
        if usage is None and queue is None and response is None and report is None:
            if outputs == 1:
                return ANSWER if answer else REASONING
            if not outputs:
                return ERROR if error else NOT_COUNTED
        usage_only = usage is not None and choices == [] and not error
        return EventInfo(outputs, answer, usage, usage_only, error, queue, response,
                         report=report)

    def body_usage(self, payload: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return _usage_of(payload)

    def body_response(self, payload: Mapping[str, Any]) -> ResponseInfo:
        return _chat_response(payload, always=True) or NO_RESPONSE

    def output_response(self, data: bytes) -> ResponseInfo | None:
        payload = _loads(data.strip())
        return _chat_response(payload, always=True) if isinstance(payload, dict) else None

    def usage(self, raw: Mapping[str, Any] | None) -> Usage:
        return _openai_usage(raw, "prompt", "completion")

    def prompt_parts(self, payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
        return _chat_prompt(payload).parts

    def prompt(self, payload: Mapping[str, Any]) -> Prompt:
        return _chat_prompt(payload)


def _chat_response(payload: Mapping[str, Any], *, always: bool) -> ResponseInfo | None:
    """id, model and every choice's non-null ``finish_reason`` of a chat or completions
    chunk or body; None when it has no finish reason (and ``always`` is false) or says
    nothing at all."""
    finish: list[tuple[int, str]] = []
    choices = payload.get("choices")
    if isinstance(choices, list):
        for position, choice in enumerate(choices[:_CHOICES_MAX]):
            if isinstance(choice, dict):
                reason = choice.get("finish_reason")
                if isinstance(reason, str) and reason:
                    index = _count(choice.get("index"))
                    finish.append((position if index is None else index, reason[:_REASON_MAX]))
    if not finish and not always:
        return None
    info = ResponseInfo(_text(payload.get("id")), _text(payload.get("model")), tuple(finish))
    return info if info != NO_RESPONSE else None


def _finish_given(data: bytes) -> bool:
    """A ``"finish_reason"`` key whose value is not null: a chunk that says why a choice
    ended (read only for chunks that carry no output, which are few per stream)."""
    at = data.find(b'"finish_reason"')
    while at >= 0:
        if not data[at + 15 : at + 26].lstrip(b" \t\r\n:").startswith(b"null"):
            return True
        at = data.find(b'"finish_reason"', at + 15)
    return False


def _chat_prompt(payload: Mapping[str, Any]) -> Prompt:
    parts = _settings_parts(payload, CHAT_SETTINGS)
    parts.extend(_tool_parts(payload, "tools", "functions"))
    messages = payload.get("messages")
    marks = explicit_marks(payload)
    if isinstance(messages, list):
        for i, m in enumerate(messages):  # no generator: a frame resumed per message
            parts.append(_message(m, i, "message", _CHAT_SKIP, marks))
    return Prompt(tuple(parts)) if marks is None else marks.prompt(parts, Caching.MARKED)


CHAT = ChatDialect()
