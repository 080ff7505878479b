"""Where the prompt-cache doctor should run: on the event loop or in its worker thread.

    python benchmarks/prefix_offload.py
    python benchmarks/prefix_offload.py --sizes 2048,8192,16384,32768,131072,409600 --requests 40
    python benchmarks/prefix_offload.py --quick         # smoke run, a few seconds
    python benchmarks/prefix_offload.py --hostile       # bodies built to be costly per byte

Why: :mod:`proxy.doctor.job` examines a prompt on the loop when its estimated blocks
(parts and body bytes) are at most ``INLINE_MAX_BLOCKS``, else in one worker thread. On the loop the whole cost
delays every other stream's next event; in the thread the loop pays a hand-off (a
submit, a wake-up through the loop's self-pipe), and the hashing still competes for the
GIL (hashlib keeps it for 256-byte pieces), so the loop waits for the thread at most a
switch interval (``sys.getswitchinterval()``, 5 ms) at a time. The threshold belongs
where the hand-off costs the loop less than the work it takes off it.

This drives the production objects (:class:`proxy.doctor.job.PrefixCheck` and its
jobs, the chat dialect's parts, a warm index) with chat prompts of each size, each one
new to the index (its costliest case: every block a miss and an insert), forced inline
and forced to the thread, and reports per request, best of ``--repeat`` runs:

* **loop CPU**: CPU time of the event loop's own thread (``time.thread_time``) per
  request, everything the loop did for it, the hand-off included;
* **total CPU**: the process's CPU per request (loop and worker);
* **late p99 / max**: how late a 1 ms ticker on the loop fired while the requests were
  examined (one request every ``--gap-ms``), the delay another stream's events would
  see.

``--hostile`` prices bodies whose cost is in their parts, not their bytes (thousands of
empty messages, tools or content parts in a few kilobytes, megabytes of tiny messages):
per body, where :meth:`PrefixCheck.place` puts it, and the event loop's CPU for it the
way the proxy runs it (``begin``, the batch or the hand-off, the wait), against the
same body examined on the loop, which is where a decision by body bytes alone put the
small ones.

Figures from a busy machine are upper bounds; the lead's quiet runs go in
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from typing import Any

from proxy.dialects import CHAT, COMPLETIONS
from proxy.doctor.job import INLINE_MAX_BLOCKS, Place, PrefixCheck, PrefixJob
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
        job = PrefixJob(check, CHAT, body, SPEC, i,
                        place=Place.THREAD if offload else Place.INLINE)
        job.start()
        await job.settle()
        if gap_s:
            await asyncio.sleep(gap_s)


async def cpu_per_request(size: int, offload: bool, requests: int) -> tuple[float, float]:
    """(loop thread CPU, process CPU) per request, in us."""
    check = PrefixCheck()
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
    check = PrefixCheck()
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


def hostile_bodies(scale: float = 1.0) -> dict[str, dict[str, Any]]:
    """Bodies whose cost is in their parts: the first four fit in 16 KiB; the fifth is
    about the most a request may hold (``PrefixCheck.max_keys``), the last far more."""
    n = max(2, int(5448 * scale))
    return {
        "empty messages": {"model": "bench", "messages": [{}] * n},
        "empty tools": {"model": "bench", "tools": [{}] * n,
                        "messages": [{"role": "user", "content": "hi"}]},
        "empty content parts": {"model": "bench", "messages": [
            {"role": "user", "content": [""] * n}]},
        "a token id, then strings": {"model": "bench", "prompt": [1] + [""] * n},
        "empty messages, up to the key cap": {"model": "bench",
                                               "messages": [{}] * int(16_000 * scale)},
        "tiny messages, MBs": {"model": "bench", "messages": [
            {"role": "user", "content": "x"}] * int(200_000 * scale)},
    }


async def loop_cost(check: PrefixCheck, body: dict[str, Any], size: int, t: int,
                    forced_inline: bool) -> tuple[float, float]:
    """The event loop thread's CPU for one body, us: (its own work, what it spent while
    a worker thread held the interpreter for it). As the proxy runs it (``begin``, the
    batch or the hand-off), or examined on the loop whatever its size (``forced_inline``)."""
    dialect = COMPLETIONS if "prompt" in body else CHAT
    start = time.thread_time()
    if forced_inline:
        job: PrefixJob | None = PrefixJob(check, dialect, body, SPEC, t,
                                            place=Place.INLINE)
        assert job is not None
        job.start()
    else:
        job = check.begin(dialect, body, SPEC, t / 1000, 200, size)
        check.run_batch()
        if job is not None:
            job.start()  # what the loop's next turn does for a job handed to the thread
    own = time.thread_time() - start
    future = job._future if job is not None else None
    if future is not None:
        await asyncio.wrap_future(future)  # the loop idles, but shares the interpreter
    return own * 1e6, (time.thread_time() - start - own) * 1e6


async def hostile(args: argparse.Namespace) -> None:
    scale = 0.05 if args.quick else 1.0
    print(f"# prompt-cache doctor: hostile bodies (INLINE_MAX_BLOCKS = {INLINE_MAX_BLOCKS}); "
          f"best of {args.repeat}; the event loop thread's CPU per body\n")
    print("| body | JSON bytes | estimated blocks | place | loop: decision, hand-off or "
          "examination | loop: while the thread works | loop if examined on it |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for name, body in hostile_bodies(scale).items():
        size = len(json.dumps(body, separators=(",", ":")))
        check = PrefixCheck()
        blocks = check.estimate(body, size)
        place = check.place(blocks)
        placed: list[tuple[float, float]] = []
        inline: list[float] = []
        for r in range(args.repeat):
            gc.collect()
            placed.append(await loop_cost(check, body, size, 2 * r, False))
            if size < 1_000_000 or not r:  # seconds each: once is enough
                gc.collect()
                inline.append(sum(await loop_cost(check, body, size, 2 * r + 1, True)))
        check.close()
        own, waiting = min(p[0] for p in placed), min(p[1] for p in placed)
        print(f"| {name} | {size:,} | {blocks:,} | {place.value} | {own:,.0f} us "
              f"| {waiting:,.0f} us | {min(inline):,.0f} us |", flush=True)


async def main_async(args: argparse.Namespace) -> None:
    if args.hostile:
        await hostile(args)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# prompt-cache doctor: on the loop or in the thread (INLINE_MAX_BLOCKS = "
          f"{INLINE_MAX_BLOCKS}); best of {args.repeat}, {args.requests} new prompts each\n")
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
    parser.add_argument("--hostile", action="store_true",
                        help="bodies costly per byte: where each goes, the loop's CPU")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.repeat = 3, 1
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
