"""OpenTelemetry tracing: one span per measured request, filled from its record.

Design: ``docs/design/opentelemetry.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from proxy.measure import Outcome, PrefixRecord, RequestRecord
from proxy.otlp_export import Exporting

if TYPE_CHECKING:
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("proxy")

# Every attribute name the span carries. GenAI and general semantic conventions first,
# then the proxy's own measurements (``llm_proxy.*``, seconds).
ATTR = {
    "operation": "gen_ai.operation.name",
    "provider": "gen_ai.provider.name",
    "request_model": "gen_ai.request.model",
    "stream": "gen_ai.request.stream",
    "response_id": "gen_ai.response.id",
    "response_model": "gen_ai.response.model",
    "finish_reasons": "gen_ai.response.finish_reasons",
    "input_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "cache_read_tokens": "gen_ai.usage.cache_read.input_tokens",
    "cache_creation_tokens": "gen_ai.usage.cache_creation.input_tokens",
    "reasoning_tokens": "gen_ai.usage.reasoning.output_tokens",
    "time_to_first_chunk": "gen_ai.response.time_to_first_chunk",
    "server_address": "server.address",
    "server_port": "server.port",
    "status_code": "http.response.status_code",
    "error_type": "error.type",
    "ttft": "llm_proxy.ttft_s",
    "ttfa": "llm_proxy.ttfa_s",
    "queue": "llm_proxy.queue_s",
    "overhead": "llm_proxy.overhead_s",
    "outcome": "llm_proxy.outcome",
    "request_id": "llm_proxy.request_id",
    "tokens_estimated": "llm_proxy.tokens_estimated",
    # The prompt-cache doctor (proxy.doctor.job): sizes, positions, bounded names.
    "prompt_bytes": "llm_proxy.prefix.prompt_bytes",
    "repeated_bytes": "llm_proxy.prefix.repeated_bytes",
    "repeated_tokens": "llm_proxy.prefix.repeated_tokens",
    "missed_tokens": "llm_proxy.prefix.missed_tokens",
    "missed_unmarked_tokens": "llm_proxy.prefix.missed_unmarked_tokens",
    "break_reason": "llm_proxy.prefix.break_reason",
    "break_part": "llm_proxy.prefix.break_part",
    "break_index": "llm_proxy.prefix.break_index",
    "break_role": "llm_proxy.prefix.break_role",
    "break_offset": "llm_proxy.prefix.break_offset",
    "unchecked": "llm_proxy.prefix.unchecked",
}
# The semantic conventions' version the gen_ai.* names above follow (docs/opentelemetry.md),
# sent as the instrumentation scope's schema URL, spans' and metrics' alike.
SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
EVENT_FIRST_BYTE = "llm_proxy.first_byte"
EVENT_FIRST_TOKEN = "llm_proxy.first_token"
EVENT_FIRST_ANSWER_TOKEN = "llm_proxy.first_answer_token"

# gen_ai.operation.name and gen_ai.provider.name per dialect name (proxy.dialects).
OPERATION = {
    "chat": "chat",
    "completions": "text_completion",
    "responses": "chat",
    "messages": "chat",
}
PROVIDER = {
    "chat": "openai",
    "completions": "openai",
    "responses": "openai",
    "messages": "anthropic",
}
SERVICE_NAME = "llm-latency-proxy"
TRACE_HEADERS = (b"traceparent", b"tracestate", b"baggage")
_MODEL_MAX = 256  # a model name is the client's text: bounded in the span name


@dataclass(slots=True)
class RequestSpan:
    """One request's span. ``trace_id``/``span_id`` are hex, empty when the span is not
    sampled (then no exemplar points at a trace that was never exported)."""

    span: Span
    start_ns: int
    operation: str
    trace_id: str
    span_id: str


class Tracing(Exporting):
    """Spans for measured requests; built once by :func:`tracing_from`."""

    def __init__(
        self,
        provider: TracerProvider,
        *,
        clock: Callable[[], float],
        upstream: str,
        propagate: bool,
    ) -> None:
        from opentelemetry import trace
        from opentelemetry.baggage.propagation import W3CBaggagePropagator
        from opentelemetry.propagators.composite import CompositePropagator
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        super().__init__(provider)
        self.tracer: Tracer = provider.get_tracer("proxy.tracing", schema_url=SCHEMA_URL)
        self.clock = clock
        self.propagate = propagate
        self._trace_api = trace
        self._extractor: TextMapPropagator = CompositePropagator(
            [TraceContextTextMapPropagator(), W3CBaggagePropagator()]
        )
        self._injector: TextMapPropagator = TraceContextTextMapPropagator()
        self._server = server_attributes(upstream)

    def start(self, headers: Sequence[tuple[bytes, bytes]], t0: float, dialect: str) -> RequestSpan:
        """The request's span, started at ``t0`` (request clock) as the child of the
        client's ``traceparent``, if any."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name in TRACE_HEADERS
        }
        context = self._extractor.extract(carrier) if carrier else None
        start_ns = time.time_ns() - round((self.clock() - t0) * 1e9)
        operation = OPERATION.get(dialect, dialect)
        attributes: dict[str, Any] = {
            ATTR["operation"]: operation,
            ATTR["provider"]: PROVIDER.get(dialect, "openai"),
            **self._server,
        }
        span = self.tracer.start_span(
            operation,
            context=context,
            kind=self._trace_api.SpanKind.CLIENT,
            attributes=attributes,
            start_time=start_ns,
        )
        ctx = span.get_span_context()
        sampled = ctx.trace_flags.sampled
        return RequestSpan(
            span,
            start_ns,
            operation,
            f"{ctx.trace_id:032x}" if sampled else "",
            f"{ctx.span_id:016x}" if sampled else "",
        )

    def inject(
        self, request_span: RequestSpan, headers: list[tuple[bytes, bytes]]
    ) -> list[tuple[bytes, bytes]]:
        """The upstream's headers with ``traceparent``/``tracestate`` naming the
        proxy's span; the client's are replaced. Unchanged with propagation off."""
        if not self.propagate:
            return headers
        carrier: dict[str, str] = {}
        self._injector.inject(
            carrier, context=self._trace_api.set_span_in_context(request_span.span)
        )
        if not carrier:
            return headers
        out = [(k, v) for k, v in headers if k not in (b"traceparent", b"tracestate")]
        out.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items())
        return out

    def finish(
        self,
        request_span: RequestSpan,
        record: RequestRecord,
        request_model: str,
        upstream: Mapping[str, Any] | None = None,
    ) -> None:
        """Fill the span from the record and end it at the record's end time.
        ``upstream``: the attributes of the upstream the request went to
        (:func:`upstream_attributes`), which the span's start could not know yet."""
        span = request_span.span
        if request_model:
            model = request_model[:_MODEL_MAX]
            span.update_name(f"{request_span.operation} {model}")
        if not span.is_recording():
            span.end()
            return
        a = _present(
            ("stream", record.stream),
            ("status_code", record.status),
            ("outcome", str(record.outcome)),
            ("request_id", record.request_id),
            ("request_model", request_model[:_MODEL_MAX] or None),
            ("response_id", record.response_id or None),
            ("response_model", record.response_model or None),
            ("finish_reasons", record.finish_reasons or None),
            ("input_tokens", record.prompt_tokens),
            ("output_tokens", record.completion_tokens),
            ("cache_read_tokens", record.cached_prompt_tokens),
            ("cache_creation_tokens", record.cache_write_tokens),
            ("reasoning_tokens", record.reasoning_tokens),
            ("time_to_first_chunk", record.ttfb_s),
            ("ttft", record.ttft_s),
            ("ttfa", record.ttfa_s),
            ("queue", record.queue_s),
            ("overhead", record.overhead_s),
            ("tokens_estimated", record.tokens_estimated or None),
        )
        if record.prefix is not None:
            a.update(prefix_attributes(record.prefix, record.prompt_tokens,
                                       record.cached_prompt_tokens))
        error = error_type(record)
        if error:
            a[ATTR["error_type"]] = error
            span.set_status(self._trace_api.Status(self._trace_api.StatusCode.ERROR))
        if upstream:
            a.update(upstream)
        span.set_attributes(a)
        start = request_span.start_ns
        for name, offset in (
            (EVENT_FIRST_BYTE, record.ttfb_s),
            (EVENT_FIRST_TOKEN, record.ttft_s),
            (EVENT_FIRST_ANSWER_TOKEN, record.ttfa_s),
        ):
            if offset is not None:
                span.add_event(name, timestamp=start + round(offset * 1e9))
        span.end(end_time=start + round(record.duration_s * 1e9))


def prefix_attributes(
    p: PrefixRecord, prompt_tokens: int | None, cached_tokens: int | None
) -> dict[str, Any]:
    """The prompt-cache doctor's finding as span attributes (no text: sizes, positions,
    the reason and the part's kind), its tokens at the request's usage; unknown values
    are left out. A request the doctor did not examine carries only why."""
    if p.unchecked:
        return {ATTR["unchecked"]: p.unchecked}
    repeated, missed, unmarked = p.tokens(prompt_tokens, cached_tokens)
    return _present(
        ("prompt_bytes", p.prompt_bytes),
        ("repeated_bytes", p.repeated_bytes),
        ("repeated_tokens", repeated),
        ("missed_tokens", missed),
        ("missed_unmarked_tokens", unmarked),
        ("break_reason", p.break_reason or None),
        ("break_part", p.break_part or None),
        ("break_index", p.break_index),
        ("break_role", p.break_role or None),
        ("break_offset", p.break_offset),
    )


def _present(*values: tuple[str, Any]) -> dict[str, Any]:
    """The attributes of the values that are known (not None), by :data:`ATTR` key."""
    return {ATTR[name]: value for name, value in values if value is not None}


def server_attributes(upstream: str) -> dict[str, Any]:
    """``server.address`` and ``server.port`` of the upstream URL."""
    parts = urlsplit(upstream)
    return {
        ATTR["server_address"]: parts.hostname or "",
        ATTR["server_port"]: parts.port or (443 if parts.scheme == "https" else 80),
    }


# gen_ai.provider.name for the hosts whose provider is certain; any other upstream keeps
# the value its API implies, unless the config file names it (``provider = "vllm"``).
KNOWN_PROVIDERS = {"api.openai.com": "openai", "api.anthropic.com": "anthropic"}


def upstream_attributes(url: str, provider: str = "") -> dict[str, Any]:
    """``server.address``/``server.port`` of an upstream and, when known, its
    ``gen_ai.provider.name``: computed once per upstream, set on each span and metric."""
    attributes = server_attributes(url)
    host = str(attributes[ATTR["server_address"]])
    name = provider or KNOWN_PROVIDERS.get(host, "")
    if not name and host.endswith(".openai.azure.com"):
        name = "azure.ai.openai"
    if name:
        attributes[ATTR["provider"]] = name
    return attributes


def error_type(record: RequestRecord) -> str:
    """``error.type``: the HTTP status sent when it is an error, else the outcome when the
    request did not complete (a stream cut short under a 200); empty on success."""
    if record.status >= 400:
        return str(record.status)
    if record.outcome is not Outcome.COMPLETED:
        return str(record.outcome)
    return ""


def otel_resource() -> Resource:
    """The process's resource, for spans and OTLP metrics alike: the standard variables
    (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``), service name
    ``llm-latency-proxy`` unless they name one, and a ``service.instance.id`` per process
    unless they give one, so that the cumulative metrics of ``--workers N`` processes
    (and of replicas) stay apart in the backend."""
    import uuid

    from opentelemetry.sdk.resources import Resource

    resource = Resource.create()
    extra: dict[str, str] = {}
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        extra["service.name"] = SERVICE_NAME
    if "service.instance.id" not in resource.attributes:
        extra["service.instance.id"] = str(uuid.uuid4())
    return resource.merge(Resource.create(extra)) if extra else resource


def wanted(otlp_endpoint: str, env: Mapping[str, str]) -> str:
    """Where spans should go: ``otlp_endpoint`` (``--otlp-endpoint``), else the standard
    OTLP variables; empty when tracing was not asked for or ``OTEL_SDK_DISABLED=true``."""
    if _disabled(env):
        return ""
    return _endpoint(otlp_endpoint, env)


def _endpoint(otlp_endpoint: str, env: Mapping[str, str]) -> str:
    return (
        otlp_endpoint
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    )


def _disabled(env: Mapping[str, str]) -> bool:
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def tracing_from(
    *,
    otlp_endpoint: str,
    upstream: str,
    propagate: bool,
    clock: Callable[[], float],
    env: Mapping[str, str],
) -> Tracing | None:
    """Tracing as configured, or None (and one warning line saying why when it was asked
    for; when it is on, the start-up line says where spans go).

    On when an OTLP endpoint is given (``otlp_endpoint``, from ``--otlp-endpoint``, or
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` in ``env``)
    unless ``OTEL_SDK_DISABLED=true``. Service name, resource attributes, sampler and
    batch settings come from the standard ``OTEL_*`` variables, read by the SDK itself.
    ``upstream``: the URL spans name before routing; ``propagate``: ``--propagate-trace``.
    """
    endpoint = _endpoint(otlp_endpoint, env)
    if not endpoint:
        return None
    if _disabled(env):
        log.warning("tracing off: an OTLP endpoint is set but OTEL_SDK_DISABLED=true")
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        log.warning(
            "tracing off: an OTLP endpoint is set but the OpenTelemetry packages are "
            "not installed (pip install 'llm-latency-proxy[otel]'): %s",
            exc,
        )
        return None
    from opentelemetry.sdk.trace.export import SpanExportResult

    from proxy import otlp_export

    resource = otel_resource()
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER(_ARG)
    exporter_class = otlp_export.watched(
        OTLPSpanExporter,
        otlp_export.ExportWatch("spans", endpoint),
        SpanExportResult.SUCCESS,
        SpanExportResult.FAILURE,
    )
    exporter = (
        exporter_class(endpoint=otlp_endpoint.rstrip("/") + "/v1/traces")
        if otlp_endpoint
        else exporter_class()
    )
    otlp_export.quiet(OTLPSpanExporter.__module__)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracing = Tracing(provider, clock=clock, upstream=upstream, propagate=propagate)
    tracing.stop_exporter = exporter.shutdown
    tracing.description = (
        f"on, {sampling(env)} -> {endpoint}, service {resource.attributes.get('service.name')}"
    )
    return tracing


# The samplers the SDK knows by name (OTEL_TRACES_SAMPLER); any other name is warned
# about by the SDK, which then uses its default, parentbased_always_on.
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


def sampling(env: Mapping[str, str]) -> str:
    """Which requests get a span, in the operator's words: ``ratio 0.1
    (parentbased_traceidratio)``, ``every request (parentbased_always_on)``. Read from
    ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` as the SDK reads them (an
    unknown name is the default, a ratio that is not a number is 1.0), rather than the
    SDK's own description of the sampler object, which spells out its internals."""
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if name not in SAMPLERS:
        name = "parentbased_always_on"
    if name.endswith("traceidratio"):
        try:
            ratio = float(env.get("OTEL_TRACES_SAMPLER_ARG", ""))
        except ValueError:
            ratio = 1.0
        what = f"ratio {ratio:g}"
    else:
        what = "no request" if name.endswith("always_off") else "every request"
    return f"{what} ({name})"
