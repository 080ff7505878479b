"""Hold 1,000 concurrent streams through the proxy; none may break.

Starts the fast fake upstream (``benchmarks/fake_upstream.py``) and the real proxy
command as subprocesses on loopback, opens ``--streams`` streaming chat completions
over ``--ramp`` seconds, and keeps them all open: every stream lasts
``ttft + itl * (tokens - 1)`` seconds (default 0.5 + 1.0 * 29 = 29.5 s), so with the
default ramp of 10 s all of them are in flight together for about 20 s. Each stream
must receive every token and ``[DONE]`` and end cleanly.

It reports: streams completed and broken (with the reasons), the peak number the
client held open at once and the proxy's own in-flight gauge at that time, the
client-side time to first token and largest gap between tokens (how much the proxy
delayed events under this load compared with the upstream's schedule), and the
proxy's peak RSS, open file descriptors, upstream connections and CPU time.

Usage::

    python benchmarks/hold_streams.py                  # 1,000 streams
    python benchmarks/hold_streams.py --streams 200    # a quick look

The run is bounded (``--max-seconds``); the open-files limit is raised with
``resource.setrlimit`` (the subprocesses inherit it). Exit code 0 when no stream broke.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak import (  # a sibling script
    StreamResult,
    cpu_seconds,
    processes,
    quantiles,
    raise_fd_limit,
    sample,
    start_proxy,
    start_upstream,
    stop,
    stream_once,
)


def in_flight_gauge(port: int) -> float | None:
    """The proxy's ``llm_proxy_in_flight_requests`` summed over its series (None if it
    could not be read)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return math.fsum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "llm_proxy_in_flight_requests"
        )
    except (OSError, ValueError):
        return None


async def one(
    port: int, tokens: int, delay: float, open_now: list[int], peak: list[int]
) -> StreamResult:
    await asyncio.sleep(delay)
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        open_now[0] += 1
        peak[0] = max(peak[0], open_now[0])
        try:
            return await stream_once(reader, writer, tokens)
        finally:
            open_now[0] -= 1
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        return StreamResult(error=f"{type(exc).__name__}: {exc}"[:120])
    finally:
        if writer is not None:
            writer.close()


async def direct(args: argparse.Namespace) -> dict[str, object]:
    """The same streams straight to the upstream: what this machine manages without a proxy."""
    upstream = start_upstream(args.ttft, args.itl, args.tokens, args.max_seconds + 60)
    open_now, peak = [0], [0]
    with processes(upstream):
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(
                one(upstream.port, args.tokens, args.ramp * i / args.streams, open_now, peak)
                for i in range(args.streams)
            )
        )
        wall = time.monotonic() - t0
    ok = [r for r in results if r.ok]
    return {
        "completed": len(ok),
        "broken": len(results) - len(ok),
        "peak_open_streams": peak[0],
        "ttft_s": {
            k: round(v, 4) for k, v in quantiles([r.t_first - r.t_start for r in ok]).items()
        },
        "max_token_gap_per_stream_s": {
            k: round(v, 4) for k, v in quantiles([r.max_gap for r in ok]).items()
        },
        "wall_s": round(wall, 1),
    }


async def hold(args: argparse.Namespace) -> dict[str, object]:
    fd_limit = raise_fd_limit(3 * args.streams + 512)
    duration = args.ttft + args.itl * (args.tokens - 1)
    baseline = await direct(args) if args.baseline else None
    load_before = os.getloadavg()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    upstream = start_upstream(args.ttft, args.itl, args.tokens, args.max_seconds + 60)
    proxy = start_proxy(
        upstream.port, "--max-upstream-connections", str(args.streams + 100), *args.proxy_arg
    )
    open_now, peak = [0], [0]
    peaks: dict[str, float] = {"rss_mib": 0.0, "fds": 0, "upstream_conns": 0}
    gauge_at_peak: float | None = None
    with processes(proxy, upstream):
        base = sample(proxy, upstream.port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = [
            asyncio.create_task(
                one(proxy.port, args.tokens, args.ramp * i / args.streams, open_now, peak)
            )
            for i in range(args.streams)
        ]
        all_done = asyncio.gather(*tasks)
        while not all_done.done():
            await asyncio.wait([all_done], timeout=1.0)
            if loop.time() - t0 > args.max_seconds:
                for t in tasks:
                    t.cancel()
                break
            s = await asyncio.to_thread(sample, proxy, upstream.port)
            for k in peaks:
                peaks[k] = max(peaks[k], s[k])
            if open_now[0] >= peak[0] and open_now[0] > 0:
                gauge_at_peak = await asyncio.to_thread(in_flight_gauge, proxy.port)
        results = [t.result() for t in tasks if t.done() and not t.cancelled()]
        wall = loop.time() - t0
        end = sample(proxy, upstream.port)
        upstream_cpu = cpu_seconds(upstream.pid)
        code = stop(proxy)
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    ok = [r for r in results if r.ok]
    broken: dict[str, int] = {}
    for r in results:
        if not r.ok:
            broken[r.error] = broken.get(r.error, 0) + 1
    missing = args.streams - len(results)
    if missing:
        broken["not finished within --max-seconds"] = missing
    return {
        "streams": args.streams,
        "completed": len(ok),
        "broken": sum(broken.values()),
        "broken_reasons": broken,
        "schedule": {
            "ttft_s": args.ttft,
            "itl_s": args.itl,
            "tokens": args.tokens,
            "stream_s": round(duration, 2),
            "ramp_s": args.ramp,
        },
        "peak_open_streams_client": peak[0],
        "proxy_in_flight_gauge_near_peak": gauge_at_peak,
        "ttft_s": {
            k: round(v, 4) for k, v in quantiles([r.t_first - r.t_start for r in ok]).items()
        },
        "max_token_gap_per_stream_s": {
            k: round(v, 4) for k, v in quantiles([r.max_gap for r in ok]).items()
        },
        "proxy_rss_mib": {
            "before": round(base["rss_mib"], 1),
            "peak": round(peaks["rss_mib"], 1),
            "after": round(end["rss_mib"], 1),
        },
        "proxy_fds": {"before": base["fds"], "peak": peaks["fds"], "after": end["fds"]},
        "proxy_upstream_conns_peak": peaks["upstream_conns"],
        "proxy_cpu_s": round(end["cpu_s"] - base["cpu_s"], 1),
        "upstream_cpu_s": round(upstream_cpu, 1),
        "client_cpu_s": round(
            cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime, 1
        ),
        "load_average_before": [round(x, 2) for x in load_before],
        "wall_s": round(wall, 1),
        "fd_soft_limit": fd_limit,
        "proxy_exit_code": code,
        "direct_baseline": baseline,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--ramp", type=float, default=10.0, help="seconds over which streams open")
    p.add_argument("--ttft", type=float, default=0.5)
    p.add_argument("--itl", type=float, default=1.0)
    p.add_argument("--tokens", type=int, default=30)
    p.add_argument("--max-seconds", type=float, default=180.0, help="hard bound on the run")
    p.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="extra argument for 'python -m proxy serve' (repeatable)",
    )
    p.add_argument(
        "--baseline",
        action="store_true",
        help="first run the same streams straight to the upstream, for comparison",
    )
    p.add_argument("--json", help="also write the report to this file")
    args = p.parse_args(argv)
    t = time.monotonic()
    report = asyncio.run(hold(args))
    report["script_s"] = round(time.monotonic() - t, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if report["broken"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
