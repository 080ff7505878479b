"""uvicorn servers run in-process by a command that owns the signals: ``simulate
--profiles`` (one server per profile) and ``demo`` (simulators and the proxy on one loop).

The sockets are bound before anything is announced, so a taken port fails the command
first; the servers install no signal handlers, the command stops them all.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn


def listen(host: str, port: int, *, or_free: bool = False) -> socket.socket:
    """A listening, non-blocking socket on ``host:port`` (0: a free port); with
    ``or_free``, on a free port when ``port`` is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in (port, 0) if port and or_free else (port,):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, candidate))
            sock.listen(2048)
        except OSError:
            sock.close()
            if candidate == 0 or not or_free:
                raise
            continue
        sock.setblocking(False)
        return sock
    raise OSError("no port")  # pragma: no cover - the last candidate raises


def command_server(config: uvicorn.Config) -> uvicorn.Server:
    """A server whose signals belong to the command that runs it."""
    import uvicorn

    class CommandServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return CommandServer(config)
