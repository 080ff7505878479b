"""Prometheus metrics: every metric the proxy exports is defined and registered here.

Design: ``docs/design/relay-and-export.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from proxy import config
from proxy.buckets import observe_many
from proxy.config import OVERHEAD_BUCKETS, QUEUE_BUCKETS
from proxy.diagnosis.fit import KTOKENS
from proxy.diagnosis.fit import SAMPLES as FIT_SAMPLES
from proxy.doctor.metrics import PrefixMetrics
from proxy.doctor.provider import agreement
from proxy.measure import Outcome, RequestRecord
from proxy.metric_help import (
    ITL_HELP,
    NO_FIRST_TOKEN_HELP,
    TPOT_HELP,
    TTFA_HELP,
    TTFB_HELP,
    TTFT_HELP,
)
from proxy.workload_capture import SKIP_REASONS

OTHER_MODEL = "other"
UNKNOWN_MODEL = "unknown"
_EXEMPLAR_MAX = 64  # exemplar label sets are limited to 128 UTF-8 characters in all


# The finish_reason label of llm_proxy_finish_reasons_total: each API's words for why an
# answer ended (chat and completions finish_reason, Responses incomplete_details.reason
# or status, Messages stop_reason, TGI's), in a fixed set of values.
FINISH_CLASSES: dict[str, tuple[str, ...]] = {
    "length": ("length", "max_tokens", "max_output_tokens", "model_context_window_exceeded"),
    "stop": ("stop", "end_turn", "stop_sequence", "completed", "eos_token"),
    "tool_calls": ("tool_calls", "function_call", "tool_use"),
    "content_filter": ("content_filter", "refusal"),
}
_FINISH_CLASS = {word: name for name, words in FINISH_CLASSES.items() for word in words}


def finish_class(reasons: Sequence[str]) -> str:
    """The label value for a response's finish reasons (in choice order)."""
    if any(_FINISH_CLASS.get(r) == "length" for r in reasons):
        return "length"
    return _FINISH_CLASS.get(reasons[0], "other") if reasons else "other"


def _exemplar(record: RequestRecord) -> dict[str, str]:
    """The trace of a traced request (what Grafana links to Tempo by), else its request
    id; both together would pass the 128-character limit on an exemplar's labels."""
    if record.trace_id:
        return {"trace_id": record.trace_id, "span_id": record.span_id}
    return {"request_id": record.request_id[:_EXEMPLAR_MAX]}


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # where the workers of serve --workers write


def multiprocess_registry(path: str) -> CollectorRegistry:
    """A registry that reads every worker's files in ``path`` at each collection."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
    return registry


class BoundedLabels:
    """Maps a request's ``model`` (or client) to a bounded label value: the first
    ``max_values`` distinct values keep theirs (``unknown`` always does), an allow-list if
    given admits only its names, anything else (and anything longer than 200 characters)
    becomes ``other``. ``tentative``: a new value is only lent by a call, and takes its
    place among the first ``max_values`` when :meth:`settle` says its request was not
    refused by name (so that names an upstream refuses cannot use the places up)."""

    def __init__(self, max_values: int, allowlist: Iterable[str] = (), *,
                 tentative: bool = False) -> None:
        self._max = max_values
        self._allow = frozenset(allowlist)
        self._seen: set[str] = set()
        self._tentative = tentative

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if self._allow and value not in self._allow:
            return OTHER_MODEL
        if value == UNKNOWN_MODEL or len(self._seen) < self._max:
            if len(value) > 200:
                return OTHER_MODEL
            if not self._tentative or value == UNKNOWN_MODEL:
                self._seen.add(value)
            return value
        return OTHER_MODEL

    def settle(self, value: str, admit: bool) -> str:
        """At a request's finish, the label lent at its start (:meth:`__call__`): kept if
        it has its place, or takes one now if ``admit`` and one is left; else ``other``."""
        if value in self._seen or value in (OTHER_MODEL, UNKNOWN_MODEL):
            return value
        if admit and len(self._seen) < self._max:
            self._seen.add(value)
            return value
        return OTHER_MODEL


# Ends of a stream the upstream never answered that are still a wait without a first
# token: the client gave up, or the proxy shut down, before any status came.
_LEFT_UNANSWERED = frozenset((Outcome.CLIENT_DISCONNECTED, Outcome.CANCELLED))
# Made at 0 with a label set (Metrics._from_zero): the codes of the shipped error-ratio
# rule the proxy answers itself (an upstream that failed or timed out, a shutdown) or
# relays most, and every outcome a stream can end with.
_FROM_ZERO_CODES = ("500", "502", "503", "504")
_STREAM_OUTCOMES = tuple(str(o) for o in Outcome if o is not Outcome.REJECTED)

# Per-request token counts: the record's field, the histogram's name and help.
_TOKEN_HISTOGRAMS = (
    ("prompt_tokens", "llm_proxy_prompt_tokens", "Prompt tokens per request, cached ones "
     "included: chat and completions usage.prompt_tokens; Responses usage.input_tokens; "
     "Messages input_tokens + cache_read_input_tokens + cache_creation_input_tokens."),
    ("cached_prompt_tokens", "llm_proxy_cached_prompt_tokens", "Prompt tokens read from the "
     "provider's prompt cache per request: usage.prompt_tokens_details.cached_tokens (chat, "
     "completions), input_tokens_details.cached_tokens (Responses), cache_read_input_tokens "
     "(Messages); where the usage does not say, llama.cpp's timings.cache_n (the prompt "
     "tokens its server reused)."),
    ("completion_tokens", "llm_proxy_completion_tokens", "Completion tokens per request, "
     "reasoning included: usage.completion_tokens (chat, completions), output_tokens "
     "(Responses, Messages; the last message_delta's cumulative value)."),
    ("reasoning_tokens", "llm_proxy_reasoning_tokens", "Reasoning tokens per request: "
     "usage.completion_tokens_details.reasoning_tokens (chat), "
     "output_tokens_details.reasoning_tokens (Responses), "
     "output_tokens_details.thinking_tokens (Messages); only where the API reports them."),
    ("cache_write_tokens", "llm_proxy_cache_write_prompt_tokens", "Prompt tokens written to "
     "the provider's prompt cache per request: prompt_tokens_details.cache_write_tokens "
     "(chat), input_tokens_details.cache_write_tokens (Responses), "
     "cache_creation_input_tokens (Messages); only where the upstream reports them."),
)


@dataclass(frozen=True, slots=True)
class _Children:
    ttft: Histogram
    ttfa: Histogram
    ttfb: Histogram
    itl: Histogram
    tpot: Histogram
    queue: Histogram
    upstream_queue: Histogram
    overhead: Histogram
    tokens: tuple[tuple[str, Histogram], ...]  # (record field, child)


@dataclass(frozen=True, slots=True)
class MetricsOptions:
    """What :class:`Metrics` is built with (the composition root fills it from the
    settings of the same names): label bounds, bucket edges, and ``multiprocess_dir``,
    the workers' shared directory (``PROMETHEUS_MULTIPROC_DIR``), None in one process.
    ``client_label``: whether requests carry the ``client`` label (``--client-label-from``)."""

    max_models: int = 100
    model_allowlist: tuple[str, ...] = ()
    client_label: bool = False
    max_clients: int = 50
    client_allowlist: tuple[str, ...] = ()
    ttft_buckets: tuple[float, ...] = config.TTFT_BUCKETS
    itl_buckets: tuple[float, ...] = config.ITL_BUCKETS
    duration_buckets: tuple[float, ...] = config.DURATION_BUCKETS
    token_buckets: tuple[float, ...] = config.TOKEN_BUCKETS
    multiprocess_dir: str | None = None


class Metrics:
    """All of the proxy's metrics, registered in one (injectable) registry."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 options: MetricsOptions | None = None) -> None:
        self.options = options = options if options is not None else MetricsOptions()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess = options.multiprocess_dir is not None
        self.model_label = BoundedLabels(options.max_models, options.model_allowlist,
                                         tentative=True)
        self.client_label = (BoundedLabels(options.max_clients, options.client_allowlist)
                             if options.client_label else None)
        reg = self.registry
        base = ("route", "model", "upstream")
        # The metrics that say who is waiting carry the optional client label.
        who = (*base, "client") if self.client_label is not None else base
        self.requests = Counter(
            "llm_proxy_requests", "Requests answered, by route, model, upstream, stream and HTTP "
            "status code sent to the client.", (*who, "stream", "code"), registry=reg)
        self.duration = Histogram(
            "llm_proxy_request_duration_seconds", "From the proxy receiving the request until the "
            "last byte was handed to the client.", (*who, "stream"),
            buckets=options.duration_buckets, registry=reg)
        self.ttft = Histogram("llm_proxy_time_to_first_token_seconds", TTFT_HELP, who,
                              buckets=options.ttft_buckets, registry=reg)
        self.no_first_token = Histogram(
            "llm_proxy_wait_without_first_token_seconds", NO_FIRST_TOKEN_HELP, who,
            buckets=options.ttft_buckets, registry=reg)
        self.ttfa = Histogram("llm_proxy_time_to_first_answer_token_seconds", TTFA_HELP, who,
                              buckets=options.ttft_buckets, registry=reg)
        self.ttfb = Histogram("llm_proxy_time_to_first_byte_seconds", TTFB_HELP, base,
                              buckets=options.ttft_buckets, registry=reg)
        self.itl = Histogram("llm_proxy_inter_token_latency_seconds", ITL_HELP, who,
                             buckets=options.itl_buckets, registry=reg)
        self.tpot = Histogram("llm_proxy_time_per_output_token_seconds", TPOT_HELP, base,
                              buckets=options.itl_buckets, registry=reg)
        self.queue = Histogram(
            "llm_proxy_queue_time_seconds", "Time a request waited in the proxy for an admission "
            "slot (--max-concurrency), a client's that gave up while waiting included; 0 when "
            "unlimited. Every measured route, streamed or not (the stream label, as on the "
            "request duration).", (*base, "stream"),
            buckets=QUEUE_BUCKETS, registry=reg)
        self.upstream_queue = Histogram(
            "llm_proxy_upstream_queue_time_seconds", "Queue time reported by the upstream itself "
            "(vLLM metrics.queue_time_ms in the usage chunk, or an x-queue-time header in ms).",
            base, buckets=QUEUE_BUCKETS, registry=reg)
        self.overhead = Histogram(
            "llm_proxy_overhead_seconds", "What the proxy itself costs before the upstream has "
            "the request: from receiving it to writing it to the upstream's socket, a new "
            "connection's set-up (TCP, TLS, a proxy tunnel) included, less queue time.", base, buckets=OVERHEAD_BUCKETS, registry=reg)
        tb = options.token_buckets
        self.tokens = {field: Histogram(name, help_text, who, buckets=tb, registry=reg)
                       for field, name, help_text in _TOKEN_HISTOGRAMS}
        self.prefix = PrefixMetrics(reg, base, tb, held=not self.multiprocess)  # the doctor's
        self.outcomes = Counter(
            "llm_proxy_stream_outcomes", "How each stream ended: completed (its last event reached the client, even if the "
            "client closed before the upstream's final bytes), client_disconnected (the client "
            "left first), client_stalled (the client took no bytes for --client-write-timeout; "
            "the proxy closed both connections), upstream_interrupted (the upstream connection "
            "closed or reset before the end), upstream_timeout (no headers or no more bytes "
            "within --read-timeout), pool_timeout (no upstream connection free within "
            "--connect-timeout), upstream_unreachable (connect failed), upstream_4xx, "
            "upstream_5xx (the upstream's status, relayed), upstream_error (an error event "
            "inside a 200 stream: Responses error or response.failed, Messages event: error; "
            "an error object for a 200 answer's body; or invalid HTTP), cancelled (still "
            "running when the proxy's shutdown grace period ended).", (*base, "outcome"),
            registry=reg)
        self.in_flight_gauge = Gauge(
            "llm_proxy_in_flight_requests", "Requests the proxy is handling right now "
            "(queued or relaying), per upstream.", ("upstream",), registry=reg,
            multiprocess_mode="livesum")
        self.request_log_dropped = Counter(
            "llm_proxy_request_log_dropped_lines", "Per-request log lines (--log-requests) "
            "dropped because --log-requests-buffer lines were already waiting for a file "
            "slower than the requests (or writing failed); those requests were served and "
            "measured as usual.", registry=reg)
        self.workload_skipped = Counter(
            "llm_proxy_trace_skipped_requests", "Measured requests answered 2xx that have no "
            "line in the workload file (--workload-file), by reason: no_usage (the upstream reported no "
            "prompt tokens), incomplete (a stream cut short, by the client or the upstream, "
            "before its usage came), dropped (the capture's buffer was full while the file was slower "
            "than the requests, or writing failed); those requests were served and measured "
            "as usual. The name, from when a workload file was called a trace, is kept for "
            "dashboards and alerts.", ("reason",), registry=reg)
        for reason in SKIP_REASONS:
            self.workload_skipped.labels(reason)
        self._init_causes(reg, base, options.ttft_buckets)
        self._children: dict[tuple[str, str, str, str, bool], _Children] = {}
        self.watchers: list[Callable[[RequestRecord], None]] = []  # each finished request

    def in_flight(self, upstream: str) -> Gauge:
        """The in-flight gauge's child for one upstream (resolved once per upstream)."""
        return self.in_flight_gauge.labels(upstream)

    def children(self, route: str, model: str, upstream: str, client: str = "",
                 stream: bool = True) -> _Children:
        key = (route, model, upstream, client, stream)
        found = self._children.get(key)
        if found is None:
            labels = (route, model, upstream)
            who = (*labels, client) if self.client_label is not None else labels
            found = _Children(
                self.ttft.labels(*who), self.ttfa.labels(*who), self.ttfb.labels(*labels),
                self.itl.labels(*who), self.tpot.labels(*labels),
                self.queue.labels(*labels, "true" if stream else "false"),
                self.upstream_queue.labels(*labels),
                self.overhead.labels(*labels),
                tuple((field, h.labels(*who)) for field, h in self.tokens.items()))
            self._children[key] = found
            self._from_zero(labels, who, stream)
        return found

    def _from_zero(self, labels: tuple[str, ...], who: tuple[str, ...], stream: bool) -> None:
        """A new label set's failure series at 0, before any failure: ``rate()`` and
        ``increase()`` count nothing of what a series held at its first scrape, so a
        series born at its first failure would hide it from the rules, the alerts and the
        dashboard (a sporadic failure never). The first request's own failure, counted
        as its series is made, still is (``docs/dashboards.md``, "Series from zero")."""
        flag = "true" if stream else "false"
        for code in _FROM_ZERO_CODES:
            self.requests.labels(*who, flag, code)
        if stream:  # not the wait without a first token: a histogram a client and model
            for outcome in _STREAM_OUTCOMES:  # would add a bucket layout of zeros
                self.outcomes.labels(*labels, outcome)

    def observe(self, record: RequestRecord, *, measured: bool) -> None:
        """Record one finished request. Called exactly once per request.

        ``llm_proxy_requests_total`` is incremented last, so whoever sees a request
        counted (a scrape, a test polling the registry from another thread) also sees
        every other observation of that request: the prompt-cache doctor's wait for a
        batch in one process, and are observed when collected, after this counter.
        """
        stream = "true" if record.stream else "false"
        exemplar = None if self.multiprocess else _exemplar(record)
        # model and client are already bounded label values
        who: tuple[str, ...] = (record.route, record.model, record.upstream)
        if self.client_label is not None:
            who = (*who, record.client)
        self.duration.labels(*who, stream).observe(record.duration_s, exemplar)
        if measured:
            self._observe_measured(record, exemplar)
        self.requests.labels(*who, stream, str(record.status)).inc()
        for watch in self.watchers:
            watch(record)

    def _observe_measured(self, record: RequestRecord, exemplar: dict[str, str] | None) -> None:
        c = self.children(record.route, record.model, record.upstream, record.client,
                          record.stream)
        if record.queue_s is not None:
            c.queue.observe(record.queue_s)
        if record.overhead_s is not None:
            c.overhead.observe(record.overhead_s)
        if record.upstream_queue_s is not None:
            c.upstream_queue.observe(record.upstream_queue_s)
        for field, child in c.tokens:
            if (count := getattr(record, field)) is not None:
                child.observe(count)
        if record.prefix is not None:
            self.prefix.hold((record.route, record.model, record.upstream), record.prefix,
                             record.prompt_tokens, record.cached_prompt_tokens)
        if record.stream:
            if record.outcome is not Outcome.REJECTED:
                self.outcomes.labels(record.route, record.model, record.upstream,
                                     str(record.outcome)).inc()
            if record.ttfb_s is not None:
                c.ttfb.observe(record.ttfb_s)
            if record.ttft_s is not None:
                c.ttft.observe(record.ttft_s, exemplar)
            elif (record.outcome is not Outcome.COMPLETED and record.outcome
                  is not Outcome.REJECTED and (200 <= record.status < 300
                                               or record.outcome in _LEFT_UNANSWERED)):
                # a 2xx stream that broke off, or one whose client left (or whose proxy
                # shut down) before the upstream answered: a queued one, a hung upstream.
                # Its child is made when first needed (not at 0 with the others, as the
                # failure counters are: a layout of empty buckets a client and model)
                who: tuple[str, ...] = (record.route, record.model, record.upstream)
                if self.client_label is not None:
                    who = (*who, record.client)
                self.no_first_token.labels(*who).observe(record.duration_s, exemplar)
            if record.ttfa_s is not None:
                c.ttfa.observe(record.ttfa_s)
            observe_many(c.itl, record.itl_s)
            if record.tpot_s is not None:
                c.tpot.observe(record.tpot_s)
        self._observe_causes(record)
        self._observe_report(record)

    # -- what the records say about causes (proxy.diagnosis reads these) ---------------

    def _init_causes(self, reg: CollectorRegistry, base: tuple[str, ...],
                     ttft_buckets: Sequence[float]) -> None:
        """The prefill fit's sums (see proxy/diagnosis/fit.py) and why answers ended."""
        about = (" Per streamed request with a first token and a prompt token count (the "
                 "upstream's usage, llama.cpp's timings, or, where neither came, the proxy's "
                 "estimate, counted in llm_proxy_prefill_fit_estimated_requests_total); x = "
                 "uncached prompt tokens / 1000 (prompt tokens minus cached prompt tokens, "
                 "cached counted 0 when the upstream does not report it), y = time to "
                 "first token minus the proxy's queue time, in seconds. With the other "
                 "llm_proxy_prefill_fit_* sums: slope = (n*Sxy - Sx*Sy) / (n*Sxx - Sx^2) "
                 "seconds per 1000 uncached prompt tokens, fixed part = (Sy - slope*Sx) / n "
                 "seconds; diagnose also fits a quadratic (docs/diagnose.md).")
        sums = (  # what each sum is, in the order of proxy.diagnosis.fit.SAMPLES
            "n, the requests in the fit.",
            "Sx, the sum of x, in thousands of uncached prompt tokens.",
            "Sy, the sum of y, in seconds.",
            "Sxy, the sum of x*y (thousands of tokens times seconds).",
            "Sxx, the sum of x*x (thousands of tokens squared).",
            "Syy, the sum of y*y (seconds squared), for the slope's standard error.",
            "Sxxx, the sum of x*x*x (thousands of tokens cubed), for the quadratic term.",
            "Sxxxx, the sum of x*x*x*x (thousands of tokens to the fourth), for the "
            "quadratic term.",
            "Sxxy, the sum of x*x*y (thousands of tokens squared times seconds), for the "
            "quadratic term.",
        )
        (self.fit_n, self.fit_x, self.fit_y, self.fit_xy, self.fit_xx, self.fit_yy,
         self.fit_xxx, self.fit_xxxx, self.fit_xxy) = (
            Counter(name.removesuffix("_total"), f"Prefill fit: {what}{about}", base, registry=reg)
            for name, what in zip(FIT_SAMPLES, sums, strict=True))
        self.fit_skipped = Counter(
            "llm_proxy_prefill_fit_skipped", "Streamed requests with a first token left out "
            "of the prefill fit (llm_proxy_prefill_fit_*) because no prompt token count was "
            "known: neither the upstream's usage nor an estimate of the proxy's.", base,
            registry=reg)
        self.fit_estimated = Counter(
            "llm_proxy_prefill_fit_estimated_requests", "Of the requests in the prefill fit "
            "(llm_proxy_prefill_fit_requests_total), those whose prompt tokens are the "
            "proxy's own estimate (about 4 characters a token) because the upstream sent no "
            "usage.", base, registry=reg)
        self.engine_prefill = Histogram(
            "llm_proxy_upstream_prefill_seconds", "Prefill time the upstream engine reported "
            "for itself, per request that reported one: llama.cpp's timings.prompt_ms (the "
            "prompt tokens it computed, timings.prompt_n, the cached ones it reused not "
            "included). diagnose takes its mean as the prefill part of the first token. "
            "Buckets: the TTFT histogram's (--ttft-buckets).",
            base, buckets=ttft_buckets, registry=reg)
        self._engine_children: dict[tuple[str, str, str], Histogram] = {}
        self.provider_reasons = Counter(
            "llm_proxy_prompt_cache_provider_reasons", "Responses carrying the provider's own "
            "cache diagnostics (Anthropic's diagnostics.cache_miss_reason, OpenAI Responses' "
            "prompt_cache_diagnostics; only when the app asked for them, the proxy never "
            "does), by the provider's reason (provider_reason: its own word when documented, "
            "else other; pending while it was still comparing), the doctor's break reason "
            "for the same request (doctor_reason, none when it found no break or did not "
            "look) and whether they agree (agreement: agree, disagree, doctor_silent, "
            "doctor_blind for what the doctor cannot see, a compacted context; not_compared).",
            (*base, "provider_reason", "doctor_reason", "agreement"), registry=reg)
        self._provider_children: dict[tuple[str, ...], Counter] = {}
        self._fit_children: dict[tuple[str, str, str], tuple[Counter, ...]] = {}
        self._estimated_children: dict[tuple[str, str, str], Counter] = {}
        self.finish_reasons = Counter(
            "llm_proxy_finish_reasons", "Why answers ended, one count per measured response "
            "whose finish reason was read (streamed or not), as one of: " + ", ".join(
                f"{name} ({' / '.join(words)})" for name, words in FINISH_CLASSES.items())
            + ", other (anything else). With several choices: length when any choice "
            "stopped at its length limit, else the first choice's.",
            (*base, "finish_reason"), registry=reg)
        self._finish_children: dict[tuple[str, str, str, str], Counter] = {}

    def _observe_causes(self, record: RequestRecord) -> None:
        if record.finish_reasons:
            key4 = (record.route, record.model, record.upstream,
                    finish_class(record.finish_reasons))
            child = self._finish_children.get(key4)
            if child is None:
                child = self._finish_children[key4] = self.finish_reasons.labels(*key4)
            child.inc()
        if not record.stream or record.ttft_s is None:
            return
        key = (record.route, record.model, record.upstream)
        c = self._fit_children.get(key)
        if c is None:
            c = self._fit_children[key] = tuple(
                m.labels(*key) for m in (self.fit_n, self.fit_x, self.fit_y, self.fit_xy,
                                         self.fit_xx, self.fit_yy, self.fit_skipped,
                                         self.fit_xxx, self.fit_xxxx, self.fit_xxy))
        prompt = record.prompt_tokens
        if prompt is None:
            c[6].inc()
            return
        if record.tokens_estimated:
            estimated = self._estimated_children.get(key)
            if estimated is None:
                estimated = self._estimated_children[key] = self.fit_estimated.labels(*key)
            estimated.inc()
        x = max(0, prompt - (record.cached_prompt_tokens or 0)) / KTOKENS
        y = max(0.0, record.ttft_s - (record.queue_s or 0.0))
        xx = x * x  # the same products as proxy.diagnosis.fit.FitSums.add
        c[0].inc()
        c[1].inc(x)
        c[2].inc(y)
        c[3].inc(x * y)
        c[4].inc(xx)
        c[5].inc(y * y)
        c[7].inc(xx * x)
        c[8].inc(xx * xx)
        c[9].inc(xx * y)

    def _observe_report(self, record: RequestRecord) -> None:
        """The upstream's own account: the engine's prefill time, the provider's reason."""
        key = (record.route, record.model, record.upstream)
        if record.engine_prefill_s is not None:
            hist = self._engine_children.get(key)
            if hist is None:
                hist = self._engine_children[key] = self.engine_prefill.labels(*key)
            hist.observe(record.engine_prefill_s)
        if record.provider_cache_reason:
            p = record.prefix
            doctor = p.break_reason if p is not None and not p.unchecked else ""
            labels = (*key, record.provider_cache_reason, doctor or "none",
                      agreement(record.provider_cache_reason, doctor))
            child = self._provider_children.get(labels)
            if child is None:
                child = self._provider_children[labels] = self.provider_reasons.labels(*labels)
            child.inc()

    @staticmethod
    def exposition_type(accept: str | None) -> str:
        """The content type :meth:`exposition` answers ``accept`` with: the format."""
        return choose_encoder(accept or "")[1]

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """Render the registry (or, with workers, every worker's files) for a scrape."""
        encoder, content_type = choose_encoder(accept or "")
        path = self.options.multiprocess_dir
        registry = multiprocess_registry(path) if path is not None else self.registry
        return encoder(registry), content_type
