"""Per-round ratios of two targets' CPU per event, and differences of their latencies,
from ``run.py`` logs.

    python benchmarks/run.py --targets direct,proxy,proxy-nodoctor --loads 64 --rounds 15 \\
        > run.log 2> run.err
    python benchmarks/paired.py run.err proxy/proxy-nodoctor [a/b ...]
    python benchmarks/paired.py run.err --pool other.err proxy/proxy-nodoctor

(The prompt-cache doctor is on by default: its price is ``proxy/proxy-nodoctor``.)

Why: on this shared 2-core machine one target's CPU per event moves by 10-15 % from one
round to the next, and the rounds' medians of two targets inherit that. ``run.py``
runs every target once per round, one after the other, so the two runs of a round
saw the same machine: the ratio within a round cancels what moves slowly (another
tenant, the host's frequency), and the median of the rounds' ratios, with its
interquartile range, says how sure a difference of a few percent is. The same holds
for latency: per round, the target's TTFT p50 and p99 and ITL p99 minus the baseline's
(the direct connection's figure cancels out of "added"). Reads the ``# round N LOAD
TARGET: ...`` lines ``run.py`` prints on its standard error, for load 64 by default
(``--load``); ``--pool`` adds the rounds of more logs (runs of the same code), and
prints each run's median ratio. A side may name several targets of the same code
joined by ``+`` (``proxy+proxy-before/proxy-nodoctor`` when both run one tree): per
round, the geometric mean of their CPU per event and the mean of their latencies, so
that what one process of that code reads apart from another (its own, for the whole
run) weighs less; ``proxy/proxy-before`` over the same tree shows how far apart.
``--bootstrap N`` adds how sure the median ratio is: its 90 % interval over N
resamples, and how many of them are at or below ``--bar``. A run's rounds share its
processes, and runs of the same code differ by more than their rounds say; so pooled
runs are resampled in two stages, the runs first and then the rounds of each run drawn,
and the interval widens with the spread between runs.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
from collections.abc import Callable

LINE = re.compile(
    r"# round (\d+) (\S+) (\S+): ttft p50 ([\d.]+) p99 ([\d.]+) ms, "
    r"itl p99 ([\d.]+) ms, .*cpu/ev ([\d.]+|n/a) us"
)
Round = dict[str, tuple[float, ...]]  # target -> (cpu/ev, ttft p50, ttft p99, itl p99)


def read_rounds(paths: list[str], load: str) -> list[tuple[int, Round]]:
    """Every round of ``load`` in the logs, in order, with the number of its log: per
    target, its figures."""
    rounds: dict[tuple[int, int], Round] = {}
    for n, path in enumerate(paths):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                m = LINE.match(line)
                if m and m[2] == load:
                    cpu = float(m[7]) if m[7] != "n/a" else float("nan")
                    figures = (cpu, float(m[4]), float(m[5]), float(m[6]))
                    rounds.setdefault((n, int(m[1])), {})[m[3]] = figures
    return [(k[0], rounds[k]) for k in sorted(rounds)]


def side(r: Round, name: str) -> tuple[float, ...] | None:
    """A side's figures in round ``r``: a target's, or for targets joined by ``+`` the
    geometric mean of their CPU per event and the mean of their latencies; None when the
    round lacks one of them."""
    names = name.split("+")
    if any(n not in r for n in names):
        return None
    if len(names) == 1:
        return r[name]
    rows = [r[n] for n in names]
    cpu = statistics.geometric_mean([row[0] for row in rows])
    return (cpu, *(statistics.fmean(row[i] for row in rows) for i in range(1, len(rows[0]))))


def spread(values: list[float], fmt: Callable[[float], str]) -> str:
    q = sorted(values)
    n = len(q)
    return (
        f"{fmt(statistics.median(q))} (interquartile {fmt(q[n // 4])}-"
        f"{fmt(q[(3 * n) // 4])}, all {fmt(q[0])}-{fmt(q[-1])})"
    )


def bootstrap(runs: list[list[float]], resamples: int, below: float) -> str:
    """A 90 % interval of the median by resampling (seeded: the same logs give the same
    interval): the runs, then the rounds of each run drawn; and the share of resampled
    medians at or below ``below``. One run: its rounds alone."""
    pick = random.Random(1).choices

    def resample() -> float:
        drawn = pick(runs, k=len(runs)) if len(runs) > 1 else runs
        return statistics.median([v for run in drawn for v in pick(run, k=len(run))])

    medians = sorted(resample() for _ in range(resamples))
    low, high = medians[resamples // 20], medians[resamples - 1 - resamples // 20]
    share = sum(m <= below for m in medians) / resamples
    return (
        f"90 % interval of the median {low:.3f}-{high:.3f} ({resamples} resamples), "
        f"{share:.0%} of them at or below {below:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", help="run.py's standard error (its round lines)")
    p.add_argument("pairs", nargs="+", help="TARGET/BASELINE (either: A+B, one code's targets)")
    p.add_argument("--pool", action="append", default=[], help="another run's log, pooled")
    p.add_argument("--load", default="64")
    p.add_argument(
        "--bootstrap",
        type=int,
        default=0,
        metavar="N",
        help="also a 90 %% interval of the median ratio from N resamples",
    )
    p.add_argument("--bar", type=float, default=1.03, help="the ratio --bootstrap weighs")
    a = p.parse_args(argv)
    rounds = read_rounds([a.log, *a.pool], a.load)
    for pair in a.pairs:
        target, _, baseline = pair.partition("/")
        both = [(n, t, b) for n, r in rounds
                if (t := side(r, target)) is not None and (b := side(r, baseline)) is not None]
        if not both:
            print(f"{pair}: no round has both", file=sys.stderr)
            return 1
        runs: dict[int, list[float]] = {}
        for n, t, b in both:
            runs.setdefault(n, []).append(t[0] / b[0])
        ratios = [v for run in runs.values() for v in run]
        print(
            f"{target} / {baseline}: median of {len(ratios)} per-round ratios "
            f"{spread(ratios, lambda v: f'{v:.3f}')}"
        )
        if len(runs) > 1:
            each = ", ".join(f"{statistics.median(run):.3f}" for run in runs.values())
            print(f"  median of each run's ratios: {each}")
        if a.bootstrap:
            print(f"  {bootstrap(list(runs.values()), a.bootstrap, a.bar)}")
        for i, name in ((1, "TTFT p50"), (2, "TTFT p99"), (3, "ITL p99")):
            diffs = [t[i] - b[i] for _, t, b in both]
            print(f"  {name} {target} - {baseline}, ms: {spread(diffs, lambda v: f'{v:+.3f}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
