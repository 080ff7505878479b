"""The whole proxy's instructions and simulated cache misses per event, the doctor on
against off: the paired CPU figure's counterpart that the machine's noise cannot move.

    python benchmarks/proxy_instructions.py --prompt-bytes 2048
    python benchmarks/proxy_instructions.py --prompt-bytes 2048 --prompt-shape varied
    python benchmarks/proxy_instructions.py --prompt-bytes 32768 --functions 12

Why: ``run.py``'s CPU per event, paired per round (``paired.py``), moves by tens of
percent from one round to the next on a shared machine; instruction counts do not.
Each target (``serve``, and ``serve --no-prefix-doctor``) runs under ``valgrind
--tool=cachegrind`` (Debian's ``valgrind``) in front of the fake upstream, twice: with
``--streams`` streams per user and with three times as many. The difference over the
extra streams, divided by their events (the ``data:`` lines the clients received,
as ``run.py`` counts them), is what one event costs, with start-up and shut-down taken out. Reported:
instructions (Ir), first-level misses (I1 and D1, read and write) and last-level
misses, and an estimate of cycles, ``Ir + 10 x first-level + 100 x last-level``
(cachegrind's manual gives this rough model; its caches are simulated, not the
machine's). ``--functions N``: the N functions (the interpreter's and the extensions'
native functions) whose instructions per event differ most between the two targets.

What it is not: the 64-stream load at full speed. Under valgrind the proxy runs tens of
times slower, so the upstream's schedule is slowed (``--ttft``, ``--itl``) to keep it
within one core. The doctor's batches then hold a job or two, where at full speed they
hold about ten: each job pays a batch's fixed cost alone, so the doctor's share here is,
in that respect, an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fake_upstream  # noqa: E402
import loadgen  # noqa: E402
from run import free_port, wait_port  # noqa: E402

# cachegrind's summary events, as it names them
EVENTS = ("Ir", "I1mr", "ILmr", "D1mr", "DLmr", "D1mw", "DLmw")
TARGETS = {"proxy": [], "proxy-nodoctor": ["--no-prefix-doctor"]}


def counts(out_file: Path) -> dict[str, int]:
    """The totals of a cachegrind output file, by event."""
    text = out_file.read_text()
    names = re.search(r"^events:\s+(.+)$", text, re.M)
    totals = re.search(r"^summary:\s+(.+)$", text, re.M)
    if names is None or totals is None:
        raise RuntimeError(f"no totals in {out_file}")
    return dict(zip(names.group(1).split(), map(int, totals.group(1).split()), strict=True))


def by_function(out_file: Path) -> dict[str, int]:
    """Instructions (Ir) per function of a cachegrind output file, summed over its files
    and lines."""
    ir, fn = 0, ""
    out: dict[str, int] = {}
    with out_file.open() as f:
        for line in f:
            if line.startswith("events:"):
                ir = line.split()[1:].index("Ir")
            elif line.startswith("fn="):
                fn = line[3:].rstrip("\n")
            elif line[:1].isdigit() and fn:
                out[fn] = out.get(fn, 0) + int(line.split()[1 + ir])
    return out


def function_difference(runs: dict[str, tuple[Path, Path, int]]) -> dict[str, float]:
    """Per function, instructions per extra event with the doctor on less with it off;
    ``runs`` holds each target's two files and the extra events between them."""
    each = {}
    for name, (few, many, events) in runs.items():
        a, b = by_function(few), by_function(many)
        each[name] = {fn: (b.get(fn, 0) - a.get(fn, 0)) / events for fn in a.keys() | b.keys()}
    on, off = each["proxy"], each["proxy-nodoctor"]
    return {fn: on.get(fn, 0.0) - off.get(fn, 0.0) for fn in on.keys() | off.keys()}


async def one_run(a: argparse.Namespace, upstream: str, flags: list[str], streams: int,
                  out_file: Path) -> tuple[dict[str, int], int]:
    """One proxy under cachegrind, ``streams`` streams per user through it, then stopped:
    its totals, and the events its clients received."""
    port = free_port()
    proc = start_proxy(upstream, port, flags, out_file)
    try:
        await asyncio.to_thread(wait_port, port, proc, a.start_timeout)
        await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz")
        cfg = loadgen.LoadConfig(
            url=f"http://127.0.0.1:{port}/v1", concurrency=a.users, duration=3600, warmup=0,
            tokens=a.tokens, streams=streams, stagger=a.ttft + a.itl * a.tokens,
            stream_timeout=600, prompt_bytes=a.prompt_bytes, prompt_shape=a.prompt_shape)
        out = await loadgen.run_load(cfg)
        if out["ok"] != a.users * streams or out["errors"]:
            raise RuntimeError(f"streams broke under the proxy: {out}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 120)
    return counts(out_file), int(out["events_all"])


def start_proxy(upstream: str, port: int, flags: list[str], out_file: Path) -> subprocess.Popen[bytes]:
    """``serve`` in front of ``upstream`` under cachegrind, its counts to ``out_file``."""
    return subprocess.Popen(
        ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--cachegrind-out-file={out_file}",
         sys.executable, "-m", "proxy", "serve", "--upstream", upstream, "--port", str(port),
         *flags],
        cwd=HERE.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)


def _get(url: str) -> None:
    with urllib.request.urlopen(url, timeout=60) as resp:
        resp.read()


def per_event(few: tuple[dict[str, int], int], many: tuple[dict[str, int], int]) -> dict[str, float]:
    """What one event of the extra streams cost, by event kind, and the cycle estimate."""
    events = many[1] - few[1]
    d = {k: (many[0].get(k, 0) - few[0].get(k, 0)) / events for k in EVENTS}
    d["L1"] = d["I1mr"] + d["D1mr"] + d["D1mw"]
    d["LL"] = d["ILmr"] + d["DLmr"] + d["DLmw"]
    d["cycles"] = d["Ir"] + 10 * d["L1"] + 100 * d["LL"]
    return d


async def main_async(a: argparse.Namespace) -> int:
    stop, ready = asyncio.Event(), asyncio.Event()
    ports: list[int] = []
    schedule = fake_upstream.Schedule(a.ttft, a.itl, a.tokens)
    serving = asyncio.create_task(
        fake_upstream.serve("127.0.0.1", 0, schedule, ready, ports, stop))
    await asyncio.wait_for(ready.wait(), 30)
    upstream = f"http://127.0.0.1:{ports[0]}/v1"
    results: dict[str, dict[str, float]] = {}
    split: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            files: dict[str, tuple[Path, Path, int]] = {}
            for name, flags in TARGETS.items():
                runs, paths = [], []
                for streams in (a.streams, 3 * a.streams):
                    paths.append(Path(tmp) / f"{name}-{streams}.out")
                    runs.append(await one_run(a, upstream, flags, streams, paths[-1]))
                results[name] = per_event(runs[0], runs[1])
                files[name] = (paths[0], paths[1], runs[1][1] - runs[0][1])
            if a.functions:
                split = function_difference(files)
    finally:
        stop.set()
        await serving
    on, off = results["proxy"], results["proxy-nodoctor"]
    print(f"# per event, {a.users} users x {2 * a.streams} extra streams of {a.tokens} tokens, "
          f"a {a.prompt_bytes:,}-byte prompt ({a.prompt_shape}); cachegrind\n")
    print("| per event | doctor on | doctor off | on / off |\n| --- | ---: | ---: | ---: |")
    for key, label in (("Ir", "instructions"), ("L1", "first-level misses"),
                       ("LL", "last-level misses"), ("cycles", "cycles (estimate)")):
        print(f"| {label} | {on[key]:,.1f} | {off[key]:,.1f} | {on[key] / off[key]:.3f} |")
    if split:
        print(f"\n| function | instructions per event, on less off (of {on['Ir'] - off['Ir']:,.0f}) |"
              "\n| --- | ---: |")
        for fn, diff in sorted(split.items(), key=lambda kv: -abs(kv[1]))[:a.functions]:
            print(f"| `{fn}` | {diff:,.1f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-bytes", type=int, default=2048)
    loadgen.add_prompt_shape(p)
    p.add_argument("--users", type=int, default=16, help="concurrent streams")
    p.add_argument("--streams", type=int, default=2, help="streams per user, the smaller run")
    p.add_argument("--tokens", type=int, default=50)
    p.add_argument("--ttft", type=float, default=0.25, help="the slowed upstream's, seconds")
    p.add_argument("--itl", type=float, default=0.1, help="the slowed upstream's, seconds")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--functions", type=int, default=0, metavar="N",
                   help="also the N functions whose instructions per event differ most")
    return fake_upstream.run_loop(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
