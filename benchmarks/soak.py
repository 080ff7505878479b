"""Soak: steady streaming load through the proxy, watching for leaks.

Runs the fast fake upstream (``benchmarks/fake_upstream.py``) and the real proxy
command (``python -m proxy serve``) as subprocesses on loopback, then keeps
``--concurrency`` clients streaming chat completions for ``--duration`` seconds. A
share of the streams (``--abort-fraction``) is abandoned mid-stream by the client, the
path most likely to leak (cancellation, half-read upstream responses). Every
``--interval`` seconds it records the proxy's resident memory, open file descriptors
and established upstream connections (from ``/proc``), and at the end says whether
they stayed flat after the warm-up.

"Flat" (printed with the thresholds): after warm-up, RSS grows by less than
max(8 MiB, 10 %) from the first to the last sample, and the peak of the last third of
the samples is within 4 MiB of the first third's (the least-squares slope is reported
too, but on a short run it is mostly noise); open fds and upstream connections stay within the concurrency of the values
seen in the first post-warm-up sample (they move with the requests in flight).

Usage::

    python benchmarks/soak.py                      # 60 s (tests/test_soak.py runs 24 s)
    python benchmarks/soak.py --duration 1800      # the 30-minute report run
    python benchmarks/soak.py --prompt-bytes 65536 --proxy-arg=--prefix-index-bytes=16000000
                                                   # distinct 64 KB prompts: the doctor's
                                                   # index fills to its bound, then stays

The helpers here (starting the processes, reading ``/proc``, a minimal streaming
HTTP/1.1 client) are shared with ``benchmarks/hold_streams.py``. Loopback only; every
run is bounded (the upstream exits by itself after ``--duration`` + a margin).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKEN_MARK = b"~t~"  # benchmarks/fake_upstream.py puts it in every token


# ---------------------------------------------------------------------------
# Processes


def raise_fd_limit(needed: int) -> int:
    """Raise the soft open-files limit (children inherit it); return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(needed, soft)
    if soft < needed and target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(needed, soft), target), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    port: int
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid


def _start(cmd: list[str], pattern: str, stream: str, timeout: float = 30.0) -> Proc:
    popen = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    found: list[int] = []
    ready = threading.Event()
    lines: list[str] = []

    def pump(pipe: object, watch: bool) -> None:
        for line in pipe:  # type: ignore[attr-defined]
            if len(lines) < 2000:
                lines.append(line)
            if watch and not found:
                m = re.search(pattern, line)
                if m:
                    found.append(int(m[1]))
                    ready.set()
        ready.set()

    for pipe, watch in ((popen.stdout, stream == "stdout"), (popen.stderr, stream == "stderr")):
        threading.Thread(target=pump, args=(pipe, watch), daemon=True).start()
    ready.wait(timeout)
    if not found:
        popen.kill()
        raise RuntimeError(f"{cmd[:4]} did not start:\n" + "".join(lines[-20:]))
    return Proc(popen, found[0], lines)


def start_upstream(ttft: float, itl: float, tokens: int, max_seconds: float) -> Proc:
    return _start(
        [
            sys.executable,
            "benchmarks/fake_upstream.py",
            "--port",
            "0",
            "--ttft",
            str(ttft),
            "--itl",
            str(itl),
            "--tokens",
            str(tokens),
            "--max-seconds",
            str(max_seconds),
        ],
        r"LISTENING (\d+)",
        "stdout",
    )


def start_proxy(upstream_port: int, *extra: str) -> Proc:
    return _start(
        [
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--upstream",
            f"http://127.0.0.1:{upstream_port}/v1",
            "--port",
            "0",
            *extra,
        ],
        r"Uvicorn running on http://[\d.]+:(\d+)",
        "stderr",
    )


def stop(proc: Proc, timeout: float = 15.0) -> int | None:
    if proc.popen.poll() is None:
        proc.popen.send_signal(signal.SIGTERM)
        try:
            return proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
    return proc.popen.wait(5)


@contextlib.contextmanager
def processes(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            stop(p)


# ---------------------------------------------------------------------------
# /proc readings


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def socket_inodes(pid: int) -> tuple[int, set[str]]:
    """(open fds, inodes of the sockets among them)."""
    fds = 0
    inodes = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return fds, inodes


def tcp_connections(pid: int, remote_port: int) -> int:
    """Established TCP connections of ``pid`` whose peer port is ``remote_port``."""
    _, inodes = socket_inodes(pid)
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            next(fh)
            for line in fh:
                cols = line.split()
                if (
                    cols[3] == "01"
                    and cols[9] in inodes
                    and int(cols[2].rsplit(":", 1)[1], 16) == remote_port
                ):
                    count += 1
    return count


def sample(proxy: Proc, upstream_port: int) -> dict[str, float]:
    fds, _ = socket_inodes(proxy.pid)
    return {
        "rss_mib": rss_bytes(proxy.pid) / 2**20,
        "fds": fds,
        "upstream_conns": tcp_connections(proxy.pid, upstream_port),
        "cpu_s": cpu_seconds(proxy.pid),
    }


# ---------------------------------------------------------------------------
# A minimal streaming HTTP/1.1 client (cheap enough for 1,000 streams on a small box)


def chat_request(tokens: int, host: str = "127.0.0.1", prompt: str = "hello") -> bytes:
    body = json.dumps(
        {
            "model": "bench",
            "stream": True,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": prompt}],
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer sk-bench\r\ncontent-length: %d\r\n\r\n%s"
        % (host.encode(), len(body), body)
    )


@dataclass
class StreamResult:
    ok: bool = False
    status: int = 0
    tokens: int = 0
    error: str = ""
    t_start: float = 0.0
    t_headers: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    max_gap: float = 0.0
    aborted: bool = False


async def stream_once(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    tokens: int,
    *,
    abort_after: int = 0,
    prompt_bytes: int = 0,
) -> StreamResult:
    """One streamed chat completion on an open connection. ``abort_after`` > 0: close the
    connection after that many tokens (a client going away). ``prompt_bytes`` > 0: a
    prompt of that many bytes never sent before (random hex), so that every block is new
    to the prompt-cache doctor's index: its memory grows until its bound, then stays."""
    loop = asyncio.get_running_loop()
    res = StreamResult(t_start=loop.time())
    prompt = os.urandom(prompt_bytes // 2 + 1).hex()[:prompt_bytes] if prompt_bytes else "hello"
    writer.write(chat_request(tokens, prompt=prompt))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    res.t_headers = loop.time()
    res.status = int(head.split(b" ", 2)[1])
    chunked = re.search(rb"(?i)\r\ntransfer-encoding: *chunked", head) is not None
    if res.status != 200 or not chunked:
        m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if m:
            await reader.readexactly(int(m[1]))
        res.error = f"status {res.status}"
        return res
    last = 0.0
    tail = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            break
        data = await reader.readexactly(size + 2)
        now = loop.time()
        n = data.count(TOKEN_MARK)
        if n:
            if res.tokens == 0:
                res.t_first = now
            else:
                res.max_gap = max(res.max_gap, now - last)
            last = now
            res.tokens += n
        tail = (tail + data[:-2])[-64:]
        if abort_after and res.tokens >= abort_after:
            res.aborted = True
            writer.close()
            return res
    res.t_end = loop.time()
    res.ok = res.tokens == tokens and b"data: [DONE]" in tail
    if not res.ok:
        res.error = f"incomplete: {res.tokens}/{tokens} tokens"
    return res


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)

    def q(p: float) -> float:
        return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": v[-1]}


# ---------------------------------------------------------------------------
# The soak


@dataclass
class Counters:
    completed: int = 0
    aborted: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)


async def worker(
    port: int,
    tokens: int,
    abort_every: int,
    deadline: float,
    c: Counters,
    seed: int,
    prompt_bytes: int = 0,
) -> None:
    loop = asyncio.get_running_loop()
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    i = seed
    while loop.time() < deadline:
        i += 1
        try:
            if conn is None:
                conn = await asyncio.open_connection("127.0.0.1", port)
            abort = abort_every > 0 and i % abort_every == 0
            res = await asyncio.wait_for(
                stream_once(
                    *conn,
                    tokens,
                    abort_after=max(1, tokens // 3) if abort else 0,
                    prompt_bytes=prompt_bytes,
                ),
                60,
            )
            if res.aborted:
                c.aborted += 1
                conn = None
            elif res.ok:
                c.completed += 1
            else:
                c.errors += 1
                c.error_kinds[res.error] = c.error_kinds.get(res.error, 0) + 1
                conn[1].close()
                conn = None
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
            c.errors += 1
            kind = type(exc).__name__
            c.error_kinds[kind] = c.error_kinds.get(kind, 0) + 1
            if conn is not None:
                conn[1].close()
            conn = None
    if conn is not None:
        conn[1].close()


def flat_verdict(
    samples: list[dict[str, float]], warmup: float, concurrency: int
) -> dict[str, object]:
    after = [s for s in samples if s["t"] >= warmup]
    if len(after) < 3:
        return {"flat": None, "reason": "too few samples after warm-up"}
    rss = [s["rss_mib"] for s in after]
    ts = [s["t"] / 60 for s in after]
    slope = statistics.linear_regression(ts, rss).slope if len(set(ts)) > 1 else 0.0
    growth = rss[-1] - rss[0]
    third = max(1, len(rss) // 3)
    climb = max(rss[-third:]) - max(rss[:third])  # a leak keeps climbing to the end
    rss_ok = growth < max(8.0, 0.10 * rss[0]) and climb < 4.0
    fds = [s["fds"] for s in after]
    conns = [s["upstream_conns"] for s in after]
    fds_ok = max(fds) - fds[0] <= concurrency + 4
    conns_ok = max(conns) - conns[0] <= concurrency
    return {
        "flat": rss_ok and fds_ok and conns_ok,
        "rss_first_mib": round(rss[0], 1),
        "rss_last_mib": round(rss[-1], 1),
        "rss_max_mib": round(max(rss), 1),
        "rss_growth_mib": round(growth, 2),
        "rss_slope_mib_per_min": round(slope, 3),
        "rss_last_third_climb_mib": round(climb, 2),
        "fds_range": [min(fds), max(fds)],
        "upstream_conns_range": [min(conns), max(conns)],
        "thresholds": "RSS growth < max(8 MiB, 10%) and the last third's peak < the first "
        "third's + 4 MiB; fds and upstream "
        "connections within +concurrency of the first post-warm-up sample",
    }


async def soak(args: argparse.Namespace) -> dict[str, object]:
    raise_fd_limit(4 * args.concurrency + 256)
    upstream = start_upstream(args.ttft, args.itl, args.tokens, args.duration + 120)
    proxy = start_proxy(upstream.port, *args.proxy_arg)
    samples: list[dict[str, float]] = []
    c = Counters()
    with processes(proxy, upstream):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + args.duration
        abort_every = round(1 / args.abort_fraction) if args.abort_fraction > 0 else 0
        tasks = [
            asyncio.create_task(
                worker(
                    proxy.port, args.tokens, abort_every, deadline, c, i * 7, args.prompt_bytes
                )
            )
            for i in range(args.concurrency)
        ]
        last_done = 0
        while loop.time() < deadline:
            await asyncio.sleep(min(args.interval, max(0.0, deadline - loop.time())))
            s = sample(proxy, upstream.port)
            s["t"] = round(loop.time() - t0, 1)
            done = c.completed + c.aborted
            s["req_per_s"] = round((done - last_done) / args.interval, 1)
            last_done = done
            samples.append(s)
            if args.verbose:
                print(json.dumps(s), file=sys.stderr, flush=True)
        await asyncio.gather(*tasks)
        end = sample(proxy, upstream.port)
        code = stop(proxy)
    warmup = args.warmup if args.warmup is not None else max(10.0, 0.2 * args.duration)
    return {
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "schedule": {"ttft_s": args.ttft, "itl_s": args.itl, "tokens": args.tokens},
        "prompt_bytes": args.prompt_bytes,
        "completed": c.completed,
        "aborted_by_client": c.aborted,
        "errors": c.errors,
        "error_kinds": c.error_kinds,
        "warmup_s": warmup,
        "samples": samples,
        "verdict": flat_verdict(samples, warmup, args.concurrency),
        "proxy_cpu_s": round(end["cpu_s"], 1),
        "proxy_exit_code": code,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds excluded from the verdict (default: 20%% of the run, >= 10 s)",
    )
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--abort-fraction",
        type=float,
        default=0.1,
        help="share of streams the client abandons mid-stream",
    )
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.01)
    p.add_argument("--tokens", type=int, default=30)
    p.add_argument(
        "--prompt-bytes",
        type=int,
        default=0,
        help="a distinct prompt of this many bytes per stream (0: 'hello'): with the "
        "prompt-cache doctor on, its index fills to --prefix-index-bytes and must stay there",
    )
    p.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="extra argument for 'python -m proxy serve' (repeatable)",
    )
    p.add_argument("--json", help="also write the report to this file")
    p.add_argument("-v", "--verbose", action="store_true", help="print each sample as it is taken")
    args = p.parse_args(argv)
    report = asyncio.run(soak(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    verdict = report["verdict"]
    assert isinstance(verdict, dict)
    return 0 if verdict.get("flat") and report["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
