"""``/v1/messages``: what an Anthropic Messages API event, and a message, mean.

Design: ``docs/design/dialects.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.dialects.base import (
    _NO_USAGE,
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
    _count,
    _event_name,
    _loads,
    _mapping,
    _single_response,
    _usage_of,
    report_of,
)
from proxy.dialects.prompt import (
    _CHAT_SKIP,
    CACHE_CONTROL,
    MESSAGES_SETTINGS,
    Caching,
    Prompt,
    PromptPart,
    _content,
    _Marks,
    _message,
    _settings_parts,
    _tool_parts,
)

MESSAGES_OUTPUT: dict[str, tuple[str, EventInfo]] = {
    "text_delta": ("text", ANSWER),
    "input_json_delta": ("partial_json", ANSWER),
    "thinking_delta": ("thinking", REASONING),
}
# What follows ``"delta":{"type":"`` in the compact form, the value's key, the reading.
_MESSAGES_FAST: tuple[tuple[bytes, bytes, EventInfo], ...] = tuple(
    (f'{kind}","{key}":"'.encode(), f'"{key}"'.encode(), info)
    for kind, (key, info) in MESSAGES_OUTPUT.items()
)
_MESSAGES_DELTA = b'"delta":{"type":"'
_MESSAGES_USAGE_B = frozenset((b"message_start", b"message_delta"))


@dataclass(frozen=True, slots=True)
class MessagesDialect:
    """``/v1/messages``.

    Design: ``docs/design/dialects.md``, "The Messages byte check".
    """

    name: str = "messages"
    route: str = "/v1/messages"
    injects_usage: bool = False
    token_keys: tuple[bytes, ...] = (b'"text":"', b'"thinking":"', b'"partial_json":"')

    def classify(self, event: bytes, data: bytes) -> EventInfo:
        name = event
        if not name:
            if data[:9] != _TYPE_PREFIX:
                return self.classify_payload(event, _loads(data))
            end = data.find(b'"', 9)
            name = data[9:end]
            if end < 0 or not name or b"\\" in name:
                return self.classify_payload(event, _loads(data))
        if name == b"content_block_delta":
            at = data.find(_MESSAGES_DELTA) + len(_MESSAGES_DELTA)
            if (
                at >= len(_MESSAGES_DELTA)
                and data[:9] == _TYPE_PREFIX
                and data[-1:] == b"}"
                and data.count(b'"type"') == 2
                and data.count(b'"delta"') == 1
            ):
                for head, key, info in _MESSAGES_FAST:
                    if data.startswith(head, at):
                        value = at + len(head)
                        if data[value : value + 1] != b'"' and data.count(key) == 1:
                            return info
                        break
            return self.classify_payload(event, _loads(data))
        if name == b"error":
            return ERROR
        if name == b"message_stop":
            return END
        if name not in _MESSAGES_USAGE_B and (event or data.count(b'"type"') == 1):
            return NOT_COUNTED  # ping, content_block_start/stop, unknown
        return self.classify_payload(event, _loads(data))

    def classify_payload(self, event: bytes, payload: Any) -> EventInfo:
        name = _event_name(event, payload)
        if name == "error":
            return ERROR
        if name == "message_stop":
            return END
        if not isinstance(payload, dict):
            return NOT_COUNTED
        if name == "content_block_delta":
            delta = payload.get("delta")
            if isinstance(delta, dict):
                kind = delta.get("type")
                known = MESSAGES_OUTPUT.get(kind) if isinstance(kind, str) else None
                if known is not None:
                    value = delta.get(known[0])
                    if isinstance(value, str) and value:
                        return known[1]
            return NOT_COUNTED
        report = None
        if name == "message_start":
            message = payload.get("message")
            usage = _usage_of(message)
            if usage is not None and "output_tokens" in usage:
                # a placeholder (1) until message_delta counts the output: a stream that
                # ends before one has no count, not 1
                usage = {k: v for k, v in usage.items() if k != "output_tokens"}
            response = _single_response(message, None)  # stop_reason is null here
            report = report_of(message)  # cache diagnostics, when the app asked
        elif name == "message_delta":
            usage = _usage_of(payload)
            delta = payload.get("delta")
            response = _single_response(
                delta, delta.get("stop_reason") if isinstance(delta, Mapping) else None)
            report = report_of(payload)
        else:
            usage = response = None
        if usage is not None or response is not None or report is not None:
            return EventInfo(usage=usage, response=response, report=report)
        if not name and payload.get("error"):
            return ERROR
        return NOT_COUNTED

    def body_usage(self, payload: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return _usage_of(payload)

    def body_response(self, payload: Mapping[str, Any]) -> ResponseInfo:
        return _single_response(payload, payload.get("stop_reason")) or NO_RESPONSE

    def output_response(self, data: bytes) -> ResponseInfo | None:
        return None  # message_start and message_delta (always decoded) say it all

    def usage(self, raw: Mapping[str, Any] | None) -> Usage:
        if not isinstance(raw, Mapping):
            return _NO_USAGE
        fresh = _count(raw.get("input_tokens"))
        read = _count(raw.get("cache_read_input_tokens"))
        write = _count(raw.get("cache_creation_input_tokens"))
        prompt = None if fresh is None else fresh + (read or 0) + (write or 0)
        details = _mapping(raw, "output_tokens_details")
        return Usage(
            prompt,
            read,
            _count(raw.get("output_tokens")),
            _count(details.get("thinking_tokens")),
            write,
        )

    def prompt_parts(self, payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
        return _messages_prompt(payload).parts

    def prompt(self, payload: Mapping[str, Any]) -> Prompt:
        return _messages_prompt(payload)


def _messages_prompt(payload: Mapping[str, Any]) -> Prompt:
    """Cached only up to a ``cache_control`` breakpoint on a tool, a system block or a
    content block, or, with a request-level ``cache_control``, up to the last block."""
    marks = _Marks(CACHE_CONTROL)
    parts = _settings_parts(payload, MESSAGES_SETTINGS)
    parts.extend(_tool_parts(payload, "tools", marks=marks))
    system = payload.get("system")
    if system is not None:
        out: list[bytes] = []
        _content(system, out, 0, marks)
        parts.append(marks.close(PromptPart("system", 0, "system", b"".join(out))))
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts.extend(_message(m, i, "message", _CHAT_SKIP, marks) for i, m in enumerate(messages))
    automatic = isinstance(payload.get(CACHE_CONTROL), dict)
    return marks.prompt(parts, Caching.AUTOMATIC if automatic else Caching.MARKED)


MESSAGES = MessagesDialect()
