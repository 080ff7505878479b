"""The suite's one fake upstream, and its one SSE builder.

Proxy tests must run the client users run (:mod:`proxy.wire`), so the fake upstream is
reached the way a real one is: over a TCP socket on 127.0.0.1. :class:`ScriptedUpstream`
is that server. It parses each request (httptools, the parser uvicorn uses), records it
(:class:`Seen`) and hands it to one of two kinds of script:

* a **handler**, ``async (httpx.Request) -> httpx.Response`` (the ``httpx.Request`` is a
  convenient container, nothing more): a fixed body (``content=``/``json=``) is written
  with its ``Content-Length``; a body that is an async iterator is written with chunked
  framing, one socket write per chunk, as servers do. With a :class:`ScriptedClock`,
  time is scripted, never measured: the body iterator sets the clock right before it
  yields each chunk; the server writes the chunk and then waits until the proxy has
  read the clock once more, which the relay does exactly once per upstream read, after
  handing that read on. So every read is seen at exactly its scripted time, and every
  expected metric can be computed from the script. Faults: a body iterator that raises
  ends the response mid-body (closed without the chunked terminator; a
  ``ConnectionResetError`` resets it with an RST instead); one that waits on an event
  stalls; when the proxy closes the connection early, a handler still working on its
  answer is cancelled and the iterator is closed, so their ``finally`` tells the test.
* a **behaviour**, ``async (Conn) -> None``, for what lives below HTTP: :class:`Conn`
  writes bytes verbatim (malformed HTTP included), sends a head and chunks by hand,
  resets with an RST, closes with a FIN mid-body, or waits for the proxy to close.

It runs either on the test's own event loop (``async with ScriptedUpstream(...)``, the
in-process tests, where the scripted clock can hold proxy and upstream in lockstep) or
on its own loop in its own thread (``with upstream.running():``), for end-to-end tests
whose proxy runs under uvicorn in another thread or process. Tests and thread-mode
scripts talk through ``threading.Event``: :class:`Gate` (test -> upstream: "go on"),
``Seen.closed`` (upstream -> test: "the proxy closed this request's connection", with
the ``time.perf_counter()`` it happened).

Ready-made scripts: :func:`normal` (an OpenAI-style answer: a stream if asked for),
:class:`RawUpstream` (a behaviour per request ``model``, else ``normal``), and
:class:`Scheduled` (a stream on a wall-clock schedule, for the e2e latency tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httptools
import httpx

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
Behaviour = Callable[["Conn"], Awaitable[None]]


# ---------------------------------------------------------------------------
# The SSE builder: every event the suite's upstreams send is made here.

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any] | str, eol: bytes = b"\n", *, compact: bool = False,
        event: str | None = None) -> bytes:
    """One SSE event: ``data: <payload>`` and a blank line, with ``eol`` line endings.
    ``compact``: JSON without spaces, as OpenAI, vLLM and llama.cpp write it.
    ``event``: an ``event: <name>`` line first, as the Responses and Messages APIs send."""
    if isinstance(payload, str):
        data = payload
    else:
        data = json.dumps(payload, separators=(",", ":") if compact else None)
    name = b"event: " + event.encode() + eol if event is not None else b""
    return name + b"data: " + data.encode() + eol + eol


def chunk_json(*deltas: dict[str, Any], model: str = "m", finish: str | None = None,
               **extra: Any) -> dict[str, Any]:
    """A ``chat.completion.chunk``: one choice per delta; ``finish`` on every choice."""
    choices = [{"index": i, "delta": d, "finish_reason": finish} for i, d in enumerate(deltas)]
    return {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": choices, **extra}


def text_json(*texts: str, model: str = "m", **extra: Any) -> dict[str, Any]:
    """A ``text_completion`` chunk (the completions route): one choice per text."""
    choices = [{"index": i, "text": t, "finish_reason": None} for i, t in enumerate(texts)]
    return {"id": "c1", "object": "text_completion", "created": 0, "model": model,
            "choices": choices, **extra}


def usage_json(prompt: int, completion: int, cached: int | None = None, *,
               model: str = "m", **extra: Any) -> dict[str, Any]:
    """The usage-only chunk (``choices: []``) that ``include_usage`` asks for."""
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    usage.update(extra)
    return {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [], "usage": usage}


def content_event(text: str, index: int = 0, *, model: str = "m") -> bytes:
    """One token of text for choice ``index``."""
    event = chunk_json({"content": text}, model=model)
    event["choices"][0]["index"] = index
    return sse(event)


def stream_events(n: int, *, usage: bool, model: str = "m", prompt: int = 3,
                  cached: int | None = None, text: Callable[[int], str] = " tok{}".format
                  ) -> list[bytes]:
    """A normal chat stream: role-only chunk, ``n`` tokens, finish, usage, [DONE]."""
    out = [sse(chunk_json({"role": "assistant", "content": ""}, model=model))]
    out += [content_event(text(i), model=model) for i in range(n)]
    out.append(sse(chunk_json({}, model=model, finish="stop")))
    if usage:
        out.append(sse(usage_json(prompt, n, cached, model=model)))
    out.append(DONE)
    return out


def completion_json(content: str, *, model: str = "m", prompt: int = 3,
                    completion: int = 1, cached: int | None = None) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` with its usage."""
    usage = usage_json(prompt, completion, cached)["usage"]
    return {"id": "c1", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}], "usage": usage}


# ---------------------------------------------------------------------------
# Scripted time


class ScriptedClock:
    """A monotonic clock that only moves when a test (or a fake upstream) moves it.

    It counts its reads, so a scripted upstream can wait until the proxy has seen a
    chunk (:meth:`read_after`) before it moves time on.
    """

    def __init__(self, now: float = 64.0) -> None:
        self.now = now
        self.reads = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        self.reads += 1
        if self._waiters:
            for count, waiter in self._waiters:
                if self.reads > count and not waiter.done():
                    waiter.set_result(None)
            self._waiters = [(c, w) for c, w in self._waiters if not w.done()]
        return self.now

    async def read_after(self, count: int) -> None:
        """Until the clock has been read more than ``count`` times."""
        if self.reads > count:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((count, waiter))
        await waiter


# ---------------------------------------------------------------------------
# What the upstream received, and what a behaviour gets


@dataclass
class Seen:
    """One request exactly as the upstream received it."""

    method: str
    target: str  # the request target as sent (latin-1), query included
    headers: list[tuple[bytes, bytes]]  # as sent: names in their case, in order
    body: bytes
    closed: threading.Event = field(default_factory=threading.Event)
    closed_at: float | None = None  # time.perf_counter() when the proxy closed

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None."""
        values = self.header_values(name)
        return values[0] if values else None

    def header_values(self, name: str) -> list[str]:
        key = name.lower().encode("latin-1")
        return [v.decode("latin-1") for k, v in self.headers if k.lower() == key]

    @property
    def json(self) -> Any:
        """The body as JSON, or None if it is not JSON."""
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):
            return None

    @property
    def model(self) -> str | None:
        body = self.json
        model = body.get("model") if isinstance(body, dict) else None
        return model if isinstance(model, str) else None


class Gate:
    """A threading event a thread-mode script can await without blocking its loop."""

    def __init__(self) -> None:
        self._flag = threading.Event()

    def open(self) -> None:
        self._flag.set()

    async def wait(self, within: float = 10.0) -> bool:
        return await asyncio.to_thread(self._flag.wait, within)


class _Link:
    """One accepted connection's state, shared by its reader and its scripts."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.lost = asyncio.Event()  # the connection is gone (either side)
        self.closed_by_us = False
        self.last: Seen | None = None  # the request the connection last carried


@dataclass
class Conn:
    """What a behaviour gets: the request and the raw connection."""

    request: Seen
    _link: _Link
    keep_open: bool = True  # False once the behaviour closed or broke the connection

    @property
    def writer(self) -> asyncio.StreamWriter:
        return self._link.writer

    async def write(self, data: bytes) -> None:
        """Bytes verbatim (a head, a body, malformed HTTP: whatever the test needs)."""
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
        """Wait for the proxy to close the connection: True if it did ``within`` seconds
        (``request.closed_at`` says when)."""
        try:
            async with asyncio.timeout(within):
                await self._link.lost.wait()
        except TimeoutError:
            return False
        self.keep_open = False
        return True

    def reset(self) -> None:
        """Abort with an RST (SO_LINGER 0), as a crashed peer or a middlebox would."""
        self._link.closed_by_us = True
        _reset(self.writer)
        self.keep_open = False

    def close(self) -> None:
        """A plain close (FIN) in the middle of whatever was being sent."""
        self._link.closed_by_us = True
        self.writer.close()
        self.keep_open = False


async def normal(conn: Conn) -> None:
    """A well-behaved OpenAI-style answer: a stream of `` tok0 tok1 tok2`` if asked for
    (with usage if asked for), else one JSON completion."""
    body = conn.request.json if isinstance(conn.request.json, dict) else {}
    if conn.request.method == "POST" and body.get("stream") is True:
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        await conn.head(200)
        for ev in stream_events(3, usage=usage):
            await conn.chunk(ev)
        await conn.end()
        return
    payload = json.dumps(completion_json("hi")).encode()
    await conn.head(200, content_type="application/json", length=len(payload))
    await conn.write(payload)


# ---------------------------------------------------------------------------
# The server


class _Requests:
    """httptools request parser callbacks, collecting whole requests."""

    def __init__(self, heads: list[tuple[str, float]] | None = None) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.url = b""
        self.done: list[Seen] = []
        self.heads = heads if heads is not None else []

    def on_headers_complete(self) -> None:
        self.heads.append((self.url.decode("latin-1"), time.perf_counter()))

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        self.done.append(Seen(method, self.url.decode("latin-1"), self.headers,
                              b"".join(self.body)))
        self.url, self.headers, self.body = b"", [], []


class ScriptedUpstream:
    """A loopback HTTP/1.1 server answering with ``handler`` or ``behaviour``.

    ``async with ScriptedUpstream(handler, clock) as up:`` serves on this loop;
    ``with ScriptedUpstream(behaviour=b).running() as up:`` on a thread of its own.
    ``up.url`` is the origin (``http://127.0.0.1:PORT``, no path); ``up.requests`` every
    request received, ``up.heads`` the target of every request whose head arrived and
    when (its body may still be arriving), ``up.connections`` the connections accepted. The port is bound at
    once (``port=0``: a free one), so the URL can go into settings before it serves.
    """

    def __init__(self, handler: Handler | None = None, clock: ScriptedClock | None = None, *,
                 behaviour: Behaviour | None = None, port: int = 0) -> None:
        if (handler is None) == (behaviour is None):
            raise TypeError("give a handler or a behaviour")
        self.handler = handler
        self.behaviour: Behaviour = behaviour if behaviour is not None else self._scripted
        self.clock = clock
        self.requests: list[Seen] = []
        # The target of every request whose head arrived and when (perf_counter), as it
        # arrives: a large body may still be on its way (``requests`` has whole ones).
        self.heads: list[tuple[str, float]] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", port))
        self.port: int = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def seen(self, model: str) -> list[Seen]:
        """The requests whose JSON body asked for ``model``."""
        return [r for r in self.requests if r.model == model]

    # -- on the test's loop ---------------------------------------------------------------

    async def start(self) -> None:
        if self._server is None and not self._closed:
            self._server = await asyncio.start_server(self._serve, sock=self.sock,
                                                      limit=1 << 20)

    async def aclose(self) -> None:
        """Stop listening and drop every connection; safe to call twice."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        else:
            self.sock.close()

    async def __aenter__(self) -> ScriptedUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- on a thread of its own -------------------------------------------------------------

    @contextlib.contextmanager
    def running(self) -> Iterator[ScriptedUpstream]:
        """Serve on a new event loop in a daemon thread until the block ends."""
        started = threading.Event()
        failure: list[BaseException] = []
        stop: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

        async def main() -> None:
            done = asyncio.Event()
            stop.append((asyncio.get_running_loop(), done))
            try:
                await self.start()
            except Exception as exc:  # reported to the test below
                failure.append(exc)
            finally:
                started.set()
            try:
                if not failure:
                    await done.wait()
            finally:
                await self.aclose()

        thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True,
                                  name="fake-upstream")
        thread.start()
        try:
            if not started.wait(10) or failure:
                raise RuntimeError(f"fake upstream did not start: {failure!r}")
            yield self
        finally:
            if stop:
                loop, done = stop[0]
                with contextlib.suppress(RuntimeError):  # its loop already ended
                    loop.call_soon_threadsafe(done.set)
            thread.join(10)

    # -- one connection -----------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        # asyncio disables Nagle only for sockets whose proto is IPPROTO_TCP, and
        # socket.create_server makes proto 0: without this, each small write waits for
        # the peer's delayed ACK (40 ms on Linux), as a real upstream's writes do not.
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        parsed = _Requests(self.heads)
        link = _Link(writer)
        arrived = asyncio.Event()

        async def read_loop() -> None:
            try:
                while data := await reader.read(65536):
                    parsed.parser.feed_data(data)
                    if parsed.done:
                        arrived.set()
            except (ConnectionError, httptools.HttpParserError):
                pass
            finally:
                last = link.last
                if last is not None and not link.closed_by_us and not last.closed.is_set():
                    last.closed_at = time.perf_counter()
                    last.closed.set()
                link.lost.set()

        reading = asyncio.ensure_future(read_loop())
        try:
            while True:
                while not parsed.done:
                    if link.lost.is_set():
                        return
                    arrived.clear()
                    await _first(arrived.wait(), link.lost.wait())
                seen = parsed.done.pop(0)
                self.requests.append(seen)
                link.last = seen
                conn = Conn(seen, link)
                await self.behaviour(conn)
                if not conn.keep_open:
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            link.closed_by_us = True
            reading.cancel()
            self._tasks.discard(task)
            writer.close()

    async def _scripted(self, conn: Conn) -> None:
        """Answer one request with the handler's response (see the module docstring)."""
        assert self.handler is not None
        seen, writer, lost = conn.request, conn.writer, conn._link.lost
        host = seen.header("host") or "upstream"
        request = httpx.Request(seen.method, httpx.URL(f"http://{host}{seen.target}"),
                                headers=seen.headers, content=seen.body,
                                extensions={"seen": seen})
        answering = asyncio.ensure_future(self.handler(request))
        await _first(asyncio.shield(answering), lost.wait())
        if not answering.done():  # the proxy went away before the answer: stop the script
            answering.cancel()
            with contextlib.suppress(BaseException):
                await answering
            conn.keep_open = False
            return
        try:
            response = answering.result()
        except ConnectionResetError:
            conn.reset()  # no answer at all
            return
        raw = list(response.headers.raw)
        sized = any(k.lower() == b"content-length" for k, _ in raw)
        framed = not sized and seen.method != "HEAD" and response.status_code not in (204, 304)
        if framed:
            raw.append((b"transfer-encoding", b"chunked"))
        reason = httpx.codes.get_reason_phrase(response.status_code) or "Status"
        head = [f"HTTP/1.1 {response.status_code} {reason}\r\n".encode()]
        head += [k + b": " + v + b"\r\n" for k, v in raw]
        writer.write(b"".join(head) + b"\r\n")
        if any(k.lower() == b"connection" and v.lower() == b"close" for k, v in raw):
            conn.keep_open = False
        gone = asyncio.ensure_future(lost.wait())
        next_chunk: asyncio.Future[bytes] | None = None
        try:
            iterator = response.stream.__aiter__()  # type: ignore[union-attr]
            while True:
                next_chunk = asyncio.ensure_future(iterator.__anext__())
                done, _ = await asyncio.wait({next_chunk, gone},
                                             return_when=asyncio.FIRST_COMPLETED)
                if next_chunk not in done:
                    next_chunk.cancel()
                    with contextlib.suppress(BaseException):
                        await next_chunk
                    conn.keep_open = False  # the proxy went away while the script waited
                    return
                try:
                    chunk = next_chunk.result()
                except StopAsyncIteration:
                    break
                except ConnectionResetError:
                    conn.reset()
                    return
                except Exception:
                    conn.keep_open = False  # end mid-body: closed without the terminator
                    return
                if not chunk:
                    continue
                mark = self.clock.reads if self.clock is not None else 0
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if framed else chunk)
                await writer.drain()
                if self.clock is not None:
                    waiting = asyncio.ensure_future(self.clock.read_after(mark))
                    done, _ = await asyncio.wait({waiting, gone},
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if waiting not in done:
                        waiting.cancel()
                        conn.keep_open = False
                        return
            if framed:
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            gone.cancel()
            if next_chunk is not None:
                # Cancelled (the server closing) while waiting for the script's next chunk:
                # the script is told, and how it ended is not left unretrieved.
                next_chunk.cancel()
                next_chunk.add_done_callback(_retrieved)
            aclose = getattr(response.stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()


class RawUpstream(ScriptedUpstream):
    """``behaviours[model]`` answers requests for that model (the JSON body's
    ``model``); every other request gets :func:`normal`. So one upstream can misbehave
    for the request under test and answer the follow-up "is the proxy still serving?"
    request normally."""

    def __init__(self, behaviours: dict[str, Behaviour] | None = None, *, port: int = 0) -> None:
        self.behaviours: dict[str, Behaviour] = dict(behaviours or {})
        super().__init__(behaviour=self._route, port=port)

    async def _route(self, conn: Conn) -> None:
        await self.behaviours.get(conn.request.model or "", normal)(conn)


@dataclass
class Scheduled:
    """A handler that answers on a known wall-clock schedule, for end-to-end latency tests.

    A streamed chat completion sends the role-only chunk at once, the first content
    token ``ttft`` seconds after the request arrived, then one every ``itl`` seconds, a
    finish chunk, the usage chunk when asked for, and ``[DONE]``; a non-streamed one
    answers after the whole generation time. Time here is the subject of the test, so
    it is the real clock. ``closed`` is set (and ``closed_at`` appended) when the proxy
    closes the request before the end; ``finished`` when a stream was sent whole.
    ``streams`` keeps, per streamed request, when it arrived and when each content token
    was handed on: a loaded machine wakes this handler late, so a test holds the proxy's
    figures against what was sent, the schedule being only when it was due.
    """

    ttft: float = 0.1
    itl: float = 0.02
    tokens: int = 10
    prompt_tokens: int = 7
    cached_tokens: int = 0
    model: str = "sched-model"
    closed: threading.Event = field(default_factory=threading.Event)
    closed_at: list[float] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)
    streams: list[tuple[float, list[float]]] = field(default_factory=list)

    def text(self, i: int) -> str:
        return f"t{i} "

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        t0 = time.perf_counter()
        try:
            payload = json.loads(request.content) if request.content else {}
        except ValueError:
            payload = {}
        if not payload.get("stream"):
            await asyncio.sleep(self.ttft + self.itl * (self.tokens - 1))  # the schedule
            answer = completion_json("x" * self.tokens, model=self.model,
                                     prompt=self.prompt_tokens, completion=self.tokens,
                                     cached=self.cached_tokens)
            return httpx.Response(200, json=answer)
        usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        events = stream_events(self.tokens, usage=usage, model=self.model,
                               prompt=self.prompt_tokens, cached=self.cached_tokens,
                               text=self.text)
        return httpx.Response(200, headers={"content-type": "text/event-stream",
                                            "x-request-id": "req-sched-1"},
                              content=self._body(t0, events))

    async def _body(self, t0: float, events: list[bytes]) -> AsyncIterator[bytes]:
        sent: list[float] = []
        self.streams.append((t0, sent))
        try:
            yield events[0]
            for i, event in enumerate(events[1 : 1 + self.tokens]):
                delay = t0 + self.ttft + i * self.itl - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # the schedule under test, not a wait
                sent.append(time.perf_counter())
                yield event
            yield b"".join(events[1 + self.tokens :])
            self.finished.set()
        finally:
            if not self.finished.is_set():
                self.closed_at.append(time.perf_counter())
                self.closed.set()


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _first(*waits: Awaitable[object]) -> None:
    """Until the first of ``waits`` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN, as a crashed host's kernel would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
