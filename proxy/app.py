"""Wiring: ``create_app(settings, *, transport=None, registry=None, clock=time.perf_counter)``.

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from proxy.admission import Admission
from proxy.asgi import Receive, Scope, Send
from proxy.auth import OBSERVER_CHALLENGE, KeyCheck, load_key_check, observer_key
from proxy.clients import identify_from
from proxy.config import Settings, process_env, reload_specs
from proxy.config_values import SettingsError
from proxy.doctor.job import PrefixCheck
from proxy.metrics import MULTIPROC_ENV, Metrics, MetricsOptions
from proxy.otel_metrics import otel_metrics_from
from proxy.reqlog import RequestLog
from proxy.routes import HandlerOptions, V1Handler
from proxy.routing import LiveUpstreams
from proxy.scrape import Scrapes
from proxy.tracing import tracing_from
from proxy.ui import UI_PATHS, index_scope, live_page
from proxy.upstream import UpstreamClient, error_body
from proxy.upstream_spec import UpstreamSpec
from proxy.wire.pool import WireTransport
from proxy.workload_capture import SHARED_ENV, capture_from

log = logging.getLogger("proxy")


class ProxyApp:
    """The proxy as an ASGI application: the one place that reads ``Settings`` and hands
    each part the values it uses (``docs/development.md``, "Settings and the environment")."""

    def __init__(self, settings: Settings, *, transport: WireTransport | None = None,
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 serve_metrics: bool | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.settings = s = settings
        # The process environment, read here once for every part built below (keys,
        # secrets, the OTEL_* variables); the settings' own variables were read by config.
        self.environ = env = process_env() if environ is None else environ
        self.metrics = Metrics(registry, metrics_options(s, env)) if s.measure else None
        self.scrapes = (Scrapes(self.metrics.exposition, self.metrics.exposition_type)
                        if self.metrics is not None else None)
        # First of what starts a thread: a workload file that cannot be opened stops here.
        skipped = self.metrics.workload_skipped if self.metrics is not None else None
        self.capture = capture_from(
            s.workload_file, block_size=s.workload_block_size,
            rotate_bytes=s.workload_rotate_bytes, rotate_seconds=s.workload_rotate_seconds,
            client=s.workload_client, workers=s.workers, shared=env.get(SHARED_ENV, ""),
            clock=clock, skipped=(
                (lambda reason, n: skipped.labels(reason).inc(n)) if skipped is not None else None))
        self.upstreams = LiveUpstreams(
            s.upstream_specs, self.metrics.in_flight if self.metrics else None, transport,
            env=env)
        self.request_log = (
            RequestLog(s.log_requests, buffer=s.log_requests_buffer,
                       dropped=self.metrics.request_log_dropped.inc if self.metrics else None)
            if s.log_requests else None)
        self.tracing = tracing_from(otlp_endpoint=s.otlp_endpoint, upstream=s.default_url,
                                    propagate=s.propagate_trace, clock=clock, env=env)
        self.otel_metrics = otel_metrics_from(
            otlp_metrics=s.otlp_metrics, otlp_endpoint=s.otlp_endpoint, measure=s.measure,
            upstream=s.default_url, max_models=s.max_models, env=env)
        self.serve_metrics = (not s.metrics_port) if serve_metrics is None else serve_metrics
        self.ui = (live_page(self.metrics, prefix_index=index_scope(
            doctor=s.prefix_doctor, shared=s.cache_index is not None,
            workers=s.workers)) if s.ui and self.metrics is not None else None)
        # Said in the 404 for any other path (a browser opening the root first): what is here.
        self.elsewhere = ("" if not self.serve_metrics or self.metrics is None else
                          "; the live page is at /ui, metrics at /metrics" if self.ui is not None
                          else "; metrics are at /metrics")
        self.keys = load_key_check(s.checked_keys_file, upstream_key_env=s.upstream_api_key_env,
                                   env=env)
        # The doctor, when someone reads what it finds: metrics, the log, spans, the capture.
        read = (self.metrics, self.request_log, self.tracing, self.capture)
        prefix = (PrefixCheck(window_s=s.prefix_window, index_bytes=s.prefix_index_bytes,
                              cache_index=s.cache_index, env=env, clock=clock,
                              secret=self.capture.secret if self.capture is not None else None,
                              keep_keys=self.capture is not None)
                  if s.prefix_doctor and any(r is not None for r in read) else None)
        self.v1 = V1Handler(
            options=HandlerOptions(
                max_header_bytes=s.max_header_bytes, max_body_bytes=s.max_body_bytes,
                body_timeout=s.body_timeout, client_write_timeout=s.client_write_timeout,
                inject_usage=s.inject_usage, secret_headers=s.secret_headers,
                key_label=s.client_label_from == "key"),
            upstreams=self.upstreams, clock=clock, prefix=prefix, metrics=self.metrics,
            keys=self.keys, request_log=self.request_log, tracing=self.tracing,
            identify=identify_from(s.client_label_from, env), otel_metrics=self.otel_metrics,
            capture=self.capture)

    @property
    def upstream(self) -> UpstreamClient:
        """The first upstream's client (the only one without a config file)."""
        return self.upstreams.targets[0].client

    @property
    def admission(self) -> Admission:
        """The first upstream's admission (the only one without a config file)."""
        return self.upstreams.targets[0].admission

    def reload(self) -> bool:
        """What ``SIGHUP`` does: re-read the config file's ``[[upstream]]`` tables and the
        client keys file (:func:`read_reload`), and switch to them; streams in flight
        finish on the upstream they started on, and a revoked key is refused from the
        next request on. Both files are read first, and if either does not load nothing
        changes (one log line says why). Top-level settings are read at start only: a
        change to them is named in a warning and not applied."""
        if not reloads(self.settings):
            log.warning("SIGHUP ignored: %s", NOTHING_TO_RELOAD)
            return False
        try:
            fresh = read_reload(self.settings, self.environ)
        except SettingsError as exc:
            log.error("%s", reload_refused(self.settings, exc))
            return False
        if fresh.specs is not None:
            self.upstreams.replace(fresh.specs)
            log.info("config reloaded from %s: upstreams %s", self.settings.config,
                     ", ".join(f"{s.name} {s.url}" for s in fresh.specs))
        if fresh.keys is not None and self.keys is not None:
            self.keys.use(fresh.keys)
            log.info("client keys reloaded from %s: %d keys", self.settings.client_keys_file,
                     len(fresh.keys))
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path: str = scope["path"]
            if path.startswith("/v1/") or path == "/v1":
                await self.v1(scope, receive, send)
            elif path == "/healthz":
                await _plain(send, 200, b"ok\n", b"text/plain; charset=utf-8")
            elif self.serve_metrics and (path == "/metrics"
                                         or (path in UI_PATHS and self.ui is not None)):
                if self.keys is not None and not self.keys.accepts(observer_key(scope["headers"])):
                    await _plain(send, 401, error_body(
                        "this proxy checks client keys: present one to read /metrics and /ui "
                        "(Authorization: Bearer, x-api-key, api-key, or as the password of "
                        "HTTP Basic auth)", "invalid_request_error", "invalid_api_key"),
                        b"application/json", OBSERVER_CHALLENGE)
                elif path == "/metrics":
                    await self._metrics(scope, send)
                else:
                    assert self.ui is not None
                    await self.ui.asgi(scope, send)
            else:
                await _plain(send, 404, error_body(f"no route {path[:200]}; this proxy serves "
                                                   f"/v1/*{self.elsewhere}",
                                                   "invalid_request_error", "not_found"),
                             b"application/json")
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _metrics(self, scope: Scope, send: Send) -> None:
        """Rendered in a worker thread, one render shared by concurrent scrapes
        (:mod:`proxy.scrape`): never a stall of the streams on this loop."""
        if self.scrapes is None:
            await _plain(send, 404, b"measurement is off (--no-measure)\n", b"text/plain")
            return
        accept = None
        for name, value in scope["headers"]:
            if name == b"accept":
                accept = value.decode("latin-1")
        body, content_type = await self.scrapes(accept)
        await _plain(send, 200, body, content_type.encode())

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # Signal handlers live in the main thread: a server run in another thread
                # (embedded, or a test's) has none and is reloaded by calling reload().
                if reloads(self.settings) and threading.current_thread() is threading.main_thread():
                    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
                _freeze_startup_objects()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def aclose(self) -> None:
        await self.upstreams.aclose()
        if self.v1.prefix is not None:
            self.v1.prefix.close()
        if self.metrics is not None:  # the doctor's last findings (a worker's files)
            self.metrics.prefix.flush()
        if self.request_log is not None:  # every buffered line written: off the loop
            await asyncio.to_thread(self.request_log.close)
        if self.capture is not None:  # likewise every buffered workload line
            await asyncio.to_thread(self.capture.close)
        # The last exports of spans and OTLP metrics: off the event loop, side by side, so
        # their bounded waits (a collector that is down) do not add up.
        await asyncio.gather(*(asyncio.to_thread(exporting.shutdown)
                               for exporting in (self.tracing, self.otel_metrics)
                               if exporting is not None))


NOTHING_TO_RELOAD = "nothing to reload (no --config file, no --client-keys-file in use)"


@dataclass(frozen=True, slots=True)
class Reload:
    """What ``SIGHUP`` re-reads, read and validated as a whole."""

    specs: tuple[UpstreamSpec, ...] | None  # the config file's tables, with --config
    keys: KeyCheck | None  # the client keys, when the proxy checks them


def reloads(settings: Settings) -> bool:
    """Whether ``SIGHUP`` has anything to re-read: a config file, or client keys."""
    return bool(settings.config) or settings.holds_upstream_key


def metrics_options(settings: Settings, env: Mapping[str, str]) -> MetricsOptions:
    """The metrics' options from the settings of the same names, and the workers'
    directory from ``PROMETHEUS_MULTIPROC_DIR`` (set by ``serve --workers``)."""
    s = settings
    return MetricsOptions(
        max_models=s.max_models, model_allowlist=s.model_allowlist,
        client_label=bool(s.client_label_from), max_clients=s.max_clients,
        client_allowlist=s.client_allowlist, ttft_buckets=s.ttft_buckets,
        itl_buckets=s.itl_buckets, duration_buckets=s.duration_buckets,
        token_buckets=s.token_buckets, multiprocess_dir=env.get(MULTIPROC_ENV) or None)


def read_reload(settings: Settings, env: Mapping[str, str]) -> Reload:
    """The config file's ``[[upstream]]`` tables and the client keys file as they are
    now, or :class:`SettingsError` naming the file and the problem. Nothing is applied
    here: with ``--workers`` the supervisor calls this once to decide whether to pass
    the signal on at all (:mod:`proxy.serve`), then each worker reads and applies."""
    specs = reload_specs(settings, env) if settings.config else None
    return Reload(specs, load_key_check(settings.checked_keys_file, env=env,
                                        upstream_key_env=settings.upstream_api_key_env))


def reload_refused(settings: Settings, exc: SettingsError) -> str:
    """The one line for a reload that did not load: what stays, and why."""
    kept = [name for name, on in (("upstreams", bool(settings.config)),
                                  ("client keys", settings.holds_upstream_key)) if on]
    what = "config" if settings.config else "client keys"
    return f"{what} reload refused, the running {' and '.join(kept)} stay: {exc}"


def _freeze_startup_objects() -> None:
    """Move everything alive at startup (modules, classes, settings) out of the garbage
    collector's reach, so the periodic full collections that per-event allocations
    trigger scan only what requests created (``gc.freeze``). Cheap insurance rather than
    a measured win (docs/performance.md)."""
    gc.collect()
    gc.freeze()


async def _plain(send: Send, status: int, body: bytes, content_type: bytes,
                 *extra: tuple[bytes, bytes]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def create_app(settings: Settings, *, transport: WireTransport | None = None,
               registry: CollectorRegistry | None = None,
               clock: Callable[[], float] = time.perf_counter,
               environ: Mapping[str, str] | None = None) -> ProxyApp:
    """Build the proxy; the production defaults are one upstream client per configured
    upstream, a private registry, ``time.perf_counter`` and the process environment."""
    return ProxyApp(settings, transport=transport, registry=registry, clock=clock,
                    environ=environ)


def create_app_from_env() -> ProxyApp:
    """Factory for uvicorn workers: settings come from the ``LLM_PROXY_*`` variables
    that :mod:`proxy.serve` exported before starting them. A worker stops with its
    supervisor, however the supervisor ended (:func:`stop_with_parent`)."""
    from proxy.config import from_sources

    env = process_env()
    supervisor = env.get(SUPERVISOR_ENV, "")
    if supervisor.isdigit():
        stop_with_parent(int(supervisor))
    return create_app(from_sources())


SUPERVISOR_ENV = "LLM_PROXY_WORKER_SUPERVISOR"  # set by serve's supervisor: its pid


def stop_with_parent(parent: int) -> None:
    """On Linux, SIGTERM to this process when its parent, ``parent``, ends
    (``PR_SET_PDEATHSIG``): a supervisor killed with SIGKILL would otherwise leave its
    workers serving the port, with no one to restart or stop them; one that ended
    before this was asked (a worker still starting) gets it at once. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl to call: nothing to do
        return
    if os.getppid() != parent:  # the parent ended before the request was made
        os.kill(os.getpid(), signal.SIGTERM)
