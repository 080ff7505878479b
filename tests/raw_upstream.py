"""A misbehaving upstream for fault and security tests: a raw asyncio TCP server.

Why raw and not an ASGI app: the faults under test live below HTTP frameworks. A
server framework will not accept a connection and then never answer, reset a
connection with an RST in the middle of a chunked body, or send a 10 MB event as one
write. Here each request is handed to a *behaviour* (an async function given the
parsed request and the connection's reader and writer) chosen by the request body's
``model``, so one upstream can misbehave for the request under test and answer the
follow-up "is the proxy still serving?" request normally.

The server runs on its own event loop in its own thread, so a test may block (for
example in ``serve_in_thread``'s shutdown) without freezing the upstream. Tests and
behaviours talk through ``threading.Event`` objects: :class:`Gate` for test ->
upstream ("send the rest now"), ``Seen.closed`` for upstream -> test ("the proxy
closed my connection", with the monotonic time it happened).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

Behaviour = Callable[["Conn"], Awaitable[None]]


@dataclass
class Seen:
    """One request exactly as the upstream received it."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    closed: threading.Event = field(default_factory=threading.Event)
    closed_at: float | None = None  # time.perf_counter() when the peer closed

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    @property
    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):
            return None


class Gate:
    """A threading event a behaviour can await without blocking the upstream's loop."""

    def __init__(self) -> None:
        self._flag = threading.Event()

    def open(self) -> None:
        self._flag.set()

    async def wait(self, within: float = 10.0) -> bool:
        return await asyncio.to_thread(self._flag.wait, within)


@dataclass
class Conn:
    """What a behaviour gets: the request and the raw connection."""

    request: Seen
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    keep_open: bool = True  # set False when the behaviour closed or broke the connection

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def head(self, status: int = 200, *, content_type: str = "text/event-stream",
                   extra: tuple[tuple[str, str], ...] = (), length: int | None = None) -> None:
        lines = [f"HTTP/1.1 {status} X", f"content-type: {content_type}"]
        lines += [f"{k}: {v}" for k, v in extra]
        lines.append(f"content-length: {length}" if length is not None
                     else "transfer-encoding: chunked")
        await self.write(("\r\n".join(lines) + "\r\n\r\n").encode())

    async def chunk(self, data: bytes) -> None:
        """One HTTP/1.1 chunk (must not be empty)."""
        await self.write(b"%x\r\n%s\r\n" % (len(data), data))

    async def end(self) -> None:
        await self.write(b"0\r\n\r\n")

    async def until_closed(self, within: float = 10.0) -> bool:
        """Wait for the peer to close; record when. True if it did ``within`` seconds."""
        try:
            async with asyncio.timeout(within):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except OSError:
            pass
        self.request.closed_at = time.perf_counter()
        self.request.closed.set()
        self.keep_open = False
        return True

    def reset(self) -> None:
        """Abort with an RST (SO_LINGER 0), as a crashed peer or a middlebox would."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()
        self.keep_open = False

    def close(self) -> None:
        """A plain close (FIN) in the middle of whatever was being sent."""
        self.writer.close()
        self.keep_open = False


# ---------------------------------------------------------------------------
# Ready-made bodies and behaviours.


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def content_event(text: str, index: int = 0) -> bytes:
    return event({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                  "choices": [{"index": index, "delta": {"content": text},
                               "finish_reason": None}]})


def stream_events(n: int, *, usage: bool) -> list[bytes]:
    """A normal chat stream: role-only chunk, ``n`` tokens, finish, usage, [DONE]."""
    out = [event({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                  "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "finish_reason": None}]})]
    out += [content_event(f" tok{i}") for i in range(n)]
    out.append(event({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                      "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    if usage:
        out.append(event({"id": "c", "object": "chat.completion.chunk", "created": 0,
                          "model": "m", "choices": [],
                          "usage": {"prompt_tokens": 3, "completion_tokens": n,
                                    "total_tokens": 3 + n}}))
    out.append(b"data: [DONE]\n\n")
    return out


async def normal(conn: Conn) -> None:
    """A well-behaved OpenAI-style answer: a stream if asked for, else one JSON object."""
    body = conn.request.json if isinstance(conn.request.json, dict) else {}
    if conn.request.method == "POST" and body.get("stream") is True:
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        await conn.head(200)
        for ev in stream_events(3, usage=usage):
            await conn.chunk(ev)
        await conn.end()
        return
    payload = json.dumps({
        "id": "c", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }).encode()
    await conn.head(200, content_type="application/json", length=len(payload))
    await conn.write(payload)


class RawUpstream:
    """The server. ``behaviours[model]`` answers requests for that model; else ``normal``."""

    def __init__(self, behaviours: dict[str, Behaviour] | None = None, *, port: int = 0) -> None:
        self.behaviours: dict[str, Behaviour] = dict(behaviours or {})
        self.requests: list[Seen] = []
        self.connections = 0
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def seen(self, model: str) -> list[Seen]:
        return [r for r in self.requests
                if isinstance(r.json, dict) and r.json.get("model") == model]

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        last: Seen | None = None
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                    if last is not None and not last.closed.is_set():
                        last.closed_at = time.perf_counter()
                        last.closed.set()
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target = [*lines[0].split(" "), "", ""][:2]
                headers = [(k.strip(), v.strip()) for k, _, v in
                           (line.partition(":") for line in lines[1:] if line)]
                length = 0
                chunked = False
                for k, v in headers:
                    if k.lower() == "content-length":
                        length = int(v)
                    if k.lower() == "transfer-encoding" and "chunked" in v.lower():
                        chunked = True
                body = await _read_chunked(reader) if chunked else await reader.readexactly(length)
                seen = Seen(method, target, headers, body)
                self.requests.append(seen)
                last = seen
                model = seen.json.get("model") if isinstance(seen.json, dict) else None
                behaviour = self.behaviours.get(model if isinstance(model, str) else "", normal)
                conn = Conn(seen, reader, writer)
                await behaviour(conn)
                if not conn.keep_open:
                    return
        except asyncio.CancelledError:
            return  # the upstream is shutting down
        except (ConnectionError, asyncio.IncompleteReadError):
            if last is not None and not last.closed.is_set():
                last.closed_at = time.perf_counter()
                last.closed.set()
        finally:
            self._tasks.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    @contextlib.contextmanager
    def running(self) -> Iterator[RawUpstream]:
        started = threading.Event()
        stop: list[asyncio.Event] = []

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            server = await asyncio.start_server(self._serve_conn, "127.0.0.1", self.port,
                                                limit=1 << 20)
            self.port = server.sockets[0].getsockname()[1]
            done = asyncio.Event()
            stop.append(done)
            started.set()
            await done.wait()
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True,
                                  name="raw-upstream")
        thread.start()
        if not started.wait(10):
            raise RuntimeError("raw upstream did not start")
        try:
            yield self
        finally:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(stop[0].set)
            thread.join(10)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


def closed_port() -> int:
    """A loopback port that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------
# The real command in a subprocess (signals, logs, --metrics-port).

ROOT = Path(__file__).resolve().parent.parent


@contextlib.asynccontextmanager
async def proxy_process(upstream_url: str, *args: str) -> AsyncIterator[tuple[subprocess.Popen[str], int, list[str]]]:
    """``python -m proxy serve`` on a kernel-chosen port; yields (process, port, stdout lines)."""
    proc = subprocess.Popen(  # noqa: ASYNC220 (returns at once; the test waits below)
        [sys.executable, "-m", "proxy", "serve", "--upstream", upstream_url + "/v1",
         "--port", "0", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ready: list[int] = []
    started = threading.Event()
    out: list[str] = []

    def pump_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            out.append(line)
            m = re.search(r"Uvicorn running on http://[\d.]+:(\d+)", line)
            if m:
                ready.append(int(m[1]))
                started.set()
        started.set()

    def pump_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)

    threads = [threading.Thread(target=f, daemon=True) for f in (pump_stderr, pump_stdout)]
    for th in threads:
        th.start()
    try:
        await anyio.to_thread.run_sync(started.wait, 20)
        assert ready, "proxy did not start:\n" + "".join(out)
        yield proc, ready[0], out
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for th in threads:
            th.join(5)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except OSError:
        return True
