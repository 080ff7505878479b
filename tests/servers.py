"""Real uvicorn servers on loopback ports for end-to-end tests.

Each server runs in its own thread with its own event loop, bound to port 0 so the
kernel picks a free port (no race between choosing and binding). We wait on uvicorn's
own ``started`` flag, never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn


@dataclass
class RunningServer:
    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.contextmanager
def serve_in_thread(app: Any, *, host: str = "127.0.0.1", timeout: float = 10.0,
                    **config: Any) -> Iterator[RunningServer]:
    """Run ``app`` under uvicorn on ``host``:free port; yield once it listens."""
    cfg = uvicorn.Config(app, host=host, port=0, log_level="warning", lifespan="on",
                         loop="asyncio", **config)
    server = uvicorn.Server(cfg)
    # No signal handlers from a non-main thread.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as exc:  # surfaced to the test below
            failure.append(exc)

    thread = threading.Thread(target=run, name="uvicorn-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if failure or not thread.is_alive():
            raise RuntimeError(f"server failed to start: {failure!r}")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start in time")
        time.sleep(0.005)  # polling uvicorn's started flag, not timing anything
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningServer(server, thread, host, port)
    finally:
        server.should_exit = True
        thread.join(timeout)
