"""``bench --workload-file FILE --simulate "KNOBS"``: the replay against the simulator.

What-if without an upstream: ``llm-latency-proxy simulate`` with the given knobs runs in
a process of its own (its clock then never waits on the client's parsing) on a loopback
port the kernel picks; the knobs are checked first by ``simulate``'s own parser.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shlex
import sys
from collections.abc import AsyncIterator

from proxy.errors import CliError

_FORBIDDEN = ("--host", "--port", "--profiles")
_ANNOUNCED = re.compile(r" at (http://127\.0\.0\.1:\d+/v1)")
START_TIMEOUT_S = 60.0


class KnobError(CliError, ValueError):
    """The knobs do not make a simulator; the message says why."""


def check_knobs(knobs: str) -> list[str]:
    """``knobs`` as ``simulate`` arguments, checked; raises :class:`KnobError`."""
    from proxy.simulator import cli as simulator_cli
    from proxy.simulator.model import ConfigError

    try:
        argv = shlex.split(knobs)
    except ValueError as exc:
        raise KnobError(f"--simulate: {exc}") from None
    for arg in argv:
        if arg.split("=", 1)[0] in _FORBIDDEN:
            raise KnobError(
                f"--simulate: {arg.split('=', 1)[0]} is chosen by bench (loopback, a free port)"
            )

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]
            raise KnobError(f"--simulate: {message}")

    parser = Parser(prog="bench --simulate", add_help=False)
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    simulator_cli.add_parser(sub)
    args = parser.parse_args(["simulate", *argv])
    try:
        simulator_cli.config_from_args(args)
    except ConfigError as exc:
        raise KnobError(f"--simulate: {exc}") from None
    return argv


@contextlib.asynccontextmanager
async def simulator(argv: list[str]) -> AsyncIterator[str]:
    """``python -m proxy simulate --host 127.0.0.1 --port 0 ARGV`` in a subprocess;
    yields its base URL once it listens (its start-up line says so), stops it
    (SIGTERM, then SIGKILL when it does not end in time) on the way out."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-u",  # unbuffered: its start-up line arrives as it is written
        "-m",
        "proxy",
        "simulate",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    assert proc.stderr is not None
    said: list[str] = []
    url = None
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            while url is None:
                line = await proc.stderr.readline()
                if not line:
                    break
                text = line.decode("utf-8", "replace")
                said.append(text)
                match = _ANNOUNCED.search(text)
                if match:
                    url = match[1]
    except TimeoutError:
        pass
    if url is None:
        await _stop(proc)
        raise RuntimeError("the simulator did not start:\n" + "".join(said[-20:]))

    async def drain() -> None:  # keep its pipe from filling; its lines are not ours
        assert proc.stderr is not None
        while await proc.stderr.readline():
            pass

    drainer = asyncio.create_task(drain())
    try:
        yield url
    finally:
        await _stop(proc)
        drainer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drainer


def _die_with_parent() -> None:
    """In the child, before it runs: a SIGTERM when bench dies, however it dies (a
    SIGKILL runs no ``finally``), so no simulator is left listening."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            async with asyncio.timeout(10.0):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
