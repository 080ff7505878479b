"""Request handling for ``/v1/*``: admission, upstream call, relay, one record.

The proxied routes are a plain ASGI endpoint, not a FastAPI route: per request there
is no routing table walk, no dependency injection and no ``Request``/``Response``
objects, and per chunk nothing but the relay loop (see issue 5 for the measurements
that led here).

Flow, one way: request in -> checks (path, sizes, key) -> body -> admission (queue
time) -> upstream -> relay (bytes out, events observed) -> record -> metrics and log.
The record is built and observed exactly once, in ``finally``, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.admission import Admission, QueueFull
from proxy.auth import KeyCheck, presented_key
from proxy.config import Settings
from proxy.measure import (
    Outcome,
    RequestRecord,
    StreamTimer,
    Usage,
    estimate_prompt_tokens,
    tpot,
    upstream_queue_seconds,
)
from proxy.metrics import UNKNOWN_MODEL, Metrics
from proxy.relay import RelayResult, relay
from proxy.reqlog import RequestLog
from proxy.sse import SSEParser
from proxy.upstream import (
    UnsafePath,
    Upstream,
    UpstreamResponse,
    error_body,
    forward_headers,
    map_transport_error,
    response_headers,
    safe_subpath,
)

log = logging.getLogger("proxy")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Clock = Callable[[], float]

MEASURED_ROUTES = {b"/chat/completions": "/v1/chat/completions", b"/completions": "/v1/completions"}
# Route templates for everything else under /v1: the first path segment when it is a
# known OpenAI-style resource, else a catch-all, so random paths add no label values.
KNOWN_RESOURCES = frozenset({
    "models", "embeddings", "files", "batches", "moderations", "images", "audio", "responses",
    "assistants", "threads", "vector_stores", "fine_tuning", "uploads", "rerank", "score",
    "tokenize", "detokenize", "chat", "completions", "realtime", "containers", "conversations",
})  # fmt: skip
NON_STREAM_USAGE_LIMIT = 8 * 1024 * 1024
JSON_HEADERS = [(b"content-type", b"application/json")]


def route_template(subpath: bytes) -> str:
    segments = subpath.split(b"/")[1:]
    if not segments or segments == [b""]:
        return "/v1"
    first = segments[0].decode("latin-1")
    if first not in KNOWN_RESOURCES:
        return "/v1/{other}"
    return f"/v1/{first}" + ("/{...}" if len(segments) > 1 and any(segments[1:]) else "")


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


@dataclass(slots=True)
class _Watch:
    """Shared between a request and its disconnect watcher."""

    disconnected: bool = False
    done: bool = False


class V1Handler:
    """The ASGI endpoint for every ``/v1/*`` request."""

    def __init__(self, settings: Settings, upstream: Upstream, metrics: Metrics | None,
                 admission: Admission, clock: Clock, keys: KeyCheck | None,
                 request_log: RequestLog | None) -> None:
        self.settings = settings
        self.upstream = upstream
        self.metrics = metrics
        self.admission = admission
        self.clock = clock
        self.keys = keys
        self.request_log = request_log
        self.upstream_name = settings.upstream_label
        self._secret_headers = frozenset(h.lower().encode() for h in settings.secret_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = self.clock()
        s = self.settings
        metrics = self.metrics
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        method: str = scope["method"]
        try:
            subpath = safe_subpath(raw_path.split(b"?", 1)[0])
        except UnsafePath as exc:
            await self._answer(send, 400, str(exc), "invalid_request_error", "invalid_path",
                               t0, "/v1/{other}", UNKNOWN_MODEL, False)
            return
        measured_route = MEASURED_ROUTES.get(subpath) if method == "POST" else None
        route = measured_route or route_template(subpath)
        headers: list[tuple[bytes, bytes]] = scope["headers"]

        # Cheap checks first: nothing is read and nothing is sent upstream.
        if sum(len(k) + len(v) for k, v in headers) > s.max_header_bytes:
            await self._answer(send, 431, "request headers too large", "invalid_request_error",
                               "headers_too_large", t0, route, UNKNOWN_MODEL, False)
            return
        for name, value in headers:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0:
                    await self._answer(send, 400, "invalid Content-Length", "invalid_request_error",
                                       "invalid_content_length", t0, route, UNKNOWN_MODEL, False)
                    return
                if declared > s.max_body_bytes:
                    await self._too_large(send, t0, route)
                    return
        if self.keys is not None and not self.keys.accepts(presented_key(headers)):
            await self._answer(send, 401, "invalid or missing API key for this proxy",
                               "invalid_request_error", "invalid_api_key", t0, route,
                               UNKNOWN_MODEL, False)
            return

        try:
            async with asyncio.timeout(s.body_timeout):
                body = await _read_body(receive, s.max_body_bytes)
        except BodyTooLarge:
            await self._too_large(send, t0, route)
            return
        except TimeoutError:
            await self._answer(send, 408, "request body not received in time",
                               "invalid_request_error", "body_timeout", t0, route,
                               UNKNOWN_MODEL, False)
            return
        except ClientGone:
            return

        # What the request asks for. Never raises: a body that is not a JSON object is
        # forwarded unchanged and measured under model "unknown".
        model, stream, payload = UNKNOWN_MODEL, False, None
        body_out, strip_usage = body, False
        looks_like_object = body[:1] == b"{" or body.lstrip()[:1] == b"{"
        if looks_like_object and (measured_route or len(body) <= 1 << 20):
            payload = _json_object(body)
        if payload is not None:
            m = payload.get("model")
            if isinstance(m, str) and m:
                model = m
            stream = measured_route is not None and payload.get("stream") is True
            if stream and s.inject_usage and metrics is not None:
                injected = _with_usage(payload)
                if injected is not None:
                    body_out, strip_usage = injected, True
        label = metrics.model_label(model) if metrics is not None else model

        if metrics is not None:
            metrics.in_flight.inc()
        watch = _Watch()
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, task, watch))
        response: UpstreamResponse | None = None
        admitted = False
        queue_s: float | None = None
        overhead_s: float | None = None
        status = 502
        result: RelayResult | None = None
        timer: StreamTimer | None = None
        request_id = ""
        outcome = Outcome.REJECTED
        try:
            if measured_route is not None:
                t_q = self.clock()
                try:
                    await self.admission.acquire()
                except QueueFull:
                    status = 429
                    await self._send_error(send, 429, "too many requests waiting for the upstream",
                                           "rate_limit_error", "proxy_queue_full",
                                           extra=[(b"retry-after", b"1")])
                    return
                admitted = True
                queue_s = self.clock() - t_q if self.admission.limited else 0.0

            out_headers = forward_headers(headers, identity=measured_route is not None,
                                          drop=self._secret_headers if self.keys else frozenset())
            if self.keys is not None:
                out_headers = [(k, v) for k, v in out_headers if k not in (b"authorization", b"api-key")]
                out_headers.append((b"authorization", self.keys.upstream_authorization))
            t_send = self.clock()
            overhead_s = t_send - t0 - (queue_s or 0.0)
            try:
                response = await self.upstream.open(
                    method, subpath, scope.get("query_string", b""), out_headers, body_out)
            except httpx.TransportError as exc:
                status, err = map_transport_error(exc)
                outcome = Outcome.TIMEOUT if status == 504 else Outcome.UPSTREAM_ERROR
                request_id = uuid.uuid4().hex
                await send({"type": "http.response.start", "status": status,
                            "headers": [*JSON_HEADERS, (b"x-request-id", request_id.encode())]})
                await send({"type": "http.response.body", "body": err, "more_body": False})
                return

            status = response.status_code
            is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
            ok = 200 <= status < 300
            observe = metrics is not None and measured_route is not None and ok
            strip = strip_usage and is_sse and observe
            request_id = response.headers.get("x-request-id", "")
            resp_headers = response_headers(response.headers.raw, keep_length=not strip)
            if not request_id:
                request_id = uuid.uuid4().hex
                resp_headers.append((b"x-request-id", request_id.encode()))
            if is_sse and b"x-accel-buffering" not in (k for k, _ in resp_headers):
                resp_headers.append((b"x-accel-buffering", b"no"))
            await send({"type": "http.response.start", "status": status, "headers": resp_headers})

            parser = None
            if observe and is_sse:
                timer = StreamTimer(text_route=measured_route == "/v1/completions")
                parser = SSEParser()
            result = await relay(
                response, send, self.clock, timer=timer, parser=parser, strip_usage=strip,
                collect_limit=NON_STREAM_USAGE_LIMIT if observe and not is_sse else 0)
            outcome = result.outcome if ok else Outcome.UPSTREAM_ERROR
        except asyncio.CancelledError:
            if not watch.disconnected:
                raise
            task.uncancel()
            outcome = Outcome.CLIENT_DISCONNECTED
        finally:
            watch.done = True
            watcher.cancel()
            t_end = self.clock()
            if response is not None:
                with contextlib.suppress(Exception):
                    await response.aclose()  # closes the upstream request if still open
            if admitted:
                self.admission.release()
            if metrics is not None:
                metrics.in_flight.dec()
            try:
                if metrics is not None or self.request_log is not None:
                    record = self._record(
                        request_id, route, label, stream, status, outcome, t0, t_end,
                        overhead_s, queue_s, timer, result, response, payload)
                    if metrics is not None:
                        metrics.observe(record, measured=measured_route is not None)
                    if self.request_log is not None:
                        self.request_log.write(record)
            except Exception:  # measurement never breaks serving
                log.exception("failed to record a request")
        # Recorded first, so a client that saw the end can already scrape the request.
        if result is not None and result.complete:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        # else: return without completing, so the server closes the connection and the
        # client sees the stream break exactly as the upstream broke it.

    def _record(self, request_id: str, route: str, model: str, stream: bool, status: int,
                outcome: Outcome, t0: float, t_end: float, overhead_s: float | None,
                queue_s: float | None, timer: StreamTimer | None, result: RelayResult | None,
                response: UpstreamResponse | None, payload: dict[str, Any] | None) -> RequestRecord:
        if outcome is not Outcome.CLIENT_DISCONNECTED and result is not None:
            t_end = result.t_end
        usage_map = None
        upstream_q = None
        if timer is not None:
            usage_map = timer.usage
            upstream_q = timer.upstream_queue_s
        elif result is not None and result.body:
            body = _json_object(result.body)
            if body is not None:
                u = body.get("usage")
                usage_map = u if isinstance(u, dict) else None
                upstream_q = upstream_queue_seconds(body)
        if upstream_q is None and response is not None:
            header = response.headers.get("x-queue-time")
            if header:
                with contextlib.suppress(ValueError):
                    value = float(header)
                    if value >= 0:
                        upstream_q = value / 1000.0
        usage = Usage.from_mapping(usage_map)
        prompt, cached, completion = usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens
        estimated = False
        if timer is not None and usage_map is None and outcome is Outcome.COMPLETED:
            completion = timer.output_choices
            prompt = estimate_prompt_tokens(payload) if payload is not None else None
            estimated = True
        first = timer.first_t if timer is not None else None
        return RequestRecord(
            request_id=request_id, route=route, model=model, upstream=self.upstream_name,
            stream=stream, status=status, outcome=outcome, duration_s=t_end - t0,
            overhead_s=overhead_s, queue_s=queue_s, upstream_queue_s=upstream_q,
            ttft_s=(first - t0) if first is not None else None,
            tpot_s=tpot(first, timer.last_t, completion) if timer is not None else None,
            itl_s=tuple(timer.gaps) if timer is not None else (),
            output_events=timer.output_events if timer is not None else 0,
            prompt_tokens=prompt, cached_prompt_tokens=cached, completion_tokens=completion,
            tokens_estimated=estimated)

    async def _too_large(self, send: Send, t0: float, route: str) -> None:
        await self._answer(send, 413, f"request body larger than {self.settings.max_body_bytes} bytes",
                           "invalid_request_error", "request_too_large", t0, route,
                           UNKNOWN_MODEL, False)

    async def _answer(self, send: Send, status: int, message: str, type_: str, code: str,
                      t0: float, route: str, model: str, stream: bool) -> None:
        """An error the proxy answers itself, before the upstream is involved."""
        request_id = await self._send_error(send, status, message, type_, code)
        if self.metrics is not None:
            record = RequestRecord(request_id, route, self.metrics.model_label(model),
                                   self.upstream_name, stream, status, Outcome.REJECTED,
                                   self.clock() - t0)
            self.metrics.observe(record, measured=False)

    async def _send_error(self, send: Send, status: int, message: str, type_: str, code: str,
                          extra: list[tuple[bytes, bytes]] | None = None) -> str:
        request_id = uuid.uuid4().hex
        headers = [*JSON_HEADERS, (b"x-request-id", request_id.encode()), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": error_body(message, type_, code),
                    "more_body": False})
        return request_id


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
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


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _with_usage(payload: dict[str, Any]) -> bytes | None:
    """The request body with ``stream_options.include_usage`` set, or None if it already is."""
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return None  # malformed: leave the request alone, the upstream will say
    if options is not None and options.get("include_usage") is True:
        return None
    changed = dict(payload)
    changed["stream_options"] = {**(options or {}), "include_usage": True}
    try:
        return json.dumps(changed, ensure_ascii=False, separators=(",", ":")).encode()
    except (ValueError, UnicodeEncodeError):  # e.g. a lone surrogate escaped in the JSON
        return None  # forward the body as it came; tokens fall back to counting
