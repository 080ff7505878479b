"""Real servers on loopback ports for end-to-end tests.

:func:`serve_in_thread` runs an ASGI app under uvicorn in its own thread with its own
event loop, bound to port 0 so the kernel picks a free port (no race between choosing
and binding); it waits on uvicorn's own ``started`` flag, never on a fixed sleep.
:func:`proxy_process` runs the real command (``python -m proxy serve``) in a subprocess,
where its signals, logs and ports are the subject, and waits for its start-up line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import uvicorn

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RunningServer:
    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.contextmanager
def serve_in_thread(app: Any, *, host: str = "127.0.0.1", timeout: float = 10.0,
                    **config: Any) -> Iterator[RunningServer]:
    """Run ``app`` under uvicorn on ``host``:free port; yield once it listens. The loop
    is asyncio's unless ``config`` says otherwise (``loop="uvloop"``, what serve uses)."""
    cfg = uvicorn.Config(app, host=host, port=0, log_level="warning", lifespan="on",
                         **{"loop": "asyncio", **config})
    server = uvicorn.Server(cfg)
    # No signal handlers from a non-main thread.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as exc:  # surfaced to the test below
            failure.append(exc)

    thread = threading.Thread(target=run, name="uvicorn-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if failure or not thread.is_alive():
            raise RuntimeError(f"server failed to start: {failure!r}")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start in time")
        time.sleep(0.005)  # polling uvicorn's started flag, not timing anything
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(server, thread, host, port)
    finally:
        server.should_exit = True
        thread.join(timeout)


# For a test client that idles between bursts (waiting for Prometheus, say) in front of
# a uvicorn server: httpx keeps an idle connection 5 s, as long as uvicorn's keep-alive,
# so a POST could go out on a connection the server was closing and fail with a
# ReadError (seen under CPU burners, and once in CI). Expire them well before.
CLIENT_LIMITS = httpx.Limits(keepalive_expiry=1.0)


def end_process(proc: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """End ``proc`` if it still runs: SIGTERM, then SIGKILL if it is still there after
    ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def announcing_process(argv: list[str], announces: str, *, what: str, timeout: float,
                       env: dict[str, str] | None = None) -> Iterator[str]:
    """``argv`` in a process of its own, from the repository's root; yields the first
    group of ``announces`` (a regular expression) in the first stderr line it matches,
    its URL, once it is said; terminated (killed if it lingers) on the way out. Its
    stderr is read throughout, so the pipe never fills, and shown if it never says it."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    said: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            said.append(line)
            match = re.search(announces, line)
            if match and not url:
                url.append(match[1])
                ready.set()
        ready.set()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        ready.wait(timeout)
        assert url, f"{what} did not start:\n" + "".join(said)
        yield url[0]
    finally:
        end_process(proc)
        thread.join(5)
        if proc.stderr is not None:
            proc.stderr.close()


def closed_port() -> int:
    """A loopback port that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def refuses(port: int) -> bool:
    """Nothing accepts connections on ``port`` (any more)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except OSError:
        return True


@contextlib.asynccontextmanager
async def proxy_process(upstream_url: str, *args: str
                        ) -> AsyncIterator[tuple[subprocess.Popen[str], int, list[str]]]:
    """``python -m proxy serve`` on a kernel-chosen port; yields (process, port, output
    lines of stdout and stderr). Killed at the end if still running."""
    proc = subprocess.Popen(  # noqa: ASYNC220 (returns at once; the test waits below)
        [sys.executable, "-m", "proxy", "serve", "--upstream", upstream_url + "/v1",
         "--port", "0", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ready: list[int] = []
    started = threading.Event()
    out: list[str] = []

    def pump_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            out.append(line)
            m = re.search(r"Uvicorn running on http://[\d.]+:(\d+)", line)
            if m:
                ready.append(int(m[1]))
                started.set()
        started.set()

    def pump_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)

    threads = [threading.Thread(target=f, daemon=True) for f in (pump_stderr, pump_stdout)]
    for th in threads:
        th.start()
    try:
        await anyio.to_thread.run_sync(started.wait, 20)
        assert ready, "proxy did not start:\n" + "".join(out)
        yield proc, ready[0], out
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for th in threads:
            th.join(5)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
