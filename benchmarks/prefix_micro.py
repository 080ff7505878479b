"""The prompt-cache doctor's CPU per request and memory per index entry, in process.

    python benchmarks/prefix_micro.py
    python benchmarks/prefix_micro.py --sizes 2048,32768,409600 --blocks 256 --repeat 7
    python benchmarks/prefix_micro.py --baseline main --sizes 2048,32768 --blocks 256
    python benchmarks/prefix_micro.py --profile 32768   # where one prompt's time goes
    python benchmarks/prefix_micro.py --instructions --baseline main --sizes 2048,32768
    python benchmarks/prefix_micro.py --quick          # smoke run, a second or two
    python benchmarks/prefix_micro.py --every-stamp --sizes 2048,32768  # settled keys or not

Why: the doctor hashes every measured prompt (:mod:`proxy.doctor`), so its
cost grows with the prompt, not with the stream; a 400 KB prompt is about 100,000
tokens. This runs exactly what the proxy runs per request, on chat prompts of the
given sizes (a system prompt, then alternating user and assistant messages of about
1 KB): ``Dialect.prompt_parts`` on the parsed body, :meth:`PromptHasher.hash`, the
exchange with a warm :class:`LruPrefixIndex` and :func:`examine`, for two cases: a
prompt seen before (the common case: another turn of a conversation, every block a
hit), a new one (every block a miss and an insert) and a new tail (the seen prompt
with its last message new: a repeated head). It reports, best of
``--repeat`` runs, the process CPU per request of each step and in total, per block
size. ``--text`` picks the prompts' text: ``prose`` (sentences and paragraphs, what
content-defined chunking cuts at; the default) or ``words`` (words without a mark).

``--baseline REF`` also loads the hasher and the examination as they are at the git
revision REF (``git show`` of ``proxy/doctor/keys.py`` and ``examine.py``, or of
``proxy/diagnosis/prefix.py`` before the doctor was a package; the index and the
dialects are this tree's) and times it
on the same prompts, each run of a step alternating between the two in one process,
so that a loaded machine slows both alike: compare the two columns as a ratio, not
as absolute figures.

``--instructions`` counts instead of timing: each step runs in a child process under
``valgrind --tool=cachegrind`` (Debian's ``valgrind``), once with the calls and once
without, and the difference over the calls is the instructions a call executes. The
count does not move with the machine's load (a loaded machine moves CPU times by
tens of percent from one run to the next), though an instruction is not a fixed
time: compare counts, and time on a quiet machine.

It also prices the hash alone, per 256-byte block: the keyed ``blake2b`` chain the
doctor used before (one ``update``, ``copy`` and ``digest`` a block), the keyed digest
of a short input it uses now, and XXH3-128 of the block; and memory: the bytes one
index entry costs (``tracemalloc``, the whole index over the entries it holds after
``--entries`` distinct blocks), against ``BYTES_PER_ENTRY``, and the keys per
kilobyte of prompt.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import importlib.util
import json
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from proxy.dialects import CHAT
from proxy.doctor import examine as doctor_examine
from proxy.doctor import keys as doctor_keys
from proxy.doctor.index import BYTES_PER_ENTRY, LruPrefixIndex

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo")


def words_text(n: int, seed: int) -> str:
    """``n`` bytes of words, no sentence ends or newlines."""
    words = [WORDS[(seed + i * 31) % len(WORDS)] for i in range(n // 6 + 1)]
    return " ".join(words)[:n]


def prose_text(n: int, seed: int) -> str:
    """``n`` bytes of prose: sentences of 4 to 24 words, paragraphs of a few sentences."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))
        piece = sentence.capitalize() + "." + ("\n\n" if rng.random() < 0.2 else " ")
        out.append(piece)
        size += len(piece)
    return "".join(out)[:n]


def chat_body(size: int, salt: int, text: str = "prose") -> dict[str, Any]:
    """A chat body of about ``size`` prompt bytes: a system prompt of a fifth of it, then
    messages of about 1 KB; ``salt`` makes the messages (not the system prompt) unique."""
    rng = (salt * 7919 + 17) % 1_000_003
    make = prose_text if text == "prose" else words_text
    messages = [{"role": "system", "content": make(size // 5, 1)}]
    left = size - size // 5
    turn = 0
    while left > 0:
        chunk = min(1024, left)
        role = "user" if turn % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"{rng}:{turn} " + make(chunk, rng + turn)})
        left -= chunk
        turn += 1
    return {"model": "bench", "messages": messages}


def _now() -> ModuleType:
    """This tree's hasher and examination, as one module."""
    module = ModuleType("doctor_now")
    module.PromptHasher = doctor_keys.PromptHasher  # type: ignore[attr-defined]
    module.DEFAULT_BLOCK_BYTES = doctor_keys.DEFAULT_BLOCK_BYTES  # type: ignore[attr-defined]
    module.examine = doctor_examine.examine  # type: ignore[attr-defined]
    return module


current = _now()


def load_baseline(ref: str) -> ModuleType:
    """The hasher and the examination at git revision ``ref``, as a module of its own."""

    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout

    try:
        source = show("proxy/diagnosis/prefix.py")  # before the doctor was a package
        source = source.replace("proxy.diagnosis.prefix_index", "proxy.doctor.index")
    except subprocess.CalledProcessError:
        skip = ("from __future__", "from proxy.doctor.keys import")
        source = show("proxy/doctor/keys.py") + "\n" + "\n".join(
            line for line in show("proxy/doctor/examine.py").splitlines()
            if not line.startswith(skip))
    path = Path(tempfile.mkdtemp()) / "prefix_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("prefix_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    if not hasattr(module, "examine"):
        module.examine = module.diagnose  # its name before the doctor was a package
    return module


def paired(steps: dict[str, Callable[[int], None]], requests: int, repeat: int
           ) -> dict[str, float]:
    """Best process CPU seconds per call of each ``step(i)`` over ``requests`` calls,
    the steps' runs interleaved (their order alternating from run to run)."""
    best = dict.fromkeys(steps, float("inf"))
    names = list(steps)
    for run in range(repeat):
        for name in names if run % 2 == 0 else reversed(names):
            step = steps[name]
            gc.collect()
            start = time.process_time()
            for i in range(requests):
                step(i)
            best[name] = min(best[name], (time.process_time() - start) / requests)
    return best


class Case:
    """One doctor (a module's hasher and examine, this tree's index) and its prompts."""

    def __init__(self, module: ModuleType, size: int, block: int, requests: int,
                 text: str, settle_ms: int | None = None) -> None:
        self.module = module
        self.hasher = module.PromptHasher(block_bytes=block)
        self.index = LruPrefixIndex(256 * 1024 * 1024, settle_ms=settle_ms)
        self.bodies = [json.loads(json.dumps(chat_body(size, i, text))) for i in range(requests)]
        self.seen_body = self.bodies[0]
        # the seen prompt with its last message new each time: a repeated head, a new tail
        self.tails = [{**self.seen_body, "messages": [*self.seen_body["messages"][:-1], {
            "role": "user", "content": f"{i} {body['messages'][-1]['content']}"}]}
            for i, body in enumerate(self.bodies)]
        self.parts = CHAT.prompt_parts(self.seen_body)
        hashed = self.hasher.hash(self.parts, upstream="u", model="bench")
        assert hashed is not None
        self.hashed = hashed
        self.clock = iter(range(1, 1 << 40))
        self.index.exchange(hashed.probe(), next(self.clock))
        self.probe = hashed.probe()
        self.seen = self.index.exchange(self.probe, next(self.clock))

    def steps(self) -> dict[str, Callable[[int], None]]:
        hasher, parts, index, probe, module = (self.hasher, self.parts, self.index, self.probe,
                                               self.module)

        def new_prompt(i: int) -> None:  # a prompt the index has not seen, whole path
            fresh = hasher.hash(CHAT.prompt_parts(self.bodies[i]), upstream="u",
                                model=f"m{i}-{time.time_ns()}")
            assert fresh is not None
            now = next(self.clock)
            module.examine(fresh, index.exchange(fresh.probe(), now), now)

        def new_tail(i: int) -> None:  # the seen prompt's head, a new last message
            fresh = hasher.hash(CHAT.prompt_parts(self.tails[i]), upstream="u", model="bench")
            assert fresh is not None
            now = next(self.clock)
            module.examine(fresh, index.exchange(fresh.probe(), now), now)

        return {
            "tail": new_tail,
            "parts": lambda i: CHAT.prompt_parts(self.seen_body),
            "hash": lambda i: hasher.hash(parts, upstream="u", model="bench"),
            "exchange": lambda i: index.exchange(probe, next(self.clock)),
            "examine": lambda i: module.examine(self.hashed, self.seen, 10),
            "new": new_prompt,
        }


def doctor_costs(modules: dict[str, tuple[ModuleType, int | None]], size: int, block: int,
                 requests: int, repeat: int, text: str) -> dict[str, dict[str, float]]:
    """CPU per request (us) of each step of each doctor (a module and the index's
    ``settle_ms``), interleaved."""
    cases = {name: Case(module, size, block, requests, text, settle)
             for name, (module, settle) in modules.items()}
    out: dict[str, dict[str, float]] = {
        name: {"blocks": float(len(case.hashed.chain)), "keys": float(len(case.hashed.keys))}
        for name, case in cases.items()}
    for step in ("parts", "hash", "exchange", "examine", "new", "tail"):
        timed = paired({name: case.steps()[step] for name, case in cases.items()}, requests,
                       repeat)
        for name, seconds in timed.items():
            out[name][step] = seconds * 1e6
    for costs in out.values():
        costs["repeat"] = costs["parts"] + costs["hash"] + costs["exchange"] + costs["examine"]
    return out


def hash_costs(block: int, blocks: int, repeat: int) -> dict[str, float]:
    """ns per block: the keyed blake2b chain over the block's bytes, the keyed digest of a
    short input (a key and a condensed block), and XXH3-128 of the block."""
    data = os.urandom(block * blocks)
    view = memoryview(data)
    key = os.urandom(32)
    base = hashlib.blake2b(key=key, digest_size=8, person=b"prefix.chain")
    short = os.urandom(24)

    def chain(_: int) -> None:
        running = base.copy()
        for start in range(0, len(data), block):
            running.update(view[start : start + block])
            running.copy().digest()

    def keyed_short(_: int) -> None:
        for _start in range(0, len(data), block):
            h = base.copy()
            h.update(short)
            h.digest()

    steps = {"blake2b_chain_ns": chain, "keyed_short_ns": keyed_short}
    try:
        from xxhash import xxh3_128_digest
    except ImportError:
        pass
    else:
        def xxh3(_: int) -> None:
            for start in range(0, len(data), block):
                xxh3_128_digest(view[start : start + block], 7)

        steps["xxh3_ns"] = xxh3
    return {name: seconds / blocks * 1e9 for name, seconds in paired(steps, 1, repeat).items()}


def entry_bytes(module: ModuleType, block: int, entries: int, text: str) -> tuple[float, float]:
    """Bytes per index entry, and index entries per KB of prompt: what tracemalloc sees
    allocated and kept while an index takes distinct prompts until it holds ``entries``
    keys (keys, values and the table; the prompts and their digests are dropped as in
    the proxy)."""
    hasher = module.PromptHasher(block_bytes=block)
    bodies = []
    for i in range(entries // (2 * 8) + 1):  # at most 2 keys a block, 8 blocks a prompt
        body = chat_body(8 * block, i, text)
        body["messages"][0]["content"] = f"{i} " + body["messages"][0]["content"]
        bodies.append(CHAT.prompt_parts(body))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = LruPrefixIndex(1 << 40)
    prompt_bytes = keys = 0
    for now, parts in enumerate(bodies, 1):
        if len(index) >= entries:
            break
        hashed = hasher.hash(parts, upstream="u", model="bench")
        assert hashed is not None
        prompt_bytes += hashed.prompt_bytes
        keys += len(hashed.keys)
        index.exchange(hashed.probe(), now)
        del hashed
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(index), keys / (prompt_bytes / 1024)


def count_one(doctor: str, step: str, size: int, calls: int, text: str) -> None:
    """Run one step ``calls`` times (the child of :func:`instructions`)."""
    module = current if doctor == "now" else load_baseline(doctor)
    case = Case(module, size, module.DEFAULT_BLOCK_BYTES, 4, text)
    run = case.steps()[step]
    for i in range(calls):
        run(i % 4)


def instructions(doctor: str, step: str, size: int, calls: int, text: str) -> int:
    """Instructions one call of ``step`` executes, by cachegrind: a run with ``calls``
    calls less one with none, over ``calls``."""
    counted = []
    for n in (0, calls):
        command = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
                   "--cachegrind-out-file=/dev/null", sys.executable, __file__, "--count-one",
                   f"{doctor},{step},{size},{n}", "--text", text]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              check=True)
        line = next(x for x in done.stderr.splitlines() if "I   refs:" in x or "I refs:" in x)
        counted.append(int(line.rsplit(":", 1)[1].replace(",", "")))
    return (counted[1] - counted[0]) // calls


def profile(size: int, text: str) -> None:
    """cProfile of the repeated-prompt path, the whole look, for one prompt size."""
    case = Case(current, size, current.DEFAULT_BLOCK_BYTES, 1, text)
    hasher, index = case.hasher, case.index

    def look() -> None:
        hashed = hasher.hash(CHAT.prompt_parts(case.seen_body), upstream="u", model="bench")
        now = next(case.clock)
        current.examine(hashed, index.exchange(hashed.probe(), now), now)

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(max(20, 2_000_000 // size)):
        look()
    profiler.disable()
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(14)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2048,32768,409600", help="prompt bytes, comma-separated")
    parser.add_argument("--blocks", default="256", help="block sizes, comma-separated")
    parser.add_argument("--requests", type=int, default=50, help="requests per timed run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (best is kept)")
    parser.add_argument("--entries", type=int, default=100_000, help="entries for the memory figure")
    parser.add_argument("--text", choices=("prose", "words"), default="prose",
                        help="the prompts' text")
    parser.add_argument("--baseline", metavar="REF",
                        help="also time the hasher and the examination at this git revision")
    parser.add_argument("--profile", type=int, metavar="BYTES",
                        help="only profile the whole look for prompts of this size")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per call with cachegrind instead of timing")
    parser.add_argument("--count-one", help=argparse.SUPPRESS)  # DOCTOR,STEP,SIZE,CALLS
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run")
    parser.add_argument("--every-stamp", action="store_true",
                        help="also time this tree with an index that writes every stamp "
                             "(settle_ms=0: no key left alone as settled)")
    args = parser.parse_args(argv)
    if args.count_one:
        doctor, step, size, calls = args.count_one.split(",")
        count_one(doctor, step, int(size), int(calls), args.text)
        return 0
    if args.profile:
        profile(args.profile, args.text)
        return 0
    if args.instructions:
        doctors = ["now"] + ([args.baseline] if args.baseline else [])
        print(f"# prompt-cache doctor, instructions per request (cachegrind; {args.text} "
              "prompts; 256-byte blocks)\n")
        print("| prompt | doctor | parts | hash | exchange (hit) | examine | total, repeated "
              "prompt | total, new prompt |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for size in [int(s) for s in args.sizes.split(",")]:
            calls = 4 if size > 100_000 else 20
            counts = {}
            for doctor in doctors:
                c = {step: instructions(doctor, step, size, calls, args.text)
                     for step in ("parts", "hash", "exchange", "examine", "new")}
                c["repeat"] = c["parts"] + c["hash"] + c["exchange"] + c["examine"]
                counts[doctor] = c
                print(f"| {size:,} B | {doctor} | "
                      + " | ".join(f"{c[k]:,}" for k in ("parts", "hash", "exchange",
                                                          "examine", "repeat", "new"))
                      + " |", flush=True)
            if args.baseline:
                now, then = counts["now"], counts[args.baseline]
                print(f"| {size:,} B | now / {args.baseline} | "
                      + " | ".join(f"{now[k] / then[k]:.2f}" for k in
                                   ("parts", "hash", "exchange", "examine", "repeat", "new"))
                      + " |", flush=True)
        return 0
    if args.quick:
        args.requests, args.repeat, args.entries = 2, 1, 2000
    sizes = [int(s) for s in args.sizes.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    modules: dict[str, tuple[ModuleType, int | None]] = {"now": (current, None)}
    if args.every_stamp:
        modules["now, every stamp"] = (current, 0)
    if args.baseline:
        modules[args.baseline] = (load_baseline(args.baseline), None)
    print(f"# prompt-cache doctor, CPU per request (best of {args.repeat} runs of "
          f"{args.requests} requests; process CPU, us; {args.text} prompts"
          + (f"; runs of this tree and of {args.baseline} interleaved" if args.baseline else "")
          + ")\n")
    print("| prompt | block | doctor | blocks | keys | parts | hash | exchange (hit) | examine "
          "| total, repeated prompt | total, new prompt | total, new tail |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in sizes:
        for block in blocks:
            requests = max(1, args.requests if size < 100_000 else args.requests // 5)
            costs = doctor_costs(modules, size, block, requests, args.repeat, args.text)
            for name, c in costs.items():
                print(f"| {size:,} B | {block} | {name} | {c['blocks']:.0f} | {c['keys']:.0f} "
                      f"| {c['parts']:.0f} | {c['hash']:.0f} | {c['exchange']:.0f} "
                      f"| {c['examine']:.0f} | {c['repeat']:.0f} | {c['new']:.0f} "
                      f"| {c['tail']:.0f} |", flush=True)
            if args.baseline:
                now, then = costs["now"], costs[args.baseline]
                print(f"| {size:,} B | {block} | now / {args.baseline} | | | "
                      + " | ".join(f"{now[k] / then[k]:.2f}" for k in
                                   ("parts", "hash", "exchange", "examine", "repeat", "new",
                                    "tail"))
                      + " |", flush=True)
    print("\n| block | keyed blake2b chain, ns/block | keyed digest of 24 bytes, ns "
          "| XXH3-128, ns/block |")
    print("| ---: | ---: | ---: | ---: |")
    for block in blocks:
        h = hash_costs(block, max(64, 4096 // max(1, block // 64) if not args.quick else 64),
                       args.repeat)
        xxh3 = f"{h['xxh3_ns']:.0f}" if "xxh3_ns" in h else "(xxhash not installed)"
        print(f"| {block} | {h['blake2b_chain_ns']:.0f} | {h['keyed_short_ns']:.0f} | {xxh3} |",
              flush=True)
    print("\n| block | doctor | index bytes/entry | index entries per KB of prompt |")
    print("| ---: | --- | ---: | ---: |")
    for block in blocks:
        for name, (module, _) in modules.items():
            per_entry, per_kb = entry_bytes(module, block, args.entries, args.text)
            print(f"| {block} | {name} | {per_entry:.0f} | {per_kb:.2f} |", flush=True)
    print(f"\nBYTES_PER_ENTRY = {BYTES_PER_ENTRY}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
