"""Per-round ratios of two targets' CPU per event, from a ``run.py`` log.

    python benchmarks/run.py --targets direct,proxy-doctor,proxy-nodoctor --loads 64 --rounds 15 > run.log
    python benchmarks/paired.py run.log proxy-doctor/proxy-nodoctor [a/b ...]

(The prompt-cache doctor is on by default, so ``proxy`` is ``proxy-doctor`` now; the
doctor's price is ``proxy-doctor/proxy-nodoctor``.)

Why: on this shared 2-core machine one target's CPU per event moves by 10-15 % from one
round to the next, and the rounds' medians of two targets inherit that. ``run.py``
runs every target once per round, one after the other, so the two runs of a round
saw the same machine: the ratio within a round cancels what moves slowly (another
tenant, the host's frequency), and the median of the rounds' ratios, with its
interquartile range, says how sure a difference of a few percent is. Reads the
``# round N LOAD TARGET: ... cpu/ev X us`` lines ``run.py`` prints, for load 64 by
default (``--load``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

LINE = re.compile(r"# round (\d+) (\S+) (\S+): .*cpu/ev ([\d.]+) us")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log", help="run.py's standard output")
    p.add_argument("pairs", nargs="+", help="TARGET/BASELINE")
    p.add_argument("--load", default="64")
    a = p.parse_args(argv)
    rounds: dict[int, dict[str, float]] = {}
    with open(a.log, encoding="utf-8") as fh:
        for line in fh:
            m = LINE.match(line)
            if m and m[2] == a.load:
                rounds.setdefault(int(m[1]), {})[m[3]] = float(m[4])
    for pair in a.pairs:
        target, _, baseline = pair.partition("/")
        ratios = [r[target] / r[baseline] for _, r in sorted(rounds.items())
                  if target in r and baseline in r]
        if not ratios:
            print(f"{pair}: no round has both", file=sys.stderr)
            return 1
        q = sorted(ratios)
        n = len(q)
        print(f"{target} / {baseline}: median of {n} per-round ratios {statistics.median(q):.3f} "
              f"(interquartile {q[n // 4]:.3f}-{q[(3 * n) // 4]:.3f}, all {q[0]:.3f}-{q[-1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
