"""Measurement: timed events in, one frozen per-request record out.

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

from proxy.dialects import (
    ANSWER,
    NOT_COUNTED,
    REASONING,
    Dialect,
    EventInfo,
    ResponseInfo,
    TokenTemplate,
    merge_usage,
)
from proxy.doctor.report import TokenRules, token_counts
from proxy.wire.http11 import DECODABLE, DECODE_PIECE

if TYPE_CHECKING:
    from proxy.sse import SSEParser

class Outcome(StrEnum):
    """How a request ended, named for what happened and whose side it happened on.

    :data:`OUTCOME_MEANINGS` says what happened and what the client saw for each. Earlier
    versions counted ``upstream_timeout`` and ``pool_timeout`` as one value, ``timeout``, and
    ``upstream_unreachable``, ``upstream_4xx`` and ``upstream_5xx`` as
    ``upstream_error``; the shipped rules select the old names too, so that a fleet
    running both versions during a rollout is still counted whole.
    """

    COMPLETED = "completed"
    CLIENT_DISCONNECTED = "client_disconnected"  # the client closed before the last event
    CLIENT_STALLED = "client_stalled"  # the client took no bytes for --client-write-timeout
    # the upstream connection closed or reset before the answer was complete
    UPSTREAM_INTERRUPTED = "upstream_interrupted"
    # no headers, or no more bytes, within --read-timeout; or the request not taken
    # within --write-timeout
    UPSTREAM_TIMEOUT = "upstream_timeout"
    POOL_TIMEOUT = "pool_timeout"  # no upstream connection became free within --connect-timeout
    UPSTREAM_UNREACHABLE = "upstream_unreachable"  # connect refused, DNS, TLS, CONNECT refused
    UPSTREAM_4XX = "upstream_4xx"  # the upstream answered 4xx (relayed unchanged)
    UPSTREAM_5XX = "upstream_5xx"  # the upstream answered 5xx (relayed unchanged)
    # an error event inside a 200 stream, invalid HTTP from the upstream, or another
    # failed answer (a non-2xx status that is neither 4xx nor 5xx; no upstream answered
    # the merged model list)
    UPSTREAM_ERROR = "upstream_error"
    # the proxy itself cut the request short: it was shutting down and the request was
    # still running after --graceful-timeout (the server cancels it)
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # answered by the proxy itself (413, 429, 404, ...)


class OutcomeMeaning(NamedTuple):
    """What an outcome says, for people: read by the documentation, never per request."""

    what_happened: str
    client_saw: str  # the HTTP status and body the client received


# What each outcome means, written once: the documentation's outcome table is generated
# from it (docs/generate.py), and tests/test_docs.py fails when an outcome has no entry.
# Plain text: flags and 'quoted' error codes are set as code by the generator.
OUTCOME_MEANINGS: dict[Outcome, OutcomeMeaning] = {
    Outcome.COMPLETED: OutcomeMeaning(
        "the stream's last event (or the whole body) reached the client",
        "the upstream's 2xx"),
    Outcome.CLIENT_DISCONNECTED: OutcomeMeaning(
        "the client closed before the last event (and after no error event: a client that "
        "leaves at one, as both official SDKs do, is 'upstream_error')",
        "the upstream's status if it was sent, else none (logged 499)"),
    Outcome.CLIENT_STALLED: OutcomeMeaning(
        "the client stopped reading: nothing could be written to it for "
        "--client-write-timeout; the proxy closed the client and the upstream connection",
        "the upstream's status, then the stream breaks"),
    Outcome.UPSTREAM_INTERRUPTED: OutcomeMeaning(
        "the upstream connection closed or reset before the answer was complete (mid-body, "
        "or before any header); or a stream's body ended well but before its last event "
        "('[DONE]', 'response.completed', 'message_stop') with no finish reason either (a "
        "finish reason without '[DONE]' is 'completed': some servers omit the marker)",
        "mid-body: the upstream's status, then the stream breaks; before headers: 502 "
        "'upstream_failed'"),
    Outcome.UPSTREAM_TIMEOUT: OutcomeMeaning(
        "no headers, or no more body bytes, within --read-timeout; or the request not taken "
        "within --write-timeout",
        "before headers: 504 'upstream_timeout'; mid-body: the upstream's status, then the "
        "stream breaks"),
    Outcome.POOL_TIMEOUT: OutcomeMeaning(
        "no upstream connection became free within --connect-timeout "
        "(--max-upstream-connections); nothing was sent",
        "504 'upstream_pool_timeout'"),
    Outcome.UPSTREAM_UNREACHABLE: OutcomeMeaning(
        "connecting failed: refused, DNS, TLS, an HTTP proxy that refused CONNECT, or "
        "--connect-timeout",
        "502 'upstream_unreachable'"),
    Outcome.UPSTREAM_4XX: OutcomeMeaning(
        "the upstream answered 4xx", "the upstream's 4xx, body unchanged"),
    Outcome.UPSTREAM_5XX: OutcomeMeaning(
        "the upstream answered 5xx", "the upstream's 5xx, body unchanged"),
    Outcome.UPSTREAM_ERROR: OutcomeMeaning(
        "an error event inside a 200 stream (chat's 'data: {\"error\": ...}', Responses "
        "'error' / 'response.failed', Messages 'event: error'), whether or not the client "
        "stays for the rest; invalid HTTP from the upstream (a status past 599 included); a "
        "1xx or 3xx answer; no upstream answered the merged 'GET /v1/models'",
        "200 with the error event; the 1xx or 3xx as the upstream sent it; else 502 "
        "'upstream_failed'"),
    Outcome.CANCELLED: OutcomeMeaning(
        "the proxy was shutting down and the request still ran after --graceful-timeout",
        "503 proxy_shutting_down if nothing was sent yet, else the stream breaks"),
    Outcome.REJECTED: OutcomeMeaning(
        "the proxy answered itself (400, 401, 404, 408, 413, 429, 431); never in "
        "'llm_proxy_stream_outcomes_total'",
        "that status"),
}


class PrefixRecord(NamedTuple):
    """What the prompt-cache doctor (:mod:`proxy.doctor`) found for one request, kept
    here with the record it is part of: sizes, positions and bounded names, never text;
    its token figures at the request's usage from :meth:`tokens`. A NamedTuple rather
    than a frozen dataclass: one is made per request, and a frozen dataclass sets each
    field through ``object.__setattr__``, which costs more (``docs/design/doctor.md``)."""

    prompt_bytes: int  # the prompt's parts, as the doctor reads them
    repeated_bytes: int  # the leading bytes a recent request sent within the window
    break_reason: str = ""  # why the prefix stopped repeating; "" where it did not break
    break_part: str = ""  # the part's kind where it broke ("" for the scope's reasons)
    break_index: int | None = None  # the part's position in its array in the body
    break_offset: int | None = None  # byte offset in that part of the block where it broke
    break_role: str = ""  # that part's role ("system", "user"; "" where it has none)
    break_part_bytes: int | None = None  # that part's size
    changed_bytes: int | None = None  # variable_before_stable: the changed run, block-rounded
    stable_bytes: int | None = None  # variable_before_stable: the bytes after it seen before
    # Why the request was not examined (proxy.doctor.job.UNCHECKED_REASONS); "" when it
    # was. When set, the other fields hold nothing (see not_examined).
    unchecked: str = ""
    index_s: float | None = None  # the shared index's round trip; None in process
    # How the request's usage gives the token figures (tokens); None where nothing was
    # examined. Kept rather than the figures: the finish, which has the usage, runs cold,
    # and whoever reads them (a batch of metrics, a log line) works them out.
    rules: TokenRules | None = None

    def tokens(
        self, prompt_tokens: int | None, cached_tokens: int | None
    ) -> tuple[int | None, int | None, int | None]:
        """(repeated, missed, unmarked) tokens at the request's usage: ``prompt_tokens``
        (the upstream's, or the proxy's estimate) and ``cached_tokens`` as reported
        (None: not reported). Repeated: the repeated bytes at the request's tokens per
        byte; missed: repeated (cacheable) but not reported cached; unmarked: of the
        missed, those past the last cache breakpoint on a request whose provider caches
        only marked prefixes (Anthropic's cache_control, OpenAI's explicit mode), which
        no cache was asked to serve (None where every repeated prefix may be cached).
        Each None where unknown (:func:`proxy.doctor.report.token_counts`)."""
        if self.rules is None:
            return None, None, None
        return token_counts(self.rules, prompt_tokens, cached_tokens)

    @property
    def repeated_share(self) -> float:
        """Repeated bytes over prompt bytes (0 for an empty prompt)."""
        return self.repeated_bytes / self.prompt_bytes if self.prompt_bytes else 0.0

    @classmethod
    def not_examined(cls, reason: str, index_s: float | None = None) -> PrefixRecord:
        """The record of a request the doctor did not examine: only why (and how long a
        failed exchange with the shared index took); every reader checks ``unchecked``
        first."""
        return cls(0, 0, unchecked=reason, index_s=index_s)


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
    client: str = ""  # the bounded client label value, when --client-label-from is set
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
    # The upstream's own account (proxy.dialects.UpstreamReport): the engine's cached
    # prompt tokens and prefill time (llama.cpp's timings), the provider's cache
    # diagnostics (its reason, bounded, and the tokens it says it missed)
    engine_cached_tokens: int | None = None
    engine_prefill_s: float | None = None
    provider_cache_reason: str = ""
    provider_missed_tokens: int | None = None
    trace_id: str = ""  # hex, when the request was traced and sampled (proxy.tracing)
    span_id: str = ""
    # What the upstream said about its answer (proxy.dialects.ResponseInfo), for the
    # trace: never a metric label (ids are unbounded).
    response_id: str = ""
    response_model: str = ""
    finish_reasons: tuple[str, ...] = ()  # in choice order, as the API words them
    prefix: PrefixRecord | None = None  # the prompt-cache doctor's finding, when it looked

    def as_log(self) -> dict[str, Any]:
        """Flat dict for the per-request JSON log (no keys, no prompt text exist here)."""
        itl = self.itl_s
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "route": self.route,
            "model": self.model,
            "upstream": self.upstream,
            "client": self.client or None,
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
            "engine_cached_tokens": self.engine_cached_tokens,
            "engine_prefill_s": self.engine_prefill_s,
            "provider_cache_reason": self.provider_cache_reason or None,
            "provider_missed_tokens": self.provider_missed_tokens,
            "trace_id": self.trace_id or None,
            "span_id": self.span_id or None,
            "response_id": self.response_id or None,
            "response_model": self.response_model or None,
            "finish_reasons": list(self.finish_reasons),
        }
        p = self.prefix
        out["prefix_unchecked"] = (p.unchecked or None) if p else None
        if p is not None and p.unchecked:
            p = None  # not examined: no finding
        repeated, missed, unmarked = (
            p.tokens(self.prompt_tokens, self.cached_prompt_tokens) if p else (None, None, None))
        out.update({
            "prompt_bytes": p.prompt_bytes if p else None,
            "repeated_prefix_bytes": p.repeated_bytes if p else None,
            "repeated_prefix_tokens": repeated,
            "cache_missed_tokens": missed,
            "cache_missed_unmarked_tokens": unmarked,
            "prefix_break": (p.break_reason or None) if p else None,
            "prefix_break_part": (p.break_part or None) if p else None,
            "prefix_break_index": p.break_index if p else None,
            "prefix_break_role": (p.break_role or None) if p else None,
            "prefix_break_offset": p.break_offset if p else None,
        })
        return out


@dataclass(slots=True)
class StreamTimer:
    """Accumulates event times for one streamed response.

    ``observe(info, t)`` is called for every classified event right after its bytes were
    handed on, with ``t`` read once for the read that carried it. ``on_first`` is called
    once, with ``first_t``, when the first output event is seen (the prompt-cache doctor
    learns there that the upstream's prefill of this prompt was done); it must not raise.
    """

    dialect: Dialect
    on_first: Callable[[float], None] | None = None
    first_t: float | None = None
    first_answer_t: float | None = None
    last_t: float | None = None
    output_events: int = 0
    output_choices: int = 0
    gaps: list[float] = field(default_factory=list)
    usage: dict[str, Any] | None = None  # the raw usage, merged over events (last value wins)
    report: dict[str, Any] | None = None  # the upstream's own account (dialects.report_of)
    upstream_queue_s: float | None = None
    error: bool = False  # an error event inside the 200 stream
    ended_t: float | None = None  # when the stream's own last event was handed on
    first_byte_t: float | None = None  # when the response's first body bytes were handed on
    response_id: str = ""  # from the events that say it (last non-empty value wins)
    response_model: str = ""
    finish: dict[int, str] | None = None  # choice index -> finish reason
    last_output: bytes = b""  # data of the last output event classified (not templated)

    def event(self, name: bytes, data: bytes, t: float) -> EventInfo:
        info = self.dialect.classify(name, data)
        if info is ANSWER or info is REASONING:  # the common token event: nothing else in it
            self.token(t, info is ANSWER)
            self.last_output = data
        elif info is not NOT_COUNTED:
            self.observe(info, t)
            if info.outputs:
                self.last_output = data
        return info

    def token(self, t: float, answer: bool) -> None:
        """``observe`` for the common event (one output, nothing else), without looking at it."""
        last = self.last_t
        if last is None:
            self.first_t = t
            if self.on_first is not None:
                self.on_first(t)
        else:
            self.gaps.append(t - last)
        if answer and self.first_answer_t is None:
            self.first_answer_t = t
        self.last_t = t
        self.output_events += 1
        self.output_choices += 1

    def observe(self, info: EventInfo, t: float) -> None:
        if info.outputs:
            if self.last_t is None:
                self.first_t = t
                if self.on_first is not None:
                    self.on_first(t)
            else:
                self.gaps.append(t - self.last_t)
            if info.answer and self.first_answer_t is None:
                self.first_answer_t = t
            self.last_t = t
            self.output_events += 1
            self.output_choices += info.outputs
        if info.usage is not None:
            self.usage = merge_usage(self.usage, info.usage)
        if info.report is not None:
            self.report = merge_usage(self.report, info.report)
        if info.upstream_queue_s is not None:
            self.upstream_queue_s = info.upstream_queue_s
        if info.error:
            self.error = True
        if info.end:
            self.ended_t = t
        if info.response is not None:
            self._merge_response(info.response)

    def _merge_response(self, response: ResponseInfo) -> None:
        if response.id:
            self.response_id = response.id
        if response.model:
            self.response_model = response.model
        if response.finish:
            if self.finish is None:
                self.finish = {}
            self.finish.update(response.finish)

    def response(self) -> ResponseInfo:
        """What the stream said about its answer. When no event said why it ended, the
        last output event is decoded once, here: some servers (vLLM) put the finish
        reason on the last token's event, which the per-event byte checks read without
        decoding (:meth:`Dialect.output_response`)."""
        if not self.finish and self.last_output:
            tail = self.dialect.output_response(self.last_output)
            if tail is not None:
                if not self.response_id:
                    self.response_id = tail.id
                if not self.response_model:
                    self.response_model = tail.model
                if tail.finish:
                    self.finish = dict(tail.finish)
            self.last_output = b""  # read once
        finish = tuple(sorted(self.finish.items())) if self.finish else ()
        return ResponseInfo(self.response_id, self.response_model, finish)


def tpot(first_t: float | None, last_t: float | None, completion_tokens: int | None) -> float | None:
    if first_t is None or last_t is None or completion_tokens is None or completion_tokens < 2:
        return None
    return (last_t - first_t) / (completion_tokens - 1)


CHARS_PER_TOKEN = 4  # the proxy's estimate of text, where no usage counts it


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int | None:
    """Rough prompt size (about :data:`CHARS_PER_TOKEN` characters a token) when the
    upstream gave no usage."""
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
    return max(1, round(chars / CHARS_PER_TOKEN))


class Meter:
    """One stream's measurement: the SSE parser, the dialect's classification, the timer.

    :meth:`chunk` is called with each read right after its bytes were handed on, with
    the time read once for it. The common event takes the cheapest path that is sure of
    it: the stream's token template (two byte compares, :class:`TokenTemplate`), then
    one whole event (:meth:`SSEParser.single`), else the general parser.
    """

    __slots__ = ("parser", "template", "timer")

    def __init__(self, timer: StreamTimer, parser: SSEParser) -> None:
        self.timer = timer
        self.parser = parser
        self.template = TokenTemplate(timer.dialect.token_keys)

    def chunk(self, chunk: bytes, t: float) -> None:
        parser, timer = self.parser, self.timer
        known = self.template.match(chunk)
        if known is not None and parser.skip(len(chunk)):
            timer.token(t, known.answer)
            return
        one = parser.single(chunk)
        if one is not None:
            self.single(chunk, one[0], one[1], t)
            return
        for event in parser.feed(chunk):
            if not event.oversize:
                timer.event(event.event, event.data, t)

    def single(self, chunk: bytes, name: bytes, data: bytes, t: float) -> None:
        """``chunk`` was one event: classify it in full, and learn the stream's token
        template from it if it was a token."""
        info = self.timer.event(name, data, t)
        if info.outputs == 1 and info.usage is None and not info.error:
            self.template.learn(chunk, info)


# Content codings the proxy undoes to measure a stream that an upstream compressed
# although asked for identity, the transfer codings it undoes (zlib reads gzip's and
# zlib's headers both); the bytes the client gets stay as sent. A decoded read is
# measured a piece of at most DECODE_PIECE at a time, as a transfer coding's.
DECODABLE_CODINGS = frozenset(coding.decode("latin-1") for coding in DECODABLE)
_ANY_HEADER = 32 + zlib.MAX_WBITS


class DecodedMeter(Meter):
    """A :class:`Meter` of a stream its upstream compressed (``Content-Encoding: gzip`` or
    ``deflate``) though the proxy asked for ``identity``: each read is decoded, a copy,
    and measured as it decodes (several gzip members one after the other, too). A body
    that does not decode is measured no further."""

    __slots__ = ("_decoder",)

    def __init__(self, timer: StreamTimer, parser: SSEParser) -> None:
        super().__init__(timer, parser)
        self._decoder: Any = zlib.decompressobj(_ANY_HEADER)

    def chunk(self, chunk: bytes, t: float) -> None:
        data = chunk
        while data and self._decoder is not None:
            decoder = self._decoder
            try:
                out = decoder.decompress(data, DECODE_PIECE)
            except zlib.error:  # not what it says it is: the rest goes unmeasured
                self._decoder = None
                return
            if out:
                super().chunk(out, t)
            data = decoder.unconsumed_tail
            if not data and decoder.eof and decoder.unused_data:  # the next gzip member
                data = decoder.unused_data
                self._decoder = zlib.decompressobj(_ANY_HEADER)
