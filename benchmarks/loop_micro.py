"""What the proxy's event loop waits for: ``/metrics`` renders and large request bodies.

    python benchmarks/loop_micro.py scrape                   # the realistic registry
    python benchmarks/loop_micro.py scrape --shape worst     # every label combination
    python benchmarks/loop_micro.py body                     # request bodies, 10 KB .. 32 MB

Why: every stall of the event loop is added to the inter-token latency of every stream
the proxy relays at that moment. ``benchmarks/run.py`` shows the effect on streams
(``-scraped`` targets); this shows the cause, in process, on this machine.

``scrape``: the proxy's own registry (:class:`proxy.metrics.Metrics`, client label on),
filled through ``Metrics.observe`` with one streamed request per label set, so every
histogram of every set has samples. Two shapes, named for what they are:

* ``realistic`` (default): ``--clients`` 50 clients, each sending to one of 3 upstreams
  and using ``--models-per-client`` 3 of the 50 models on ``--routes`` 1 route: 150
  (route, model, upstream, client) sets;
* ``worst``: every combination of 4 routes x 50 models x 3 upstreams x 50 clients,
  30,000 sets per histogram: hundreds of MB of exposition, which no Prometheus would
  take in one scrape; the record of what the bound on label values allows, rendered
  once (``--repeat 1``), without the loop probe.

It reports the label sets, the exposition's size and lines, the render time (plain text
and OpenMetrics, best of ``--repeat``), and the event loop's longest stall while
``--scrapes`` scrapes are answered one after another: (a) rendered on the loop, as
``/metrics`` was answered before (``Metrics.exposition`` inside the handler), (b) through
:class:`proxy.scrape.Scrapes` (a worker thread). The stall is read by a probe on the
loop (uvloop when installed, as ``serve`` runs): a callback scheduled every 1 ms that
records how late it ran. Then two scrapes arriving together, and the renders they cost.

``body``: what :mod:`proxy.routes` does with a streamed chat body it adds the usage
request to (``decode_body``: decode, then re-encode), per size and shape (``turns``:
many short messages; ``document``: a few long texts with escapes; ``image``: one base64
data URL), in ms: inline (``json``, whole), in pieces (:mod:`proxy.bodies`); and the
probe's longest stall while one body is handled: inline on the loop, ``json`` whole in a
worker thread (``asyncio.to_thread``: its C code keeps the GIL for the whole call), in
pieces in a worker thread (what the proxy does above ``LARGE_BODY``).

Output: markdown tables on stdout; ``--json FILE`` keeps the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions")
MODELS = 50
UPSTREAMS = 3
CLIENTS = 50


# --------------------------------------------------------------------------- shapes


def model_name(index: int) -> str:
    """Model ``index``, served by upstream ``index % UPSTREAMS`` (``benchmarks/run.py``
    routes it there by the ``u{n}-`` prefix)."""
    return f"u{index % UPSTREAMS}-model-{index:02d}"


def upstream_name(index: int) -> str:
    return f"upstream-{index}"


def realistic_sets(clients: int = CLIENTS, models_per_client: int = 3, routes: int = 1
                   ) -> list[tuple[str, str, str, str]]:
    """(route, model, upstream, client) of a realistic fleet: client ``c`` sends to
    upstream ``c % 3`` only, using ``models_per_client`` of that upstream's models (its
    own choice among them) on the first ``routes`` routes."""
    out = []
    for c in range(clients):
        up = c % UPSTREAMS
        served = [m for m in range(MODELS) if m % UPSTREAMS == up]
        for k in range(models_per_client):
            model = served[(c * 5 + k * 3) % len(served)]
            for route in ROUTES[:routes]:
                out.append((route, model_name(model), upstream_name(up), f"client-{c:02d}"))
    return sorted(set(out))


def worst_sets() -> list[tuple[str, str, str, str]]:
    """Every label combination the bounds allow: 4 x 50 x 3 x 50."""
    return [(route, model_name(m), upstream_name(u), f"client-{c:02d}")
            for route, m, u, c in itertools.product(ROUTES, range(MODELS), range(UPSTREAMS),
                                                    range(CLIENTS))]


def filled_metrics(sets: list[tuple[str, str, str, str]]) -> Any:
    """The proxy's metrics, client label on, one streamed request observed per set."""
    from prometheus_client import CollectorRegistry

    from proxy.measure import Outcome, RequestRecord
    from proxy.metrics import Metrics, MetricsOptions

    options = MetricsOptions(client_label=True, max_models=MODELS * 2, max_clients=CLIENTS * 2)
    metrics = Metrics(CollectorRegistry(), options)
    itl = tuple(0.015 + 0.001 * (i % 10) for i in range(49))
    for n, (route, model, upstream, client) in enumerate(sets):
        metrics.observe(RequestRecord(
            request_id=f"r{n}", route=route, model=model, upstream=upstream, client=client,
            stream=True, status=200, outcome=Outcome.COMPLETED, duration_s=1.2,
            overhead_s=0.0004, queue_s=0.0, upstream_queue_s=0.002, ttft_s=0.21,
            ttfa_s=0.25, ttfb_s=0.05, tpot_s=0.02, itl_s=itl, output_events=50,
            prompt_tokens=900, cached_prompt_tokens=512, completion_tokens=50,
            reasoning_tokens=10, cache_write_tokens=64), measured=True)
    return metrics


# --------------------------------------------------------------------------- the probe


class Probe:
    """A callback every ``every`` seconds on the running loop, recording how late it ran:
    the loop's stalls, as any stream's next event would have met them."""

    def __init__(self, every: float = 0.001) -> None:
        self.every = every
        self.late: list[float] = []
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        self._due = time.perf_counter() + self.every
        self._handle = asyncio.get_running_loop().call_later(self.every, self._tick)

    def _tick(self) -> None:
        now = time.perf_counter()
        self.late.append(max(0.0, now - self._due))
        self._due = now + self.every
        self._handle = asyncio.get_running_loop().call_later(self.every, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def summary(self) -> dict[str, float]:
        late = sorted(self.late) or [0.0]
        return {"max_ms": late[-1] * 1000,
                "p99_ms": late[min(len(late) - 1, int(0.99 * len(late)))] * 1000,
                "ticks": float(len(late))}


async def probed(work: Callable[[], Awaitable[Any]]) -> tuple[float, dict[str, float]]:
    """``work``'s wall time and the probe's figures while it ran."""
    probe = Probe()
    probe.start()
    await asyncio.sleep(0.01)  # the probe is ticking
    probe.late.clear()
    t0 = time.perf_counter()
    await work()
    wall = time.perf_counter() - t0
    await asyncio.sleep(0.002)  # the tick due during the last stall reports it
    probe.stop()
    return wall, probe.summary()


def run_loop(coro: Awaitable[Any]) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is in the serve extras
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


def best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# --------------------------------------------------------------------------- scrape

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def scrape(args: argparse.Namespace) -> dict[str, Any]:
    from proxy.scrape import Scrapes

    if args.shape == "worst":
        sets = worst_sets()
    else:
        sets = realistic_sets(args.clients, args.models_per_client, args.routes)
    t0 = time.perf_counter()
    metrics = filled_metrics(sets)
    fill_s = time.perf_counter() - t0
    text, _ = metrics.exposition(None)
    out: dict[str, Any] = {
        "shape": args.shape, "label_sets": len(sets), "fill_s": fill_s,
        "bytes": len(text), "lines": text.count(b"\n"),
        "render_text_ms": best(lambda: metrics.exposition(None), args.repeat) * 1000,
    }
    del text
    if args.shape == "worst":
        return out
    out["render_openmetrics_ms"] = best(lambda: metrics.exposition(OPENMETRICS),
                                        args.repeat) * 1000

    async def measure() -> None:
        scrapes = Scrapes(metrics.exposition, metrics.exposition_type)

        async def inline() -> None:
            for _ in range(args.scrapes):
                metrics.exposition(None)
                await asyncio.sleep(0)

        async def threaded() -> None:
            for _ in range(args.scrapes):
                await scrapes(None)

        async def together() -> None:
            await asyncio.gather(scrapes(None), scrapes(None))

        for name, work in (("inline", inline), ("thread", threaded)):
            wall, probe = await probed(work)
            out[name] = {"wall_ms_per_scrape": wall * 1000 / args.scrapes, **probe}
        before = scrapes.renders
        await together()
        out["renders_for_two_concurrent_scrapes"] = scrapes.renders - before

    run_loop(measure())
    return out


def scrape_report(r: dict[str, Any]) -> str:
    lines = [
        f"### /metrics render, {r['shape']} registry: {r['label_sets']:,} label sets "
        f"(route, model, upstream, client)", "",
        f"- exposition: {r['bytes'] / 1e6:,.1f} MB, {r['lines']:,} lines; filled in "
        f"{r['fill_s']:.1f} s",
        f"- render, plain text: {r['render_text_ms']:,.0f} ms",
    ]
    if "render_openmetrics_ms" in r:
        lines.append(f"- render, OpenMetrics: {r['render_openmetrics_ms']:,.0f} ms")
    if "inline" in r:
        lines += ["", "| scrape answered | wall ms per scrape | loop's longest stall ms | "
                  "stall p99 ms (1 ms probe) |", "| --- | --- | --- | --- |"]
        for name, label in (("inline", "on the loop (before)"),
                             ("thread", "in a worker thread (proxy.scrape)")):
            x = r[name]
            lines.append(f"| {label} | {x['wall_ms_per_scrape']:,.0f} | {x['max_ms']:,.1f} | "
                         f"{x['p99_ms']:,.1f} |")
        lines += ["", f"Two scrapes arriving together: "
                  f"{r['renders_for_two_concurrent_scrapes']} render."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- body

SHAPES = ("turns", "document", "image")
SIZES = (10_000, 100_000, 300_000, 1 << 20, 4 << 20, 16 << 20, 31 << 20)


def make_body(size: int, shape: str) -> bytes:
    """A streamed chat request of about ``size`` bytes (without stream_options, so the
    proxy adds the usage request and re-encodes it)."""
    if shape == "turns":  # many short turns, as a long conversation has
        turn = "Which of these is faster, and why? " * 7
        messages = [{"role": "user" if i % 2 else "assistant", "content": f"{i}: {turn}"}
                    for i in range(max(1, size // 290))]
    elif shape == "document":  # a few long texts with line breaks and quotes
        para = 'The "quick" brown fox\\jumps over the lazy dog.\n' * 40
        count = max(1, size // 200_000)
        messages = [{"role": "user", "content": para * max(1, size // count // len(para))}
                    for _ in range(count)]
    elif shape == "image":  # one image as a base64 data URL
        raw = base64.b64encode(bytes(range(256)) * max(1, size * 3 // 4 // 256)).decode()
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + raw}}]}]
    else:
        raise ValueError(shape)
    return json.dumps({"model": "m", "stream": True, "messages": messages}).encode()


def body(args: argparse.Namespace) -> dict[str, Any]:
    from proxy.bodies import LARGE_BODY, decode_body

    rows = []
    sizes = [s for s in SIZES if s <= args.max_size]
    for shape in args.shapes.split(","):
        for size in sizes:
            data = make_body(size, shape)
            repeat = args.repeat if len(data) < (4 << 20) else max(1, args.repeat // 3)
            row: dict[str, Any] = {
                "shape": shape, "bytes": len(data),
                "inline_ms": best(lambda: decode_body(data, True), repeat) * 1000,  # noqa: B023
                "pieces_ms": best(lambda: decode_body(data, True, large=True),  # noqa: B023
                                  repeat) * 1000,
            }
            assert decode_body(data, True) == decode_body(data, True, large=True)

            run_loop(stalls(data, row))
            rows.append(row)
            print(f"# {shape} {len(data):,} B: inline {row['inline_ms']:.2f} ms, pieces "
                  f"{row['pieces_ms']:.2f} ms; stall inline {row['stall_inline_ms']:.1f}, json "
                  f"thread {row['stall_json_thread_ms']:.1f}, pieces thread "
                  f"{row['stall_pieces_thread_ms']:.1f} ms", file=sys.stderr)
    return {"large_body": LARGE_BODY, "rows": rows}


async def stalls(data: bytes, row: dict[str, Any]) -> None:
    """The loop's longest stall while ``data`` is handled each way, into ``row``."""
    from proxy.bodies import decode_body

    async def inline() -> None:
        decode_body(data, True)

    async def json_thread() -> None:
        await asyncio.to_thread(decode_body, data, True)

    async def pieces_thread() -> None:
        await asyncio.to_thread(decode_body, data, True, large=True)

    for name, work in (("inline", inline), ("json_thread", json_thread),
                       ("pieces_thread", pieces_thread)):
        wall, probe = await probed(work)
        row[f"stall_{name}_ms"] = probe["max_ms"]
        row[f"wall_{name}_ms"] = wall * 1000


def body_report(r: dict[str, Any]) -> str:
    lines = [
        "### Request bodies: decode and re-encode with the usage request", "",
        f"Above {r['large_body']:,} bytes (`LARGE_BODY`) the proxy uses pieces in a worker "
        "thread. Stall: the loop's longest stall while one body is handled (1 ms probe).", "",
        "| shape | bytes | inline ms | pieces ms | stall: inline | stall: json in a thread | "
        "stall: pieces in a thread |", "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['shape']} | {row['bytes']:,} | {row['inline_ms']:,.2f} | "
            f"{row['pieces_ms']:,.2f} | {row['stall_inline_ms']:,.1f} | "
            f"{row['stall_json_thread_ms']:,.1f} | {row['stall_pieces_thread_ms']:,.1f} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def machine() -> str:
    return f"{platform.machine()}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("scrape", help="/metrics render time and loop stalls")
    s.add_argument("--shape", choices=("realistic", "worst"), default="realistic")
    s.add_argument("--clients", type=int, default=CLIENTS)
    s.add_argument("--models-per-client", type=int, default=3)
    s.add_argument("--routes", type=int, default=1, choices=range(1, len(ROUTES) + 1))
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--scrapes", type=int, default=3)
    b = sub.add_parser("body", help="request body decode/encode cost and loop stalls")
    b.add_argument("--shapes", default=",".join(SHAPES))
    b.add_argument("--max-size", type=int, default=SIZES[-1])
    b.add_argument("--repeat", type=int, default=5)
    for sp in (s, b):
        sp.add_argument("--json", default="", help="also write the figures to this file")
    a = p.parse_args(argv)
    if a.what == "scrape":
        if a.shape == "worst":
            a.repeat = min(a.repeat, 1)
        result = scrape(a)
        report = scrape_report(result)
    else:
        result = body(a)
        report = body_report(result)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = "python benchmarks/loop_micro.py " + " ".join(sys.argv[1:] if argv is None else argv)
    sys.stdout.write(f"{report}\n- {stamp}, {machine()}; `{command}`\n")
    if a.json:
        Path(a.json).write_text(json.dumps({"command": command, "date": stamp, **result},
                                           indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
