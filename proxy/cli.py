"""Command line: ``llm-latency-proxy {serve,simulate,bench,demo,healthcheck,workload,diagnose}``.

Design: ``docs/design/serve.md``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from proxy import __version__
from proxy.errors import CliError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-latency-proxy",
        description=(
            "OpenAI-compatible instrumenting reverse proxy: measures time to first token "
            "(TTFT), inter-token latency (ITL), tokens and queue time per request and "
            "exports them as Prometheus histograms."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from proxy import demo, diagnose, healthcheck, serve, workload_cli
    from proxy.bench import cli as bench_cli
    from proxy.simulator import cli as simulator_cli

    for module in (serve, simulator_cli, bench_cli, demo, healthcheck, workload_cli, diagnose):
        module.add_parser(sub)

    # healthcheck reads PID 1's command line as this program would: handed down, so that
    # no sub-command imports this module.
    sub.choices["healthcheck"].set_defaults(program=build_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except CliError as exc:
        # As argparse says a bad argument, unless the command's lines begin otherwise.
        prefix = getattr(args, "error_prefix", None) or f"{parser.prog} {args.command}: error"
        print(f"{prefix}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
