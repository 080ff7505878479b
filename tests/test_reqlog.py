"""The per-request log never blocks the event loop, drops (and counts) rather than wait,
and writes every buffered line at shutdown, SIGTERM included.

A slow disk is a FIFO that the test does not read: a write to it blocks exactly as a
write to a disk that takes nothing does, and the test decides when the "disk" starts
taking lines. Its pipe buffer is shrunk to one page, so a handful of lines fill it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from proxy.measure import Outcome, RequestRecord
from proxy.reqlog import RequestLog
from tests.fake_upstream import Conn, Gate, RawUpstream, ScriptedClock, normal, stream_events
from tests.servers import proxy_process
from tests.upstream_fakes import CHAT, call_raw, make_app

pytestmark = pytest.mark.anyio

WAIT_S = 30.0  # bound on every wait for an event (a loaded 2-core machine)
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
JSON_HEADERS = [(b"content-type", b"application/json")]


class SlowDisk:
    """A FIFO whose reader reads nothing until :meth:`start_reading` (or, so that a
    test of code that blocks its loop on a write fails instead of hanging, until
    ``give_up_s`` passed); then everything, to the end, into :attr:`data`."""

    def __init__(self, path: Path, give_up_s: float = WAIT_S) -> None:
        os.mkfifo(path)
        self.path = path
        # Non-blocking, so opening the read end does not wait for a writer.
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        fcntl.fcntl(self.fd, fcntl.F_SETPIPE_SZ, 4096)  # one page: a few lines fill it
        self.go = threading.Event()
        self.read_early = False  # the reader started because nobody told it to
        self.data = bytearray()
        self.done = threading.Event()
        self._give_up_s = give_up_s
        self._thread = threading.Thread(target=self._read, daemon=True, name="slow-disk")
        self._thread.start()

    def start_reading(self) -> None:
        self.go.set()

    def _read(self) -> None:
        if not self.go.wait(self._give_up_s):
            self.read_early = True
        os.set_blocking(self.fd, True)
        # EOF only once every writer has closed (and at least one had opened it).
        while chunk := os.read(self.fd, 65536):
            self.data += chunk
        self.done.set()

    def lines(self) -> list[dict[str, object]]:
        assert self.done.wait(WAIT_S), "the log's writer never closed the file"
        return [json.loads(line) for line in self.data.decode().splitlines()]

    def close(self) -> None:
        self.go.set()
        self._thread.join(WAIT_S)
        os.close(self.fd)

    async def exit_waits_for_it(self, proc: subprocess.Popen[str], out: list[str]) -> None:
        """``proc`` (SIGTERMed, its output lines in ``out``) began its app's shutdown
        while lines are still buffered for this disk: it must wait for the disk, not exit
        and lose them; then, once the disk reads, exit 0."""
        assert not self.read_early, "requests waited for the file"
        deadline = time.monotonic() + WAIT_S
        while not any("Waiting for application shutdown" in line for line in out):
            assert time.monotonic() < deadline, "".join(out)
            await anyio.sleep(0.01)  # polling the output for an event, not timing
        with pytest.raises(subprocess.TimeoutExpired):
            await anyio.to_thread.run_sync(proc.wait, 2.0)
        self.start_reading()
        code = await anyio.to_thread.run_sync(proc.wait, WAIT_S)
        assert code == 0, "".join(out)


@pytest.fixture
def slow_disk(tmp_path: Path) -> Iterator[SlowDisk]:
    disk = SlowDisk(tmp_path / "requests.fifo")
    try:
        yield disk
    finally:
        disk.close()


def request_id(result: object) -> str:
    headers = dict(result.headers)  # type: ignore[attr-defined]
    return headers[b"x-request-id"].decode()


async def test_a_file_that_takes_nothing_never_blocks_requests_and_all_lines_follow(
        slow_disk: SlowDisk) -> None:
    """Far more lines than the pipe holds are logged while the file takes nothing: every
    request is answered at once; when the file takes lines again, all are there."""
    app, registry = make_app(None, ScriptedClock(), behaviour=normal,
                             log_requests=str(slow_disk.path))
    ids = []
    async with app:
        for _ in range(60):  # about 30 KB of lines: seven times what the pipe holds
            result = await call_raw(app, "POST", CHAT, body=BODY, headers=JSON_HEADERS)
            assert result.status == 200
            ids.append(request_id(result))
        assert not slow_disk.read_early, "requests waited for the file"
        slow_disk.start_reading()
    logged = slow_disk.lines()
    assert [line["request_id"] for line in logged] == ids
    assert registry.get_sample_value("llm_proxy_request_log_dropped_lines_total") == 0


async def test_a_full_buffer_drops_counts_and_warns(
        slow_disk: SlowDisk, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="proxy")
    app, registry = make_app(None, ScriptedClock(), behaviour=normal,
                             log_requests=str(slow_disk.path), log_requests_buffer=4)
    ids = []
    async with app:
        for _ in range(60):
            result = await call_raw(app, "POST", CHAT, body=BODY, headers=JSON_HEADERS)
            assert result.status == 200
            ids.append(request_id(result))
        assert not slow_disk.read_early
        dropped = registry.get_sample_value("llm_proxy_request_log_dropped_lines_total")
        assert dropped is not None and dropped > 0
        assert app.request_log.dropped == dropped
        slow_disk.start_reading()
    logged = [line["request_id"] for line in slow_disk.lines()]
    # Every request is either in the file, in order, or counted as dropped.
    assert len(logged) + dropped == len(ids)
    assert logged == [i for i in ids if i in set(logged)]
    warnings = [r.getMessage() for r in caplog.records if "request log" in r.getMessage()]
    assert warnings  # the first drop at once; then at most one per 10 s, with the total
    assert "lines dropped so far" in warnings[0]


def test_lines_after_close_are_counted_not_lost_silently(tmp_path: Path) -> None:
    counted: list[int] = []
    reqlog = RequestLog(str(tmp_path / "log.jsonl"), dropped=counted.append)
    record = RequestRecord(request_id="r1", route=CHAT, model="m", upstream="u",
                           stream=False, status=200, outcome=Outcome.COMPLETED,
                           duration_s=0.1)
    reqlog.write(record)
    reqlog.close()
    reqlog.write(record)
    assert counted == [1]
    [line] = (tmp_path / "log.jsonl").read_text().splitlines()
    assert json.loads(line)["request_id"] == "r1"


async def test_sigterm_writes_every_buffered_line_before_exit(slow_disk: SlowDisk) -> None:
    """``serve`` in a real process, its log a file that takes nothing until after
    SIGTERM: the lines of the requests answered before, and of the stream that finishes
    during the drain, are all written before the process exits."""
    gate = Gate()
    events = stream_events(3, usage=True)

    async def held(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(events[0])
        await gate.wait(WAIT_S)
        for event in events[1:]:
            await conn.chunk(event)
        await conn.end()

    upstream = RawUpstream({"held": held})
    ids: list[str] = []
    with upstream.running():
        async with proxy_process(upstream.url, "--log-requests", str(slow_disk.path),
                                 "--graceful-timeout", "20") as (proc, port, out):
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(timeout=WAIT_S) as client:
                for _ in range(30):
                    r = await client.post(base + CHAT, content=BODY)
                    assert r.status_code == 200
                    ids.append(r.headers["x-request-id"])
                body = json.dumps({"model": "held", "stream": True, "messages": []})
                async with client.stream("POST", base + CHAT, content=body) as stream:
                    ids.append(stream.headers["x-request-id"])
                    chunks = stream.aiter_raw()
                    await anext(chunks)  # the first event: the stream is in flight
                    proc.send_signal(signal.SIGTERM)
                    gate.open()
                    async for _ in chunks:
                        pass
            await slow_disk.exit_waits_for_it(proc, out)
    logged = await anyio.to_thread.run_sync(slow_disk.lines)
    assert [line["request_id"] for line in logged] == ids
    assert logged[-1]["outcome"] == "completed" and logged[-1]["stream"] is True
