"""One command: fake upstream + every target side by side, interleaved rounds, medians.

    python benchmarks/run.py                 # full run (about 22 min on 2 cores)
    python benchmarks/run.py --quick         # smoke configuration, < 60 s
    python benchmarks/run.py --with-litellm  # add LiteLLM (benchmarks/litellm/setup.sh first)

What it does, and why:

* Starts ``fake_upstream.py`` (fixed schedule: TTFT, ITL, tokens) and every target once:
  ``direct`` (the upstream itself), ``nginx`` (proxy_buffering off, ``nginx.conf``),
  ``proxy`` (``python -m proxy serve``), ``proxy-nomeasure`` (``--no-measure``, prices the
  measurement) and optionally ``litellm``. Idle targets cost nothing, so all stay up.
* ``proxy-20up`` (any ``-Nup``) is the same proxy started with ``--config`` instead of
  ``--upstream``: a generated file of N upstreams, N-1 decoys first and the fake upstream
  last, so routing by model walks the whole table before the table caches its decision
  (see :meth:`Bench.upstreams_config`).
* Loads with ``close`` (e.g. ``64close``) run against a second fake upstream started
  with ``--close`` (``Connection: close`` and a closed connection after every response,
  as HTTP/1.0-style servers and some load balancers do) and a second instance of every
  target pointed at it, so each proxied request opens a new upstream connection. Loads
  may name another API (``64-responses``, ``64-messages``): the fake upstream streams
  OpenAI Responses or Anthropic Messages events on the same schedule.
* For each round, for each load, runs ``loadgen.py`` against every target, rotating the
  target order each round (A B C, B C A, ...), so drift on a noisy machine hits all
  targets alike. "Added" figures are target minus direct *in the same round and load*;
  the table shows the median over rounds. ``--together``: a round's targets run at the
  same time instead, each with its own client, so the host's swings in speed within a
  round reach all of them at once; their latencies then include each other's.
* Target CPU comes from the threads' ``schedstat`` (time on a CPU, in ns, summed over the
  process tree, e.g. nginx master + workers) before/after each load, divided by SSE
  events relayed; a round line gives it to three decimals, so that paired ratios are
  not steps of a tenth of a microsecond.
  Memory per open stream is (median RSS while the load is steady - idle RSS) / streams;
  peak RSS is ``VmHWM`` summed over the tree at the end.
* Pinning (default, ``--no-pin`` to switch off): targets on CPU 0, fake upstream and load
  client on CPU 1, so a target never competes with the instrument for its core.
* The live page's cost: a ``proxy-ui`` target is a ``proxy`` whose page is open during
  every load (:class:`PagePoller`: ``GET /ui`` once, then ``/ui/data`` every second, as
  the page's script does), so ``proxy`` beside ``proxy-ui`` prices an open page in CPU
  per event, e.g. ``--targets direct,proxy,proxy-ui --loads 64``.
* Scraped by a real Prometheus: a ``-scraped`` target (e.g. ``proxy-scraped``,
  ``proxy-before-scraped``) runs with ``--client-label-from header:x-client``, its
  registry is filled before the loads with the realistic label sets of
  ``loop_micro.py`` (``--scrape-fill``: 50 clients x 3 models, one streamed request
  each), and during each of its loads a ``prometheus`` server (:class:`Scraper`, on the
  client's CPU) scrapes its ``/metrics`` every ``--scrape-interval`` (1 s): the streams'
  ITL while the proxy renders a registry of real size, e.g. ``--targets
  direct,proxy,proxy-before,proxy-scraped,proxy-before-scraped --before DIR --loads 64``.
* What a file per request costs: ``proxy-reqlog`` writes the per-request log
  (``--log-requests``), ``proxy-capture`` the workload capture (``--workload-file``), each to a file in
  the run's temporary directory, so ``--targets direct,proxy,proxy-reqlog,proxy-capture
  --loads 64`` sets their CPU per event side by side (``--prompt-bytes 2048`` for
  prompts of a realistic size: the capture's work grows with the prompt's blocks).
* A rate sweep raises the number of 50 tokens/s streams until a target's added p99 TTFT
  passes the threshold (10 ms) or it breaks streams.
* Bounded: every loadgen run has a duration and a stream timeout, every child process a
  deadline, the whole run ``--max-minutes``; all children are stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

try:  # run as a script or imported as benchmarks.run
    from loadgen import add_prompt_shape  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - import path depends on how we are run
    from benchmarks.loadgen import add_prompt_shape

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
BENCH_MODEL = "bench"  # the model every loadgen.py request names (LoadConfig.model)
DEFAULT_LITELLM_VENV = "/tmp/llm-latency-proxy-bench/venv-litellm"


# --------------------------------------------------------------------------- /proc


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
    return out


def proc_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (nginx workers, uvicorn workers)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo.extend(_children(p))
    return seen


def cpu_seconds(pids: list[int]) -> float:
    """utime+stime of ``pids`` (fields 14, 15 of /proc/<pid>/stat), in seconds."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def _schedstat_seconds(pids: list[int], field: int) -> float:
    """A field of the threads' ``/proc/<pid>/task/<tid>/schedstat`` (ns), summed, in s."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[field])
    return total / 1e9


def on_cpu_seconds(pids: list[int]) -> float:
    """Time the threads of ``pids`` ran on a CPU (schedstat field 1), to the nanosecond:
    the targets' CPU. ``/proc/<pid>/stat`` counts clock ticks (10 ms), which over a round
    of a few CPU-seconds move a ratio by about half a percent. A thread that exits during
    a load takes its time with it (the proxy's threads live as long as it does)."""
    return _schedstat_seconds(pids, 0)


def runqueue_wait_seconds(pids: list[int]) -> float:
    """Time the threads of ``pids`` spent runnable but waiting for a CPU (schedstat field
    2): how much other work on the machine delayed them."""
    return _schedstat_seconds(pids, 1)


def busy_seconds() -> float:
    """Non-idle CPU time of the whole machine (all CPUs) from /proc/stat, in seconds."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / CLK_TCK


def mem_kib(pids: list[int], key: str) -> int:
    """Sum of ``VmRSS``/``VmHWM`` (KiB) over ``pids``."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    total += int(line.split()[1])
                    break
    return total


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[Any] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)  # polling for a port to open, not timing anything
    raise TimeoutError(f"nothing listening on {port} after {timeout} s")


APIS = ("chat", "responses", "messages")
_LOAD = re.compile(r"(\d+)(new)?(close)?(?:idle(\d+(?:\.\d+)?))?(?:-(chat|responses|messages))?")


@dataclass(frozen=True)
class Load:
    """One load: concurrent streams, how the client connects, how the upstream answers,
    which API is streamed."""

    streams: int
    keepalive: bool = True  # client: one kept-alive connection per user ('new': per stream)
    close: bool = False  # upstream: Connection: close and closed after every response
    api: str = "chat"
    idle: float = 0.0  # seconds each user waits between its streams ('idle6': sparse traffic)

    @classmethod
    def parse(cls, spec: str, api: str = "chat") -> Load:
        """``N[new][close][idleS][-API]``, e.g. ``64``, ``64new``, ``256close``,
        ``1newidle6`` (a pause of 6 s before every stream: the traffic of an internal tool
        or a night, which finds pooled connections expired), ``64-responses``; ``api`` for
        specs that name none."""
        m = _LOAD.fullmatch(spec.strip())
        if m is None:
            raise SystemExit(
                f"bad load {spec!r}: N[new][close][idleS][-chat|-responses|-messages], "
                "e.g. 64, 64new, 256close, 1newidle6, 64-responses"
            )
        return cls(int(m[1]), m[2] is None, m[3] is not None, m[5] or api, float(m[4] or 0))

    @classmethod
    def of(cls, run: dict[str, Any]) -> Load:
        """The load of a run or row (runs recorded before ``close``/``api`` existed
        were keep-alive upstream, chat)."""
        return cls(
            run["load"],
            run["keepalive"],
            run.get("close", False),
            run.get("api", "chat"),
            run.get("idle", 0.0),
        )

    @property
    def label(self) -> str:
        """The load as ``--loads`` spells it (``64``, ``64new``, ``256close-messages``)."""
        conn = "" if self.keepalive else "new"
        upstream = "close" if self.close else ""
        api = "" if self.api == "chat" else "-" + self.api
        idle = f"idle{self.idle:g}" if self.idle else ""
        return f"{self.streams}{conn}{upstream}{idle}{api}"


@dataclass
class Target:
    """A thing the load client talks to, and the processes whose CPU/memory we read."""

    name: str
    url: str
    proc: subprocess.Popen[Any] | None = None
    headers: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    idle_rss_kib: int = 0
    close: bool = False  # in front of the close-per-response upstream
    poll_ui: bool = False  # its live page is open (polled) during every load
    scraped: bool = False  # a Prometheus scrapes its /metrics during every load

    def pids(self) -> list[int]:
        return proc_tree(self.proc.pid) if self.proc is not None else []

    @property
    def key(self) -> str:
        """Unique per instance: the name, ``@close`` added for the close-upstream twin."""
        return peak_key(self.name, self.close)


class PagePoller:
    """A browser tab with the proxy's live page open: ``GET /ui`` once, then
    ``/ui/data`` every ``every`` seconds, one request at a time, until stopped."""

    def __init__(self, root: str, every: float = 1.0) -> None:
        self.root = root
        self.every = every
        self.polls = 0
        self.failures = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ui-poller", daemon=True)

    def __enter__(self) -> PagePoller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def _get(self, path: str) -> None:
        try:
            with urllib.request.urlopen(self.root + path, timeout=5) as response:
                response.read()
            self.polls += 1
        except OSError:
            self.failures += 1

    def _run(self) -> None:
        self._get("/ui")
        while not self.stop.wait(self.every):
            self._get("/ui/data")


class Scraper:
    """A real Prometheus server scraping one target's ``/metrics`` every ``interval``
    seconds (scrape timeout: the interval, the most Prometheus allows), started before a
    load and stopped after it; pinned like the load client. :attr:`stats` afterwards:
    scrapes attempted and answered, and their durations as Prometheus measured them."""

    def __init__(self, bench: Bench, root: str, interval: float) -> None:
        exe = shutil.which("prometheus")
        if exe is None:
            raise SystemExit("-scraped targets need a prometheus server on PATH "
                             "(Debian: apt-get install prometheus)")
        self.bench, self.exe, self.interval = bench, exe, interval
        self.target = root.removeprefix("http://")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="prometheus-", dir=bench.tmp))
        self.proc: subprocess.Popen[Any] | None = None
        self.started = 0.0
        self.stats: dict[str, float | None] = {}

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []

    def __enter__(self) -> Scraper:
        every = f"{self.interval:g}s"
        (self.dir / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {every}\n  scrape_timeout: {every}\n"
            f"scrape_configs:\n  - job_name: proxy\n    static_configs:\n"
            f"      - targets: ['{self.target}']\n"
        )
        log = (self.dir / "prometheus.log").open("wb")  # closed with the bench's logs
        self.bench.logs.append(log)
        self.proc = subprocess.Popen(
            [
                *self.bench.pin(self.bench.args.client_cpu),
                self.exe, f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=log, stderr=log, start_new_session=True,
        )
        self.bench.procs.append(self.proc)
        # Prometheus hands new targets to its scrapers every 5 s: the load starts once
        # the first scrape is done, so that it is scraped from its first second.
        deadline = time.monotonic() + 60
        while not self._scraped_once():  # polling for an event, not timing anything
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("prometheus did not scrape the target within 60 s")
            time.sleep(0.1)
        self.started = time.monotonic()
        return self

    def _scraped_once(self) -> bool:
        url = f"http://127.0.0.1:{self.port}/api/v1/targets?state=active"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                targets = json.loads(r.read())["data"]["activeTargets"]
        except (OSError, ValueError, KeyError):
            return False
        return any(t.get("health") in ("up", "down") for t in targets)

    def query(self, expr: str) -> float | None:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                result = json.loads(r.read())["data"]["result"]
        except (OSError, ValueError, KeyError):
            return None
        return float(result[0]["value"][1]) if result else None

    def __exit__(self, *exc: object) -> None:
        window = f"{int(time.monotonic() - self.started) + 2}s"
        self.stats = {
            "scrapes": self.query(f"count_over_time(up[{window}])"),
            "scrapes_ok": self.query(f"sum_over_time(up[{window}])"),
            "scrape_s_avg": self.query(f"avg_over_time(scrape_duration_seconds[{window}])"),
            "scrape_s_max": self.query(f"max_over_time(scrape_duration_seconds[{window}])"),
        }
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
            self.bench.procs.remove(proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def fill_registry(url: str, pairs: list[tuple[str, str]], tokens: int = 2) -> None:
    """One short streamed chat request per (model, client) through the proxy at ``url``
    (its ``/v1``), the client named in ``x-client``: every per-request histogram of each
    label set gets samples, as in production. Sixteen at a time."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor

    where = urllib.parse.urlsplit(url)

    def one(pair: tuple[str, str]) -> None:
        model, client = pair
        body = json.dumps({"model": model, "stream": True, "max_tokens": tokens,
                           "messages": [{"role": "user", "content": "fill"}]})
        conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=30)
        try:
            conn.request("POST", where.path + "/chat/completions", body,
                         {"content-type": "application/json", "x-client": client})
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        if response.status != 200 or b"[DONE]" not in data:
            raise RuntimeError(f"filling the registry: HTTP {response.status} for {pair}")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, pairs))


def scrape_fill(spec: str) -> list[tuple[str, str]]:
    """``--scrape-fill CLIENTS,MODELS_PER_CLIENT``: the (model, client) pairs of
    ``loop_micro.py``'s realistic registry, all on the run's one upstream."""
    from loop_micro import realistic_sets

    try:
        clients, per_client = (int(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"bad --scrape-fill {spec!r}: CLIENTS,MODELS_PER_CLIENT") from None
    return sorted({(model, client) for _, model, _, client in
                   realistic_sets(clients, per_client, routes=1)})


def peak_key(name: str, close: bool) -> str:
    return name + ("@close" if close else "")


class Bench:
    """Owns the child processes; stops them all on exit."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[subprocess.Popen[Any]] = []
        self.logs: list[BinaryIO] = []  # children's output files, closed with them
        self.tmp = Path(tempfile.mkdtemp(prefix="llm-proxy-bench-"))
        self.upstream_procs: dict[bool, subprocess.Popen[Any]] = {}  # by close mode
        self.codes: dict[str, str] = {}  # proxy code measured: short sha256 per source
        self.refusing: socket.socket | None = None  # the decoy upstreams' port (-Nup)

    def pin(self, cpu: str) -> list[str]:
        """Command prefix: optional priority (``--nice``) and CPU pinning (taskset)."""
        prefix = ["nice", "-n", str(self.args.nice)] if self.args.nice else []
        if self.args.no_pin or not shutil.which("taskset") or (os.cpu_count() or 1) < 2:
            return prefix
        return [*prefix, "taskset", "-c", cpu]

    def spawn(
        self,
        cmd: list[str],
        *,
        name: str,
        cpu: str,
        env: dict[str, str] | None = None,
        stdout: int | None = None,
        cwd: Path = REPO,
    ) -> subprocess.Popen[Any]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed in close()
        self.logs.append(log)
        proc = subprocess.Popen(
            self.pin(cpu) + cmd,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=stdout if stdout is not None else log,
            stderr=log,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
        for log in self.logs:
            log.close()
        if self.refusing is not None:
            self.refusing.close()
        if not self.args.keep_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- starting things

    def start_upstream(self, close: bool = False) -> str:
        """The fake upstream; ``close``: it closes the connection after every response."""
        a = self.args
        proc = self.spawn(
            [
                PY,
                str(HERE / "fake_upstream.py"),
                "--port",
                "0",
                "--ttft",
                str(a.ttft),
                "--itl",
                str(a.itl),
                "--tokens",
                str(a.tokens),
                "--max-seconds",
                str(a.max_minutes * 60),
                *(["--close"] if close else []),
            ],
            name="fake_upstream" + ("-close" if close else ""),
            cpu=a.client_cpu,
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("LISTENING"):
            raise RuntimeError(f"fake upstream failed: {line!r}")
        self.upstream_procs[close] = proc
        return f"http://127.0.0.1:{int(line.split()[1])}/v1"

    def start_nginx(self, upstream: str, close: bool = False) -> Target:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        tag = peak_key("nginx", close).replace("@", "-")
        prefix = self.tmp / tag
        prefix.mkdir()
        port = free_port()
        conf = (HERE / "nginx.conf").read_text()
        for key, value in {
            "@PREFIX@": str(prefix),
            "@WORKERS@": str(self.args.nginx_workers),
            "@UPSTREAM_PORT@": upstream.split(":")[-1].split("/")[0],
            "@LISTEN_PORT@": str(port),
        }.items():
            conf = conf.replace(key, value)
        (prefix / "nginx.conf").write_text(conf)
        proc = self.spawn(
            [
                nginx,
                "-p",
                str(prefix),
                "-c",
                str(prefix / "nginx.conf"),
                "-e",
                str(prefix / "error.log"),
            ],
            name=tag,
            cpu=self.args.target_cpu,
        )
        wait_port(port, proc, 10)
        return Target("nginx", f"http://127.0.0.1:{port}/v1", proc, close=close)

    def snapshot_proxy(self, before: bool = False) -> Path:
        """Copy ``proxy/`` once, so every proxy run in this benchmark runs the same code
        even while the tree is being edited; the directory to run it from. ``before``: the
        ``proxy/`` of the ``--before`` checkout instead of this repository's."""
        src = self.tmp / ("src-before" if before else "src")
        if not (src / "proxy").exists():
            origin = Path(self.args.before) if before else REPO
            shutil.copytree(
                origin / "proxy", src / "proxy", ignore=shutil.ignore_patterns("__pycache__")
            )
            digest = hashlib.sha256()
            for path in sorted((src / "proxy").rglob("*.py")):
                digest.update(path.relative_to(src).as_posix().encode() + path.read_bytes())
            where = f" from {self.args.before}" if before else ""
            self.codes["-before" if before else ""] = f"{digest.hexdigest()[:12]}{where}"
        return src

    def refusing_port(self) -> int:
        """A loopback port bound for the whole run but never listening: a connection to
        it is refused at once, and nothing else can take it meanwhile."""
        if self.refusing is None:
            self.refusing = socket.socket()
            self.refusing.bind(("127.0.0.1", 0))
        return int(self.refusing.getsockname()[1])

    def upstreams_config(self, upstream: str, count: int, tag: str) -> Path:
        """A ``--config`` file of ``count`` upstreams: ``count - 1`` decoys, then
        ``upstream`` last, the only one whose patterns match :data:`BENCH_MODEL`.

        Every decoy has the shapes a real table holds (``prefix*`` patterns, a
        ``family/*`` pattern, one sharing the benchmark model's first letters so its
        match fails late, exact names), so a request walks every set lookup and every
        compiled pattern before it reaches the last upstream. The routing table caches
        its decision per (model, route): only the first request per model and route pays
        that walk, every later one a dict lookup. With the one model of the load, the
        figures price routing as users run it (a cached lookup per request, beside it the
        decoys' idle pools, queues and label children); routing is per request, so any
        cost of it is spread over the request's events. Decoys point at
        :meth:`refusing_port`: a request routed to one by mistake fails at once and
        shows as broken streams.
        """
        closed = self.refusing_port()
        lines = [
            f"# {count} upstreams for benchmarks/run.py: {count - 1} decoys, the fake "
            "upstream last.",
            "",
        ]
        for i in range(1, count):
            n = f"{i:02d}"
            models = [
                f"decoy-{n}-*",
                f"family-{n}/*",
                f"{BENCH_MODEL}-{n}-*",
                f"decoy-{n}-exact",
                f"family-{n}/exact",
            ]
            lines += [
                "[[upstream]]",
                f'name = "decoy-{n}"',
                f'url = "http://127.0.0.1:{closed}/decoy-{n}/v1"',
                "models = [" + ", ".join(f'"{m}"' for m in models) + "]",
                "",
            ]
        lines += [
            "[[upstream]]",
            'name = "fake-upstream"',
            f'url = "{upstream}"',
            f'models = ["{BENCH_MODEL}*"]',
            "",
        ]
        path = self.tmp / f"{tag}.toml"
        path.write_text("\n".join(lines))
        return path

    def start_proxy(
        self,
        upstream: str,
        name: str,
        extra: list[str],
        close: bool = False,
        before: bool = False,
        upstreams: int = 0,
    ) -> Target:
        """``python -m proxy serve`` in front of ``upstream``; ``upstreams`` > 0: through a
        ``--config`` file of that many upstreams (:meth:`upstreams_config`) instead of
        ``--upstream``, every other flag the same."""
        src = self.snapshot_proxy(before)
        port = free_port()
        tag = peak_key(name, close).replace("@", "-")
        if upstreams:
            where = ["--config", str(self.upstreams_config(upstream, upstreams, tag))]
        else:
            where = ["--upstream", upstream]
        cmd = [
            PY,
            "-m",
            "proxy",
            "serve",
            *where,
            "--port",
            str(port),
            *self.args.proxy_arg,
            *extra,
        ]
        proc = self.spawn(cmd, name=tag, cpu=self.args.target_cpu, cwd=src)
        wait_port(port, proc, 30)
        return Target(name, f"http://127.0.0.1:{port}/v1", proc, close=close)

    def start_litellm(self, upstream: str, close: bool = False) -> Target | None:
        venv = Path(self.args.litellm_venv)
        exe = venv / "bin" / "litellm"
        if not exe.exists():
            print(
                f"# litellm: skipped, no venv at {venv} (run benchmarks/litellm/setup.sh)",
                file=sys.stderr,
            )
            return None
        port = free_port()
        conf = (
            (HERE / "litellm" / "config.yaml")
            .read_text()
            .replace("@UPSTREAM_PORT@", upstream.split(":")[-1].split("/")[0])
        )
        tag = peak_key("litellm", close).replace("@", "-")
        path = self.tmp / f"{tag}.yaml"
        path.write_text(conf)
        key = os.environ.get("LITELLM_MASTER_KEY") or "sk-" + secrets.token_hex(24)
        env = {
            "LITELLM_MASTER_KEY": key,
            "LITELLM_TELEMETRY": "False",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
        }
        proc = self.spawn(
            [
                str(exe),
                "--config",
                str(path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            name=tag,
            cpu=self.args.target_cpu,
            env=env,
        )
        wait_port(port, proc, 120)
        return Target(
            "litellm",
            f"http://127.0.0.1:{port}/v1",
            proc,
            headers=["--bearer-env", "BENCH_BEARER"],
            env={"BENCH_BEARER": key},
            close=close,
        )

    # -- running loads

    def load(
        self,
        target: Target,
        c: int,
        keepalive: bool,
        duration: float,
        warmup: float,
        tokens: int,
        streams: int = 0,
        api: str = "chat",
        pause: float = 0.0,
    ) -> dict[str, Any]:
        """One loadgen run against ``target`` with CPU and memory read around it; a
        ``-scraped`` target is scraped by a Prometheus server meanwhile."""
        if not target.scraped:
            return self._load(target, c, keepalive, duration, warmup, tokens, streams, api,
                              pause=pause)
        with Scraper(self, target.url.removesuffix("/v1"), self.args.scrape_interval) as prom:
            res = self._load(target, c, keepalive, duration, warmup, tokens, streams, api,
                             prom.pids(), pause=pause)
        res.update(prom.stats)
        return res

    def _load(
        self,
        target: Target,
        c: int,
        keepalive: bool,
        duration: float,
        warmup: float,
        tokens: int,
        streams: int = 0,
        api: str = "chat",
        other_pids: list[int] | None = None,
        pause: float = 0.0,
    ) -> dict[str, Any]:
        a = self.args
        cmd = [
            PY,
            str(HERE / "loadgen.py"),
            "--url",
            target.url,
            "-c",
            str(c),
            "--duration",
            str(duration),
            "--warmup",
            str(warmup),
            "--tokens",
            str(tokens),
            "--stagger",
            str(min(1.0, a.ttft + a.itl * tokens)),
            "--stream-timeout",
            str(a.stream_timeout),
            "--api",
            api,
            *target.headers,
        ]
        if a.prompt_bytes:
            cmd += ["--prompt-bytes", str(a.prompt_bytes), "--prompt-shape", a.prompt_shape]
        if streams:
            cmd += ["--streams", str(streams)]
        if not keepalive:
            cmd.append("--new-connections")
        if pause:
            cmd += ["--pause", str(pause)]
        pids = target.pids()
        upstream = self.upstream_procs.get(target.close)
        up_pids = [upstream.pid] if upstream is not None else []
        idle = mem_kib(pids, "VmRSS")
        cpu0, up0 = on_cpu_seconds(pids), cpu_seconds(up_pids)
        other0 = cpu_seconds(other_pids or [])  # the scraping Prometheus: instrument too
        t0 = time.monotonic()
        busy0 = busy_seconds()
        rq0, uprq0 = runqueue_wait_seconds(pids), runqueue_wait_seconds(up_pids)
        proc = subprocess.Popen(
            self.pin(a.client_cpu) + cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **target.env},
            start_new_session=True,
        )
        self.procs.append(proc)
        samples: list[tuple[float, int]] = []
        steady_from = max(warmup, 1.0) + 0.3
        page = PagePoller(target.url.removesuffix("/v1")) if target.poll_ui else None
        with page if page is not None else contextlib.nullcontext():
            while proc.poll() is None:
                now = time.monotonic() - t0
                if pids and steady_from <= now <= duration:
                    samples.append((now, mem_kib(pids, "VmRSS")))
                try:
                    proc.wait(0.25)
                except subprocess.TimeoutExpired:
                    if now > duration + a.stream_timeout + 30:
                        proc.kill()
        out, err = proc.communicate()
        self.procs.remove(proc)
        if proc.returncode != 0:
            raise RuntimeError(f"loadgen failed on {target.name}: {err.decode()[-2000:]}")
        res: dict[str, Any] = json.loads(out)
        ev = res["events_all"] or 1
        res["target"] = target.name
        if page is not None:
            res["ui_polls"], res["ui_poll_failures"] = page.polls, page.failures
        res["target_cpu_s"] = on_cpu_seconds(pids) - cpu0
        up_cpu = cpu_seconds(up_pids) - up0
        wall = time.monotonic() - t0
        res["span_s"] = (t0, t0 + wall)  # this process's monotonic clock: which loads overlapped
        # CPU used by anything outside the benchmark meanwhile (other users of the
        # machine), in cores: a noise gauge for reading the figures.
        instrument = up_cpu + res["client_cpu_s"] + cpu_seconds(other_pids or []) - other0
        other = busy_seconds() - busy0 - res["target_cpu_s"] - instrument
        res["other_load_cores"] = max(other, 0.0) / wall
        res["target_runqueue_wait_frac"] = (
            (runqueue_wait_seconds(pids) - rq0) / wall if pids else None
        )
        res["upstream_runqueue_wait_frac"] = (runqueue_wait_seconds(up_pids) - uprq0) / wall
        res["target_cpu_us_per_event"] = res["target_cpu_s"] / ev * 1e6 if pids else None
        res["upstream_cpu_us_per_event"] = up_cpu / ev * 1e6
        res["client_cpu_us_per_event_all"] = res["client_cpu_s"] / ev * 1e6
        res["idle_rss_kib"] = idle
        steady = statistics.median(s for _, s in samples) if samples else None
        res["mem_per_stream_kib"] = (steady - idle) / c if steady is not None else None
        return res


# --------------------------------------------------------------------------- report


def _med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v == v]
    return statistics.median(vals) if vals else None


def _total(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) if vals else None


def _fmt(v: float | None, nd: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{nd}f}"


def rounds_of(runs: list[dict[str, Any]]) -> int:
    return len({r["round"] for r in runs})


def _mem_per_stream(runs: list[dict[str, Any]], mine: list[dict[str, Any]], c: int) -> float | None:
    """KiB per open stream from the first round: (steady RSS - the target's idle RSS before
    its first load) / streams. Later rounds would under-read it, since Python keeps the
    memory it once grew to."""
    first = min(mine, key=lambda r: r["round"])
    if first.get("mem_per_stream_kib") is None:
        return None
    steady = first["mem_per_stream_kib"] * c + first["idle_rss_kib"]
    base = min(r["idle_rss_kib"] for r in runs if r["target"] == first["target"])
    return float((steady - base) / c)


def summarize_loads(runs: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    """Median over rounds of each per-round figure, per (load, target)."""
    rows = []
    loads = list(dict.fromkeys(Load.of(r) for r in runs))
    for load in loads:
        c = load.streams
        for name in targets:
            mine = [r for r in runs if Load.of(r) == load and r["target"] == name]
            if not mine:
                continue
            added_p50, added_p99, added_itl = [], [], []
            for r in mine:
                d = next(
                    (
                        x
                        for x in runs
                        if Load.of(x) == load
                        and x["round"] == r["round"]
                        and x["target"] == "direct"
                    ),
                    None,
                )
                if d is None:
                    continue
                added_p50.append(r["ttft_ms"]["p50"] - d["ttft_ms"]["p50"])
                added_p99.append(r["ttft_ms"]["p99"] - d["ttft_ms"]["p99"])
                added_itl.append(r["itl_ms"]["p99"] - d["itl_ms"]["p99"])
            rows.append(
                {
                    "load": c,
                    "keepalive": load.keepalive,
                    "close": load.close,
                    "api": load.api,
                    "idle": load.idle,
                    "target": name,
                    "rounds": len(mine),
                    "ttft_p50": _med([r["ttft_ms"]["p50"] for r in mine]),
                    "ttft_p99": _med([r["ttft_ms"]["p99"] for r in mine]),
                    "itl_p99": _med([r["itl_ms"]["p99"] for r in mine]),
                    "added_ttft_p50": _med(added_p50),
                    "added_ttft_p99": _med(added_p99),
                    "added_itl_p99": _med(added_itl),
                    "streams": sum(r["streams"] + r["warmup_streams"] for r in mine),
                    "broken": sum(r["broken"] + r["warmup_broken"] for r in mine),
                    "cpu_us_per_event": _med([r["target_cpu_us_per_event"] for r in mine]),
                    "mem_per_stream_kib": _mem_per_stream(runs, mine, c),
                    "client_cpu_us_per_event": _med(
                        [r["client_cpu_us_per_event_all"] for r in mine]
                    ),
                    "upstream_cpu_us_per_event": _med(
                        [r["upstream_cpu_us_per_event"] for r in mine]
                    ),
                    "other_load_cores": _med([r.get("other_load_cores") for r in mine]),
                    "rq_wait_ms_per_s": _med(
                        [
                            None
                            if r.get("target_runqueue_wait_frac") is None
                            else r["target_runqueue_wait_frac"] * 1000
                            for r in mine
                        ]
                    ),
                    "cpu_util": _med(
                        [r["target_cpu_s"] / r["wall_s"] if r["wall_s"] else None for r in mine]
                    ),
                    "counted_warmup": any(r.get("counted_warmup") for r in mine),
                    "scrapes": _total([r.get("scrapes") for r in mine]),
                    "scrapes_ok": _total([r.get("scrapes_ok") for r in mine]),
                    "scrape_s_max": max(
                        (r["scrape_s_max"] for r in mine if r.get("scrape_s_max") is not None),
                        default=None,
                    ),
                    "scrape_s_avg": _med([r.get("scrape_s_avg") for r in mine]),
                    "overloaded": len(mine) < rounds_of(runs),
                }
            )
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The performance targets for the ``proxy`` target, met or missed, with the figures
    (keep-alive client and upstream, chat)."""

    def row(target: str, load: int) -> dict[str, Any] | None:
        return next(
            (r for r in rows if r["target"] == target and Load.of(r) == Load(load)),
            None,
        )

    def check(label: str, value: float | None, limit: float, unit: str = "ms") -> str:
        if value is None:
            return f"- {label}: not measured"
        return (
            f"- {label}: {'MET' if value <= limit else 'MISSED'} "
            f"({value:.2f} {unit}, target <= {limit:g} {unit})"
        )

    p64, p256 = row("proxy", 64), row("proxy", 256)
    if p64 is None and p256 is None:
        return []
    out = ["", "Performance targets for `proxy` (keep-alive loads, medians):", ""]
    if p64:
        out.append(check("64 streams added TTFT p50", p64["added_ttft_p50"], 1))
        out.append(check("64 streams added TTFT p99", p64["added_ttft_p99"], 5))
        out.append(check("64 streams added ITL p99", p64["added_itl_p99"], 1))
        out.append(
            f"- 64 streams broken streams: {'MET' if p64['broken'] == 0 else 'MISSED'} "
            f"({p64['broken']})"
        )
    if p256:
        out.append(check("256 streams added TTFT p50", p256["added_ttft_p50"], 2))
        out.append(check("256 streams added TTFT p99", p256["added_ttft_p99"], 10))
    for load in (64, 256):
        mine, ng, off = row("proxy", load), row("nginx", load), row("proxy-nomeasure", load)
        if mine and ng and mine["cpu_us_per_event"] and ng["cpu_us_per_event"]:
            out.append(
                check(
                    f"{load} streams CPU/event vs nginx",
                    mine["cpu_us_per_event"] / ng["cpu_us_per_event"],
                    2,
                    "x",
                )
            )
        if mine and off and mine["cpu_us_per_event"] and off["cpu_us_per_event"]:
            extra = (mine["cpu_us_per_event"] / off["cpu_us_per_event"] - 1) * 100
            out.append(check(f"{load} streams measurement CPU over --no-measure", extra, 15, "%"))
    # Routing among several upstreams (-Nup targets) against the single-upstream proxy:
    # figures side by side, no verdict, since "no measurable cost" is read against the
    # round-to-round spread of the same table, not a fixed limit.
    single = row("proxy", 64)
    for r in rows:
        many = re.fullmatch(r"proxy-(\d+)up", r["target"])
        if not (many and single and Load.of(r) == Load(64)):
            continue
        cpu, cpu1 = r["cpu_us_per_event"], single["cpu_us_per_event"]
        diff = f", {(cpu / cpu1 - 1) * 100:+.1f} %" if cpu and cpu1 else ""
        out.append(
            f"- 64 streams with {many[1]} upstreams (`{r['target']}`) vs one (`proxy`): "
            f"CPU/event {_fmt(cpu)} vs {_fmt(cpu1)} us{diff}; added TTFT p50 "
            f"{_fmt(r['added_ttft_p50'], 2)} vs {_fmt(single['added_ttft_p50'], 2)} ms, p99 "
            f"{_fmt(r['added_ttft_p99'], 2)} vs {_fmt(single['added_ttft_p99'], 2)} ms"
        )
    ll = row("litellm", 64)
    if p64 and ll and p64["added_ttft_p99"] is not None and ll["added_ttft_p99"] is not None:
        ratio = ll["added_ttft_p99"] / max(p64["added_ttft_p99"], 0.1)
        out.append(
            f"- 64 streams added p99 TTFT vs LiteLLM: "
            f"{'MET' if ratio >= 10 else 'MISSED'} (LiteLLM {ll['added_ttft_p99']:.1f} ms "
            f"/ proxy {p64['added_ttft_p99']:.2f} ms = {ratio:.1f}x, target >= 10x; "
            f"proxy figure floored at 0.1 ms)"
        )
    return out


def side_by_side(rows: list[dict[str, Any]]) -> list[str]:
    """Every ``-before`` row beside its twin of this tree, same load (CPU per event, ITL,
    TTFT: the hot path no slower?), and every ``-scraped`` row with its scrapes."""
    out = []
    by_key = {(r["target"], Load.of(r)): r for r in rows}
    for r in rows:
        load = Load.of(r)
        twin = by_key.get((r["target"].replace("-before", ""), load))
        if "-before" in r["target"] and twin is not None:
            cpu, cpu0 = twin["cpu_us_per_event"], r["cpu_us_per_event"]
            diff = f", {(cpu / cpu0 - 1) * 100:+.1f} %" if cpu and cpu0 else ""
            out.append(
                f"- {load.label}: `{twin['target']}` vs `{r['target']}`: CPU/event "
                f"{_fmt(cpu)} vs {_fmt(cpu0)} us{diff}; ITL p99 {_fmt(twin['itl_p99'], 2)} vs "
                f"{_fmt(r['itl_p99'], 2)} ms (added {_fmt(twin['added_itl_p99'], 2)} vs "
                f"{_fmt(r['added_itl_p99'], 2)}); added TTFT p99 "
                f"{_fmt(twin['added_ttft_p99'], 2)} vs {_fmt(r['added_ttft_p99'], 2)} ms"
            )
    for r in rows:
        if r.get("scrapes") is None:
            continue
        avg, top = r.get("scrape_s_avg"), r.get("scrape_s_max")
        out.append(
            f"- {Load.of(r).label}: `{r['target']}` scraped by Prometheus: "
            f"{r['scrapes_ok']:.0f} of {r['scrapes']:.0f} scrapes answered in time; scrape "
            f"duration median {_fmt(None if avg is None else avg * 1000, 0)} ms, max "
            f"{_fmt(None if top is None else top * 1000, 0)} ms"
        )
    return ["", *out] if out else []


def render(
    rows: list[dict[str, Any]], sweep: dict[str, Any], peaks: dict[str, int], meta: dict[str, Any]
) -> str:
    out = [
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- command: `{meta['command']}`",
        f"- schedule: {meta['schedule']}",
        f"- code: {meta['code']}",
        f"- pinning: {meta['pinning']}",
        f"- rounds: {meta['rounds']} (medians shown)",
        "",
    ]
    out.append(
        "| load | api | conn | upstream | target | TTFT p50 ms | TTFT p99 ms | "
        "added TTFT p50 ms | added TTFT p99 ms | ITL p99 ms | added ITL p99 ms | "
        "broken / streams | CPU us/event | CPU cores | runqueue wait ms/s | "
        "KiB/open stream | peak RSS MiB | rounds | other load (cores) |"
    )
    out.append("|" + "---|" * 19)
    for r in rows:
        direct = r["target"] == "direct"
        load = Load.of(r)
        peak = peaks.get(peak_key(r["target"], load.close))
        out.append(
            f"| {load.label} | {load.api} | {'keep-alive' if r['keepalive'] else 'new'} "
            f"| {'close' if load.close else 'keep-alive'} | {r['target']} "
            f"| {_fmt(r['ttft_p50'])} | {_fmt(r['ttft_p99'])} "
            f"| {'-' if direct else _fmt(r['added_ttft_p50'], 2)} "
            f"| {'-' if direct else _fmt(r['added_ttft_p99'], 2)} | {_fmt(r['itl_p99'])} "
            f"| {'-' if direct else _fmt(r['added_itl_p99'], 2)} "
            f"| {r['broken']} / {r['streams']} "
            f"| {'-' if direct else _fmt(r['cpu_us_per_event'])} "
            f"| {'-' if direct else _fmt(r['cpu_util'], 2)} "
            f"| {'-' if direct else _fmt(r['rq_wait_ms_per_s'], 0)} "
            f"| {'-' if direct else _fmt(r['mem_per_stream_kib'])} "
            f"| {'-' if direct or peak is None else _fmt(peak / 1024)} "
            f"| {r['rounds']}{' (overloaded)' if r['overloaded'] else ''} "
            f"| {_fmt(r['other_load_cores'], 2)} |"
        )
    out.append("")
    out.append(
        "Overloaded: TTFT p50 over --overload-ms or >10% broken streams in its first "
        "round, so later rounds skip that load (figures then from that round; "
        "streams that started during warm-up are then counted too). Other load: "
        "CPU cores used meanwhile by processes outside the benchmark (noise gauge). "
        "CPU cores: the target's CPU time / wall time. Runqueue wait: ms per second "
        "the target's threads were runnable but waiting for a CPU (schedstat), i.e. "
        "latency caused by CPU contention rather than by the target's own work."
        + (
            " Upstream close: the fake upstream answers with `Connection: close` and closes "
            "the connection after every response, so each proxied request opens a new "
            "upstream connection (and the direct client a new connection per stream); "
            "targets there are second instances pointed at that upstream."
            if any(r.get("close") for r in rows)
            else ""
        )
    )
    out.append("")
    out.append(
        "Instrument cost (median CPU us per event, same loads): "
        + ", ".join(
            f"{Load.of(r).label}/{r['target']}: "
            f"client {_fmt(r['client_cpu_us_per_event'])}, "
            f"upstream {_fmt(r['upstream_cpu_us_per_event'])}"
            for r in rows
            if r["target"] == "direct"
        )
    )
    out += verdicts(rows)
    out += side_by_side(rows)
    if sweep:
        out += [
            "",
            f"Rate sweep (keep-alive, {meta['tokens']} tokens/stream at "
            f"{1 / meta['itl']:.0f} tokens/s; added p99 TTFT vs direct in the same step, "
            f"threshold {meta['threshold_ms']} ms; median of {meta['sweep_rounds']} runs per step):",
            "",
        ]
        out.append(
            "| streams | token events/s | "
            + " | ".join(f"{t} added p99 ms" for t in sweep["targets"])
            + " | direct p99 ms |"
        )
        out.append("|" + "---|" * (len(sweep["targets"]) + 3))
        for step in sweep["steps"]:
            cells = []
            for t in sweep["targets"]:
                v = step["added"].get(t)
                b = step["broken"].get(t, 0)
                cells.append("-" if v is None else _fmt(v, 1) + (f" ({b} broken)" if b else ""))
            out.append(
                f"| {step['c']} | {step['rate']:.0f} | "
                + " | ".join(cells)
                + f" | {_fmt(step['direct_p99'])} |"
            )
        out.append("")
        for t in sweep["targets"]:
            best = sweep["best"].get(t)
            out.append(
                f"- {t}: highest rate with added p99 TTFT <= {meta['threshold_ms']} ms: "
                + (f"{best:.0f} events/s" if best else "none of the steps")
            )
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- main


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"{os.cpu_count()} CPUs ({model}), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}"
    )


@contextlib.contextmanager
def time_budget(minutes: float) -> Iterator[None]:
    """Raise TimeoutError if the whole run overstays; children are stopped by the caller."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"benchmark exceeded --max-minutes {minutes}")

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    # Background shells start us with SIGINT ignored; TERM and INT must both clean up.
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(minutes * 60)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke configuration (< 60 s)")
    p.add_argument(
        "--targets",
        default="direct,nginx,proxy,proxy-nomeasure",
        help="comma list from direct,nginx,proxy,proxy-nomeasure,litellm; proxy targets take "
        "suffixes: -nomeasure (--no-measure), -noinject (--no-inject-usage), -doctor "
        "(--prefix-doctor), -nodoctor (--no-prefix-doctor), -wN (--workers N), "
        "-Nup (--config with N upstreams, the benchmark's last, e.g. proxy-20up), "
        "-before (the proxy/ of --before DIR), -ui (its live page polled every second), "
        "-scraped (a filled registry, scraped by Prometheus every --scrape-interval), "
        "-reqlog (--log-requests to a file), -capture (--workload-file to a file)",
    )
    p.add_argument("--with-litellm", action="store_true", help="add the litellm target")
    p.add_argument("--litellm-venv", default=os.environ.get("LITELLM_VENV", DEFAULT_LITELLM_VENV))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--together",
        action="store_true",
        help="run a round's targets at the same time (each its own load client, the "
        "targets on --target-cpu), not one after the other: the host's swings in speed "
        "then reach every target of a round alike, for paired.py's per-round ratios; "
        "each target's figures include the others' contention, and its 'other load' "
        "the others' CPU",
    )
    p.add_argument(
        "--loads",
        default="1,64,64new,256,256new,1close,64close,256close",
        help="concurrent streams N[new][close][idleS][-API]: 'new' for a new client "
        "connection per stream, 'close' for the upstream that closes after every response, "
        "'idleS' for a pause of S seconds before each stream (sparse traffic), "
        "-chat/-responses/-messages for the API (default --api), e.g. 64close-responses, "
        "1newidle6",
    )
    p.add_argument(
        "--idle-streams",
        type=int,
        default=4,
        help="streams per user and round in an idleS load (its duration follows)",
    )
    p.add_argument(
        "--api",
        choices=APIS,
        default="chat",
        help="API of loads that name none: chat (Chat Completions), responses (OpenAI "
        "Responses), messages (Anthropic Messages)",
    )
    p.add_argument("--duration", type=float, default=8.0, help="seconds per load run")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds not counted per run")
    p.add_argument("--ttft", type=float, default=0.05, help="fake upstream TTFT, seconds")
    p.add_argument("--itl", type=float, default=0.02, help="fake upstream ITL, seconds")
    p.add_argument("--tokens", type=int, default=50, help="tokens per stream")
    p.add_argument(
        "--prompt-bytes",
        type=int,
        default=0,
        help="each stream's user message, in bytes (0: the word 'benchmark'); prices the "
        "prompt-cache doctor per prompt size, e.g. 2048, 32768, 409600",
    )
    add_prompt_shape(p)
    p.add_argument(
        "--sweep", default="16,32,64,128,192,256,384", help="streams per sweep step ('' to skip)"
    )
    p.add_argument("--sweep-duration", type=float, default=6.0)
    p.add_argument("--sweep-rounds", type=int, default=2, help="runs per sweep step (median)")
    p.add_argument("--threshold-ms", type=float, default=10.0)
    p.add_argument("--stream-timeout", type=float, default=30.0)
    p.add_argument(
        "--overload-ms",
        type=float,
        default=1000.0,
        help="a target whose TTFT p50 passes this (or that breaks >10%% of its "
        "streams) at a load runs that load in one round only (0: never skip)",
    )
    p.add_argument("--nginx-workers", type=int, default=1)
    p.add_argument(
        "--before",
        default="",
        metavar="DIR",
        help="a checkout (e.g. a git worktree of an earlier commit) whose proxy/ the "
        "'-before' proxy targets run: proxy-before beside proxy compares two versions in "
        "one run",
    )
    p.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="extra argument for both proxy targets (repeat), e.g. --proxy-arg=--workers=2",
    )
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="seconds between Prometheus scrapes of -scraped targets (also the timeout)",
    )
    p.add_argument(
        "--scrape-fill",
        default="50,3",
        metavar="CLIENTS,MODELS",
        help="label sets in a -scraped target's registry before its loads: CLIENTS "
        "clients using MODELS models each (loop_micro.py's realistic registry)",
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run every benchmark process at this niceness (negative needs root; "
        "shields the figures from other work on a shared machine)",
    )
    p.add_argument("--target-cpu", default="0")
    p.add_argument("--client-cpu", default="1")
    p.add_argument("--max-minutes", type=float, default=40.0, help="hard bound for the run")
    p.add_argument("--json", default="", help="also write every raw run to this JSON file")
    p.add_argument("--write", default="", help="write the markdown report to this file")
    p.add_argument("--keep-tmp", action="store_true", help="keep configs and logs (debug)")
    p.add_argument(
        "--render",
        default="",
        metavar="JSON",
        help="only re-render the report from a --json file of an earlier run",
    )
    a = p.parse_args(argv)
    if a.with_litellm and "litellm" not in a.targets:
        a.targets += ",litellm"
    if a.quick:
        a.rounds, a.loads, a.duration, a.warmup = 1, "1,16,16new,16close", 2.5, 0.5
        a.tokens, a.sweep, a.max_minutes = 10, "", min(a.max_minutes, 3.0)
    return a


def rerender(path: str, write: str) -> int:
    """Print (and ``--write``) the report of an earlier run from its ``--json`` file."""
    data = json.loads(Path(path).read_text())
    runs = data["runs"]
    names = list(dict.fromkeys(r["target"] for r in runs))
    names.sort(key=lambda n: n != "direct")
    peaks = data.get("peaks", {})
    report = render(summarize_loads(runs, names), data["sweep"], peaks, data["meta"])
    sys.stdout.write(report)
    if write:
        Path(write).write_text(report)
    return 0


def start_targets(bench: Bench, names: list[str], close: bool) -> list[Target]:
    """A fake upstream (closing after every response if ``close``) and every named target
    in front of it; ``direct`` first."""
    upstream = bench.start_upstream(close)
    targets: list[Target] = []
    for name in names:
        if name == "direct":
            targets.append(Target("direct", upstream, close=close))
        elif name == "nginx":
            targets.append(bench.start_nginx(upstream, close))
        elif name.startswith("proxy"):
            # proxy[-nomeasure][-noinject][-doctor|-nodoctor][-wN][-Nup][-before][-ui][-reqlog]
            # [-capture]: measurement off, no usage injection, the prompt-cache doctor
            # off, N workers, a --config file of N upstreams, the code of the --before
            # checkout, the live page open, the per-request log on, the workload capture on
            # (each to a file in the run's temporary directory)
            extra = []
            before = poll_ui = scraped = False
            upstreams = 0
            for part in name.split("-")[1:]:
                if part == "before":
                    if not bench.args.before:
                        raise SystemExit(f"target {name!r} needs --before DIR")
                    before = True
                elif part == "nomeasure":
                    extra.append("--no-measure")
                elif part == "noinject":
                    extra.append("--no-inject-usage")
                elif part == "doctor":
                    extra.append("--prefix-doctor")
                elif part == "nodoctor":
                    extra.append("--no-prefix-doctor")
                elif part.startswith("w") and part[1:].isdigit():
                    extra += ["--workers", part[1:]]
                elif part.endswith("up") and part[:-2].isdigit() and int(part[:-2]) >= 1:
                    upstreams = int(part[:-2])
                elif part == "ui":
                    poll_ui = True
                elif part == "scraped":
                    scraped = True
                    extra += ["--client-label-from", "header:x-client"]
                elif part == "reqlog":
                    extra += ["--log-requests", str(bench.tmp / f"{peak_key(name, close)}.log.jsonl")]
                elif part == "capture":  # its hash ids are the doctor's
                    extra += ["--prefix-doctor", "--workload-file", str(bench.tmp / f"{peak_key(name, close)}.workload.jsonl")]
                else:
                    raise SystemExit(f"unknown target {name!r}")
            if upstreams and before:
                raise SystemExit(
                    f"target {name!r}: -Nup runs this tree's proxy only (the config file "
                    "is written for its --config); compare proxy-Nup with proxy instead"
                )
            target = bench.start_proxy(upstream, name, extra, close, before, upstreams)
            target.poll_ui = poll_ui
            if scraped:
                target.scraped = True
                fill_registry(target.url, scrape_fill(bench.args.scrape_fill))
            targets.append(target)
        elif name == "litellm":
            t = bench.start_litellm(upstream, close)
            if t is not None:
                targets.append(t)
        else:
            raise SystemExit(f"unknown target {name!r}")
    return targets


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.render:
        return rerender(a.render, a.write)
    names = [t.strip() for t in a.targets.split(",") if t.strip()]
    if "direct" not in names:
        names.insert(0, "direct")
    bench = Bench(a)
    runs: list[dict[str, Any]] = []
    sweep: dict[str, Any] = {}
    try:
        with time_budget(a.max_minutes):
            loads = [Load.parse(spec, a.api) for spec in a.loads.split(",") if spec.strip()]
            # One set of targets per upstream mode; keep-alive always (sweep, report order).
            groups: dict[bool, list[Target]] = {}
            for close in sorted({False} | {load.close for load in loads}):
                groups[close] = start_targets(bench, names, close)
            targets = groups[False]
            # Warm-up: first requests (imports, connection pools) are not what we measure.
            for group in groups.values():
                for t in group:
                    for api in dict.fromkeys(["chat", *(load.api for load in loads)]):
                        w = bench.load(t, 4, True, 1.0, 0.0, min(a.tokens, 5), streams=2, api=api)
                        if w["broken"]:
                            raise RuntimeError(
                                f"{t.key} ({api}): warm-up streams broke: {w['errors']}"
                            )
            overloaded: set[tuple[str, Load]] = set()
            for rnd in range(a.rounds):
                for load in loads:
                    group = groups[load.close]
                    k = rnd % len(group)
                    order = [t for t in group[k:] + group[:k] if (t.name, load) not in overloaded]

                    def one(t: Target, load: Load = load) -> dict[str, Any]:
                        c = load.streams
                        dur = max(a.duration, 10.0) if c == 1 and not a.quick else a.duration
                        if load.idle:  # enough for a few streams after a pause each
                            dur = max(dur, a.idle_streams * (load.idle + a.ttft + a.itl * a.tokens))
                        return bench.load(
                            t, c, load.keepalive, dur, a.warmup, a.tokens, api=load.api,
                            pause=load.idle,
                        )

                    results: Iterator[dict[str, Any]]
                    if a.together:  # one thread per target: each waits on its own client
                        with ThreadPoolExecutor(len(order)) as pool:
                            results = iter(list(pool.map(one, order)))
                    else:  # lazily: each target recorded and printed before the next runs
                        results = map(one, order)
                    for t, res in zip(order, results, strict=True):
                        res.update(
                            round=rnd,
                            load=load.streams,
                            keepalive=load.keepalive,
                            close=load.close,
                            api=load.api,
                            idle=load.idle,
                            together=a.together,
                        )
                        runs.append(res)
                        p50 = res["ttft_ms"]["p50"]
                        if (
                            t.name != "direct"
                            and a.overload_ms
                            and (
                                p50 != p50
                                or p50 > a.overload_ms
                                or res["broken"] > 0.1 * res["streams"]
                            )
                        ):
                            overloaded.add((t.name, load))  # later rounds skip it
                        print(
                            f"# round {rnd + 1} {load.label} {t.name}: "
                            f"ttft p50 {res['ttft_ms']['p50']:.3f} p99 "
                            f"{res['ttft_ms']['p99']:.3f} ms, itl p99 "
                            f"{res['itl_ms']['p99']:.3f} ms, broken {res['broken']}/"
                            f"{res['streams']}, cpu/ev "
                            f"{_fmt(res['target_cpu_us_per_event'], 3)} us",
                            file=sys.stderr,
                        )
            steps = [int(s) for s in a.sweep.split(",") if s.strip()]
            if steps:
                sweep = {
                    "targets": [t.name for t in targets if t.name != "direct"],
                    "steps": [],
                    "best": {},
                }
                alive = [t for t in targets if t.name != "direct"]
                direct = targets[0]
                for c in steps:
                    if not alive:
                        break
                    step = {
                        "c": c,
                        "rate": c / a.itl,
                        "direct_p99": None,
                        "added": {},
                        "broken": {},
                    }
                    direct_p99s: list[float] = []
                    added_by: dict[str, list[float]] = {t.name: [] for t in alive}
                    broken_by: dict[str, int] = {t.name: 0 for t in alive}
                    for _ in range(a.sweep_rounds):
                        d = bench.load(direct, c, True, a.sweep_duration, a.warmup, a.tokens)
                        direct_p99s.append(d["ttft_ms"]["p99"])
                        for t in alive:
                            r = bench.load(t, c, True, a.sweep_duration, a.warmup, a.tokens)
                            added_by[t.name].append(r["ttft_ms"]["p99"] - d["ttft_ms"]["p99"])
                            broken_by[t.name] += r["broken"] + r["warmup_broken"]
                    step["direct_p99"] = statistics.median(direct_p99s)
                    for t in list(alive):
                        added = statistics.median(added_by[t.name])
                        broken = broken_by[t.name]
                        step["added"][t.name] = added
                        step["broken"][t.name] = broken
                        print(
                            f"# sweep c={c} {t.name}: added p99 {added:.1f} ms (median of "
                            f"{a.sweep_rounds}), broken {broken}",
                            file=sys.stderr,
                        )
                        if added > a.threshold_ms or broken:
                            alive.remove(t)
                        else:
                            sweep["best"][t.name] = c / a.itl
                    sweep["steps"].append(step)
            peaks = {
                t.key: mem_kib(t.pids(), "VmHWM")
                for group in groups.values()
                for t in group
                if t.proc is not None
            }
    finally:
        bench.close()
    rows = summarize_loads(runs, [t.name for t in targets])
    code = "; ".join(
        f"proxy{key} targets: proxy/ sha256 {value}" for key, value in bench.codes.items()
    )
    meta = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": "python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "schedule": f"fake upstream TTFT {a.ttft * 1000:.0f} ms, ITL {a.itl * 1000:.0f} ms, "
        f"{a.tokens} tokens/stream"
        + (f", a {a.prompt_bytes:,}-byte prompt ({a.prompt_shape})" if a.prompt_bytes else "")
        + f"; {a.duration:.0f} s per run "
        f"({a.warmup:.1f} s warm-up not counted)",
        "code": f"{code} (snapshots taken at start)" if code else "n/a (no proxy target)",
        "pinning": (
            "none"
            if a.no_pin
            else f"targets on CPU {a.target_cpu}; fake upstream + load client on CPU {a.client_cpu}"
        )
        + (f"; all at nice {a.nice}" if a.nice else ""),
        "rounds": a.rounds,
        "together": a.together,
        "tokens": a.tokens,
        "itl": a.itl,
        "threshold_ms": a.threshold_ms,
        "sweep_rounds": a.sweep_rounds,
    }
    report = render(rows, sweep, peaks, meta)
    sys.stdout.write(report)
    if a.write:
        Path(a.write).write_text(report)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"meta": meta, "rows": rows, "sweep": sweep, "runs": runs, "peaks": peaks},
                indent=1,
                default=str,
            )
        )
    broken = sum(r["broken"] for r in rows)
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
