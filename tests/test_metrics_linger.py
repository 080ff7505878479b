"""``--metrics-linger``: after SIGTERM and the drain, ``--metrics-port`` keeps answering,
so the streams that finished during the drain reach a scrape before the process exits.

The real command (``python -m proxy serve``) in front of a scripted upstream that holds
its stream open until the test lets it go: the stream is mid-way when SIGTERM arrives,
it completes after it, and only once the proxy says it has drained does the test
scrape; the scrape must count that stream. Then the process must stay until the
linger is over and exit 0. Waits are on the process's own output and state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.fake_upstream import DONE, Gate, ScriptedUpstream, chunk_json, sse, usage_json
from tests.servers import refuses
from tests.test_workers import free_port, metric_total, wait_healthy

pytestmark = pytest.mark.e2e

DRAINED = "drained; /metrics stays on port"


class HeldStream:
    """A chat stream that sends its first token, then waits for ``gate``."""

    def __init__(self) -> None:
        self.gate = Gate()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield sse(chunk_json({"role": "assistant", "content": ""}))
            yield sse(chunk_json({"content": "first "}))
            await self.gate.wait(30)
            yield sse(chunk_json({"content": "last"}))
            yield sse(chunk_json({}, finish="stop"))
            yield sse(usage_json(3, 2))
            yield DONE

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


@pytest.fixture
def held() -> Iterator[tuple[HeldStream, ScriptedUpstream]]:
    stream = HeldStream()
    with ScriptedUpstream(stream).running() as up:
        try:
            yield stream, up
        finally:
            stream.gate.open()


def start(up: ScriptedUpstream, log: Path, *args: str) -> tuple[subprocess.Popen[bytes], int, int]:
    port, metrics_port = free_port(), free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--upstream",
                up.url + "/v1",
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--graceful-timeout",
                "20",
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("LLM_PROXY_")},
                "TMPDIR": str(log.parent),
            },
        )
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc, port, metrics_port


def wait_for_line(
    log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 20
) -> float:
    """When ``text`` appeared in the process's output (monotonic clock)."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"exited before {text!r}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r}:\n{log.read_text()}"
        time.sleep(0.02)  # polling the process's output, not timing anything
    return time.monotonic()


def stream_through_sigterm(port: int, proc: subprocess.Popen[bytes], stream: HeldStream) -> bytes:
    """One stream: SIGTERM once its first token arrived, the rest released after it."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    received = b""
    signalled = False
    with (
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for raw in response.iter_raw():
            received += raw
            if b"first" in received and not signalled:
                proc.send_signal(signal.SIGTERM)  # mid-stream
                signalled = True
                stream.gate.open()
    assert signalled
    return received


@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_last_stream_is_scraped_after_the_drain(
    held: tuple[HeldStream, ScriptedUpstream], tmp_path: Path, workers: str
) -> None:
    stream, up = held
    linger = 2
    log = tmp_path / "proxy.log"
    proc, port, metrics_port = start(up, log, "--metrics-linger", str(linger), "--workers", workers)
    try:
        received = stream_through_sigterm(port, proc, stream)
        assert b'"content": "last"' in received and received.endswith(DONE)
        drained_at = wait_for_line(log, DRAINED, proc)
        # The drain is over and the main port is closed; the metrics port still answers
        # and counts the stream that finished during the drain.
        assert refuses(port)
        scrape = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert metric_total(scrape, "llm_proxy_requests_total") == 1
        assert metric_total(scrape, "llm_proxy_time_to_first_token_seconds_count") == 1
        assert metric_total(scrape, "llm_proxy_completion_tokens_sum") == 2
        assert proc.wait(20) == 0, log.read_text()
        assert time.monotonic() - drained_at >= linger - 0.25  # it stayed for the linger
        assert refuses(metrics_port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_second_sigterm_ends_the_linger(
    held: tuple[HeldStream, ScriptedUpstream], tmp_path: Path
) -> None:
    stream, up = held
    log = tmp_path / "proxy.log"
    proc, port, metrics_port = start(up, log, "--metrics-linger", "600")
    try:
        stream_through_sigterm(port, proc, stream)
        wait_for_line(log, DRAINED, proc)
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_without_linger_the_drained_proxy_exits_at_once(
    held: tuple[HeldStream, ScriptedUpstream], tmp_path: Path
) -> None:
    """The default (0): no line, no wait (what the linger changes)."""
    stream, up = held
    log = tmp_path / "proxy.log"
    proc, port, _ = start(up, log)
    try:
        stream_through_sigterm(port, proc, stream)
        assert proc.wait(20) == 0, log.read_text()
        assert DRAINED not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
