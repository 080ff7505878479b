"""``llm-latency-proxy serve``: settings from flags and environment, then uvicorn.

Start-up order matters: settings are validated (a bad one exits 2 with a one-line
message naming it) before anything listens; with ``--workers N`` the multiprocess
metrics directory is created *before* any process imports prometheus_client, because
the library picks its storage at import time.

Multiprocess directory: a fresh private directory per proxy instance
(``mkdtemp``), so two proxies on one host never share or wipe each other's files; it
is removed when the proxy exits. Workers get the settings through the ``LLM_PROXY_*``
variables, the same path a container uses.

uvicorn runs with uvloop and httptools (``uvicorn[standard]``). On SIGTERM or SIGINT it
stops accepting, lets in-flight streams finish for up to ``--graceful-timeout``
seconds, then exits 0.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import tempfile
from typing import Any

from proxy import config
from proxy.config import OPTIONS, Settings, SettingsError


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the proxy",
        description="Run the instrumenting proxy in front of an OpenAI-compatible upstream. "
        "Every flag can also be set with the environment variable named in its help.",
    )
    config.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        settings = config.from_sources(args)
        if settings.upstream_api_key_env:
            from proxy.auth import load_key_check

            load_key_check(settings)  # fail now, before listening
    except SettingsError as exc:
        print(f"llm-latency-proxy: error: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        return _run_workers(settings)
    return _run_single(settings)


def _uvicorn_kwargs(settings: Settings) -> dict[str, Any]:
    return {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        "http": "httptools",
        "lifespan": "on",
        "access_log": settings.access_log,
        "timeout_graceful_shutdown": settings.graceful_timeout,
        "log_level": "info",
        "proxy_headers": False,
        "server_header": False,
        "date_header": False,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
    }


def _banner(settings: Settings) -> None:
    where = f"http://{settings.host}:{settings.port}"
    metrics = (f"http://{settings.metrics_host or settings.host}:{settings.metrics_port}/metrics"
               if settings.metrics_port else f"{where}/metrics")
    upstream = re.sub(r"//[^/@]*@", "//***@", settings.upstream)  # never print URL credentials
    print(f"llm-latency-proxy: relaying {where}/v1 -> {upstream} "
          f"(upstream label {settings.upstream_label!r}); metrics at {metrics}; "
          f"workers {settings.workers}", file=sys.stderr, flush=True)


def _run_single(settings: Settings) -> int:
    import uvicorn
    from prometheus_client import disable_created_metrics

    from proxy.app import create_app

    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    try:
        app = create_app(settings)
    except SettingsError as exc:
        print(f"llm-latency-proxy: error: {exc}", file=sys.stderr)
        return 2
    if settings.metrics_port and app.metrics is not None:
        _start_metrics_server(settings, app.metrics.registry)
    _banner(settings)
    # uvicorn re-raises SIGTERM after its graceful shutdown, under the handler it found;
    # the default one would end the process with -15. Ours exits 0 (issue 6).
    signal.signal(signal.SIGTERM, _exit_zero)
    uvicorn.Server(uvicorn.Config(app, **_uvicorn_kwargs(settings))).run()
    return 0


def _exit_zero(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _run_workers(settings: Settings) -> int:
    directory = tempfile.mkdtemp(prefix="llm-latency-proxy-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    export_settings(settings, os.environ)
    try:
        import uvicorn

        if settings.metrics_port and settings.measure:
            from proxy.metrics import multiprocess_registry

            _start_metrics_server(settings, multiprocess_registry(directory))
        _banner(settings)
        uvicorn.run("proxy.app:create_app_from_env", factory=True, workers=settings.workers,
                    **_uvicorn_kwargs(settings))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


def _start_metrics_server(settings: Settings, registry: Any) -> None:
    """``/metrics`` on its own port, out of reach of app clients (``--metrics-port``)."""
    from prometheus_client import start_http_server

    start_http_server(settings.metrics_port, addr=settings.metrics_host or settings.host,
                      registry=registry)


def export_settings(settings: Settings, environ: Any) -> None:
    """Write every setting back as its ``LLM_PROXY_*`` variable (for worker processes)."""
    for opt in OPTIONS:
        value = getattr(settings, opt.name)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, tuple):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        environ[opt.env] = text
