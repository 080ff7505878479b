"""OpenTelemetry tracing (proxy/tracing.py) against a real OTLP/HTTP receiver.

The receiver is a small loopback HTTP server that decodes each
``ExportTraceServiceRequest`` with ``opentelemetry-proto``, as a Collector would. The
proxy runs in process in front of the suite's scripted upstream (the production
upstream client, a real loopback server), with the production exporter and batch
processor: a test flushes the proxy's tracer provider, then reads what the receiver
decoded. Times are scripted (tests/upstream_fakes.py), so every duration in a span is
known exactly.
"""

from __future__ import annotations

import asyncio
import gzip
import http.server
import json
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from proxy import otel_metrics, otlp_export
from proxy.config import Settings, from_sources
from proxy.config_values import SettingsError
from proxy.doctor.report import TokenRules
from proxy.measure import PrefixRecord
from proxy.serve import export_settings
from proxy.simulator.app import create_simulator_app
from proxy.simulator.model import SimConfig
from proxy.tracing import Tracing, prefix_attributes, sampling, tracing_from, wanted
from tests.servers import closed_port, proxy_process, serve_in_thread
from tests.test_dialect_routes import MESSAGES, RESPONSES, messages_script, responses_script
from tests.test_dialect_routes import event as dialect_event
from tests.test_dialect_routes import sse_upstream as dialect_upstream
from tests.test_proxy_inprocess import json_upstream
from tests.upstream_fakes import (
    CHAT,
    COMPLETIONS,
    SSE_HEADERS,
    FakeUpstream,
    InProcess,
    ScriptedClock,
    chunk_json,
    make_app,
    sse,
    sse_upstream,
    text_json,
    timed_body,
    usage_json,
)

pytestmark = pytest.mark.anyio

T0 = 64.0
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
SECRET_KEY = "sk-test-NEVER-IN-A-SPAN-0123456789"
PROMPT = "PROMPT-TEXT-NEVER-IN-A-SPAN " * 4000  # about 112 kB
ANSWER = "ANSWER-TEXT-NEVER"
SERVER_PORT_OF = "server.port"


# ---------------------------------------------------------------------------
# The OTLP/HTTP receiver


@dataclass
class Receiver:
    """What the loopback OTLP/HTTP server received: raw bodies and decoded spans."""

    url: str = ""
    bodies: list[bytes] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[list[Metric]] = field(default_factory=list)  # per export, in order
    metric_resources: list[dict[str, Any]] = field(default_factory=list)
    schemas: set[str] = field(default_factory=set)  # the scopes' schema URLs, spans' and metrics'
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as got:
        yield got


@contextmanager
def receiving(port: int = 0) -> Iterator[Receiver]:
    """A loopback OTLP/HTTP receiver on ``port`` (0: a free one) until the block ends."""
    got = Receiver()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path == "/v1/metrics":
                metrics = ExportMetricsServiceRequest()
                metrics.ParseFromString(body)
                with got.lock:
                    got.bodies.append(body)
                    for rm in metrics.resource_metrics:
                        got.metric_resources.append(attrs(rm.resource.attributes))
                        got.metrics.append([m for sm in rm.scope_metrics for m in sm.metrics])
                        got.schemas.update(sm.schema_url for sm in rm.scope_metrics)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()
                return
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            with got.lock:
                got.bodies.append(body)
                for rs in request.resource_spans:
                    got.resources.append(attrs(rs.resource.attributes))
                    for ss in rs.scope_spans:
                        got.spans.extend(ss.spans)
                        got.schemas.add(ss.schema_url)
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    got.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield got
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: value_of(kv.value) for kv in kvs}


def value_of(value: Any) -> Any:
    """An OTLP AnyValue as Python (an array as a list)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def hexid(raw: bytes) -> str:
    return raw.hex()


async def exported(app: InProcess, receiver: Receiver) -> list[Span]:
    """Every span the proxy made so far, once its batch processor has sent them."""
    tracing = app.tracing
    assert tracing is not None
    assert await asyncio.to_thread(tracing.provider.force_flush)  # the loop keeps serving meanwhile
    with receiver.lock:
        return list(receiver.spans)


# ---------------------------------------------------------------------------
# Upstreams with scripted time


def chat_stream(clock: ScriptedClock) -> FakeUpstream:
    script = [
        (T0 + 0.25, sse(chunk_json({"role": "assistant"}))),
        (T0 + 0.5, sse(chunk_json({"reasoning_content": "hm"}))),
        (T0 + 0.625, sse(chunk_json({"content": ANSWER}))),
        (T0 + 0.75, sse(chunk_json({"content": "lo"}))),
        (T0 + 1.0, sse(chunk_json({}, finish="stop"))),
        (T0 + 1.125, sse(usage_json(7, 3, 2, completion_tokens_details={"reasoning_tokens": 1}))),
        (T0 + 1.25, b"data: [DONE]\n\n"),
    ]

    async def respond(request: httpx.Request) -> httpx.Response:
        clock.now = T0 + 0.125
        return httpx.Response(200, headers={**SSE_HEADERS, "x-request-id": "req-stream"},
                              content=timed_body(clock, script, T0 + 1.5))

    return FakeUpstream(respond)


def completions_json(clock: ScriptedClock) -> FakeUpstream:
    body = json.dumps({**text_json(ANSWER), "usage": {
        "prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}).encode()

    async def respond(request: httpx.Request) -> httpx.Response:
        clock.now = T0 + 0.5

        async def content() -> Any:
            yield body

        return httpx.Response(200, headers={"content-type": "application/json",
                                            "content-length": str(len(body)),
                                            "x-request-id": "req-plain"}, content=content())

    return FakeUpstream(respond)


async def post(app: Any, path: str, payload: dict[str, Any],
               headers: dict[str, str] | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as client:
        return await client.post(path, content=json.dumps(payload).encode(),
                                 headers=headers or {})


def chat_request(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "stream": True,
            "messages": [{"role": "user", "content": PROMPT}], **extra}


CLIENT_HEADERS = {"traceparent": TRACEPARENT, "tracestate": "vendor=client",
                  "baggage": "tenant=t1", "authorization": f"Bearer {SECRET_KEY}",
                  "x-api-key": SECRET_KEY}


# ---------------------------------------------------------------------------
# Spans


async def test_stream_span_attributes_parent_events_and_upstream_traceparent(
        receiver: Receiver, tmp_path: Path) -> None:
    clock = ScriptedClock(T0)
    up = chat_stream(clock)
    log_file = tmp_path / "requests.jsonl"
    app, registry = make_app(up, clock, otlp_endpoint=receiver.url, log_requests=str(log_file),
                             prefix_doctor=True)  # its span attributes too
    async with app:
        response = await post(app, CHAT, chat_request(), CLIENT_HEADERS)
        assert response.status_code == 200
        spans = await exported(app, receiver)
        assert len(spans) == 1
        span = spans[0]
        span_id = hexid(span.span_id)
        assert span.name == "chat m"
        assert span.kind == Span.SPAN_KIND_CLIENT
        assert hexid(span.trace_id) == CLIENT_TRACE
        assert hexid(span.parent_span_id) == CLIENT_PARENT
        port = int(app.upstream.host.rsplit(":", 1)[1])
        assert attrs(span.attributes) == {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "m",
            "gen_ai.request.stream": True,
            "gen_ai.response.id": "c1",
            "gen_ai.response.model": "m",
            "gen_ai.response.finish_reasons": ["stop"],
            "gen_ai.usage.input_tokens": 7,
            "gen_ai.usage.output_tokens": 3,
            "gen_ai.usage.cache_read.input_tokens": 2,
            "gen_ai.usage.reasoning.output_tokens": 1,
            "gen_ai.response.time_to_first_chunk": 0.25,
            "server.address": "127.0.0.1",
            SERVER_PORT_OF: port,
            "http.response.status_code": 200,
            "llm_proxy.ttft_s": 0.5,
            "llm_proxy.ttfa_s": 0.625,
            "llm_proxy.queue_s": 0.0,
            "llm_proxy.overhead_s": 0.0,
            "llm_proxy.outcome": "completed",
            "llm_proxy.request_id": "req-stream",
            # The prompt-cache doctor: a prompt seen first (sizes and reason, never text).
            "llm_proxy.prefix.prompt_bytes": len(PROMPT),
            "llm_proxy.prefix.repeated_bytes": 0,
            "llm_proxy.prefix.repeated_tokens": 0,
            "llm_proxy.prefix.missed_tokens": 0,
            "llm_proxy.prefix.break_reason": "first_seen",
        }
        # The TTFT attribute is the measured TTFT: the histogram saw the same value.
        ttft_sum = registry.get_sample_value(
            "llm_proxy_time_to_first_token_seconds_sum",
            {"route": CHAT, "model": "m", "upstream": "upstream.test:8000"})
        assert ttft_sum == 0.5
        assert span.end_time_unix_nano - span.start_time_unix_nano == 1_500_000_000
        assert [(e.name, e.time_unix_nano - span.start_time_unix_nano) for e in span.events] == [
            ("llm_proxy.first_byte", 250_000_000), ("llm_proxy.first_token", 500_000_000),
            ("llm_proxy.first_answer_token", 625_000_000)]
        assert span.status.code == span.status.STATUS_CODE_UNSET
        # The upstream's traceparent: same trace, the proxy's span as parent, sampled.
        sent = up.seen[0]
        assert sent.header_values("traceparent") == [f"00-{CLIENT_TRACE}-{span_id}-01"]
        assert sent.header_values("tracestate") == ["vendor=client"]
        assert sent.header_values("baggage") == ["tenant=t1"]  # passed on as received
        # Exemplars on TTFT and duration point at the trace.
        text, _ = app.metrics.exposition("application/openmetrics-text; version=1.0.0")
        exemplar = f'# {{span_id="{span_id}",trace_id="{CLIENT_TRACE}"}}'
        ttft_lines = [line for line in text.decode().splitlines()
                      if line.startswith(("llm_proxy_time_to_first_token_seconds_bucket",
                                          "llm_proxy_request_duration_seconds_bucket"))
                      and exemplar in line]
        assert {line.split("{", 1)[0] for line in ttft_lines} == {
            "llm_proxy_time_to_first_token_seconds_bucket",
            "llm_proxy_request_duration_seconds_bucket"}
        # No prompt, completion or key anywhere in what was exported.
        exported_bytes = b"".join(receiver.bodies)
        for secret in (b"PROMPT-TEXT", ANSWER.encode(), SECRET_KEY.encode(), b"tenant"):
            assert secret not in exported_bytes
    # The per-request log line (written by the time the app has shut down) names the same
    # trace and span.
    (line,) = log_file.read_text().splitlines()
    assert (json.loads(line)["trace_id"], json.loads(line)["span_id"]) == (CLIENT_TRACE, span_id)


async def test_non_stream_span(receiver: Receiver) -> None:
    clock = ScriptedClock(T0)
    up = completions_json(clock)
    app, _ = make_app(up, clock, otlp_endpoint=receiver.url, prefix_doctor=True)
    async with app:
        response = await post(app, COMPLETIONS, {"model": "m", "prompt": PROMPT},
                              {"authorization": f"Bearer {SECRET_KEY}"})
        assert response.status_code == 200
        (span,) = await exported(app, receiver)
        assert span.name == "text_completion m"
        assert span.parent_span_id == b""  # no traceparent from the client: a root span
        assert attrs(span.attributes) == {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "m",
            "gen_ai.request.stream": False,
            "gen_ai.response.id": "c1",
            "gen_ai.response.model": "m",
            "gen_ai.usage.input_tokens": 5,
            "gen_ai.usage.output_tokens": 4,
            "server.address": "127.0.0.1",
            SERVER_PORT_OF: int(app.upstream.host.rsplit(":", 1)[1]),
            "http.response.status_code": 200,
            "llm_proxy.queue_s": 0.0,
            "llm_proxy.overhead_s": 0.0,
            "llm_proxy.outcome": "completed",
            "llm_proxy.request_id": "req-plain",
            # No cached tokens in the usage: missed is unknown, so not on the span.
            "llm_proxy.prefix.prompt_bytes": len(PROMPT),
            "llm_proxy.prefix.repeated_bytes": 0,
            "llm_proxy.prefix.repeated_tokens": 0,
            "llm_proxy.prefix.break_reason": "first_seen",
        }
        assert list(span.events) == []
        assert span.end_time_unix_nano - span.start_time_unix_nano == 500_000_000
        _version, trace_id, parent_id, flags = up.seen[0].header("traceparent").split("-")  # type: ignore[union-attr]
        assert (trace_id, parent_id) == (hexid(span.trace_id), hexid(span.span_id))
        assert int(flags, 16) & 1  # sampled (the SDK may add the random-trace-id flag)
        exported_bytes = b"".join(receiver.bodies)
        for secret in (b"PROMPT-TEXT", ANSWER.encode(), SECRET_KEY.encode()):
            assert secret not in exported_bytes


async def test_upstream_error_span_says_so(receiver: Receiver) -> None:
    clock = ScriptedClock(T0)

    app, _ = make_app(json_upstream(503, b'{"error":{"message":"busy"}}'), clock, otlp_endpoint=receiver.url)
    async with app:
        response = await post(app, CHAT, chat_request())
        assert response.status_code == 503
        (span,) = await exported(app, receiver)
        got = attrs(span.attributes)
        assert got["error.type"] == "503"
        assert got["llm_proxy.outcome"] == "upstream_5xx"
        assert span.status.code == span.status.STATUS_CODE_ERROR


async def test_a_malformed_traceparent_starts_a_new_trace(receiver: Receiver) -> None:
    clock = ScriptedClock(T0)
    up = chat_stream(clock)
    app, _ = make_app(up, clock, otlp_endpoint=receiver.url)
    async with app:
        response = await post(app, CHAT, chat_request(), {"traceparent": "00-zz-yy-01"})
        assert response.status_code == 200
        (span,) = await exported(app, receiver)
        assert span.parent_span_id == b""
        assert up.seen[0].header("traceparent").split("-")[1:3] == [  # type: ignore[union-attr]
            hexid(span.trace_id), hexid(span.span_id)]


async def test_no_propagation_leaves_the_client_headers_untouched(receiver: Receiver) -> None:
    clock = ScriptedClock(T0)
    up = chat_stream(clock)
    app, _ = make_app(up, clock, otlp_endpoint=receiver.url, propagate_trace=False)
    async with app:
        await post(app, CHAT, chat_request(), CLIENT_HEADERS)
        (span,) = await exported(app, receiver)
        assert hexid(span.parent_span_id) == CLIENT_PARENT  # still the client's child
        assert up.seen[0].header_values("traceparent") == [TRACEPARENT]
        assert up.seen[0].header_values("tracestate") == ["vendor=client"]


# ---------------------------------------------------------------------------
# Sampling, exemplars without a trace, off switches


@pytest.mark.parametrize(("sampler", "arg", "expected"), [
    ("always_on", None, 3), ("always_off", None, 0),
    ("traceidratio", "1.0", 3), ("traceidratio", "0", 0)])
async def test_sampling(receiver: Receiver, monkeypatch: pytest.MonkeyPatch, sampler: str,
                        arg: str | None, expected: int) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    if arg is not None:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    clock = ScriptedClock(T0)
    up = chat_stream(clock)
    app, _ = make_app(up, clock, otlp_endpoint=receiver.url)
    async with app:
        for _ in range(3):
            assert (await post(app, CHAT, chat_request())).status_code == 200
        assert len(await exported(app, receiver)) == expected
        sampled = {int(seen.header("traceparent")[-2:], 16) & 1  # type: ignore[index]
                   for seen in up.seen}
        assert sampled == {1 if expected else 0}  # the decision travels upstream
        text, _ = app.metrics.exposition("application/openmetrics-text; version=1.0.0")
        ttft = [line for line in text.decode().splitlines()
                if line.startswith("llm_proxy_time_to_first_token_seconds_bucket") and " # " in line]
        assert ttft
        if expected:
            assert all("trace_id=" in line for line in ttft)
        else:  # not sampled: no trace to point at, the request id as before
            assert all('request_id="req-stream"' in line and "trace_id" not in line
                       for line in ttft)


async def test_parent_based_sampler_follows_the_client(receiver: Receiver,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    clock = ScriptedClock(T0)
    app, _ = make_app(chat_stream(clock), clock, otlp_endpoint=receiver.url)
    async with app:
        await post(app, CHAT, chat_request(), {"traceparent": TRACEPARENT})  # sampled parent
        await post(app, CHAT, chat_request())  # a root: ratio 0
        spans = await exported(app, receiver)
        assert [hexid(s.trace_id) for s in spans] == [CLIENT_TRACE]


async def test_exporter_down_the_proxy_keeps_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    clock = ScriptedClock(T0)
    app, _ = make_app(chat_stream(clock), clock,
                      otlp_endpoint=f"http://127.0.0.1:{closed_port()}")
    async with app:
        for _ in range(3):
            response = await post(app, CHAT, chat_request())
            assert response.status_code == 200
            assert ANSWER.encode() in response.content
        assert app.tracing is not None
        await asyncio.to_thread(app.tracing.provider.force_flush, 5000)  # fails within its timeout
        assert (await post(app, CHAT, chat_request())).status_code == 200


async def test_a_collector_that_refuses_is_one_line_per_outage_and_one_when_it_is_back(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The exporter's own retry and failure lines (four of over 250 characters per
    batch) are replaced by one line when exports start failing and one when they work
    again; three failed exports in between say nothing more."""
    # One retry within the timeout: its line carries the reason, as with the default 10 s.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "2")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # exports happen at each flush
    port = closed_port()
    clock = ScriptedClock(T0)
    app, _ = make_app(chat_stream(clock), clock, otlp_endpoint=f"http://127.0.0.1:{port}")
    caplog.set_level(logging.DEBUG)
    async with app:
        assert app.tracing is not None
        for _ in range(3):
            assert (await post(app, CHAT, chat_request())).status_code == 200
            await asyncio.to_thread(app.tracing.provider.force_flush, 5000)  # one failed export each
        with receiving(port) as collector:  # the collector comes up on its address
            assert (await post(app, CHAT, chat_request())).status_code == 200
            await asyncio.to_thread(app.tracing.provider.force_flush, 5000)
            with collector.lock:
                assert len(collector.spans) == 1
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in said] == [
        f"spans cannot be exported to http://127.0.0.1:{port} ([Errno 111] Connection "
        "refused); the exporter keeps trying and drops what it cannot send; one line when it "
        "works again",
        f"spans reach http://127.0.0.1:{port} again (3 exports failed meanwhile)"]


@pytest.mark.e2e
async def test_collector_down_at_sigterm_the_stop_waits_at_most_two_seconds_for_it() -> None:
    """``serve`` with tracing on and the collector refusing connections, stopped with
    nothing in flight while spans are queued: the last export gets its bounded wait
    instead of the exporter's retries (about 7 s for each of two rounds), and the log
    gets one line, not four long lines per batch."""
    dead = f"http://127.0.0.1:{closed_port()}"
    async with proxy_process(f"http://127.0.0.1:{closed_port()}", "--otlp-endpoint", dead) as (
            proc, port, out):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(3):  # each a span (the upstream is down too: 502s, fast)
                response = await client.post(CHAT, json=chat_request())
                assert response.status_code == 502
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(proc.wait, 30) == 0
        took = time.monotonic() - started
    text = "".join(out)
    assert took < otlp_export.SHUTDOWN_WAIT_S + 3.0, (took, text)
    assert [line for line in out if "cannot be exported" in line] == [
        f"WARNING:  spans cannot be exported to {dead} ([Errno 111] Connection refused); the "
        "exporter keeps trying and drops what it cannot send; one line when it works again\n"]
    assert "Transient error" not in text and "Failed to export" not in text, text


@pytest.mark.parametrize(("env", "words"), [
    ({}, "every request (parentbased_always_on)"),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
     "ratio 0.1 (parentbased_traceidratio)"),
    ({"OTEL_TRACES_SAMPLER": "TraceIdRatio", "OTEL_TRACES_SAMPLER_ARG": "x"},
     "ratio 1 (traceidratio)"),  # the SDK's reading: a bad ratio is 1.0
    ({"OTEL_TRACES_SAMPLER": "always_off"}, "no request (always_off)"),
    ({"OTEL_TRACES_SAMPLER": "nonsense"}, "every request (parentbased_always_on)"),
])
def test_the_start_up_line_says_the_sampling_in_the_operators_words(
        env: dict[str, str], words: str) -> None:
    assert sampling(env) == words


def test_outage_lines_are_rate_limited_when_the_collector_comes_and_goes(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    watch = otlp_export.ExportWatch("spans", "http://c", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="proxy")
    for t, ok in ((0, False), (1, False), (5, True), (10, False), (11, True), (70, False),
                  (71, True)):
        now[0] = float(t)
        watch.note(ok, "[Errno 111] Connection refused")
    assert [r.getMessage()[:30] for r in caplog.records] == [
        "spans cannot be exported to ht", "spans reach http://c again (2 ",  # at 0 and 5
        "spans cannot be exported to ht", "spans reach http://c again (1 "]  # at 70, 71


@pytest.mark.parametrize(("text", "reason"), [
    ("HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded with url: /v1/traces "
     "(Caused by NewConnectionError(\"HTTPConnection(host='127.0.0.1', port=1): Failed to "
     "establish a new connection: [Errno 111] Connection refused\"))",
     "[Errno 111] Connection refused"),
    ("Service Unavailable", "Service Unavailable"),
    ("x" * 300, "x" * 117 + "..."),
])
def test_the_reason_is_the_part_a_person_needs(text: str, reason: str) -> None:
    assert otlp_export.short_reason(text) == reason


async def test_resource_and_service_name(receiver: Receiver,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=test")
    clock = ScriptedClock(T0)
    app, _ = make_app(chat_stream(clock), clock, otlp_endpoint=receiver.url)
    async with app:
        await post(app, CHAT, chat_request())
        await exported(app, receiver)
        assert receiver.resources[0]["service.name"] == "llm-latency-proxy"
        assert receiver.resources[0]["deployment.environment.name"] == "test"
        # the conventions' version the attribute names follow, for a backend to translate
        assert receiver.schemas == {"https://opentelemetry.io/schemas/1.44.0"}
    monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-proxy")
    assert _service(receiver.url) == "edge-proxy"


def spans(otlp_endpoint: str = "", env: dict[str, str] | None = None) -> Tracing | None:
    """:func:`tracing_from` as the app calls it, for the default settings but these."""
    return tracing_from(otlp_endpoint=otlp_endpoint, upstream="http://127.0.0.1:8000/v1",
                        propagate=True, clock=lambda: 0.0, env=env or {})


def _service(url: str) -> str:
    tracing = spans(url)
    assert tracing is not None
    try:
        return str(tracing.provider.resource.attributes["service.name"])
    finally:
        tracing.shutdown()


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert spans() is None
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"}
    tracing = spans(env=env)
    assert tracing is not None
    tracing.shutdown()
    assert spans(env={**env, "OTEL_SDK_DISABLED": "true"}) is None
    assert wanted("", {**env, "OTEL_SDK_DISABLED": "TRUE"}) == ""
    assert wanted("http://a:4318", env) == "http://a:4318"


def test_settings_round_trip_through_the_workers_environment() -> None:
    """``serve --workers`` writes every setting back as its variable, unset ones too."""
    for settings in (Settings(), Settings(otlp_endpoint="http://collector:4318",
                                          propagate_trace=False, otlp_metrics=True,
                                          metrics_linger=30)):
        environ: dict[str, str] = {}
        export_settings(settings, environ)
        assert from_sources(environ=environ) == settings
    with pytest.raises(SettingsError, match="LLM_PROXY_OTLP_ENDPOINT"):
        from_sources(environ={"LLM_PROXY_OTLP_ENDPOINT": "collector:4318"})


def test_without_the_packages_one_line_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules,
                        "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("proxy")
    logger.addHandler(handler)
    try:
        assert spans("http://127.0.0.1:1") is None
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records if "tracing off" in r.getMessage()]
    assert len(lines) == 1
    assert "llm-latency-proxy[otel]" in lines[0]


async def test_tracing_off_sends_the_client_headers_unchanged() -> None:
    clock = ScriptedClock(T0)
    up = chat_stream(clock)
    app, _ = make_app(up, clock)
    async with app:
        assert app.tracing is None
        await post(app, CHAT, chat_request(), {"traceparent": TRACEPARENT})
        assert up.seen[0].header_values("traceparent") == [TRACEPARENT]


# ---------------------------------------------------------------------------
# The other two APIs: names per the conventions, their own timings and tokens


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_messages_and_responses_spans(receiver: Receiver, api: str) -> None:
    clock = ScriptedClock(T0)
    if api == "messages":
        route, provider = MESSAGES, "anthropic"
        script, r_times, a_times = messages_script(2, 3)
    else:
        route, provider = RESPONSES, "openai"
        script, r_times, a_times = responses_script(2, 3)
    up = dialect_upstream(clock, script)
    app, registry = make_app(up, clock, otlp_endpoint=receiver.url)
    async with app:
        payload = {"model": "m", "stream": True, "max_tokens": 8,
                   "messages": [{"role": "user", "content": PROMPT}]}
        if api == "responses":
            payload = {"model": "m", "stream": True, "input": PROMPT}
        response = await post(app, route, payload, CLIENT_HEADERS)
        assert response.status_code == 200
        (span,) = await exported(app, receiver)
        got = attrs(span.attributes)
        assert span.name == "chat m"
        assert got["gen_ai.operation.name"] == "chat"
        assert got["gen_ai.provider.name"] == provider
        assert got["llm_proxy.ttft_s"] == r_times[0] - T0
        assert got["llm_proxy.ttfa_s"] == a_times[0] - T0
        assert got["llm_proxy.ttft_s"] == registry.get_sample_value(
            "llm_proxy_time_to_first_token_seconds_sum",
            {"route": route, "model": "m", "upstream": "upstream.test:8000"})
        tokens = {k: v for k, v in got.items() if k.startswith("gen_ai.usage.")}
        if api == "messages":
            assert tokens == {"gen_ai.usage.input_tokens": 45,
                              "gen_ai.usage.cache_read.input_tokens": 30,
                              "gen_ai.usage.cache_creation.input_tokens": 5,
                              "gen_ai.usage.output_tokens": 5}
        else:
            assert tokens["gen_ai.usage.output_tokens"] >= 1
        assert "error.type" not in got
        assert hexid(span.parent_span_id) == CLIENT_PARENT
        assert up.seen[0].header_values("traceparent") == [
            f"00-{CLIENT_TRACE}-{hexid(span.span_id)}-01"]
        exported_bytes = b"".join(receiver.bodies)
        for secret in (b"PROMPT-TEXT", b"w0 ", SECRET_KEY.encode()):
            assert secret not in exported_bytes


async def test_error_event_inside_a_200_stream(receiver: Receiver) -> None:
    clock = ScriptedClock(T0)
    script, _, _ = messages_script(0, 2, error=True)
    app, _ = make_app(dialect_upstream(clock, script), clock, otlp_endpoint=receiver.url)
    async with app:
        response = await post(app, MESSAGES, {"model": "m", "stream": True, "max_tokens": 8,
                                              "messages": [{"role": "user", "content": "x"}]})
        assert response.status_code == 200
        (span,) = await exported(app, receiver)
        got = attrs(span.attributes)
        assert (got["http.response.status_code"], got["error.type"]) == (200, "upstream_error")
        assert span.status.code == span.status.STATUS_CODE_ERROR


# ---------------------------------------------------------------------------
# The real command, configured by the standard environment only


@pytest.mark.e2e
async def test_serve_with_standard_env_exports_at_shutdown(
        receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m proxy serve`` with ``OTEL_EXPORTER_OTLP_ENDPOINT`` only (and
    ``OTEL_METRICS_EXPORTER=otlp`` for the OTLP metrics), in front of the simulator: a
    batch delay and an export interval longer than the test prove that SIGTERM exports
    what is still queued, and the start-up log says tracing and OTLP metrics are on."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "e2e-proxy")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")
    config = SimConfig(prefill_rate=1e9, prefill_overhead=0.01, itl=0.001, itl_growth=0.0,
                       jitter=0.0, output_tokens=4, output_dist="fixed", seed=3)
    with serve_in_thread(create_simulator_app(config)) as sim:
        async with proxy_process(sim.url) as (proc, port, out):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                response = await client.post(
                    CHAT, json={"model": "sim", "stream": True,
                                "messages": [{"role": "user", "content": PROMPT}]},
                    headers={"traceparent": TRACEPARENT,
                             "authorization": f"Bearer {SECRET_KEY}"})
                assert response.status_code == 200
            with receiver.lock:
                assert receiver.spans == []  # still in the batch
                assert receiver.metrics == []  # before the first export interval
            proc.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(proc.wait, 20) == 0
    banner = [line for line in out if "relaying" in line]
    assert (f"; tracing: on, every request (parentbased_always_on) -> {receiver.url}, "
            "service e2e-proxy;") in banner[0]
    assert banner[0].rstrip().endswith(
        f"; OTLP metrics: OTLP/HTTP to {receiver.url}/v1/metrics, every 600 s")
    with receiver.lock:
        (exported_metrics,) = receiver.metrics
    ttft_metric = next(m for m in exported_metrics if m.name == "gen_ai.server.time_to_first_token")
    ((point_attrs, point),) = points(ttft_metric)
    assert (point.count, point_attrs["gen_ai.request.model"]) == (1, "sim")
    with receiver.lock:
        (span,) = receiver.spans
        resource = receiver.resources[0]
    assert resource["service.name"] == "e2e-proxy"
    got = attrs(span.attributes)
    assert (span.name, hexid(span.trace_id), hexid(span.parent_span_id)) == (
        "chat sim", CLIENT_TRACE, CLIENT_PARENT)
    assert got["gen_ai.usage.output_tokens"] == 4
    assert 0 < got["llm_proxy.ttft_s"] <= got["llm_proxy.ttfa_s"] < got["llm_proxy.ttft_s"] + 1
    assert point.sum == got["llm_proxy.ttft_s"]  # the same measurement, both ways
    assert (got["gen_ai.response.model"], got["gen_ai.response.finish_reasons"]) == ("sim", ["stop"])
    for secret in (b"PROMPT-TEXT", SECRET_KEY.encode()):
        assert secret not in b"".join(receiver.bodies)


async def test_a_refused_request_is_a_span_too(receiver: Receiver) -> None:
    """The proxy answers 413 itself: nothing reaches the upstream, the span says why."""
    clock = ScriptedClock(T0)
    up = chat_stream(clock)
    app, _ = make_app(up, clock, otlp_endpoint=receiver.url, max_body_bytes=1024)
    async with app:
        response = await post(app, CHAT, chat_request(), {"traceparent": TRACEPARENT})
        assert response.status_code == 413
        (span,) = await exported(app, receiver)
        assert up.seen == []
        assert span.name == "chat"  # the body was never read: no model
        assert hexid(span.parent_span_id) == CLIENT_PARENT
        got = attrs(span.attributes)
        assert {k: got[k] for k in ("http.response.status_code", "error.type",
                                    "llm_proxy.outcome")} == {
            "http.response.status_code": 413, "error.type": "413",
            "llm_proxy.outcome": "rejected"}
        assert "gen_ai.request.model" not in got


# ---------------------------------------------------------------------------
# gen_ai.response.*: what the upstream said about its answer, for every API


CHAT_ID, CHAT_MODEL = "chatcmpl-B7", "gpt-4o-2024-08-06"
USAGE_4_3 = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def compact_chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    return sse({"id": CHAT_ID, "object": "chat.completion.chunk", "created": 1,
                "model": CHAT_MODEL, "choices": choices, **extra}, compact=True)


def choice(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}


def chat_script(layout: str) -> list[tuple[float, bytes]]:
    """OpenAI ends with an empty-delta chunk holding the reason; vLLM puts the reason
    on the last token's chunk. Both then send the usage chunk and [DONE]."""
    script = [(T0 + 0.25, compact_chunk([choice({"role": "assistant", "content": ""})])),
              (T0 + 0.5, compact_chunk([choice({"content": "one "})])),
              (T0 + 0.625, compact_chunk([choice({"content": "two "})]))]
    if layout == "openai":
        script += [(T0 + 0.75, compact_chunk([choice({"content": "three"})])),
                   (T0 + 0.875, compact_chunk([choice({}, "length")]))]
    else:
        script += [(T0 + 0.75, compact_chunk([choice({"content": "three"}, "length",
                                                     stop_reason=None)]))]
    return [*script, (T0 + 1.0, compact_chunk([], usage=USAGE_4_3)),
            (T0 + 1.125, b"data: [DONE]\n\n")]


def completions_script() -> list[tuple[float, bytes]]:
    def text_chunk(text: str, finish: str | None = None) -> bytes:
        return sse({"id": "cmpl-C1", "object": "text_completion", "created": 1,
                    "model": "gpt-3.5-turbo-instruct", "choices": [
                        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]},
                   compact=True)

    return [(T0 + 0.5, text_chunk("one ")), (T0 + 0.625, text_chunk("two")),
            (T0 + 0.75, text_chunk("", "stop")), (T0 + 0.875, b"data: [DONE]\n\n")]


def responses_incomplete_script() -> list[tuple[float, bytes]]:
    """A Responses stream cut by max_output_tokens: response.incomplete says why."""
    script, _, _ = responses_script(0, 3, end="response.incomplete")
    at, _ = script[-1]
    final = {"id": "resp_9", "object": "response", "status": "incomplete",
             "model": "gpt-4.1-2025-04-14",
             "incomplete_details": {"reason": "max_output_tokens"},
             "usage": {"input_tokens": 40, "output_tokens": 3, "total_tokens": 43}}
    return [*script[:-1], (at, dialect_event("response.incomplete",
                                             {"response": final, "sequence_number": 99}))]


STREAMS = {  # route, script, (id, model, finish reasons)
    "chat-openai": (CHAT, lambda: chat_script("openai"), (CHAT_ID, CHAT_MODEL, ["length"])),
    "chat-vllm": (CHAT, lambda: chat_script("vllm"), (CHAT_ID, CHAT_MODEL, ["length"])),
    "completions": (COMPLETIONS, completions_script,
                    ("cmpl-C1", "gpt-3.5-turbo-instruct", ["stop"])),
    "responses": (RESPONSES, responses_incomplete_script,
                  ("resp_9", "gpt-4.1-2025-04-14", ["max_output_tokens"])),
    "messages": (MESSAGES, lambda: messages_script(1, 2)[0], ("msg_1", "m", ["end_turn"])),
}


def request_for(route: str, stream: bool) -> dict[str, Any]:
    if route == RESPONSES:
        return {"model": "m", "stream": stream, "input": PROMPT}
    if route == COMPLETIONS:
        return {"model": "m", "stream": stream, "prompt": PROMPT}
    return {"model": "m", "stream": stream, "max_tokens": 8,
            "messages": [{"role": "user", "content": PROMPT}]}


RESPONSE_KEYS = ("gen_ai.response.id", "gen_ai.response.model",
                 "gen_ai.response.finish_reasons")


@pytest.mark.parametrize("name", list(STREAMS))
async def test_stream_span_names_the_response(receiver: Receiver, name: str) -> None:
    route, script, expected = STREAMS[name]
    clock = ScriptedClock(T0)
    events = script()
    up = sse_upstream(clock, events, headers_at=T0 + 0.125, end=events[-1][0] + 0.125)
    app, registry = make_app(up, clock, otlp_endpoint=receiver.url)
    async with app:
        response = await post(app, route, request_for(route, True))
        assert response.status_code == 200
        (span,) = await exported(app, receiver)
        got = attrs(span.attributes)
        assert tuple(got.get(k) for k in RESPONSE_KEYS) == expected
        assert got["llm_proxy.outcome"] == "completed"
        assert got["llm_proxy.ttft_s"] == registry.get_sample_value(
            "llm_proxy_time_to_first_token_seconds_sum",
            {"route": route, "model": "m", "upstream": "upstream.test:8000"})


NON_STREAM = {  # route, body, (id, model, finish reasons)
    "chat": (CHAT, {"id": "chatcmpl-N1", "object": "chat.completion", "created": 1,
                    "model": CHAT_MODEL, "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "a"},
                         "finish_reason": "stop"},
                        {"index": 1, "message": {"role": "assistant", "content": "b"},
                         "finish_reason": "length"}], "usage": USAGE_4_3},
             ("chatcmpl-N1", CHAT_MODEL, ["stop", "length"])),
    "completions": (COMPLETIONS, {"id": "cmpl-N2", "object": "text_completion", "created": 1,
                                  "model": "gpt-3.5-turbo-instruct", "choices": [
                                      {"index": 0, "text": "a", "logprobs": None,
                                       "finish_reason": "length"}], "usage": USAGE_4_3},
                    ("cmpl-N2", "gpt-3.5-turbo-instruct", ["length"])),
    "responses": (RESPONSES, {"id": "resp_N3", "object": "response", "status": "completed",
                              "model": "gpt-4.1-2025-04-14", "incomplete_details": None,
                              "output": [], "usage": {"input_tokens": 4, "output_tokens": 3}},
                  ("resp_N3", "gpt-4.1-2025-04-14", ["completed"])),
    "messages": (MESSAGES, {"id": "msg_N4", "type": "message", "role": "assistant",
                            "model": "claude-sonnet-4-5", "content": [],
                            "stop_reason": "max_tokens", "stop_sequence": None,
                            "usage": {"input_tokens": 4, "output_tokens": 3}},
                 ("msg_N4", "claude-sonnet-4-5", ["max_tokens"])),
}


@pytest.mark.parametrize("name", list(NON_STREAM))
async def test_non_stream_span_names_the_response(receiver: Receiver, name: str) -> None:
    route, body, expected = NON_STREAM[name]
    clock = ScriptedClock(T0)
    app, _ = make_app(json_upstream(200, json.dumps(body).encode()), clock,
                      otlp_endpoint=receiver.url)
    async with app:
        response = await post(app, route, request_for(route, False))
        assert response.status_code == 200
        (span,) = await exported(app, receiver)
        got = attrs(span.attributes)
        assert tuple(got.get(k) for k in RESPONSE_KEYS) == expected
        assert got["gen_ai.usage.output_tokens"] == 3


async def test_response_attributes_are_never_metric_labels(receiver: Receiver) -> None:
    clock = ScriptedClock(T0)
    events = chat_script("openai")
    up = sse_upstream(clock, events, headers_at=T0 + 0.125, end=T0 + 1.25)
    app, _ = make_app(up, clock, otlp_endpoint=receiver.url)
    async with app:
        await post(app, CHAT, request_for(CHAT, True))
        text, _ = app.metrics.exposition("application/openmetrics-text; version=1.0.0")
        for said in (CHAT_ID, CHAT_MODEL):
            assert said not in text.decode()
        # the finish reason only as one of a fixed set of values, in its one counter
        for line in text.decode().splitlines():
            if "length" in line:
                assert line.startswith(("# HELP llm_proxy_finish_reasons ",
                                        "llm_proxy_finish_reasons_total{",
                                        "llm_proxy_finish_reasons_created{")), line


# ---------------------------------------------------------------------------
# OTLP metrics (--otlp-metrics): the GenAI instruments, decoded as a Collector would


async def exported_metrics(app: InProcess, receiver: Receiver) -> dict[str, Metric]:
    """The metrics of the proxy's latest export, by name, after a forced export."""
    assert app.otel_metrics is not None
    assert await asyncio.to_thread(app.otel_metrics.provider.force_flush)
    with receiver.lock:
        return {m.name: m for m in receiver.metrics[-1]}


def points(metric: Metric) -> list[tuple[dict[str, Any], Any]]:
    return [(attrs(p.attributes), p) for p in metric.histogram.data_points]


async def test_otlp_metrics_names_units_buckets_and_the_measured_values(
        receiver: Receiver) -> None:
    clock = ScriptedClock(T0)
    up = chat_stream(clock)
    app, registry = make_app(up, clock, otlp_endpoint=receiver.url, otlp_metrics=True)
    async with app:
        assert (await post(app, CHAT, chat_request())).status_code == 200
        got = await exported_metrics(app, receiver)
        lbl = {"route": CHAT, "model": "m", "upstream": "upstream.test:8000"}
        ttft = registry.get_sample_value("llm_proxy_time_to_first_token_seconds_sum", lbl)
        tpot = registry.get_sample_value("llm_proxy_time_per_output_token_seconds_sum", lbl)
        duration = registry.get_sample_value(
            "llm_proxy_request_duration_seconds_sum", {**lbl, "stream": "true"})
        assert (ttft, tpot, duration) == (0.5, 0.125, 1.5)
        port = int(app.upstream.host.rsplit(":", 1)[1])
        base = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "m", "gen_ai.response.model": "m",
                "server.address": "127.0.0.1", SERVER_PORT_OF: port}
        expected = {  # name: (unit, bucket advice, [(attributes, value)])
            "gen_ai.server.time_to_first_token": (
                "s", [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                      2.5, 5.0, 7.5, 10.0], [(base, ttft)]),
            "gen_ai.server.time_per_output_token": (
                "s", [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5],
                [(base, tpot)]),
            "gen_ai.server.request.duration": (
                "s", [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                      20.48, 40.96, 81.92], [(base, duration)]),
            "gen_ai.client.token.usage": (
                "{token}", [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576,
                            4194304, 16777216, 67108864],
                [({**base, "gen_ai.token.type": "input"}, 7),
                 ({**base, "gen_ai.token.type": "output"}, 3)]),
        }
        assert set(got) == set(expected)
        for name, (unit, bounds, values) in expected.items():
            metric = got[name]
            assert metric.unit == unit, name
            assert metric.histogram.aggregation_temporality == 2  # cumulative
            seen = sorted(((a, p.count, p.sum, list(p.explicit_bounds), list(p.bucket_counts))
                           for a, p in points(metric)), key=repr)
            want = sorted(((a, 1, float(v), [float(b) for b in bounds],
                            [1 if i == next(j for j, b in enumerate([*bounds, math.inf])
                                            if v <= b) else 0
                             for i in range(len(bounds) + 1)]) for a, v in values), key=repr)
            assert seen == want, name
        with receiver.lock:
            resource = receiver.metric_resources[-1]
            assert receiver.schemas == {"https://opentelemetry.io/schemas/1.44.0"}
        assert resource["service.name"] == "llm-latency-proxy"
        assert resource["service.instance.id"]


async def test_otlp_metrics_failed_request_has_error_type_and_no_ttft(
        receiver: Receiver) -> None:
    clock = ScriptedClock(T0)
    app, _ = make_app(json_upstream(503, b'{"error":{"message":"busy"}}'), clock,
                      otlp_endpoint=receiver.url, otlp_metrics=True)
    async with app:
        assert (await post(app, CHAT, chat_request())).status_code == 503
        got = await exported_metrics(app, receiver)
        assert set(got) == {"gen_ai.server.request.duration"}
        ((a, point),) = points(got["gen_ai.server.request.duration"])
        assert (a["error.type"], a["gen_ai.request.model"], point.count) == ("503", "m", 1)
        assert "gen_ai.response.model" not in a


def test_otlp_metrics_off_unless_asked() -> None:
    assert not otel_metrics.wanted(False, {})
    assert otel_metrics.wanted(True, {})
    assert otel_metrics.wanted(False, {"OTEL_METRICS_EXPORTER": "otlp"})
    assert not otel_metrics.wanted(False, {"OTEL_METRICS_EXPORTER": "prometheus"})
    assert not otel_metrics.wanted(True, {"OTEL_METRICS_EXPORTER": "none"})
    assert not otel_metrics.wanted(True, {"OTEL_SDK_DISABLED": "true"})
    assert otel_metrics.otel_metrics_from(otlp_metrics=False, otlp_endpoint="", measure=True,
                                          upstream="http://u/v1", max_models=1, env={}) is None
    assert otel_metrics.endpoint("http://c:4318/", {}) == "http://c:4318/v1/metrics"
    assert otel_metrics.endpoint("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:1"}) == (
        "http://c:1/v1/metrics")
    assert otel_metrics.endpoint("", {}) == "http://localhost:4318/v1/metrics"


def test_a_break_names_its_part_and_role_on_the_span_as_in_the_log() -> None:
    """A changed setting: the part is ``settings`` and the role the setting's name (never
    its value), as the request log's ``prefix_break_role`` says."""
    found = PrefixRecord(4000, 0, "settings_changed", "settings", 0, 0, "response_format",
                         rules=TokenRules(4000, 0, False, 0, 1))
    attributes = prefix_attributes(found, 1000, 0)
    assert attributes["llm_proxy.prefix.break_part"] == "settings"
    assert attributes["llm_proxy.prefix.break_role"] == "response_format"
    assert attributes["llm_proxy.prefix.break_index"] == 0
