"""CPU time of the prompt-cache doctor's steps inside a running proxy (a diagnostic).

    LLM_PROXY_DOCTOR_TIMING=/tmp/doctor-timing PYTHONPATH=$PWD/benchmarks/timing_shim \\
        python benchmarks/run.py --sweep '' --targets proxy-doctor --loads 64 --rounds 1
    cat /tmp/doctor-timing-*.txt

Why: the doctor's cost per request in the proxy is several times its cost in a tight
loop (``benchmarks/prefix_micro.py``), because code that runs once between waits runs
with cold CPU caches, and the 64-stream benchmark's CPU per event is too noisy to see a
few microseconds per request. Python imports this file at start-up when its directory is
on ``PYTHONPATH`` (every process of the run; only the proxy imports the doctor; an
absolute path, since ``run.py`` starts the proxy in another directory). When
``LLM_PROXY_DOCTOR_TIMING`` is set it wraps the doctor's steps in ``time.thread_time_ns``
(the thread's own CPU time, so waits for the GIL or the CPU do not count) and every 100
finished requests writes ``<prefix>-<pid>.txt``: per step its calls, mean microseconds
per call and per finished request, each inclusive of the steps inside it, and the
garbage collector's passes. The request log's and the workload capture's writers are timed
too (on the loop, and in their thread per batch), to compare what each costs a request. Each wrapper
adds two clock reads (about 0.8 us each on this machine, a system call), so nested
figures run high by a few microseconds; the outer ones (``begin``, ``ready``,
``start``, ``record``, ``observe``) are what one request pays; to time only those (fewer
clock reads inside them), set ``LLM_PROXY_DOCTOR_TIMING_STEPS=begin,ready,start,record,observe``
(``observe`` holds a finding; ``flush`` observes the findings held, a batch at a time).
The ``gc`` line counts every collection in the process, whoever's objects it visits
(``gc0``-``gc2``: by generation); a step's time leaves out the collections that ran
inside it. Requests are counted as ``Metrics.observe`` records them, so the ``gc``
lines read the same with the doctor off (``--targets proxy-nodoctor``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

_PREFIX = os.environ.get("LLM_PROXY_DOCTOR_TIMING", "")


def _install(prefix: str) -> None:
    import gc
    import time

    import proxy.dialects.chat as chat
    import proxy.doctor.examine as doctor
    import proxy.doctor.index as index
    import proxy.doctor.job as check
    import proxy.doctor.keys as keys
    import proxy.doctor.metrics as prefix_metrics
    import proxy.metrics as metrics
    import proxy.reqlog as reqlog
    import proxy.workload_capture as capture

    clock = time.thread_time_ns
    stats: dict[str, list[int]] = {}
    collections = stats.setdefault("gc", [0, 0])
    generations = [stats.setdefault(f"gc{g}", [0, 0]) for g in range(3)]

    def wrap(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)
        totals = stats.setdefault(label, [0, 0])

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, collected = clock(), collections[1]
            try:
                return inner(*args, **kwargs)
            finally:
                totals[0] += 1  # a collection that ran inside the step is the gc line's
                totals[1] += clock() - start - (collections[1] - collected)

        setattr(owner, name, timed)

    def dump() -> None:
        requests = max(finished[0], 1)
        with open(f"{prefix}-{os.getpid()}.txt", "w") as out:
            for label, (calls, ns) in stats.items():
                out.write(f"{label:12s} calls={calls:8d} mean={ns / max(calls, 1) / 1000:8.2f} us"
                          f"  per request={ns / requests / 1000:8.2f} us\n")

    wanted = os.environ.get("LLM_PROXY_DOCTOR_TIMING_STEPS", "")
    for owner, name, label in (
        (check.PrefixCheck, "begin", "begin"),
        (check.PrefixJob, "ready", "ready"),  # on the first token: its estimate and place
        (check.PrefixCheck, "estimate", "estimate"),
        (check.PrefixCheck, "enqueue", "enqueue"),
        (check.PrefixJob, "start", "start"),
        (check.PrefixCheck, "run_batch", "batch"),  # one turn of a batch: its calls, per job
        (check.PrefixJob, "examine", "look"),
        (chat.ChatDialect, "prompt", "parts"),
        (keys.PromptHasher, "hash", "hash"),
        (index.LruPrefixIndex, "exchange", "exchange"),
        (doctor, "examine", "examine"),
        (check.PrefixJob, "record", "record"),
        (prefix_metrics.PrefixMetrics, "hold", "observe"),  # at the finish
        (prefix_metrics.PrefixMetrics, "flush", "flush"),  # a batch of findings
        (capture.WorkloadCapture, "add", "capture_add"),  # on the loop
        (capture.WorkloadCapture, "_emit", "capture_emit"),  # in its writer thread, per batch
        (reqlog.RequestLog, "write", "reqlog_write"),
        (reqlog.RequestLog, "_emit", "reqlog_emit"),
    ):
        if not wanted or label in wanted.split(","):
            wrap(owner, name, label)
    started = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = clock()
        else:
            spent = clock() - started[0]
            for line in (collections, generations[info["generation"]]):
                line[0] += 1
                line[1] += spent

    gc.callbacks.append(on_gc)
    observed = metrics.Metrics.observe  # every request's finish, the doctor on or off
    finished = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        try:
            return observed(*args, **kwargs)
        finally:
            finished[0] += 1
            if finished[0] % 100 == 0:
                dump()

    metrics.Metrics.observe = counted  # type: ignore[method-assign]


if _PREFIX:
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from shim_hook import AfterImport  # benchmarks/shim_hook.py

    sys.meta_path.insert(0, AfterImport('proxy.routes', lambda: _install(_PREFIX)))
