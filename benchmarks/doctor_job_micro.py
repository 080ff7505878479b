"""The prompt-cache doctor's whole per-request path, in instructions per request.

    python benchmarks/doctor_job_micro.py --baseline /tmp/before-REV
    python benchmarks/doctor_job_micro.py --baseline /tmp/before-REV --sizes 2048,32768

Why: ``prefix_micro.py`` prices the doctor's steps (parts, keys, the index, the report);
the proxy also pays for the job around them, per request: ``PrefixCheck.begin``, the
job made ready on the first token (its estimate, its place, its batch), the batch run,
the finish's ``settle`` and ``record``. This runs exactly those calls, as the request
path makes them, for a stream whose chat prompt (one user message of ``--sizes`` bytes,
the load client's words) every request repeats: the load of ``run.py --prompt-bytes``.

It counts instead of timing (a loaded machine moves CPU times by tens of percent): each
tree runs in a child process under ``valgrind --tool=cachegrind`` (Debian's
``valgrind``) twice, with ``--requests`` and with five times as many, and the
difference over the extra requests is the instructions one request executes. The
baseline is another checkout's ``proxy/`` (``git worktree add /tmp/before-REV REV``, or
``git archive REV | tar -x -C DIR``), run the same way: compare the two as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_requests(requests: int, size: int) -> int:
    """``requests`` requests through one ``PrefixCheck``, as ``proxy.routes`` drives it;
    how many of them the doctor found repeated whole."""
    from loadgen import prompt_text  # type: ignore[import-not-found]

    from proxy.dialects import CHAT
    from proxy.doctor.job import BATCH_JOBS, PrefixCheck
    from proxy.upstream_spec import UpstreamSpec

    body = {
        "model": "bench",
        "stream": True,
        "messages": [{"role": "user", "content": prompt_text(size)}],
        "max_tokens": 50,
        "stream_options": {"include_usage": True},
    }
    raw = len(json.dumps(body))
    spec = UpstreamSpec(name="up", url="http://127.0.0.1:1/v1", models=("*",), default=True)

    repeated = 0

    async def main() -> None:
        nonlocal repeated
        check, clock = PrefixCheck(), time.perf_counter
        jobs = []
        for _ in range(requests):
            t0 = clock()
            job = check.begin(CHAT, body, spec, t0, 200, raw, t_headers=t0, stream=True)
            assert job is not None
            job.ready(clock())  # the first token
            jobs.append(job)
            if len(jobs) == BATCH_JOBS:  # the batch runs at the loop's next turn
                await asyncio.sleep(0)
                for job in jobs:
                    await job.settle()
                    record = job.record(size // 4, size // 4)
                    repeated += record is not None and record.repeated_bytes == size
                jobs = []
        check.close()

    asyncio.run(main())
    return repeated


def instructions(tree: Path, requests: int, size: int) -> int:
    """The instructions a child process running ``requests`` requests executes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(tree), str(HERE))))
    out = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, __file__, "--child", str(requests), "--sizes", str(size)],
        env=env, capture_output=True, text=True, check=True,
    ).stderr
    found = re.search(r"I\s+refs:\s+([\d,]+)", out)
    if found is None:
        raise RuntimeError(f"no instruction count from cachegrind:\n{out[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="a checkout whose proxy/ is the before (required)")
    p.add_argument("--sizes", default="2048,32768", help="prompt bytes, comma-separated")
    p.add_argument("--requests", type=int, default=500, help="the smaller run's requests")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.child:  # one tree's run, under cachegrind (or alone, as a smoke test)
        repeated = run_requests(a.child, sizes[0])
        print(f"{a.child} requests, {repeated} found repeated whole")
        return 0
    if not a.baseline:
        p.error("--baseline is required")
    trees = {"now": HERE.parent, "baseline": Path(a.baseline)}
    print("# the doctor's per-request path, instructions per request (cachegrind)\n")
    print("| prompt | now | baseline | now / baseline |\n| ---: | ---: | ---: | ---: |")
    for size in sizes:
        per = {}
        for name, tree in trees.items():
            few, many = (instructions(tree, n, size) for n in (a.requests, 5 * a.requests))
            per[name] = (many - few) / (4 * a.requests)
        print(f"| {size:,} B | {per['now']:,.0f} | {per['baseline']:,.0f} | "
              f"{per['now'] / per['baseline']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
