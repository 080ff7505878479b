"""Measurement: timed events in, one frozen per-request record out.

This module knows what an OpenAI streaming event *means* (does it carry generated
output? is it the usage event?) and turns the times at which events were handed to
the client into the quantities users feel. It knows nothing of HTTP, sockets or
Prometheus, and never reads a clock: every time comes from the caller, read once per
event.

Definitions (kept word for word in the README and the metrics' HELP texts):

* The request clock starts when the proxy receives the request, before any queueing.
* TTFT ends when the first event carrying generated output is handed on to the client:
  non-empty ``delta.content``, ``delta.reasoning_content`` or ``delta.reasoning``,
  ``delta.tool_calls``, ``delta.refusal``, ``delta.function_call`` (or non-empty
  ``choices[].text`` for ``/v1/completions``). A role-only or empty chunk is not a
  token. With ``n > 1`` the first output of any choice counts.
* ITL is every gap between consecutive output-bearing events.
* TPOT is (last - first) / (completion_tokens - 1) per request, with tokens from the
  upstream's usage, only when completion_tokens >= 2.

Nothing here may raise on any input: a malformed event is simply not counted.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from proxy.sse import SSEParser

_CHAT_OUTPUT_KEYS = ("content", "reasoning_content", "reasoning", "refusal")
_CHAT_OUTPUT_CONTAINERS = ("tool_calls", "function_call")


class Outcome(StrEnum):
    COMPLETED = "completed"
    CLIENT_DISCONNECTED = "client_disconnected"
    UPSTREAM_INTERRUPTED = "upstream_interrupted"
    UPSTREAM_ERROR = "upstream_error"
    TIMEOUT = "timeout"
    REJECTED = "rejected"  # answered by the proxy itself (413, 429, 502 before headers, ...)


class EventInfo(NamedTuple):
    """What one SSE ``data`` payload says, as far as measurement cares (a NamedTuple:
    one is made per event)."""

    outputs: int = 0  # choices in this event that carry generated output
    usage: Mapping[str, Any] | None = None
    usage_only: bool = False  # ``"choices": []`` with a usage object
    upstream_queue_s: float | None = None


NOT_COUNTED = EventInfo()


def _count_outputs(choices: Any, text_route: bool) -> int:
    if not isinstance(choices, list):
        return 0
    count = 0
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if text_route:
            text = choice.get("text")
            if isinstance(text, str) and text:
                count += 1
            continue
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        for key in _CHAT_OUTPUT_KEYS:
            value = delta.get(key)
            if isinstance(value, str) and value:
                count += 1
                break
        else:
            for key in _CHAT_OUTPUT_CONTAINERS:
                if delta.get(key):
                    count += 1
                    break
    return count


def upstream_queue_seconds(payload: Mapping[str, Any]) -> float | None:
    """vLLM-style per-request ``metrics.queue_time_ms`` (top level or inside usage)."""
    for holder in (payload, payload.get("usage")):
        if isinstance(holder, dict):
            metrics = holder.get("metrics")
            if isinstance(metrics, dict):
                value = metrics.get("queue_time_ms")
                if (isinstance(value, int | float) and not isinstance(value, bool)
                        and math.isfinite(value) and value >= 0):  # json.loads takes Infinity
                    return float(value) / 1000.0
    return None


def inspect_payload(payload: Any, *, text_route: bool) -> EventInfo:
    """Classify one decoded JSON payload (a streaming chunk)."""
    if not isinstance(payload, dict):
        return NOT_COUNTED
    choices = payload.get("choices")
    outputs = _count_outputs(choices, text_route)
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        usage = None
    queue = upstream_queue_seconds(payload) if usage is not None or "metrics" in payload else None
    if not outputs and usage is None and queue is None:
        return NOT_COUNTED
    usage_only = usage is not None and isinstance(choices, list) and not choices
    return EventInfo(outputs, usage, usage_only, queue)


# Byte scan for the common event, one pass: a non-empty string value under one of the
# output keys (an unescaped quote on both sides of the key, so text inside a JSON string
# never matches), the ``"index"`` keys (one means one choice), and anything that needs
# the full decode (a usage object, vLLM metrics).
_CHAT_SCAN = re.compile(
    rb'"(?:content|reasoning_content|reasoning|refusal)"\s*:\s*"[^"]|"index"|"usage"\s*:\s*\{|"metrics"')
_TEXT_SCAN = re.compile(rb'"text"\s*:\s*"[^"]|"index"|"usage"\s*:\s*\{|"metrics"')
_INDEX = b'"index"'
_OUTPUT_INITIALS = frozenset(b"crt")  # "content", "reasoning...", "refusal", "text"
ONE_OUTPUT = EventInfo(1)  # the common event: one choice carrying output, nothing else


# The cheapest test, for compact JSON (OpenAI, vLLM, llama.cpp): a plain substring
# search for an output key followed by the opening quote of a non-empty string.
_CHAT_KEYS = (b'"content":"', b'"reasoning_content":"', b'"reasoning":"', b'"refusal":"',
              b'"content": "')
_TEXT_KEYS = (b'"text":"', b'"text": "')


def _usage_is_null(data: bytes) -> bool:
    """No ``"usage"`` key, or only ``"usage": null`` (OpenAI sends that on every chunk of
    a stream that asked for usage)."""
    at = data.find(b'"usage"')
    if at < 0:
        return True
    rest = data[at + 7 : at + 16].lstrip(b" \t\r\n:")
    return rest.startswith(b"null") and data.find(b'"usage"', at + 7) < 0


def inspect_event(data: bytes, *, text_route: bool) -> EventInfo:
    """Classify one SSE ``data`` payload; never raises.

    Most events of a stream are one token of text. Those are recognised without
    decoding (``json.loads`` per event was a quarter of the measurement's cost in issue
    5), in two steps: substring searches for the compact form (``"content":"x``), then
    one regex pass for any spacing; either way exactly one choice (at most one
    ``"index"`` key), an output value that is a non-empty string, and no usage object or
    vLLM metrics. Every other event, and any event the scans are not sure of, is decoded
    in full. The scans only trust payloads that look like one JSON object
    (``{`` ... ``}``); a property test checks they agree with the full decode on
    generated chunks.
    """
    if not data or data[:1] != b"{" or data[-1:] != b"}":
        stripped = data.strip()
        if not stripped.startswith(b"{"):
            return NOT_COUNTED  # "[DONE]", keep-alive text, garbage
        data = stripped
    if data[-1:] == b"}":
        if (b'"metrics"' not in data and data.count(b'"index"') <= 1
                and _usage_is_null(data)):
            for key in _TEXT_KEYS if text_route else _CHAT_KEYS:
                at = data.find(key)
                if at >= 0 and data[at + len(key) : at + len(key) + 1] not in (b'"', b""):
                    return ONE_OUTPUT
        hits = (_TEXT_SCAN if text_route else _CHAT_SCAN).findall(data)
        if len(hits) == 2:
            a, b = hits
            hit = b if a == _INDEX else a if b == _INDEX else b""
        else:
            hit = hits[0] if len(hits) == 1 else b""
        if hit[1:2] and hit[1] in _OUTPUT_INITIALS:
            return ONE_OUTPUT
        # No output value, no usage object, no metrics: unless a tool call or a function
        # call hides in it, a role-only, empty or finish event.
        if ((not hits or (len(hits) == 1 and hits[0] == _INDEX))
                and b'"tool_calls"' not in data and b'"function_call"' not in data):
            return NOT_COUNTED
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):
        return NOT_COUNTED
    return inspect_payload(payload, text_route=text_route)


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @classmethod
    def from_mapping(cls, usage: Mapping[str, Any] | None) -> Usage:
        if not usage:
            return cls()
        details = usage.get("prompt_tokens_details")
        cached = _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
        return cls(
            _int_or_none(usage.get("prompt_tokens")),
            cached,
            _int_or_none(usage.get("completion_tokens")),
        )


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Everything measured about one request, in seconds and tokens."""

    request_id: str
    route: str
    model: str
    upstream: str
    stream: bool
    status: int
    outcome: Outcome
    duration_s: float
    overhead_s: float | None = None
    queue_s: float | None = None
    upstream_queue_s: float | None = None
    ttft_s: float | None = None
    ttfa_s: float | None = None  # time to first answer (non-reasoning) token
    ttfb_s: float | None = None  # time to first body byte handed on
    tpot_s: float | None = None
    itl_s: tuple[float, ...] = ()
    output_events: int = 0
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_write_tokens: int | None = None
    tokens_estimated: bool = False

    def as_log(self) -> dict[str, Any]:
        """Flat dict for the per-request JSON log (no keys, no prompt text exist here)."""
        itl = self.itl_s
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "route": self.route,
            "model": self.model,
            "upstream": self.upstream,
            "stream": self.stream,
            "status": self.status,
            "outcome": str(self.outcome),
            "duration_s": self.duration_s,
            "overhead_s": self.overhead_s,
            "queue_s": self.queue_s,
            "upstream_queue_s": self.upstream_queue_s,
            "ttfb_s": self.ttfb_s,
            "ttft_s": self.ttft_s,
            "ttfa_s": self.ttfa_s,
            "tpot_s": self.tpot_s,
            "itl_count": len(itl),
            "itl_mean_s": (sum(itl) / len(itl)) if itl else None,
            "itl_max_s": max(itl) if itl else None,
            "output_events": self.output_events,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "tokens_estimated": self.tokens_estimated,
        }
        return out


@dataclass(slots=True)
class StreamTimer:
    """Accumulates event times for one streamed response.

    ``event(data, t)`` is called for every SSE event right after its bytes were handed
    on, with ``t`` read once for the read that carried it.
    """

    text_route: bool
    first_t: float | None = None
    last_t: float | None = None
    output_events: int = 0
    output_choices: int = 0
    gaps: list[float] = field(default_factory=list)
    usage: Mapping[str, Any] | None = None
    upstream_queue_s: float | None = None

    def event(self, data: bytes, t: float) -> EventInfo:
        info = inspect_event(data, text_route=self.text_route)
        if info is not NOT_COUNTED:
            self.observe(info, t)
        return info

    def token(self, t: float) -> None:
        """``observe(ONE_OUTPUT, t)``, for the common event, without looking at it."""
        last = self.last_t
        if last is None:
            self.first_t = t
        else:
            self.gaps.append(t - last)
        self.last_t = t
        self.output_events += 1
        self.output_choices += 1

    def observe(self, info: EventInfo, t: float) -> None:
        if info.outputs:
            if self.last_t is None:
                self.first_t = t
            else:
                self.gaps.append(t - self.last_t)
            self.last_t = t
            self.output_events += 1
            self.output_choices += info.outputs
        if info.usage is not None:
            self.usage = info.usage
        if info.upstream_queue_s is not None:
            self.upstream_queue_s = info.upstream_queue_s


def tpot(first_t: float | None, last_t: float | None, completion_tokens: int | None) -> float | None:
    if first_t is None or last_t is None or completion_tokens is None or completion_tokens < 2:
        return None
    return (last_t - first_t) / (completion_tokens - 1)


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int | None:
    """Rough prompt size (about 4 characters a token) when the upstream gave no usage."""
    chars = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(len(p) for p in prompt if isinstance(p, str))
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
    if chars == 0 and prompt is None and messages is None:
        return None
    return max(1, round(chars / 4))


# The bytes of a JSON string's body with no quote, no line break, not ending in a backslash.
_PLAIN_TEXT = re.compile(rb'[^"\r\n]*[^"\r\n\\]').fullmatch


class TokenTemplate:
    """The shape of one stream's token events, learned once, matched with two compares.

    Servers write every token event of a stream the same way; only the token text
    changes: ``data: {"id":"x",...,"delta":{"content":"<TEXT>"},...}\n\n``. From the first
    event that the full path classified as one output, this keeps what comes before
    ``<TEXT>`` and what comes after it. A later chunk that starts and ends with exactly
    those bytes, and whose middle holds no quote, no line break and no trailing
    backslash, is the same JSON with another non-empty string in the same place: one
    event, one output. That costs two byte compares instead of a parse and a scan per
    event (measurement was a third of the proxy's CPU per event before it,
    ``benchmarks/profile.md``).

    Events that do not match (another key, a varying field such as OpenAI's
    ``obfuscation``, escaped quotes) take the full path, so the template can only make
    measurement cheaper, never different; after 8 misses in a row it is learned again
    (a reasoning model moving from ``reasoning_content`` to ``content``). A property
    test checks the template path against the full one on generated streams.
    """

    __slots__ = ("_head", "_misses", "_tail", "_width", "keys")

    def __init__(self, text_route: bool) -> None:
        self.keys = (b'"text":"',) if text_route else (
            b'"content":"', b'"reasoning_content":"', b'"reasoning":"', b'"refusal":"')
        self._head = b""  # empty: nothing learned
        self._tail = b""
        self._width = 0
        self._misses = 0

    def match(self, chunk: bytes) -> bool:
        head = self._head
        if not head:
            return False
        if (len(chunk) > self._width and chunk.startswith(head) and chunk.endswith(self._tail)
                and _PLAIN_TEXT(chunk, len(head), len(chunk) - len(self._tail))):
            self._misses = 0
            return True
        self._misses += 1
        if self._misses >= 8:
            self._head = b""
        return False

    def learn(self, chunk: bytes) -> None:
        """``chunk`` is one whole ``data:`` event the full path found to be one output."""
        if self._head:
            return
        for key in self.keys:
            at = chunk.find(key)
            if at >= 0:
                break
        else:
            return
        start = at + len(key)
        end = chunk.find(b'"', start)
        if (end <= start or chunk.find(key, start) >= 0 or b"\\" in chunk[start:end]
                or not chunk.startswith(b"data:") or not chunk.endswith(b"\n\n")):
            return
        self._head, self._tail = chunk[:start], chunk[end:]
        self._width = len(self._head) + len(self._tail)
        self._misses = 0




class Meter:
    """One stream's measurement: the SSE parser, the event classification, the timer.

    :meth:`chunk` is called with each read right after its bytes were handed on, with
    the time read once for it. The common event takes the cheapest path that is sure of
    it: a token-template match (two byte compares), then one whole single-line event
    (:meth:`SSEParser.single`), else the general parser.
    """

    __slots__ = ("parser", "template", "text_route", "timer")

    def __init__(self, timer: StreamTimer, parser: SSEParser) -> None:
        self.timer = timer
        self.parser = parser
        self.text_route = timer.text_route
        self.template = TokenTemplate(timer.text_route)

    def chunk(self, chunk: bytes, t: float) -> None:
        parser, timer, template = self.parser, self.timer, self.template
        if template.match(chunk) and parser.skip(len(chunk)):
            timer.token(t)
            return
        data = parser.single(chunk)
        if data is not None:
            self.single(chunk, data, t)
            return
        for event in parser.feed(chunk):
            if not event.oversize:
                timer.event(event.data, t)

    def single(self, chunk: bytes, data: bytes, t: float) -> None:
        """``chunk`` was one event with this data: classify it in full, and learn the
        stream's token template from it if it was a token."""
        if self.timer.event(data, t) is ONE_OUTPUT:
            self.template.learn(chunk)
