"""The request path's state: one frozen record per stage, and the record made of them.

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from proxy.dialects import NO_RESPONSE, Dialect, Usage, read_answer, read_report
from proxy.measure import Meter, Outcome, RequestRecord, estimate_prompt_tokens, tpot
from proxy.metrics import UNKNOWN_MODEL
from proxy.wire.errors import ConnectError, PoolTimeout, ReadError, UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from proxy.doctor.job import PrefixJob
    from proxy.relay import RelayResult
    from proxy.tracing import RequestSpan
    from proxy.upstream import LiveUpstream
    from proxy.wire.response import WireResponse


class Arrival(NamedTuple):
    """What the request line says, before any check (``V1Handler._arrive``)."""

    subpath: bytes
    route: str  # the route's label value
    dialect: Dialect | None  # the dialect of a measured route
    span: RequestSpan | None  # the request's span, when tracing is on


# A request refused for its path: nothing is known of it but that.
UNROUTED = Arrival(b"", "/v1/{other}", None, None)


class Asked(NamedTuple):
    """What the body asks for (``V1Handler._parse``). A request with one of these was read
    and parsed: it is measured from here on."""

    model: str  # the bounded label value
    request_model: str  # the body's "model" as sent ("" when none): routing, span, workload
    stream: bool  # a measured route's body asked for a stream
    payload: dict[str, Any] | None  # the body as a JSON object; None: not one
    body: bytes  # the body to send upstream
    strip_usage: bool  # the proxy added the usage request to ``body``


class Admitted(NamedTuple):
    """The request got its upstream slot and was sent, or failed to be (``_forward``)."""

    queue_s: float | None  # the wait for a slot; None off the measured routes
    # the proxy's own time from arrival until the request was written (a new connection's
    # set-up included), the wait excluded; None when it was never sent (the client left,
    # or the server shut down, while it waited for its slot)
    overhead_s: float | None


class Answered(NamedTuple):
    """The upstream's answer, as its headers came (``V1Handler._forward``)."""

    response: WireResponse  # status, headers, and the body on the connection it came on
    request_id: str  # the upstream's x-request-id, else the proxy's own
    headers: list[tuple[bytes, bytes]]  # the response headers as the client gets them
    event_stream: bool  # ``text/event-stream``: relayed as it comes
    strip_usage: bool  # remove the usage event the proxy asked for
    collect_limit: int  # bytes of a non-stream answer kept for its usage; 0: none
    meter: Meter | None  # an observed stream's meter: mutable while it streams
    prefix: PrefixJob | None  # the prompt-cache doctor's look at this prompt


class Ended(NamedTuple):
    """How the request ended, made by the step where it ended."""

    status: int  # as the client saw it (499: it left before any answer)
    outcome: Outcome
    t_end: float
    request_id: str = ""  # "" when no answer carried one: the finish makes one
    reason: str = ""  # why the upstream failed, for the warning line
    result: RelayResult | None = None  # how the relay ended: first byte, a collected body
    upstream: str = ""  # the upstream label when no single upstream took it (model list)


class Stages:
    """One request's stage records, each set once, by :class:`proxy.routes.V1Handler`'s
    step that makes it; None until that step ran (the arrival: :data:`UNROUTED`)."""

    __slots__ = ("admitted", "answered", "arrival", "asked", "ended", "identity", "t0", "target")

    def __init__(self, t0: float) -> None:
        self.t0 = t0  # the request clock's start
        self.arrival = UNROUTED
        self.identity = ""  # who the request says it is, once past the key check (unbounded)
        self.asked: Asked | None = None
        self.target: LiveUpstream | None = None  # the upstream the request was routed to
        self.admitted: Admitted | None = None
        self.answered: Answered | None = None
        self.ended: Ended | None = None


def record_of(
    x: Stages,
    ended: Ended,
    request_id: str,
    client: str,
    *,
    response_info: bool,
    fallback_upstream: str,
) -> RequestRecord:
    """The frozen record of a finished request, read from its stages. ``response_info``:
    read the stream's response id, model and finish reasons; ``fallback_upstream``: the
    upstream label of a request no upstream took."""
    t0, arrival, asked, answered, admitted = x.t0, x.arrival, x.asked, x.answered, x.admitted
    dialect, result = arrival.dialect, ended.result
    meter = answered.meter if answered is not None else None
    timer = meter.timer if meter is not None else None
    raw: Mapping[str, Any] | None = None
    said: Mapping[str, Any] | None = None
    upstream_q = None
    reply = NO_RESPONSE
    if timer is not None:
        raw = timer.usage
        said = timer.report
        upstream_q = timer.upstream_queue_s
        if response_info:
            reply = timer.response()
    elif result is not None and result.body and dialect is not None:
        whole = read_answer(dialect, result.body)  # a non-stream answer
        if whole is not None:
            raw, upstream_q, reply, said = whole
    if upstream_q is None and answered is not None:
        upstream_q = _queue_header(answered.response.headers.get("x-queue-time"))
    usage = dialect.usage(raw) if dialect is not None else Usage()
    report = read_report(said)
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    cached = usage.cached_prompt_tokens
    if cached is None:
        cached = report.cached_tokens  # llama.cpp: its timings say what it reused
    estimated = False
    if prompt is None and report.computed_tokens is not None and report.cached_tokens is not None:
        prompt = report.computed_tokens + report.cached_tokens  # the engine's own count
    if raw is None and ended.outcome is Outcome.COMPLETED and (
            timer is not None or (dialect is not None and 200 <= ended.status < 300)):
        # No usage (--no-inject-usage, or a server that ignores the request for it, or
        # a non-stream answer without it): a stream counts its output events; the prompt
        # is the engine's count where its timings give one, else the proxy's estimate,
        # said as such.
        if timer is not None:
            completion = timer.output_choices
        if prompt is None:
            payload = asked.payload if asked is not None else None
            prompt = estimate_prompt_tokens(payload) if payload is not None else None
            estimated = prompt is not None
    first = timer.first_t if timer is not None else None
    answer = timer.first_answer_t if timer is not None else None
    first_byte = timer.first_byte_t if timer is not None else None  # the relay's, kept
    prefix = answered.prefix if answered is not None else None
    span = arrival.span
    return RequestRecord(
        request_id=request_id,
        route=arrival.route,
        model=asked.model if asked is not None else UNKNOWN_MODEL,
        upstream=(x.target.name if x.target is not None else ended.upstream or fallback_upstream),
        client=client,
        stream=asked is not None and asked.stream,
        status=ended.status,
        outcome=ended.outcome,
        duration_s=ended.t_end - t0,
        overhead_s=admitted.overhead_s if admitted is not None else None,
        queue_s=admitted.queue_s if admitted is not None else None,
        upstream_queue_s=upstream_q,
        ttft_s=(first - t0) if first is not None else None,
        ttfa_s=(answer - t0) if answer is not None else None,
        ttfb_s=(first_byte - t0) if first_byte is not None else None,
        tpot_s=tpot(first, timer.last_t, completion) if timer is not None else None,
        itl_s=tuple(timer.gaps) if timer is not None else (),
        output_events=timer.output_events if timer is not None else 0,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        completion_tokens=completion,
        reasoning_tokens=usage.reasoning_tokens,
        cache_write_tokens=usage.cache_write_tokens,
        tokens_estimated=estimated,
        engine_cached_tokens=report.cached_tokens,
        engine_prefill_s=report.prefill_s,
        provider_cache_reason=report.cache_reason,
        provider_missed_tokens=report.cache_missed_tokens,
        trace_id=span.trace_id if span is not None else "",
        span_id=span.span_id if span is not None else "",
        response_id=reply.id,
        response_model=reply.model,
        finish_reasons=reply.finish_reasons,
        # the doctor's token figures come from prompt and cached (PrefixRecord.tokens):
        # an estimated prompt still gives them, and tokens_estimated says so
        prefix=(prefix.record if prefix is not None else None),
    )


def failure_outcome(exc: UpstreamError) -> Outcome:
    """The outcome of an upstream exchange that failed before the response headers."""
    if isinstance(exc, ConnectError):  # ConnectTimeout included: nothing was sent
        return Outcome.UPSTREAM_UNREACHABLE
    if isinstance(exc, PoolTimeout):
        return Outcome.POOL_TIMEOUT
    if isinstance(exc, UpstreamTimeout):
        return Outcome.UPSTREAM_TIMEOUT
    if isinstance(exc, ReadError):  # closed or reset with the request sent, no answer yet
        return Outcome.UPSTREAM_INTERRUPTED
    return Outcome.UPSTREAM_ERROR  # invalid HTTP


# an "error" key whose value is an object or a string: the one look before a 2xx body
# is parsed for it (record_of parses it again, for its usage)
_ERROR_GIVEN = re.compile(rb'"error"[ \t\n\r]*:[ \t\n\r]*[{"]').search


def error_answer(body: bytes | None) -> bool:
    """Whether a 2xx answer's collected body is an error: an ``error`` object (or a
    non-empty string: ``{"error": "overloaded"}``) without the answer's ``choices`` or
    ``content`` (some servers answer a failure with status 200; a failed Responses
    object holds one beside its empty ``output``)."""
    if not body or _ERROR_GIVEN(body) is None:  # most answers: none, or "error": null
        return False
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return (isinstance(payload, dict) and isinstance(payload.get("error"), dict | str)
            and bool(payload["error"]) and "choices" not in payload and "content" not in payload)


def status_outcome(status: int) -> Outcome:
    """The outcome of an answer the upstream gave with a status other than 2xx."""
    if 400 <= status < 500:
        return Outcome.UPSTREAM_4XX
    if 500 <= status < 600:
        return Outcome.UPSTREAM_5XX
    return Outcome.UPSTREAM_ERROR


def _queue_header(value: str) -> float | None:
    """An ``x-queue-time`` header (ms, as TGI sends it) in seconds."""
    if not value:
        return None
    try:
        seconds = float(value) / 1000.0
    except ValueError:
        return None
    return seconds if seconds >= 0 and math.isfinite(seconds) else None
