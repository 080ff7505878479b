"""``llm-latency-proxy simulate``: run the simulated OpenAI- and Anthropic-compatible upstream.

Design: ``docs/design/simulator.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import socket
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from proxy.simulator import PROFILES, get_profile
from proxy.simulator.model import OUTPUT_DISTS, SimConfig

if TYPE_CHECKING:
    import uvicorn

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000  # where `llm-latency-proxy serve` looks for its upstream by default


def _number(
    kind: type[int] | type[float], low: float, high: float = math.inf, *, open_low: bool = False
) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            value = kind(raw)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {what}: {raw!r}") from None
        if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
            rule = f"> {low}" if open_low else f">= {low}"
            if high != math.inf:
                rule += f" and <= {high}"
            raise argparse.ArgumentTypeError(f"must be {rule} (got {raw})")
        return value

    return parse


def _names(kind: str, known: Collection[str] = ()) -> Callable[[str], tuple[str, ...]]:
    """Comma-separated ``kind`` names, at least one; only ``known`` ones if given."""

    def parse(raw: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in raw.split(",") if part.strip())
        if not names:
            raise argparse.ArgumentTypeError(f"needs at least one {kind} name")
        for name in names:
            if known and name not in known:
                choices = ", ".join(known)
                raise argparse.ArgumentTypeError(f"unknown {kind} {name!r} (known: {choices})")
        return names

    return parse


_GIVEN = "given_flags"  # namespace attribute: dests of the flags the command line set


class _Store(argparse.Action):
    """``store``, noting that the flag was given (a profile must not override it; no
    speed flag is a boolean, so the booleans need not note it)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, _GIVEN, (*getattr(namespace, _GIVEN, ()), self.dest))


# flag name -> (parser, metavar, help). Booleans have parser None.
_FLAGS: dict[str, tuple[Callable[[str], Any] | None, str, str]] = {
    "slots": (
        _number(int, 1),
        "N",
        "Decode slots: requests generated at once (like vLLM --max-num-seqs). Requests "
        "beyond them wait in a FIFO queue; that wait is their queue time.",
    ),
    "prefill_rate": (
        _number(float, 0, open_low=True),
        "TOK/S",
        "Prefill speed in uncached prompt tokens per second, on one compute lane "
        "shared by all requests (a burst of long prompts queues behind itself).",
    ),
    "prefill_overhead": (
        _number(float, 0),
        "S",
        "Fixed seconds added to every request's time to first token "
        "(scheduling, sampling the first token).",
    ),
    "itl": (
        _number(float, 0),
        "S",
        "Inter-token latency in seconds of one decode step with a single active stream "
        "(0.02 s = 50 tokens/s).",
    ),
    "itl_growth": (
        _number(float, 0),
        "F",
        "Fractional ITL increase per additional active stream: a step takes "
        "itl * (1 + itl_growth * (active - 1)).",
    ),
    "jitter": (
        _number(float, 0, 1),
        "F",
        "Relative jitter of each decode step: uniform in [1 - F, 1 + F] times the step.",
    ),
    "tokens_per_chunk": (
        _number(int, 1),
        "K",
        "Tokens per decode step and SSE chunk (K > 1 mimics speculative "
        "decoding: fewer, larger chunks).",
    ),
    "chars_per_token": (
        _number(float, 0, open_low=True),
        "C",
        "Characters per token used to estimate prompt tokens from text.",
    ),
    "cache_block_tokens": (
        _number(int, 1),
        "N",
        "Prefix-cache block size in tokens; a prefix is reused in whole "
        "blocks of N * --chars-per-token characters.",
    ),
    "cache_blocks": (
        _number(int, 0),
        "N",
        "Prefix-cache capacity in blocks (least recently used evicted first); "
        "0 turns the prefix cache off.",
    ),
    "cached_tokens_factor": (
        _number(float, 0, 1),
        "F",
        "Report F times the prefix-cache hits as cached tokens (rounded down): an upstream "
        "that under-reports its cache. The hits still cost no prefill.",
    ),
    "report_cached_tokens": (
        None,
        "",
        "Report cached tokens in usage. Off: the field is absent, as from an upstream that "
        "does not report its cache (chat and completions without prompt_tokens_details, "
        "Responses without input_tokens_details, Messages without the cache fields and "
        "the whole prompt as input_tokens).",
    ),
    "output_tokens": (
        _number(int, 1),
        "N",
        "Mean output length in tokens when a request sets no max_tokens.",
    ),
    "output_dist": (
        None,
        "DIST",
        "Distribution of output lengths around --output-tokens: fixed, uniform "
        "(from N/2 to 3N/2) or exponential.",
    ),
    "stop_early": (
        None,
        "",
        "Let a request that sets max_tokens stop earlier (finish_reason 'stop') when "
        "the length drawn from --output-dist is shorter. Off: exactly max_tokens "
        "tokens, finish_reason 'length'.",
    ),
    "reasoning_tokens": (
        _number(int, 0),
        "N",
        "Reasoning tokens of a request that asks for reasoning (chat reasoning_effort, "
        "Responses reasoning, Messages thinking), generated before the answer and "
        "counted in its max tokens; 0: no reasoning output.",
    ),
    "max_model_len": (
        _number(int, 2),
        "N",
        "Context length: prompt plus max_tokens beyond it gets a 400 context_length_exceeded.",
    ),
    "error_rate": (
        _number(float, 0, 1),
        "P",
        "Fault injection: share of requests answered at once with --error-status.",
    ),
    "error_status": (_number(int, 400), "CODE", "HTTP status of injected errors (400..599)."),
    "drop_rate": (
        _number(float, 0, 1),
        "P",
        "Fault injection: share of streams whose connection is dropped after a random "
        "number of tokens (no finish chunk, no [DONE]).",
    ),
    "stream_error_rate": (
        _number(float, 0, 1),
        "P",
        "Fault injection: share of streams that end, after a random number of tokens, "
        "with the API's error event (HTTP status 200): chat and completions "
        'data: {"error": ...}, Responses response.failed, Messages event: error '
        "(overloaded_error).",
    ),
    "stall_rate": (
        _number(float, 0, 1),
        "P",
        "Fault injection: share of requests that stall once, before a random token.",
    ),
    "stall_seconds": (_number(float, 0), "S", "Length of an injected stall in seconds."),
    "vllm_metrics": (
        None,
        "",
        "Add vLLM-style per-request timings to the usage object (usage.metrics: "
        "queue_time_ms, prefill_time_ms, time_to_first_token_ms, decode_time_ms, "
        "e2e_time_ms).",
    ),
    "llamacpp_timings": (
        None,
        "",
        "Add llama.cpp-style timings to the last chunk of a chat or completions stream and "
        "to a non-stream body (timings: cache_n, prompt_n, prompt_ms, prompt_per_token_ms, "
        "prompt_per_second, predicted_n, predicted_ms, predicted_per_token_ms, "
        "predicted_per_second), as llama.cpp's server sends them whether or not usage was "
        "asked for.",
    ),
    "prefill_attention": (
        _number(float, 0),
        "S",
        "Extra prefill seconds per (1,000 tokens)^2: each computed token attends to every "
        "token before it, so prefill grows faster than linearly, as on a CPU engine "
        "[default 0: linear].",
    ),
    "models": (
        _names("model"),
        "NAMES",
        "Comma-separated model names listed by /v1/models. Requests may name any model "
        "(it is echoed back) unless --strict-models.",
    ),
    "strict_models": (None, "", "Answer 404 model_not_found for models not in --models."),
    "api_key": (
        str,
        "KEY",
        "Require 'Authorization: Bearer KEY' or 'x-api-key: KEY'; without it, no key is needed.",
    ),
    "seed": (
        int,
        "N",
        "Seed of the per-request random numbers: same seed and same arrival "
        "order give the same lengths, words, jitter and faults.",
    ),
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, except a flag with none (``None`` or empty): its
    help says what happens without it, and "(default: None)" would say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == "":
            return action.help
        return super()._get_help_string(action)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "simulate",
        help="run a simulated OpenAI/Anthropic-compatible upstream (no GPU, no API key)",
        description=(
            "Run an OpenAI- and Anthropic-compatible server (chat completions, "
            "completions, Responses, Messages) whose latencies follow the physics of an "
            "LLM server: decode slots and a FIFO queue, prefill time proportional to "
            "uncached prompt tokens, a prefix cache, inter-token latency that grows "
            "with the number of active streams, and optional faults. Point the proxy at "
            "it with: llm-latency-proxy serve --upstream http://127.0.0.1:8000/v1"
        ),
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="Interface to listen on.")
    parser.add_argument(
        "--port",
        type=_number(int, 0),
        default=DEFAULT_PORT,
        help="Port to listen on.",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn log level.",
    )
    parser.add_argument("--access-log", action="store_true", help="Log every request (uvicorn).")
    speeds = "; ".join(f"{p.name}: {p.describe()}" for p in PROFILES.values())
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument(
        "--profile",
        choices=tuple(PROFILES),
        help=f"Speed profile ({speeds}). Sets --prefill-overhead, --prefill-rate, --itl and "
        "--itl-growth; any of them given on the command line wins.",
    )
    choice.add_argument(
        "--profiles",
        type=_names("profile", PROFILES),
        metavar="NAMES",
        help="Comma-separated speed profiles, e.g. fast,slow: one simulator per profile in "
        "this process, profile i on --port + i (every other flag applies to all of them).",
    )
    defaults = SimConfig()
    group = parser.add_argument_group("latency model and faults")
    for f in fields(SimConfig):
        parse, metavar, help_text = _FLAGS[f.name]
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kind: dict[str, Any] = {"action": _Store, "type": parse, "metavar": metavar}
        if f.name == "output_dist":
            kind = {"action": _Store, "choices": OUTPUT_DISTS}
        elif parse is None:
            kind = {"action": argparse.BooleanOptionalAction}
        aliases: tuple[str, ...] = ()
        if f.name == "models":  # one flag for a tuple: comma-separated, and an alias
            aliases, default = ("--model",), ",".join(default)
        group.add_argument(flag, *aliases, dest=f.name, default=default, help=help_text, **kind)
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace, profile: str | None = None) -> SimConfig:
    """The configuration the flags describe, with speed profile ``profile`` (default:
    ``--profile``) under the speed flags given explicitly."""
    values = {f.name: getattr(args, f.name) for f in fields(SimConfig)}
    name = profile or getattr(args, "profile", None)
    if name:
        given = set(getattr(args, _GIVEN, ()))
        values.update({k: v for k, v in get_profile(name).fields().items() if k not in given})
    return SimConfig(**values)


def profile_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The profiles to serve: ``--profiles``, else ``--profile``, else none."""
    if getattr(args, "profiles", None):
        return tuple(args.profiles)
    profile = getattr(args, "profile", None)
    return (profile,) if profile else ()


def _describe(config: SimConfig) -> str:
    return (
        f"models: {', '.join(config.models)}; {config.slots} slots, "
        f"TTFT {config.prefill_overhead * 1000:g} ms + prompt tokens / "
        f"{config.prefill_rate:g} tok/s, ITL {config.itl * 1000:g} ms, seed {config.seed}"
    )


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


# -- uvicorn servers run in-process by a command that owns the signals: ``simulate
# --profiles`` (one server per profile) and ``demo`` (simulators and the proxy on one
# loop). The sockets are bound before anything is announced, so a taken port fails the
# command first; the servers install no signal handlers, the command stops them all.


def listen(host: str, port: int, *, or_free: bool = False) -> socket.socket:
    """A listening, non-blocking socket on ``host:port`` (0: a free port); with
    ``or_free``, on a free port when ``port`` is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for candidate in (port, 0) if port and or_free else (port,):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, candidate))
            sock.listen(2048)
        except OSError:
            sock.close()
            if candidate == 0 or not or_free:
                raise
            continue
        sock.setblocking(False)
        return sock
    raise OSError("no port")  # pragma: no cover - the last candidate raises


def command_server(config: uvicorn.Config) -> uvicorn.Server:
    """A server whose signals belong to the command that runs it."""
    import uvicorn

    class CommandServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return CommandServer(config)


def _uvicorn_config(args: argparse.Namespace, app: Any) -> uvicorn.Config:
    import uvicorn

    return uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=args.access_log,
        lifespan="on",
        server_header=False,
        timeout_graceful_shutdown=5,
    )


def run(args: argparse.Namespace) -> int:
    configs = [(name, config_from_args(args, name)) for name in profile_names(args) or ("",)]
    if len(configs) > 1:
        return _serve_many(args, configs)
    import uvicorn

    from proxy.logs import quiet_unfinished_responses
    from proxy.simulator.app import create_simulator_app

    name, config = configs[0]
    try:  # bound before the URL is announced: a taken port is said as such, not after it
        sock = listen(args.host, args.port)
    except OSError as exc:
        from proxy.serve import listen_problem

        print(
            f"llm-latency-proxy simulate: error: {listen_problem(args.host, args.port, exc)}",
            file=sys.stderr,
        )
        return 2
    quiet_unfinished_responses()  # its drops are on purpose
    app = create_simulator_app(config)
    profile = f" (profile {name})" if name else ""
    print(  # the socket listens: a client that read this line can connect (--port 0 too)
        f"llm-latency-proxy simulate: OpenAI/Anthropic-compatible upstream{profile} at "
        f"{_url(args.host, sock.getsockname()[1])} ({_describe(config)})",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(_uvicorn_config(args, app))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        sock.close()
    return 0


def _serve_many(args: argparse.Namespace, configs: list[tuple[str, SimConfig]]) -> int:
    """One uvicorn server per profile, all on one event loop; ports bound up front, so a
    taken port fails the command before anything serves."""
    import asyncio
    import signal

    from proxy.logs import quiet_unfinished_responses
    from proxy.simulator.app import create_simulator_app

    last = args.port + len(configs) - 1
    if args.port and last > 65535:
        print(
            f"llm-latency-proxy simulate: error: --port {args.port} + {len(configs) - 1} "
            "profiles goes past port 65535",
            file=sys.stderr,
        )
        return 2
    sockets: list[socket.socket] = []
    for i in range(len(configs)):
        port = args.port + i if args.port else 0
        try:
            sockets.append(listen(args.host, port))
        except OSError as exc:
            for sock in sockets:
                sock.close()
            print(
                f"llm-latency-proxy simulate: error: cannot listen on {args.host}:{port} "
                f"for profile {configs[i][0]}: {exc}",
                file=sys.stderr,
            )
            return 2

    quiet_unfinished_responses()  # its drops are on purpose
    servers = [command_server(_uvicorn_config(args, create_simulator_app(c))) for _, c in configs]

    async def serve_all() -> None:
        loop = asyncio.get_running_loop()

        def stop(sig: signal.Signals) -> None:
            for server in servers:  # a second Ctrl-C forces the exit, as uvicorn's own
                server.handle_exit(sig, None)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)
        # Announced once the sockets listen and the signals are handled: from this line
        # on, a client can connect and SIGTERM stops the servers gracefully.
        for (name, config), sock in zip(configs, sockets, strict=True):
            print(
                f"llm-latency-proxy simulate: profile {name} at "
                f"{_url(args.host, sock.getsockname()[1])} ({_describe(config)})",
                file=sys.stderr,
                flush=True,
            )
        await asyncio.gather(
            *(server.serve(sockets=[sock]) for server, sock in zip(servers, sockets, strict=True))
        )

    try:
        asyncio.run(serve_all())
    finally:
        for sock in sockets:
            sock.close()
    return 0
