"""Settings: one frozen object, built from flags and environment, validated at start-up.

Every option is declared once in ``OPTIONS``; from that table come the ``serve`` flags,
their ``LLM_PROXY_*`` environment variables and their ``--help`` text, so the three
can never drift apart. Each option names its :class:`Group`, the section of ``--help``
and of the settings reference it is listed in. Precedence: flag, then environment, then
default.

A config file (``--config FILE``, TOML) adds a layer below the environment: its
top-level keys are these options by name (``max_concurrency = 64``), and its
``[[upstream]]`` tables declare several upstreams (checked by :mod:`proxy.upstream_spec`,
which is below this module and knows nothing of it). Precedence:
flag, then environment, then file, then default. The single-upstream options
(``--upstream``, ``--upstream-name``, ``--upstream-api-key-env``, ``--upstream-auth``)
cannot be combined with a file: the file's tables say the same, per upstream.

A bad value raises :class:`SettingsError` before any socket is opened, with a one-line
message that names the setting as the operator gave it: the flag, the environment
variable (and its flag), or the file and key (:class:`SettingsError`, from
:mod:`proxy.config_values` like the checks shared with the file's tables). No web framework
is imported here.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

from proxy.config_values import HEADER_NAME, SettingsError, parse_upstream_url, parse_url
from proxy.deprecated import RenamedFlag, RenamedSwitch, warn_renamed
from proxy.doctor.index import BYTES_PER_ENTRY, DEFAULT_MAX_BYTES
from proxy.doctor.shared_index import CacheIndexSpec, cache_index_spec
from proxy.upstream_spec import (
    UPSTREAM_AUTH_MODES,
    UPSTREAM_LIMIT_SETTINGS,
    UpstreamSpec,
    upstream_specs,
)

ENV_PREFIX = "LLM_PROXY_"
log = logging.getLogger("proxy")

# Bucket edges where users set targets (docs/definitions.md, "Labels").
TTFT_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0,
    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
DURATION_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
)  # fmt: skip
QUEUE_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
OVERHEAD_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 1.0,
)  # fmt: skip
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(19))  # 1 .. 262144


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the proxy needs to know, resolved once before it listens."""

    upstream: str = "http://127.0.0.1:8000/v1"
    upstream_name: str = ""
    host: str = "127.0.0.1"
    port: int = 8080
    metrics_host: str = ""
    metrics_port: int = 0
    max_concurrency: int = 0
    max_queue: int = 1000
    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    max_upstream_connections: int = 1000
    upstream_keepalive_expiry: float = 4.0
    upstream_resend_on_reset: bool = True
    upstream_keep_warm: float = 900.0
    connect_timeout: float = 5.0
    read_timeout: float = 300.0
    write_timeout: float = 30.0
    body_timeout: float = 60.0
    client_write_timeout: float = 60.0
    inject_usage: bool = True
    measure: bool = True
    log_requests: str = ""
    log_requests_buffer: int = 10_000
    max_models: int = 100
    model_allowlist: tuple[str, ...] = ()
    ttft_buckets: tuple[float, ...] = TTFT_BUCKETS
    itl_buckets: tuple[float, ...] = ITL_BUCKETS
    duration_buckets: tuple[float, ...] = DURATION_BUCKETS
    token_buckets: tuple[float, ...] = TOKEN_BUCKETS
    workers: int = 1
    graceful_timeout: float = 30.0
    upstream_api_key_env: str = ""
    upstream_auth: str = "bearer"
    client_keys_file: str = ""
    secret_headers: tuple[str, ...] = ()
    access_log: bool = False
    ui: bool = True
    otlp_endpoint: str = ""
    propagate_trace: bool = True
    otlp_metrics: bool = False
    metrics_linger: int = 0
    config: str = ""
    client_label_from: str = ""
    max_clients: int = 50
    client_allowlist: tuple[str, ...] = ()
    prefix_doctor: bool = True
    prefix_window: float = 300.0
    prefix_index_bytes: int = DEFAULT_MAX_BYTES
    workload_file: str = ""
    workload_block_size: int = 512
    workload_rotate_bytes: int = 0
    workload_rotate_seconds: float = 0.0
    workload_client: bool = False
    # From the config file's [[upstream]] tables (not an option): empty without a file.
    upstreams: tuple[UpstreamSpec, ...] = ()
    # From the config file's [cache-index] table (proxy.doctor.shared_index): None without one,
    # and the prompt-cache doctor's index is then per process.
    cache_index: CacheIndexSpec | None = None

    @property
    def upstream_label(self) -> str:
        """The ``upstream`` label value: the configured name, else the upstream's host."""
        if self.upstream_name:
            return self.upstream_name
        parts = urlsplit(self.upstream)
        return parts.netloc.rsplit("@", 1)[-1] or "upstream"

    @property
    def holds_upstream_key(self) -> bool:
        """The proxy sends a key of its own to some upstream: clients must then present
        one of the proxy's keys (``--client-keys-file``)."""
        return bool(self.upstream_api_key_env) or any(u.api_key_env for u in self.upstreams)

    @property
    def default_url(self) -> str:
        """The default upstream's URL (else the first's): where a request that was not
        routed would have gone, for telemetry attributes set before routing."""
        specs = self.upstream_specs
        return next((u.url for u in specs if u.default), specs[0].url)

    @property
    def upstream_specs(self) -> tuple[UpstreamSpec, ...]:
        """Every upstream: the config file's, else the one the single-upstream flags give."""
        if self.upstreams:
            return self.upstreams
        return (single_spec(self),)


# ---------------------------------------------------------------------------
# Parsers and validators. Each takes the raw string and returns the typed value.


_url = parse_url


def redact(text: str) -> str:
    """``text`` with the user info of any URL in it masked as ``***@``: never printed."""
    return re.sub(r"//[^/\s]*@", "//***@", text)


def _client_label_from(raw: str) -> str:
    value = raw.strip()
    if value in ("", "key"):
        return value
    kind, _, header = value.partition(":")
    if kind == "header" and HEADER_NAME.match(header.strip()):
        return "header:" + header.strip().lower()
    raise ValueError("must be 'header:NAME' (e.g. header:X-Team) or 'key'")


def _int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if value < minimum or (maximum is not None and value > maximum):
            upper = f" and <= {maximum}" if maximum is not None else ""
            raise ValueError(f"must be an integer >= {minimum}{upper}")
        return value

    return parse


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a number of seconds > 0")
    return value


def _window(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value) or not 0 < value <= 86_400:
        raise ValueError("must be a number of seconds > 0 and <= 86400 (a day)")
    return value


def _seconds_or_zero(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value) or value < 0:
        raise ValueError("must be a number of seconds >= 0 (0: never)")
    return value


def _workload_path(raw: str) -> str:
    value = raw.strip()
    if value == "-":
        raise ValueError("must be a file (a workload is not written to standard output)")
    return value


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be true or false")


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError("must be one of " + ", ".join(allowed))
        return value

    return parse


def _str(raw: str) -> str:
    return raw.strip()


def _names(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _buckets(raw: str) -> tuple[float, ...]:
    values = tuple(float(part) for part in raw.split(",") if part.strip())
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise ValueError("must be a comma-separated list of positive numbers")
    if list(values) != sorted(set(values)):
        raise ValueError("bucket edges must be strictly increasing")
    return values


def _optional_url(raw: str) -> str:
    """A URL, or empty for none (what ``serve`` writes back for its workers when unset)."""
    return _url(raw) if raw.strip() else ""


class Group(Enum):
    """The groups of ``serve --help`` and of the settings reference (docs/generate.py), in
    the order a new user reads them: where requests go, where the proxy listens, who may
    use it, how much it takes, what it exports, then the diagnostics and exports that are
    optional. The value is the group's title in ``--help``."""

    UPSTREAM = "upstream"
    LISTENING = "listening and workers"
    KEYS = "keys"
    LIMITS = "limits and timeouts"
    METRICS = "metrics and live page"
    LABELS = "client and model labels"
    DOCTOR = "prompt-cache doctor"
    LOGS = "request log and workload capture"
    OTEL = "OpenTelemetry"


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # Settings field
    parse: Callable[[str], Any]
    help: str
    metavar: str = ""
    flag_only_true: bool = False  # boolean switch: --flag / --no-flag
    unset: str = ""  # what an empty default means, shown as the default in --help
    group: Group = field(kw_only=True)  # required: where --help and the reference list it
    old: str = field(default="", kw_only=True)  # the name before a rename (proxy.deprecated)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def old_flag(self) -> str:
        return "--" + self.old.replace("_", "-")

    @property
    def old_env(self) -> str:
        return ENV_PREFIX + self.old.upper()


OPTIONS: tuple[Option, ...] = (
    Option("upstream", parse_upstream_url, "OpenAI-style base URL of the upstream, including its version "
           "segment such as /v1 (what the app would have used as its base URL): the proxy's "
           "/v1/<rest> goes to <URL>/<rest>. A URL whose path does not end in a version segment "
           "is accepted with a start-up warning that shows what will be requested. Credentials in it "
           "(user:password@) stop start-up: name the key's variable with --upstream-api-key-env.",
           "URL", group=Group.UPSTREAM),
    Option("upstream_name", _str, "Value of the 'upstream' metric label.", "NAME",
           unset="the upstream's host:port", group=Group.UPSTREAM),
    Option("config", _str, "TOML file declaring several upstreams ([[upstream]] tables: name, "
           "url, models, routes, api_key_env, auth, default, limits, headers) and, at its top "
           "level, any of these settings by name; flags and LLM_PROXY_* variables override it. "
           "Cannot be combined with --upstream, --upstream-name, --upstream-api-key-env or "
           "--upstream-auth. SIGHUP re-reads its [[upstream]] tables.", "FILE",
           unset="none, one upstream from --upstream", group=Group.UPSTREAM),
    Option("client_label_from", _client_label_from, "Add a 'client' label to the request, "
           "latency and token metrics, taken from a request header ('header:X-Team') or from "
           "the client's API key ('key': a keyed fingerprint, never the key; needs "
           "LLM_PROXY_FINGERPRINT_SECRET).", "SOURCE", unset="none, no client label",
           group=Group.LABELS),
    Option("max_clients", _int(1), "Distinct 'client' label values kept; later ones are "
           "counted as 'other'.", "N", group=Group.LABELS),
    Option("client_allowlist", _names, "Comma-separated client label values allowed; any other "
           "becomes 'other'.", "NAMES", unset="none, the first --max-clients values are kept",
           group=Group.LABELS),
    Option("host", _str, "Interface to listen on.", "HOST", group=Group.LISTENING),
    Option("port", _int(0, 65535), "Port to listen on (0: a free port chosen by the system, "
           "printed in the start-up line).", "PORT", group=Group.LISTENING),
    Option("metrics_port", _int(0, 65535), "Serve /metrics on this separate port instead of the main one "
           "(0: serve it on the main port). Use it in production so app clients cannot read metrics. "
           "It takes no client key; the main port's /metrics and /ui take one when client keys "
           "are checked.", "PORT", group=Group.METRICS),
    Option("metrics_host", _str, "Interface for --metrics-port.", "HOST", unset="same as --host",
           group=Group.METRICS),
    Option("max_concurrency", _int(0), "In-flight upstream requests allowed at once; more wait in a queue "
           "and the wait is measured as queue time (0: unlimited).", "N", group=Group.LIMITS),
    Option("max_queue", _int(0), "Requests allowed to wait for a slot when --max-concurrency is set; "
           "beyond it the proxy answers 429 with Retry-After.", "N", group=Group.LIMITS),
    Option("max_body_bytes", _int(1), "Largest request body accepted; larger gets 413 without being read.", "BYTES",
           group=Group.LIMITS),
    Option("max_header_bytes", _int(1024), "Largest total size of request headers; larger gets 431.", "BYTES",
           group=Group.LIMITS),
    Option("max_upstream_connections", _int(1), "Size of the upstream connection pool.", "N",
           group=Group.LIMITS),
    Option("upstream_keepalive_expiry", _positive_float, "Seconds an idle upstream connection may "
           "wait in the pool and still be reused; older ones are closed instead. Below uvicorn's "
           "5 s keep-alive, which vLLM, SGLang and llama-cpp-python serve with, so that a pooled "
           "connection is not reused just as the upstream closes it. The client also learns a "
           "shorter limit from an upstream that closes idle connections sooner, and raises it "
           "again, step by step up to this value, when connections outlive it (as after an "
           "upstream restart).", "S", group=Group.LIMITS),
    Option("upstream_keep_warm", _seconds_or_zero, "Seconds after an upstream's last request "
           "during which the proxy keeps one idle connection to it open: when the last idle "
           "connection reaches --upstream-keepalive-expiry it is replaced by a new one, so a "
           "request after a pause does not wait for a connection's set-up (TCP, TLS, a proxy "
           "tunnel). It costs one connection set-up per expiry period per upstream while "
           "warm, and the upstream sees connections that carry no request. 0: off.", "S",
           group=Group.LIMITS),
    Option("upstream_resend_on_reset", _bool, "Send a POST once more, on a new connection, when "
           "the pooled connection it went out on is reset within 1 s before any byte of the "
           "answer: an upstream closing an idle connection as the request arrived, with the "
           "request unread, so no generation started. Safe when the proxy talks to the "
           "server itself. Turn it off behind a load balancer or another proxy that may have "
           "forwarded the request before the reset: there the request may be generating, and "
           "a resend is a second generation; off, that client gets a 502 instead.",
           flag_only_true=True, group=Group.LIMITS),
    Option("connect_timeout", _positive_float, "Seconds to connect to the upstream before answering 502.", "S",
           group=Group.LIMITS),
    Option("read_timeout", _positive_float, "Seconds to wait for the upstream's headers or for its next "
           "bytes; before headers: 504; mid-stream: the stream ends with outcome 'upstream_timeout'.", "S",
           group=Group.LIMITS),
    Option("write_timeout", _positive_float, "Seconds allowed to send the request body upstream.", "S",
           group=Group.LIMITS),
    Option("body_timeout", _positive_float, "Seconds allowed for the client to send its whole request "
           "body; slower gets 408.", "S", group=Group.LIMITS),
    Option("client_write_timeout", _positive_float, "Seconds a client may take no byte of its "
           "answer while the proxy has bytes for it; then the proxy closes the client's and the "
           "upstream's connection, frees the slot and ends the request with outcome "
           "'client_stalled'. A slow client that keeps reading is never cut.", "S",
           group=Group.LIMITS),
    Option("inject_usage", _bool, "Ask the upstream for stream_options.include_usage on streaming chat "
           "completions that do not ask for it, and remove that usage-only event from the client's "
           "stream (exact token counts).", flag_only_true=True, group=Group.UPSTREAM),
    Option("measure", _bool, "Measure and export metrics (off: a plain relay, for pricing the "
           "measurement in benchmarks).", flag_only_true=True, group=Group.METRICS),
    Option("log_requests", _str, "Write one JSON line per finished request to this file ('-' for stdout).",
           "FILE", unset="none, no per-request log", group=Group.LOGS),
    Option("log_requests_buffer", _int(1), "Lines of the per-request log held in memory while "
           "the file is slower than the requests (a writer thread writes them, never the "
           "event loop); when it is full, new lines are dropped and counted in "
           "llm_proxy_request_log_dropped_lines_total instead of slowing the streams down.",
           "LINES", group=Group.LOGS),
    Option("max_models", _int(1), "Distinct 'model' label values kept; later names are counted as 'other'.", "N",
           group=Group.LABELS),
    Option("model_allowlist", _names, "Comma-separated model names allowed as label values; any other "
           "becomes 'other'.", "NAMES", unset="none, the first --max-models names are kept",
           group=Group.LABELS),
    Option("ttft_buckets", _buckets, "Comma-separated TTFT histogram bucket edges in seconds.", "EDGES",
           group=Group.METRICS),
    Option("itl_buckets", _buckets, "Comma-separated ITL and TPOT histogram bucket edges in seconds.", "EDGES",
           group=Group.METRICS),
    Option("duration_buckets", _buckets, "Comma-separated request-duration bucket edges in seconds.", "EDGES",
           group=Group.METRICS),
    Option("token_buckets", _buckets, "Comma-separated token-count bucket edges.", "EDGES",
           group=Group.METRICS),
    Option("workers", _int(1, 64), "Worker processes (metrics summed with prometheus-client multiprocess mode).", "N",
           group=Group.LISTENING),
    Option("graceful_timeout", _positive_float, "On SIGTERM, seconds to let in-flight streams finish.", "S",
           group=Group.LISTENING),
    Option("upstream_api_key_env", _str, "Name of an environment variable holding the key the proxy sends "
           "upstream; clients must then present one of --client-keys-file's keys, and their "
           "Authorization, x-api-key and api-key headers are not sent upstream.", "VAR",
           unset="none, the client's key headers pass through to the upstream", group=Group.KEYS),
    Option("upstream_auth", _choice(*UPSTREAM_AUTH_MODES), "How the key of --upstream-api-key-env "
           "is sent upstream: 'bearer' (Authorization: Bearer KEY; OpenAI, vLLM and most servers), "
           "'x-api-key' (x-api-key: KEY; Anthropic) or 'api-key' (api-key: KEY; Azure OpenAI). "
           "Clients may present their own key in any of the three headers whatever this says.",
           "MODE", group=Group.KEYS),
    Option("client_keys_file", _str, "File of client keys (one SHA-256 hex digest per line, "
           "or 'sha256:<hex>') accepted when --upstream-api-key-env is set. SIGHUP re-reads "
           "it.", "FILE",
           unset="none; required with --upstream-api-key-env", group=Group.KEYS),
    Option("secret_headers", _names, "Comma-separated request header names removed from the "
           "upstream request when --upstream-api-key-env is set, like the client's key headers "
           "(e.g. a header that only this proxy should see); without a server-held key they pass "
           "through unchanged. No request header is ever logged, these or any other.", "NAMES",
           unset="none", group=Group.KEYS),
    Option("access_log", _bool, "Let uvicorn write its access log.", flag_only_true=True,
           group=Group.LOGS),
    Option("ui", _bool, "Serve the live page (/ui) and its data (/ui/data) wherever /metrics is "
           "served: on the main port, or on --metrics-port when that is set.", flag_only_true=True,
           group=Group.METRICS),
    Option("otlp_endpoint", _optional_url, "Export one OpenTelemetry span per measured request over "
           "OTLP/HTTP to this base URL (spans go to <URL>/v1/traces), like "
           "OTEL_EXPORTER_OTLP_ENDPOINT; needs pip install 'llm-latency-proxy[otel]'. "
           "OTEL_SDK_DISABLED=true turns tracing off.", "URL",
           unset="none; tracing is on when OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set",
           group=Group.OTEL),
    Option("propagate_trace", _bool, "With tracing on, send the upstream a traceparent whose "
           "parent is the proxy's span (replacing the client's traceparent/tracestate); off: "
           "the client's trace headers pass through untouched.", flag_only_true=True,
           group=Group.OTEL),
    Option("otlp_metrics", _bool, "Also export the OpenTelemetry GenAI metrics "
           "(gen_ai.server.time_to_first_token, ...) over OTLP/HTTP, once per request, to "
           "--otlp-endpoint or OTEL_EXPORTER_OTLP_(METRICS_)ENDPOINT; also on when "
           "OTEL_METRICS_EXPORTER=otlp, off with OTEL_METRICS_EXPORTER=none. Prometheus "
           "/metrics is unchanged.", flag_only_true=True, group=Group.OTEL),
    Option("metrics_linger", _int(0, 3600), "After SIGTERM and the drain, keep "
           "--metrics-port answering this many seconds before exiting, so that a scrape "
           "sees the counts of the last streams (set it above one scrape interval plus "
           "the scrape timeout); a second SIGTERM or SIGINT ends it at once. Only with "
           "--metrics-port: the main port stops listening when the drain begins.", "S",
           group=Group.METRICS),
    Option("prefix_doctor", _bool, "The prompt-cache doctor: for each measured request "
           "answered 2xx, find the longest prefix of its prompt that a recent request sent "
           "(keyed hashes of 256-byte blocks, never the text), compare it with the cached "
           "tokens the upstream reports, and say where and why the prefix broke "
           "(llm_proxy_prompt_repeated_tokens_total, llm_proxy_prompt_cache_missed_tokens_total, "
           "llm_proxy_prompt_prefix_breaks_total, the request log and the span). Each worker "
           "process keeps its own index, and finds only the repeats it served itself, unless "
           "the config file's [cache-index] table shares one on Redis or Valkey among every "
           "worker and replica. On by default; --no-prefix-doctor turns it off. It costs CPU "
           "per request that grows with the prompt's parts and bytes, large prompts in a "
           "worker thread (docs/prompt-caching.md#cost, benchmarks/RESULTS.md). "
           "--workload-file and a [cache-index] table need it.",
           flag_only_true=True, group=Group.DOCTOR),
    Option("prefix_window", _window, "Seconds a prompt prefix counts as repeatable after a "
           "request sent it, as a provider's prefix cache keeps one (about 5 minutes); a "
           "prefix last sent longer ago is 'expired'.", "S", group=Group.DOCTOR),
    Option("prefix_index_bytes", _int(BYTES_PER_ENTRY), "Memory bound of the prompt-cache "
           f"doctor's index of recent prompt blocks ({BYTES_PER_ENTRY} bytes per entry at most, "
           "about 1.3 bytes per byte of distinct prompt text: the default remembers about 50 MB "
           "of it); the least recently seen blocks are forgotten first. Per worker process; "
           "unused with a [cache-index] table (the store's maxmemory bounds that index).",
           "BYTES", group=Group.DOCTOR),
    Option("workload_file", _workload_path, "Capture the shape of the traffic as a workload "
           "file in the Mooncake trace format, which bench --workload-file, NVIDIA AIPerf and "
           "Dynamo replay: one JSON "
           "line per measured request answered 2xx with the upstream's usage (arrival time, "
           "prompt and completion tokens, the prompt's block hash ids, model, route, upstream, "
           "cached tokens, TTFT, mean ITL, outcome), never prompt text or keys. Written by a "
           "thread of its own; requests without usage are counted in "
           "llm_proxy_trace_skipped_requests_total, not written. Needs the prompt-cache "
           "doctor (its block hashes). With --workers, one file per worker, FILE.<pid>.",
           "FILE", unset="none, no workload capture", group=Group.LOGS, old="trace_file"),
    Option("workload_block_size", _int(1), "Prompt tokens per hash id in the workload file "
           "(AIPerf's "
           "--prompt-input-tokens-block-size; the Mooncake traces use 512). Prompts share "
           "ids as far as their blocks are equal; a smaller block keeps a shared prefix more "
           "precisely, down to about 64 tokens (the doctor's 256-byte blocks).", "TOKENS",
           group=Group.LOGS, old="trace_block_size"),
    Option("workload_rotate_bytes", _int(0), "Continue the workload capture in a new file "
           "(FILE.1, FILE.2, ...: the first free number) once the current one has reached "
           "this size; 0: never.", "BYTES", group=Group.LOGS, old="trace_rotate_bytes"),
    Option("workload_rotate_seconds", _seconds_or_zero, "Continue the workload capture in a "
           "new file once the current one has held lines this long (with "
           "--workload-rotate-bytes, whichever comes first); 0: never.", "S",
           group=Group.LOGS, old="trace_rotate_seconds"),
    Option("workload_client", _bool, "Write the client label (--client-label-from) in the "
           "workload file's lines; off, the file says nothing of who sent a request.",
           flag_only_true=True, group=Group.LOGS, old="trace_client"),
)

_FIELDS = {f.name for f in fields(Settings)}
assert all(o.name in _FIELDS for o in OPTIONS)


_BY_NAME = {o.name: o for o in OPTIONS}
_BY_OLD = {o.old: o for o in OPTIONS if o.old}


def _shown_default(opt: Option, default: Any) -> str:
    if isinstance(default, tuple):
        default = ",".join(str(v) for v in default)
    text = str(default)
    if text:
        return text
    assert opt.unset, f"{opt.flag} has an empty default: say what its absence means"
    return opt.unset


def shown_default(opt: Option) -> str:
    """``opt``'s default as ``--help`` shows it (the settings reference shows the same)."""
    return _shown_default(opt, getattr(Settings(), opt.name))


def grouped() -> list[tuple[Group, list[Option]]]:
    """The options by :class:`Group`, in the groups' order, each group's in ``OPTIONS``
    order: ``serve --help`` and the settings reference list them so."""
    return [(group, [o for o in OPTIONS if o.group is group]) for group in Group]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every option as a flag, in its group; the default stays None so env can
    fill in."""
    defaults = Settings()
    for group, options in grouped():
        section = parser.add_argument_group(group.value)
        for opt in options:
            shown = _shown_default(opt, getattr(defaults, opt.name))
            help_text = f"{opt.help} [env {opt.env}; default: {shown}]"
            if opt.flag_only_true:
                section.add_argument(opt.flag, dest=opt.name, default=None,
                                     action=argparse.BooleanOptionalAction, help=help_text)
            else:
                section.add_argument(opt.flag, dest=opt.name, default=None, metavar=opt.metavar,
                                     help=help_text)
            if opt.old:
                section.add_argument(opt.old_flag, dest=opt.name, default=None, new=opt.flag,
                                     action=RenamedSwitch if opt.flag_only_true else RenamedFlag)


def given_as(name: str, args: argparse.Namespace | None = None,
             environ: Mapping[str, str] | None = None) -> str:
    """How the operator gave setting ``name``: its flag, else its environment variable
    when that is set, else (not given at all) its flag. Error messages use it, so that
    they name what the operator has to change."""
    opt = _BY_NAME[name]
    env = os.environ if environ is None else environ
    if args is not None and getattr(args, name, None) is not None:
        return opt.flag
    if opt.env in env:
        return opt.env
    if opt.old and opt.old_env in env:
        return opt.old_env
    return opt.flag


SINGLE_UPSTREAM_OPTIONS = ("upstream", "upstream_name", "upstream_api_key_env", "upstream_auth")
FINGERPRINT_SECRET_ENV = "LLM_PROXY_FINGERPRINT_SECRET"


def file_key(opt: Option) -> str:
    """``opt``'s top-level key in a config file, or "" where a file cannot set it: the
    file itself, and the single-upstream options its ``[[upstream]]`` tables replace."""
    return "" if opt.name == "config" or opt.name in SINGLE_UPSTREAM_OPTIONS else opt.name


def from_sources(args: argparse.Namespace | None = None,
                 environ: Mapping[str, str] | None = None) -> Settings:
    """Build and validate settings: flag, then ``LLM_PROXY_*`` variable, then the config
    file's top-level key, then default; then the file's ``[[upstream]]`` tables.

    An invalid value raises :class:`SettingsError` naming the flag when the flag was
    used, the variable (and its flag) when the variable was, or the file and key, with
    the value as given.
    """
    env = os.environ if environ is None else environ
    raw_values: dict[str, tuple[Any, str]] = {}  # option -> (raw value, where it came from)
    for opt in OPTIONS:
        raw = getattr(args, opt.name, None) if args is not None else None
        if raw is not None:
            raw_values[opt.name] = (raw, opt.flag)
        elif opt.env in env:
            raw_values[opt.name] = (env[opt.env], opt.env)
        elif opt.old and opt.old_env in env:
            warn_renamed(opt.old_env, opt.env)
            raw_values[opt.name] = (env[opt.old_env], opt.old_env)
    values = {name: _parse_option(_BY_NAME[name], raw, where)
              for name, (raw, where) in raw_values.items()}
    path = values.get("config", "")
    doc: dict[str, Any] = {}
    if path:
        given = [raw_values[n][1] for n in SINGLE_UPSTREAM_OPTIONS if n in raw_values]
        if given:
            raise SettingsError(f"invalid setting {given[0]}: cannot be combined with "
                                f"{raw_values['config'][1]} {path}: its [[upstream]] tables "
                                "declare the upstreams")
        doc = read_file(path)
        for key, raw in doc.items():
            if key in ("upstream", "cache-index"):
                continue
            found = _BY_NAME.get(key)
            if found is None and key in _BY_OLD:
                found = _BY_OLD[key]
                warn_renamed(f"config {path}: {key}", found.name)
                key = found.name
            if found is None or not file_key(found):
                hint = (" (declare upstreams as [[upstream]] tables)"
                        if key in SINGLE_UPSTREAM_OPTIONS else _closest_key(key))
                raise SettingsError(f"config {path}: {key}: unknown setting{hint}")
            if key not in values:
                values[key] = toml_value(found, raw, f"config {path}: {key}")
    settings = Settings(**values)
    if path:
        settings = replace(settings, upstreams=upstream_specs(path, doc, upstream_limits(settings),
                                                              env),
                           cache_index=cache_index_spec(path, doc, env))
    _check_combinations(settings, lambda name: given_as(name, args, env), env)
    return settings


def _closest_key(key: str) -> str:
    """`` (did you mean NAME?)`` for a top-level config key that is a typo of a setting's
    name, or its flag or variable written as a key; there are too many settings to list
    them all, as an ``[[upstream]]`` table's few keys are."""
    import difflib

    names = [o.name for o in OPTIONS if o.name != "config" and o.name not in SINGLE_UPSTREAM_OPTIONS]
    plain = key.lower().lstrip("-").replace("-", "_").removeprefix("llm_proxy_")
    close = difflib.get_close_matches(plain, [*names, "upstream"], n=1, cutoff=0.75)
    if close == ["upstream"]:
        return " (declare upstreams as [[upstream]] tables)"
    if close:
        return f" (did you mean {close[0]}?)"
    return " (a key is a flag's name without -- and with _ for -, e.g. max_concurrency)"


def toml_value(opt: Option, raw: Any, where: str) -> Any:
    """A config file's value for ``opt``, parsed as its flag would be; a bad one raises
    :class:`SettingsError` naming ``where`` (the file and key)."""
    if isinstance(raw, bool):  # as text, so a number option refuses it like a flag would
        raw = "true" if raw else "false"
    elif isinstance(raw, list):
        raw = ",".join(str(v) for v in raw)
    return _parse_option(opt, raw, where, file=True)


def _parse_option(opt: Option, raw: Any, where: str, *, file: bool = False) -> Any:
    if isinstance(raw, bool):
        return raw
    try:
        return opt.parse(str(raw))
    except ValueError as exc:
        detail = str(exc) or "invalid value"
        if detail.startswith(("invalid literal", "could not convert")):
            detail = "not a number"
        shown = redact(repr(str(raw)))
        if file:
            raise SettingsError(f"{where}: {detail} (got {shown})") from None
        also = f" ({opt.flag})" if where != opt.flag else ""
        raise SettingsError(f"invalid setting {where}={shown}{also}: {detail}") from None


# ---------------------------------------------------------------------------
# The config file and its upstreams.


def read_file(path: str) -> dict[str, Any]:
    """The parsed TOML document; a file that cannot be read or parsed is one line."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise SettingsError(f"config {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config {path}: not valid TOML: {exc}") from None


def upstream_limits(settings: Settings) -> dict[str, Any]:
    """What an ``[[upstream]]`` table's absent limits and timeouts default to: the
    top-level settings of the same purpose, by table key."""
    return {key: getattr(settings, name) for key, name in UPSTREAM_LIMIT_SETTINGS.items()}


def single_spec(settings: Settings) -> UpstreamSpec:
    """The one upstream the single-upstream flags describe: every model, the default."""
    return UpstreamSpec(
        name=settings.upstream_label, url=settings.upstream, models=("*",), default=True,
        api_key_env=settings.upstream_api_key_env, auth=settings.upstream_auth,
        **upstream_limits(settings))


def reload_specs(settings: Settings) -> tuple[UpstreamSpec, ...]:
    """The ``[[upstream]]`` tables of ``settings.config`` as the file says now (SIGHUP),
    or :class:`SettingsError` when they cannot replace the running ones.

    Per-upstream defaults come from the running settings; top-level keys are read at
    start only, and one that changed is named in a warning rather than half-applied.
    Client keys are set up at start too: a file that gives an upstream a key when the
    running proxy checks none is refused.
    """
    path = settings.config
    doc = read_file(path)
    specs = upstream_specs(path, doc, upstream_limits(settings))
    if any(s.api_key_env for s in specs) and not settings.holds_upstream_key:
        raise SettingsError(f"config {path}: an upstream now holds a key (api_key_env) but "
                            "client keys were not set up at start (--client-keys-file): "
                            "restart to add one")
    changed = []
    for key, raw in doc.items():
        opt = _BY_NAME.get(key)
        if key == "upstream" or opt is None:
            continue
        try:
            value = toml_value(opt, raw, key)
        except SettingsError:
            value = None
        if value != getattr(settings, key):
            changed.append(key)
    if changed:
        log.warning(
            "config %s: top-level settings %s differ from the running ones (or a flag or "
            "variable overrides them); they are read at start only: restart to apply",
            path, ", ".join(changed))
    return specs


def _check_combinations(s: Settings, name: Callable[[str], str],
                        env: Mapping[str, str]) -> None:
    if s.client_label_from == "key" and not env.get(FINGERPRINT_SECRET_ENV, "").strip():
        raise SettingsError(f"invalid setting {name('client_label_from')}=key: needs the "
                            f"secret in {FINGERPRINT_SECRET_ENV} (the same on every replica), "
                            "so that a key's label is a keyed fingerprint, never a plain hash")
    if s.upstream_api_key_env and not os.environ.get(s.upstream_api_key_env, "").strip():
        raise SettingsError(f"invalid setting {name('upstream_api_key_env')}: environment "
                            f"variable {s.upstream_api_key_env} is empty or unset")
    if s.holds_upstream_key:
        if not s.client_keys_file:
            held = next((u for u in s.upstreams if u.api_key_env), None)
            why = (f"when an upstream holds a key (upstream {held.name!r} has api_key_env "
                   f"in {s.config})" if held is not None else
                   f"with {name('upstream_api_key_env')}")
            raise SettingsError(f"invalid setting {name('client_keys_file')}: required {why}")
        if not os.path.isfile(s.client_keys_file):
            raise SettingsError(f"invalid setting {name('client_keys_file')}: no such file "
                                f"{s.client_keys_file!r}")
    if not s.upstream_api_key_env and s.upstream_auth != "bearer":
        # Without a server-held key the client's own headers go upstream unchanged, so
        # the setting would silently do nothing.
        raise SettingsError(f"invalid setting {name('upstream_auth')}: only used with "
                            f"{name('upstream_api_key_env')} (without it the client's key "
                            "headers pass through unchanged)")
    if s.cache_index is not None and not s.prefix_doctor:
        raise SettingsError("the config file's [cache-index] table is the prompt-cache "
                            f"doctor's shared index, and the doctor is turned off "
                            f"({name('prefix_doctor')}): leave it on (the default), or "
                            "remove the table")
    if s.workload_file:
        if not s.prefix_doctor:
            raise SettingsError(f"invalid setting {name('workload_file')}: the workload file's hash ids are "
                                "the prompt-cache doctor's block hashes, and the doctor is "
                                f"turned off ({name('prefix_doctor')}): leave it on (the "
                                "default)")
        if not s.measure:
            raise SettingsError(f"invalid setting {name('workload_file')}: the workload file records the "
                                "measured usage and timings; it cannot be combined with "
                                f"{name('measure')}=false (--no-measure)")
        if s.workload_file == s.log_requests:
            raise SettingsError(f"invalid setting {name('workload_file')}: the same file as "
                                f"{name('log_requests')}")
        folder = os.path.dirname(os.path.abspath(s.workload_file))
        if not os.path.isdir(folder):
            raise SettingsError(f"invalid setting {name('workload_file')}: no such directory "
                                f"{folder!r}")
    elif s.workload_client:
        raise SettingsError(f"invalid setting {name('workload_client')}: only used with "
                            f"{name('workload_file')}")
    if s.workload_client and not s.client_label_from:
        raise SettingsError(f"invalid setting {name('workload_client')}: there is no client "
                            f"label to write without {name('client_label_from')}")
    if s.metrics_port and s.metrics_port == s.port:
        raise SettingsError(f"invalid setting {name('metrics_port')}: must differ from {name('port')}")


def describe(settings: Settings, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """Settings as a plain dict for a start-up log line (nothing secret is held here)."""
    return {f.name: getattr(settings, f.name) for f in fields(Settings)
            if keys is None or f.name in keys}
