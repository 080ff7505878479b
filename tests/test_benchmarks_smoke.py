"""The benchmark harness (``benchmarks/``) measures what it claims to measure.

No timing is asserted (timing belongs to ``benchmarks/run.py`` and its report); these
tests prove correctness of the instrument: the load client's chunked decoding and
byte-scan counting over every split point for all three APIs (Chat Completions,
Responses, Messages), stream and token counts against the fake upstream's schedule,
kept-alive versus new connections, the close-per-response upstream (one upstream
connection per request, direct, through nginx and through the proxy), broken streams
detected, and ``run.py`` end to end (fake upstream, direct, nginx when installed, the
proxy, the proxy with ``--no-measure`` and a proxy from ``--before``; keep-alive and
close upstreams; Responses and Messages streams relayed) producing a report with no
broken streams. The ``proxy-20up`` target's generated config loads with the proxy's own
loader and routes the benchmark's model past every decoy, and the proxy started on it
relays every stream to the fake upstream. A ``-scraped`` target's registry is filled
with every (model, client) label set asked for, a real Prometheus scrapes it during its
loads (and the report says how often), beside its ``-before`` twin; ``loop_micro.py``
runs both its measurements.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import fake_upstream  # noqa: E402
import loadgen  # noqa: E402
import loop_micro  # noqa: E402
import proxy_instructions  # noqa: E402
import run  # noqa: E402
import timeline  # noqa: E402

from proxy.config import from_sources  # noqa: E402
from proxy.routing import RoutingTable  # noqa: E402
from tests.test_observability import require_tool  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.slow]

HAS_PROXY = (BENCH.parent / "proxy" / "serve.py").exists()
HAS_NGINX = shutil.which("nginx") is not None
HAS_PROMETHEUS = shutil.which("prometheus") is not None

# SSE events per streamed response besides the tokens. Chat: role chunk, finish chunk,
# [DONE] (+ the usage chunk when asked for). Responses: created, in_progress,
# output_item.added, content_part.added, output_text.done, content_part.done,
# output_item.done, completed. Messages: message_start, content_block_start, ping,
# content_block_stop, message_delta, message_stop.
EXTRA_EVENTS = {"chat": 3, "responses": 8, "messages": 6}


@asynccontextmanager
async def upstream(
    schedule: fake_upstream.Schedule, *, close: bool = False
) -> AsyncIterator[tuple[str, dict[str, int]]]:
    """The fake upstream in this event loop; yields its base URL and live stats."""
    stop, ready = asyncio.Event(), asyncio.Event()
    ports: list[int] = []
    stats: dict[str, int] = {}
    task = asyncio.create_task(
        fake_upstream.serve("127.0.0.1", 0, schedule, ready, ports, stop, stats, close=close)
    )
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield f"http://127.0.0.1:{ports[0]}/v1", stats
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


FAST = fake_upstream.Schedule(ttft=0.005, itl=0.002, tokens=6)


def _config(url: str, **overrides: Any) -> loadgen.LoadConfig:
    settings: dict[str, Any] = {
        "url": url,
        "concurrency": 6,
        "duration": 60,
        "warmup": 0,
        "tokens": 7,
        "streams": 3,
        "stagger": 0.01,
        "stream_timeout": 10,
    }
    return loadgen.LoadConfig(**(settings | overrides))


@pytest.mark.parametrize("keepalive", [True, False], ids=["keep-alive", "new-connections"])
@pytest.mark.parametrize(
    ("api", "usage"),
    [("chat", True), ("chat", False), ("responses", False), ("messages", False)],
    ids=["chat-usage", "chat-no-usage", "responses", "messages"],
)
async def test_direct_counts_match_schedule(keepalive: bool, api: str, usage: bool) -> None:
    users, per_user, tokens = 6, 3, 7
    async with upstream(FAST) as (url, stats):
        cfg = _config(url, keepalive=keepalive, include_usage=usage, api=api)
        out = await loadgen.run_load(cfg)
    n = users * per_user
    assert out["streams"] == out["ok"] == n
    assert out["broken"] == 0 and out["errors"] == {}
    assert out["tokens"] == n * tokens
    assert out["events"] == n * (tokens + EXTRA_EVENTS[api] + usage)
    assert out["ttft_ms"]["n"] == n
    assert out["itl_ms"]["n"] == n * (tokens - 1)
    assert stats["requests"] == stats["completed"] == n
    assert stats["events"] == n * tokens
    assert stats["connections"] == (users if keepalive else n)


def _response(api: str, tokens: int, usage: bool = False, close: bool = False) -> bytes:
    """The fake upstream's exact bytes for one streamed response."""
    head = fake_upstream.HEAD_STREAM + (b"connection: close\r\n" if close else b"") + b"\r\n"
    if api == "chat":
        body = fake_upstream.ROLE + fake_upstream.TOKEN * tokens + fake_upstream.FINISH
        body += fake_upstream._usage(8, tokens) if usage else b""
        return head + body + fake_upstream.DONE
    stream = (
        fake_upstream.responses_stream if api == "responses" else fake_upstream.messages_stream
    )(tokens)
    deltas = b"".join(stream.token(i) for i in range(tokens))
    return head + stream.before + deltas + stream.after + b"0\r\n\r\n"


class _Sink:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_client_parses_every_split_point(api: str) -> None:
    """The chunked decoder and the byte scan count right however TCP splits the bytes,
    the long event-type marks of Responses and Messages included."""
    tokens = 3
    usage = api == "chat"
    wire = _response(api, tokens, usage=usage)
    for size in (1, 2, 3, 5, 7, 11, 29, 64, len(wire)):
        for offset in range(min(size, 8)):
            conn = loadgen._Conn(loadgen.APIS[api])
            conn.connection_made(_Sink())  # type: ignore[arg-type]
            res = loadgen.StreamResult(t_start=0.0)
            fut = conn.start(b"", res)
            pieces = [wire[:offset]] + [wire[i : i + size] for i in range(offset, len(wire), size)]
            for piece in pieces:
                if piece:
                    conn.data_received(piece)
            assert fut.done(), (size, offset)
            assert res.ok and res.status == 200, (size, offset, res.error)
            assert res.tokens == tokens and res.events == tokens + EXTRA_EVENTS[api] + usage
            assert len(res.gaps) == tokens - 1
            assert conn.reusable


def _without_last_event(api: str, tokens: int) -> bytes:
    """A complete chunked body that lacks the API's last event."""
    wire = _response(api, tokens)
    if api == "chat":
        return wire[: -len(fake_upstream.DONE)] + b"0\r\n\r\n"
    last = wire.index(
        b"event: response.completed" if api == "responses" else b"event: message_stop"
    )
    chunk = wire.rindex(b"\r\n", 0, wire.rindex(b"\r\n", 0, last)) + 2  # its size line
    return wire[:chunk] + b"0\r\n\r\n"


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_missing_last_event_is_broken(api: str) -> None:
    """A complete body without the API's last event is a broken stream."""
    conn = loadgen._Conn(loadgen.APIS[api])
    conn.connection_made(_Sink())  # type: ignore[arg-type]
    res = loadgen.StreamResult(t_start=0.0)
    fut = conn.start(b"", res)
    conn.data_received(_without_last_event(api, 2))
    assert fut.done() and not res.ok and res.tokens == 2
    assert res.error == "no " + loadgen.APIS[api].end_name


async def test_connection_close_is_not_reused() -> None:
    """``Connection: close`` in a response head makes the client give the connection up."""
    conn = loadgen._Conn()
    conn.connection_made(_Sink())  # type: ignore[arg-type]
    res = loadgen.StreamResult(t_start=0.0)
    fut = conn.start(b"", res)
    conn.data_received(_response("chat", 2, close=True))
    assert fut.done() and res.ok and res.tokens == 2
    assert not conn.reusable


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_close_mode_answers_once_per_connection(api: str) -> None:
    """With ``close`` the upstream says ``Connection: close`` and hangs up after the
    response, even when the client asked to keep the connection."""
    async with upstream(FAST, close=True) as (url, stats):
        host, port, request = loadgen._request_bytes(_config(url, api=api, tokens=3))
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(request)
            await writer.drain()
            wire = await asyncio.wait_for(reader.read(), 10)  # to EOF: the server closed
        finally:
            writer.close()
    assert wire == _response(api, 3, usage=api == "chat", close=True)
    assert stats["connections"] == stats["requests"] == stats["completed"] == 1


def _bench() -> run.Bench:
    return run.Bench(run.parse_args(["--no-pin", "--max-minutes", "2"]))


@pytest.mark.parametrize("target", ["direct", "nginx", "proxy"])
async def test_close_mode_opens_an_upstream_connection_per_request(target: str) -> None:
    """Against the close-per-response upstream every request, relayed or not, reaches it
    on a new connection, and the client's kept-alive streams all complete."""
    if target == "nginx" and not HAS_NGINX:
        pytest.skip("nginx not installed")
    if target == "proxy" and not HAS_PROXY:
        pytest.skip("no proxy in this tree")
    users, per_user = 4, 3
    bench = _bench()
    try:
        async with upstream(FAST, close=True) as (url, stats):
            if target == "nginx":
                url = (await asyncio.to_thread(bench.start_nginx, url, True)).url
            elif target == "proxy":
                url = (await asyncio.to_thread(bench.start_proxy, url, "proxy", [], True)).url
            before = stats["connections"]  # start-up probes, if a target makes any
            out = await loadgen.run_load(_config(url, concurrency=users, streams=per_user))
            connections = stats["connections"] - before
    finally:
        await asyncio.to_thread(bench.close)
    n = users * per_user
    assert out["streams"] == out["ok"] == n and out["errors"] == {}
    assert out["tokens"] == n * 7
    assert stats["requests"] == stats["completed"] == n
    assert connections == n


def test_many_upstreams_config_routes_the_benchmark_model_last() -> None:
    """The ``-Nup`` config loads with the proxy's own loader (no pattern shadowed, names
    distinct), and the benchmark's model goes past every decoy to the last upstream;
    the decoys' port refuses connections, so a misrouted request would break a stream."""
    assert loadgen.LoadConfig.model == run.BENCH_MODEL
    bench = _bench()
    try:
        path = bench.upstreams_config("http://127.0.0.1:1/v1", 20, "proxy-20up")
        specs = from_sources(None, {"LLM_PROXY_CONFIG": str(path)}).upstreams
        assert len({s.name for s in specs}) == len(specs) == 20
        assert specs[-1].url == "http://127.0.0.1:1/v1"
        for route in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
            table = RoutingTable(specs)
            assert table.pick(run.BENCH_MODEL, route) == 19, route
            assert table.pick("decoy-07-x", route) == 6  # the decoys do match their own
            assert table.pick("family-19/exact", route) == 18
            assert table.pick("unknown", route) is None  # no default: nothing catches all
        port = bench.refusing_port()
        assert all(s.url == f"http://127.0.0.1:{port}/{s.name}/v1" for s in specs[:-1])
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), 2).close()
    finally:
        bench.close()


async def _through_proxy(
    name: str, upstreams: int = 0, **load: Any
) -> tuple[dict[str, Any], dict[str, int], str]:
    """A load (``load``: :func:`_config`'s overrides) through ``run.py``'s proxy target
    ``name`` in front of the fake upstream: loadgen's summary, the upstream's stats and
    the proxy's /metrics after it."""
    bench = _bench()
    try:
        async with upstream(FAST) as (url, stats):
            target = await asyncio.to_thread(
                bench.start_proxy, url, name, [], False, False, upstreams
            )
            out = await loadgen.run_load(_config(target.url, **load))
            metrics = await asyncio.to_thread(_scrape, target.url)
    finally:
        await asyncio.to_thread(bench.close)
    return out, stats, metrics


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as resp:
        text: str = resp.read().decode()
    return text


async def test_many_upstreams_proxy_relays_to_the_last() -> None:
    """``proxy-20up`` is the production proxy on that config: it knows all 20 upstreams
    and relays every stream to the fake upstream, none to a decoy."""
    if not HAS_PROXY:
        pytest.skip("no proxy in this tree")
    users, per_user = 4, 3
    out, stats, metrics = await _through_proxy(
        "proxy-20up", upstreams=20, concurrency=users, streams=per_user)
    n = users * per_user
    assert out["streams"] == out["ok"] == n and out["errors"] == {}
    assert stats["requests"] == stats["completed"] == n
    known = set(re.findall(r'^llm_proxy_in_flight_requests\{upstream="([^"]+)"\}', metrics, re.M))
    assert known == {f"decoy-{i:02d}" for i in range(1, 20)} | {"fake-upstream"}
    answered = re.findall(r"^llm_proxy_requests_total\{([^}]*)\} (\S+)$", metrics, re.M)
    by_upstream: dict[str, float] = {}
    for labels, value in answered:
        name = re.search(r'upstream="([^"]+)"', labels)
        assert name is not None
        by_upstream[name[1]] = by_upstream.get(name[1], 0) + float(value)
    assert by_upstream == {"fake-upstream": n}


async def test_truncated_stream_is_broken() -> None:
    """An upstream that hangs up mid-stream yields broken streams, not silent success."""
    cut = _response("chat", 5)
    cut = cut[: cut.index(fake_upstream.TOKEN) + 2 * len(fake_upstream.TOKEN)]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(cut)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        cfg = _config(
            f"http://127.0.0.1:{port}/v1",
            concurrency=2,
            tokens=5,
            streams=2,
            stagger=0,
            stream_timeout=5,
        )
        out = await loadgen.run_load(cfg)
    assert out["streams"] == 4 and out["ok"] == 0 and out["broken"] == 4
    assert out["tokens"] == 4 * 2
    assert out["errors"] == {"connection lost": 4}


def _run_harness(tmp_path: Path, targets: list[str], loads: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(BENCH / "run.py"),
        "--targets",
        ",".join(targets),
        "--rounds",
        "1",
        "--loads",
        loads,
        # the loads only have to run and be counted (no figure is asserted): half a
        # second each is dozens of streams per target at this schedule
        "--duration",
        "0.5",
        "--warmup",
        "0.1",
        "--ttft",
        "0.01",
        "--itl",
        "0.005",
        "--tokens",
        "5",
        "--sweep",
        "",
        "--max-minutes",
        "2",
        "--json",
        str(out),
        *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| load | api | conn | upstream | target |" in done.stdout
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _check_runs(result: dict[str, Any], targets: list[str], loads: list[run.Load]) -> None:
    seen = {(r["target"], run.Load.of(r)) for r in result["runs"]}
    assert seen == {(t, load) for t in targets for load in loads}
    for r in result["runs"]:
        assert r["streams"] > 0 and r["broken"] == 0 and r["warmup_broken"] == 0, r
        assert r["ok"] == r["streams"]
        assert r["tokens"] == r["streams"] * 5
        events = EXTRA_EVENTS[r["api"]] + (r["api"] == "chat")  # chat asks for usage
        assert r["events"] == r["streams"] * (5 + events)
        if r["target"] == "direct":
            assert r["target_cpu_us_per_event"] is None
        else:
            cpu = r["target_cpu_s"] / r["events_all"] * 1e6
            assert r["target_cpu_us_per_event"] == pytest.approx(cpu)
    proxies = [r for r in result["runs"] if r["target"].startswith("proxy")]
    if proxies:  # a Python relay of these runs uses more than one 10 ms clock tick
        assert sum(r["target_cpu_s"] for r in proxies) > 0
    for row in result["rows"]:
        assert row["broken"] == 0
    closing = {load.close for load in loads}
    for t in targets:
        for close in closing:
            if t != "direct":  # every instance that ran reports its peak memory
                assert result["peaks"][run.peak_key(t, close)] > 1024, (t, close)


@pytest.mark.timeout(180)
def test_run_py_side_by_side(tmp_path: Path) -> None:
    targets = ["direct"]
    if HAS_NGINX:
        targets.append("nginx")
    if HAS_PROXY:
        # proxy-before: the proxy of another checkout (here this one again)
        targets += ["proxy", "proxy-nomeasure", "proxy-before"]
    result = _run_harness(tmp_path, targets, "4,4new", "--before", str(BENCH.parent))
    _check_runs(result, targets, [run.Load(4), run.Load(4, keepalive=False)])
    if HAS_PROXY:  # both snapshots of the same tree: the same hash, each named
        now, before = result["meta"]["code"].removesuffix(" (snapshots taken at start)").split("; ")
        digest = now.removeprefix("proxy targets: proxy/ sha256 ")
        assert len(digest) == 12
        assert before == f"proxy-before targets: proxy/ sha256 {digest} from {BENCH.parent}"


@pytest.mark.timeout(180)
@pytest.mark.skipif(not HAS_PROXY, reason="needs the proxy's dependencies")
def test_run_py_together_runs_a_rounds_targets_at_the_same_time(tmp_path: Path) -> None:
    """``--together``: each round's loads overlap (one after the other, they do not)."""
    targets = ["direct", "proxy", "proxy-nodoctor"]
    for together in (True, False):
        extra = ("--together", "--rounds", "2") if together else ("--rounds", "2")
        result = _run_harness(tmp_path, targets, "4", *extra)
        _check_runs(result, targets, [run.Load(4)])
        for rnd in (0, 1):
            spans = [r["span_s"] for r in result["runs"] if r["round"] == rnd]
            assert len(spans) == len(targets)
            overlap = max(start for start, _ in spans) < min(end for _, end in spans)
            assert overlap is together, (together, spans)


def test_a_targets_cpu_is_read_to_the_nanosecond_from_its_threads_schedstat() -> None:
    """The targets' CPU agrees with ``/proc/<pid>/stat``'s ticks, but is not counted in
    them: a paired ratio then moves by less than a tick's share of a round."""
    pid = [os.getpid()]
    on0, ticks0 = run.on_cpu_seconds(pid), run.cpu_seconds(pid)
    spins = 0
    while run.cpu_seconds(pid) - ticks0 < 0.05:  # busy until five ticks are counted
        spins += sum(range(1000)) > 0
    on, ticks = run.on_cpu_seconds(pid) - on0, run.cpu_seconds(pid) - ticks0
    assert spins and abs(on - ticks) < 0.03  # within three ticks of each other
    assert round(on * 1e9) % 10_000_000  # not a whole number of ticks


def test_idle_loads_round_trip() -> None:
    """``1newidle6``: one user, a new connection per stream, 6 s without traffic before each."""
    load = run.Load.parse("1newidle6")
    assert load == run.Load(1, keepalive=False, idle=6.0)
    assert load.label == "1newidle6"
    assert run.Load.of({"load": 1, "keepalive": False, "idle": 6.0}) == load
    assert run.Load.parse("4idle0.5-messages").label == "4idle0.5-messages"


@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAS_PROXY, reason="needs the proxy's dependencies")
def test_timeline_stamps_every_step_of_the_request_path(tmp_path: Path) -> None:
    """``timeline.py`` finds every point it stamps in this tree (a renamed step would
    silently drop out of the timeline), and splits a request into its steps, a new
    upstream connection after the idle pause included."""
    out = tmp_path / "timeline.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "timeline.py"),
            "--targets",
            "direct,proxy",
            "--rounds",
            "1",
            "--steady",
            "2",
            "--idle",
            "0.3",
            "--json",
            str(out),
            "--proxy-arg=--upstream-keepalive-expiry=0.1",
            "--proxy-arg=--upstream-keep-warm=0",
        ],
        check=True,
        capture_output=True,
        timeout=220,
    )
    result = json.loads(out.read_text())
    assert result["missing_points"] == {"proxy": []}
    proxied = [r for r in result["results"] if r["target"] == "proxy"]
    assert {r["situation"] for r in proxied} == {"steady", "idle"}
    for r in proxied:
        steps = r["steps"]
        assert steps is not None
        for name, _ in timeline.WAY_IN:
            assert name in steps, name
        assert steps["way in: client's last byte -> request written upstream"] > 0
    idle = next(r for r in proxied if r["situation"] == "idle")
    assert "  of which connect (new connection)" in idle["steps"]


@pytest.mark.timeout(180)
def test_run_py_close_upstream_and_other_apis(tmp_path: Path) -> None:
    """Close-per-response loads run against their own upstream and target instances;
    Responses and Messages streams go through every target, the proxy as a relay."""
    targets = ["direct"]
    if HAS_NGINX:
        targets.append("nginx")
    if HAS_PROXY:
        targets.append("proxy")
    result = _run_harness(tmp_path, targets, "4close,4-responses,4newclose-messages")
    loads = [
        run.Load(4, close=True),
        run.Load(4, api="responses"),
        run.Load(4, keepalive=False, close=True, api="messages"),
    ]
    _check_runs(result, targets, loads)
    rows = {(r["target"], run.Load.of(r)) for r in result["rows"]}
    assert rows == {(t, load) for t in targets for load in loads}


@pytest.mark.timeout(180)
def test_run_py_many_upstreams_beside_one(tmp_path: Path) -> None:
    """``proxy-20up`` runs in the same run as ``proxy``, keep-alive and close upstreams
    (each instance with its own config file), and reports the same figures."""
    if not HAS_PROXY:
        pytest.skip("no proxy in this tree")
    targets = ["direct", "proxy", "proxy-20up"]
    result = _run_harness(tmp_path, targets, "4,4close")
    _check_runs(result, targets, [run.Load(4), run.Load(4, close=True)])
    for r in result["runs"]:
        if r["target"] == "proxy-20up":
            assert r["target_cpu_us_per_event"] is not None and r["target_cpu_s"] >= 0


def test_many_upstreams_cannot_run_the_before_code(tmp_path: Path) -> None:
    """The config file is written for this tree's proxy: ``-Nup`` with ``-before`` is
    refused before anything starts."""
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "run.py"),
            "--targets",
            "proxy-20up-before",
            "--before",
            str(BENCH.parent),
            "--max-minutes",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=BENCH.parent,
    )
    assert done.returncode != 0
    assert "-Nup runs this tree's proxy only" in done.stderr


def test_many_upstreams_figures_beside_one_in_the_report() -> None:
    """The report puts the 64-stream figures of ``proxy-20up`` beside ``proxy``'s."""

    def row(target: str, cpu: float, p50: float, p99: float) -> dict[str, Any]:
        return {
            "target": target,
            "load": 64,
            "keepalive": True,
            "close": False,
            "api": "chat",
            "cpu_us_per_event": cpu,
            "added_ttft_p50": p50,
            "added_ttft_p99": p99,
            "added_itl_p99": 0.1,
            "broken": 0,
        }

    lines = run.verdicts([row("proxy", 30.0, 0.1, 0.2), row("proxy-20up", 30.3, 0.12, 0.25)])
    assert (
        "- 64 streams with 20 upstreams (`proxy-20up`) vs one (`proxy`): CPU/event 30.3 vs "
        "30.0 us, +1.0 %; added TTFT p50 0.12 vs 0.10 ms, p99 0.25 vs 0.20 ms"
    ) in lines


def test_old_reports_still_render() -> None:
    """Runs recorded before loads had an upstream mode and an API (``--render`` of an
    old ``--json``) read as keep-alive upstream, chat."""
    figures = {"p50": 50.0, "p99": 60.0}
    old = {
        "round": 0,
        "load": 64,
        "keepalive": True,
        "streams": 10,
        "warmup_streams": 0,
        "broken": 0,
        "warmup_broken": 0,
        "ttft_ms": figures,
        "itl_ms": figures,
        "target_cpu_us_per_event": None,
        "client_cpu_us_per_event_all": 1.0,
        "upstream_cpu_us_per_event": 1.0,
        "target_cpu_s": 0.0,
        "wall_s": 1.0,
        "idle_rss_kib": 0,
    }
    runs = [old | {"target": "direct"}, old | {"target": "proxy", "target_cpu_us_per_event": 9.0}]
    rows = run.summarize_loads(runs, ["direct", "proxy"])
    assert [(r["target"], run.Load.of(r)) for r in rows] == [
        ("direct", run.Load(64)),
        ("proxy", run.Load(64)),
    ]
    meta = {
        "date": "d",
        "machine": "m",
        "command": "c",
        "schedule": "s",
        "code": "x",
        "pinning": "p",
        "rounds": 1,
        "tokens": 50,
        "itl": 0.02,
        "threshold_ms": 10.0,
        "sweep_rounds": 2,
    }
    report = run.render(rows, {}, {"proxy": 2048}, meta)
    assert "| 64 | chat | keep-alive | keep-alive | proxy | 50.0 | 60.0 | 0.00 |" in report
    assert "| 2.0 |" in report  # peak RSS of the keep-alive proxy instance, in MiB
    assert "Upstream close" not in report
    assert "Performance targets for `proxy`" in report


async def test_scrape_fill_puts_every_label_set_in_the_registry() -> None:
    """``fill_registry`` sends one stream per (model, client) of ``--scrape-fill``
    through a proxy with the client label on: each set is in its histograms."""
    if not HAS_PROXY:
        pytest.skip("no proxy in this tree")
    pairs = run.scrape_fill("6,2")
    assert len(pairs) == 12 and len({client for _, client in pairs}) == 6
    bench = _bench()
    try:
        async with upstream(FAST) as (url, stats):
            target = await asyncio.to_thread(
                bench.start_proxy, url, "proxy-scraped", ["--client-label-from", "header:x-client"]
            )
            await asyncio.to_thread(run.fill_registry, target.url, pairs)
            metrics = await asyncio.to_thread(_scrape, target.url)
    finally:
        await asyncio.to_thread(bench.close)
    assert stats["requests"] == stats["completed"] == 12
    found = re.findall(  # labels in alphabetical order: client before model
        r'^llm_proxy_inter_token_latency_seconds_count\{client="([^"]+)",model="([^"]+)",'
        r"[^}]*\} 1\.0$",
        metrics,
        re.M,
    )
    assert {(model, client) for client, model in found} == set(pairs)


@pytest.mark.timeout(240)
def test_run_py_scraped_targets_side_by_side(tmp_path: Path) -> None:
    """``proxy-scraped`` and ``proxy-before-scraped`` run beside their unscraped twins;
    a Prometheus scraped each scraped target during its load, and the report puts each
    twin beside its ``-before`` and says how the scrapes went."""
    if not (HAS_PROXY and HAS_PROMETHEUS):
        pytest.skip("needs the proxy and a prometheus server")
    targets = ["direct", "proxy", "proxy-before", "proxy-scraped", "proxy-before-scraped"]
    result = _run_harness(
        tmp_path,
        targets,
        "4",
        "--before",
        str(BENCH.parent),
        "--scrape-fill",
        "4,2",
        "--duration",
        "1.5",
    )
    _check_runs(result, targets, [run.Load(4)])
    for r in result["runs"]:
        if r["target"].endswith("-scraped"):
            assert r["scrapes"] >= 1 and r["scrapes_ok"] >= 1, r
        else:
            assert r.get("scrapes") is None
    report = run.render(result["rows"], result["sweep"], result["peaks"], result["meta"])
    assert "- 4: `proxy` vs `proxy-before`: CPU/event" in report
    assert "- 4: `proxy-scraped` vs `proxy-before-scraped`: CPU/event" in report
    assert "- 4: `proxy-scraped` scraped by Prometheus: " in report


def test_loop_micro_measures_scrapes_and_bodies(tmp_path: Path) -> None:
    """Both measurements run and report what they claim: renders and stalls for a small
    registry, decode costs and stalls per body size and shape."""
    out = tmp_path / "scrape.json"
    assert (
        loop_micro.main(
            [
                "scrape",
                "--clients",
                "3",
                "--models-per-client",
                "2",
                "--repeat",
                "1",
                "--scrapes",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    figures = json.loads(out.read_text())
    assert figures["label_sets"] == 6 and figures["lines"] > 100
    assert figures["renders_for_two_concurrent_scrapes"] == 1
    assert figures["inline"]["max_ms"] >= 0 and figures["thread"]["ticks"] >= 0
    assert len(loop_micro.worst_sets()) == 30_000
    out = tmp_path / "body.json"
    assert (
        loop_micro.main(
            [
                "body",
                "--max-size",
                "100000",
                "--repeat",
                "1",
                "--shapes",
                "turns,image",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["bytes"] > 0) for r in rows] == [
        ("turns", True),
        ("turns", True),
        ("image", True),
        ("image", True),
    ]
    for r in rows:
        assert r["inline_ms"] > 0 and r["pieces_ms"] > 0 and r["stall_pieces_thread_ms"] >= 0


def test_paired_reads_run_py_rounds(tmp_path: Path) -> None:
    """benchmarks/paired.py: per-round ratios from run.py's round lines, load 64 only."""
    log = tmp_path / "run.log"
    log.write_text(
        "\n".join(
            [
                "# round 1 64 proxy: ttft p50 50.7 p99 52.2 ms, itl p99 21.3 ms, broken 0/404, cpu/ev 60.0 us",
                "# round 1 64 proxy-doctor: ttft p50 50.7 p99 52.2 ms, itl p99 21.500 ms, broken 0/404, cpu/ev 66.0 us",
                "# round 1 1 proxy-doctor: ttft p50 50.7 p99 52.2 ms, itl p99 21.3 ms, broken 0/4, cpu/ev 999.0 us",
                "# round 2 64 proxy-doctor: ttft p50 50.7 p99 52.2 ms, itl p99 21.3 ms, broken 0/404, cpu/ev 72.0 us",
                "# round 2 64 proxy: ttft p50 50.7 p99 52.2 ms, itl p99 21.3 ms, broken 0/404, cpu/ev 80.0 us",
                "# round 3 64 proxy: ttft p50 50.7 p99 52.2 ms, itl p99 21.3 ms, broken 0/404, cpu/ev 50.0 us",
            ]
        )
        + "\n"
    )
    out = subprocess.run(
        [sys.executable, str(BENCH / "paired.py"), str(log), "proxy-doctor/proxy"],
        capture_output=True,
        text=True,
        check=True,
    )
    # rounds 1 and 2 have both (1.1 and 0.9); round 3 has one; load 1 is not read;
    # ITL p99 differs by 0.2 ms in round 1, not in round 2
    assert out.stdout.splitlines() == [
        "proxy-doctor / proxy: median of 2 per-round ratios 1.000 "
        "(interquartile 0.900-1.100, all 0.900-1.100)",
        "  TTFT p50 proxy-doctor - proxy, ms: +0.000 (interquartile +0.000-+0.000, "
        "all +0.000-+0.000)",
        "  TTFT p99 proxy-doctor - proxy, ms: +0.000 (interquartile +0.000-+0.000, "
        "all +0.000-+0.000)",
        "  ITL p99 proxy-doctor - proxy, ms: +0.100 (interquartile +0.000-+0.200, "
        "all +0.000-+0.200)",
    ]
    pooled = subprocess.run(
        [sys.executable, str(BENCH / "paired.py"), str(log), "--pool", str(log),
         "proxy-doctor/proxy"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert pooled.stdout.splitlines()[:2] == [
        "proxy-doctor / proxy: median of 4 per-round ratios 1.000 "
        "(interquartile 0.900-1.100, all 0.900-1.100)",
        "  median of each run's ratios: 1.000, 1.000",
    ]
    # how sure: resampled medians of the ratios 0.9 and 1.1 lie between them; the bar
    # at 1.0 counts those at or below it (seeded: the same every time)
    sure = subprocess.run(
        [sys.executable, str(BENCH / "paired.py"), str(log), "proxy-doctor/proxy",
         "--bootstrap", "400", "--bar", "1.0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[1]
    found = re.fullmatch(
        r"  90 % interval of the median (\S+)-(\S+) \(400 resamples\), (\d+)% of them "
        r"at or below 1\.000", sure)
    assert found is not None, sure
    assert float(found[1]) == 0.9 and float(found[2]) == 1.1 and 0 < int(found[3]) < 100


def test_the_profile_counts_a_sample_the_doctors_when_any_frame_of_it_is() -> None:
    """benchmarks/profile_proxy.py: a sample is the doctor's when a frame anywhere in its
    stack is (its job, keys, index, the prompt's parts), whatever it called below."""
    import profile_proxy

    raw = "\n".join([
        "run (uvicorn/server.py:86);PrefixCheck.run_batch (proxy/doctor/job.py:302);"
        "_recall (proxy/doctor/keys.py:564) 7",
        "run (uvicorn/server.py:86);ChatDialect.prompt (proxy/dialects/chat.py:240);"
        "_message (proxy/dialects/prompt.py:231) 5",
        "run (uvicorn/server.py:86);_chat_prompt (proxy/dialects/chat.py:253) 1",
        "run (uvicorn/server.py:86);PrefixJob.record (/tmp/x/proxy/doctor/job.py:581);"
        "gc_collect (gc.c:1) 2",
        "run (uvicorn/server.py:86);ChatDialect.classify (proxy/dialects/chat.py:90) 11",
        "run (uvicorn/server.py:86);Metrics.observe (proxy/metrics.py:299) 3",
    ])
    assert profile_proxy.doctor_samples(raw) == 15


def test_pooled_runs_are_resampled_run_first(tmp_path: Path) -> None:
    """benchmarks/paired.py --pool: three runs whose rounds agree within each run (ratios
    1.00, 1.02, 1.04, a little spread) give a 90 % interval as wide as the spread between
    the runs, not the narrow one their 36 rounds would give drawn as one run."""
    logs = []
    for n, base in enumerate((1.00, 1.02, 1.04)):
        log = tmp_path / f"run{n}.log"
        lines = []
        for r in range(12):
            ratio = base + (r % 3 - 1) * 0.001
            for target, cpu in (("proxy-nodoctor", 50.0), ("proxy", 50.0 * ratio)):
                lines.append(
                    f"# round {r + 1} 64 {target}: ttft p50 50.7 p99 52.2 ms, itl p99 21.3 ms, "
                    f"broken 0/404, cpu/ev {cpu:.4f} us"
                )
        log.write_text("\n".join(lines) + "\n")
        logs.append(str(log))

    def interval(args: list[str]) -> tuple[float, float]:
        out = subprocess.run(
            [sys.executable, str(BENCH / "paired.py"), *args, "proxy/proxy-nodoctor",
             "--bootstrap", "2000"],
            capture_output=True, text=True, check=True,
        ).stdout
        found = re.search(r"90 % interval of the median (\S+)-(\S+) ", out)
        assert found is not None, out
        return float(found[1]), float(found[2])

    low, high = interval([logs[0], "--pool", logs[1], "--pool", logs[2]])
    assert low <= 1.005 and high >= 1.035  # the runs' spread, from 1.00 to 1.04
    low, high = interval([logs[1]])  # one run: its rounds alone
    assert 1.018 <= low <= high <= 1.022


def test_a_side_of_several_targets_reads_their_geometric_mean(tmp_path: Path) -> None:
    """benchmarks/paired.py: ``proxy+proxy-before/proxy-nodoctor`` divides, per round, the
    geometric mean of the two targets' CPU per event by the baseline's (60 and 40 over
    50: 0.980, where the arithmetic mean would read 1.000), and averages their latencies;
    a round without one of them is not read."""
    log = tmp_path / "run.log"
    rows = [(1, "proxy", 60.0, 21.5), (1, "proxy-before", 40.0, 21.1),
            (1, "proxy-nodoctor", 50.0, 21.0), (2, "proxy", 60.0, 21.0),
            (2, "proxy-nodoctor", 50.0, 21.0)]
    log.write_text("".join(
        f"# round {r} 64 {t}: ttft p50 50.7 p99 52.2 ms, itl p99 {itl} ms, broken 0/404, "
        f"cpu/ev {cpu} us\n" for r, t, cpu, itl in rows))
    out = subprocess.run(
        [sys.executable, str(BENCH / "paired.py"), str(log), "proxy+proxy-before/proxy-nodoctor"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert out[0] == ("proxy+proxy-before / proxy-nodoctor: median of 1 per-round ratios 0.980 "
                      "(interquartile 0.980-0.980, all 0.980-0.980)")
    assert out[3].startswith("  ITL p99 proxy+proxy-before - proxy-nodoctor, ms: +0.300 ")


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_varied_prompts_share_one_system_prompt_and_ask_their_own_question(api: str) -> None:
    """``--prompt-shape varied``: every request is whole (its Content-Length its body's),
    with the same system prompt of ``--prompt-bytes`` and a question no other asks;
    ``repeated`` sends the same bytes every time."""
    cfg = _config("http://127.0.0.1:1/v1", api=api, prompt_bytes=2048, prompt_shape="varied")
    _, _, next_request = loadgen.request_source(cfg)
    systems, questions = set(), set()
    for _ in range(3):
        head, body = next_request().split(b"\r\n\r\n", 1)
        assert f"Content-Length: {len(body)}\r\n".encode() in head + b"\r\n"
        sent = json.loads(body)
        if api == "responses":
            system, question = sent["instructions"], sent["input"]
        elif api == "messages":
            system, question = sent["system"], sent["messages"][0]["content"]
        else:
            system, question = (m["content"] for m in sent["messages"])
        systems.add(system)
        questions.add(question)
    assert len(systems) == 1 and len(systems.pop().encode()) == 2048
    assert len(questions) == 3
    _, _, same = loadgen.request_source(_config("http://127.0.0.1:1/v1", prompt_bytes=2048))
    assert same() == same()


def _ratio_buckets(metrics: str) -> dict[str, float]:
    """The repeated-prefix share histogram's cumulative buckets, by ``le``."""
    pattern = r'llm_proxy_prompt_repeated_prefix_ratio_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)'
    return {le: float(n) for le, n in re.findall(pattern, metrics)}


@pytest.mark.parametrize("shape", ["repeated", "varied"])
async def test_the_prompt_shapes_reach_the_doctor_as_they_say(shape: str) -> None:
    """Through the production proxy (the doctor on by default): a repeated prompt is
    found repeated whole; a varied one repeats its system prompt and not its question
    (a share below 1), and neither breaks past the run's first prompts (seen first, or
    at once with the first)."""
    if not HAS_PROXY:
        pytest.skip("no proxy in this tree")
    users, per_user = 2, 3
    out, _, metrics = await _through_proxy(
        "proxy", concurrency=users, streams=per_user, prompt_bytes=2048, prompt_shape=shape)
    n = users * per_user
    assert out["streams"] == out["ok"] == n and out["errors"] == {}
    buckets = _ratio_buckets(metrics)
    assert buckets["+Inf"] == n  # every request examined
    whole = buckets["1.0"] - buckets["0.99"]  # shares above 0.99: repeated whole
    most = buckets["0.99"] - buckets["0.95"]  # the system prompt, not the question
    if shape == "repeated":
        assert whole >= 1 and most == 0
    else:
        assert whole == 0 and most >= 1
    breaks = re.findall(r'^llm_proxy_prompt_prefix_breaks_total\{[^}]*reason="([^"]+)"', metrics, re.M)
    assert "first_seen" in breaks and set(breaks) <= {"first_seen", "concurrent"}  # the start


def test_the_instruction_benchmark_reads_cachegrind_totals(tmp_path: Path) -> None:
    """``proxy_instructions.py`` reads a real cachegrind file's totals (every event it
    reports, the simulated caches' included) and prices one event of the extra streams
    as the difference of two runs over the difference of their events."""
    out = tmp_path / "cg.out"
    subprocess.run([require_tool("valgrind"), "--tool=cachegrind", "--cache-sim=yes",
                    f"--cachegrind-out-file={out}", "true"], check=True, capture_output=True)
    totals = proxy_instructions.counts(out)
    assert set(proxy_instructions.EVENTS) <= totals.keys() and totals["Ir"] > 0
    tripled = {k: 3 * v for k, v in totals.items()}
    one = proxy_instructions.per_event((totals, 100), (tripled, 300))
    assert one["Ir"] == pytest.approx(totals["Ir"] / 100)
    assert one["LL"] == pytest.approx((totals["ILmr"] + totals["DLmr"] + totals["DLmw"]) / 100)
    assert one["cycles"] == pytest.approx(one["Ir"] + 10 * one["L1"] + 100 * one["LL"])


def test_the_instruction_benchmark_splits_the_difference_by_function(tmp_path: Path) -> None:
    """``--functions``: a real cachegrind file's instructions per function add up to its
    total, and the split is each function's per-event difference, doctor on less off."""
    out = tmp_path / "cg.out"
    subprocess.run([require_tool("valgrind"), "--tool=cachegrind", f"--cachegrind-out-file={out}",
                    "true"], check=True, capture_output=True)
    functions = proxy_instructions.by_function(out)
    assert len(functions) > 1
    assert sum(functions.values()) == proxy_instructions.counts(out)["Ir"]

    def written(name: str, body: str) -> Path:
        path = tmp_path / name
        path.write_text(f"events: I1mr Ir\nfl=x.c\n{body}summary: 0 0\n")
        return path

    on = (written("on-few", "fn=f\n1 0 10\nfn=g\n2 0 5\n"),
          written("on-many", "fn=f\n1 0 30\nfn=g\n2 0 5\nfn=h\n3 9 20\n"), 10)
    off = (written("off-few", "fn=f\n1 0 10\n"), written("off-many", "fn=f\n1 0 20\n"), 10)
    split = proxy_instructions.function_difference({"proxy": on, "proxy-nodoctor": off})
    assert split == {"f": pytest.approx(1.0), "g": 0.0, "h": pytest.approx(2.0)}
