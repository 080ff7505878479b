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
TTFT, ITL, TOKENS = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
ids = itertools.count()
def chunk(delta, finish=None):
    return ("data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n").encode()
USAGE = ("data: " + json.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": 5,
         "completion_tokens": TOKENS}}) + "\n\n").encode()
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
            def send(data):
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            send(chunk({"role": "assistant", "content": ""}))
            for i in range(TOKENS):
                delay = t0 + TTFT + i * ITL - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                send(chunk({"content": f"t{i}"}))
            send(chunk({}, "stop") + USAGE + b"data: [DONE]\n\n")
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


async def one(client: httpx.AsyncClient, url: str) -> dict[str, object]:
    body = {"model": "acc", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", url, json=body) as response:
        rid = response.headers["x-request-id"]
        async for raw in response.aiter_raw():
            t = time.perf_counter()
            stamps.extend(t for _ in range(raw.count(b'"content": "t')))
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"id": rid, "ttft": stamps[0] - start, "gaps": gaps}


async def drive(url: str, requests: int, concurrency: int) -> list[dict[str, object]]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[dict[str, object]] = []
    queue = list(range(requests))
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def worker() -> None:
            while queue:
                queue.pop()
                results.append(await one(client, url))

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
    parser.add_argument("--tokens", type=int, default=20)
    args = parser.parse_args()

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
                str(args.ttft),
                str(args.itl),
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
                f"http://127.0.0.1:{proxy_port}/v1/chat/completions",
                args.requests,
                args.concurrency,
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
    ttft_vs_schedule, ttft_vs_client, itl_vs_schedule, itl_vs_client = [], [], [], []
    for r in results:
        rec = logged[str(r["id"])]
        gaps = r["gaps"]
        assert isinstance(gaps, list)
        ttft_vs_schedule.append(rec["ttft_s"] - args.ttft)
        ttft_vs_client.append(float(r["ttft"]) - rec["ttft_s"])  # type: ignore[arg-type]
        itl_vs_schedule.append(rec["itl_mean_s"] - args.itl)
        itl_vs_client.append(statistics.fmean(gaps) - rec["itl_mean_s"])
    print(
        f"accuracy: {len(results)} streams, concurrency {args.concurrency}, schedule "
        f"TTFT {args.ttft * 1000:.0f} ms, ITL {args.itl * 1000:.0f} ms, {args.tokens} tokens"
    )
    for name, values in (
        ("proxy TTFT - scheduled TTFT", ttft_vs_schedule),
        ("client TTFT - proxy TTFT", ttft_vs_client),
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
