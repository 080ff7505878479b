"""Where the prompt-cache doctor should run: on the event loop or in its worker thread.

    python benchmarks/prefix_offload.py
    python benchmarks/prefix_offload.py --sizes 2048,8192,16384,32768,131072,409600 --requests 40
    python benchmarks/prefix_offload.py --quick         # smoke run, a few seconds

Why: :mod:`proxy.prefix_check` examines a prompt on the loop when its request body is
at most ``INLINE_MAX_BYTES``, else in one worker thread. On the loop the whole cost
delays every other stream's next event; in the thread the loop pays a hand-off (a
submit, a wake-up through the loop's self-pipe), and the hashing still competes for the
GIL (hashlib keeps it for 256-byte pieces), so the loop waits for the thread at most a
switch interval (``sys.getswitchinterval()``, 5 ms) at a time. The threshold belongs
where the hand-off costs the loop less than the work it takes off it.

This drives the production objects (:class:`proxy.prefix_check.PrefixCheck` and its
jobs, the chat dialect's parts, a warm index) with chat prompts of each size, each one
new to the index (its costliest case: every block a miss and an insert), forced inline
and forced to the thread, and reports per request, best of ``--repeat`` runs:

* **loop CPU**: CPU time of the event loop's own thread (``time.thread_time``) per
  request, everything the loop did for it, the hand-off included;
* **total CPU**: the process's CPU per request (loop and worker);
* **late p99 / max**: how late a 1 ms ticker on the loop fired while the requests were
  examined (one request every ``--gap-ms``), the delay another stream's events would
  see.

Figures from a busy machine are upper bounds; the lead's quiet runs go in
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from typing import Any

from proxy.config import Settings
from proxy.dialects import CHAT
from proxy.prefix_check import INLINE_MAX_BYTES, PrefixCheck, PrefixJob
from proxy.upstream_spec import UpstreamSpec

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo")
SPEC = UpstreamSpec(name="bench", url="http://127.0.0.1:1/v1")


def chat_body(size: int, salt: int) -> dict[str, Any]:
    """A chat body of about ``size`` prompt bytes: a system prompt of a fifth of it,
    then messages of about 1 KB, all of it unique to ``salt``."""

    def text(n: int, seed: int) -> str:
        return " ".join(WORDS[(seed + i * 31) % len(WORDS)] for i in range(n // 6 + 1))[:n]

    messages = [{"role": "system", "content": f"{salt} " + text(size // 5, salt)}]
    left, turn = size - size // 5, 0
    while left > 0:
        chunk = min(1024, left)
        messages.append({"role": "user" if turn % 2 == 0 else "assistant",
                         "content": f"{salt}:{turn} " + text(chunk, salt + turn)})
        left -= chunk
        turn += 1
    return {"model": "bench", "messages": messages}


async def examine_all(check: PrefixCheck, bodies: list[dict[str, Any]], offload: bool,
                      gap_s: float) -> None:
    for i, body in enumerate(bodies):
        job = PrefixJob(check, CHAT, body, SPEC, i, offload=offload)
        job.start()
        await job.settle()
        if gap_s:
            await asyncio.sleep(gap_s)


async def cpu_per_request(size: int, offload: bool, requests: int) -> tuple[float, float]:
    """(loop thread CPU, process CPU) per request, in us."""
    check = PrefixCheck(Settings())
    bodies = [chat_body(size, i) for i in range(requests + 1)]
    await examine_all(check, bodies[:1], offload, 0.0)  # the thread started, the index warm
    gc.collect()
    loop0, cpu0 = time.thread_time(), time.process_time()
    await examine_all(check, bodies[1:], offload, 0.0)
    loop1, cpu1 = time.thread_time(), time.process_time()
    check.close()
    return (loop1 - loop0) / requests * 1e6, (cpu1 - cpu0) / requests * 1e6


async def lateness(size: int, offload: bool, requests: int, gap_s: float) -> tuple[float, float]:
    """(p99, max) lateness of a 1 ms ticker on the loop while prompts are examined, ms."""
    check = PrefixCheck(Settings())
    bodies = [chat_body(size, i) for i in range(requests + 1)]
    await examine_all(check, bodies[:1], offload, 0.0)
    late: list[float] = []
    running = True

    async def ticker() -> None:
        while running:
            t = time.perf_counter()
            await asyncio.sleep(0.001)  # the loop's responsiveness is what is measured
            late.append(max(0.0, time.perf_counter() - t - 0.001))

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    await examine_all(check, bodies[1:], offload, gap_s)
    running = False
    await tick
    check.close()
    late.sort()
    p99 = late[min(len(late) - 1, int(0.99 * len(late)))] if late else 0.0
    return p99 * 1e3, (late[-1] if late else 0.0) * 1e3


async def main_async(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# prompt-cache doctor: on the loop or in the thread (INLINE_MAX_BYTES = "
          f"{INLINE_MAX_BYTES}); best of {args.repeat}, {args.requests} new prompts each\n")
    print("| body | inline: loop CPU | thread: loop CPU | inline: total CPU "
          "| thread: total CPU | inline: late p99 / max | thread: late p99 / max |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in sizes:
        requests = max(2, args.requests if size < 100_000 else args.requests // 4)
        row = []
        for offload in (False, True):
            runs = [await cpu_per_request(size, offload, requests) for _ in range(args.repeat)]
            row.append((min(r[0] for r in runs), min(r[1] for r in runs)))
        lates = []
        for offload in (False, True):
            runs = [await lateness(size, offload, requests, args.gap_ms / 1e3)
                    for _ in range(args.repeat)]
            lates.append((statistics.median(r[0] for r in runs),
                          statistics.median(r[1] for r in runs)))
        (il, it), (tl, tt) = row
        print(f"| {size:,} B | {il:.0f} us | {tl:.0f} us | {it:.0f} us | {tt:.0f} us "
              f"| {lates[0][0]:.2f} / {lates[0][1]:.2f} ms "
              f"| {lates[1][0]:.2f} / {lates[1][1]:.2f} ms |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2048,8192,16384,32768,131072,409600",
                        help="request body bytes, comma-separated")
    parser.add_argument("--requests", type=int, default=40, help="prompts per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure")
    parser.add_argument("--gap-ms", type=float, default=2.0,
                        help="pause between prompts in the lateness runs")
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.repeat = 3, 1
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
