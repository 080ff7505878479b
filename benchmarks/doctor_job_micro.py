"""The prompt-cache doctor's whole per-request path, in instructions per request.

    python benchmarks/doctor_job_micro.py --baseline /tmp/before-REV
    python benchmarks/doctor_job_micro.py --baseline /tmp/before-REV --sizes 2048,32768
    python benchmarks/doctor_job_micro.py --opcodes --sizes 2048

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

``--opcodes`` says where those instructions go, in this tree alone: the bytecodes one
request executes in ``proxy/``, per function (``sys.settrace`` with opcode events over
the second half of ``--requests``, after the first half filled the doctor's caches;
the event loop's own code is left out, a NamedTuple's ``__new__`` it calls is in as
``<string>:<lambda>``), so that a change can aim at the functions that
run the most of them. A bytecode is tens of machine instructions.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

HERE = Path(__file__).resolve().parent


def run_requests(
    requests: int, size: int, opcodes: collections.Counter[str] | None = None, shape: str = "repeated"
) -> int:
    """``requests`` requests through one ``PrefixCheck``, as ``proxy.routes`` drives it;
    how many of them the doctor found repeated whole. ``opcodes``: counts the bytecodes
    of the second half's requests, by ``file:function`` (of ``proxy/`` only). ``shape``:
    as ``loadgen --prompt-shape`` (``varied``: the prompt a system message, then a
    question of each request's own)."""
    from loadgen import chat_messages, prompt_text  # type: ignore[import-not-found]

    import proxy
    from proxy.dialects import CHAT
    from proxy.doctor.job import BATCH_JOBS, PrefixCheck
    from proxy.upstream_spec import UpstreamSpec

    prompt = prompt_text(size)
    body = {
        "model": "bench",
        "stream": True,
        "messages": chat_messages(prompt, "repeated"),
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
        for n in range(requests):
            if opcodes is not None and n == traced_from(requests, BATCH_JOBS):
                sys.settrace(tracer)
            payload = body if shape == "repeated" else {
                **body, "messages": chat_messages(prompt, shape, n)}
            t0 = clock()
            job = check.begin(CHAT, payload, spec, t0, 200, raw, t_headers=t0, stream=True)
            assert job is not None
            job.ready(clock())  # the first token
            jobs.append(job)
            if len(jobs) == BATCH_JOBS:  # the batch runs at the loop's next turn
                await asyncio.sleep(0)
                for job in jobs:
                    if not getattr(job, "settled", False):  # as proxy.routes (older trees: always)
                        await job.settle()
                    record = job.record  # its tokens: worked out in the metrics' batch
                    if callable(record):  # older trees: the finish worked them out
                        record = record(size // 4, size // 4)
                    repeated += record is not None and record.repeated_bytes == size
                jobs = []
        sys.settrace(None)
        check.close()

    package = str(Path(proxy.__file__).parent)  # this tree's proxy/

    def tracer(frame: FrameType, event: str, _arg: object) -> Callable[..., object] | None:
        code, caller = frame.f_code, frame.f_back
        ours = code.co_filename.startswith(package) or (  # a NamedTuple's __new__: "<string>"
            code.co_filename == "<string>"
            and caller is not None
            and caller.f_code.co_filename.startswith(package)
        )
        if not ours:
            return None  # the loop's and this harness's own: not the doctor's
        frame.f_trace_opcodes = True
        if event == "opcode" and opcodes is not None:
            opcodes[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return tracer

    asyncio.run(main())
    return repeated


def traced_from(requests: int, batch: int) -> int:
    """The first request traced: the first of a batch, past half of them."""
    return -(-requests // 2 // batch) * batch


def print_opcodes(requests: int, size: int, shape: str = "repeated") -> None:
    """The bytecodes one request executes, per function, most first (a markdown table)."""
    from proxy.doctor.job import BATCH_JOBS

    requests -= requests % BATCH_JOBS  # whole batches: the last runs too
    counts: collections.Counter[str] = collections.Counter()
    run_requests(requests, size, counts, shape)
    traced = requests - traced_from(requests, BATCH_JOBS)
    total = sum(counts.values())
    print(f"# {size:,} B prompt: {total / traced:,.0f} bytecodes per request "
          f"({traced} requests traced)\n")
    print("| function | bytecodes per request | share |\n| --- | ---: | ---: |")
    for name, n in counts.most_common():
        if n / total < 0.005:
            break
        print(f"| `{name}` | {n / traced:,.1f} | {n / total:.1%} |")
    print()


def instructions(tree: Path, requests: int, size: int, shape: str = "repeated") -> int:
    """The instructions a child process running ``requests`` requests executes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(tree), str(HERE))))
    out = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, __file__, "--child", str(requests), "--sizes", str(size),
         "--prompt-shape", shape],
        env=env, capture_output=True, text=True, check=True,
    ).stderr
    found = re.search(r"I\s+refs:\s+([\d,]+)", out)
    if found is None:
        raise RuntimeError(f"no instruction count from cachegrind:\n{out[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> int:
    from loadgen import add_prompt_shape

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="a checkout whose proxy/ is the before (required)")
    p.add_argument("--sizes", default="2048,32768", help="prompt bytes, comma-separated")
    p.add_argument("--requests", type=int, default=500, help="the smaller run's requests")
    p.add_argument("--opcodes", action="store_true",
                   help="bytecodes per request, per function, in this tree (no valgrind)")
    add_prompt_shape(p)
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.opcodes:
        for size in sizes:
            print_opcodes(a.requests, size, a.prompt_shape)
        return 0
    if a.child:  # one tree's run, under cachegrind (or alone, as a smoke test)
        repeated = run_requests(a.child, sizes[0], shape=a.prompt_shape)
        print(f"{a.child} requests, {repeated} found repeated whole")
        return 0
    if not a.baseline:
        p.error("--baseline is required")
    trees = {"now": HERE.parent, "baseline": Path(a.baseline)}
    print(f"# the doctor's per-request path, instructions per request (cachegrind), "
          f"{a.prompt_shape} prompts\n")
    print("| prompt | now | baseline | now / baseline |\n| ---: | ---: | ---: | ---: |")
    for size in sizes:
        per = {}
        for name, tree in trees.items():
            few, many = (instructions(tree, n, size, a.prompt_shape)
                         for n in (a.requests, 5 * a.requests))
            per[name] = (many - few) / (4 * a.requests)
        print(f"| {size:,} B | {per['now']:,.0f} | {per['baseline']:,.0f} | "
              f"{per['now'] / per['baseline']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
