"""The prompt-cache doctor's shared index: what one request's exchange costs, and what a
key costs the store.

    python benchmarks/prefix_store.py                       # starts its own redis-server
    python benchmarks/prefix_store.py --url redis://HOST:6379/0    # an existing store
    python benchmarks/prefix_store.py --quick               # smoke run, a few seconds

Why: with the config file's ``[cache-index]`` table every measured request makes one
round trip to Redis or Valkey (:class:`proxy.doctor.shared_index.RedisPrefixIndex`) where the
in-process index (:class:`proxy.doctor.index.LruPrefixIndex`) makes a dict
walk. The round trip runs in the doctor's threads after the response headers, never on
the event loop, but its CPU is the proxy's, its time bounds how soon the finish can
record the request, and the store's own time per key is what every replica waits
behind. This runs the exchange exactly as the proxy does, on the probes the doctor
builds for chat prompts of the given sizes (:func:`benchmarks.prefix_micro.chat_body`),
for a prompt seen before (another turn: every key a hit) and a new one, and reports per
exchange: the round trip (median and p99 wall time), this process's CPU, the store's
own time (``INFO commandstats``), the in-process exchange's CPU for comparison; then
exchanges per second with the proxy's :data:`proxy.doctor.job.STORE_THREADS` threads
at once; then the store's memory per key (``MEMORY USAGE`` and ``used_memory`` growth
over ``--entries`` keys).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prefix_micro import chat_body
from proxy.dialects import CHAT
from proxy.doctor.index import LruPrefixIndex, Probe
from proxy.doctor.job import STORE_THREADS
from proxy.doctor.keys import PromptHasher
from proxy.doctor.shared_index import CacheIndexSpec, RedisPrefixIndex


@contextmanager
def own_store() -> Iterator[str]:
    """A redis-server on a free loopback port, nothing saved; its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server), "
                         "or give --url")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="prefix-store-bench-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "Ready to accept connections" in line:
            break
    else:
        raise SystemExit("redis-server did not start")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def probes(size: int, count: int, hasher: PromptHasher) -> list[Probe]:
    out = []
    for i in range(count):
        hashed = hasher.hash(CHAT.prompt_parts(chat_body(size, i)), upstream="u",
                             model=f"bench-{size}-{i}-{time.time_ns()}")
        assert hashed is not None
        out.append(hashed.probe())
    return out


def store_us(client: Any) -> float:
    stats = client.info("commandstats").get("cmdstat_evalsha")
    return float(stats["usec"]) if stats else 0.0


def exchange_costs(index: RedisPrefixIndex, client: Any, size: int, requests: int
                   ) -> dict[str, float]:
    hasher = PromptHasher()
    fresh = probes(size, requests, hasher)
    seen = fresh[0]
    index.exchange(seen, 0)  # connected, script loaded, the prompt stored
    lru = LruPrefixIndex(1 << 30)
    out: dict[str, float] = {"keys": float(len(seen.keys))}
    for name, batch in (("hit", [seen] * requests), ("new", fresh)):
        walls: list[float] = []
        client.config_resetstat()
        cpu0 = time.process_time()
        for probe in batch:
            start = time.perf_counter()
            index.exchange(probe, 0)
            walls.append(time.perf_counter() - start)
        cpu = (time.process_time() - cpu0) / requests
        server = store_us(client) / requests
        walls.sort()
        out[f"{name}_p50_us"] = statistics.median(walls) * 1e6
        out[f"{name}_p99_us"] = walls[min(len(walls) - 1, int(len(walls) * 0.99))] * 1e6
        out[f"{name}_cpu_us"] = cpu * 1e6
        out[f"{name}_store_us"] = server
        lru.exchange(batch[0], 1)
        cpu0 = time.process_time()
        for i, probe in enumerate(batch):
            lru.exchange(probe, i + 2)
        out[f"{name}_lru_us"] = (time.process_time() - cpu0) / requests * 1e6
    return out


def throughput(index: RedisPrefixIndex, size: int, seconds: float) -> float:
    """Exchanges per second with STORE_THREADS threads at once (each a repeated prompt)."""
    probe = probes(size, 1, PromptHasher())[0]
    index.exchange(probe, 0)
    done = [0] * STORE_THREADS
    stop = time.perf_counter() + seconds

    def work(n: int) -> None:
        while time.perf_counter() < stop:
            index.exchange(probe, 0)
            done[n] += 1

    threads = [threading.Thread(target=work, args=(n,)) for n in range(STORE_THREADS)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - start)


def memory(index: RedisPrefixIndex, client: Any, prefix: str, entries: int) -> tuple[float, float]:
    """(MEMORY USAGE of one key, used_memory growth per key) over ``entries`` new keys."""
    before = client.info("memory")["used_memory"]
    batch = 2000
    for start in range(0, entries, batch):
        n = min(batch, entries - start)
        index.exchange(Probe(tuple(os.urandom(8) for _ in range(n)), bytes(n)), 0)
    grown = (client.info("memory")["used_memory"] - before) / entries
    key = next(client.scan_iter(match=prefix + "*", count=100))
    return float(client.memory_usage(key)), grown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="", help="an existing store (default: start one)")
    parser.add_argument("--sizes", default="2048,32768,409600", help="prompt bytes, comma-separated")
    parser.add_argument("--requests", type=int, default=200, help="exchanges per figure")
    parser.add_argument("--seconds", type=float, default=3.0, help="for the throughput figure")
    parser.add_argument("--entries", type=int, default=100_000, help="keys for the memory figure")
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.seconds, args.entries = 5, 0.2, 2000
    import redis

    with (own_store() if not args.url else _given(args.url)) as url:
        prefix = f"bench-{os.getpid()}:"
        index = RedisPrefixIndex(CacheIndexSpec(url=url, key_prefix=prefix, timeout_s=5.0),
                                 horizon_ms=3_600_000)
        client = redis.Redis.from_url(url)
        try:
            print(f"# the shared index, per exchange ({args.requests} exchanges; wall time of "
                  "the round trip, this process's CPU, the store's own time; us)\n")
            print("| prompt | keys | prompt seen | round trip p50 | p99 | CPU here | store "
                  "| in process, CPU |")
            print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
            sizes = [int(s) for s in args.sizes.split(",")]
            for size in sizes:
                requests = max(2, args.requests if size < 100_000 else args.requests // 10)
                c = exchange_costs(index, client, size, requests)
                for name, what in (("hit", "before"), ("new", "never")):
                    print(f"| {size:,} B | {c['keys']:.0f} | {what} | {c[name + '_p50_us']:.0f} "
                          f"| {c[name + '_p99_us']:.0f} | {c[name + '_cpu_us']:.0f} "
                          f"| {c[name + '_store_us']:.0f} | {c[name + '_lru_us']:.0f} |",
                          flush=True)
            rate = throughput(index, sizes[0], args.seconds)
            print(f"\n{STORE_THREADS} threads, a {sizes[0]:,}-byte prompt: {rate:,.0f} "
                  "exchanges/s")
            usage, grown = memory(index, client, prefix, args.entries)
            print(f"\nper key: MEMORY USAGE {usage:.0f} bytes; used_memory grew {grown:.0f} "
                  f"bytes per key over {args.entries:,} keys")
        finally:
            for key in client.scan_iter(match=prefix + "*", count=1000):
                client.delete(key)
            index.close()
            client.close()
    return 0


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url


if __name__ == "__main__":
    raise SystemExit(main())
