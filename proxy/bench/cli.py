"""``llm-latency-proxy bench``: flags in, workload run, table (and JSON) out.

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import urlsplit

from proxy.errors import CliError

from .flags import DEFAULT_MODEL, add_arguments, validate

if TYPE_CHECKING:
    from .client import RequestResult, RunPlan
    from .promscrape import Histogram, ProxyView, Snapshot
    from .replay import Replay
    from .stats import Summary
    from .workload import PlannedRequest

ANTHROPIC_VERSION = "2023-06-01"
_JSON_KEYS = {"TTFB": "ttfb", "first answer": "first_answer"}


class Progress:
    """A hand-rolled progress bar on a TTY; otherwise a line per tenth of the run; or nothing.

    Progress is requests done over the request budget, or elapsed over the duration
    when that is the tighter bound.
    """

    def __init__(
        self,
        stream: TextIO,
        requests: int | None,
        duration: float | None,
        *,
        tty: bool | None = None,
        enabled: bool = True,
    ) -> None:
        self.stream = stream
        self.requests = requests
        self.duration = duration
        self.tty = stream.isatty() if tty is None else tty
        self.enabled = enabled
        self.done = 0
        self.errors = 0
        self.start = time.perf_counter()
        self._last_decile = -1
        self._last_draw = 0.0

    def fraction(self) -> float:
        parts = []
        if self.requests:
            parts.append(self.done / self.requests)
        if self.duration:
            parts.append((time.perf_counter() - self.start) / self.duration)
        return min(max(parts, default=0.0), 1.0)

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.errors += 0 if result.ok else 1
        if not self.enabled:
            return
        frac = self.fraction()
        if self.tty:
            now = time.perf_counter()
            if now - self._last_draw < 0.1 and frac < 1.0:
                return  # redraw at most ten times a second
            self._last_draw = now
            width = 30
            filled = int(frac * width)
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(
                f"\r[{bar}] {frac * 100:5.1f}%  {self.done} done, {self.errors} errors, "
                f"{now - self.start:6.1f} s"
            )
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile > self._last_decile:
                self._last_decile = decile
                self.stream.write(
                    f"bench: {decile * 10}% ({self.done} done, {self.errors} errors)\n"
                )
                self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure TTFT, ITL and TPOT client side against any OpenAI- or Anthropic-style URL",
        description=(
            "Send a workload of streaming requests (chat completions, completions, Responses "
            "or Messages) to a base URL (the proxy, the simulator, a real provider) and "
            "measure per request, client side: time to first byte (TTFB), time to first "
            "token (TTFT), time to the first answer token after any reasoning, every "
            "inter-token gap (ITL), time per output token (TPOT) and total time. Pointed at "
            "the proxy, it also prints the proxy's own view from /metrics beside the client's."
        ),
    )
    add_arguments(parser)
    parser.set_defaults(func=run_command, error_prefix="bench")


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname or "", parts.port


def _key_headers(api: str, key: str | None) -> tuple[tuple[str, str], ...]:
    if api == "messages":
        version = (("anthropic-version", ANTHROPIC_VERSION),)
        return ((("x-api-key", key),) if key else ()) + version
    return (("Authorization", f"Bearer {key}"),) if key else ()


def run_command(args: argparse.Namespace) -> int:
    validate(args)
    args.compare_run = _read_run(args.compare) if args.compare else None
    import asyncio

    try:
        import uvloop  # comes with uvicorn[standard]; less client CPU per event (docs/performance.md)
    except ImportError:  # pragma: no cover - Windows, or uvicorn without extras
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        return runner(_main(args))
    except KeyboardInterrupt:
        print("\nbench: interrupted", file=sys.stderr)
        return 130


@dataclass
class _Workload:
    """What a run sends: the plan, the bodies, their send times, and how to say it."""

    plan: RunPlan
    planned: Iterable[PlannedRequest]
    arrivals: Iterable[float] | None
    describe: str
    route: str | None  # the one route of every request, for the proxy's view
    model: str | None  # the one model of every request, for the proxy's view
    replay: Replay | None = None


def _api_key(args: argparse.Namespace, api: str) -> str | None:
    from proxy.config import process_env

    key_env = "ANTHROPIC_API_KEY" if api == "messages" else "OPENAI_API_KEY"
    return args.api_key or process_env().get(key_env)


def _synthetic_workload(args: argparse.Namespace, base: str) -> _Workload:
    from .client import RunPlan
    from .workload import API_PATHS, Profile, iter_requests, poisson_arrivals, route_of

    requests = args.requests if args.requests is not None else (None if args.duration else 100)
    concurrency = args.concurrency if args.concurrency is not None else (None if args.rate else 8)
    model = args.model or DEFAULT_MODEL
    plan = RunPlan(
        url=base + API_PATHS[args.api],
        requests=requests,
        duration=args.duration,
        concurrency=concurrency,
        rate=args.rate,
        headers=_key_headers(args.api, _api_key(args, args.api)),
    )
    profile = Profile(
        "bench",
        args.prompt_tokens,
        args.shared_prefix_tokens,
        args.max_tokens,
        api=args.api,
        reasoning=args.reasoning,
        prompt_tokens_max=args.prompt_tokens_max or 0,
    )
    target = f"rate {args.rate}/s" if args.rate else f"concurrency {concurrency}"
    limits = [f"{requests} requests"] if requests else []
    if args.duration:
        limits.append(f"{args.duration:g} s")
    return _Workload(
        plan=plan,
        planned=iter_requests([profile], model=model, seed=args.seed),
        arrivals=poisson_arrivals(args.rate, seed=args.seed) if args.rate else None,
        describe=f"bench: {plan.url}, model {model}, {target}, up to {' and '.join(limits)}",
        route=route_of(args.api),
        model=model,
    )


def _replay_workload(args: argparse.Namespace, base: str, replay: Replay) -> _Workload:
    from .client import RunPlan
    from .workload import API_PATHS, route_of

    apis = sorted(set(replay.apis))
    routes = tuple(
        (api, base + API_PATHS[api], _key_headers(api, _api_key(args, api))) for api in apis
    )
    plan = RunPlan(
        url=routes[0][1] if routes else base + API_PATHS[args.api],
        requests=len(replay.records),
        concurrency=args.concurrency,
        headers=routes[0][2] if routes else (),
        scheduled=True,
        routes=routes,
    )
    models = {args.model} if args.model else {r.model or DEFAULT_MODEL for r in replay.records}
    start = (
        f", recorded from {replay.workload.start:%Y-%m-%d %H:%M:%S %Z}"
        if replay.workload.start
        else ""
    )
    cap = f", at most {args.concurrency} in flight" if args.concurrency else ""
    describe = (
        f"bench: replaying {len(replay.records)} requests of {', '.join(replay.workload.paths)}"
        f"{start} over {replay.span_s:.1f} s (speedup {args.speedup:g}{cap}) to {base} "
        f"({', '.join(f'{api} {n}' for api, n in sorted(Counter(replay.apis).items()))}; "
        f"blocks of {replay.block_size} tokens)"
    )
    return _Workload(
        plan=plan,
        planned=replay.requests(),
        arrivals=replay.offsets,
        describe=describe,
        route=route_of(apis[0]) if len(apis) == 1 else None,
        model=next(iter(models)) if len(models) == 1 else None,
        replay=replay,
    )


def _load_replay(args: argparse.Namespace) -> Replay:
    from proxy.workload_file import WorkloadError, load

    from .replay import ReplayOptions, plan

    try:
        workload = load(args.workload_file, block_size=args.block_size)
        options = ReplayOptions(
            speedup=args.speedup,
            model=args.model,
            default_model=DEFAULT_MODEL,
            default_api=args.api,
            default_max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            block_size=args.block_size,
            requests=args.requests,
            duration=args.duration,
        )
        replay = plan(workload, options)
    except (WorkloadError, ValueError) as exc:
        raise CliError(f"--workload-file: {exc}") from None
    if not replay.records:
        raise CliError("--workload-file: no request to replay (check --requests and --duration)")
    return replay


async def _main(args: argparse.Namespace) -> int:
    replay = _load_replay(args) if args.workload_file else None
    if args.simulate is not None:
        from .whatif import check_knobs, simulator

        knobs = check_knobs(args.simulate)
        async with simulator(knobs) as url:
            args.base_url = url
            print(
                f"bench: simulator at {url} ({args.simulate or 'default knobs'})", file=sys.stderr
            )
            return await _run(args, replay)
    return await _run(args, replay)


async def _run(args: argparse.Namespace, replay: Replay | None) -> int:
    import httpx

    from . import promscrape
    from .client import RunResult, make_client, run
    from .stats import format_table, summarize

    base = args.base_url.rstrip("/")
    work = _replay_workload(args, base, replay) if replay else _synthetic_workload(args, base)
    plan = work.plan
    metrics_url = (
        None if args.no_compare else (args.compare_metrics or promscrape.metrics_url_for(base))
    )
    # A proxy that checks client keys wants one for its main port's /metrics too: the
    # run's key goes with the scrape, to the run's own origin only.
    scrape_key = tuple(
        (name, value)
        for name, value in plan.headers
        if name.lower() in ("authorization", "x-api-key")
        and metrics_url is not None
        and _origin(metrics_url) == _origin(base)
    )
    before: Snapshot | None = None
    async with make_client(plan.concurrency, args.timeout) as http:
        if metrics_url:
            try:
                before = await promscrape.scrape(http, metrics_url, scrape_key)
            except httpx.HTTPError as exc:
                if args.compare_metrics:
                    raise CliError(f"cannot scrape {metrics_url}: {exc}") from None
            if before is not None and not promscrape.has_proxy_metrics(before):
                if args.compare_metrics:
                    raise CliError(f"{metrics_url} has no llm_proxy_ metrics")
                before = None
        print(work.describe, file=sys.stderr)
        progress = Progress(sys.stderr, plan.requests, plan.duration, enabled=not args.no_progress)
        finished: list[RequestResult] = []

        def done(result: RequestResult) -> None:
            finished.append(result)
            progress.update(result)

        interrupted, started = False, time.perf_counter()
        try:
            outcome = await run(
                plan, work.planned, arrivals=work.arrivals, client=http, on_result=done
            )
        except asyncio.CancelledError:  # Ctrl-C (the runner cancels this task): a long
            # replay's finished requests are reported and written, not lost
            interrupted = True
            results = tuple(sorted(finished, key=lambda r: r.index))
            outcome = RunResult(results, time.perf_counter() - started)
        finally:
            progress.close()
        after = None
        if interrupted:
            print(f"\nbench: interrupted: the {len(outcome.results)} requests that finished "
                  "are reported; those in flight are not", file=sys.stderr)
        elif before is not None and metrics_url:
            try:
                after = await promscrape.scrape(http, metrics_url, scrape_key)
            except httpx.HTTPError as exc:
                print(f"bench: cannot scrape {metrics_url} after the run: {exc}", file=sys.stderr)

    summary = summarize(outcome.results, outcome.wall_s)
    out = sys.stderr if args.json == "-" else sys.stdout  # keep stdout pure JSON then
    print(format_table(summary), file=out)
    failed = next((r for r in outcome.results if not r.ok), None)
    if failed is not None:
        status = f" (HTTP {failed.status})" if failed.status else ""
        print(f"bench: first error: {failed.outcome}{status}: {failed.error}", file=sys.stderr)
    view = None
    extra: dict[str, Histogram] = {}
    if before is not None and after is not None:
        if work.route is None:
            print(
                "\nproxy's view: not compared (the workload mixes APIs; the comparison is per route)",
                file=out,
            )
        else:
            where = promscrape.proxy_filter(after, work.model, work.route)
            view = promscrape.ProxyView.between(before, after, where)
            extra = promscrape.proxy_extra(before, after, where)
            print(f"\nproxy's view ({metrics_url}) beside the client's:", file=out)
            print(
                promscrape.format_comparison(summary, outcome.results, view, extra, work.route),
                file=out,
            )
    compared = None
    if work.replay is not None and not interrupted:
        from .replay import compare
        from .replay import format_comparison as format_replay

        upstream = (
            base if args.simulate is None else f"the simulator ({args.simulate or 'defaults'})"
        )
        compared = compare(work.replay, outcome.results, upstream)
        print("\nthe replay beside the workload file:", file=out)
        print(format_replay(compared), file=out)
    if args.json or args.report:
        payload = _payload(args, outcome.results, summary, view, extra)
        payload["interrupted"] = interrupted
        if compared is not None and work.replay is not None:
            payload["replay"] = {**compared, "scheduled_s": list(work.replay.offsets)}
        if args.json:
            _write_json(args.json, payload)
        if args.report:
            _write_report(args, payload)
            print(f"bench: report written to {args.report}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if summary.completed else 1


def _read_run(path: str) -> dict[str, Any]:
    """Another run's ``--json`` file for ``--compare``; raises why it cannot be used."""
    try:
        with open(path, encoding="utf-8") as fh:
            run = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CliError(f"--compare {path}: {exc}") from None
    if not isinstance(run, dict) or not {"summary", "requests"} <= run.keys():
        raise CliError(f"--compare {path}: not a bench --json file (no summary and requests)")
    return run


def _payload(
    args: argparse.Namespace,
    results: tuple[RequestResult, ...],
    summary: Summary,
    view: ProxyView | None,
    extra: dict[str, Histogram] | None = None,
) -> dict[str, Any]:
    """The run as JSON-ready data: what ``--json`` writes and ``--report`` draws."""
    hidden = ("func", "api_key", "compare_run")
    payload: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in hidden},
        "summary": summary.as_json(),
        "requests": [r.as_json() for r in results],
    }
    if view is not None:

        def hist(h: Any) -> dict[str, Any]:
            def f(x: float) -> float | None:
                return None if math.isnan(x) else x

            return {
                "count": h.count,
                "mean": f(h.mean),
                "p50": f(h.quantile(0.5)),
                "p90": f(h.quantile(0.9)),
                "p99": f(h.quantile(0.99)),
                # cumulative counts at the finite bucket edges, over the run
                "buckets": [[le, c] for le, c in h.buckets if math.isfinite(le)],
            }

        payload["proxy"] = {
            "ttft": hist(view.ttft),
            "itl": hist(view.itl),
            "tpot": hist(view.tpot),
            "requests": view.requests,
            "outcomes": view.outcomes,
            **{_JSON_KEYS[k]: hist(h) for k, h in (extra or {}).items()},
        }
    return payload


def _write_report(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    from .report import build

    name = os.path.basename(args.compare) if args.compare else ""
    html = build(payload, getattr(args, "compare_run", None), name)
    with open(args.report, "w", encoding="utf-8") as fh:
        fh.write(html)


def _write_json(path: str, payload: dict[str, Any]) -> None:
    text = json.dumps(payload, indent=1, allow_nan=False)
    if path == "-":
        print(text)
    else:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
