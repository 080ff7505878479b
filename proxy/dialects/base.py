"""What every dialect shares: the readings (:class:`EventInfo`, :class:`ResponseInfo`,
:class:`Usage`), the :class:`Dialect` protocol each API's module implements, a
non-stream answer read whole (:func:`read_answer`), and the helpers the readings are
made of: usage merged across events (:func:`merge_usage`), vLLM's per-request queue
time (:func:`upstream_queue_seconds`), and bounded text.

Pure functions of their input, like every dialect (see :mod:`proxy.dialects`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from proxy.dialects.prompt import Prompt, PromptPart


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
    # what the upstream says about its own work beside the usage (:func:`read_report`):
    # llama.cpp's ``timings``, Anthropic's ``diagnostics``, OpenAI Responses'
    # ``prompt_cache_diagnostics``, each under its own key
    report: Mapping[str, Any] | None = None


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

# The keys of a response (or of a chunk, or of the message/response object of an event)
# that carry the upstream's own account, read as they are (:func:`read_report`).
REPORT_KEYS = ("timings", "diagnostics", "prompt_cache_diagnostics")


@dataclass(frozen=True, slots=True)
class UpstreamReport:
    """What the upstream said about its own work, normalised (None: not said).

    * llama.cpp's server (``timings`` on the last chunk of a chat or completions stream,
      and in a non-stream body): ``cache_n`` is ``cached_tokens``, ``prompt_n`` the
      prompt tokens it computed (``computed_tokens``), ``prompt_ms`` its prefill time;
    * Anthropic's cache diagnostics (``diagnostics.cache_miss_reason`` with ``type`` and
      ``cache_missed_input_tokens``) and OpenAI Responses' ``prompt_cache_diagnostics``
      (``type``; a ``cache_miss`` has ``reason`` and ``cache_missed_tokens``): the
      provider's reason as it words it and the tokens it says it missed. They come only
      when the app asked for them; the proxy never asks.
    """

    cached_tokens: int | None = None
    computed_tokens: int | None = None
    prefill_s: float | None = None
    cache_reason: str = ""  # the provider's own word, bounded (proxy.doctor.provider)
    cache_missed_tokens: int | None = None


NO_REPORT = UpstreamReport()


def _ms_value(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
            and value >= 0:
        return float(value)
    return None


def report_of(holder: Any) -> dict[str, Any] | None:
    """The :data:`REPORT_KEYS` mappings of ``holder`` (a chunk, a body, a message), or None."""
    if not isinstance(holder, Mapping):
        return None
    out = {key: holder[key] for key in REPORT_KEYS if isinstance(holder.get(key), Mapping)}
    return out or None


def read_report(raw: Mapping[str, Any] | None) -> UpstreamReport:
    """Normalise what :func:`report_of` found (merged across events, last value wins)."""
    if not raw:
        return NO_REPORT
    from proxy.doctor.provider import provider_reason

    timings = _mapping(raw, "timings")
    prompt_ms = _ms_value(timings.get("prompt_ms"))
    computed = _count(timings.get("prompt_n"))
    reason, missed = provider_reason(_mapping(raw, "diagnostics"),
                                     _mapping(raw, "prompt_cache_diagnostics"))
    return UpstreamReport(
        cached_tokens=_count(timings.get("cache_n")),
        computed_tokens=computed,
        prefill_s=prompt_ms / 1000.0 if prompt_ms is not None else None,
        cache_reason=reason, cache_missed_tokens=missed)


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _mapping(holder: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = holder.get(key)
    return value if isinstance(value, Mapping) else _EMPTY


def _openai_usage(raw: Mapping[str, Any] | None, inputs: str, outputs: str) -> Usage:
    """A usage block as OpenAI's APIs shape it: ``{inputs}_tokens`` with its
    ``{inputs}_tokens_details`` (cached and cache-write tokens), ``{outputs}_tokens`` with
    its ``{outputs}_tokens_details`` (reasoning tokens). Chat and completions name them
    prompt / completion, Responses input / output."""
    if not isinstance(raw, Mapping):
        return _NO_USAGE
    prompt = _mapping(raw, f"{inputs}_tokens_details")
    completion = _mapping(raw, f"{outputs}_tokens_details")
    return Usage(
        _count(raw.get(f"{inputs}_tokens")),
        _count(prompt.get("cached_tokens")),
        _count(raw.get(f"{outputs}_tokens")),
        _count(completion.get("reasoning_tokens")),
        _count(prompt.get("cache_write_tokens")),
    )


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


def _single_response(holder: Any, reason: Any) -> ResponseInfo | None:
    """id and model of ``holder``, and ``reason`` as the one finish reason."""
    if not isinstance(holder, Mapping):
        return None
    finish = ((0, reason[:_REASON_MAX]),) if isinstance(reason, str) and reason else ()
    info = ResponseInfo(_text(holder.get("id")), _text(holder.get("model")), finish)
    return info if info != NO_RESPONSE else None


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
        (see :mod:`proxy.dialects.prompt`); never raises."""
        ...

    def prompt(self, payload: Mapping[str, Any]) -> Prompt:
        """The same parts, with the cache breakpoints the request marks, read while the
        parts are built (for the doctor's split of missed tokens); never raises."""
        ...


class AnswerInfo(NamedTuple):
    """What a non-stream answer's JSON body says, as far as measurement cares."""

    usage: Mapping[str, Any] | None  # the raw usage mapping, for Dialect.usage
    upstream_queue_s: float | None  # vLLM ``metrics.queue_time_ms``, in seconds
    response: ResponseInfo  # id, model, finish reasons
    report: Mapping[str, Any] | None = None  # the upstream's own account (report_of)


def read_answer(dialect: Dialect, body: bytes) -> AnswerInfo | None:
    """A non-stream answer's body as ``dialect`` reads it: its usage, queue time and
    response info; None when the body is not a JSON object."""
    payload = _loads(body)
    if not isinstance(payload, dict):
        return None
    return AnswerInfo(dialect.body_usage(payload), upstream_queue_seconds(payload),
                      dialect.body_response(payload), report_of(payload))


_TYPE_PREFIX = b'{"type":"'
