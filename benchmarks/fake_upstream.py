"""A fast fake upstream with a fixed schedule, for benchmarks only.

Why not the simulator: a benchmark's upstream must never be the bottleneck, so this is a
raw asyncio ``Protocol`` server (uvloop when installed) that writes pre-encoded bytes on
an absolute timetable. Every streamed response follows the same schedule:

* headers and the events before the first token immediately (chat: a role-only chunk,
  which is not a token);
* the first token ``ttft`` seconds after the request was read, then one token every
  ``itl`` seconds, computed from the start time so timer jitter never accumulates;
* the closing events. Chat Completions: a finish chunk, then a usage chunk (only when
  the request asked with ``stream_options.include_usage``, as OpenAI does), then
  ``data: [DONE]``.

Three APIs, each streamed the way its service streams it, one ``event: NAME`` /
``data: JSON`` pair per event for the last two:

* ``POST .../chat/completions`` (and ``.../completions``): the chat chunks above;
  ``max_tokens`` sets the number of tokens.
* ``POST .../responses`` (OpenAI Responses): ``response.created``,
  ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, one ``response.output_text.delta`` per token, the
  ``.done`` events, ``response.completed`` with ``usage``; ``max_output_tokens`` sets
  the number of tokens.
* ``POST .../messages`` (Anthropic Messages): ``message_start`` with usage,
  ``content_block_start``, ``ping``, one ``content_block_delta`` (``text_delta``) per
  token, ``content_block_stop``, ``message_delta`` with ``usage.output_tokens``,
  ``message_stop``; ``max_tokens`` sets the number of tokens.

Without a token count in the request, ``--tokens``. Every token's text contains
``TOKEN_MARK`` so a client can count chat tokens with a byte scan whatever JSON
formatting a proxy in between uses.

Each SSE event is written as its own HTTP/1.1 chunk (``Transfer-Encoding: chunked``).
Connections are kept alive, so load clients can measure both new and reused
connections; with ``--close`` every response carries ``Connection: close`` and the
server closes the connection after it, as HTTP/1.0-style servers and some load
balancers do, so a proxy in front opens a new upstream connection per request.

Run: ``python benchmarks/fake_upstream.py --port 0`` prints ``LISTENING <port>`` on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

TOKEN_MARK = b"~t~"
MODEL = "bench"


@dataclass(frozen=True)
class Schedule:
    """The fixed timetable every streamed response follows."""

    ttft: float = 0.05
    itl: float = 0.02
    tokens: int = 50


def _chunk(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk holding ``payload``."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk_obj(delta: dict[str, object], finish: str | None = None) -> dict[str, object]:
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


# Pre-encoded wire bytes: the hot loop only writes these.
HEAD_STREAM = (
    b"HTTP/1.1 200 OK\r\n"
    b"content-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n"
)
ROLE = _chunk(_event(_chunk_obj({"role": "assistant", "content": ""})))
TOKEN = _chunk(_event(_chunk_obj({"content": " " + TOKEN_MARK.decode()})))
FINISH = _chunk(_event(_chunk_obj({}, "stop")))
DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def _usage(prompt: int, completion: int) -> bytes:
    obj = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    return _chunk(_event(obj))


def _plain(status: str, body: bytes, close: bool) -> bytes:
    conn = b"connection: close\r\n" if close else b""
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status.encode(),
        len(body),
        conn,
        body,
    )


def _named(name: str, obj: object) -> bytes:
    """One HTTP chunk holding one named SSE event (Responses and Messages streams)."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _chunk(b"event: " + name.encode() + b"\ndata: " + data + b"\n\n")


TOKEN_TEXT = " " + TOKEN_MARK.decode()
PROMPT_TOKENS = 8
RESPONSE_ID, ITEM_ID = "resp_bench", "msg_bench"


@dataclass(frozen=True)
class Stream:
    """One streamed response of a named-event API: the events before the first token,
    the token event for each index, the events after the last token."""

    before: bytes
    token: Callable[[int], bytes]
    after: bytes


def _response_obj(status: str, output: list[object], usage: object) -> dict[str, object]:
    return {
        "id": RESPONSE_ID,
        "object": "response",
        "created_at": 0,
        "status": status,
        "model": MODEL,
        "output": output,
        "usage": usage,
    }


def _message_item(status: str, content: list[object]) -> dict[str, object]:
    return {
        "id": ITEM_ID,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _responses_usage(tokens: int) -> dict[str, object]:
    return {
        "input_tokens": PROMPT_TOKENS,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": PROMPT_TOKENS + tokens,
    }


@functools.lru_cache(maxsize=8192)
def _responses_delta(seq: int) -> bytes:
    """The ``response.output_text.delta`` event with sequence number ``seq``."""
    return _named(
        "response.output_text.delta",
        {
            "type": "response.output_text.delta",
            "item_id": ITEM_ID,
            "output_index": 0,
            "content_index": 0,
            "delta": TOKEN_TEXT,
            "sequence_number": seq,
        },
    )


@functools.lru_cache(maxsize=256)
def responses_stream(tokens: int) -> Stream:
    """An OpenAI Responses stream of ``tokens`` text deltas."""
    text = TOKEN_TEXT * tokens
    part: dict[str, object] = {"type": "output_text", "text": text, "annotations": []}
    item = _message_item("completed", [part])
    where = {"item_id": ITEM_ID, "output_index": 0, "content_index": 0}
    before = [
        ("response.created", {"response": _response_obj("in_progress", [], None)}),
        ("response.in_progress", {"response": _response_obj("in_progress", [], None)}),
        (
            "response.output_item.added",
            {"output_index": 0, "item": _message_item("in_progress", [])},
        ),
        (
            "response.content_part.added",
            where | {"part": {"type": "output_text", "text": "", "annotations": []}},
        ),
    ]
    after = [
        ("response.output_text.done", where | {"text": text}),
        ("response.content_part.done", where | {"part": part}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        (
            "response.completed",
            {"response": _response_obj("completed", [item], _responses_usage(tokens))},
        ),
    ]
    first = len(before)

    def encode(events: list[tuple[str, dict[str, object]]], seq: int) -> bytes:
        return b"".join(
            _named(name, {"type": name} | obj | {"sequence_number": seq + i})
            for i, (name, obj) in enumerate(events)
        )

    return Stream(
        encode(before, 0),
        lambda i: _responses_delta(first + i),
        encode(after, first + tokens),
    )


MESSAGES_DELTA = _named(
    "content_block_delta",
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": TOKEN_TEXT},
    },
)


def _messages_token(_: int) -> bytes:
    return MESSAGES_DELTA


@functools.lru_cache(maxsize=256)
def messages_stream(tokens: int) -> Stream:
    """An Anthropic Messages stream of ``tokens`` text deltas."""
    message = {
        "id": ITEM_ID,
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": 1},
    }
    before = (
        _named("message_start", {"type": "message_start", "message": message})
        + _named(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        )
        + _named("ping", {"type": "ping"})
    )
    after = (
        _named("content_block_stop", {"type": "content_block_stop", "index": 0})
        + _named(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": tokens},
            },
        )
        + _named("message_stop", {"type": "message_stop"})
    )
    return Stream(before, _messages_token, after)


def responses_body(tokens: int) -> dict[str, object]:
    """The non-streamed Responses answer."""
    part = {"type": "output_text", "text": TOKEN_TEXT * tokens, "annotations": []}
    return _response_obj(
        "completed", [_message_item("completed", [part])], _responses_usage(tokens)
    )


def messages_body(tokens: int) -> dict[str, object]:
    """The non-streamed Messages answer."""
    return {
        "id": ITEM_ID,
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": TOKEN_TEXT * tokens}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": tokens},
    }


@dataclass(frozen=True)
class NamedEventAPI:
    """An API whose stream is named events: the request field holding the token count,
    the streamed answer and the whole one, both by token count."""

    tokens_field: str
    stream: Callable[[int], Stream]
    body: Callable[[int], dict[str, object]]


NAMED_EVENT_APIS = {
    "/responses": NamedEventAPI("max_output_tokens", responses_stream, responses_body),
    "/messages": NamedEventAPI("max_tokens", messages_stream, messages_body),
}


class UpstreamProtocol(asyncio.Protocol):
    """One client connection: read a request, answer it, repeat (keep-alive); with
    ``close_all``, answer one request with ``Connection: close`` and close."""

    def __init__(self, schedule: Schedule, stats: dict[str, int], close_all: bool = False) -> None:
        self.schedule = schedule
        self.stats = stats
        self.close_all = close_all
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.stats["connections"] += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._try_request()

    def _try_request(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1")
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0") or 0)
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4 : end + 4 + length]
        self.buf = self.buf[end + 4 + length :]
        close = self.close_all or headers.get("connection", "").lower() == "close"
        self.busy = True
        self.task = asyncio.get_running_loop().create_task(
            self._respond(method, target, body, close)
        )

    async def _respond(self, method: str, target: str, body: bytes, close: bool) -> None:
        t = self.transport
        try:
            path = target.split("?", 1)[0]
            if method == "GET" and path.endswith("/models"):
                data = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                t and t.write(_plain("200 OK", data.encode(), close))
            elif method == "GET":
                t and t.write(_plain("200 OK", b'{"status":"ok"}', close))
            elif method == "POST" and path.endswith(("/chat/completions", "/completions")):
                await self._completion(body, close)
            elif method == "POST" and path.endswith(("/responses", "/messages")):
                await self._named_events(NAMED_EVENT_APIS[path[path.rfind("/") :]], body, close)
            else:
                t and t.write(_plain("404 Not Found", b'{"error":{"message":"not found"}}', close))
        finally:
            self.busy = False
            self.task = None
        if close:
            if self.transport is not None:
                self.transport.close()
        elif self.buf:
            self._try_request()

    async def _completion(self, body: bytes, close: bool) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            req = {}
        s = self.schedule
        tokens = int(req.get("max_tokens") or s.tokens)
        self.stats["requests"] += 1
        if not req.get("stream"):
            await asyncio.sleep(s.ttft + s.itl * (tokens - 1))
            msg = {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": 0,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {
                            "role": "assistant",
                            "content": (" " + TOKEN_MARK.decode()) * tokens,
                        },
                    }
                ],
                "usage": {
                    "prompt_tokens": 8,
                    "completion_tokens": tokens,
                    "total_tokens": 8 + tokens,
                },
            }
            if self.transport is not None:
                self.transport.write(_plain("200 OK", json.dumps(msg).encode(), close))
            return
        usage = bool((req.get("stream_options") or {}).get("include_usage"))
        head = HEAD_STREAM + (b"connection: close\r\n\r\n" if close else b"\r\n")
        t = self.transport
        if t is None:
            return
        t.write(head + ROLE)
        first = start + s.ttft
        for i in range(tokens):
            delay = first + i * s.itl - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.transport is None:
                self.stats["aborted"] += 1
                return
            t.write(TOKEN)
        self.stats["events"] += tokens
        tail = FINISH + (_usage(8, tokens) if usage else b"") + DONE
        t.write(tail)
        self.stats["completed"] += 1

    async def _named_events(self, api: NamedEventAPI, body: bytes, close: bool) -> None:
        """A Responses or Messages answer on the same schedule as ``_completion``."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            req = {}
        s = self.schedule
        tokens = int(req.get(api.tokens_field) or s.tokens)
        self.stats["requests"] += 1
        if not req.get("stream"):
            await asyncio.sleep(s.ttft + s.itl * (tokens - 1))
            if self.transport is not None:
                self.transport.write(_plain("200 OK", json.dumps(api.body(tokens)).encode(), close))
            return
        events = api.stream(tokens)
        t = self.transport
        if t is None:
            return
        t.write(HEAD_STREAM + (b"connection: close\r\n\r\n" if close else b"\r\n") + events.before)
        token = events.token
        first = start + s.ttft
        for i in range(tokens):
            delay = first + i * s.itl - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.transport is None:
                self.stats["aborted"] += 1
                return
            t.write(token(i))
        self.stats["events"] += tokens
        t.write(events.after + b"0\r\n\r\n")
        self.stats["completed"] += 1


async def serve(
    host: str,
    port: int,
    schedule: Schedule,
    ready: asyncio.Event | None = None,
    port_out: list[int] | None = None,
    stop: asyncio.Event | None = None,
    stats: dict[str, int] | None = None,
    *,
    close: bool = False,
) -> None:
    """Serve until ``stop`` is set (or forever). ``port_out`` receives the bound port;
    ``stats`` (connections, requests, completed, aborted, events) is updated live;
    ``close``: close the connection after every response."""
    loop = asyncio.get_running_loop()
    if stats is None:
        stats = {}
    for key in ("connections", "requests", "completed", "aborted", "events"):
        stats.setdefault(key, 0)
    server = await loop.create_server(
        lambda: UpstreamProtocol(schedule, stats, close),
        host,
        port,
        backlog=4096,
        reuse_address=True,
    )
    bound = server.sockets[0].getsockname()[1]
    if port_out is not None:
        port_out.append(bound)
    if ready is not None:
        ready.set()
    stop = stop or asyncio.Event()
    try:
        await stop.wait()
    finally:
        server.close()
        if hasattr(server, "close_clients"):
            server.close_clients()


def run_loop(coro: Coroutine[Any, Any, T], *, uvloop_ok: bool = True) -> T:
    """Run ``coro`` on uvloop when installed (as the servers under test do), else asyncio."""
    if uvloop_ok:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft", type=float, default=Schedule.ttft, help="seconds to first token")
    p.add_argument("--itl", type=float, default=Schedule.itl, help="seconds between tokens")
    p.add_argument("--tokens", type=int, default=Schedule.tokens, help="tokens per response")
    p.add_argument(
        "--close",
        action="store_true",
        help="send Connection: close and close the connection after every response",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=3600.0,
        help="exit by itself after this long (runs are always bounded)",
    )
    p.add_argument("--no-uvloop", action="store_true")
    a = p.parse_args(argv)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.call_later(a.max_seconds, stop.set)
        ports: list[int] = []
        ready = asyncio.Event()
        task = asyncio.create_task(
            serve(
                a.host,
                a.port,
                Schedule(a.ttft, a.itl, a.tokens),
                ready,
                ports,
                stop,
                close=a.close,
            )
        )
        await ready.wait()
        mode = " close" if a.close else ""
        sys.stdout.write(f"LISTENING {ports[0]} pid={os.getpid()}{mode}\n")
        sys.stdout.flush()
        await task

    run_loop(run(), uvloop_ok=not a.no_uvloop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
