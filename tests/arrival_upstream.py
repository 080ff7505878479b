"""The simulator in a process of its own that stamps when each request arrives.

For the replay's timing tests: the stamp is ``time.perf_counter()`` when uvicorn hands
the request to the app (its headers parsed), and ``GET /arrivals`` answers the stamps
so far. Requests with ``x-warm-up: 1`` are not stamped: the context manager sends a
few before it yields, as a real upstream has served requests before a replay starts. A process of its own, as a real upstream is: in a thread of the test's process
the simulator would wait on the client for the interpreter lock and blur what is
measured. Run as ``python -m tests.arrival_upstream [simulate flags]``; it announces
``... at http://127.0.0.1:PORT/v1`` on stderr once it listens.

The pacing control (``--pace``) is the floor under those measurements: a process
that only sleeps until the same offsets, at the same time, and reports how late it
woke. On a shared machine most of a replay's lateness is the scheduler's, and the
control says how much.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.servers import announcing_process

ROOT = Path(__file__).resolve().parent.parent


def serve(argv: list[str]) -> None:
    import uvicorn

    from proxy.simulator import cli as simulator_cli
    from proxy.simulator.app import create_simulator_app

    parser = argparse.ArgumentParser(prog="arrival_upstream")
    simulator_cli.add_parser(parser.add_subparsers())
    config = simulator_cli.config_from_args(parser.parse_args(["simulate", *argv]))
    app = create_simulator_app(config)
    stamps: list[float] = []

    async def stamped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if scope["method"] == "POST" and (b"x-warm-up", b"1") not in scope["headers"]:
                stamps.append(time.perf_counter())
            elif scope["path"] == "/arrivals":
                body = json.dumps(stamps).encode()
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json")]})  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(stamped, lifespan="on", log_level="warning", timeout_graceful_shutdown=2)
    )
    print(f"arrival upstream at http://127.0.0.1:{port}/v1", file=sys.stderr, flush=True)
    server.run(sockets=[sock])


@contextlib.contextmanager
def arrival_upstream(*knobs: str, timeout: float = 60.0) -> Iterator[str]:
    """Start it with ``knobs`` (simulate flags); yield its base URL (``.../v1``)."""
    with announcing_process(
        [sys.executable, "-m", "tests.arrival_upstream", *knobs],
        r" at (http://127\.0\.0\.1:\d+/v1)", what="the arrival upstream", timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as url:
        # Warm it (its first requests take code paths never run before): a real
        # upstream has served requests before a replay starts. Not stamped.
        body = {"model": "sim-llm", "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": "warm up"}]}  # fmt: skip
        for _ in range(3):
            httpx.post(url + "/chat/completions", json=body, headers={"x-warm-up": "1"},
                       timeout=30).raise_for_status()  # fmt: skip
        yield url


def arrivals(base_url: str) -> list[float]:
    """The stamps so far (``perf_counter`` seconds of the upstream's process)."""
    root = base_url.rsplit("/v1", 1)[0]
    return [float(x) for x in httpx.get(root + "/arrivals", timeout=10).json()]


def pace(offsets_file: str, delay: float) -> None:
    """The control: sleep until each offset (from ``delay`` seconds after start) on the
    same kind of event loop as bench, and print how late each wake-up was (JSON)."""
    import asyncio

    import uvloop

    offsets = json.loads(Path(offsets_file).read_text())

    async def run() -> list[float]:
        origin = time.perf_counter() + delay
        late = []
        for offset in offsets:
            wait = origin + offset - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            late.append(time.perf_counter() - origin - offset)
        return late

    print(json.dumps(uvloop.run(run())), flush=True)


@contextlib.contextmanager
def pacing_control(offsets: list[float], tmp: Path, delay: float = 0.3) -> Iterator[list[float]]:
    """Run :func:`pace` in a process of its own while the body runs; the yielded list
    holds its lateness (seconds per offset) once the block is left. What a process that
    only sleeps meets from the machine at that time: the floor under any replay's."""
    path = tmp / "offsets.json"
    path.write_text(json.dumps(offsets))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.arrival_upstream", "--pace", str(path), str(delay)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    late: list[float] = []
    try:
        yield late
        out, _ = proc.communicate(timeout=max(offsets, default=0.0) + 60)
        late.extend(json.loads(out))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pace"]:
        pace(sys.argv[2], float(sys.argv[3]))
    else:
        serve(sys.argv[1:])
