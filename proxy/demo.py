"""``llm-latency-proxy demo``: the whole product on one machine, no key, no GPU, no network.

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import random
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TextIO

from proxy.deprecated import NewName, RenamedFlag

if TYPE_CHECKING:
    import httpx
    import uvicorn

    from proxy.bench.promscrape import Snapshot


from proxy.demo_view import by_route, one_line, render, window
from proxy.simulator.cli import listen

READY_LINE = "demo: traffic is flowing"
# The simulated upstreams: (upstream label, model the demo sends, model patterns).
LOCAL = ("local", "sim-llm", ("sim-llm",))
CLOUD = ("cloud", "cloud-llm", ("cloud-*",))
# The support app's own server (see support_request): a quiet self-hosted one.
SUPPORT = ("support", "sim-support", ("sim-support",))
UPSTREAMS = (LOCAL[0], CLOUD[0], SUPPORT[0])
CLOUD_SHARE = 0.25  # of the steady traffic
SUPPORT_RATE_SHARE = 0.3  # the support app's requests per second, as a share of --rate
SUPPORT_INSTRUCTION_TOKENS = 2400  # the stable block after the timestamp, four bytes a token
SUPPORT_QUESTION_TOKENS = (20, 3000)  # a ticket pasted in: from a line to a long log
SUPPORT_MAX_TOKENS = 24  # short answers: what it costs is the first token


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the simulator, the proxy and a live workload; watch what the proxy measures",
        description=(
            "Start simulated OpenAI/Anthropic-compatible upstreams, the proxy in front of them "
            "and a steady mixed workload over chat completions, completions, Responses and "
            "Messages with periodic bursts, and an app that puts the time first in its system "
            "prompt (the live page's Prompt caching panel and What to fix card find it), and "
            "show the proxy's live TTFT, ITL, queue time, "
            "tokens, cache hit ratio, outcomes and figures per route, refreshed every second, "
            "until Ctrl-C. No API key, GPU or network needed."
        ),
    )
    add = parser.add_argument
    for flag, metavar, kind, default, text in (
        ("--host", "HOST", str, "127.0.0.1", "Interface for the proxy"),
        ("--port", "PORT", int, 8080, "Proxy port; a free one if this one is taken"),
        ("--duration", "S", float, None, "Stop after this many seconds"),
        ("--rate", "PER_S", float, 1.5, "Steady requests per second, Poisson arrivals"),
        ("--burst-every", "S", float, 15.0, "Seconds between bursts; 0: no bursts"),
        ("--burst-size", "N", int, 12, "Requests sent at once in a burst"),
        ("--slots", "N", int, 8, "The simulator's decode slots; bursts beyond them queue"),
        ("--window", "S", float, 5.0, "Seconds of history in the view's 'last' column"),
        ("--refresh", "S", float, 1.0, "Seconds between refreshes of the view"),
        ("--seed", "N", int, 0, "Seed for the workload and the simulator"),
    ):
        shown = "default: run until Ctrl-C" if default is None else "%(default)s"
        add(flag, metavar=metavar, type=kind, default=default, help=f"{text} [{shown}]")
    add(
        "--workload-file",
        metavar="FILE",
        default="",
        action=NewName,
        help="Capture the demo's traffic as a workload file (serve --workload-file), for "
        "bench --workload-file [default: none]",
    )
    add("--trace-file", dest="workload_file", action=RenamedFlag, new="--workload-file")
    add(
        "--workload-block-size",
        metavar="TOKENS",
        type=int,
        default=512,
        action=NewName,
        help="Prompt tokens per hash id in the workload file (serve --workload-block-size) "
        "[%(default)s]",
    )
    add(
        "--trace-block-size",
        dest="workload_block_size",
        type=int,
        action=RenamedFlag,
        new="--workload-block-size",
    )
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    for name in ("rate", "refresh", "window", "duration"):
        value = getattr(args, name)
        if value is not None and value <= 0:  # --duration: None, until Ctrl-C
            print(f"demo: --{name} must be > 0", file=sys.stderr)
            return 2
    if args.slots < 1 or args.burst_size < 0 or args.burst_every < 0:
        print("demo: --slots must be >= 1, --burst-size and --burst-every >= 0", file=sys.stderr)
        return 2
    if args.workload_block_size < 1:
        print("demo: --workload-block-size must be >= 1", file=sys.stderr)
        return 2
    if args.workload_file:
        folder = os.path.dirname(os.path.abspath(args.workload_file))
        if not os.path.isdir(folder):
            print(f"demo: --workload-file: no such directory {folder!r}", file=sys.stderr)
            return 2
    return asyncio.run(Demo(args, sys.stdout).main())


# -- workload --------------------------------------------------------------------------


def demo_profiles() -> list[Any]:
    """The mix: what a small product's traffic looks like to an inference server, over
    the four APIs (about half of it chat completions)."""
    from proxy.bench.workload import Profile

    return [
        # Chat turns behind a shared system prompt: short answers, mostly cached prefill.
        Profile("chat", prompt_tokens=400, shared_prefix_tokens=300, max_tokens=48, weight=4),
        # Same name, so the same system prompt; long answers hold decode slots for seconds.
        Profile("chat", prompt_tokens=500, shared_prefix_tokens=300, max_tokens=200),
        # Retrieval over the Responses API: long unique context, nothing cached, so a
        # long prefill and a high TTFT.
        Profile("rag", prompt_tokens=3000, max_tokens=96, weight=2, api="responses"),
        # An assistant over the Responses API that reasons before it answers.
        Profile("assistant", 600, 400, max_tokens=80, api="responses", reasoning=True),
        # Agent step over Anthropic Messages: long shared tool preamble, thinking first.
        Profile("agent", 2400, 2000, max_tokens=128, api="messages", reasoning=True),
        # Legacy completions: short autocomplete requests.
        Profile("autocomplete", prompt_tokens=200, max_tokens=16, api="completions"),
    ]


def support_instructions(seed: int) -> str:
    """The support app's long, stable system prompt (after the timestamp)."""
    from proxy.bench.workload import words

    rng = random.Random(f"support:{seed}")
    return "You are the support assistant. Instructions: " + words(
        rng, SUPPORT_INSTRUCTION_TOKENS)


def support_request(index: int, instructions: str, rng: random.Random, clock: str) -> Any:
    """One request of the support app: an app that puts the time first in its system
    prompt (``Current time is HH:MM:SS.``), then a long block of instructions that never
    changes, then the ticket. Every second the head changes, so no prefix cache can
    reuse the instructions after it: the prompt-cache doctor reports ``variable_before_stable``
    at message 0 (system), and the "What to fix" card's top lever for this model is
    prefill (each request computes the whole prompt again; moving the time after the
    instructions would let a cache serve them)."""
    from proxy.bench.workload import PlannedRequest, words

    question = f"Ticket {index}: " + words(rng, rng.randint(*SUPPORT_QUESTION_TOKENS))
    body = {
        "model": SUPPORT[1],
        "messages": [
            {"role": "system", "content": f"Current time is {clock}.\n\n{instructions}"},
            {"role": "user", "content": question},
        ],
        "max_tokens": SUPPORT_MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return PlannedRequest(index, "support", body, "chat")


# -- servers ---------------------------------------------------------------------------


def _server(app: Any) -> uvicorn.Server:
    import uvicorn

    from proxy.simulator.cli import command_server

    return command_server(uvicorn.Config(
        app, lifespan="on", log_level="error", access_log=False, timeout_graceful_shutdown=2))


# -- the demo --------------------------------------------------------------------------


class Demo:
    def __init__(self, args: argparse.Namespace, out: TextIO, *, tty: bool | None = None) -> None:
        self.args = args
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self.inflight: set[asyncio.Task[Any]] = set()
        self.completed = 0
        self.sent: Counter[str] = Counter()  # requests sent, by route
        self.ready_printed = False

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        # Faults are part of the show; the proxy's per-request warnings would wreck the view
        # (restored on the way out: the demo also runs inside other programs' processes).
        proxy_log = logging.getLogger("proxy")
        level = proxy_log.level
        proxy_log.setLevel(logging.ERROR)
        try:
            return await self._main(loop, stop)
        finally:
            proxy_log.setLevel(level)

    async def _main(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> int:
        import httpx

        from proxy.app import create_app
        from proxy.config import Settings
        from proxy.simulator import profile_config
        from proxy.simulator.app import create_simulator_app
        from proxy.simulator.model import SimConfig
        from proxy.upstream_spec import UpstreamSpec

        args = self.args

        sim_config = SimConfig(
            slots=args.slots,
            prefill_rate=6000.0,
            prefill_overhead=0.02,
            itl=0.025,
            itl_growth=0.03,
            jitter=0.2,
            error_rate=0.005,
            drop_rate=0.005,
            stream_error_rate=0.005,
            stall_rate=0.01,
            stall_seconds=1.0,
            vllm_metrics=True,
            seed=args.seed,
        )
        # The upstreams of LOCAL, CLOUD and SUPPORT. The support app's has its own slots
        # and prefill lane, no faults: its first token is its prompt's prefill.
        upstream_configs = (
            sim_config,
            profile_config("slow", sim_config),
            replace(sim_config, prefill_rate=10_000.0, prefill_overhead=0.03, itl=0.01,
                    itl_growth=0.005, error_rate=0.0, drop_rate=0.0, stream_error_rate=0.0,
                    stall_rate=0.0),
        )
        socks = [listen("127.0.0.1", 0) for _ in upstream_configs]
        sim_url, cloud_url, support_url = (
            f"http://127.0.0.1:{sock.getsockname()[1]}/v1" for sock in socks
        )
        proxy_sock = listen(args.host, args.port, or_free=True)
        proxy_port = proxy_sock.getsockname()[1]
        host = f"[{args.host}]" if ":" in args.host else args.host
        proxy_root = f"http://{host}:{proxy_port}"
        # What a config file with three [[upstream]] tables gives: model -> upstream.
        specs = (
            UpstreamSpec(LOCAL[0], sim_url, models=LOCAL[2], default=True),
            UpstreamSpec(CLOUD[0], cloud_url, models=CLOUD[2]),
            UpstreamSpec(SUPPORT[0], support_url, models=SUPPORT[2]),
        )
        workload_file = getattr(args, "workload_file", "")  # absent when embedded without it
        # The doctor (on by default, said here too: the demo shows what it finds).
        settings = Settings(upstreams=specs, host=args.host, port=proxy_port,
                            prefix_doctor=True, workload_file=workload_file,
                            workload_block_size=getattr(args, "workload_block_size", 512))
        servers = [_server(create_simulator_app(c)) for c in upstream_configs]
        servers.append(_server(create_app(settings)))
        running = [
            (server, asyncio.create_task(server.serve(sockets=[sock])))
            for server, sock in zip(servers, [*socks, proxy_sock], strict=True)
        ]
        tasks: list[asyncio.Task[Any]] = []
        http = httpx.AsyncClient(
            timeout=httpx.Timeout(120.0, connect=5.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,
        )
        try:
            for server, task in running:
                while not server.started:  # uvicorn's own flag; no event to wait on
                    if task.done():
                        await task  # surfaces the start-up error
                        raise RuntimeError("server stopped during start-up")
                    await asyncio.sleep(0.01)
            note = f" (port {args.port} is taken)" if args.port and proxy_port != args.port else ""
            self.say(f"demo: live page at {proxy_root}/ui")
            self.say(
                f"demo: simulator at {sim_url} ({args.slots} decode slots), upstream "
                f"{LOCAL[0]!r} for model {LOCAL[1]}"
            )
            self.say(
                f"demo: simulator at {cloud_url} (slow profile), upstream {CLOUD[0]!r} for "
                f"models {', '.join(CLOUD[2])} ({CLOUD_SHARE:.0%} of the traffic)"
            )
            self.say(
                f"demo: simulator at {support_url} (10,000 prompt tokens/s), upstream {SUPPORT[0]!r} for "
                f"model {SUPPORT[1]}: an app that puts the time first in its system prompt"
            )
            self.say(f"demo: proxy at {proxy_root}/v1{note}")
            self.say(f"demo: metrics at {proxy_root}/metrics")
            if workload_file:
                self.say(f"demo: workload capture to {workload_file} (replay: llm-latency-proxy "
                         f"bench --workload-file {workload_file} --simulate \"--slots {args.slots}\")")
            self.say(
                f"demo: try  curl -s {proxy_root}/metrics | grep llm_proxy_time_to_first_token"
            )
            tasks.append(asyncio.create_task(self.steady(http, proxy_root + "/v1")))
            tasks.append(asyncio.create_task(self.support(http, proxy_root + "/v1")))
            if args.burst_every and args.burst_size:
                tasks.append(asyncio.create_task(self.bursts(http, proxy_root + "/v1")))
            view = asyncio.create_task(self.view(http, proxy_root + "/metrics", proxy_root))
            tasks.append(view)
            waits = [asyncio.create_task(stop.wait()), view]
            await asyncio.wait(waits, timeout=args.duration, return_when=asyncio.FIRST_COMPLETED)
            waits[0].cancel()
            if view.done() and not view.cancelled() and view.exception() is not None:
                raise view.exception()  # type: ignore[misc]
        finally:
            # Restore default Ctrl-C handling: a second one interrupts a stuck shutdown.
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
            await self.shutdown(tasks, http, running[::-1])  # the proxy first
        self.say(f"demo: stopped after {self.completed} completed requests")
        return 0

    async def shutdown(
        self,
        tasks: list[asyncio.Task[Any]],
        http: httpx.AsyncClient,
        servers: Sequence[tuple[uvicorn.Server, asyncio.Task[Any]]],
    ) -> None:
        for task in [*tasks, *self.inflight]:
            task.cancel()
        await asyncio.gather(*tasks, *self.inflight, return_exceptions=True)
        await http.aclose()
        for server, task in servers:
            server.should_exit = True
            try:
                await asyncio.wait_for(task, timeout=5.0)
            except (TimeoutError, asyncio.CancelledError):
                server.force_exit = True
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def say(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    # -- traffic ------------------------------------------------------------------------

    def _launch(self, http: httpx.AsyncClient, base: str, planned: Any) -> None:
        """Send one request to its API's path under ``base`` (the proxy's ``/v1``)."""
        from proxy.bench.client import send
        from proxy.bench.workload import API_PATHS, route_of

        self.sent[route_of(planned.api)] += 1
        model = planned.body.get("model")
        self.sent[next((u[0] for u in (CLOUD, SUPPORT) if u[1] == model), LOCAL[0])] += 1

        async def one() -> None:
            result = await send(http, base + API_PATHS[planned.api], planned)
            if result.ok:
                self.completed += 1
                if not self.ready_printed:
                    self.ready_printed = True
                    self.say(
                        f"{READY_LINE}: first request completed in {result.total_s * 1000:.0f} ms"
                    )

        task = asyncio.create_task(one())
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)

    async def steady(self, http: httpx.AsyncClient, base: str) -> None:
        from proxy.bench.workload import iter_requests, poisson_arrivals

        local = iter_requests(demo_profiles(), model=LOCAL[1], seed=self.args.seed)
        cloud = iter_requests(demo_profiles(), model=CLOUD[1], seed=self.args.seed + 2)
        pick = random.Random(f"upstreams:{self.args.seed}")
        start = time.perf_counter()
        for offset in poisson_arrivals(self.args.rate, seed=self.args.seed):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the workload
            self._launch(http, base, next(cloud if pick.random() < CLOUD_SHARE else local))

    async def support(self, http: httpx.AsyncClient, base: str) -> None:
        """The support app's requests, stamped with the wall-clock time as they are sent:
        a worker that takes a ticket every ``1 / (rate * SUPPORT_RATE_SHARE)`` seconds
        (give or take a fifth), so its prompts never wait for each other's prefill and
        its first-token times follow its prompt lengths."""
        instructions = support_instructions(self.args.seed)
        rng = random.Random(f"support-questions:{self.args.seed}")
        period = 1.0 / (self.args.rate * SUPPORT_RATE_SHARE)
        start = time.perf_counter()
        for index in itertools.count():
            offset = period * (index + rng.uniform(-0.2, 0.2))
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the workload
            stamp = time.strftime("%H:%M:%S")  # the app's own wall clock, as apps do
            self._launch(http, base, support_request(index, instructions, rng, stamp))

    async def bursts(self, http: httpx.AsyncClient, base: str) -> None:
        from proxy.bench.workload import Profile, iter_requests

        # A batch job's burst: its own system prompt, medium answers, more than the free slots.
        burst = Profile("batch", prompt_tokens=500, shared_prefix_tokens=300, max_tokens=96)
        planned = iter_requests([burst], model=LOCAL[1], seed=self.args.seed + 1)
        while True:
            await asyncio.sleep(self.args.burst_every)
            for _ in range(self.args.burst_size):
                self._launch(http, base, next(planned))

    # -- view ---------------------------------------------------------------------------

    async def view(self, http: httpx.AsyncClient, metrics_url: str, root: str) -> None:
        import httpx

        from proxy.bench import promscrape as p

        refresh, span = self.args.refresh, self.args.window
        start = time.perf_counter()
        first = await p.scrape(http, metrics_url)
        history: deque[tuple[float, Snapshot]] = deque([(start, first)])
        if self.tty:
            self.out.write("\x1b[2J")
        tick = start
        while True:
            tick += refresh
            await asyncio.sleep(max(0.0, tick - time.perf_counter()))
            try:
                snap = await p.scrape(http, metrics_url)
            except httpx.HTTPError:
                continue  # one failed scrape is not fatal; the next refresh tries again
            now = time.perf_counter()
            history.append((now, snap))
            while len(history) > 2 and now - history[1][0] >= span - refresh / 2:
                history.popleft()
            old_t, old = history[0]
            recent = window(old, snap, now - old_t)
            total = window(first, snap, now - start)
            routes = by_route(first, snap)
            upstreams = by_route(first, snap, UPSTREAMS, label="upstream")
            if self.tty:
                elapsed = int(now - start)
                header = [  # the page's URL stays in sight: the first frame clears the lines above
                    f"llm-latency-proxy demo   up {elapsed // 60}:{elapsed % 60:02d}   "
                    f"live page (charts) {root}/ui",
                    f"proxy {root}/v1   metrics {root}/metrics",
                    "all figures are the proxy's own histograms (bucket-interpolated "
                    "percentiles); Ctrl-C to stop",
                ]
                lines = render(
                    header, recent, total, p.total(snap, p.IN_FLIGHT), routes, self.sent, upstreams
                )
                self.out.write("\x1b[H" + "".join(line + "\x1b[K\n" for line in lines) + "\x1b[J")
                self.out.flush()
            else:
                self.say(one_line(now - start, recent, total, [*routes, *upstreams]))
