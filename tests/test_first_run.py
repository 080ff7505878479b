"""What a new user meets on a first run in a terminal: Ctrl-C stops ``serve`` (one
process and ``--workers``) with exit 0 and no traceback, streams in flight finishing
first; a port already in use is said in one line with the way out (``--port 0``),
before anything announces that it started; ``simulate`` binds before it prints its URL.

A terminal's Ctrl-C is a SIGINT to the whole foreground process group: the proxy, its
workers and multiprocessing's resource tracker all get it at once. So the commands run
in a session of their own and the tests signal the group (``os.killpg``), as the
terminal does, rather than the one process. They wait on the commands' own output lines
and on the upstream's events, with deadlines, never on a fixed sleep.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from proxy.simulator import cli as sim_cli
from tests.fake_upstream import Gate, ScriptedUpstream, stream_events
from tests.servers import closed_port

ROOT = Path(__file__).resolve().parent.parent
BANNER = re.compile(r"^llm-latency-proxy: relaying http://127\.0\.0\.1:(\d+)/v1 -> ")
NOT_CLEAN = ("Traceback", "KeyboardInterrupt", "CancelledError")


class Command:
    """``python -m proxy ARGS`` in a session (process group) of its own; its stderr
    lines collected as they come."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_PROXY_")}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "proxy", *args], cwd=ROOT, env=env, start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.group = os.getpgid(self.popen.pid)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, count: int = 1, within: float = 30.0) -> re.Match[str]:
        """The ``count``-th line (counting from the start) that matches ``pattern``."""
        deadline = time.monotonic() + within
        compiled = re.compile(pattern)
        while True:
            seen = [m for line in self.lines if (m := compiled.search(line))]
            if len(seen) >= count:
                return seen[count - 1]
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no line matching {pattern!r}:\n" + self.text()
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            assert line is not None, f"exited before {pattern!r}:\n" + self.text()
            self.lines.append(line)

    def ctrl_c(self) -> None:
        os.killpg(self.group, signal.SIGINT)

    def finish(self, within: float = 60.0) -> int:
        """The exit code, once the command has exited and its output is all read."""
        code = self.popen.wait(within)
        while (line := self._queue.get(timeout=within)) is not None:
            self.lines.append(line)
        return code

    def text(self) -> str:
        return "\n".join(self.lines)

    def group_gone(self, within: float = 20.0) -> bool:
        """Whether every process of the group (workers, resource tracker) has exited."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                os.killpg(self.group, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.05)  # polling the kernel's process table, not timing anything
        return False

    def kill(self) -> None:
        with_group = self.popen.poll() is None
        if with_group:
            os.killpg(self.group, signal.SIGKILL)
            self.popen.wait(10)
        if self.popen.stderr is not None:
            self.popen.stderr.close()


@contextmanager
def command(*args: str) -> Iterator[Command]:
    cmd = Command(*args)
    try:
        yield cmd
    finally:
        cmd.kill()


def gated_stream() -> tuple[ScriptedUpstream, Gate]:
    """An upstream whose stream sends its first token, then waits for the gate."""
    gate = Gate()
    events = stream_events(3, usage=True)

    async def handler(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"".join(events[:2])  # the role chunk and the first token
            assert await gate.wait(60), "the test never opened the gate"
            yield b"".join(events[2:])

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=body())

    return ScriptedUpstream(handler), gate


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_drains_the_stream_in_flight_then_exits_0_without_a_traceback(
        workers: int) -> None:
    upstream, gate = gated_stream()
    with upstream.running(), command("serve", "--upstream", upstream.url + "/v1", "--port", "0",
                                     "--workers", str(workers)) as proxy:
        port = int(proxy.wait_for(BANNER.pattern)[1])
        received: list[bytes] = []
        first_token = threading.Event()

        def client() -> None:
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                              json=body, timeout=60) as response:
                for chunk in response.iter_raw():
                    received.append(chunk)
                    if b"tok0" in b"".join(received):
                        first_token.set()

        reader = threading.Thread(target=client, daemon=True)
        reader.start()
        assert first_token.wait(30), proxy.text()
        proxy.ctrl_c()
        # Every worker (or the one process) has begun its drain; the stream is still open.
        proxy.wait_for(r"Shutting down", count=workers)
        gate.open()
        reader.join(30)
        assert not reader.is_alive()
        assert b"data: [DONE]" in b"".join(received)
        assert proxy.finish() == 0, proxy.text()
        assert proxy.group_gone(), "a worker or helper process outlived the proxy"
    assert not [line for line in proxy.lines if any(word in line for word in NOT_CLEAN)], \
        proxy.text()


@pytest.mark.e2e
def test_ctrl_c_while_the_workers_start_exits_0_without_a_traceback() -> None:
    """The start-up line comes before the workers are up (they start behind the listening
    socket): a Ctrl-C then reaches workers still importing, where Python would print a
    ``KeyboardInterrupt`` traceback from each."""
    with command("serve", "--upstream", "http://127.0.0.1:9/v1", "--port", "0",
                 "--workers", "2") as proxy:
        proxy.wait_for(BANNER.pattern)
        proxy.ctrl_c()
        assert proxy.finish() == 0, proxy.text()
        assert proxy.group_gone(), "a worker or helper process outlived the proxy"
    assert not [line for line in proxy.lines if any(word in line for word in NOT_CLEAN)], \
        proxy.text()


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [1, 2])
def test_the_start_up_line_names_the_live_page(workers: int) -> None:
    with command("serve", "--upstream", "http://127.0.0.1:9/v1", "--port", "0",
                 "--workers", str(workers)) as proxy:
        line = proxy.wait_for(BANNER.pattern).string
        port = int(BANNER.search(line)[1])  # type: ignore[index]
        page = f"http://127.0.0.1:{port}/ui"
        assert f"; metrics at http://127.0.0.1:{port}/metrics; live page at {page};" in line
        answer = httpx.get(page, timeout=20)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
        root = httpx.get(f"http://127.0.0.1:{port}/", timeout=20)
        assert root.status_code == 404 and "the live page is at /ui" in root.text
        proxy.ctrl_c()
        assert proxy.finish() == 0, proxy.text()


@pytest.mark.e2e
def test_with_a_metrics_port_the_live_page_is_named_there() -> None:
    metrics_port = closed_port()
    with command("serve", "--upstream", "http://127.0.0.1:9/v1", "--port", "0",
                 "--metrics-port", str(metrics_port)) as proxy:
        line = proxy.wait_for(BANNER.pattern).string
        side = f"http://127.0.0.1:{metrics_port}"
        assert f"; metrics at {side}/metrics; live page at {side}/ui;" in line
        assert httpx.get(side + "/ui", timeout=20).status_code == 200
        proxy.ctrl_c()
        assert proxy.finish() == 0, proxy.text()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another server listens on."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


@pytest.mark.e2e
@pytest.mark.parametrize(("args", "flag"), [
    (["--port", "{taken}"], "--port"),
    (["--port", "{taken}", "--workers", "2"], "--port"),
    (["--port", "0", "--metrics-port", "{taken}"], "--metrics-port"),
])
def test_port_in_use_is_one_line_with_the_way_out_and_nothing_announced(
        taken_port: int, args: list[str], flag: str) -> None:
    argv = [a.format(taken=taken_port) for a in args]
    with command("serve", "--upstream", "http://127.0.0.1:9/v1", *argv) as proxy:
        assert proxy.finish() == 3, proxy.text()
    zero = ("to serve it on the main port" if flag == "--metrics-port"  # what 0 means
            else "for any free port")
    assert proxy.lines[-1] == (
        f"llm-latency-proxy: error: cannot listen on 127.0.0.1:{taken_port}: the port is in "
        f"use (another server listens there); choose another with {flag} PORT, or {flag} 0 "
        f"{zero}"), proxy.text()
    for announcement in ("startup complete", "Uvicorn running", "relaying", "Traceback"):
        assert announcement not in proxy.text()


@pytest.mark.e2e
def test_simulate_on_a_port_in_use_says_so_and_prints_no_url(taken_port: int) -> None:
    with command("simulate", "--port", str(taken_port)) as sim:
        assert sim.finish() == 2, sim.text()
    assert sim.lines == [
        f"llm-latency-proxy simulate: error: cannot listen on 127.0.0.1:{taken_port}: the "
        f"port is in use (another server listens there); choose another with --port PORT, "
        "or --port 0 for any free port"]


@pytest.mark.e2e
def test_a_stream_the_upstream_broke_is_one_warning_not_an_error() -> None:
    """The proxy leaves the client's response unfinished when the upstream broke its
    stream, so that the client sees the same break, and warns once with the reason:
    uvicorn's ERROR line for an unfinished response would read as the proxy's fault."""
    with command("simulate", "--port", "0", "--drop-rate", "1") as sim:
        sim_port = int(sim.wait_for(r"upstream at http://127\.0\.0\.1:(\d+)/v1 ")[1])
        with command("serve", "--upstream", f"http://127.0.0.1:{sim_port}/v1",
                     "--port", "0") as proxy:
            port = int(proxy.wait_for(BANNER.pattern)[1])
            body = {"model": "m", "stream": True, "max_tokens": 40,
                    "messages": [{"role": "user", "content": "hi"}]}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            with (pytest.raises(httpx.HTTPError),  # the break reaches the client as a break
                  httpx.stream("POST", url, json=body, timeout=20) as answer):
                for _ in answer.iter_raw():
                    pass
            proxy.wait_for(r"upstream failure: .*stream upstream_interrupted")
            proxy.ctrl_c()
            assert proxy.finish() == 0, proxy.text()
        sim.ctrl_c()
        assert sim.finish() == 0, sim.text()
    assert "ASGI callable returned without completing response" not in proxy.text()
    assert "ERROR" not in proxy.text(), proxy.text()


@pytest.mark.e2e
def test_simulate_announces_the_port_it_listens_on() -> None:
    """Its URL is printed once the socket listens: with ``--port 0`` it names the port
    the system chose, and a client that read it can connect."""
    with command("simulate", "--port", "0") as sim:
        port = int(sim.wait_for(r"upstream at http://127\.0\.0\.1:(\d+)/v1 ")[1])
        assert port != 0
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        sim.ctrl_c()
        assert sim.finish() == 0, sim.text()


def test_simulate_help_shows_no_empty_defaults() -> None:
    parser = argparse.ArgumentParser(prog="llm-latency-proxy")
    sim_cli.add_parser(parser.add_subparsers())
    simulate = parser._subparsers._group_actions[0].choices["simulate"]  # type: ignore[union-attr]
    text = " ".join(simulate.format_help().split())
    assert "(default: )" not in text and "(default: None)" not in text
    assert "'x-api-key: KEY'; without it, no key is needed. --seed" in text
    assert "(default: 64)" in text  # the defaults that say something stay
