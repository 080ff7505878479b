"""Request handling for ``/v1/*``: admission, upstream call, relay, one record.

The proxied routes are a plain ASGI endpoint, not a FastAPI route: per request there
is no routing table walk, no dependency injection and no ``Request``/``Response``
objects, and per chunk nothing but the relay (``benchmarks/profile.md`` has the
measurements that led here).

Flow, one way: request in -> checks (path, sizes, key) -> body -> admission (queue
time) -> upstream -> relay (bytes out, events observed) -> one finish (record ->
metrics, log line, warning, trace span). The finish runs exactly once per request, whatever
happened, refused requests included, so the per-request log has one line per request
and ``llm_proxy_requests_total`` counts every answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from proxy.admission import QueueFull
from proxy.asgi import Receive, Scope, Send
from proxy.auth import CLIENT_KEY_HEADERS, KeyCheck, presented_key
from proxy.bodies import LARGE_BODY, decode_body, meant_as_json, not_an_object
from proxy.clients import Identify
from proxy.config import Settings
from proxy.dialects import (
    DIALECTS,
    DIALECTS_WITHOUT_RESPONSE_INFO,
    NO_RESPONSE,
    Dialect,
    Usage,
    read_answer,
    read_report,
)
from proxy.doctor.job import PrefixJob, prefix_check_from
from proxy.logs import RateLimitedLog
from proxy.measure import (
    Meter,
    Outcome,
    RequestRecord,
    StreamTimer,
    estimate_prompt_tokens,
    tpot,
)
from proxy.metrics import UNKNOWN_MODEL, Metrics
from proxy.model_list import ALL_UPSTREAMS, list_body, merged_models
from proxy.otel_metrics import OtelMetrics
from proxy.relay import RelayResult, relay
from proxy.reqlog import RequestLog
from proxy.routing import LiveUpstreams, route_template
from proxy.sse import SSEParser
from proxy.tracing import RequestSpan, Tracing
from proxy.upstream import (
    LiveUpstream,
    UnsafePath,
    error_body,
    error_response,
    forward_headers,
    response_headers,
    safe_subpath,
)
from proxy.wire.errors import ConnectError, PoolTimeout, ReadError, UpstreamError, UpstreamTimeout
from proxy.wire.response import WireResponse
from proxy.workload_capture import WorkloadCapture

log = logging.getLogger("proxy")

Clock = Callable[[], float]

# The measured routes: POST to one of these is observed by its API's dialect.
MEASURED_ROUTES: dict[bytes, Dialect] = {
    d.route.removeprefix("/v1").encode(): d for d in DIALECTS.values()}
MEASURED_ROUTES_WITHOUT_RESPONSE_INFO: dict[bytes, Dialect] = {
    d.route.removeprefix("/v1").encode(): d for d in DIALECTS_WITHOUT_RESPONSE_INFO.values()}
NON_STREAM_USAGE_LIMIT = 8 * 1024 * 1024
JSON_HEADERS = [(b"content-type", b"application/json")]


class Refused(Exception):
    """The proxy refuses the request and answers it itself, in the OpenAI error shape
    (outcome ``rejected``)."""

    outcome = Outcome.REJECTED

    def __init__(self, status: int, message: str, type_: str, code: str, *,
                 extra: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.extra = extra or []

    @property
    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)


class UpstreamFailed(Exception):
    """The upstream exchange failed before the response headers: the client gets the
    status and body :func:`proxy.upstream.error_response` made of the failure, and the
    request the outcome :func:`failure_outcome` names."""

    extra: tuple[tuple[bytes, bytes], ...] = ()

    def __init__(self, status: int, body: bytes, outcome: Outcome) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.outcome = outcome


class BodyTooLarge(Exception):
    pass


class ClientDisconnected(Exception):
    """The client disconnected before its request body was read whole."""


@dataclass(slots=True)
class _Watch:
    """Shared between a request and its disconnect watcher."""

    disconnected: bool = False
    done: bool = False


@dataclass(slots=True)
class _Request:
    """What the steps learn about one request; :meth:`V1Handler._finish` turns it into
    the frozen :class:`RequestRecord`. Every field has the value a refusal at any step
    leaves, so the finish needs no case analysis of where the request stopped."""

    t0: float
    subpath: bytes = b""
    route: str = "/v1/{other}"
    measured: Dialect | None = None  # the dialect of a measured route
    model: str = UNKNOWN_MODEL  # the bounded label value
    stream: bool = False
    payload: dict[str, Any] | None = None
    parsed: bool = False  # the body was read and parsed: a measured request from here on
    status: int = 0
    outcome: Outcome = Outcome.REJECTED
    request_id: str = ""
    queue_s: float | None = None
    overhead_s: float | None = None
    response: WireResponse | None = None
    result: RelayResult | None = None
    timer: StreamTimer | None = None
    t_end: float = 0.0
    reason: str = ""  # why the upstream failed, for the warning line
    request_model: str = ""  # the body's "model" as sent: routing, span, workload
    span: RequestSpan | None = None  # the request's span, when tracing is on
    target: LiveUpstream | None = None  # the upstream the request was routed to
    client: str = ""  # the bounded client label value, when that label is on
    identity: str = ""  # who the request says it is, once past the key check (unbounded)
    upstream: str = ""  # the upstream label when no single target took it (model list)
    prefix: PrefixJob | None = None  # the prompt-cache doctor's look at this prompt


class V1Handler:
    """The ASGI endpoint for every ``/v1/*`` request.

    One request path, as small steps that return or raise: :meth:`_check` (path, sizes,
    key), :meth:`_read` (the body), :meth:`_decode` and :meth:`_parse` (what the body
    asks for),
    :meth:`_admit` (queue time), :meth:`_forward` (the upstream exchange) and
    :meth:`_relay`. A step that refuses raises :class:`Refused`, an upstream exchange
    that fails before its headers :class:`UpstreamFailed`; whatever happened,
    :meth:`_finish` runs once and builds the record, observes the metrics and writes the
    log line, refused requests included.
    """

    def __init__(self, settings: Settings, upstreams: LiveUpstreams, metrics: Metrics | None,
                 clock: Clock, keys: KeyCheck | None, request_log: RequestLog | None,
                 tracing: Tracing | None = None, identify: Identify | None = None,
                 otel_metrics: OtelMetrics | None = None, capture: WorkloadCapture | None = None
                 ) -> None:
        self.settings = settings
        self.capture = capture
        self.tracing = tracing
        self.otel_metrics = otel_metrics
        self.upstreams = upstreams
        self.metrics = metrics
        self.clock = clock
        self.keys = keys
        self.request_log = request_log
        self.model_label: Callable[[str], str] = (
            metrics.model_label if metrics is not None else _unbounded)
        self.identify = identify
        self.client_label: Callable[[str], str] = (
            metrics.client_label if metrics is not None and metrics.client_label is not None
            else _unbounded)
        # A key the proxy does not check is checked by the upstream: only its answer,
        # other than 401 or 403, says the key was right, and a wrong key must not take a
        # label (see _finish and _key_accepted).
        self._upstream_checks_key = keys is None and settings.client_label_from == "key"
        self._secret_headers = frozenset(h.lower().encode() for h in settings.secret_headers)
        # Response id, model and finish reasons are read only for whoever reads them:
        # the trace, OTLP metrics, the request log, and the metrics' finish reasons.
        self.response_info = (tracing is not None or request_log is not None
                              or otel_metrics is not None or metrics is not None)
        self.routes = (MEASURED_ROUTES if self.response_info
                       else MEASURED_ROUTES_WITHOUT_RESPONSE_INFO)
        self._warnings = RateLimitedLog(log, per_interval=10, interval_s=10.0)
        self.prefix = prefix_check_from(settings, wanted=metrics is not None
                                        or request_log is not None or tracing is not None
                                        or capture is not None,
                                        secret=capture.secret if capture is not None else None,
                                        clock=clock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        x = _Request(self.clock())
        try:
            headers = self._check(x, scope)
            body = await self._read(x, receive)
            body_out, strip = self._parse(x, body, await self._decode(x, body))
            if self._union(x, scope):
                await self._models_union(x, scope, headers, send)
                return
            self._route(x, body)
            await self._exchange(x, scope, headers, body_out, strip, receive, send)
            if x.prefix is not None:
                await x.prefix.settle()
        except (Refused, UpstreamFailed) as answer:
            x.status, x.outcome = answer.status, answer.outcome
            x.request_id = uuid.uuid4().hex
            x.t_end = self.clock()
            await _send_error(send, answer, x.request_id)
        except ClientDisconnected:
            x.status, x.outcome, x.t_end = 499, Outcome.CLIENT_DISCONNECTED, self.clock()
        except asyncio.CancelledError:
            # The server cancelled the request (shutdown past --graceful-timeout) before
            # or during its exchange, e.g. while a large body was decoded: cut short.
            x.status, x.outcome = x.status or 503, Outcome.CANCELLED
            x.t_end = x.t_end or self.clock()
            raise
        finally:
            self._finish(x)
        # Recorded first, so a client that saw the end can already scrape the request.
        if x.result is not None and x.result.complete:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        # else: return without completing, so the server closes the connection and the
        # client sees the stream break exactly as the upstream broke it.

    # -- the steps -----------------------------------------------------------------------

    def _check(self, x: _Request, scope: Scope) -> list[tuple[bytes, bytes]]:
        """Cheap checks first: nothing is read and nothing is sent upstream."""
        s = self.settings
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        try:
            subpath = safe_subpath(raw_path.split(b"?", 1)[0])
        except UnsafePath as exc:
            raise Refused(400, str(exc), "invalid_request_error", "invalid_path") from None
        x.measured = self.routes.get(subpath) if scope["method"] == "POST" else None
        x.route = x.measured.route if x.measured is not None else route_template(subpath)
        x.subpath = subpath
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if self.tracing is not None and x.measured is not None:
            x.span = self.tracing.start(headers, x.t0, x.measured.name)
        if sum(len(k) + len(v) for k, v in headers) > s.max_header_bytes:
            raise Refused(431, "request headers too large", "invalid_request_error",
                          "headers_too_large")
        for name, value in headers:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0:
                    raise Refused(400, "invalid Content-Length", "invalid_request_error",
                                  "invalid_content_length")
                if declared > s.max_body_bytes:
                    raise self._too_large()
        if self.keys is not None and not self.keys.accepts(presented_key(headers)):
            raise Refused(401, "invalid or missing API key for this proxy",
                          "invalid_request_error", "invalid_api_key")
        if self.identify is not None:  # only now: a refused request takes no label value
            x.identity = self.identify(headers)
        return headers

    def _too_large(self) -> Refused:
        return Refused(413, f"request body larger than {self.settings.max_body_bytes} bytes",
                       "invalid_request_error", "request_too_large")

    async def _read(self, x: _Request, receive: Receive) -> bytes:
        try:
            async with asyncio.timeout(self.settings.body_timeout):
                return await _read_body(receive, self.settings.max_body_bytes)
        except BodyTooLarge:
            raise self._too_large() from None
        except TimeoutError:
            raise Refused(408, "request body not received in time", "invalid_request_error",
                          "body_timeout") from None

    async def _decode(self, x: _Request, body: bytes) -> tuple[dict[str, Any] | None,
                                                              bytes | None]:
        """The body as a JSON object (None: not one, or not read) and, for a stream whose
        usage the proxy asks for, the body to send instead. A body larger than
        ``LARGE_BODY`` is decoded in a worker thread, in pieces (:mod:`proxy.bodies`),
        with the same result: never a stall of the streams on this loop."""
        looks_like_object = body[:1] == b"{" or body.lstrip()[:1] == b"{"
        if not looks_like_object or (not x.measured and len(body) > 1 << 20):
            return None, None
        inject = (x.measured is not None and x.measured.injects_usage
                  and self.settings.inject_usage and self.metrics is not None)
        if len(body) <= LARGE_BODY:
            return decode_body(body, inject)
        return await asyncio.to_thread(decode_body, body, inject, large=True)

    def _parse(self, x: _Request, body: bytes,
               decoded: tuple[dict[str, Any] | None, bytes | None]) -> tuple[bytes, bool]:
        """What the request asks for: model, stream; the body to send and whether the
        proxy added the usage request. Never raises: a body that is not a JSON object is
        forwarded unchanged and measured under model "unknown"."""
        x.parsed = True
        model = UNKNOWN_MODEL
        body_out, strip = body, False
        x.payload, injected = decoded
        if x.payload is not None:
            m = x.payload.get("model")
            if isinstance(m, str) and m:
                model = x.request_model = m
            x.stream = x.measured is not None and x.payload.get("stream") is True
            if injected is not None:
                body_out, strip = injected, True
        x.model = self.model_label(model)
        return body_out, strip

    def _route(self, x: _Request, body: bytes) -> None:
        """Which upstream takes the request: by the body's model, by the model id of
        ``/v1/models/{id}``, else the default upstream; none is a 404, or a 400 when the
        body meant to name the model is not a JSON object (with a default upstream it
        is forwarded unchanged instead: the upstream answers it as it would directly)."""
        model: str | None = x.request_model or None
        if model is None and x.subpath.startswith(b"/models/"):
            model = unquote(x.subpath[len(b"/models/"):].decode("latin-1")) or None
        x.target = self.upstreams.pick(model, x.route)
        if x.target is None and model is None and x.payload is None and meant_as_json(
                x.measured is not None, body):
            raise Refused(400, f"{not_an_object(body)}, so it names no model to route by "
                          "(and no upstream is the default)", "invalid_request_error",
                          "invalid_json")
        if x.target is None:
            shown = f"model {model[:200]!r}" if model is not None else "a request without a model"
            raise Refused(404, f"{shown} on {x.route} is not served by this proxy: no upstream "
                          "takes it and none is the default", "invalid_request_error",
                          "model_not_found")

    def _union(self, x: _Request, scope: Scope) -> bool:
        return (x.subpath == b"/models" and scope["method"] == "GET"
                and len(self.upstreams.targets) > 1)

    async def _models_union(self, x: _Request, scope: Scope,
                            headers: list[tuple[bytes, bytes]], send: Send) -> None:
        """``GET /v1/models`` with several upstreams: every upstream's list, merged
        (:mod:`proxy.model_list`); a 502 only when no upstream answered."""
        data = await merged_models(
            self.upstreams.targets,
            lambda target: self._upstream_headers(target, headers, identity=False),
            scope.get("query_string", b""), self._warnings)
        x.request_id = uuid.uuid4().hex
        x.t_end = self.clock()
        x.upstream = ALL_UPSTREAMS
        if data is None:
            x.status, x.outcome = 502, Outcome.UPSTREAM_ERROR
            failed = UpstreamFailed(502, error_body("no upstream answered the model list",
                                                    "upstream_error", "upstream_failed"),
                                    Outcome.UPSTREAM_ERROR)
            await _send_error(send, failed, x.request_id)
            return
        body = list_body(data)
        x.status, x.outcome = 200, Outcome.COMPLETED
        await send({"type": "http.response.start", "status": 200, "headers": [
            *JSON_HEADERS, (b"content-length", str(len(body)).encode()),
            (b"x-request-id", x.request_id.encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _exchange(self, x: _Request, scope: Scope, headers: list[tuple[bytes, bytes]],
                        body: bytes, strip: bool, receive: Receive, send: Send) -> None:
        """Admission, the upstream exchange and the relay, with the in-flight gauge held
        and a watcher that turns the client's disconnect into cancellation."""
        target = x.target
        assert target is not None
        target.enter()
        watch = _Watch()
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, task, watch))
        admitted = False
        try:
            if x.measured is not None:
                admitted = await self._admit(x, target)
            await self._forward(x, scope, headers, body)
            await self._relay(x, send, strip)
        except asyncio.CancelledError:
            if not watch.disconnected:
                # The server cancelled the request (shutdown past --graceful-timeout): it
                # is still finished, with an outcome that says so; 503 if nothing was sent.
                x.outcome = Outcome.CANCELLED
                x.status = x.status or 503
                x.t_end = self.clock()
                raise
            task.uncancel()
            timer = x.timer
            if timer is not None and timer.ended_t is not None and not timer.error:
                # The client had the stream's last event and closed before the upstream's
                # final bytes (the chunked terminator): the official openai SDK closes as
                # soon as it reads [DONE]. The stream was complete for the client.
                x.outcome, x.t_end = Outcome.COMPLETED, timer.ended_t
            else:
                x.outcome = Outcome.CLIENT_DISCONNECTED
                x.status = x.status or 499
                x.t_end = self.clock()
        finally:
            watch.done = True
            watcher.cancel()
            if not x.t_end:
                x.t_end = self.clock()
            if x.response is not None:
                with contextlib.suppress(Exception):
                    await x.response.aclose()  # closes the upstream request if still open
            if admitted:
                target.admission.release()
            target.leave()

    async def _admit(self, x: _Request, target: LiveUpstream) -> bool:
        t_q = self.clock()
        admission = target.admission
        try:
            await admission.acquire()
        except QueueFull:
            raise Refused(429, f"too many requests waiting for upstream {target.name}",
                          "rate_limit_error", "proxy_queue_full",
                          extra=[(b"retry-after", b"1")]) from None
        x.queue_s = self.clock() - t_q if admission.limited else 0.0
        return True

    def _upstream_headers(self, target: LiveUpstream, headers: list[tuple[bytes, bytes]], *,
                          identity: bool) -> list[tuple[bytes, bytes]]:
        """The client's headers as the upstream gets them: keys replaced by the
        upstream's own when client keys are checked, the upstream's configured headers
        set (replacing the client's of the same name)."""
        keys = self.keys
        out_headers = forward_headers(headers, identity=identity,
                                      drop=self._secret_headers if keys else frozenset())
        if keys is not None:
            out_headers = [(k, v) for k, v in out_headers if k not in CLIENT_KEY_HEADERS]
            if target.key is not None:
                out_headers.append(target.key)
        if target.headers:
            names = {k for k, _ in target.headers}
            out_headers = [(k, v) for k, v in out_headers if k not in names]
            out_headers.extend(target.headers)
        return out_headers

    async def _forward(self, x: _Request, scope: Scope, headers: list[tuple[bytes, bytes]],
                       body: bytes) -> None:
        target = x.target
        assert target is not None
        out_headers = self._upstream_headers(target, headers, identity=x.measured is not None)
        if x.span is not None and self.tracing is not None:
            out_headers = self.tracing.inject(x.span, out_headers)
        t_send = self.clock()
        x.overhead_s = t_send - x.t0 - (x.queue_s or 0.0)
        try:
            x.response = await target.client.open(
                scope["method"], x.subpath, scope.get("query_string", b""),
                out_headers, body, self.clock)
        except UpstreamError as exc:
            status, err = error_response(exc, target.client.host)
            x.reason = f"{type(exc).__name__}: {exc}"
            raise UpstreamFailed(status, err, failure_outcome(exc)) from None
        x.overhead_s += x.response.setup_s  # until written: a new connection's set-up too
        if self.prefix is not None:  # runs later (batched, or in a thread): after the request was sent
            stream = x.response.headers.get("content-type", "").startswith("text/event-stream")
            x.prefix = self.prefix.begin(x.measured, x.payload, target.spec, x.t0,
                                         x.response.status_code, len(body),
                                         t_headers=self.clock(), stream=stream)

    async def _relay(self, x: _Request, send: Send, strip_usage: bool) -> None:
        response = x.response
        assert response is not None
        x.status = status = response.status_code
        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
        ok = 200 <= status < 300
        observe = self.metrics is not None and x.measured is not None and ok
        strip = strip_usage and is_sse and observe
        x.request_id = response.headers.get("x-request-id", "")
        resp_headers = response_headers(response.headers.raw, keep_length=not strip)
        if not x.request_id:
            x.request_id = uuid.uuid4().hex
            resp_headers.append((b"x-request-id", x.request_id.encode()))
        if is_sse and b"x-accel-buffering" not in (k for k, _ in resp_headers):
            resp_headers.append((b"x-accel-buffering", b"no"))
        if status >= 500:  # a 4xx is the client's request, not an upstream failure
            x.reason = f"HTTP {status}"
        await send({"type": "http.response.start", "status": status, "headers": resp_headers})
        meter = None
        if observe and is_sse and x.measured is not None:
            # the doctor's job is ready once the upstream's prefill was done
            x.timer = StreamTimer(x.measured, x.prefix.ready if x.prefix is not None else None)
            meter = Meter(x.timer, SSEParser())
        x.result = result = await relay(
            response.body, send, self.clock, meter=meter, strip_usage=strip,
            collect_limit=NON_STREAM_USAGE_LIMIT if observe and not is_sse else 0,
            write_timeout=self.settings.client_write_timeout)
        if x.prefix is not None and meter is None and result.t_first_byte is not None:
            x.prefix.ready(result.t_first_byte)  # a stream not metered: its first bytes
        x.outcome = (result.outcome if ok or result.outcome is Outcome.CLIENT_STALLED
                     else status_outcome(status))
        if x.outcome is Outcome.COMPLETED and x.timer is not None and x.timer.error:
            x.outcome = Outcome.UPSTREAM_ERROR  # an error event inside the 200 stream
            x.reason = "error event in the stream"
        if result.outcome is not Outcome.CLIENT_DISCONNECTED:
            x.t_end = result.t_end
        if ok and result.outcome in (Outcome.UPSTREAM_TIMEOUT, Outcome.UPSTREAM_INTERRUPTED):
            x.reason = f"stream {result.outcome}"

    # -- the one finish ----------------------------------------------------------------

    def _finish(self, x: _Request) -> None:
        """Record, metrics, log line and warning: once per request, whatever happened."""
        if not x.request_id:  # the client left before any answer: the log still needs an id
            x.request_id = uuid.uuid4().hex
        if x.identity and (not self._upstream_checks_key or _key_accepted(x)):
            x.client = self.client_label(x.identity)
        if x.reason:
            self._warnings.warning(
                "upstream failure: request_id=%s route=%s model=%s upstream=%s status=%s: %s",
                x.request_id, x.route, x.model,
                x.target.client.host if x.target is not None else "-", x.status, x.reason)
        if x.outcome is Outcome.CLIENT_STALLED:
            self._warnings.warning(
                "client stalled: request_id=%s route=%s model=%s upstream=%s status=%s: the "
                "client took no bytes for %g s (--client-write-timeout); closed it and the "
                "upstream request", x.request_id, x.route, x.model,
                x.target.client.host if x.target is not None else "-", x.status,
                self.settings.client_write_timeout)
        if self.metrics is None and self.request_log is None and x.span is None:
            return
        try:
            record = self._record(x)
            if self.metrics is not None:
                self.metrics.observe(record, measured=x.measured is not None and x.parsed)
            if self.request_log is not None:
                self.request_log.write(record)
            upstream = x.target.telemetry if x.target is not None else None
            if x.span is not None and self.tracing is not None:
                self.tracing.finish(x.span, record, x.request_model, upstream)
            if self.otel_metrics is not None and x.measured is not None:
                self.otel_metrics.record(record, x.measured.name, upstream)
            if self.capture is not None and x.measured is not None and x.parsed:
                self.capture.add(record, x.t0, x.request_model, x.prefix)
        except Exception:  # measurement never breaks serving
            log.exception("failed to record a request")

    def _record(self, x: _Request) -> RequestRecord:
        timer, result, response, dialect = x.timer, x.result, x.response, x.measured
        raw: Mapping[str, Any] | None = None
        said: Mapping[str, Any] | None = None
        upstream_q = None
        reply = NO_RESPONSE
        if timer is not None:
            raw = timer.usage
            said = timer.report
            upstream_q = timer.upstream_queue_s
            if self.response_info:
                reply = timer.response()
        elif result is not None and result.body and dialect is not None:
            whole = read_answer(dialect, result.body)  # a non-stream answer
            if whole is not None:
                raw, upstream_q, reply, said = whole
        if upstream_q is None and response is not None:
            upstream_q = _queue_header(response.headers.get("x-queue-time"))
        usage = dialect.usage(raw) if dialect is not None else Usage()
        report = read_report(said)
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        cached = usage.cached_prompt_tokens
        if cached is None:
            cached = report.cached_tokens  # llama.cpp: its timings say what it reused
        estimated = False
        if prompt is None and report.computed_tokens is not None and \
                report.cached_tokens is not None:
            prompt = report.computed_tokens + report.cached_tokens  # the engine's own count
        if timer is not None and raw is None and x.outcome is Outcome.COMPLETED:
            # No usage (--no-inject-usage, or a server that ignores the request for it):
            # count output events; the prompt is the engine's count where its timings give
            # one, else the proxy's estimate, said as such.
            completion = timer.output_choices
            if prompt is None:
                prompt = estimate_prompt_tokens(x.payload) if x.payload is not None else None
                estimated = prompt is not None
        first = timer.first_t if timer is not None else None
        answer = timer.first_answer_t if timer is not None else None
        first_byte = result.t_first_byte if result is not None and timer is not None else None
        return RequestRecord(
            request_id=x.request_id, route=x.route, model=x.model,
            upstream=(x.target.name if x.target is not None
                      else x.upstream or self.upstreams.fallback_name),
            client=x.client, stream=x.stream, status=x.status, outcome=x.outcome, duration_s=x.t_end - x.t0,
            overhead_s=x.overhead_s, queue_s=x.queue_s, upstream_queue_s=upstream_q,
            ttft_s=(first - x.t0) if first is not None else None,
            ttfa_s=(answer - x.t0) if answer is not None else None,
            ttfb_s=(first_byte - x.t0) if first_byte is not None else None,
            tpot_s=tpot(first, timer.last_t, completion) if timer is not None else None,
            itl_s=tuple(timer.gaps) if timer is not None else (),
            output_events=timer.output_events if timer is not None else 0,
            prompt_tokens=prompt, cached_prompt_tokens=cached,
            completion_tokens=completion, reasoning_tokens=usage.reasoning_tokens,
            cache_write_tokens=usage.cache_write_tokens, tokens_estimated=estimated,
            engine_cached_tokens=report.cached_tokens, engine_prefill_s=report.prefill_s,
            provider_cache_reason=report.cache_reason,
            provider_missed_tokens=report.cache_missed_tokens,
            trace_id=x.span.trace_id if x.span is not None else "",
            span_id=x.span.span_id if x.span is not None else "",
            response_id=reply.id, response_model=reply.model,
            finish_reasons=reply.finish_reasons,
            # an estimated prompt still turns the doctor's bytes into tokens: the
            # record's tokens_estimated says so wherever they are shown
            prefix=(x.prefix.record(prompt, cached) if x.prefix is not None else None))


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


def _key_accepted(x: _Request) -> bool:
    """Did the upstream take the key it was passed? Only an answer of its own says so,
    with a status other than 401 or 403: a request the proxy refused itself (413, 408,
    429, 404) or whose exchange failed (502, 504) never reached the upstream's key check,
    so its key, perhaps a random one, takes no label value."""
    if x.response is not None:
        return x.response.status_code not in (401, 403)
    return x.upstream == ALL_UPSTREAMS and x.status == 200  # the merged model list


def _unbounded(model: str) -> str:
    return model


async def _send_error(send: Send, answer: Refused | UpstreamFailed, request_id: str) -> None:
    headers = [*JSON_HEADERS, (b"x-request-id", request_id.encode()), *answer.extra]
    body = answer.body
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        part = message.get("body", b"")
        if part:
            size += len(part)
            if size > limit:
                raise BodyTooLarge
            chunks.append(part)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _watch_disconnect(receive: Receive, task: asyncio.Task[Any], watch: _Watch) -> None:
    """Cancel the request's task when its client goes away (uvicorn's send won't say)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not watch.done:
                watch.disconnected = True
                task.cancel()
            return
