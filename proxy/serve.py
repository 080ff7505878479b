"""``llm-latency-proxy serve``: settings from flags, environment and config file, then
uvicorn (uvloop, httptools).

Design: ``docs/design/serve.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import inspect
import os
import re
import select
import shutil
import signal
import socket
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from proxy import config
from proxy.config import Settings, redact
from proxy.config_values import SettingsError
from proxy.options import BY_NAME, OPTIONS, SINGLE_UPSTREAM_OPTIONS

# The end of ``serve --help``: the two set-ups most users start from, laid out by hand
# (see _HelpFormatter) within 80 columns, each command as typed (a backslash continues
# it). tests/test_config.py runs their shell lines and parses each command with the
# program's parser into settings that pass the start-up checks.
EXAMPLES = """\
examples:
  In front of OpenAI: apps set their base URL to http://127.0.0.1:8080/v1 and
  send their own OpenAI key; Prometheus scrapes /metrics on port 9100, apart
  from them.

    llm-latency-proxy serve --upstream https://api.openai.com/v1 \\
        --metrics-port 9100

  Several upstreams from a config file (examples/proxy.toml in the repository:
  OpenAI, Anthropic and a local vLLM, routed by model) whose keys the proxy
  holds; clients then present keys of the proxy's own, each one's SHA-256 a
  line of client-keys.sha256 (here one, $CLIENT_KEY).

    export OPENAI_API_KEY=... ANTHROPIC_API_KEY=...
    printf %s "$CLIENT_KEY" | sha256sum | cut -d' ' -f1 >> client-keys.sha256
    llm-latency-proxy serve --config examples/proxy.toml \\
        --client-keys-file client-keys.sha256"""


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's, except that a text of several lines (:data:`EXAMPLES`) keeps its
    layout: a command stays one per line, as it is typed. A one-line text (the
    description, a flag's help) is filled to the terminal's width, and never broken at a
    hyphen: a flag named in a help text (--upstream-api-key-env) stays whole."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the proxy",
        # Every flag is listed below, by group: a usage line of them all would fill a screen.
        usage="%(prog)s [--upstream URL | --config FILE] [OPTION ...]",
        description="Run the instrumenting proxy in front of an OpenAI-compatible upstream. "
        "Every flag can also be set with the environment variable named in its help, and "
        "most as a top-level key of the --config file.",
        epilog=EXAMPLES,
        formatter_class=_HelpFormatter,
    )
    config.add_arguments(parser)
    parser.set_defaults(func=run, error_prefix="llm-latency-proxy: error")


def run(args: argparse.Namespace) -> int:
    env = config.process_env()
    settings = config.from_sources(args, env)
    from proxy.auth import load_key_check

    named = (config.given_as("upstream_api_key_env", args, env),
             config.given_as("client_keys_file", args, env))
    load_key_check(settings.checked_keys_file, upstream_key_env=settings.upstream_api_key_env,
                   env=env, given_as=named)  # fail now, before listening
    # Ctrl-C in a terminal or SIGTERM before the server installs its own handlers (while
    # the app is built, the workers start): a stop, not a crash, so exit 0 without a
    # traceback, as after a drain.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_zero)
    warnings = [upstream_warning(spec.url) for spec in settings.upstream_specs]
    for warning in [*warnings, *rule_edge_warnings(settings, args, env)]:
        if warning:
            print(f"llm-latency-proxy: warning: {warning}", file=sys.stderr, flush=True)
    try:
        if settings.workers > 1:
            return _run_workers(settings, env)
        return _run_single(settings, env)
    except CannotListen as exc:
        flags = (config.given_as(exc.option, args, env),
                 config.given_as(exc.host_option, args, env))
        zero = ("to serve it on the main port" if exc.option == "metrics_port"
                else "for any free port")  # what 0 means for this option
        problem = listen_problem(exc.host, exc.port, exc.error, *flags, zero=zero)
        print(f"llm-latency-proxy: error: {problem}", file=sys.stderr, flush=True)
        return 3


class CannotListen(Exception):
    """A port the proxy cannot listen on (``option``: the setting that names it)."""

    def __init__(self, option: str, host: str, port: int, error: OSError) -> None:
        super().__init__(f"{host}:{port}: {error}")
        self.option = option
        self.host_option = "metrics_host" if option == "metrics_port" else "host"
        self.host, self.port, self.error = host, port, error


def listen_problem(host: str, port: int, error: OSError, port_flag: str = "--port",
                   host_flag: str = "--host", *, zero: str = "for any free port") -> str:
    """One line saying why ``host:port`` cannot be listened on and what to change: the
    usual cause, a port another server holds, gets ``--port 0`` as a way out (``zero``:
    what 0 does for that option)."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sep = " " if port_flag.startswith("--") else "="  # a flag, or its variable
    if error.errno == errno.EADDRINUSE:
        return (f"cannot listen on {where}: the port is in use (another server listens "
                f"there); choose another with {port_flag}{sep}PORT, or {port_flag}{sep}0 {zero}")
    if error.errno == errno.EACCES:
        return (f"cannot listen on {where}: permission denied (ports below 1024 need "
                f"privileges); choose another with {port_flag}{sep}PORT")
    if error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        return (f"cannot listen on {where}: {host} is not an address of this machine "
                f"({error.strerror or error}); check {host_flag}")
    return f"cannot listen on {where}: {error.strerror or error}"


def _listen(host: str, port: int, option: str = "port") -> socket.socket:
    """A socket bound to ``host:port`` as uvicorn binds one (``SO_REUSEADDR``,
    inheritable for the workers), before anything starts or is announced: a port that
    is taken fails the command with :func:`listen_problem`'s line, not after the
    application started and printed that it did."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CannotListen(option, host, port, exc) from None
    sock.set_inheritable(True)
    return sock


_VERSION_SEGMENT = re.compile(r"v\d+\w*")


def rule_edge_warnings(settings: Settings, args: argparse.Namespace | None = None,
                       env: Mapping[str, str] | None = None) -> list[str]:
    """A line per bucket layout that lacks an edge the shipped rules select
    (:data:`proxy.config.RULE_EDGES`), naming the option as it was given (the config
    file's key where neither its flag nor its variable was); none without measurement."""
    out: list[str] = []
    if not settings.measure:
        return out
    for option, edges in config.RULE_EDGES.items():
        have = getattr(settings, option)
        missing = [(edge, what) for edge, what in edges if edge not in have]
        if not missing:
            continue
        named = config.given_as(option, args, env)
        if (named == BY_NAME[option].flag and settings.config
                and (args is None or getattr(args, option, None) is None)):
            named = f"{option} in {settings.config}"
        at = " or ".join(f"{edge:g} s" for edge, _ in missing)
        whats = "; ".join(what for _, what in missing)
        out.append(f"{named} has no edge at {at}, which the shipped rules read "
                   f"(prometheus/rules: {whats}): add it, or move the rules' edges to "
                   "edges you have")
    return out


def upstream_warning(upstream: str) -> str | None:
    """What an upstream URL without a version segment will be asked, else None.

    The proxy appends what follows its own ``/v1`` to the upstream URL, so an upstream
    given as ``http://host:8000`` gets ``/chat/completions``, which an OpenAI-compatible
    server answers with 404. That is a likely mistake but not a certain one (a gateway
    may route without a version), so it is said once at start-up, not refused.
    """
    last = urlsplit(upstream).path.rstrip("/").rsplit("/", 1)[-1]
    if _VERSION_SEGMENT.fullmatch(last):
        return None
    shown = redact(upstream)
    return (f"upstream {shown} has no version segment: /v1/chat/completions will be "
            f"requested as {shown}/chat/completions")


def _log_config() -> dict[str, Any]:
    """uvicorn's logging configuration plus the proxy's own logger, at INFO, on uvicorn's
    stderr handler: the one-line reports (config reloaded, upstream reached through an
    HTTP proxy, rate-limited upstream failures) reach the operator in the same format
    as uvicorn's lines, in every worker (uvicorn applies it in each process)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["proxy"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    # a stream the upstream broke is left unfinished on purpose, and the proxy's own
    # warning says why: uvicorn's ERROR line for it would read as the proxy's fault
    config.setdefault("filters", {})["unfinished"] = {"()": "proxy.logs.NotUnfinishedOnPurpose"}
    config["loggers"].setdefault("uvicorn.error", {})["filters"] = ["unfinished"]
    return config


def _uvicorn_kwargs(settings: Settings) -> dict[str, Any]:
    return {
        "log_config": _log_config(),
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
    }


def _banner(settings: Settings, port: int, tracing: str = "", otlp_metrics: str = "") -> None:
    """The start-up lines, once the port is bound. First the one uvicorn writes when it
    binds a port itself; it does not for a socket it is handed, and scripts wait for it
    (``Uvicorn running on http://host:port``). Then the proxy's: with ``--port 0``, the
    only other place the chosen port appears. ``tracing``: where spans go, when tracing
    is on; ``otlp_metrics``: where OTLP metrics go, when on."""
    import logging

    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host, port)
    where = f"http://{host}:{port}"
    metrics = (f"http://{settings.metrics_host or settings.host}:{settings.metrics_port}/metrics"
               if settings.metrics_port else f"{where}/metrics")
    if settings.ui and settings.measure:  # the page is served wherever /metrics is
        metrics += f"; live page at {metrics.removesuffix('/metrics')}/ui"
    targets = ", ".join(f"{redact(u.url)} ({u.name!r}{', default' if u.default else ''})"
                        for u in settings.upstream_specs)
    if not settings.upstreams:
        targets = f"{redact(settings.upstream)} (upstream label {settings.upstream_label!r})"
    print(f"llm-latency-proxy: relaying {where}/v1 -> {targets}; metrics at {metrics}; "
          f"workers {settings.workers}" + (f"; tracing: {redact(tracing)}" if tracing else "")
          + (f"; OTLP metrics: {redact(otlp_metrics)}" if otlp_metrics else "")
          + (f"; prompt-cache index shared at {redact(settings.cache_index.url)}"
             if settings.cache_index is not None and settings.prefix_doctor else "")
          + (f"; workload capture to {settings.workload_file}" + (".<pid> per worker" if settings.workers > 1
                                                   else "") if settings.workload_file else ""),
          file=sys.stderr, flush=True)


def _run_single(settings: Settings, env: MutableMapping[str, str]) -> int:
    from prometheus_client import disable_created_metrics

    from proxy.metrics import MULTIPROC_ENV

    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    sock = _listen(settings.host, settings.port)
    inherited = env.get(MULTIPROC_ENV)
    if inherited:  # another run's, or another proxy's, files would be counted as this one's
        env[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="llm-latency-proxy-metrics-")
    try:
        return _serve_app(settings, env, sock)
    finally:
        if inherited:
            shutil.rmtree(env[MULTIPROC_ENV], ignore_errors=True)
            env[MULTIPROC_ENV] = inherited


def _serve_app(settings: Settings, env: MutableMapping[str, str], sock: socket.socket) -> int:
    import logging.config

    import uvicorn

    from proxy.app import create_app

    # before the app is made: the lines it logs (an upstream reached through an HTTP
    # proxy) had no handler yet, and were lost, in one process (uvicorn applies the
    # configuration later; a worker's is applied before it makes its app)
    logging.config.dictConfig(_log_config())
    app = create_app(settings, environ=env)
    linger = 0
    if settings.metrics_port and app.metrics is not None:
        _start_metrics_server(settings, app.metrics.registry, app.ui)
        linger = settings.metrics_linger

    class Server(uvicorn.Server):
        signals = 0  # stop signals received
        lingering: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.signals += 1
            if self.lingering is not None:  # a second signal: stop lingering
                loop, stop = self.lingering
                loop.call_soon_threadsafe(stop.set)  # safe from a signal handler
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # listening, application started: the port is final
                _banner(settings, self.servers[0].sockets[0].getsockname()[1],
                        app.tracing.description if app.tracing is not None else "",
                        app.otel_metrics.description if app.otel_metrics is not None else "")

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)  # the drain, then the app's own shutdown
            if linger and not self.force_exit:
                stop = asyncio.Event()
                self.lingering = (asyncio.get_running_loop(), stop)
                if self.signals == 1:  # stopped by a signal, and not told twice
                    _linger_line(settings, linger)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), linger)

    # uvicorn re-raises SIGTERM or SIGINT after its graceful shutdown, under the handler
    # it found (installed by run()): the default ones would end the process with -15, or
    # with a KeyboardInterrupt traceback and 130 for Ctrl-C. Ours exits 0.
    Server(uvicorn.Config(app, **_uvicorn_kwargs(settings))).run(sockets=[sock])
    return 0


def _exit_zero(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _run_workers(settings: Settings, env: MutableMapping[str, str]) -> int:
    """uvicorn's own supervisor, started as ``uvicorn.run`` starts it, except that the
    socket is bound and listening here first, so the start-up line can name the port
    (``--port 0``) and connections made after it wait in the backlog for a worker."""
    from proxy.metrics import MULTIPROC_ENV

    directory = tempfile.mkdtemp(prefix="llm-latency-proxy-metrics-")
    env[MULTIPROC_ENV] = directory  # the workers inherit this environment
    from proxy.app import SUPERVISOR_ENV

    env[SUPERVISOR_ENV] = str(os.getpid())  # they stop with this process
    export_settings(settings, env)
    if settings.workload_file:  # one start, id namespace and hashing secret for every worker
        from proxy.workload_capture import SHARED_ENV, Shared

        env[SHARED_ENV] = Shared.new().encode()
    try:
        import uvicorn
        from uvicorn.supervisors import Multiprocess

        if settings.metrics_port and settings.measure:
            from proxy.metrics import multiprocess_registry

            _start_metrics_server(settings, multiprocess_registry(directory))
        uconfig = uvicorn.Config("proxy.app:create_app_from_env", factory=True,
                                 workers=settings.workers, **_uvicorn_kwargs(settings))
        sock = _listen(settings.host, settings.port)
        sock.listen(uconfig.backlog)
        from proxy import otel_metrics
        from proxy.tracing import sampling, wanted

        endpoint = wanted(settings.otlp_endpoint, env)
        _banner(settings, sock.getsockname()[1],
                f"on, {sampling(env)} -> {endpoint}, from each worker" if endpoint else "",
                f"OTLP/HTTP to {otel_metrics.endpoint(settings.otlp_endpoint, env)}, from each "
                "worker" if otel_metrics.wanted(settings.otlp_metrics, env) else "")
        supervisor_class = _reloading_supervisor(Multiprocess, settings, env)
        if "target" in inspect.signature(Multiprocess).parameters:  # older uvicorn releases
            supervisor = supervisor_class(uconfig, target=uvicorn.Server(uconfig).run,
                                          sockets=[sock])
        else:
            supervisor = supervisor_class(uconfig, sockets=[sock])
        stopped = _stop_signals()  # after Multiprocess() installed its handlers
        supervisor.run()  # handles SIGINT and SIGTERM itself: stops the workers, returns
        sock.close()
        if settings.metrics_port and settings.measure and settings.metrics_linger and stopped():
            _linger_line(settings, settings.metrics_linger)
            _wait_for_signal(settings.metrics_linger)  # the metrics thread serves meanwhile
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


def _reloading_supervisor(base: Any, settings: Settings, env: Mapping[str, str]) -> Any:
    """uvicorn's supervisor, except on SIGHUP: uvicorn restarts every worker, which
    would start workers on files that may not load; here the supervisor reads the
    config file and the client keys file first, once (one line if either does not
    load, and no worker is told), then passes SIGHUP to each worker, which switches its
    upstreams and keys in place (:meth:`proxy.app.ProxyApp.reload`) without dropping a
    stream."""

    class Supervisor(base):  # type: ignore[misc]
        def init_processes(self) -> None:
            with _sigint_blocked():
                super().init_processes()

        def keep_subprocess_alive(self) -> None:  # restarts a worker that died
            before = {process.pid for process in self.processes}
            with _sigint_blocked():
                super().keep_subprocess_alive()
            self._forget(before)

        def handle_ttin(self) -> None:  # one worker more
            with _sigint_blocked():
                super().handle_ttin()

        def handle_ttou(self) -> None:  # one worker fewer
            before = {process.pid for process in self.processes}
            super().handle_ttou()
            self._forget(before)

        def _forget(self, before: set[int | None]) -> None:
            """A worker gone (killed, or one fewer): its live gauges (the in-flight
            requests it held) leave the sums; its counters stay, as counts of the past."""
            from prometheus_client.multiprocess import mark_process_dead

            from proxy.metrics import MULTIPROC_ENV

            for pid in before - {process.pid for process in self.processes}:
                if pid is not None:
                    mark_process_dead(pid, env[MULTIPROC_ENV])  # type: ignore[no-untyped-call]

        def terminate_all(self) -> None:
            # the listening socket closed here first: with the workers' own copies closed
            # as they stop, a connection made during the drain is refused at once, not
            # queued for no worker and reset when the drain ends
            for sock in self.sockets:
                sock.close()
            super().terminate_all()

        def handle_hup(self) -> None:
            from proxy.app import NOTHING_TO_RELOAD, read_reload, reload_refused, reloads

            if not reloads(settings):
                print(f"llm-latency-proxy: SIGHUP ignored: {NOTHING_TO_RELOAD}",
                      file=sys.stderr, flush=True)
                return
            try:
                read_reload(settings, env)
            except SettingsError as exc:
                print(f"llm-latency-proxy: error: {reload_refused(settings, exc)}",
                      file=sys.stderr, flush=True)
                return
            for process in self.processes:
                pid = process.pid
                if pid is not None:
                    os.kill(pid, signal.SIGHUP)

    return Supervisor


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked while workers are started: they inherit the mask and keep it, so
    the Ctrl-C a terminal sends to the whole process group reaches the supervisor only,
    which stops each worker with SIGTERM (one drain, one path). A worker that got it
    would print a ``KeyboardInterrupt`` traceback if it came before uvicorn's handlers
    were installed (while it imports). A SIGINT that arrives meanwhile is delivered to
    the supervisor when the block ends, not lost. multiprocessing's resource tracker is
    started first: starting it unblocks SIGINT (it uses the same mask for itself)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _linger_line(settings: Settings, seconds: int) -> None:
    print(f"llm-latency-proxy: drained; /metrics stays on port {settings.metrics_port} for "
          f"{seconds} s so the last counts are scraped (--metrics-linger; SIGTERM again to "
          "stop now)", file=sys.stderr, flush=True)


def _stop_signals() -> Callable[[], bool]:
    """Whether the supervisor was stopped by SIGTERM/SIGINT (its handlers, installed by
    its constructor, still run): the linger follows a stop signal only, not a supervisor
    that gave up on a worker that cannot start."""
    got: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def note(signum: int, frame: Any, previous: Any = previous) -> None:
            got.append(signum)
            if callable(previous):
                previous(signum, frame)

        signal.signal(sig, note)
    return lambda: bool(got)


def _wait_for_signal(seconds: float) -> None:
    """Sleep up to ``seconds``; a SIGTERM or SIGINT ends it at once (the handler writes
    to a pipe that ``select`` waits on)."""
    read_fd, write_fd = os.pipe()
    try:
        def wake(signum: int, frame: Any) -> None:
            with contextlib.suppress(OSError):  # closed: the wait is over already
                os.write(write_fd, b"\0")

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, wake)
        select.select([read_fd], [], [], seconds)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def _start_metrics_server(settings: Settings, registry: Any, page: Any = None) -> None:
    """``/metrics`` on its own port, out of reach of app clients (``--metrics-port``),
    and the live page beside it unless ``--no-ui``: the page shows what ``/metrics``
    shows, so it goes where ``/metrics`` goes. prometheus_client's own WSGI app answers
    everything but the page's paths, on a server built as its ``start_http_server``
    builds one (threads, silent log). ``page``: the relaying process's page (single
    process), which also knows the slowest requests; with workers, a page of its own."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    host = settings.metrics_host or settings.host
    app = make_wsgi_app(registry)
    if settings.ui and settings.measure:
        if page is None:
            from proxy.ui import LivePage, index_scope

            page = LivePage(registry, prefix_index=index_scope(
                doctor=settings.prefix_doctor, shared=settings.cache_index is not None,
                workers=settings.workers))
        app = page.wsgi(app)

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    try:  # a host that does not resolve is a CannotListen too

        class Server(ThreadingWSGIServer):
            address_family = socket.getaddrinfo(host, settings.metrics_port, 0, socket.SOCK_STREAM)[0][0]

        httpd = make_server(host, settings.metrics_port, app, Server, handler_class=Quiet)
    except OSError as exc:
        raise CannotListen("metrics_port", host, settings.metrics_port, exc) from None
    threading.Thread(target=httpd.serve_forever, name="metrics-port", daemon=True).start()


def export_settings(settings: Settings, environ: MutableMapping[str, str]) -> None:
    """Write every setting back as its ``LLM_PROXY_*`` variable (for worker processes)."""
    for opt in OPTIONS:
        if settings.config and opt.name in SINGLE_UPSTREAM_OPTIONS:
            environ.pop(opt.env, None)  # the workers read the upstreams from the file
            continue
        value = getattr(settings, opt.name)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, tuple):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        environ[opt.env] = text
