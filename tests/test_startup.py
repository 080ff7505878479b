"""``serve`` start-up as an operator sees it: the start-up line names the port actually
bound (``--port 0``, with one process and with ``--workers``), and an upstream URL
without a version segment gets exactly one warning saying what will be requested.

The real command runs as a subprocess; the tests wait on its own output lines, with a
deadline, never on a fixed sleep.
"""

from __future__ import annotations

import argparse
import http.client
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from proxy.serve import upstream_warning
from tests.servers import end_process

ROOT = Path(__file__).resolve().parent.parent
BANNER = re.compile(r"^llm-latency-proxy: relaying http://127\.0\.0\.1:(\d+)/v1 -> ")


@pytest.mark.parametrize(("upstream", "requested"), [
    ("http://host:8000", "http://host:8000/chat/completions"),
    ("http://host:8000/tenant", "http://host:8000/tenant/chat/completions"),
    ("https://user:pw@host/api", "https://***@host/api/chat/completions"),
    ("http://host/v1x/openai", "http://host/v1x/openai/chat/completions"),
])
def test_upstream_without_version_segment_warns(upstream: str, requested: str) -> None:
    warning = upstream_warning(upstream)
    assert warning is not None
    assert warning.endswith(f"has no version segment: /v1/chat/completions will be requested as {requested}")
    assert "pw" not in warning


@pytest.mark.parametrize("upstream", [
    "http://host:8000/v1", "https://api.openai.com/v1", "http://host/v2",
    "https://generativelanguage.googleapis.com/v1beta", "https://x.openai.azure.com/openai/v1",
    "http://host/tenant/v1alpha1",
])
def test_upstream_with_version_segment_does_not_warn(upstream: str) -> None:
    assert upstream_warning(upstream) is None


class Proc:
    """The real ``serve`` command; its stderr lines collected as they come."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_PROXY_")}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", *args], cwd=ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: re.Pattern[str], within: float = 30.0) -> re.Match[str]:
        deadline = time.monotonic() + within
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "no line matching " + pattern.pattern + ":\n" + "\n".join(self.lines)
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            assert line is not None, "exited before printing it:\n" + "\n".join(self.lines)
            self.lines.append(line)
            match = pattern.search(line)
            if match:
                return match

    def stop(self) -> int:
        self.popen.send_signal(signal.SIGTERM)
        code = self.popen.wait(30)
        self._reader.join(10)
        while (line := self._queue.get_nowait()) is not None:  # the rest, for the asserts
            self.lines.append(line)
        return code


@contextmanager
def serving(*args: str) -> Iterator[Proc]:
    proc = Proc(*args)
    try:
        yield proc
    finally:
        # SIGTERM first: with --workers, a killed supervisor would leave its workers
        # running, holding stderr open, and closing it below would never return.
        end_process(proc.popen, grace=30)
        if proc.popen.stderr is not None:
            proc.popen.stderr.close()


def get_healthz(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/healthz")
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.mark.e2e
def test_port_0_start_up_line_names_the_bound_port_and_one_warning_comes_first() -> None:
    with serving("--port", "0", "--upstream", "http://127.0.0.1:9") as proc:
        port = int(proc.wait_for(BANNER)[1])
        assert port != 0
        assert get_healthz(port) == 200  # the line is printed once the socket listens
        assert proc.stop() == 0
    warnings = [line for line in proc.lines if "warning" in line.lower()]
    assert warnings == [
        "llm-latency-proxy: warning: upstream http://127.0.0.1:9 has no version segment: "
        "/v1/chat/completions will be requested as http://127.0.0.1:9/chat/completions"]
    assert proc.lines.index(warnings[0]) < next(
        i for i, line in enumerate(proc.lines) if BANNER.search(line))
    assert sum(bool(BANNER.search(line)) for line in proc.lines) == 1


@pytest.mark.e2e
def test_port_0_with_workers_names_the_port_the_workers_share() -> None:
    with serving("--port", "0", "--workers", "2", "--upstream", "http://127.0.0.1:9/v1") as proc:
        port = int(proc.wait_for(BANNER)[1])
        assert port != 0
        # Connections made before the workers are up wait in the listening socket's backlog.
        assert get_healthz(port) == 200
        assert get_healthz(port) == 200
        assert proc.stop() == 0
    assert not [line for line in proc.lines if "warning" in line.lower()]


@pytest.mark.e2e
def test_a_bucket_layout_without_the_rules_edges_warns_at_start() -> None:
    """The shipped rules read the TTFT buckets at 2 s (the SLO) and 5 s, the ITL buckets
    at 0.2 s: without the 2 s edge the SLO counts every stream a miss, so start-up says so."""
    with serving("--port", "0", "--upstream", "http://127.0.0.1:9/v1",
                 "--ttft-buckets", "0.5,1,5") as proc:
        proc.wait_for(BANNER)
        assert proc.stop() == 0
    warnings = [line for line in proc.lines if "warning" in line.lower()]
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "llm-latency-proxy: warning: --ttft-buckets has no edge at 2 s, which the shipped rules")
    assert "TTFT SLO" in warnings[0] and "p99" not in warnings[0]


def test_the_bucket_warning_names_the_config_file_key_and_is_silent_without_metrics(
        tmp_path: Path) -> None:
    from proxy import config
    from proxy.serve import rule_edge_warnings

    path = tmp_path / "proxy.toml"
    path.write_text('itl_buckets = [0.1, 0.3]\n\n[[upstream]]\nname = "up"\n'
                    'url = "http://127.0.0.1:9/v1"\ndefault = true\n')
    settings = config.from_sources(argparse.Namespace(config=str(path)), {})
    (warning,) = rule_edge_warnings(settings, argparse.Namespace(config=str(path)), {})
    assert warning.startswith(f"itl_buckets in {path} has no edge at 0.2 s")
    assert "ITL p99 alert" in warning and "SLO" not in warning
    quiet = config.from_sources(argparse.Namespace(config=str(path), measure=False), {})
    assert rule_edge_warnings(quiet, None, {}) == []
