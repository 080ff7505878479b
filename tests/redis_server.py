"""A real Redis for the shared prompt-cache index's tests: Debian's ``redis-server``
(``.ci/run`` installs it) on a loopback port, one per test, nothing saved to disk.

:class:`RedisServer` starts it and waits for its own "Ready to accept connections" line
(never a fixed sleep), and can take it away the ways a store fails: killed (connections
refused), stopped with SIGSTOP (connections still accepted by the kernel, nothing ever
answered: a hung or overloaded store), and brought back on the same port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_observability import require_tool

READY = "Ready to accept connections"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """One ``redis-server`` process on ``port``; :meth:`start` again after :meth:`kill`
    brings an empty one back on the same port."""

    def __init__(self, workdir: Path, *extra: str, config: Path | None = None) -> None:
        self.binary = require_tool("redis-server")
        self.config = config  # a config file, read before the options given here
        self.port = free_port()
        self.workdir = workdir
        self.extra = extra
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        assert self.proc is None or self.proc.poll() is not None
        proc = subprocess.Popen(
            [self.binary, *([str(self.config)] if self.config else []), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir),
             *self.extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.output.append(line)
                if READY in line:
                    ready.set()
            ready.set()  # it exited: the wait below ends and the check fails

        threading.Thread(target=pump, daemon=True).start()
        self.proc = proc
        if not ready.wait(timeout) or proc.poll() is not None:
            self.kill()
            pytest.fail("redis-server did not start:\n" + "".join(self.output[-20:]))

    def kill(self) -> None:
        """Gone: connections are refused from now on (until :meth:`start`)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped process dies only once resumed
            proc.kill()
        if proc is not None:
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()

    def pause(self) -> None:
        """Hung: the kernel still accepts connections, nothing is ever answered."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)



@contextlib.contextmanager
def redis_server(workdir: Path, *extra: str, config: Path | None = None
                 ) -> Iterator[RedisServer]:
    server = RedisServer(workdir, *extra, config=config)
    server.start()
    try:
        yield server
    finally:
        server.kill()
