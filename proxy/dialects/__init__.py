"""API dialects: what one streamed event means for each API the proxy measures, and how
each API reports token usage.

Four streaming APIs are measured: chat completions (``/v1/chat/completions``),
completions (``/v1/completions``), the OpenAI Responses API (``/v1/responses``) and the
Anthropic Messages API (``/v1/messages``). Each has a :class:`Dialect` that reads one SSE
event (its ``event:`` name and its joined ``data``) into an :class:`EventInfo`, and a
raw usage mapping into a :class:`Usage` normalised so that one dashboard compares all
four. Everything here is a pure function of its input: no I/O, no clock, no HTTP, no
metrics, and nothing raises on any input (a malformed event is simply not counted).

Definitions:

* TTFT ends at the first event carrying generated output, reasoning included. Time to
  first *answer* token ends at the first output event that is not reasoning
  (``EventInfo.answer``).
* Event name: the ``event:`` field when the event has one, else the data's ``"type"``.
  An event is read the same whether its name comes from one or the other.
* chat: a choice carries output when its ``delta`` has a non-empty ``content`` or
  ``refusal`` string, a truthy ``tool_calls`` or ``function_call`` (answer), or a
  non-empty ``reasoning_content`` or ``reasoning`` string (reasoning). Role-only and
  empty chunks are not tokens. With ``n > 1``, ``outputs`` is the number of choices
  carrying output and ``answer`` is true if any of them carries non-reasoning output.
  completions: a choice carries output when its ``text`` is a non-empty string (answer).
* chat and completions usage: ``prompt_tokens``, ``prompt_tokens_details.cached_tokens``
  and ``.cache_write_tokens``, ``completion_tokens``,
  ``completion_tokens_details.reasoning_tokens``. A data event with a truthy top-level
  ``"error"`` (vLLM and TGI report failures mid-stream that way, and the ``openai``
  client raises on it) is an error unless it carries output: real error events carry
  no choices, and that rule keeps the error check off the token path. An event named
  ``error`` is an error whatever its data.
* Responses: output is a non-empty string ``delta`` in ``response.output_text.delta``,
  ``response.refusal.delta``, ``response.function_call_arguments.delta``,
  ``response.custom_tool_call_input.delta``, ``response.mcp_call_arguments.delta``,
  ``response.code_interpreter_call_code.delta``, ``response.shell_call_command.delta``,
  ``response.audio.delta``, ``response.audio.transcript.delta`` (answer) and
  ``response.reasoning_text.delta``, ``response.reasoning_summary_text.delta``
  (reasoning). Never output: ``response.created``, ``response.in_progress``,
  ``response.queued``, every ``*.added`` and ``*.done``, and the progress events of
  hosted tools (``response.shell_call_output_content.delta`` is the output of running a
  command, not generated text; a partial image is not a token). Usage is
  ``response.usage`` in ``response.completed``, ``response.incomplete`` and
  ``response.failed`` (or the non-stream body's ``usage``): prompt ``input_tokens``,
  cached ``input_tokens_details.cached_tokens``, cache write
  ``input_tokens_details.cache_write_tokens``, completion ``output_tokens``, reasoning
  ``output_tokens_details.reasoning_tokens``. ``error`` and ``response.failed`` are
  errors; ``response.incomplete`` (a length or content-filter stop) is not.
* Messages: output is a ``content_block_delta`` whose delta is a ``text_delta`` with a
  non-empty ``text``, an ``input_json_delta`` with a non-empty ``partial_json``
  (answer), or a ``thinking_delta`` with a non-empty ``thinking`` (reasoning). Never
  output: ``message_start``, ``content_block_start``, ``ping``, ``signature_delta``,
  ``citations_delta``, ``message_delta``, ``message_stop``. Usage is
  ``message_start.message.usage`` and every ``message_delta.usage``; the API's counts
  are cumulative, so the last value of each field wins (:func:`merge_usage`), never a
  sum. Prompt is ``input_tokens + cache_read_input_tokens +
  cache_creation_input_tokens`` (the API's own definition of total input; an absent
  cache field counts 0, an absent ``input_tokens`` makes prompt unknown), cached is
  ``cache_read_input_tokens``, cache write ``cache_creation_input_tokens``, completion
  ``output_tokens``, reasoning ``output_tokens_details.thinking_tokens`` when the API
  reports it. An ``error`` event (``{"type":"error","error":{...}}``) is an error.
* Responses and Messages events with no name at all whose data has a truthy
  ``"error"`` are errors too (a server that reports failures the chat way).
* Response info (:class:`ResponseInfo`: id, the model that answered, why it stopped;
  for the trace only, never a metric label), as each API words it, read only from
  events that are decoded anyway or carry no output, so no token event is decoded for
  it. chat and completions: the top-level ``id`` and ``model`` and every choice's
  non-null ``finish_reason``, from the usage chunk and from chunks without output whose
  ``finish_reason`` is set (the byte check sends those to the full decode: one per
  choice per stream). Servers such as vLLM put the reason on the last token's event
  instead, which the byte checks read without decoding; so the stream timer keeps the
  data of the last output event it classified, and :meth:`Dialect.output_response`
  decodes that once, at the end of a stream where nothing else said why it ended.
  Responses: ``response.id`` and ``.model`` of the final event, and as the reason its
  ``incomplete_details.reason`` when set, else its ``status``. Messages: ``message.id``
  and ``.model`` of ``message_start``, ``delta.stop_reason`` of ``message_delta``.
  Non-stream answers: the same fields of the body (``stop_reason`` for Messages).
  Only events without output carry it in :attr:`EventInfo.response`.
* A token count only counts when it is an ``int >= 0`` (not a bool).

Prompt parts (:meth:`Dialect.prompt_parts`, for the prompt-cache doctor in
``proxy/diagnosis/``): the request body's prompt as an ordered tuple of
:class:`PromptPart`, in the order the provider renders it, so that a prefix of the
parts is a prefix of what the upstream's prefix cache sees. chat: ``tools`` (and the
legacy ``functions``), then ``messages``; Responses: ``instructions``, ``tools``, the
server-side context it names (``previous_response_id``, ``conversation``: the proxy
cannot see that text, so its id stands in for it), then ``input`` items; Messages:
``tools``, ``system``, ``messages`` (Anthropic's order); completions: ``prompt``. One
part per tool, message or input item (``index``: its position in the body's array, so
a user can find it). Text is its UTF-8 bytes, so a byte offset into a part is an offset
into the text the app sent; content parts are concatenated in order. Tools, tool calls,
tool results' headers and other structured pieces are compact JSON in the body's own key
order (a provider renders keys in the order given, so a reordering is a change);
``cache_control`` is left out everywhere (it moves between turns and is not prompt
text). A part the proxy cannot read (image, audio, file, document) enters as a hash of
its JSON. A chat or Responses message whose role is ``system`` or ``developer`` is of
kind ``system``. Nothing raises: a malformed body gives the parts that can be read.
:func:`cache_scope` gives what keeps two prompts from sharing a prefix cache even when
their text is the same (the model; ``prompt_cache_key``, ``cache_salt``).

Speed: most events of a stream are one token. Each dialect recognises its common token
event from the bytes, without decoding JSON (``benchmarks/profile.md`` has the cost of
a decode per event), and decodes everything else in full. The byte checks only return
an answer when the bytes leave no doubt about what the full decode would say for the
layouts servers write (compact JSON, keys written plainly, no duplicate keys); property
tests check them against :meth:`Dialect.classify_payload` on generated events.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple, Protocol


class ResponseInfo(NamedTuple):
    """What a response says about itself: its id, the model that answered and why it
    stopped (the span's ``gen_ai.response.*``). Empty strings: not said."""

    id: str = ""
    model: str = ""
    finish: tuple[tuple[int, str], ...] = ()  # (choice index, reason as the API says it)

    @property
    def finish_reasons(self) -> tuple[str, ...]:
        """The reasons in choice order."""
        return tuple(reason for _, reason in sorted(self.finish))


NO_RESPONSE = ResponseInfo()


class EventInfo(NamedTuple):
    """What one SSE event says, as far as measurement cares (a NamedTuple: one is made
    per event)."""

    outputs: int = 0  # output-bearing units: chat choices carrying output; else 0 or 1
    answer: bool = False  # any of those outputs is answer, not reasoning
    usage: Mapping[str, Any] | None = None  # the raw usage mapping this event carries
    usage_only: bool = False  # chat/completions: ``"choices": []`` with usage, no error
    error: bool = False  # an error reported inside a 200 stream
    upstream_queue_s: float | None = None  # vLLM ``metrics.queue_time_ms``, in seconds
    # id, model, finish reasons: only on events without output (see "Response info")
    response: ResponseInfo | None = None
    # the stream's own last event: chat/completions ``[DONE]``, Responses
    # ``response.completed``/``incomplete``/``failed``, Messages ``message_stop``
    end: bool = False


NOT_COUNTED = EventInfo()
END = EventInfo(end=True)
ANSWER = EventInfo(1, True)
REASONING = EventInfo(1, False)
ERROR = EventInfo(error=True)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts normalised across the four APIs (None: not reported)."""

    prompt_tokens: int | None = None  # all input tokens, cached or not
    cached_prompt_tokens: int | None = None  # of those, read from the prompt cache
    completion_tokens: int | None = None  # all output tokens, reasoning included
    reasoning_tokens: int | None = None  # of those, reasoning
    cache_write_tokens: int | None = None  # input tokens written to the prompt cache


_NO_USAGE = Usage()
_EMPTY: Mapping[str, Any] = {}


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _mapping(holder: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = holder.get(key)
    return value if isinstance(value, Mapping) else _EMPTY


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def _event_name(event: bytes, payload: Any) -> str:
    """The ``event:`` field if present, else the payload's ``"type"``; ``""`` if neither."""
    if event:
        return event.decode("utf-8", "replace")
    if isinstance(payload, dict):
        kind = payload.get("type")
        if isinstance(kind, str):
            return kind
    return ""


def _usage_of(holder: Any) -> Mapping[str, Any] | None:
    if isinstance(holder, Mapping):
        usage = holder.get("usage")
        if isinstance(usage, Mapping):
            return usage
    return None


_ID_MAX = 256  # the upstream's text: bounded before it goes anywhere
_REASON_MAX = 64
_CHOICES_MAX = 128


def _text(value: Any, limit: int = _ID_MAX) -> str:
    return value[:limit] if isinstance(value, str) else ""


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


def _single_response(holder: Any, reason: Any) -> ResponseInfo | None:
    """id and model of ``holder``, and ``reason`` as the one finish reason."""
    if not isinstance(holder, Mapping):
        return None
    finish = ((0, reason[:_REASON_MAX]),) if isinstance(reason, str) and reason else ()
    info = ResponseInfo(_text(holder.get("id")), _text(holder.get("model")), finish)
    return info if info != NO_RESPONSE else None


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


def _finish_given(data: bytes) -> bool:
    """A ``"finish_reason"`` key whose value is not null: a chunk that says why a choice
    ended (read only for chunks that carry no output, which are few per stream)."""
    at = data.find(b'"finish_reason"')
    while at >= 0:
        if not data[at + 15 : at + 26].lstrip(b" \t\r\n:").startswith(b"null"):
            return True
        at = data.find(b'"finish_reason"', at + 15)
    return False


def merge_usage(acc: dict[str, Any] | None, raw: Mapping[str, Any]) -> dict[str, Any]:
    """Fold one event's raw usage into ``acc`` (a new dict when None) and return it.

    Field by field, a later event's value wins: Messages and vLLM report cumulative
    counts, so the last value is the total and a sum would double count. A nested
    mapping (``prompt_tokens_details``, ``input_tokens_details``, ...) is merged one
    level deep, so an event that reports only some details keeps the others. A null
    value means "not reported here" and never erases an earlier value. ``acc`` is
    updated in place; it never shares a nested mapping with an event.
    """
    out: dict[str, Any] = {} if acc is None else acc
    if not isinstance(raw, Mapping):
        return out
    for key, value in raw.items():
        if value is None:
            continue
        if isinstance(value, Mapping):
            old = out.get(key)
            merged = dict(old) if isinstance(old, dict) else {}
            for inner, item in value.items():
                if item is not None:
                    merged[inner] = item
            out[key] = merged
        else:
            out[key] = value
    return out


def upstream_queue_seconds(payload: Mapping[str, Any]) -> float | None:
    """vLLM-style per-request ``metrics.queue_time_ms`` (top level or inside usage)."""
    for holder in (payload, payload.get("usage")):
        if isinstance(holder, dict):
            metrics = holder.get("metrics")
            if isinstance(metrics, dict):
                value = metrics.get("queue_time_ms")
                if (
                    isinstance(value, int | float)
                    and not isinstance(value, bool)
                    and math.isfinite(value)  # json.loads takes Infinity and NaN
                    and value >= 0
                ):
                    return float(value) / 1000.0
    return None


class Dialect(Protocol):
    """One streaming API, as far as measurement cares.

    The attributes are read-only properties so that frozen instances satisfy the
    protocol. ``classify`` is the per-event entry point; ``classify_payload`` is the
    full-decode reading it must agree with (and falls back to).
    """

    @property
    def name(self) -> str:
        """``"chat"``, ``"completions"``, ``"responses"`` or ``"messages"``."""
        ...

    @property
    def route(self) -> str:
        """The request path this dialect measures."""
        ...

    @property
    def injects_usage(self) -> bool:
        """Whether the proxy may add ``stream_options.include_usage`` to the request
        (chat and completions only: the other two always report usage)."""
        ...

    @property
    def token_keys(self) -> tuple[bytes, ...]:
        """Compact JSON keys, opening quote included, whose non-empty string value is
        the token text of the common event (for :class:`TokenTemplate`)."""
        ...

    def classify(self, event: bytes, data: bytes) -> EventInfo:
        """Read one event: ``event`` is its ``event:`` name (``b""`` when absent),
        ``data`` its joined data field."""
        ...

    def classify_payload(self, event: bytes, payload: Any) -> EventInfo:
        """Read one event whose data was decoded to ``payload`` (None if undecodable)."""
        ...

    def body_usage(self, payload: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The raw usage of a non-stream JSON answer."""
        ...

    def body_response(self, payload: Mapping[str, Any]) -> ResponseInfo:
        """id, model and finish reasons of a non-stream JSON answer."""
        ...

    def output_response(self, data: bytes) -> ResponseInfo | None:
        """What an output event's data says about the response, decoded once at the end
        of a stream that said no finish reason anywhere else; None for APIs whose output
        events never carry one."""
        ...

    def usage(self, raw: Mapping[str, Any] | None) -> Usage:
        """Normalise a raw usage mapping (merged across events by :func:`merge_usage`)."""
        ...

    def prompt_parts(self, payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
        """The prompt of a parsed request body as the provider renders it, in order
        (see "Prompt parts" above); never raises."""
        ...


# ---------------------------------------------------------------------------
# Prompt parts

PART_KINDS: tuple[str, ...] = (
    "tools", "system", "instructions", "context", "message", "input", "prompt")


@dataclass(frozen=True, slots=True)
class PromptPart:
    """One piece of a request's prompt, in render order (see "Prompt parts").

    ``kind`` is one of :data:`PART_KINDS`; ``index`` the piece's position in its array
    in the body (tool *i*, message *i*, input item *i*; 0 for a single ``system`` or
    ``instructions``); ``role`` the message's role or the input item's type (bounded,
    ``""`` where there is none); ``data`` the canonical bytes. Held only while the
    doctor hashes it: never stored, logged or exported.
    """

    kind: str
    index: int
    role: str
    data: bytes


_ROLE_MAX = 32
_NESTING_MAX = 8
_SYSTEM_ROLES = frozenset(("system", "developer"))
_TEXT_PARTS = frozenset(("text", "input_text", "output_text"))
# Content the proxy cannot read as text: each enters as a hash of its JSON.
_OPAQUE_PARTS = frozenset((
    "image", "image_url", "input_image", "audio", "input_audio", "file", "input_file",
    "document", "video", "video_url"))
_NOT_PROMPT = "cache_control"  # Anthropic's breakpoint marker: not text the model sees


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # json.loads lets lone surrogates through


def _json_bytes(value: Any) -> bytes:
    try:
        return _utf8(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    except (ValueError, TypeError, RecursionError):
        return b""


def _without_marker(value: Any) -> Any:
    if isinstance(value, dict) and _NOT_PROMPT in value:
        return {k: v for k, v in value.items() if k != _NOT_PROMPT}
    return value


def _role(value: Any) -> str:
    return value[:_ROLE_MAX] if isinstance(value, str) else ""


def _opaque(kind: str, value: Any) -> bytes:
    digest = hashlib.blake2b(_json_bytes(value), digest_size=16).hexdigest()
    return b"\x00" + _utf8(kind[:_ROLE_MAX]) + b":" + digest.encode() + b"\x00"


def _content(value: Any, out: list[bytes], depth: int = 0) -> None:
    """Append the bytes of a message's ``content`` (a string, a list of parts, a part)."""
    if isinstance(value, str):
        out.append(_utf8(value))
    elif isinstance(value, list):
        if depth >= _NESTING_MAX:
            out.append(_json_bytes(value))
            return
        for item in value:
            _content_part(item, out, depth + 1)
    elif value is not None:
        _content_part(value, out, depth + 1)


def _content_part(part: Any, out: list[bytes], depth: int) -> None:
    if isinstance(part, str):
        out.append(_utf8(part))
        return
    if not isinstance(part, dict):
        out.append(_json_bytes(part))
        return
    kind = part.get("type")
    text = part.get("text")
    if isinstance(text, str) and (kind is None or kind in _TEXT_PARTS):
        out.append(_utf8(text))
    elif isinstance(kind, str) and kind in _OPAQUE_PARTS:
        out.append(_opaque(kind, _without_marker(part)))
    elif kind == "tool_result" and depth < _NESTING_MAX:
        # The header (id, is_error) as JSON, then the result's content read like any
        # content: text stays text, an image in it is hashed.
        out.append(_json_bytes({k: v for k, v in part.items()
                                if k not in ("content", _NOT_PROMPT)}))
        _content(part.get("content"), out, depth)
    else:
        out.append(_json_bytes(_without_marker(part)))


def _message(message: Any, index: int, kind: str, skip: frozenset[str]) -> PromptPart:
    """A chat message, Messages message or Responses input item as one part: its content,
    then any other field (tool calls, name, tool_call_id, ...) as JSON."""
    if not isinstance(message, dict):
        if isinstance(message, str):  # not valid in any API, but readable
            return PromptPart(kind, index, "", _utf8(message))
        return PromptPart(kind, index, "", _json_bytes(message))
    role = message.get("role")
    if not isinstance(role, str):  # a Responses item such as function_call: its JSON
        return PromptPart(kind, index, _role(message.get("type")),
                          _json_bytes(_without_marker(message)))
    out: list[bytes] = []
    _content(message.get("content"), out)
    extras = {k: v for k, v in message.items() if k not in skip}
    if extras:
        out.append(b"\x00" + _json_bytes(extras))
    if role in _SYSTEM_ROLES and kind != "instructions":
        kind = "system"
    return PromptPart(kind, index, _role(role), b"".join(out))


_CHAT_SKIP = frozenset(("role", "content", _NOT_PROMPT))
_ITEM_SKIP = frozenset(("role", "content", "type", _NOT_PROMPT))


def _tool_parts(payload: Mapping[str, Any], *names: str) -> list[PromptPart]:
    parts: list[PromptPart] = []
    for name in names:
        tools = payload.get(name)
        if isinstance(tools, list):
            for tool in tools:
                parts.append(PromptPart("tools", len(parts), "", _json_bytes(_without_marker(tool))))
    return parts


def _chat_parts(payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
    parts = _tool_parts(payload, "tools", "functions")
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts.extend(_message(m, i, "message", _CHAT_SKIP) for i, m in enumerate(messages))
    return tuple(parts)


def _completions_parts(payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return (PromptPart("prompt", 0, "", _utf8(prompt)),)
    if not isinstance(prompt, list):
        return ()
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]  # one prompt sent as token ids
    parts = []
    for i, item in enumerate(prompt):  # batched prompts: one part each
        if isinstance(item, str):
            parts.append(PromptPart("prompt", i, "", _utf8(item)))
        elif isinstance(item, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in item):
            parts.append(PromptPart("prompt", i, "", " ".join(map(str, item)).encode()))
        else:
            parts.append(PromptPart("prompt", i, "", _json_bytes(item)))
    return tuple(parts)


def _responses_parts(payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
    parts: list[PromptPart] = []
    instructions = payload.get("instructions")
    if isinstance(instructions, str):
        parts.append(PromptPart("instructions", 0, "", _utf8(instructions)))
    elif isinstance(instructions, list):
        parts.extend(_message(m, i, "instructions", _ITEM_SKIP)
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
        parts.extend(_message(m, i, "input", _ITEM_SKIP) for i, m in enumerate(items))
    return tuple(parts)


def _messages_parts(payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
    parts = _tool_parts(payload, "tools")
    system = payload.get("system")
    if system is not None:
        out: list[bytes] = []
        _content(system, out)
        parts.append(PromptPart("system", 0, "system", b"".join(out)))
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts.extend(_message(m, i, "message", _CHAT_SKIP) for i, m in enumerate(messages))
    return tuple(parts)


def cache_scope(payload: Mapping[str, Any]) -> tuple[str, str]:
    """(model, cache key) of a parsed request body: prompts that differ in either never
    share a prefix cache. The key is OpenAI's ``prompt_cache_key`` and vLLM's
    ``cache_salt``, joined when both are given; ``""`` when neither."""
    model = payload.get("model")
    keys = [value for value in (payload.get("prompt_cache_key"), payload.get("cache_salt"))
            if isinstance(value, str) and value]
    return (model if isinstance(model, str) else ""), "\x00".join(keys)


# ---------------------------------------------------------------------------
# chat completions and completions


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

    The byte scan for the common event (one choice, one token, no usage, no metrics)
    runs only on payloads that look like one JSON object with exactly one ``"delta"``
    key (so at most one choice can carry output; ``measure.inspect_event`` counted
    ``"index"`` keys instead, which misreads servers that omit them) and no usage
    object or vLLM metrics. Then, cheapest first: the first ``"content"`` key followed
    by a non-empty string is an answer; a delta whose only key is ``reasoning_content``
    or ``reasoning`` with a non-empty string (``"delta":{"reasoning":"x"}``: its value
    ends at the first unescaped quote, right before the delta's ``}``) is reasoning;
    else one regex pass finds every output key with a non-empty string in any spacing.
    An unescaped quote on both sides of a key means it cannot lie inside a JSON string.
    Reasoning from the regex pass is only trusted with no answer key and no
    ``"tool_calls"``/``"function_call"`` at all, "nothing" only when there is also no
    ``"error"``, so the ``"error"`` search never runs for a token event.
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
            if info is not None:
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
        if usage is None and queue is None and response is None:
            if outputs == 1:
                return ANSWER if answer else REASONING
            if not outputs:
                return ERROR if error else NOT_COUNTED
        usage_only = usage is not None and choices == [] and not error
        return EventInfo(outputs, answer, usage, usage_only, error, queue, response)

    def body_usage(self, payload: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return _usage_of(payload)

    def body_response(self, payload: Mapping[str, Any]) -> ResponseInfo:
        return _chat_response(payload, always=True) or NO_RESPONSE

    def output_response(self, data: bytes) -> ResponseInfo | None:
        payload = _loads(data.strip())
        return _chat_response(payload, always=True) if isinstance(payload, dict) else None

    def usage(self, raw: Mapping[str, Any] | None) -> Usage:
        if not isinstance(raw, Mapping):
            return _NO_USAGE
        prompt = _mapping(raw, "prompt_tokens_details")
        completion = _mapping(raw, "completion_tokens_details")
        return Usage(
            _count(raw.get("prompt_tokens")),
            _count(prompt.get("cached_tokens")),
            _count(raw.get("completion_tokens")),
            _count(completion.get("reasoning_tokens")),
            _count(prompt.get("cache_write_tokens")),
        )

    def prompt_parts(self, payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
        return _chat_parts(payload)


@dataclass(frozen=True, slots=True)
class CompletionsDialect(ChatDialect):
    """``/v1/completions``: the chat reading with ``choices[].text`` as the only output
    (and the byte scan keyed on ``"text"``, one per choice)."""

    name: str = "completions"
    route: str = "/v1/completions"
    injects_usage: bool = True
    token_keys: tuple[bytes, ...] = (b'"text":"',)

    _marker: ClassVar[bytes] = b'"text"'
    _answer_key: ClassVar[bytes] = b'"text"'
    _reasoning_delta: ClassVar[bytes] = b""
    _scan: ClassVar[re.Pattern[bytes]] = re.compile(rb'"(text)"\s*:\s*"[^"]')
    _answer_names: ClassVar[frozenset[bytes]] = frozenset((b"text",))
    _containers: ClassVar[tuple[bytes, ...]] = ()

    @staticmethod
    def _carries(choice: Any) -> int:
        if isinstance(choice, dict):
            text = choice.get("text")
            if isinstance(text, str) and text:
                return _ANSWER
        return _NONE

    def prompt_parts(self, payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
        return _completions_parts(payload)


# ---------------------------------------------------------------------------
# Responses

_RESPONSES_OUTPUT: dict[str, EventInfo] = {
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
_RESPONSES_OUTPUT_B = {name.encode(): info for name, info in _RESPONSES_OUTPUT.items()}
_RESPONSES_USAGE = frozenset(("response.completed", "response.incomplete", "response.failed"))
_RESPONSES_USAGE_B = frozenset(name.encode() for name in _RESPONSES_USAGE)
_TYPE_PREFIX = b'{"type":"'


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

    Byte check for the delta events: the name (from ``event:``, or from data that
    starts with ``{"type":"NAME"`` and has no other ``"type"`` key) is one of the output
    deltas, the data is one object with exactly one ``"delta"`` key, written
    ``"delta":"`` followed by anything but a quote: a non-empty string. Events named
    anything else are settled by their name alone, except the three that carry usage.
    OpenAI's delta events carry a ``sequence_number`` and an ``obfuscation`` pad that
    change every event, so :class:`TokenTemplate` rarely matches them; this check is
    what keeps them cheap.
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
        info = _RESPONSES_OUTPUT.get(name)
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
            if name == "response.failed":
                return EventInfo(usage=usage, error=True, response=response, end=True)
            if usage is None and response is None:
                return END
            return EventInfo(usage=usage, response=response, end=True)
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
        if not isinstance(raw, Mapping):
            return _NO_USAGE
        inputs = _mapping(raw, "input_tokens_details")
        outputs = _mapping(raw, "output_tokens_details")
        return Usage(
            _count(raw.get("input_tokens")),
            _count(inputs.get("cached_tokens")),
            _count(raw.get("output_tokens")),
            _count(outputs.get("reasoning_tokens")),
            _count(inputs.get("cache_write_tokens")),
        )

    def prompt_parts(self, payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
        return _responses_parts(payload)


# ---------------------------------------------------------------------------
# Messages

_MESSAGES_OUTPUT: dict[str, tuple[str, EventInfo]] = {
    "text_delta": ("text", ANSWER),
    "input_json_delta": ("partial_json", ANSWER),
    "thinking_delta": ("thinking", REASONING),
}
# What follows ``"delta":{"type":"`` in the compact form, the value's key, the reading.
_MESSAGES_FAST: tuple[tuple[bytes, bytes, EventInfo], ...] = tuple(
    (f'{kind}","{key}":"'.encode(), f'"{key}"'.encode(), info)
    for kind, (key, info) in _MESSAGES_OUTPUT.items()
)
_MESSAGES_DELTA = b'"delta":{"type":"'
_MESSAGES_USAGE_B = frozenset((b"message_start", b"message_delta"))


@dataclass(frozen=True, slots=True)
class MessagesDialect:
    """``/v1/messages``.

    Byte check for ``content_block_delta``, in the layout the API writes
    (``{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}``):
    the data starts with ``{"type":"``, has exactly two ``"type"`` keys (the event's and
    the delta's, which ``"delta":{"type":"`` pins as the delta's first key), one
    ``"delta"`` key, the delta kind followed at once by its value key, that key once,
    and its value a non-empty string. ``message_start`` and ``message_delta`` (usage)
    and anything unsure are decoded; other names are settled by the name alone.
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
                known = _MESSAGES_OUTPUT.get(kind) if isinstance(kind, str) else None
                if known is not None:
                    value = delta.get(known[0])
                    if isinstance(value, str) and value:
                        return known[1]
            return NOT_COUNTED
        if name == "message_start":
            message = payload.get("message")
            usage = _usage_of(message)
            response = _single_response(message, None)  # stop_reason is null here
        elif name == "message_delta":
            usage = _usage_of(payload)
            delta = payload.get("delta")
            response = _single_response(
                delta, delta.get("stop_reason") if isinstance(delta, Mapping) else None)
        else:
            usage = response = None
        if usage is not None or response is not None:
            return EventInfo(usage=usage, response=response)
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
        return _messages_parts(payload)


CHAT = ChatDialect()
COMPLETIONS = CompletionsDialect()
RESPONSES = ResponsesDialect()
MESSAGES = MessagesDialect()
DIALECTS: dict[str, Dialect] = {d.route: d for d in (CHAT, COMPLETIONS, RESPONSES, MESSAGES)}
# The same, not reading response info where that costs a decode per stream (chat and
# completions' finish chunk): for a proxy with no trace, OTLP metrics or request log.
DIALECTS_WITHOUT_RESPONSE_INFO: dict[str, Dialect] = {
    d.route: d for d in (replace(CHAT, response_info=False),
                         replace(COMPLETIONS, response_info=False), RESPONSES, MESSAGES)}


# ---------------------------------------------------------------------------
# The token template

# The bytes of a JSON string's body with no quote, no line break, not ending in a backslash.
_PLAIN_TEXT = re.compile(rb'[^"\r\n]*[^"\r\n\\]').fullmatch


class TokenTemplate:
    """The shape of one stream's token events, learned once, matched with two compares.

    Servers write every token event of a stream the same way; only the token text
    changes: ``data: {"id":"x",...,"delta":{"content":"<TEXT>"},...}\\n\\n``, or with an
    ``event: NAME`` line first (Messages). From the first chunk that is one whole event
    read as a single output (no usage, no error), this keeps the bytes before
    ``<TEXT>``, the bytes after it, and what the event was (answer or reasoning). A later
    chunk that starts and ends with exactly those bytes, and whose middle holds no quote,
    no line break and no trailing backslash, is the same event with another non-empty
    string in the same place. Every dialect's reading depends on such a string only
    through whether it is empty, so the match is read exactly as the learned event was:
    two byte compares instead of a parse and a scan.

    Events that do not match (another key, a varying field such as a sequence number or
    OpenAI's ``obfuscation``, escaped quotes) take the full path, so the template can
    only make measurement cheaper, never different; after 8 misses in a row it is
    learned again (a reasoning model moving from ``reasoning_content`` to ``content``).
    A property test checks the template path against the full one on generated streams.
    """

    __slots__ = ("_head", "_info", "_misses", "_tail", "_width", "keys")

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys
        self._head = b""  # empty: nothing learned
        self._tail = b""
        self._width = 0
        self._misses = 0
        self._info = ANSWER

    def match(self, chunk: bytes) -> EventInfo | None:
        """The learned reading if ``chunk`` is another event of the learned shape."""
        head = self._head
        if not head:
            return None
        if (
            len(chunk) > self._width
            and chunk.startswith(head)
            and chunk.endswith(self._tail)
            and _PLAIN_TEXT(chunk, len(head), len(chunk) - len(self._tail))
        ):
            self._misses = 0
            return self._info
        self._misses += 1
        if self._misses >= 8:
            self._head = b""
        return None

    def learn(self, chunk: bytes, info: EventInfo) -> None:
        """``chunk`` is one whole event (``data:`` line, optionally after an ``event:``
        line) that the full path read as ``info``; learn from it if nothing is learned
        yet and it is a single output with no usage and no error."""
        if (
            self._head
            or info.outputs != 1
            or info.usage is not None
            or info.error
            or info.upstream_queue_s is not None
            or not chunk.endswith(b"\n\n")
        ):
            return
        if chunk.startswith(b"data:"):
            begin = 0
        elif chunk.startswith(b"event:"):
            begin = chunk.find(b"\n") + 1  # the data line must come next
            if not chunk.startswith(b"data:", begin):
                return
        else:
            return
        for key in self.keys:  # the first key with a non-empty value
            at = chunk.find(key, begin)
            if at < 0:
                continue
            start = at + len(key)
            end = chunk.find(b'"', start)
            if end > start:
                break
        else:
            return
        if chunk.find(key, start) >= 0 or b"\\" in chunk[start:end]:
            return
        self._head, self._tail = chunk[:start], chunk[end:]
        self._width = len(self._head) + len(self._tail)
        self._info = ANSWER if info.answer else REASONING
        self._misses = 0
