"""The benchmark harness (``benchmarks/``) measures what it claims to measure.

No timing is asserted (timing belongs to ``benchmarks/run.py`` and its report); these
tests prove correctness of the instrument: the load client's chunked decoding and
byte-scan counting over every split point, stream and token counts against the fake
upstream's schedule, kept-alive versus new connections, broken streams detected, and
``run.py`` end to end (fake upstream, direct, nginx when installed, the proxy and the
proxy with ``--no-measure``) producing a report with no broken streams.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import fake_upstream  # noqa: E402
import loadgen  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

# Events per streamed response from the fake upstream besides tokens: role chunk,
# finish chunk, [DONE] (+ the usage chunk when asked for).
EXTRA_EVENTS = 3



@asynccontextmanager
async def upstream(schedule: fake_upstream.Schedule) -> AsyncIterator[tuple[str, dict[str, int]]]:
    """The fake upstream in this event loop; yields its base URL and live stats."""
    stop, ready = asyncio.Event(), asyncio.Event()
    ports: list[int] = []
    stats: dict[str, int] = {}
    task = asyncio.create_task(
        fake_upstream.serve("127.0.0.1", 0, schedule, ready, ports, stop, stats)
    )
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield f"http://127.0.0.1:{ports[0]}/v1", stats
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


FAST = fake_upstream.Schedule(ttft=0.005, itl=0.002, tokens=6)


@pytest.mark.parametrize("keepalive", [True, False], ids=["keep-alive", "new-connections"])
@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no-usage"])
async def test_direct_counts_match_schedule(keepalive: bool, usage: bool) -> None:
    users, per_user, tokens = 6, 3, 7
    async with upstream(FAST) as (url, stats):
        cfg = loadgen.LoadConfig(
            url=url,
            concurrency=users,
            duration=60,
            warmup=0,
            tokens=tokens,
            keepalive=keepalive,
            streams=per_user,
            stagger=0.01,
            stream_timeout=10,
            include_usage=usage,
        )
        out = await loadgen.run_load(cfg)
    n = users * per_user
    assert out["streams"] == out["ok"] == n
    assert out["broken"] == 0 and out["errors"] == {}
    assert out["tokens"] == n * tokens
    assert out["events"] == n * (tokens + EXTRA_EVENTS + usage)
    assert out["ttft_ms"]["n"] == n
    assert out["itl_ms"]["n"] == n * (tokens - 1)
    assert stats["requests"] == stats["completed"] == n
    assert stats["connections"] == (users if keepalive else n)


def _response(tokens: int, usage: bool) -> bytes:
    body = fake_upstream.HEAD_STREAM + b"\r\n" + fake_upstream.ROLE
    body += fake_upstream.TOKEN * tokens + fake_upstream.FINISH
    body += fake_upstream._usage(8, tokens) if usage else b""
    return body + fake_upstream.DONE


class _Sink:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


async def test_client_parses_every_split_point() -> None:
    """The chunked decoder and the byte scan count right however TCP splits the bytes."""
    tokens = 3
    wire = _response(tokens, usage=True)
    for size in (1, 2, 3, 5, 7, 64, len(wire)):
        for offset in range(min(size, 8)):
            conn = loadgen._Conn()
            conn.connection_made(_Sink())  # type: ignore[arg-type]
            res = loadgen.StreamResult(t_start=0.0)
            fut = conn.start(b"", res)
            pieces = [wire[:offset]] + [wire[i : i + size] for i in range(offset, len(wire), size)]
            for piece in pieces:
                if piece:
                    conn.data_received(piece)
            assert fut.done(), (size, offset)
            assert res.ok and res.status == 200, (size, offset, res.error)
            assert res.tokens == tokens and res.events == tokens + EXTRA_EVENTS + 1
            assert len(res.gaps) == tokens - 1


async def test_truncated_stream_is_broken() -> None:
    """An upstream that hangs up mid-stream yields broken streams, not silent success."""
    cut = _response(5, usage=False)
    cut = cut[: cut.index(fake_upstream.TOKEN) + 2 * len(fake_upstream.TOKEN)]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(cut)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        cfg = loadgen.LoadConfig(
            url=f"http://127.0.0.1:{port}/v1",
            concurrency=2,
            duration=60,
            warmup=0,
            tokens=5,
            streams=2,
            stagger=0,
            stream_timeout=5,
        )
        out = await loadgen.run_load(cfg)
    assert out["streams"] == 4 and out["ok"] == 0 and out["broken"] == 4
    assert out["tokens"] == 4 * 2


def _run_harness(tmp_path: Path, targets: list[str]) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(BENCH / "run.py"),
        "--targets",
        ",".join(targets),
        "--rounds",
        "1",
        "--loads",
        "4,4new",
        "--duration",
        "1.2",
        "--warmup",
        "0.2",
        "--ttft",
        "0.01",
        "--itl",
        "0.005",
        "--tokens",
        "5",
        "--sweep",
        "",
        "--max-minutes",
        "2",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| load | conn | target |" in done.stdout
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_run_py_side_by_side(tmp_path: Path) -> None:
    targets = ["direct"]
    if shutil.which("nginx"):
        targets.append("nginx")
    if (BENCH.parent / "proxy" / "serve.py").exists():
        targets += ["proxy", "proxy-nomeasure"]
    result = _run_harness(tmp_path, targets)
    seen = {(r["target"], r["load"], r["keepalive"]) for r in result["runs"]}
    assert seen == {(t, 4, ka) for t in targets for ka in (True, False)}
    for run in result["runs"]:
        assert run["streams"] > 0 and run["broken"] == 0 and run["warmup_broken"] == 0, run
        assert run["ok"] == run["streams"]
        assert run["tokens"] == run["streams"] * 5
        if run["target"] != "direct":
            assert run["target_cpu_s"] >= 0
    for row in result["rows"]:
        assert row["broken"] == 0
