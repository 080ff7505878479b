"""``llm-latency-proxy healthcheck``: the container image's ``HEALTHCHECK``.

Design: ``docs/design/relay-and-export.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PROGRAM = "llm-latency-proxy"
_ANY_ADDRESS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


@dataclass(frozen=True, slots=True)
class Target:
    """What to ask: ``host:port`` for a server, or ``None`` with the reason there is none."""

    command: str
    host: str | None = None
    port: int | None = None
    reason: str = ""


def our_arguments(cmdline: Sequence[str]) -> list[str] | None:
    """The arguments after ``llm-latency-proxy`` (or ``python -m proxy``) in a command
    line, or None when the command line does not run this program."""
    for i, arg in enumerate(cmdline):
        if os.path.basename(arg) == PROGRAM:
            return list(cmdline[i + 1:])
        if arg == "-m" and cmdline[i + 1:i + 2] == ["proxy"]:
            return list(cmdline[i + 2:])
    return None


Program = Callable[[], argparse.ArgumentParser]
"""The program's own command-line parser (:func:`proxy.cli.build_parser`, which the
command line hands down as ``args.program``): a command line is read as it would."""


def target_for(cmdline: Sequence[str] | None, environ: Mapping[str, str],
               program: Program) -> Target:
    """Where the command in ``cmdline`` listens, with ``environ`` as its environment,
    reading ``cmdline`` with the parser ``program`` builds.

    Raises :class:`proxy.config_values.SettingsError` when ``serve``'s settings are invalid
    (then it is not serving either).
    """
    from proxy import config

    arguments = our_arguments(cmdline or []) or ["serve"]
    # the server's own warnings (an old flag's name) were its to print, at its start:
    # a check every few seconds would fill the health log with them
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            args, _ = program().parse_known_args(arguments)
        except SystemExit:  # argparse's exit: the command line is not one of ours
            args, _ = program().parse_known_args(["serve"])
        command: str = args.command
        settings = config.from_sources(args, environ) if command == "serve" else None
    if settings is not None:
        host, port = settings.host, settings.port
    elif command == "simulate":
        host, port = args.host, args.port
    else:
        return Target(command, reason=f"'{command}' runs no server")
    if port == 0:
        return Target(command, reason="port 0 is chosen at start-up and cannot be known here")
    return Target(command, _ANY_ADDRESS.get(host, host), port)


def check(host: str, port: int, path: str, timeout: float) -> str | None:
    """None when ``GET path`` answers 2xx within ``timeout``, else what went wrong."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", path, headers={"connection": "close"})
        response = connection.getresponse()
        response.read()
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
    if not 200 <= response.status < 300:
        return f"status {response.status}"
    return None


def read_cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:  # no /proc (not Linux), or the process is gone
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "healthcheck",
        help="exit 0 if the server this container runs answers (the image's HEALTHCHECK)",
        description="Find the command this container runs (the command line of --pid) and, "
        "for serve and simulate, ask its health endpoint on the port it listens on; bench "
        "and demo run no server and count as healthy. Exit 0 healthy, 1 not.",
    )
    parser.add_argument("--pid", type=int, default=1,
                        help="process whose command line says what runs (default: 1, the "
                        "container's entry point)")
    parser.add_argument("--path", default="/healthz", help="path to ask (default: /healthz)")
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="seconds to wait for the answer (default: 2)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from proxy.config import process_env
    from proxy.config_values import SettingsError

    if os.path.isdir("/proc/self") and not os.path.exists(f"/proc/{args.pid}"):
        # a process that is gone runs nothing: not the default command's port to ask
        print(f"{PROGRAM} healthcheck: unhealthy: no process {args.pid}", file=sys.stderr)
        return 1
    try:
        target = target_for(read_cmdline(args.pid), process_env(), args.program)
    except SettingsError as exc:
        print(f"{PROGRAM} healthcheck: unhealthy: {exc}", file=sys.stderr)
        return 1
    if target.host is None or target.port is None:
        print(f"{PROGRAM} healthcheck: {target.command}: nothing to ask ({target.reason})")
        return 0
    host = f"[{target.host}]" if ":" in target.host else target.host
    url = f"http://{host}:{target.port}{args.path}"
    problem = check(target.host, target.port, args.path, args.timeout)
    if problem:
        print(f"{PROGRAM} healthcheck: {target.command}: {url} unhealthy: {problem}",
              file=sys.stderr)
        return 1
    print(f"{PROGRAM} healthcheck: {target.command}: {url} ok")
    return 0
