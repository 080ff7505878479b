"""A light streaming load client: client-side TTFT and every inter-token gap, per stream.

Why not wrk/hey/httpx: none of them times individual SSE events, and a heavy client
would share the 2 cores with the system under test and distort what it measures. This
is a raw asyncio ``Protocol`` client (uvloop when installed) that:

* reads ``time.perf_counter()`` once per received chunk of bytes (``data_received``);
* decodes HTTP/1.1 chunked transfer encoding (uvicorn, nginx), ``Content-Length`` or
  close-delimited bodies, without copying more than the current read;
* counts tokens with a byte scan, events by ``data:`` and the end by the API's last
  event; nothing is JSON-decoded. Per ``--api``: ``chat`` (Chat Completions) counts the
  fake upstream's token mark (so any JSON re-serialisation by a proxy in between still
  counts) and ends with ``[DONE]``; ``responses`` (OpenAI Responses) counts
  ``response.output_text.delta`` events and ends with ``response.completed``;
  ``messages`` (Anthropic Messages) counts ``content_block_delta`` events and ends with
  ``message_stop``. The event types are matched as quoted JSON strings, so the
  ``event:`` lines and the final events that repeat the whole text are not counted;
* runs ``concurrency`` users, each doing one stream after another, either on a new TCP
  connection per stream (connect time is inside TTFT) or on one kept-alive connection,
  which is given up when the server answers ``Connection: close``.
  Users start staggered over one stream's length so the load is steady, not a burst;
* sends, with ``--prompt-bytes``, one prompt every stream repeats or (``--prompt-shape
  varied``) one system prompt and a question of each stream's own.

TTFT is from just before connect/write to the first read that holds a token; gaps are
between reads holding tokens (tokens that arrive in the same read add gaps of 0, which is
what a client sees). A stream is broken unless it has status 200, exactly the expected
tokens, the API's last event and a complete body.

Every run is bounded: ``--duration`` (plus at most ``--stream-timeout`` to finish the
streams in flight) and optionally ``--streams`` per user. Output: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

try:  # run as a script or imported as benchmarks.loadgen
    from fake_upstream import TOKEN_MARK, run_loop  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - import path depends on how we are run
    from benchmarks.fake_upstream import TOKEN_MARK, run_loop

DATA = b"data:"
perf_counter = time.perf_counter


@dataclass(frozen=True)
class API:
    """What a stream of one API looks like to the byte scan, and where to send it."""

    path: str  # after the base URL
    token: bytes  # once per token event
    end: bytes  # once, in the last event
    end_name: str  # for the error message


APIS = {
    "chat": API("/chat/completions", TOKEN_MARK, b"[DONE]", "[DONE]"),
    "responses": API(
        "/responses",
        b'"response.output_text.delta"',
        b'"response.completed"',
        "response.completed",
    ),
    "messages": API("/messages", b'"content_block_delta"', b'"message_stop"', "message_stop"),
}


@dataclass
class StreamResult:
    """What one stream looked like from the client."""

    t_start: float
    ok: bool = False
    error: str = ""
    status: int = 0
    ttft: float = math.nan
    tokens: int = 0
    events: int = 0
    gaps: list[float] = field(default_factory=list)


class _Conn(asyncio.Protocol):
    """One HTTP/1.1 connection; one request in flight at a time (no pipelining)."""

    __slots__ = (
        "_last",
        "_res",
        "ccarry",
        "chunked",
        "clen",
        "close_delim",
        "crem",
        "done",
        "done_seen",
        "end_name",
        "fut",
        "hbuf",
        "in_head",
        "keep",
        "mark",
        "need_crlf",
        "reusable",
        "tail",
        "transport",
    )

    def __init__(self, api: API = APIS["chat"]) -> None:
        self.transport: asyncio.Transport | None = None
        self.fut: asyncio.Future[None] | None = None
        self._res: StreamResult | None = None
        self.mark, self.done, self.end_name = api.token, api.end, api.end_name
        # bytes kept from the previous read, so a mark split between reads is found
        self.keep = max(8, len(api.token), len(api.end))
        self.reusable = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        res = self._res
        if res is not None and self.fut is not None and not self.fut.done():
            if self.close_delim and self.done_seen:
                self._finish(True, "")
            else:
                self._finish(False, "connection lost" + (f": {exc}" if exc else ""))

    def start(self, request: bytes, res: StreamResult) -> asyncio.Future[None]:
        self._res = res
        self.hbuf = b""
        self.in_head = True
        self.tail = b""
        self.ccarry = b""
        self.crem = 0
        self.need_crlf = 0
        self.chunked = False
        self.clen = -1
        self.close_delim = False
        self.done_seen = False
        self.reusable = True
        self._last = 0.0
        self.fut = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(request)
        return self.fut

    def _finish(self, ok: bool, error: str) -> None:
        res = self._res
        assert res is not None and self.fut is not None
        res.ok = ok
        res.error = error
        self._res = None
        if not self.fut.done():
            self.fut.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = perf_counter()
        res = self._res
        if res is None:
            return  # bytes after a finished response: ignore (nothing is pipelined)
        if self.in_head:
            self.hbuf += data
            buf = self.hbuf.lstrip(b"\r\n")  # tolerate the last CRLF of a previous body
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = buf[:end].split(b"\r\n")
            try:
                res.status = int(lines[0].split(b" ", 2)[1])
            except (IndexError, ValueError):
                self._finish(False, "bad status line")
                return
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"transfer-encoding" and b"chunked" in value.lower():
                    self.chunked = True
                elif name == b"content-length":
                    self.clen = int(value)
                elif name == b"connection" and b"close" in value.lower():
                    self.reusable = False
            self.close_delim = not self.chunked and self.clen < 0
            self.in_head = False
            data = buf[end + 4 :]
            if not data and self.clen != 0:
                return
        if self.chunked:
            payload, complete = self._dechunk(data)
        elif self.clen >= 0:
            payload = data[: self.clen]
            self.clen -= len(payload)
            complete = self.clen == 0
        else:
            payload, complete = data, False
        if payload:
            tail = self.tail
            mark = self.mark
            buf = tail + payload if tail else payload
            n = buf.count(mark) - (tail.count(mark) if tail else 0)
            res.events += buf.count(DATA) - (tail.count(DATA) if tail else 0)
            if not self.done_seen and self.done in buf:
                self.done_seen = True
            self.tail = buf[-self.keep :]
            if n:
                if res.tokens == 0:
                    res.ttft = now - res.t_start
                else:
                    res.gaps.append(now - self._last)
                if n > 1:
                    res.gaps.extend([0.0] * (n - 1))
                res.tokens += n
                self._last = now
        if complete:
            if res.status != 200:
                self._finish(False, f"http {res.status}")
            elif not self.done_seen:
                self._finish(False, "no " + self.end_name)
            else:
                self._finish(True, "")

    def _dechunk(self, data: bytes) -> tuple[bytes, bool]:
        """Strip chunked framing from ``data``; report whether the last chunk arrived."""
        if self.ccarry:
            data = self.ccarry + data
            self.ccarry = b""
        out: list[bytes] = []
        pos, end = 0, len(data)
        while pos < end:
            if self.crem:
                take = min(self.crem, end - pos)
                out.append(data[pos : pos + take])
                pos += take
                self.crem -= take
                if not self.crem:
                    self.need_crlf = 2
            elif self.need_crlf:
                skip = min(self.need_crlf, end - pos)
                pos += skip
                self.need_crlf -= skip
            else:
                nl = data.find(b"\r\n", pos)
                if nl < 0:
                    self.ccarry = data[pos:]
                    break
                size = int(data[pos:nl].split(b";", 1)[0], 16)
                pos = nl + 2
                if size == 0:
                    return b"".join(out), True
                self.crem = size
        if len(out) == 1:
            return out[0], False
        return b"".join(out), False


@dataclass
class LoadConfig:
    """One load: who to hit, how hard and for how long."""

    url: str  # base URL, e.g. http://127.0.0.1:8080/v1
    concurrency: int = 64
    duration: float = 8.0
    warmup: float = 1.0
    tokens: int = 50
    keepalive: bool = True
    streams: int = 0  # per user; 0: until duration
    stagger: float = 1.0  # seconds over which user starts are spread
    stream_timeout: float = 30.0
    include_usage: bool = True
    headers: tuple[str, ...] = ()
    model: str = "bench"
    api: str = "chat"  # chat | responses | messages
    prompt_bytes: int = 0  # the user message's size; 0: "benchmark"
    prompt_shape: str = "repeated"  # repeated | varied (see PROMPT_SHAPES)
    pause: float = 0.0  # seconds each user waits before each of its streams (sparse traffic)


PROMPT_SHAPES = {
    "repeated": "one user message of --prompt-bytes, the same for every stream",
    "varied": "a system message of --prompt-bytes, the same for every stream, and a short "
    "user question that no other stream of the run asks (a numbered one)",
}
QUESTION = "Question {:08d}: what does the text above say about alpha?"  # a varied tail
_ASKED = QUESTION.split("{")[0].encode()  # what precedes the question's number
_NUMBER = b"%08d"  # the number, written in place in the request's bytes (same length)


def add_prompt_shape(parser: argparse.ArgumentParser) -> None:
    """``--prompt-shape``, as every benchmark that sends prompts takes it."""
    parser.add_argument(
        "--prompt-shape",
        choices=sorted(PROMPT_SHAPES),
        default="repeated",
        help="; ".join(f"{k}: {v}" for k, v in PROMPT_SHAPES.items()),
    )


def chat_messages(prompt: str, shape: str, n: int = 0) -> list[dict[str, str]]:
    """A chat request's messages for ``prompt`` in ``shape`` (``varied``: question ``n``)."""
    if shape == "varied":
        return [
            {"role": "system", "content": prompt},
            {"role": "user", "content": QUESTION.format(n)},
        ]
    return [{"role": "user", "content": prompt}]


def prompt_text(size: int) -> str:
    """``size`` bytes of words, the same for every stream of a run (a repeated prompt:
    the prompt-cache doctor's common case, every block a hit)."""
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
    text = " ".join(f"{words[i % len(words)]}{i % 97}" for i in range(size // 6 + 1))
    return text[:size]


def _request_bytes(cfg: LoadConfig) -> tuple[str, int, bytes]:
    parts = urlsplit(cfg.url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    path = parts.path.rstrip("/") + APIS[cfg.api].path
    body: dict[str, Any] = {"model": cfg.model, "stream": True}
    headers = list(cfg.headers)
    prompt = prompt_text(cfg.prompt_bytes) if cfg.prompt_bytes else "benchmark"
    if cfg.prompt_shape == "varied":
        question = QUESTION.format(0)
        if cfg.api == "responses":
            body |= {"instructions": prompt, "input": question}
        elif cfg.api == "messages":
            body |= {"system": prompt, "messages": [{"role": "user", "content": question}]}
        else:
            body["messages"] = chat_messages(prompt, cfg.prompt_shape)
    elif cfg.api == "responses":
        body["input"] = prompt
    else:
        body["messages"] = chat_messages(prompt, cfg.prompt_shape)
    body["max_output_tokens" if cfg.api == "responses" else "max_tokens"] = cfg.tokens
    if cfg.api == "messages":
        headers.append("anthropic-version: 2023-06-01")
    elif cfg.api == "chat" and cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    raw = json.dumps(body).encode()
    extra = "".join(f"{h}\r\n" for h in headers)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(raw)}\r\n{extra}"
    )
    if not cfg.keepalive:
        head += "Connection: close\r\n"
    return host, port, head.encode() + b"\r\n" + raw


def request_source(cfg: LoadConfig) -> tuple[str, int, Callable[[], bytes]]:
    """Where to send, and what gives each stream's request bytes: the same bytes every
    time, or for ``varied`` prompts the next question's number written into them."""
    host, port, request = _request_bytes(cfg)
    if cfg.prompt_shape != "varied":
        return host, port, lambda: request
    at = request.rfind(_ASKED) + len(_ASKED)
    numbers = itertools.count(random.randrange(10**8))  # no round repeats another's

    def numbered() -> bytes:
        return request[:at] + _NUMBER % (next(numbers) % 10**8) + request[at + 8 :]

    return host, port, numbered


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile of ``values`` (``q`` in 0..100); NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(
    results: list[StreamResult], cfg: LoadConfig, wall: float, cpu: float, warm: list[StreamResult]
) -> dict[str, Any]:
    """Aggregate per-stream results into one JSON-able report (seconds unless _ms)."""
    counted_warmup = not results and bool(warm)
    if counted_warmup:  # overloaded: no stream started after the warm-up; count them all
        results, warm = warm, []
    ok = [r for r in results if r.ok and r.tokens == cfg.tokens]
    broken = [r for r in results if not (r.ok and r.tokens == cfg.tokens)]
    ttfts = [r.ttft for r in ok]
    gaps = [g for r in ok for g in r.gaps]
    errors = Counter(r.error or f"tokens {r.tokens} != {cfg.tokens}" for r in broken)
    events = sum(r.events for r in results)
    warm_events = sum(r.events for r in warm)

    def pct(vals: list[float]) -> dict[str, float]:
        return {f"p{q}": percentile(vals, q) * 1000 for q in (50, 90, 99)} | {
            "max": max(vals) * 1000 if vals else math.nan,
            "n": len(vals),
        }

    return {
        "config": asdict(cfg) | {"headers": len(cfg.headers)},
        "streams": len(results),
        "ok": len(ok),
        "broken": len(broken),
        "errors": dict(errors),
        "warmup_streams": len(warm),
        "counted_warmup": counted_warmup,
        "warmup_broken": sum(1 for r in warm if not (r.ok and r.tokens == cfg.tokens)),
        "tokens": sum(r.tokens for r in results),
        "events": events,
        "events_all": events + warm_events,
        "ttft_ms": pct(ttfts),
        "itl_ms": pct(gaps),
        "wall_s": wall,
        "client_cpu_s": cpu,
        "client_cpu_us_per_event": cpu / events * 1e6 if events else math.nan,
    }


async def run_load(cfg: LoadConfig) -> dict[str, Any]:
    """Run one load and return its summary; always ends within duration + stream_timeout."""
    loop = asyncio.get_running_loop()
    host, port, next_request = request_source(cfg)
    results: list[StreamResult] = []
    warm: list[StreamResult] = []
    cpu0 = time.process_time()
    t0 = perf_counter()
    warm_end = t0 + cfg.warmup
    deadline = t0 + cfg.duration
    step = cfg.stagger / max(cfg.concurrency, 1)
    protocol = functools.partial(_Conn, APIS[cfg.api])

    async def one(conn: _Conn | None) -> tuple[_Conn | None, StreamResult]:
        res = StreamResult(t_start=perf_counter())
        try:
            if conn is None or conn.transport is None:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(protocol, host, port), cfg.stream_timeout
                )
            await asyncio.wait_for(conn.start(next_request(), res), cfg.stream_timeout)
        except (TimeoutError, OSError) as exc:
            res.ok = False
            res.error = type(exc).__name__
            if conn is not None and conn.transport is not None:
                conn.transport.abort()
            conn = None
        return conn, res

    async def user(i: int) -> None:
        await asyncio.sleep(i * step)
        conn: _Conn | None = None
        done = 0
        while perf_counter() < deadline and (not cfg.streams or done < cfg.streams):
            if cfg.pause:
                await asyncio.sleep(cfg.pause)
                if perf_counter() >= deadline:
                    break
            conn, res = await one(conn)
            done += 1
            (results if res.t_start >= warm_end else warm).append(res)
            if not res.ok or not cfg.keepalive or (conn is not None and not conn.reusable):
                if conn is not None and conn.transport is not None:
                    conn.transport.close()
                conn = None
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    await asyncio.gather(*(user(i) for i in range(cfg.concurrency)))
    wall = perf_counter() - t0
    cpu = time.process_time() - cpu0
    return summarize(results, cfg, wall, cpu, warm)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--concurrency", "-c", type=int, default=64)
    p.add_argument("--duration", type=float, default=8.0, help="seconds of load")
    p.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="streams started in the first seconds are not counted",
    )
    p.add_argument("--tokens", type=int, default=50, help="tokens per stream (max_tokens)")
    p.add_argument(
        "--new-connections",
        action="store_true",
        help="a new TCP connection per stream (default: keep-alive)",
    )
    p.add_argument("--streams", type=int, default=0, help="streams per user (0: until duration)")
    p.add_argument(
        "--stagger", type=float, default=1.0, help="spread user starts over this many seconds"
    )
    p.add_argument("--stream-timeout", type=float, default=30.0)
    p.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds each user waits before each stream: sparse traffic, whose pooled "
        "connections have expired",
    )
    p.add_argument("--api", choices=sorted(APIS), default="chat", help="which API to stream")
    p.add_argument("--no-usage", action="store_true", help="do not ask for the usage chunk (chat)")
    p.add_argument(
        "--prompt-bytes",
        type=int,
        default=0,
        help="a prompt of this many bytes, the same for every stream (0: 'benchmark')",
    )
    add_prompt_shape(p)
    p.add_argument("--header", action="append", default=[], help="extra 'Name: value'")
    p.add_argument(
        "--bearer-env",
        default="",
        help="send 'Authorization: Bearer $VAR' (the key stays out of argv)",
    )
    a = p.parse_args(argv)
    if a.bearer_env:
        a.header.append(f"Authorization: Bearer {os.environ[a.bearer_env]}")
    cfg = LoadConfig(
        url=a.url,
        concurrency=a.concurrency,
        duration=a.duration,
        warmup=a.warmup,
        tokens=a.tokens,
        keepalive=not a.new_connections,
        streams=a.streams,
        stagger=a.stagger,
        stream_timeout=a.stream_timeout,
        include_usage=not a.no_usage,
        headers=tuple(a.header),
        api=a.api,
        prompt_bytes=a.prompt_bytes,
        prompt_shape=a.prompt_shape,
        pause=a.pause,
    )
    out = run_loop(run_load(cfg))
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
