"""``serve --workers 2``: metrics from every worker are summed on every scrape.

The proxy runs as a real subprocess (uvicorn's supervisor and two worker processes)
in front of a scheduled upstream. After N requests, every scrape, whichever worker
answers it, must show exactly N requests and N TTFT observations; the private
multiprocess directory must hold files of both workers and be gone after exit.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fake_upstream import Scheduled, ScriptedUpstream

pytestmark = pytest.mark.e2e

REQUESTS = 40


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    with ScriptedUpstream(Scheduled(ttft=0.005, itl=0.002, tokens=4)).running() as server:
        yield server


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "proxy exited during start-up"
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # polling the server's own readiness endpoint
    raise TimeoutError("proxy did not become healthy")


def serve(upstream_url: str, port: int, tmp_path: Path, *flags: str,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``serve`` in front of ``upstream_url`` on ``port`` (its temporary files in
    ``tmp_path``), with ``flags``."""
    return subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--upstream", upstream_url + "/v1",
         "--port", str(port), *flags],
        env=env if env is not None else {**os.environ, "TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def metric_total(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_workers_sum_metrics(upstream: ScriptedUpstream, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    proc = serve(upstream.url, port, tmp_path, "--workers", "2", "--upstream-name", "up",
                 env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
        with httpx.Client(base_url=url, timeout=10) as client:
            for _ in range(REQUESTS):  # new connections spread over both workers
                with client.stream("POST", "/v1/chat/completions", json=body,
                                   headers={"connection": "close"}) as response:
                    assert response.status_code == 200
                    assert b"data: [DONE]" in response.read()
            [metrics_dir] = list(tmp_path.glob("llm-latency-proxy-metrics-*"))
            pids = {m.group(1) for f in metrics_dir.iterdir()
                    if (m := re.search(r"_(\d+)\.db$", f.name))}
            assert len(pids) == 2, f"expected files from 2 workers, got {sorted(pids)}"
            for _ in range(10):
                text = httpx.get(url + "/metrics", headers={"connection": "close"}).text
                assert metric_total(text, "llm_proxy_requests_total") == REQUESTS
                assert metric_total(text, "llm_proxy_time_to_first_token_seconds_count") == REQUESTS
                assert metric_total(text, "llm_proxy_inter_token_latency_seconds_count") == REQUESTS * 3
                assert metric_total(text, "llm_proxy_in_flight_requests") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out.decode(errors="replace")
    assert not list(tmp_path.glob("llm-latency-proxy-metrics-*")), "multiprocess dir left behind"


def refuses(port: int) -> bool:
    """Whether a connection to ``port`` is refused now (one that is taken is closed)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def worker_pids(supervisor: int) -> list[int]:
    """The supervisor's worker processes (multiprocessing's spawned children)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    return [int(pid) for pid in children
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_a_killed_worker_leaves_no_request_in_flight(tmp_path: Path) -> None:
    """Both workers killed (SIGKILL) with a stream in flight: the supervisor starts new
    ones, and the in-flight gauge, which sums the live workers, comes back to 0: the
    dead workers' live gauges leave the sum (their counters stay)."""
    fake = Scheduled(ttft=0.05, itl=0.05, tokens=400)  # a 20 s stream, cut by the kill
    with ScriptedUpstream(fake).running() as up:
        port = free_port()
        proc = serve(up.url, port, tmp_path, "--workers", "2")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
            with httpx.Client(base_url=url, timeout=20) as client, \
                    client.stream("POST", "/v1/chat/completions", json=body) as response:
                parts = response.iter_raw()  # one iterator: a dropped one closes it
                next(parts)  # the stream is under way
                text = httpx.get(url + "/metrics", headers={"connection": "close"}).text
                assert metric_total(text, "llm_proxy_in_flight_requests") == 1
                workers = worker_pids(proc.pid)
                assert len(workers) == 2, workers
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
                with pytest.raises(httpx.HTTPError):
                    for _ in parts:
                        pass
            deadline, in_flight = time.monotonic() + 20, None
            while time.monotonic() < deadline:  # the new workers: up within a second or two
                try:
                    text = httpx.get(url + "/metrics", headers={"connection": "close"}).text
                except httpx.TransportError:
                    time.sleep(0.05)  # polling until a new worker answers
                    continue
                in_flight = metric_total(text, "llm_proxy_in_flight_requests")
                if in_flight == 0:
                    break
                time.sleep(0.05)
            assert in_flight == 0, f"in flight after the workers died: {in_flight}"
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode(errors="replace")


def test_sigterm_with_workers_lets_in_flight_stream_finish(tmp_path: Path) -> None:
    """SIGTERM to the supervisor: the stream in flight completes, the process exits 0."""
    fake = Scheduled(ttft=0.05, itl=0.05, tokens=60)  # a 3 s stream
    with ScriptedUpstream(fake).running() as up:
        port = free_port()
        proc = serve(up.url, port, tmp_path, "--workers", "2", "--graceful-timeout", "20")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
            received = b""
            signalled = refused = False
            with httpx.Client(base_url=url, timeout=20) as client, \
                    client.stream("POST", "/v1/chat/completions", json=body) as response:
                for raw in response.iter_raw():
                    received += raw
                    if not signalled and b'"content": "t0 "' in received:
                        proc.send_signal(signal.SIGTERM)  # mid-stream, once
                        signalled = True
                    elif signalled and not refused:
                        refused = refuses(port)
            assert signalled and not fake.closed.is_set()
            # meanwhile a new connection was refused, not queued for no worker and reset
            # when the drain ended
            assert refused, "connections made during the drain were not refused"
            assert received.count(b'"content": "t') == 60
            assert b"data: [DONE]" in received
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, out.decode(errors="replace")


def test_an_inherited_metrics_directory_is_not_this_proxys(
        upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """PROMETHEUS_MULTIPROC_DIR set in the environment (a host-wide habit, a volume kept
    across restarts), one process: each run counts its own requests in a directory of
    its own; the files another run left there used to be counted again."""
    shared = tmp_path / "shared"
    shared.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path), "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    for run in range(2):
        port = free_port()
        proc = serve(upstream.url, port, tmp_path, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            with httpx.Client(base_url=url, timeout=10) as client:
                for _ in range(3):
                    with client.stream("POST", "/v1/chat/completions", json=body) as response:
                        assert b"data: [DONE]" in response.read()
                text = client.get("/metrics").text
            assert metric_total(text, "llm_proxy_requests_total") == 3, run
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out.decode(errors="replace")
    assert not list(tmp_path.glob("llm-latency-proxy-metrics-*")), "its own directory left behind"


def test_workers_stop_when_their_supervisor_is_killed(
        upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """SIGKILL to the supervisor (a process manager that kills one pid): its workers
    stop too, and the port is free for the next start; they used to serve on, orphaned,
    with nothing to restart or stop them."""
    port = free_port()
    proc = serve(upstream.url, port, tmp_path, "--workers", "2")
    workers: list[int] = []

    def running() -> list[int]:
        return [pid for pid in workers if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]

    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        workers = worker_pids(proc.pid)
        assert len(workers) == 2, workers
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while running() and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the workers' exit
        assert not running(), f"workers still running after their supervisor died: {running()}"
        assert refuses(port)
    finally:
        for pid in running():  # a failed run leaves no orphan behind
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=10)
