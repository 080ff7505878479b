"""The image's one ``HEALTHCHECK`` for every command it runs: ``healthcheck`` finds the
command from PID 1's command line (direct, under an init, or as ``python -m proxy``) and
asks the port that command listens on; ``bench`` and ``demo`` run no server.

Unit tests resolve command lines; the end-to-end ones run the Dockerfile's own command
against a real simulator (``--pid`` points it at the simulator's process) and against
a port nothing listens on.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from proxy.cli import build_parser
from proxy.config_values import SettingsError
from proxy.healthcheck import Target, our_arguments, target_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("cmdline", "expected"), [
    (["llm-latency-proxy", "serve"], ["serve"]),  # exec-form ENTRYPOINT + CMD
    # The console script, as the kernel runs it (interpreter, script, arguments):
    (["/opt/venv/bin/python", "/opt/venv/bin/llm-latency-proxy", "serve", "--port", "9000"],
     ["serve", "--port", "9000"]),
    (["/sbin/docker-init", "--", "llm-latency-proxy", "simulate", "--port=8001"],  # init: true
     ["simulate", "--port=8001"]),
    (["python", "-m", "proxy", "bench", "--rate", "3"], ["bench", "--rate", "3"]),
    (["/bin/sh", "-c", "while true; do llm-latency-proxy bench; done"], None),
    (["python", "-m", "pytest"], None),
    ([], None),
])
def test_our_arguments(cmdline: list[str], expected: list[str] | None) -> None:
    assert our_arguments(cmdline) == expected


@pytest.mark.parametrize(("cmdline", "environ", "expected"), [
    (["llm-latency-proxy", "serve"], {"LLM_PROXY_HOST": "0.0.0.0", "LLM_PROXY_PORT": "8080"},
     Target("serve", "127.0.0.1", 8080)),
    (["llm-latency-proxy", "serve", "--port", "9001"], {"LLM_PROXY_PORT": "8080"},
     Target("serve", "127.0.0.1", 9001)),  # the flag wins, as it does for serve
    (["llm-latency-proxy", "serve"], {"LLM_PROXY_HOST": "::", "LLM_PROXY_PORT": "8081"},
     Target("serve", "::1", 8081)),
    (["llm-latency-proxy", "serve", "--host", "10.1.2.3"], {}, Target("serve", "10.1.2.3", 8080)),
    (["llm-latency-proxy", "simulate", "--host", "0.0.0.0", "--port=8000"], {"LLM_PROXY_PORT": "8080"},
     Target("simulate", "127.0.0.1", 8000)),
    (["llm-latency-proxy", "simulate"], {}, Target("simulate", "127.0.0.1", 8000)),
    # Not ours, or nothing readable: the image's default command, serve.
    (["/bin/sh", "-c", "llm-latency-proxy serve"], {"LLM_PROXY_PORT": "8090"},
     Target("serve", "127.0.0.1", 8090)),
    (None, {"LLM_PROXY_PORT": "8091"}, Target("serve", "127.0.0.1", 8091)),
])
def test_target_for_servers(cmdline: list[str] | None, environ: dict[str, str],
                            expected: Target) -> None:
    assert target_for(cmdline, environ, build_parser) == expected


@pytest.mark.parametrize("cmdline", [
    ["llm-latency-proxy", "bench", "--base-url", "http://proxy:8080/v1", "--model", "m"],
    ["llm-latency-proxy", "demo", "--duration", "5"],
    ["llm-latency-proxy", "serve", "--port", "0"],
])
def test_target_for_commands_without_a_known_port(cmdline: list[str]) -> None:
    target = target_for(cmdline, {}, build_parser)
    assert target.host is None and target.port is None and target.reason
    assert target.command == cmdline[1]


def test_an_old_flags_warning_is_the_servers_not_each_checks(
        capsys: pytest.CaptureFixture[str]) -> None:
    cmdline = ["llm-latency-proxy", "serve", "--trace-file", "w.jsonl", "--port", "8093"]
    assert target_for(cmdline, {}, build_parser) == Target("serve", "127.0.0.1", 8093)
    assert capsys.readouterr().err == ""  # serve printed "--trace-file is deprecated" once


def test_invalid_serve_settings_are_unhealthy() -> None:
    with pytest.raises(SettingsError, match="LLM_PROXY_PORT"):
        target_for(["llm-latency-proxy", "serve"], {"LLM_PROXY_PORT": "http"}, build_parser)


# ---------------------------------------------------------------------------
# The Dockerfile's command, run for real


def dockerfile_healthcheck() -> list[str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("HEALTHCHECK ")]
    argv: list[str] = json.loads(line.split(" CMD ", 1)[1])
    assert argv[:4] == ["python", "-m", "proxy", "healthcheck"]
    return [sys.executable, *argv[1:]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_PROXY_")}
    env.update(extra)
    return env


def run_healthcheck(*extra: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*dockerfile_healthcheck(), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.e2e
def test_healthcheck_asks_the_simulator_on_its_port() -> None:
    port = free_port()
    sim = subprocess.Popen(
        [sys.executable, "-m", "proxy", "simulate", "--port", str(port), "--log-level", "info"],
        cwd=ROOT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert sim.stderr is not None
        for line in sim.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        seen = []
        while True:  # the simulator's own line, printed once it listens
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, "simulator exited:\n" + "".join(seen)
            seen.append(line)
            if re.search(rf"upstream at http://127\.0\.0\.1:{port}/v1\b", line):
                break
        # LLM_PROXY_PORT points elsewhere: the port comes from the simulator's own --port.
        done = run_healthcheck("--pid", str(sim.pid), env=clean_env(LLM_PROXY_PORT=str(free_port())))
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"simulate: http://127.0.0.1:{port}/healthz ok" in done.stdout
    finally:
        sim.send_signal(signal.SIGTERM)
        sim.wait(30)
        if sim.stderr is not None:
            sim.stderr.close()


@pytest.mark.e2e
def test_healthcheck_fails_when_nothing_answers() -> None:
    # This test process is not one of ours, so the check takes serve and its variables.
    port = free_port()
    done = run_healthcheck("--pid", str(os.getpid()), env=clean_env(LLM_PROXY_PORT=str(port)))
    assert done.returncode == 1
    assert f"serve: http://127.0.0.1:{port}/healthz unhealthy" in done.stderr


def test_healthcheck_of_a_process_that_is_gone_says_so() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    done = run_healthcheck("--pid", str(gone.pid), env=clean_env())
    assert done.returncode == 1
    assert done.stderr.strip() == f"llm-latency-proxy healthcheck: unhealthy: no process {gone.pid}"


def test_healthcheck_is_healthy_for_a_command_without_a_server(tmp_path: Path) -> None:
    """``bench`` and ``demo`` containers: nothing to ask, exit 0 (a process whose command
    line is ``python -m proxy bench ...`` stands in for PID 1)."""
    bench = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", "-m", "proxy", "bench"],
        stdin=subprocess.PIPE, text=True)
    try:
        done = run_healthcheck("--pid", str(bench.pid), env=clean_env())
        assert done.returncode == 0, done.stderr
        assert "bench: nothing to ask" in done.stdout
    finally:
        assert bench.stdin is not None
        bench.stdin.close()
        bench.wait(10)
