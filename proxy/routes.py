"""Request handling for ``/v1/*``: admission, upstream call, relay, one record.

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import unquote

from proxy.admission import QueueFull
from proxy.answers import (
    CLOSE,
    JSON_HEADERS,
    Refused,
    UpstreamFailed,
    cancelled,
    send_error,
)
from proxy.asgi import Receive, Scope, Send
from proxy.auth import CLIENT_KEY_HEADERS, KeyCheck, presented_key
from proxy.bodies import LARGE_BODY, decode_body, meant_as_json, not_an_object
from proxy.clients import Identify
from proxy.dialects import DIALECTS, DIALECTS_WITHOUT_RESPONSE_INFO, Dialect
from proxy.doctor.job import PrefixCheck
from proxy.logs import RateLimitedLog
from proxy.measure import DECODABLE_CODINGS, DecodedMeter, Meter, Outcome, StreamTimer
from proxy.metrics import UNKNOWN_MODEL, Metrics
from proxy.model_list import ALL_UPSTREAMS, merged_models
from proxy.otel_metrics import OtelMetrics
from proxy.relay import Watch, relay, watch_disconnect
from proxy.reqlog import RequestLog
from proxy.routing import LiveUpstreams, route_template
from proxy.sse import SSEParser
from proxy.stages import (
    Admitted,
    Answered,
    Arrival,
    Asked,
    Ended,
    Stages,
    error_answer,
    failure_outcome,
    record_of,
    status_outcome,
)
from proxy.tracing import Tracing
from proxy.upstream import (
    LiveUpstream,
    UnsafePath,
    error_body,
    error_response,
    forward_headers,
    response_headers,
    safe_subpath,
)
from proxy.uvicorn_writer import body_in_hand
from proxy.wire.errors import UpstreamError
from proxy.workload_capture import WorkloadCapture

log = logging.getLogger("proxy")

Clock = Callable[[], float]

# The measured routes: POST to one of these is observed by its API's dialect.
MEASURED_ROUTES: dict[bytes, Dialect] = {
    d.route.removeprefix("/v1").encode(): d for d in DIALECTS.values()}
MEASURED_ROUTES_WITHOUT_RESPONSE_INFO: dict[bytes, Dialect] = {
    d.route.removeprefix("/v1").encode(): d for d in DIALECTS_WITHOUT_RESPONSE_INFO.values()}
NON_STREAM_USAGE_LIMIT = 8 * 1024 * 1024


class BodyTooLarge(Exception):
    pass


class ClientDisconnected(Exception):
    """The client disconnected before its request body was read whole."""


class HandlerOptions(NamedTuple):
    """The settings of the same names that the request path reads."""

    max_header_bytes: int
    max_body_bytes: int
    body_timeout: float
    client_write_timeout: float
    inject_usage: bool
    secret_headers: tuple[str, ...]
    key_label: bool  # --client-label-from key


class V1Handler:
    """The ASGI endpoint for every ``/v1/*`` request: small steps that return or raise
    (:class:`Refused`, or :class:`UpstreamFailed` before the upstream's headers), then one
    :meth:`_finish` whatever happened (``docs/design/request-path.md``, "State in stages").
    """

    def __init__(self, *, options: HandlerOptions, upstreams: LiveUpstreams, clock: Clock,
                 prefix: PrefixCheck | None = None,
                 metrics: Metrics | None = None, keys: KeyCheck | None = None,
                 request_log: RequestLog | None = None, tracing: Tracing | None = None,
                 identify: Identify | None = None, otel_metrics: OtelMetrics | None = None,
                 capture: WorkloadCapture | None = None) -> None:
        """
        Parameters:
            options: Limits, timeouts, the usage request, the headers kept from upstreams.
            upstreams: The live upstreams and the routing table over them.
            clock: The monotonic clock every time on the request path is read from.
            prefix: The prompt-cache doctor; None: off.
            metrics: Prometheus metrics to observe each request in; None: off.
            keys: The proxy's own client keys; None: the client's key goes upstream.
            request_log: The per-request JSON log; None: off.
            tracing: OpenTelemetry spans; None: off.
            identify: Names a request's client for the ``client`` label; None: off.
            otel_metrics: OpenTelemetry metrics; None: off.
            capture: The workload capture (its file, for replay); None: off.
        """
        self.options, self.upstreams, self.clock, self.prefix = options, upstreams, clock, prefix
        self.metrics, self.keys, self.request_log, self.identify = metrics, keys, request_log, identify
        self.tracing, self.otel_metrics, self.capture = tracing, otel_metrics, capture
        self.model_label: Callable[[str], str] = (
            metrics.model_label if metrics is not None else _unbounded)
        self.client_label: Callable[[str], str] = (
            metrics.client_label if metrics is not None and metrics.client_label is not None
            else _unbounded)
        # A key the proxy does not check is checked by the upstream: only an answer other
        # than 401 or 403 says it was right; a wrong key takes no label (_key_accepted).
        self._upstream_checks_key = keys is None and options.key_label
        self._secret_headers = frozenset(h.lower().encode() for h in options.secret_headers)
        # Response id, model and finish reasons are read only for whoever reads them:
        # the span, OTLP metrics, the request log, and the metrics' finish reasons.
        self.response_info = (tracing is not None or request_log is not None
                              or otel_metrics is not None or metrics is not None)
        self.routes = (MEASURED_ROUTES if self.response_info
                       else MEASURED_ROUTES_WITHOUT_RESPONSE_INFO)
        self._warnings = RateLimitedLog(log, per_interval=10, interval_s=10.0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        x = Stages(self.clock())
        try:
            x.arrival = arrival = self._arrive(x.t0, scope)
            headers: list[tuple[bytes, bytes]] = scope["headers"]
            identity = self._check(headers)
            body = await self._read(receive)
            x.identity = identity  # a body refused for its size or time takes no label
            x.asked = asked = self._parse(arrival, body, await self._decode(arrival, body))
            if self._union(arrival, scope):
                x.ended = await self._models_union(scope, headers, send)
                return
            x.target = self._route(arrival, asked)
            await self._exchange(x, scope, headers, receive, send)
            job = x.answered.prefix if x.answered is not None else None
            if job is not None and not job.settled:
                await job.settle()
        except (Refused, UpstreamFailed) as answer:
            request_id = uuid.uuid4().hex
            x.ended = Ended(answer.status, answer.outcome, self.clock(), request_id,
                            answer.reason)
            await send_error(send, answer, request_id)
        except ClientDisconnected:
            x.ended = Ended(499, Outcome.CLIENT_DISCONNECTED, self.clock())
        except asyncio.CancelledError:
            # The server cancelled the request (shutdown past --graceful-timeout) before
            # or during its exchange, e.g. while a large body was decoded: cut short.
            ended = x.ended
            x.ended = (Ended(503, Outcome.CANCELLED, self.clock()) if ended is None else
                       ended._replace(status=ended.status or 503, outcome=Outcome.CANCELLED))
            await cancelled(send, x.answered is not None)
        finally:
            self._finish(x)
        # Recorded first, so a client that saw the end can already scrape the request.
        result = x.ended.result if x.ended is not None else None
        if result is not None and result.complete:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        # else: return without completing, so the server closes the connection and the
        # client sees the stream break exactly as the upstream broke it.

    # -- the steps -----------------------------------------------------------------------

    def _arrive(self, t0: float, scope: Scope) -> Arrival:
        """Where the request goes, from its path alone; its span starts here."""
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        try:
            subpath = safe_subpath(raw_path.split(b"?", 1)[0])
        except UnsafePath as exc:
            raise Refused(400, str(exc), "invalid_request_error", "invalid_path") from None
        dialect = self.routes.get(subpath) if scope["method"] == "POST" else None
        span = None
        if self.tracing is not None and dialect is not None:
            span = self.tracing.start(scope["headers"], t0, dialect.name)
        return Arrival(subpath, dialect.route if dialect is not None else route_template(subpath),
                       dialect, span)

    def _check(self, headers: list[tuple[bytes, bytes]]) -> str:
        """Cheap checks first: nothing is read and nothing is sent upstream. Returns who
        the request says it is ("" when the client label is off)."""
        s = self.options
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
        # only now: a refused request takes no label value
        return self.identify(headers) if self.identify is not None else ""

    def _too_large(self) -> Refused:
        return Refused(413, f"request body larger than {self.options.max_body_bytes} bytes",
                       "invalid_request_error", "request_too_large", extra=CLOSE)

    async def _read(self, receive: Receive) -> bytes:
        limit = self.options.max_body_bytes
        try:
            if body_in_hand(receive):  # nothing to wait for, so nothing to bound
                return await _read_body(receive, limit)
            async with asyncio.timeout(self.options.body_timeout):
                return await _read_body(receive, limit)
        except BodyTooLarge:
            raise self._too_large() from None
        except TimeoutError:
            raise Refused(408, "request body not received in time", "invalid_request_error",
                          "body_timeout", extra=CLOSE) from None

    async def _decode(self, arrival: Arrival, body: bytes
                      ) -> tuple[dict[str, Any] | None, bytes | None]:
        """The body as a JSON object (None: not one, or not read) and, for a stream whose
        usage the proxy asks for, the body to send instead. A body larger than
        ``LARGE_BODY`` is decoded in a worker thread, in pieces (:mod:`proxy.bodies`),
        with the same result: never a stall of the streams on this loop."""
        dialect = arrival.dialect
        looks_like_object = body[:1] == b"{" or body.lstrip()[:1] == b"{"
        if not looks_like_object or (dialect is None and len(body) > 1 << 20):
            return None, None
        inject = (dialect is not None and dialect.injects_usage
                  and self.options.inject_usage and self.metrics is not None)
        if len(body) <= LARGE_BODY:
            return decode_body(body, inject)
        return await asyncio.to_thread(decode_body, body, inject, large=True)

    def _parse(self, arrival: Arrival, body: bytes,
               decoded: tuple[dict[str, Any] | None, bytes | None]) -> Asked:
        """What the request asks for: model, stream; the body to send and whether the
        proxy added the usage request. Never raises: a body that is not a JSON object is
        forwarded unchanged and measured under model "unknown"."""
        payload, injected = decoded
        if payload is None:
            return Asked(self.model_label(UNKNOWN_MODEL), "", False, None, body, False)
        m = payload.get("model")
        request_model = m if isinstance(m, str) and m else ""
        return Asked(self.model_label(request_model or UNKNOWN_MODEL), request_model,
                     arrival.dialect is not None and payload.get("stream") is True, payload,
                     body if injected is None else injected, injected is not None)

    def _route(self, arrival: Arrival, asked: Asked) -> LiveUpstream:
        """Which upstream takes the request: by the body's model, by the model id of
        ``/v1/models/{id}``, else the default upstream; none is a 404, or a 400 when the
        body meant to name the model is not a JSON object (with a default upstream it
        is forwarded unchanged instead: the upstream answers it as it would directly)."""
        model: str | None = asked.request_model or None
        if model is None and arrival.subpath.startswith(b"/models/"):
            model = unquote(arrival.subpath[len(b"/models/"):].decode("latin-1")) or None
        # by the real path: routes = ["/v1/messages"] takes /v1/messages/count_tokens
        target = self.upstreams.pick(model, "/v1" + arrival.subpath.decode("latin-1"))
        if target is not None:
            return target
        body = asked.body  # unchanged: nothing is injected into a body that is no object
        if model is None and asked.payload is None and meant_as_json(
                arrival.dialect is not None, body):
            raise Refused(400, f"{not_an_object(body)}, so it names no model to route by "
                          "(and no upstream is the default)", "invalid_request_error",
                          "invalid_json")
        shown = f"model {model[:200]!r}" if model is not None else "a request without a model"
        raise Refused(404, f"{shown} on {arrival.route} is not served by this proxy: no "
                      "upstream takes it and none is the default", "invalid_request_error",
                      "model_not_found")

    def _union(self, arrival: Arrival, scope: Scope) -> bool:
        return (arrival.subpath == b"/models" and scope["method"] == "GET"
                and len(self._listing()) > 1)

    def _listing(self) -> tuple[LiveUpstream, ...]:  # those whose routes take /v1/models
        return tuple(t for t in self.upstreams.targets if t.spec.serves("/v1/models"))

    async def _models_union(self, scope: Scope, headers: list[tuple[bytes, bytes]],
                            send: Send) -> Ended:
        """``GET /v1/models`` with several upstreams: every upstream's list, merged
        (:mod:`proxy.model_list`); a 502 only when no upstream answered."""
        answer = await merged_models(
            self._listing(),
            lambda target: self._upstream_headers(target, headers, identity=False),
            scope.get("query_string", b""), self._warnings)
        request_id, t_end = uuid.uuid4().hex, self.clock()
        if answer is None:
            failed = UpstreamFailed(502, error_body("no upstream answered the model list",
                                                    "upstream_error", "upstream_failed"),
                                    Outcome.UPSTREAM_ERROR)
            await send_error(send, failed, request_id)
            return Ended(502, Outcome.UPSTREAM_ERROR, t_end, request_id, upstream=ALL_UPSTREAMS)
        status, body = answer  # 200 and the list, or the refusal of the client's key
        await send({"type": "http.response.start", "status": status, "headers": [
            *JSON_HEADERS, (b"content-length", str(len(body)).encode()),
            (b"x-request-id", request_id.encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        outcome = Outcome.COMPLETED if status == 200 else status_outcome(status)
        return Ended(status, outcome, t_end, request_id, upstream=ALL_UPSTREAMS)

    async def _exchange(self, x: Stages, scope: Scope, headers: list[tuple[bytes, bytes]],
                        receive: Receive, send: Send) -> None:
        """Admission, the upstream exchange and the relay, with the in-flight gauge held
        and a watcher that turns the client's disconnect into cancellation."""
        target, arrival = x.target, x.arrival
        assert target is not None
        target.enter()
        watch = Watch()
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(receive, task, watch))
        admitted = False
        try:
            queue_s = None
            if arrival.dialect is not None:
                t_q = self.clock()
                try:
                    queue_s = await self._admit(target, t_q)
                except asyncio.CancelledError:  # the client left (or the server shut down)
                    # while it waited: its wait is a queue time all the same
                    waited = self.clock() - t_q if target.admission.limited else 0.0
                    x.admitted = Admitted(waited, None)
                    raise
                admitted = True
            x.answered = answered = await self._forward(x, scope, headers, queue_s)
            x.ended = await self._relay(answered, send)
        except asyncio.CancelledError:
            status = x.answered.response.status_code if x.answered is not None else 0
            if not watch.disconnected:
                # The server cancelled it (shutdown past --graceful-timeout): 503 if unsent.
                x.ended = Ended(status or 503, Outcome.CANCELLED, self.clock())
                raise
            task.uncancel()
            meter = x.answered.meter if x.answered is not None else None
            timer = meter.timer if meter is not None else None
            if timer is not None and timer.error:
                # An error event in the stream, and the client left at it (both official
                # SDKs raise on it and close): the failure is the upstream's.
                x.ended = Ended(status, Outcome.UPSTREAM_ERROR, self.clock(),
                                reason="error event in the stream")
            elif timer is not None and timer.ended_t is not None:
                # The client had the stream's last event and closed before the upstream's
                # final bytes: the openai SDK closes at [DONE]. The stream was complete.
                x.ended = Ended(status, Outcome.COMPLETED, timer.ended_t)
            else:
                x.ended = Ended(status or 499, Outcome.CLIENT_DISCONNECTED, self.clock())
        finally:
            watch.done = True
            watcher.cancel()
            if x.answered is not None:
                with contextlib.suppress(Exception):
                    await x.answered.response.aclose()  # closes the upstream request if open
            if admitted:
                target.admission.release()
            target.leave()

    async def _admit(self, target: LiveUpstream, t_q: float) -> float:
        """The wait for an upstream slot since ``t_q`` (0 when unlimited); a full queue is
        a 429."""
        admission = target.admission
        try:
            await admission.acquire()
        except QueueFull:
            raise Refused(429, f"too many requests waiting for upstream {target.name}",
                          "rate_limit_error", "proxy_queue_full",
                          extra=[(b"retry-after", b"1")]) from None
        return self.clock() - t_q if admission.limited else 0.0

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

    async def _forward(self, x: Stages, scope: Scope, headers: list[tuple[bytes, bytes]],
                       queue_s: float | None) -> Answered:
        """Send the request (its :class:`Admitted` made once it was written, or failed);
        from the answer's headers, decide how it is relayed."""
        t0, arrival, asked, target = x.t0, x.arrival, x.asked, x.target
        assert asked is not None and target is not None
        out_headers = self._upstream_headers(target, headers, identity=arrival.dialect is not None)
        if arrival.span is not None and self.tracing is not None:
            out_headers = self.tracing.inject(arrival.span, out_headers)
        overhead_s, setup_s = self.clock() - t0 - (queue_s or 0.0), 0.0
        try:
            response = await target.client.open(
                scope["method"], arrival.subpath, scope.get("query_string", b""),
                out_headers, asked.body, self.clock)
            setup_s = response.setup_s  # until written: a new connection's set-up too
        except UpstreamError as exc:
            status, err = error_response(exc, target.client.host)
            raise UpstreamFailed(status, err, failure_outcome(exc),
                                 f"{type(exc).__name__}: {exc}") from None
        finally:
            x.admitted = Admitted(queue_s, overhead_s + setup_s)
        status = response.status_code
        event_stream = (response.headers.get("content-type", "").lower()  # RFC 9110: any case
                        .startswith("text/event-stream"))
        prefix = None
        if self.prefix is not None:  # runs later (batched, or in a thread): after the request was sent
            prefix = self.prefix.begin(arrival.dialect, asked.payload, target.spec, t0, status,
                                       len(asked.body), t_headers=self.clock(),
                                       stream=event_stream)
        dialect = arrival.dialect
        observe = self.metrics is not None and dialect is not None and 200 <= status < 300
        # an upstream that compressed the stream though asked for identity: measured on a
        # decoded copy, and its usage event (compressed) left in
        coding = (response.headers.get("content-encoding", "identity").strip().lower()
                  if event_stream else "identity")
        strip = asked.strip_usage and event_stream and observe and coding == "identity"
        request_id = response.headers.get("x-request-id", "")
        # no length on a 204 or 304 (RFC 9110, 8.6): uvicorn would wait for a body
        headers = response_headers(response.headers.raw,
                                   keep_length=not strip and status not in (204, 304))
        if not request_id:
            request_id = uuid.uuid4().hex
            headers.append((b"x-request-id", request_id.encode()))
        if event_stream and b"x-accel-buffering" not in (k for k, _ in headers):
            headers.append((b"x-accel-buffering", b"no"))
        meter = None
        if observe and event_stream and dialect is not None:
            # the doctor's job is ready once the upstream's prefill was done
            timer = StreamTimer(dialect, prefix.ready if prefix is not None else None)
            if coding == "identity":
                meter = Meter(timer, SSEParser())
            elif coding in DECODABLE_CODINGS:
                meter = DecodedMeter(timer, SSEParser())
        return Answered(response, request_id, headers, event_stream, strip,
                        NON_STREAM_USAGE_LIMIT if observe and not event_stream else 0,
                        meter, prefix)

    async def _relay(self, answered: Answered, send: Send) -> Ended:
        response, meter = answered.response, answered.meter
        status = response.status_code
        await send({"type": "http.response.start", "status": status,
                    "headers": answered.headers})
        result = await relay(
            response.body, send, self.clock, meter=meter, strip_usage=answered.strip_usage,
            collect_limit=answered.collect_limit,
            write_timeout=self.options.client_write_timeout)
        if answered.prefix is not None and meter is None and result.t_first_byte is not None:
            answered.prefix.ready(result.t_first_byte)  # a stream not metered: its first bytes
        ok = 200 <= status < 300
        outcome = (result.outcome if ok or result.outcome is Outcome.CLIENT_STALLED
                   else status_outcome(status))
        reason = ""
        if outcome is Outcome.COMPLETED and meter is not None and meter.timer.error:
            outcome = Outcome.UPSTREAM_ERROR  # an error event inside the 200 stream
            reason = "error event in the stream"
        elif outcome is Outcome.COMPLETED and meter is None and ok and error_answer(result.body):
            outcome = Outcome.UPSTREAM_ERROR  # status 200, and an error object for a body
            reason = "error object in a 2xx body"
        elif (outcome is Outcome.COMPLETED and meter is not None and meter.timer.ended_t is None
              and not meter.timer.response().finish):
            # the body ended well, the answer did not: no last event and no finish reason
            outcome = Outcome.UPSTREAM_INTERRUPTED
            reason = "the stream ended before its last event"
        elif ok and result.outcome in (Outcome.UPSTREAM_TIMEOUT, Outcome.UPSTREAM_INTERRUPTED):
            reason = f"{'stream' if answered.event_stream else 'body'} {result.outcome}"
        t_end = (result.t_end if result.outcome is not Outcome.CLIENT_DISCONNECTED
                 else self.clock())
        return Ended(status, outcome, t_end, answered.request_id, reason, result)

    # -- the one finish ----------------------------------------------------------------

    def _finish(self, x: Stages) -> None:
        """Record, metrics, log line and warning: once per request, whatever happened."""
        answered = x.answered
        ended = x.ended
        if ended is None:  # an unexpected error on the way: nothing said how it ended
            ended = Ended(answered.response.status_code if answered is not None else 0,
                          Outcome.REJECTED, self.clock())
        # the client left before any answer: the log still needs an id
        request_id = (ended.request_id or (answered.request_id if answered is not None else "")
                      or uuid.uuid4().hex)
        client = ""
        if x.identity and (not self._upstream_checks_key or _key_accepted(answered, ended)):
            client = self.client_label(x.identity)
        status = answered.response.status_code if answered is not None else 0
        if x.asked is not None and self.metrics is not None:  # a new name takes its label
            # place unless its upstream refused it, or the key, by name (a scanner's)
            x.asked = x.asked._replace(model=self.metrics.model_label.settle(
                x.asked.model, status not in _REFUSED_NAME))
        model = x.asked.model if x.asked is not None else UNKNOWN_MODEL
        # a 4xx is the client's request, not an upstream failure
        reason = ended.reason or (f"HTTP {status}" if status >= 500 else "")
        target = x.target
        host = target.client.host if target is not None else "-"
        if reason:
            self._warnings.warning(
                "upstream failure: request_id=%s route=%s model=%s upstream=%s status=%s: %s",
                request_id, x.arrival.route, model, host, ended.status, reason)
        if ended.outcome is Outcome.CLIENT_STALLED:
            self._warnings.warning(
                "client stalled: request_id=%s route=%s model=%s upstream=%s status=%s: the "
                "client took no bytes for %g s (--client-write-timeout); closed it and the "
                "upstream request", request_id, x.arrival.route, model, host, ended.status,
                self.options.client_write_timeout)
        span, dialect = x.arrival.span, x.arrival.dialect
        if self.metrics is None and self.request_log is None and span is None:
            return
        try:
            record = record_of(x, ended, request_id, client, response_info=self.response_info,
                               fallback_upstream=self.upstreams.fallback_name)
            measured = dialect is not None and x.asked is not None
            if self.metrics is not None:
                self.metrics.observe(record, measured=measured)
            if self.request_log is not None:
                self.request_log.write(record)
            upstream = target.telemetry if target is not None else None
            request_model = x.asked.request_model if x.asked is not None else ""
            if span is not None and self.tracing is not None:
                self.tracing.finish(span, record, request_model, upstream)
            if self.otel_metrics is not None and dialect is not None:
                self.otel_metrics.record(record, dialect.name, upstream)
            if self.capture is not None and measured:
                self.capture.add(record, x.t0, request_model,
                                 answered.prefix if answered is not None else None)
        except Exception:  # measurement never breaks serving
            log.exception("failed to record a request")

# An upstream's answer that refused the request as named (its model, or its key): such a
# model name takes no label place of its own. Not 400 or 422: a served model's request
# may be refused for its content (too long a context), and its name is real
_REFUSED_NAME = frozenset((401, 403, 404))


def _key_accepted(answered: Answered | None, ended: Ended) -> bool:
    """Did the upstream take the key it was passed? Only an answer of its own says so,
    with a status other than 401 or 403: a request the proxy refused itself (413, 408,
    429, 404) or whose exchange failed (502, 504) never reached the upstream's key check,
    so its key, perhaps a random one, takes no label value."""
    if answered is not None:
        return answered.response.status_code not in (401, 403)
    return ended.upstream == ALL_UPSTREAMS and ended.status == 200  # the merged model list


def _unbounded(model: str) -> str:
    return model


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
