"""The prompt-cache doctor's CPU per request and memory per index entry, in process.

    python benchmarks/prefix_micro.py
    python benchmarks/prefix_micro.py --sizes 2048,32768,409600 --blocks 64,128,256 --repeat 7
    python benchmarks/prefix_micro.py --quick          # smoke run, a second or two

Why: the doctor hashes every measured prompt (:mod:`proxy.diagnosis.prefix`), so its
cost grows with the prompt, not with the stream; a 400 KB prompt is about 100,000
tokens. This runs exactly what the proxy runs per request, on chat prompts of the
given sizes (a system prompt, then alternating user and assistant messages):
``Dialect.prompt_parts`` on the parsed body, :meth:`PromptHasher.hash`, the exchange
with a warm :class:`LruPrefixIndex` and :func:`diagnose`, for two cases: a prompt
seen before (the common case: another turn of a conversation, every block a hit) and
a new one (every block a miss and an insert). It reports, best of ``--repeat`` runs,
the process CPU per request of each step and in total, per block size.

It also prices the hash alone: the keyed ``blake2b`` the doctor uses against xxhash's
XXH3 with a seed (when ``xxhash`` is installed), per block; and memory: the bytes one
index entry costs (``tracemalloc``, the whole index over the entries it holds after
``--entries`` distinct blocks), against ``BYTES_PER_ENTRY``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from proxy.diagnosis.prefix import PromptHasher, diagnose
from proxy.diagnosis.prefix_index import BYTES_PER_ENTRY, LruPrefixIndex
from proxy.dialects import CHAT

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo")


def chat_body(size: int, salt: int) -> dict[str, Any]:
    """A chat body of about ``size`` prompt bytes: a system prompt of a fifth of it, then
    messages of about 1 KB; ``salt`` makes the messages (not the system prompt) unique."""
    rng = (salt * 7919 + 17) % 1_000_003

    def text(n: int, seed: int) -> str:
        words = [WORDS[(seed + i * 31) % len(WORDS)] for i in range(n // 6 + 1)]
        return " ".join(words)[:n]

    messages = [{"role": "system", "content": text(size // 5, 1)}]
    left = size - size // 5
    turn = 0
    while left > 0:
        chunk = min(1024, left)
        role = "user" if turn % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"{rng}:{turn} " + text(chunk, rng + turn)})
        left -= chunk
        turn += 1
    return {"model": "bench", "messages": messages}


def per_request(step: Callable[[int], None], requests: int, repeat: int) -> float:
    """Best process CPU seconds per call of ``step(i)`` over ``requests`` calls."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        start = time.process_time()
        for i in range(requests):
            step(i)
        best = min(best, (time.process_time() - start) / requests)
    return best


def doctor_costs(size: int, block: int, requests: int, repeat: int) -> dict[str, float]:
    """CPU per request (us) of each step, for a repeated and for a new prompt."""
    hasher = PromptHasher(block_bytes=block)
    index = LruPrefixIndex(256 * 1024 * 1024)
    bodies = [json.loads(json.dumps(chat_body(size, i))) for i in range(requests)]
    seen_body = bodies[0]
    parts = CHAT.prompt_parts(seen_body)
    hashed = hasher.hash(parts, upstream="u", model="bench")
    assert hashed is not None
    clock = iter(range(1, 1 << 40))
    index.exchange(hashed.probe(), next(clock))
    probe = hashed.probe()
    out: dict[str, float] = {"blocks": float(len(hashed.chain))}
    out["parts_us"] = per_request(lambda i: CHAT.prompt_parts(seen_body), requests, repeat) * 1e6
    out["hash_us"] = per_request(
        lambda i: hasher.hash(parts, upstream="u", model="bench"), requests, repeat) * 1e6
    out["exchange_hit_us"] = per_request(
        lambda i: index.exchange(probe, next(clock)), requests, repeat) * 1e6
    seen = index.exchange(probe, next(clock))
    out["diagnose_us"] = per_request(
        lambda i: diagnose(hashed, seen, 10), requests, repeat) * 1e6

    def new_prompt(i: int) -> None:  # a prompt the index has not seen, whole path
        body = bodies[i]
        fresh = hasher.hash(CHAT.prompt_parts(body), upstream="u", model=f"m{i}-{time.time_ns()}")
        assert fresh is not None
        now = next(clock)
        diagnose(fresh, index.exchange(fresh.probe(), now), now)

    out["new_total_us"] = per_request(new_prompt, requests, repeat) * 1e6
    out["repeat_total_us"] = (out["parts_us"] + out["hash_us"] + out["exchange_hit_us"]
                              + out["diagnose_us"])
    return out


def hash_costs(block: int, blocks: int, repeat: int) -> dict[str, float]:
    """ns per block of a keyed chain: the doctor's blake2b, and XXH3 with a seed."""
    data = os.urandom(block * blocks)
    view = memoryview(data)
    key = os.urandom(32)
    base = hashlib.blake2b(key=key, digest_size=8, person=b"prefix.chain")

    def blake(_: int) -> None:
        prev = b"\0" * 8
        for start in range(0, len(data), block):
            h = base.copy()
            h.update(prev)
            h.update(view[start : start + block])
            prev = h.digest()

    out = {"blake2b_ns": per_request(blake, 1, repeat) / blocks * 1e9}
    try:
        import xxhash  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return out
    digest = xxhash.xxh3_64_intdigest
    seed = int.from_bytes(key[:8], "little")

    def xxh3(_: int) -> None:
        prev = seed
        for start in range(0, len(data), block):
            prev = digest(view[start : start + block], prev ^ seed)

    out["xxh3_ns"] = per_request(xxh3, 1, repeat) / blocks * 1e9
    return out


def entry_bytes(block: int, entries: int) -> float:
    """Bytes per index entry: what tracemalloc sees allocated and kept while an index
    takes distinct prompts until it holds ``entries`` keys (keys, values and the
    table; the prompts and their digests are dropped as in the proxy)."""
    hasher = PromptHasher(block_bytes=block)
    bodies = []
    for i in range(entries // (2 * 8) + 1):  # about 2 keys per block, 8 blocks a prompt
        body = chat_body(8 * block, i)
        body["messages"][0]["content"] = f"{i} " + body["messages"][0]["content"]
        bodies.append(CHAT.prompt_parts(body))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = LruPrefixIndex(1 << 40)
    for now, parts in enumerate(bodies, 1):
        if len(index) >= entries:
            break
        hashed = hasher.hash(parts, upstream="u", model="bench")
        assert hashed is not None
        index.exchange(hashed.probe(), now)
        del hashed
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(index)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2048,32768,409600", help="prompt bytes, comma-separated")
    parser.add_argument("--blocks", default="64,128,256", help="block sizes, comma-separated")
    parser.add_argument("--requests", type=int, default=50, help="requests per timed run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (best is kept)")
    parser.add_argument("--entries", type=int, default=100_000, help="entries for the memory figure")
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.repeat, args.entries = 2, 1, 2000
    sizes = [int(s) for s in args.sizes.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    print(f"# prompt-cache doctor, CPU per request (best of {args.repeat} runs of "
          f"{args.requests} requests; process CPU, us)\n")
    print("| prompt | block | blocks | parts | hash | exchange (hit) | diagnose "
          "| total, repeated prompt | total, new prompt |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in sizes:
        for block in blocks:
            requests = max(1, args.requests if size < 100_000 else args.requests // 5)
            c = doctor_costs(size, block, requests, args.repeat)
            print(f"| {size:,} B | {block} | {c['blocks']:.0f} | {c['parts_us']:.0f} "
                  f"| {c['hash_us']:.0f} | {c['exchange_hit_us']:.0f} | {c['diagnose_us']:.0f} "
                  f"| {c['repeat_total_us']:.0f} | {c['new_total_us']:.0f} |", flush=True)
    print("\n| block | keyed blake2b, ns/block | XXH3 with seed, ns/block | index bytes/entry |")
    print("| ---: | ---: | ---: | ---: |")
    for block in blocks:
        h = hash_costs(block, max(64, 4096 // max(1, block // 64) if not args.quick else 64),
                       args.repeat)
        xxh3 = f"{h['xxh3_ns']:.0f}" if "xxh3_ns" in h else "(xxhash not installed)"
        print(f"| {block} | {h['blake2b_ns']:.0f} | {xxh3} | {entry_bytes(block, args.entries):.0f} |",
              flush=True)
    print(f"\nBYTES_PER_ENTRY = {BYTES_PER_ENTRY}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
