"""Run a test command while CPU burners keep every core busy, as on a loaded CI machine.

Usage::

    python benchmarks/under_load.py                        # the README's and .ci/run's: python -m pytest
    python benchmarks/under_load.py --rounds 2             # twice, burners running throughout
    python benchmarks/under_load.py -- python -m pytest tests/test_faults.py -q

Starts ``--burners`` processes that spin (default: one per core), runs the command
``--rounds`` times, stops the burners, prints each round's exit code, wall time and the
load average, and exits 1 if any round failed. The burners only take CPU; whatever else
runs on the machine adds to the load, so say what did when reporting a result.

Ctrl-C reaches the command with the rest of the terminal's process group; a SIGTERM to
this script is passed on to the command as SIGINT, so that pytest still tears its
servers down. Either way the script waits for the command, then stops the burners.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from types import FrameType

BURN = "while True: pass"


def _default_sigint() -> None:
    # A command started from a shell that ignores SIGINT (a background job) would
    # inherit that, and then neither Ctrl-C nor a passed-on SIGTERM could stop it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("command", nargs="*", help="default: python -m pytest")
    args = parser.parse_args(argv)
    command = args.command or [sys.executable, "-m", "pytest"]

    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
    running: list[subprocess.Popen[bytes]] = []
    interrupted = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        interrupted = True
        if signum == signal.SIGTERM:
            for proc in running:
                proc.send_signal(signal.SIGINT)
        # SIGINT: the command got it too (the terminal's process group); wait for it

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    lines, failed = [], False
    try:
        print(f"under_load: {args.burners} burner(s); command: {' '.join(command)}", flush=True)
        for round_ in range(1, args.rounds + 1):
            start = time.monotonic()
            proc = subprocess.Popen(command, preexec_fn=_default_sigint)
            running[:] = [proc]
            code = proc.wait()
            running.clear()
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            lines.append(
                f"round {round_}/{args.rounds}: exit {code} in {time.monotonic() - start:.0f} s, "
                f"load average {load}"
            )
            failed = failed or code != 0
            if interrupted:
                break
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait()
    for line in lines:
        print(f"under_load: {line}")
    verdict = "INTERRUPTED" if interrupted else "FAIL" if failed else "PASS"
    print(f"under_load: {verdict} ({args.burners} burner(s))")
    return 1 if failed or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
