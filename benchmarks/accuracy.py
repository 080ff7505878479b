"""How right are the proxy's numbers? TTFT and ITL error against a known schedule.

Starts a scheduled fake upstream (first token ``--ttft`` after it receives a request,
then one every ``--itl``) and the proxy (``python -m proxy serve --log-requests``) as
separate processes, sends ``--requests`` streams at ``--concurrency``, and compares per
request, matched by ``x-request-id``:

* the proxy's TTFT with the schedule's TTFT (what the upstream intended) and with the
  client's own TTFT (what the app saw, measured through the proxy);
* the proxy's mean and max ITL with the schedule's ITL and the client's gaps.

All processes read ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for the whole
machine). Prints medians and p99 of the differences. Loopback only; bounded.

    python benchmarks/accuracy.py --requests 200 --concurrency 1
    python benchmarks/accuracy.py --requests 400 --concurrency 64
    python benchmarks/accuracy.py --api responses --reasoning 10 --concurrency 64

``--api`` picks the route (chat, completions, responses, messages), each with its own
event sequence: opening events at once, ``--reasoning`` reasoning deltas from TTFT, then
the answer, one output event every ITL; the first answer is scheduled at
TTFT + reasoning x ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

UPSTREAM = r"""
import asyncio, json, sys, time, itertools
API, TTFT, ITL, REASONING, TOKENS = sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
ids = itertools.count()
def data(obj):
    return "data: " + json.dumps(obj) + "\n\n"
def named(name, obj):
    return "event: " + name + "\n" + data({"type": name, **obj})
# Per API: the opening events (sent at once), one output event (reasoning or answer, i-th),
# and the closing events. Reasoning deltas come first, then the answer.
def opening():
    if API == "chat":
        return data({"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    if API == "completions":
        return ""
    if API == "responses":
        r = {"id": "resp_x", "object": "response", "status": "in_progress"}
        return named("response.created", {"response": r, "sequence_number": 0}) + named("response.in_progress", {"response": r, "sequence_number": 1})
    return named("message_start", {"message": {"id": "msg_x", "type": "message", "role": "assistant", "content": [], "usage": {"input_tokens": 5, "output_tokens": 1}}}) + named("ping", {})
def output(i, reasoning):
    if API == "chat":
        key = "reasoning_content" if reasoning else "content"
        return data({"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {key: f"t{i}"}, "finish_reason": None}]})
    if API == "completions":
        return data({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})
    if API == "responses":
        name = "response.reasoning_text.delta" if reasoning else "response.output_text.delta"
        return named(name, {"item_id": "i", "output_index": 0, "content_index": 0, "delta": f"t{i}", "sequence_number": i + 2})
    delta = {"type": "thinking_delta", "thinking": f"t{i}"} if reasoning else {"type": "text_delta", "text": f"t{i}"}
    return named("content_block_delta", {"index": 0 if reasoning else 1, "delta": delta})
def closing():
    n = REASONING + TOKENS
    if API in ("chat", "completions"):
        usage = {"prompt_tokens": 5, "completion_tokens": n}
        return data({"id": "x", "choices": [], "usage": usage}) + "data: [DONE]\n\n"
    if API == "responses":
        usage = {"input_tokens": 5, "output_tokens": n, "output_tokens_details": {"reasoning_tokens": REASONING}}
        return named("response.completed", {"response": {"id": "resp_x", "status": "completed", "usage": usage}, "sequence_number": n + 2})
    return named("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": n}}) + named("message_stop", {})
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            t0 = time.perf_counter()
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            rid = f"acc-{next(ids)}"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\nx-request-id: " + rid.encode() + b"\r\n\r\n")
            def send(text):
                if text:
                    raw = text.encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(raw), raw))
            send(opening())
            for i in range(REASONING + TOKENS):
                delay = t0 + TTFT + i * ITL - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                send(output(i, i < REASONING))
            send(closing())
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "responses": "/v1/responses", "messages": "/v1/messages"}
# What marks an output event in the client's reads (the upstream writes compact JSON
# with a space after ':' (json.dumps), one event per write): reasoning, then answer.
MARKS = {
    "chat": (b'"reasoning_content": "t', b'"content": "t'),
    "completions": (b"\x00", b'"text": "t'),
    "responses": (b'"response.reasoning_text.delta", ', b'"response.output_text.delta", '),
    "messages": (b'"thinking_delta", ', b'"text_delta", '),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise TimeoutError(url)


async def one(client: httpx.AsyncClient, url: str, api: str) -> dict[str, object]:
    body = {"model": "acc", "stream": True, "messages": [{"role": "user", "content": "x"}],
            "prompt": "x", "input": "x", "max_tokens": 64}
    reasoning_mark, answer_mark = MARKS[api]
    start = time.perf_counter()
    stamps: list[float] = []
    first_answer: float | None = None
    async with client.stream("POST", url, json=body) as response:
        rid = response.headers["x-request-id"]
        async for raw in response.aiter_raw():
            t = time.perf_counter()
            answers = raw.count(answer_mark)
            if answers and first_answer is None:
                first_answer = t
            stamps.extend(t for _ in range(raw.count(reasoning_mark) + answers))
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"id": rid, "ttft": stamps[0] - start, "ttfa": (first_answer or start) - start,
            "gaps": gaps}


async def drive(url: str, requests: int, concurrency: int, api: str) -> list[dict[str, object]]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[dict[str, object]] = []
    queue = list(range(requests))
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def worker() -> None:
            while queue:
                queue.pop()
                results.append(await one(client, url, api))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--ttft", type=float, default=0.2)
    parser.add_argument("--itl", type=float, default=0.02)
    parser.add_argument("--tokens", type=int, default=20, help="answer tokens")
    parser.add_argument("--reasoning", type=int, default=0,
                        help="reasoning deltas before the answer (not for completions)")
    parser.add_argument("--api", choices=sorted(ROUTES), default="chat")
    args = parser.parse_args()
    if args.api == "completions":
        args.reasoning = 0

    up_port, proxy_port = free_port(), free_port()
    workdir = Path(tempfile.mkdtemp(prefix="accuracy-"))
    log_file = workdir / "requests.jsonl"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                UPSTREAM,
                str(up_port),
                args.api,
                str(args.ttft),
                str(args.itl),
                str(args.reasoning),
                str(args.tokens),
            ],
            stdout=subprocess.PIPE,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--upstream",
                f"http://127.0.0.1:{up_port}/v1",
                "--port",
                str(proxy_port),
                "--log-requests",
                str(log_file),
            ],
            stderr=subprocess.DEVNULL,
            env={**os.environ},
        ),
    ]
    try:
        assert procs[0].stdout is not None
        procs[0].stdout.readline()
        wait_for(f"http://127.0.0.1:{proxy_port}/healthz")
        results = asyncio.run(
            drive(
                f"http://127.0.0.1:{proxy_port}{ROUTES[args.api]}",
                args.requests,
                args.concurrency,
                args.api,
            )
        )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    logged = {}
    for line in log_file.read_text().splitlines():
        record = json.loads(line)
        logged[record["request_id"]] = record
    answer_at = args.ttft + args.reasoning * args.itl
    ttft_vs_schedule, ttft_vs_client, itl_vs_schedule, itl_vs_client = [], [], [], []
    ttfa_vs_schedule, ttfa_vs_client, itl_count_error = [], [], []
    for r in results:
        rec = logged[str(r["id"])]
        gaps = r["gaps"]
        assert isinstance(gaps, list)
        ttft_vs_schedule.append(rec["ttft_s"] - args.ttft)
        ttft_vs_client.append(float(r["ttft"]) - rec["ttft_s"])  # type: ignore[arg-type]
        ttfa_vs_schedule.append(rec["ttfa_s"] - answer_at)
        ttfa_vs_client.append(float(r["ttfa"]) - rec["ttfa_s"])  # type: ignore[arg-type]
        itl_vs_schedule.append(rec["itl_mean_s"] - args.itl)
        itl_vs_client.append(statistics.fmean(gaps) - rec["itl_mean_s"])
        itl_count_error.append(float(rec["itl_count"] - (args.reasoning + args.tokens - 1)))
    print(
        f"accuracy: {args.api} ({ROUTES[args.api]}), {len(results)} streams, concurrency "
        f"{args.concurrency}, schedule TTFT {args.ttft * 1000:.0f} ms, first answer "
        f"{answer_at * 1000:.0f} ms, ITL {args.itl * 1000:.0f} ms, {args.reasoning} reasoning "
        f"+ {args.tokens} answer tokens"
    )
    print(f"  ITL observations per stream - scheduled gaps: max {max(itl_count_error):+.0f}, "
          f"min {min(itl_count_error):+.0f}")
    for name, values in (
        ("proxy TTFT - scheduled TTFT", ttft_vs_schedule),
        ("client TTFT - proxy TTFT", ttft_vs_client),
        ("proxy first answer - scheduled", ttfa_vs_schedule),
        ("client first answer - proxy", ttfa_vs_client),
        ("proxy mean ITL - scheduled ITL", itl_vs_schedule),
        ("client mean ITL - proxy mean ITL", itl_vs_client),
    ):
        print(
            f"  {name:34s} median {statistics.median(values) * 1000:+.3f} ms   "
            f"p99 {pct(values, 0.99) * 1000:+.3f} ms   max {max(values) * 1000:+.3f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
