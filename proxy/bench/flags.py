"""``bench``'s flags and their checks: what a run may be asked, and the one-line reason
a combination cannot be run (exit status 2 before anything is sent)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from proxy.deprecated import RenamedFlag
from proxy.errors import CliError

API_CHOICES = ("chat", "completions", "responses", "messages")
DEFAULT_BASE_URL = "http://127.0.0.1:8080/v1"
DEFAULT_MODEL = "sim-llm"
DEFAULT_BLOCK_SIZE = 512  # proxy.workload_file.DEFAULT_BLOCK_SIZE, without importing it here


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--base-url",
        metavar="URL",
        help=f"OpenAI base URL including /v1 [env OPENAI_BASE_URL; default {DEFAULT_BASE_URL}]",
    )
    parser.add_argument(
        "--api",
        choices=API_CHOICES,
        default="chat",
        help="API to send: chat (/chat/completions), completions (/completions), "
        "responses (/responses) or messages (/messages, Anthropic) [default %(default)s]",
    )
    parser.add_argument(
        "--reasoning",
        action="store_true",
        help="Ask for reasoning: chat reasoning_effort low, Responses reasoning effort low, "
        "Messages thinking with a 1024-token budget (not with --api completions)",
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help=f"Model name sent in each request [default {DEFAULT_MODEL}; with --workload-file the "
        "recorded model]",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="Key sent upstream, as a Bearer token (x-api-key for --api messages) "
        "[default: env OPENAI_API_KEY, or ANTHROPIC_API_KEY for --api messages, else none]",
    )
    parser.add_argument(
        "--requests",
        metavar="N",
        type=int,
        help="Requests to send [default 100, or no limit with --duration]",
    )
    parser.add_argument(
        "--duration",
        metavar="S",
        type=float,
        help="Stop sending new requests after this many seconds; in-flight ones finish",
    )
    parser.add_argument(
        "--concurrency",
        metavar="N",
        type=int,
        help="Requests in flight at once (closed loop) [default 8]; with --rate: a cap",
    )
    parser.add_argument(
        "--rate",
        metavar="PER_S",
        type=float,
        help="Open loop: requests per second with Poisson arrivals (seeded)",
    )
    parser.add_argument(
        "--prompt-tokens",
        metavar="N",
        type=int,
        default=256,
        help="Approximate prompt length [default %(default)s]",
    )
    parser.add_argument(
        "--shared-prefix-tokens",
        metavar="N",
        type=int,
        default=0,
        help="Leading prompt tokens identical across requests (prefix-cache friendly) [default %(default)s]",
    )
    parser.add_argument(
        "--max-tokens",
        metavar="N",
        type=int,
        default=128,
        help="max_tokens per request [default %(default)s]",
    )
    parser.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=0,
        help="Seed for prompts and arrivals [default %(default)s]",
    )
    parser.add_argument(
        "--timeout",
        metavar="S",
        type=float,
        default=600.0,
        help="Per-request read timeout in seconds [default %(default)s]",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        help="Write every per-request record and the summary as JSON ('-' for stdout)",
    )
    parser.add_argument(
        "--compare-metrics",
        metavar="URL",
        help="The proxy's /metrics URL to compare with [default: <base-url minus /v1>/metrics if it "
        "serves llm_proxy_ metrics]",
    )
    parser.add_argument(
        "--no-compare", action="store_true", help="Do not look for the proxy's metrics"
    )
    parser.add_argument("--no-progress", action="store_true", help="No progress output on stderr")
    parser.add_argument(
        "--prompt-tokens-max",
        metavar="N",
        type=int,
        help="Vary the prompt length: each prompt between --prompt-tokens and N tokens "
        "(uniform, seeded), so the report can show TTFT against prompt length",
    )
    parser.add_argument(
        "--report",
        metavar="FILE",
        help="Write a self-contained HTML report of the run: client CDFs with the proxy's "
        "figures on top, TTFT against prompt length, decode rates, errors, settings",
    )
    parser.add_argument(
        "--compare",
        metavar="JSON",
        help="With --report: draw another run (its --json file) beside this one",
    )
    replay = parser.add_argument_group(
        "replaying a workload",
        "Send a workload file's requests (--workload-file, the Mooncake trace format) at their "
        "recorded times, with "
        "prompts of the recorded lengths whose shared blocks are byte-identical, and set "
        "the replay beside what the file recorded (docs/workload.md).",
    )
    replay.add_argument(
        "--workload-file",
        metavar="FILE",
        nargs="+",
        action="extend",
        help="Workload file(s) or quoted glob(s), e.g. one per proxy worker; read as one",
    )
    replay.add_argument(
        "--trace", dest="workload_file", nargs="+", action=RenamedFlag, new="--workload-file"
    )
    replay.add_argument(
        "--speedup",
        metavar="F",
        type=float,
        default=1.0,
        help="Send the workload F times faster (arrival gaps divided by F) [default %(default)s]",
    )
    replay.add_argument(
        "--ignore-eos",
        action="store_true",
        help="Add ignore_eos to chat and completions bodies so the answer has the recorded "
        "length (vLLM, SGLang; OpenAI refuses unknown fields)",
    )
    replay.add_argument(
        "--block-size",
        metavar="TOKENS",
        type=int,
        help="Tokens per hash id when the file does not say [default "
        f"{DEFAULT_BLOCK_SIZE}, the Mooncake traces' and AIPerf's]",
    )
    replay.add_argument(
        "--simulate",
        metavar="KNOBS",
        nargs="?",
        const="",
        help="Replay against the built-in simulator started with these simulate flags "
        '(quoted, e.g. "--slots 16 --prefill-rate 20000"; one flag alone as '
        "--simulate=--slots=16), not against --base-url: what-if without an upstream",
    )


def _validate_replay(args: argparse.Namespace) -> None:
    if not args.workload_file:
        if args.simulate is not None:
            raise CliError(
                "--simulate replays a workload against the simulator: give --workload-file"
            )
        if args.speedup != 1.0 or args.ignore_eos or args.block_size is not None:
            raise CliError("--speedup, --ignore-eos and --block-size go with --workload-file")
        return
    if args.rate is not None:
        raise CliError("--rate: a workload file brings its own arrival times (use --speedup)")
    if args.reasoning:
        raise CliError(
            "--reasoning: not with --workload-file (recorded output lengths include any reasoning)"
        )
    if args.shared_prefix_tokens or args.prompt_tokens_max is not None:
        raise CliError(
            "--shared-prefix-tokens and --prompt-tokens-max: a workload file brings its own prompts"
        )
    if not (args.speedup > 0 and math.isfinite(args.speedup)):
        raise CliError("--speedup must be a number > 0")
    if args.block_size is not None and args.block_size < 1:
        raise CliError("--block-size must be >= 1")
    if args.simulate is not None and args.base_url is not None:
        raise CliError("--simulate replays against the simulator: leave out --base-url")


def validate(args: argparse.Namespace) -> None:
    """Raises the one-line reason the flags cannot make a run."""
    _validate_replay(args)
    if args.base_url is None and args.simulate is None:
        from proxy.config import process_env

        args.base_url = process_env().get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    if args.requests is not None and args.requests < 1:
        raise CliError("--requests must be >= 1")
    if args.duration is not None and args.duration <= 0:
        raise CliError("--duration must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        raise CliError("--concurrency must be >= 1")
    if args.rate is not None and args.rate <= 0:
        raise CliError("--rate must be > 0")
    if args.prompt_tokens < 1 or args.max_tokens < 1:
        raise CliError("--prompt-tokens and --max-tokens must be >= 1")
    if not 0 <= args.shared_prefix_tokens <= args.prompt_tokens:
        raise CliError("--shared-prefix-tokens must be between 0 and --prompt-tokens")
    if args.base_url is not None and not args.base_url.startswith(("http://", "https://")):
        raise CliError("--base-url must be an http(s) URL")
    if args.reasoning and args.api == "completions":
        raise CliError("--reasoning: the completions API has no way to ask for reasoning")
    if args.prompt_tokens_max is not None and args.prompt_tokens_max < args.prompt_tokens:
        raise CliError("--prompt-tokens-max must be >= --prompt-tokens")
    if args.compare and not args.report:
        raise CliError("--compare needs --report")
