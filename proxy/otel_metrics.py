"""Optional OTLP metrics: the OpenTelemetry GenAI metric instruments, once per request.

Design: ``docs/design/opentelemetry.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from proxy.measure import RequestRecord
from proxy.metrics import UNKNOWN_MODEL, BoundedLabels
from proxy.otlp_export import Exporting
from proxy.tracing import (
    ATTR,
    OPERATION,
    PROVIDER,
    SCHEMA_URL,
    error_type,
    otel_resource,
    server_attributes,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider

log = logging.getLogger("proxy")

# Instrument names, units and the conventions' bucket advice, in one place.
TTFT = "gen_ai.server.time_to_first_token"
TPOT = "gen_ai.server.time_per_output_token"
DURATION = "gen_ai.server.request.duration"
TOKENS = "gen_ai.client.token.usage"
# (The request-duration edges double, the token edges are powers of 4.)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = tuple(0.01 * 2**i for i in range(14))  # 0.01 .. 81.92
TOKEN_BUCKETS = tuple(4**i for i in range(14))  # 1 .. 67108864
TOKEN_TYPE = "gen_ai.token.type"


class OtelMetrics(Exporting):
    """The four instruments; built once by :func:`otel_metrics_from`. ``upstream``: the
    URL a record without an upstream of its own is attributed to; ``max_models``: the
    bound on response-model attribute values (``--max-models``)."""

    def __init__(self, provider: MeterProvider, *, upstream: str, max_models: int) -> None:
        super().__init__(provider)
        meter = provider.get_meter("proxy.otel_metrics", schema_url=SCHEMA_URL)
        self.ttft = meter.create_histogram(
            TTFT,
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            TPOT,
            unit="s",
            description="Time per output token generated after the first token "
            "for successful responses.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self.duration = meter.create_histogram(
            DURATION,
            unit="s",
            description="Generative AI server request duration such as "
            "time-to-last byte or last output token.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.tokens = meter.create_histogram(
            TOKENS,
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self._server = server_attributes(upstream)
        self._response_models = BoundedLabels(max_models)

    def record(
        self, record: RequestRecord, dialect: str, upstream: Mapping[str, Any] | None = None
    ) -> None:
        """One finished request to a measured route (``dialect``: its API's name;
        ``upstream``: the attributes of the upstream it went to)."""
        a: dict[str, Any] = {
            ATTR["operation"]: OPERATION.get(dialect, dialect),
            ATTR["provider"]: PROVIDER.get(dialect, "openai"),
            **(upstream or self._server),
        }
        if record.model != UNKNOWN_MODEL:
            a[ATTR["request_model"]] = record.model  # already a bounded label value
        if record.response_model:
            a[ATTR["response_model"]] = self._response_models(record.response_model)
        error = error_type(record)
        self.duration.record(record.duration_s, {**a, ATTR["error_type"]: error} if error else a)
        if not error:
            if record.ttft_s is not None:
                self.ttft.record(record.ttft_s, a)
            if record.tpot_s is not None:
                self.tpot.record(record.tpot_s, a)
        if not record.tokens_estimated:
            if record.prompt_tokens is not None:
                self.tokens.record(record.prompt_tokens, {**a, TOKEN_TYPE: "input"})
            if record.completion_tokens is not None:
                self.tokens.record(record.completion_tokens, {**a, TOKEN_TYPE: "output"})


def wanted(otlp_metrics: bool, env: Mapping[str, str]) -> bool:
    """Whether OTLP metrics were asked for (``otlp_metrics``: ``--otlp-metrics``, or
    ``OTEL_METRICS_EXPORTER``) and not switched off."""
    exporters = {e.strip().lower() for e in env.get("OTEL_METRICS_EXPORTER", "").split(",")}
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or "none" in exporters:
        return False
    return otlp_metrics or "otlp" in exporters


def endpoint(otlp_endpoint: str, env: Mapping[str, str]) -> str:
    """Where metrics go, as the exporter will resolve it (``otlp_endpoint``:
    ``--otlp-endpoint``)."""
    if otlp_endpoint:
        return otlp_endpoint.rstrip("/") + "/v1/metrics"
    if env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
    return base.rstrip("/") + "/v1/metrics"


def otel_metrics_from(
    *,
    otlp_metrics: bool,
    otlp_endpoint: str,
    measure: bool,
    upstream: str,
    max_models: int,
    env: Mapping[str, str],
) -> OtelMetrics | None:
    """OTLP metrics as configured (the settings of the same names; ``upstream``,
    ``max_models``: :class:`OtelMetrics`), or None (with one warning line saying why when
    they were asked for but cannot be on)."""
    if not wanted(otlp_metrics, env):
        if otlp_metrics:
            log.warning(
                "OTLP metrics off: --otlp-metrics is set but OTEL_SDK_DISABLED=true "
                "or OTEL_METRICS_EXPORTER=none"
            )
        return None
    if not measure:
        log.warning("OTLP metrics off: measurement is off (--no-measure)")
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    except ImportError as exc:
        log.warning(
            "OTLP metrics off: asked for but the OpenTelemetry packages are not "
            "installed (pip install 'llm-latency-proxy[otel]'): %s",
            exc,
        )
        return None
    from opentelemetry.sdk.metrics.export import MetricExportResult

    from proxy import otlp_export

    exporter_class = otlp_export.watched(
        OTLPMetricExporter,
        otlp_export.ExportWatch("OTLP metrics", where := endpoint(otlp_endpoint, env)),
        MetricExportResult.SUCCESS,
        MetricExportResult.FAILURE,
    )
    exporter = exporter_class(endpoint=where) if otlp_endpoint else exporter_class()
    otlp_export.quiet(OTLPMetricExporter.__module__)
    reader = PeriodicExportingMetricReader(exporter)  # OTEL_METRIC_EXPORT_INTERVAL
    resource = otel_resource()
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    metrics = OtelMetrics(provider, upstream=upstream, max_models=max_models)
    metrics.stop_exporter = exporter.shutdown
    metrics.description = f"OTLP/HTTP to {where}, every {_interval_s(env):g} s"
    return metrics


def _interval_s(env: Mapping[str, str]) -> float:
    """``OTEL_METRIC_EXPORT_INTERVAL`` in seconds, as the reader reads it (ms, default
    60000; a bad value means the default)."""
    try:
        value = float(env.get("OTEL_METRIC_EXPORT_INTERVAL", "60000"))
    except ValueError:
        value = 60000.0
    return (value if value > 0 else 60000.0) / 1000
