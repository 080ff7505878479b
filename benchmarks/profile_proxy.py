"""Where does the proxy's CPU go per SSE event? py-spy under the benchmark's load.

    pip install py-spy
    python benchmarks/profile_proxy.py                    # 64 streams, 8 s, measuring on
    python benchmarks/profile_proxy.py --proxy-arg=--no-measure --raw /tmp/stacks.txt

Starts the fake upstream and one proxy (pinned like ``run.py``), runs a steady load with
``loadgen.py`` and meanwhile samples the proxy with ``py-spy record --format raw`` (idle
frames excluded, non-blocking so the proxy is not paused). It then prints the top
functions by *own* time (leaf frame of each sample) and by inclusive time, both as a
share of the proxy's busy samples and as microseconds of CPU per relayed SSE event
(CPU from /proc around the load, shared out in proportion to samples), and the share of
the samples inside the prompt-cache doctor: its job, batch, parts, keys, index, report
and metrics (a frame of ``proxy/doctor/`` or of the prompt's parts, :data:`DOCTOR`). That
share is its CPU at full speed, cold caches and garbage collections run inside it
included; the paired figure (``paired.py``) also holds what it costs the rest.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import add_prompt_shape  # type: ignore[import-not-found]
from run import Bench, cpu_seconds, parse_args  # type: ignore[import-not-found]

# A sample is the doctor's when a frame of its stack is one of these (file, or function)
DOCTOR = ("proxy/doctor/", "proxy/dialects/prompt.py", "_chat_prompt (", "ChatDialect.prompt (")


def _short(frame: str) -> str:
    """``func (path/to/file.py:12)`` -> ``func (file.py)`` so lines of one function merge."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{name} ({short})"


def _package(frame: str) -> str:
    """Which library a frame belongs to: ``aiohttp``, ``proxy.relay``, ``stdlib:json``...

    ``asyncio/runners.py`` own time is the event loop itself (uvloop's C code: epoll,
    socket reads and writes, callbacks), which py-spy charges to ``Runner.run``.
    """
    where = frame.partition(" (")[2].rstrip(")").rsplit(":", 1)[0]
    parts = Path(where).parts
    if parts and not where.startswith("/"):  # py-spy shortens site-packages paths
        if parts[0] == "proxy":
            return "proxy." + Path(*parts[1:]).with_suffix("").as_posix().replace("/", ".")
        if where == "asyncio/runners.py":
            return "event loop (uvloop C: syscalls, callbacks)"
        if parts[0] in sys.stdlib_module_names:
            return "stdlib:" + parts[0].removesuffix(".py")
        return parts[0].removesuffix(".py")
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1]
    if "proxy" in parts:
        i = len(parts) - 1 - parts[::-1].index("proxy")
        return "proxy." + Path(*parts[i + 1 :]).with_suffix("").as_posix().replace("/", ".")
    if where.endswith("asyncio/runners.py"):
        return "event loop (uvloop C: syscalls, callbacks)"
    if len(parts) >= 2 and parts[-2].startswith("python3"):
        return "stdlib:" + Path(parts[-1]).stem
    if len(parts) >= 3 and parts[-3].startswith("python3"):
        return "stdlib:" + parts[-2]
    return where or frame


def raw_stacks(text: str) -> list[tuple[str, int]]:
    """py-spy's raw stacks (``frame;frame;... count`` a line): each stack's frames, as
    one string, and its samples."""
    lines = (line.rpartition(" ") for line in text.splitlines())
    return [(frames, int(count)) for frames, _, count in lines if frames]


def doctor_samples(text: str) -> int:
    """The samples of py-spy's raw stacks with a frame of the prompt-cache doctor
    (:data:`DOCTOR`) anywhere in their stack."""
    return sum(n for frames, n in raw_stacks(text) if any(d in frames for d in DOCTOR))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", "-c", type=int, default=64)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--raw", default="", help="keep the collapsed stacks here")
    p.add_argument("--proxy-arg", action="append", default=[])
    p.add_argument("--native", action="store_true", help="py-spy --native (C frames)")
    p.add_argument("--prompt-bytes", type=int, default=None, help="as run.py's")
    add_prompt_shape(p)
    a = p.parse_args(argv)
    if not shutil.which("py-spy"):
        raise SystemExit("py-spy not found: pip install py-spy")
    extra = ["--prompt-shape", a.prompt_shape]
    if a.prompt_bytes is not None:
        extra += ["--prompt-bytes", str(a.prompt_bytes)]
    args = parse_args(["--proxy-arg=" + x for x in a.proxy_arg] + extra)
    bench = Bench(args)
    raw = Path(a.raw) if a.raw else bench.tmp / "stacks.txt"
    try:
        upstream = bench.start_upstream()
        target = bench.start_proxy(upstream, "proxy", [])
        bench.load(target, 4, True, 1.0, 0.0, 5, streams=2)  # warm-up
        pid = target.proc.pid if target.proc else 0
        spy = [
            "py-spy",
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(a.rate),
            "--nonblocking",
            "--duration",
            str(int(a.duration - 2)),
            "--format",
            "raw",
            "-o",
            str(raw),
        ]
        if a.native:
            spy.append("--native")
        cpu0 = cpu_seconds([pid])
        # py-spy starts 1.5 s into the load (steady state) and stops before it ends.
        spy_cmd = bench.pin(args.client_cpu) + spy
        spy_out: list[subprocess.CompletedProcess[bytes]] = []

        def record() -> None:
            spy_out.append(subprocess.run(spy_cmd, capture_output=True, timeout=a.duration + 30))

        spy_thread = threading.Timer(1.5, record)
        spy_thread.start()
        res = bench.load(target, a.concurrency, True, a.duration, 1.0, args.tokens)
        spy_thread.join(a.duration + 30)
        cpu = cpu_seconds([pid]) - cpu0
        if not raw.exists():
            err = spy_out[0].stderr.decode()[-1500:] if spy_out else "py-spy did not run"
            raise SystemExit(f"py-spy wrote nothing: {err}")
        text = raw.read_text()
    finally:
        bench.close()
    raw_counts = raw_stacks(text)
    total = sum(n for _, n in raw_counts) or 1
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    by_pkg: collections.Counter[str] = collections.Counter()
    for joined, n in raw_counts:
        frames = joined.split(";")
        by_pkg[_package(frames[-1])] += n
        short = [_short(f) for f in frames]
        own[short[-1]] += n
        for f in set(short):
            incl[f] += n
    per_event = cpu / max(res["events_all"], 1) * 1e6
    print(
        f"load: {a.concurrency} streams x {args.tokens} tokens, {res['events_all']} events, "
        f"broken {res['broken']}; proxy CPU {cpu:.2f} s = {per_event:.0f} us/event; "
        f"{total} busy samples"
    )
    doctor = doctor_samples(text)
    print(f"the prompt-cache doctor: {100 * doctor / total:.1f}% of busy samples, "
          f"{per_event * doctor / total:.1f} us per event")
    for title, counter in (
        ("own time, by library", by_pkg),
        ("own time", own),
        ("inclusive time (undercounted: some samples have partial stacks)", incl),
    ):
        print(f"\nTop {a.top} by {title} (share of busy samples, ~us per event):")
        for name, n in counter.most_common(a.top):
            print(f"  {100 * n / total:5.1f}%  {per_event * n / total:6.1f} us  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
