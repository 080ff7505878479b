"""Every ``serve`` option, declared once (:data:`OPTIONS`): its flag, its ``LLM_PROXY_*``
variable, its config-file key, its parser and its help, so the three sources and the
settings reference cannot drift apart. :mod:`proxy.config` reads them into ``Settings``.
A renamed option's ``old`` name is still read, with a warning (:mod:`proxy.deprecated`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from proxy.config_values import HEADER_NAME, parse_upstream_url, parse_url
from proxy.doctor.index import BYTES_PER_ENTRY
from proxy.upstream_spec import UPSTREAM_AUTH_MODES

ENV_PREFIX = "LLM_PROXY_"
# The options a config file's [[upstream]] tables replace.
SINGLE_UPSTREAM_OPTIONS = ("upstream", "upstream_name", "upstream_api_key_env", "upstream_auth")


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


def _seconds(bounds: str, within: Callable[[float], bool]) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(raw)
        if not math.isfinite(value) or not within(value):
            raise ValueError(f"must be a number of seconds {bounds}")
        return value

    return parse


_positive_float = _seconds("> 0", lambda v: v > 0)
_window = _seconds("> 0 and <= 86400 (a day)", lambda v: 0 < v <= 86_400)
_seconds_or_zero = _seconds(">= 0 (0: never)", lambda v: v >= 0)


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
    return parse_url(raw) if raw.strip() else ""


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


# A table, one entry per option, laid out by hand.
# fmt: off
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
           "latency and token metrics, taken from a request header that names the client "
           "('header:X-Team'; never one that carries a secret) or from the client's API key "
           "('key': a keyed fingerprint, never the key; needs LLM_PROXY_FINGERPRINT_SECRET).",
           "SOURCE", unset="none, no client label", group=Group.LABELS),
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
           "wait in the pool and still be reused; older ones are closed instead. Keep it below "
           "the upstream server's own keep-alive timeout (uvicorn's default, which vLLM, SGLang "
           "and llama-cpp-python serve with, is five seconds), so that a pooled connection is "
           "not reused just as the upstream closes it. The client also learns a "
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
           "the pooled connection it went out on is reset within a second and before any byte of the "
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
    Option("max_models", _int(1), "Distinct 'model' label values kept (per worker), each taken by a name's first "
           "request the upstream did not refuse by name or key; later names are counted as "
           "'other'.", "N",
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
           "request sent it, as a provider's prefix cache keeps one (docs/prompt-caching.md); "
           "a prefix last sent longer ago is 'expired'.", "S", group=Group.DOCTOR),
    Option("prefix_index_bytes", _int(BYTES_PER_ENTRY), "Memory bound of the prompt-cache "
           f"doctor's index of recent prompt blocks ({BYTES_PER_ENTRY} bytes per entry at most; "
           "how much prompt text that remembers: docs/prompt-caching.md#cost); the least recently seen blocks are forgotten first. Per worker process; "
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
           "precisely, down to the doctor's 256-byte blocks.", "TOKENS",
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
# fmt: on


BY_NAME = {o.name: o for o in OPTIONS}
BY_OLD = {o.old: o for o in OPTIONS if o.old}  # renamed options by their old name


def grouped() -> list[tuple[Group, list[Option]]]:
    """The options by :class:`Group`, in the groups' order, each group's in ``OPTIONS``
    order: ``serve --help`` and the settings reference list them so."""
    return [(group, [o for o in OPTIONS if o.group is group]) for group in Group]


def file_key(opt: Option) -> str:
    """``opt``'s top-level key in a config file, or "" where a file cannot set it: the
    file itself, and the single-upstream options its ``[[upstream]]`` tables replace."""
    return "" if opt.name == "config" or opt.name in SINGLE_UPSTREAM_OPTIONS else opt.name
