"""The simulator in a process of its own that stamps when each request arrives.

For the replay's timing tests: the stamp is ``time.perf_counter()`` when uvicorn hands
the request to the app (its headers parsed), and ``GET /arrivals`` answers the stamps
so far. A process of its own, as a real upstream is: in a thread of the test's process
the simulator would wait on the client for the interpreter lock and blur what is
measured. Run as ``python -m tests.arrival_upstream [simulate flags]``; it announces
``... at http://127.0.0.1:PORT/v1`` on stderr once it listens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

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
            if scope["method"] == "POST":
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.arrival_upstream", *knobs],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    said: list[str] = []
    url: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            said.append(line)
            match = re.search(r" at (http://127\.0\.0\.1:\d+/v1)", line)
            if match and not url:
                url.append(match[1])
                ready.set()
        ready.set()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        ready.wait(timeout)
        assert url, "the arrival upstream did not start:\n" + "".join(said)
        yield url[0]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        thread.join(5)
        if proc.stderr is not None:
            proc.stderr.close()


def arrivals(base_url: str) -> list[float]:
    """The stamps so far (``perf_counter`` seconds of the upstream's process)."""
    root = base_url.rsplit("/v1", 1)[0]
    return [float(x) for x in httpx.get(root + "/arrivals", timeout=10).json()]


if __name__ == "__main__":
    serve(sys.argv[1:])
