"""The live page's data (``/ui/data``), its serving rules and its bad-input answers.

* The figures against the registry's own exposition: the same registry read through
  ``/metrics`` text and prometheus_client's parser (:mod:`proxy.bench.promscrape`) gives
  the same counts, means and bucket percentiles.
* "Last minute" and "over time" with a scripted clock: which collection the window starts
  from, since start (and saying so) until the ring holds a minute, the ring's bounds, the
  breaks where no page polled, only whole intervals drawn.
* The table by upstream and model from real requests through the proxy to two scripted
  upstreams: every figure follows from the upstreams' schedules; what counts as an error;
  the prompt-cache doctor's missed tokens read when the registry has them.
* Labels the page does not select on are summed generically (a ``client`` label, two
  upstreams), whatever they are.
* Bad input: 400 in the OpenAI error shape, refused before the registry is read.
* Where the page is served: with ``/metrics`` (main port, or ``--metrics-port``), not with
  ``--no-ui`` or ``--no-measure``; with ``--workers`` it sums every worker.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import signal
import textwrap
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy.bench import promscrape
from proxy.config import Settings, from_sources
from proxy.measure import Outcome, RequestRecord
from proxy.metrics import Metrics
from proxy.simulator.app import create_simulator_app
from proxy.simulator.model import SimConfig
from proxy.ui import LivePage
from proxy.ui import collect as ui_collect
from proxy.ui import data as ui_data
from proxy.ui import panels as ui_panels
from proxy.ui.page import MAX_QUERY
from proxy.ui.slow import KEEP, SlowRequests
from tests.fake_upstream import (
    DONE,
    Handler,
    ScriptedClock,
    ScriptedUpstream,
    chunk_json,
    sse,
    text_json,
    usage_json,
)
from tests.servers import closed_port, proxy_process, serve_in_thread
from tests.upstream_fakes import SSE_HEADERS, lazy, timed_body

pytestmark = pytest.mark.anyio

TTFT = "llm_proxy_time_to_first_token_seconds"
ITL = "llm_proxy_inter_token_latency_seconds"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Counting:
    """A registry that counts how often it was read."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.reads = 0

    def collect(self) -> Iterable[Any]:
        self.reads += 1
        return self.registry.collect()


def record(i: int = 0, **kw: Any) -> RequestRecord:
    values: dict[str, Any] = {
        "request_id": f"req-{i}",
        "route": CHAT,
        "model": "m-a",
        "upstream": "up",
        "stream": True,
        "status": 200,
        "outcome": Outcome.COMPLETED,
        "duration_s": 1.0,
        "overhead_s": 0.001,
        "queue_s": 0.0,
        "ttft_s": 0.2,
        "ttfa_s": 0.3,
        "tpot_s": 0.03,
        "itl_s": (0.02, 0.03, 0.04),
        "output_events": 4,
        "prompt_tokens": 100,
        "cached_prompt_tokens": 25,
        "completion_tokens": 4,
    }
    values.update(kw)
    return RequestRecord(**values)


def traffic() -> Iterator[RequestRecord]:
    """Two routes, two models, streams and not, every outcome."""
    outcomes = [Outcome.COMPLETED] * 6 + [Outcome.UPSTREAM_5XX, Outcome.CLIENT_DISCONNECTED]
    for i in range(40):
        model = "m-a" if i % 3 else "m-b"
        yield record(
            i,
            route=CHAT if i % 4 else COMPLETIONS,
            model=model,
            ttft_s=0.05 + 0.037 * i,
            ttfa_s=0.08 + 0.04 * i,
            duration_s=1.0 + 0.05 * i,
            queue_s=0.01 * (i % 5),
            itl_s=tuple(0.01 + 0.013 * ((i + k) % 17) for k in range(5)),
            tpot_s=0.02 + 0.01 * (i % 25),
            outcome=outcomes[i % len(outcomes)],
            stream=i % 10 != 9,
            status=200 if i % 8 else 502,
            prompt_tokens=100 + 10 * i,
            cached_prompt_tokens=(50 if model == "m-a" else 0),
        )


def observed(registry: CollectorRegistry | None = None) -> tuple[Metrics, CollectorRegistry]:
    registry = registry or CollectorRegistry()
    metrics = Metrics(registry)
    for r in traffic():
        metrics.observe(r, measured=True)
    return metrics, registry


def scraped(registry: CollectorRegistry) -> promscrape.Snapshot:
    """The registry as ``/metrics`` shows it, read as the bench reads it."""
    return promscrape.parse(generate_latest(registry).decode())


# ---------------------------------------------------------------------------
# The figures


@pytest.mark.parametrize(
    "selection", [("", "", ""), (CHAT, "", ""), ("", "m-b", ""), (COMPLETIONS, "m-a", "up")]
)
def test_figures_equal_the_exposition(selection: tuple[str, str, str]) -> None:
    _, registry = observed()
    data = ui_data.LiveData(registry, clock=Clock())
    total = data.answer(selection)["figures"]["total"]
    wanted = {k: v for k, v in zip(("route", "model", "upstream"), selection, strict=True) if v}
    snap = scraped(registry)
    where = promscrape.label_filter(**wanted)
    assert total["requests"] == promscrape.total(snap, promscrape.REQUESTS, where) > 0
    for key, name in (
        ("ttft", TTFT),
        ("itl", ITL),
        ("tpot", promscrape.TPOT),
        ("ttfa", "llm_proxy_time_to_first_answer_token_seconds"),
    ):
        hist = promscrape.histogram(snap, name, where)
        assert total[key]["n"] == hist.count > 0
        assert total[key]["mean"] == pytest.approx(hist.mean)
        for q in (0.5, 0.9, 0.99):
            assert total[key][f"p{round(q * 100)}"] == pytest.approx(hist.quantile(q))
    prompt = promscrape.histogram(snap, promscrape.PROMPT_TOKENS, where).sum
    cached = promscrape.histogram(snap, promscrape.CACHED_TOKENS, where).sum
    assert total["cache_hit_ratio"] == pytest.approx(cached / prompt)
    assert total["outcomes"] == {
        k: v
        for k, v in promscrape.by_label(snap, promscrape.OUTCOMES, "outcome", where).items()
        if v
    }
    assert (
        total["output_tokens"]
        == promscrape.histogram(snap, promscrape.COMPLETION_TOKENS, where).sum
    )


def test_time_split_adds_up_to_the_mean_streamed_request() -> None:
    metrics = Metrics(CollectorRegistry())
    for i in range(4):
        metrics.observe(
            record(i, queue_s=0.1, overhead_s=0.002, ttft_s=0.5, duration_s=2.0,
                   itl_s=(0.5, 0.5, 0.5)),
            measured=True,
        )
    metrics.observe(
        record(9, stream=False, ttft_s=None, duration_s=30.0, queue_s=0.1, overhead_s=0.002),
        measured=True,
    )
    split = ui_data.LiveData(metrics.registry, clock=Clock()).answer(("", "", ""))["figures"][
        "total"
    ]["time"]
    # The non-streamed 30 s request is not part of the streamed request's mean duration;
    # its queue and overhead (0.1 s, 0.002 s) are, being the same as the streams'.
    assert split["request_s"] == pytest.approx(2.0)
    assert split["parts_s"] == pytest.approx(
        {"queue": 0.1, "overhead": 0.002, "first_token": 0.398, "decode": 1.5}
    )
    assert math.fsum(split["shares"].values()) == pytest.approx(1.0)


def test_time_split_leaves_out_the_streams_that_had_no_first_token() -> None:
    """Streams answered an error (429 at once) are streams without a first token: they
    lowered the mean duration below the first token, and decoding read as 0."""
    metrics = Metrics(CollectorRegistry())
    metrics.observe(record(0, ttft_s=0.3, duration_s=0.5, itl_s=(0.05,) * 4), measured=True)
    for i in range(1, 5):
        metrics.observe(
            record(i, status=429, outcome=Outcome.UPSTREAM_4XX, ttft_s=None, ttfa_s=None,
                   tpot_s=None, itl_s=(), output_events=0, completion_tokens=None,
                   duration_s=0.003),
            measured=True,
        )
    split = ui_data.LiveData(metrics.registry, clock=Clock()).answer(("", "", ""))["figures"][
        "total"
    ]["time"]
    assert split["request_s"] == pytest.approx(0.5)
    assert split["parts_s"]["decode"] == pytest.approx(0.2)
    assert math.fsum(split["parts_s"].values()) == pytest.approx(split["request_s"])


def test_cache_hit_ratio_leaves_out_upstreams_that_never_say() -> None:
    """An upstream that reports no cached tokens is unknown, not a cache that hit
    nothing: its prompt tokens are not in the ratio's denominator."""
    metrics = Metrics(CollectorRegistry())
    metrics.observe(record(0, upstream="says", prompt_tokens=1234, cached_prompt_tokens=1000),
                    measured=True)
    metrics.observe(record(1, upstream="silent", prompt_tokens=1234, cached_prompt_tokens=None),
                    measured=True)
    data = ui_data.LiveData(metrics.registry, clock=Clock())
    assert data.answer(("", "", ""))["figures"]["total"]["cache_hit_ratio"] == pytest.approx(
        1000 / 1234)
    assert data.answer(("", "", "silent"))["figures"]["total"]["cache_hit_ratio"] is None


def test_last_minute_starts_from_the_collection_a_minute_ago() -> None:
    clock = Clock()
    metrics = Metrics(CollectorRegistry())
    data = ui_data.LiveData(metrics.registry, clock=clock)
    for i in range(5):
        metrics.observe(record(i, ttft_s=2.0), measured=True)
    first = data.answer(("", "", ""))
    assert first["figures"]["window"] is None  # nothing to compare with yet
    assert first["figures"]["total"]["ttft"]["n"] == 5
    for second in range(1, 62):  # a page polling once a second
        clock.now += 1.0
        if second == 30:
            for i in range(3):
                metrics.observe(record(10 + i, ttft_s=0.1), measured=True)
        answer = data.answer(("", "", ""))
    assert answer["window_s"] == pytest.approx(60.0)
    window, total = answer["figures"]["window"], answer["figures"]["total"]
    assert window["ttft"]["n"] == 3 and window["ttft"]["p99"] < 0.1
    assert total["ttft"]["n"] == 8 and total["ttft"]["p99"] > 1.5
    assert window["requests_per_s"] == pytest.approx(3 / 60)
    clock.now += 45.0  # no page for 45 s: the last minute is what the ring has
    later = data.answer(("", "", ""))
    # The base is the oldest collection within the minute (45 s after the three came),
    # not the current one: the minute has no request.
    assert later["window_s"] == pytest.approx(60.0)
    assert (
        later["figures"]["window"]["requests"] == 0 and later["figures"]["window"]["ttft"] is None
    )


def test_over_time_points_every_five_seconds_with_breaks_where_no_page_polled() -> None:
    clock = Clock()
    metrics = Metrics(CollectorRegistry())
    data = ui_data.LiveData(metrics.registry, clock=clock)
    for second in range(21):
        if second % 5 == 2:
            metrics.observe(record(second, ttft_s=0.1 * (second + 1)), measured=True)
        data.answer(("", "", ""))
        clock.now += 1.0
    clock.now += 100.0  # the page was closed
    metrics.observe(record(99, ttft_s=5.0), measured=True)
    series = data.answer(("", "", ""))["series"]
    # collections at 0, 5, 10, 15, 20 and now (121): four 5 s points, a break, one more
    assert series["t"] == [-121 + 5, -121 + 10, -121 + 15, -121 + 20, -121 + 25, 0]
    p50 = series["ttft.p50"]
    assert p50[4] is None and series["requests_per_s"][4] is None
    assert [p is not None for p in p50] == [True, True, True, True, False, True]
    assert series["requests_per_s"][:4] == [pytest.approx(1 / 5)] * 4
    assert p50[0] < p50[1] < p50[2] < p50[3] < p50[5]


def test_over_time_draws_only_whole_intervals() -> None:
    """The interval still running is not a point: its first second has none of the
    requests a whole interval has, so the right-most point would drop toward zero."""
    clock = Clock()
    metrics = Metrics(CollectorRegistry())
    data = ui_data.LiveData(metrics.registry, clock=clock)
    for second in range(17):  # one request every 5 s, at 2, 7, 12, 17 s
        if second % 5 == 2:
            metrics.observe(record(second, completion_tokens=10), measured=True)
        series = data.answer(("", "", ""))["series"]
        clock.now += 1.0
    # at 16 s: collections every 5 s at 0, 5, 10 and 15; the last whole interval ends at 15
    assert series["t"] == [-11.0, -6.0, -1.0]
    assert series["requests_per_s"] == [0.2, 0.2, 0.2]
    assert series["output_tokens_per_s"] == [2.0, 2.0, 2.0]
    assert series["ttft.p50"] == [pytest.approx(0.175)] * 3  # one 0.2 in (0.15, 0.2]


def test_since_start_until_the_ring_holds_a_minute_and_it_says_so() -> None:
    """A page opened during traffic shows since-start figures at once, labelled so,
    rather than nothing, or a few seconds labelled as the last minute."""
    clock = Clock()
    metrics = Metrics(CollectorRegistry())
    for i in range(5):
        metrics.observe(record(i, ttft_s=2.0), measured=True)
    clock.now += 300.0  # the proxy has run for 5 minutes when the first page opens
    data = ui_data.LiveData(metrics.registry, clock=clock)
    data.started = clock.now - 300.0
    first = data.answer(("", "", ""))
    assert first["span"] == {
        "kind": "start",
        "label": "since start",
        "seconds": 300.0,
        "minute_in_s": ui_collect.FULL_WINDOW_S,
    }
    assert first["figures"]["window"] is None
    assert first["figures"]["total"]["requests"] == 5
    assert first["table"]["rows"][0]["requests"] == 5
    for _ in range(30):  # half a minute of polling, with traffic
        clock.now += 1.0
        metrics.observe(record(9, ttft_s=0.1), measured=True)
        half = data.answer(("", "", ""))
    # 30 s is not the last minute: since start, until the ring holds one
    assert half["span"]["kind"] == "start" and half["span"]["label"] == "since start"
    assert half["span"]["minute_in_s"] == pytest.approx(ui_collect.FULL_WINDOW_S - 30.0)
    assert half["figures"]["window"] is None and half["hist"][TTFT]["window"] is None
    assert half["table"]["rows"][0]["requests"] == 35
    for _ in range(30):
        clock.now += 1.0
        minute = data.answer(("", "", ""))
    assert minute["span"] == {"kind": "minute", "label": "last minute", "seconds": 60.0}
    assert minute["figures"]["window"]["requests"] == 30  # those of the last 60 s
    assert minute["figures"]["total"]["requests"] == 35
    assert minute["table"]["rows"][0]["requests"] == 30  # the table covers the same span


def test_errors_are_the_upstreams_and_the_proxys_failures_not_the_client_leaving() -> None:
    metrics = Metrics(CollectorRegistry())
    for i, outcome in enumerate(o for o in Outcome if o is not Outcome.REJECTED):
        metrics.observe(record(i, outcome=outcome, status=200), measured=True)
    # Not streamed: a 5xx counts (no outcome is recorded for these); a 4xx cannot be
    # told from the proxy refusing the request, and a refusal is not the upstream's.
    metrics.observe(record(20, stream=False, status=502), measured=True)
    metrics.observe(record(21, stream=False, status=404), measured=True)
    metrics.observe(record(22, outcome=Outcome.REJECTED, status=429), measured=True)
    row = ui_data.LiveData(metrics.registry, clock=Clock()).answer(("", "", ""))["table"]["rows"]
    assert len(row) == 1
    failed = {
        "upstream_interrupted",
        "upstream_timeout",
        "pool_timeout",
        "upstream_unreachable",
        "upstream_4xx",
        "upstream_5xx",
        "upstream_error",
        "cancelled",
    }
    assert set(ui_panels.FAILED) == failed
    assert row[0]["errors_by"] == {**dict.fromkeys(failed, 1.0), "5xx, not streamed": 1.0}
    assert row[0]["errors"] == len(failed) + 1
    assert row[0]["requests"] == len(Outcome) - 1 + 3
    assert row[0]["error_share"] == pytest.approx(row[0]["errors"] / row[0]["requests"])


def test_the_ring_is_bounded_and_idle_series_are_shared() -> None:
    clock = Clock()
    metrics = Metrics(CollectorRegistry())
    metrics.observe(record(0, model="idle"), measured=True)
    data = ui_data.LiveData(metrics.registry, clock=clock)
    for second in range(400):  # more than the fine ring (61 s) and the coarse (300 s)
        metrics.observe(record(second, model="busy"), measured=True)
        data.answer(("", "", ""))
        clock.now += 1.0
    assert len(data.fine) <= 62 and len(data.coarse) == ui_data.COARSE_KEEP
    idle = [c.series[(CHAT, "idle", "up")] for c in (*data.fine, *data.coarse)]
    assert all(s.scalars is idle[0].scalars for s in idle)
    assert all(s.hists[TTFT] is idle[0].hists[TTFT] for s in idle)
    busy = [c.series[(CHAT, "busy", "up")] for c in data.fine]
    assert len({id(s.hists[TTFT]) for s in busy}) == len(busy)


def test_labels_not_selected_are_summed_whatever_they_are() -> None:
    """A ``client`` label and two upstreams, as later versions may export."""
    registry = CollectorRegistry()
    ttft = Histogram(
        TTFT,
        "t",
        ("route", "model", "upstream", "client"),
        registry=registry,
        buckets=(0.1, 0.5, 1.0),
    )
    requests = Counter(
        "llm_proxy_requests",
        "r",
        ("route", "model", "upstream", "client", "code"),
        registry=registry,
    )
    for upstream, client, value in (
        ("a", "app1", 0.05),
        ("a", "app2", 0.3),
        ("b", "app1", 0.7),
        ("b", "app1", 0.8),
    ):
        ttft.labels(CHAT, "m", upstream, client).observe(value)
        requests.labels(CHAT, "m", upstream, client, "200").inc()
    data = ui_data.LiveData(registry, clock=Clock())
    everything = data.answer(("", "", ""))
    assert everything["choices"] == {"route": [CHAT], "model": ["m"], "upstream": ["a", "b"]}
    assert everything["figures"]["total"]["ttft"]["n"] == 4
    assert everything["figures"]["total"]["requests"] == 4
    only_b = data.answer(("", "m", "b"))["figures"]["total"]
    assert only_b["ttft"]["n"] == 2 and only_b["ttft"]["mean"] == pytest.approx(0.75)
    snap = scraped(registry)
    hist = promscrape.histogram(snap, TTFT, promscrape.label_filter(upstream="b"))
    assert only_b["ttft"]["p90"] == pytest.approx(hist.quantile(0.9))


def test_the_registry_is_read_at_most_twice_a_second() -> None:
    clock = Clock()
    _, registry = observed()
    counting = Counting(registry)
    data = ui_data.LiveData(counting, clock=clock)
    for _ in range(10):  # ten pages, or one hostile poller, in the same instant
        data.answer(("", "", ""))
    assert counting.reads == 1
    clock.now += ui_data.MIN_COLLECT_S
    data.answer(("", "m-a", ""))
    assert counting.reads == 2


# ---------------------------------------------------------------------------
# By upstream and model, from real requests through the proxy

T0 = 64.0


def scheduled(clock: ScriptedClock, first: float, gap: float, n: int = 5) -> Handler:
    """Streams with the first token ``first`` s after the request and ``n`` tokens ``gap``
    apart (100 prompt tokens); a model named ``*-bad`` gets a 502, a request not
    streamed a 503."""

    async def respond(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["model"].endswith("-bad") or not body.get("stream"):
            error = json.dumps({"error": {"message": "down", "type": "server_error"}}).encode()
            status = 502 if body.get("stream") else 503
            headers = {"content-type": "application/json", "content-length": str(len(error))}
            return httpx.Response(status, headers=headers, content=lazy(error))
        legacy = request.url.path.endswith("/v1/completions")
        events = [
            text_json(f"t{i}") if legacy else chunk_json({"content": f"t{i}"}) for i in range(n)
        ]
        script = [(T0 + first + i * gap, sse(event)) for i, event in enumerate(events)]
        last = T0 + first + (n - 1) * gap
        script += [(last, sse(usage_json(100, n))), (last, DONE)]
        clock.now = T0
        return httpx.Response(200, headers=SSE_HEADERS, content=timed_body(clock, script, last))

    return respond


@asynccontextmanager
async def two_upstreams(
    tmp_path: Path,
) -> AsyncIterator[tuple[httpx.AsyncClient, Any, ScriptedClock]]:
    """The proxy (from a config file with two ``[[upstream]]`` tables) in front of
    ``fast`` (gpt-* models: first token after 125 ms, then 12.5 ms apart) and ``slow``
    (claude-*: 1.25 s, then 62.5 ms apart); its registry's page view."""
    clock = ScriptedClock(T0)
    fast = ScriptedUpstream(scheduled(clock, 0.125, 0.0125), clock)
    slow = ScriptedUpstream(scheduled(clock, 1.25, 0.0625), clock)
    path = tmp_path / "proxy.toml"
    path.write_text(
        textwrap.dedent(f"""
        # The doctor's counter is counted by hand in the test below, to check how the
        # page reads it (tests/test_prefix_proxy.py drives the doctor itself).
        prefix_doctor = false

        [[upstream]]
        name = "fast"
        url = "{fast.url}/v1"
        models = ["gpt-*"]

        [[upstream]]
        name = "slow"
        url = "{slow.url}/v1"
        models = ["claude-*"]
        """)
    )
    from proxy.app import create_app

    settings = from_sources(None, {"LLM_PROXY_CONFIG": str(path)})
    app = create_app(settings, registry=CollectorRegistry(), clock=clock)
    assert app.ui is not None
    transport = httpx.ASGITransport(app=app)
    try:
        await fast.start()
        await slow.start()
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as http:
            yield http, app, clock
    finally:
        await app.aclose()
        await fast.aclose()
        await slow.aclose()


async def send(
    http: httpx.AsyncClient, clock: ScriptedClock, model: str, *, stream: bool = True,
    route: str = CHAT,
) -> int:
    clock.now = T0
    body: dict[str, Any] = {"model": model, "stream": stream}
    if route == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    response = await http.post(route, json=body)
    return response.status_code


async def test_by_upstream_and_model_from_real_requests(tmp_path: Path) -> None:
    async with two_upstreams(tmp_path) as (http, app, clock):
        for _ in range(4):
            assert await send(http, clock, "gpt-4o") == 200
        for _ in range(2):
            assert await send(http, clock, "claude-3") == 200
        assert await send(http, clock, "claude-3", stream=False) == 503
        assert await send(http, clock, "claude-bad") == 502
        page = Clock()
        # The page's own reading of the app's registry (restricted to the samples it
        # uses, as served), with a clock of its own.
        data = ui_data.LiveData(app.ui.data.registry, clock=page)
        answer = data.answer(("", "", ""))
        table = answer["table"]
        assert table["by_route"] is False and table["missed_measured"] is False
        # neither upstream says what it served from its cache: unknown, where it read 0 %
        assert answer["figures"]["total"]["cache_hit_ratio"] is None
        rows = table["rows"]
        assert [(r["upstream"], r["model"], r["requests"]) for r in rows] == [
            ("fast", "gpt-4o", 4),
            ("slow", "claude-3", 3),
            ("slow", "claude-bad", 1),
        ]
        fast, slow, bad = rows
        # Every TTFT 125 ms (bucket 100-150 ms), every gap 12.5 ms (10-15 ms); 1.25 s
        # (1-1.5 s) and 62.5 ms (50-75 ms): mid-bucket, so the estimates are exact.
        assert fast["ttft_p50"] == fast["ttfa_p50"] == pytest.approx(0.125)
        assert fast["ttft_p95"] == pytest.approx(0.1 + 0.05 * 0.95)
        assert fast["itl_p50"] == pytest.approx(0.0125)
        assert fast["decode_tok_s"] == pytest.approx(80.0)  # 1 / 12.5 ms
        assert (fast["errors"], fast["error_share"], fast["errors_by"]) == (0, 0, {})
        assert slow["ttft_p50"] == pytest.approx(1.25) and slow["ttft_p95"] == pytest.approx(1.475)
        assert slow["itl_p50"] == pytest.approx(0.0625)
        assert slow["decode_tok_s"] == pytest.approx(16.0)  # 1 / 62.5 ms
        assert slow["errors_by"] == {"5xx, not streamed": 1}
        assert slow["error_share"] == pytest.approx(1 / 3)
        assert bad["errors_by"] == {"upstream_5xx": 1} and bad["ttft_p50"] is None
        assert bad["decode_tok_s"] is None
        assert all(r["missed_cache"] is None and r["route"] == "" for r in rows)
        assert (fast["prompt_tokens"], slow["prompt_tokens"]) == (400, 200)
        # The same figures as /metrics gives for each row's labels.
        snap = scraped(app.metrics.registry)
        for row in rows[:2]:
            where = promscrape.label_filter(upstream=row["upstream"], model=row["model"])
            assert row["requests"] == promscrape.total(snap, promscrape.REQUESTS, where)
            ttft = promscrape.histogram(snap, TTFT, where)
            assert row["ttft_p95"] == pytest.approx(ttft.quantile(0.95))
            tpot = promscrape.histogram(snap, promscrape.TPOT, where)
            assert row["decode_tok_s"] == pytest.approx(1 / tpot.quantile(0.5))

        # A second route with traffic: rows per route too.
        assert await send(http, clock, "gpt-4o", route=COMPLETIONS) == 200
        # The prompt-cache doctor's counters, once the registry has samples of them.
        app.metrics.prefix.missed_tokens.labels(CHAT, "gpt-4o", "fast").inc(30)
        for upstream, model, missed in (("fast", "gpt-4o", 30), ("slow", "claude-3", 0)):
            app.metrics.prefix.missed_per_request.labels(CHAT, model, upstream).observe(missed)
        page.now += 1.0
        table = data.answer(("", "", ""))["table"]
        assert table["by_route"] is True and table["missed_measured"] is True
        assert [(r["upstream"], r["model"], r["route"], r["requests"]) for r in table["rows"]] == [
            ("fast", "gpt-4o", CHAT, 4),
            ("slow", "claude-3", CHAT, 3),
            ("fast", "gpt-4o", COMPLETIONS, 1),
            ("slow", "claude-bad", CHAT, 1),
        ]
        chat_fast, chat_slow, legacy = table["rows"][:3]
        assert chat_fast["missed_cache"] == pytest.approx(30 / 400)
        assert chat_slow["missed_cache"] == 0.0  # examined, nothing missed
        assert legacy["missed_cache"] is None  # none examined with the figure: unknown, not 0
        assert legacy["ttft_p50"] == pytest.approx(0.125)
        assert legacy["decode_tok_s"] == pytest.approx(80.0)


# ---------------------------------------------------------------------------
# Prompt caching and What to fix, from real requests through the proxy

STAMPED = "Current time is 12:00:{:02d}" + ".\n\n" + "x" * 3069  # 24 + 3,072 bytes
SHARED = "s" * 4096  # sixteen whole blocks
PER_1K_S, FIXED_S = 0.1, 0.02  # the upstream's prefill: 100 ms per 1,000 uncached tokens


def prefilled(clock: ScriptedClock, cached: dict[str, int]) -> Handler:
    """Chat streams whose usage says one prompt token per four bytes of the messages'
    content, cached tokens ``cached[model]`` (0 for a model's first request), and whose
    first token comes ``FIXED_S + PER_1K_S`` per 1,000 uncached tokens after the
    request (sent at the clock's time): a prefill cost the fit finds exactly."""
    first: set[str] = set()

    async def respond(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        model = body["model"]
        size = sum(len(m["content"].encode()) for m in body["messages"])
        assert size % 4 == 0
        prompt = size // 4
        hit = cached.get(model, 0) if model in first else 0
        first.add(model)
        ttft = FIXED_S + PER_1K_S * (prompt - hit) / 1000
        sent = clock.now
        script = [(sent + ttft + i * 0.0125, sse(chunk_json({"content": f"t{i}"})))
                  for i in range(5)]
        last = script[-1][0]
        script += [(last, sse(usage_json(prompt, 5, hit))), (last, DONE)]
        clock.now = sent
        return httpx.Response(200, headers=SSE_HEADERS, content=timed_body(clock, script, last))

    return respond


async def test_prompt_caching_and_what_to_fix_from_real_requests(tmp_path: Path) -> None:
    """Two apps on one upstream: ``gpt-clock`` puts the time first in a 3,096-byte system
    prompt (the doctor finds ``variable_before_stable`` at message 0, bytes 0-256: the
    time's line, block-rounded, and the 2,840 bytes after it repeat), ``gpt-cached`` repeats a 4,096-byte system prompt that
    the upstream reports half cached (512 of its 1,024 tokens missed a request). Every
    figure of both panels follows from the script."""
    from proxy.app import create_app
    from proxy.upstream_spec import UpstreamSpec

    clock = ScriptedClock(T0)
    upstream = ScriptedUpstream(prefilled(clock, {"gpt-cached": 512}), clock)
    # Every repeated token is cacheable here: no minimum length, no caching step.
    spec = UpstreamSpec("up", upstream.url + "/v1", models=("*",), default=True,
                        min_cacheable_tokens=0, cache_granularity_tokens=1)
    app = create_app(Settings(upstreams=(spec,), prefix_doctor=True), registry=CollectorRegistry(),
                     clock=clock)
    assert app.ui is not None
    questions = [f"question {i}: " + "w" * (4 * (10 + 37 * i) - len(f"question {i}: "))
                 for i in range(24)]
    sent: dict[str, list[int]] = {"gpt-clock": [], "gpt-cached": []}
    try:
        await upstream.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy.test") as http:
            for i, question in enumerate(questions):
                for j, (model, system) in enumerate((("gpt-clock", STAMPED.format(i)),
                                                     ("gpt-cached", SHARED))):
                    # one request a second: each after the one before's first token
                    clock.now = T0 + 2 * i + j
                    body = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": question}]}
                    assert (await http.post(CHAT, json=body)).status_code == 200
                    sent[model].append((len(system) + len(question)) // 4)
        page = Clock()
        data = ui_data.LiveData(app.ui.data.registry, clock=page, breaks=app.ui.data.breaks)
        data.started = page.now - 100.0  # since start: 100 s
        everything = data.answer(("", "", ""))
    finally:
        await app.aclose()
        await upstream.aclose()

    n = len(questions)
    clock_tokens, cached_tokens = sum(sent["gpt-clock"]), sum(sent["gpt-cached"])
    pc = everything["prompt_cache"]
    assert pc["measured"] is True and pc["window"] is None  # no minute yet: since start
    total = pc["total"]
    prompt = clock_tokens + cached_tokens
    assert total["prompt"] == {"tokens": prompt, "per_s": prompt / 100, "share": 1.0}
    repeated, missed = 1024 * (n - 1), 512 * (n - 1)  # gpt-cached's from its second on
    assert total["repeated"] == {"tokens": repeated, "per_s": repeated / 100,
                                 "share": pytest.approx(repeated / prompt)}
    assert total["cached"]["tokens"] == 512 * (n - 1)
    assert total["missed"] == {"tokens": missed, "per_s": missed / 100,
                               "share": pytest.approx(missed / prompt)}
    assert total["examined"] == 2 * n  # every usage says its cached tokens
    # 512 tokens missed by each of gpt-cached's requests but the first, at 0.1 ms a token,
    # per request examined; both selections have a prefill fit.
    assert total["missed_ms"] == pytest.approx(PER_1K_S * missed / (2 * n))
    assert total["missed_ms_covers"] == pytest.approx(1.0)
    assert total["breaks_total"] == n - 1 + 2
    top, second = total["breaks"]
    assert (top["reason"], top["count"], second["reason"], second["count"]) == (
        "variable_before_stable", n - 1, "first_seen", 2)
    example = top["example"]
    tokens = 2840 * sent["gpt-clock"][-1] / (3096 + len(questions[-1]))  # its own ratio
    assert tokens == 710
    assert {k: example[k] for k in ("route", "model", "upstream", "part", "index", "role",
                                    "offset", "part_bytes", "changed_bytes", "stable_bytes",
                                    "stable_tokens")} == {
        "route": CHAT, "model": "gpt-clock", "upstream": "up", "part": "system", "index": 0,
        "role": "system", "offset": 0, "part_bytes": 3096, "changed_bytes": 256,
        "stable_bytes": 2840, "stable_tokens": 710}
    assert top["saves_ms"] == pytest.approx(71.0)  # 710 tokens at 0.1 ms
    assert top["sentence"] == (
        "Message 0 (system) changes in bytes 0-256 of 3,096; the 2,840 bytes after them "
        "repeat: move the changing part after them (about 710 tokens a request could be "
        "cached, 71 ms of first token by the prefill fit).")
    assert second["sentence"].startswith("Nothing like this prompt went to this upstream")

    # What to fix: both selections, the busiest first (equal: by route, model, upstream).
    card = everything["fix"]
    assert [(s["model"], s["requests"]) for s in card["selections"]] == [
        ("gpt-cached", n), ("gpt-clock", n)]
    assert card["more"] == 0
    by_model = {s["model"]: s for s in card["selections"]}
    stamped = by_model["gpt-clock"]
    fit = stamped["fit"]["total"]
    assert stamped["fit"]["window"] is None
    assert fit["usable"] and fit["requests"] == n
    assert fit["ms_per_1k_tokens"] == pytest.approx(1000 * PER_1K_S)
    assert fit["fixed_ms"] == pytest.approx(1000 * FIXED_S)
    lever = stamped["levers"][0]
    mean_tokens = clock_tokens / n
    assert (lever["name"], lever["status"]) == ("prefill", "lever")
    assert lever["saves_ms"] == pytest.approx(PER_1K_S * mean_tokens, rel=1e-3)
    assert stamped["first_token"]["mean_ms"] == pytest.approx(
        1000 * FIXED_S + PER_1K_S * mean_tokens, rel=1e-3)
    # gpt-cached: its missed cache, at the fitted cost, is a lever of its own.
    levers = {lv["name"]: lv for lv in by_model["gpt-cached"]["levers"]}
    assert levers["prompt_cache"]["saves_ms"] == pytest.approx(
        PER_1K_S * missed / n, rel=1e-3)
    assert levers["prompt_cache"]["numbers"]["missed_cache_tokens"] == pytest.approx(
        missed / n, rel=1e-3)

    # One selection: its own figures, its own example; the other's break is not there.
    cached_only = data.answer(("", "gpt-cached", ""))
    assert [s["model"] for s in cached_only["fix"]["selections"]] == ["gpt-cached"]
    only = cached_only["prompt_cache"]["total"]
    assert only["prompt"]["tokens"] == cached_tokens and only["missed"]["tokens"] == missed
    assert only["missed_ms"] == pytest.approx(PER_1K_S * missed / n)
    assert [(b["reason"], b["count"]) for b in only["breaks"]] == [("first_seen", 1)]


def test_the_card_and_the_prompt_panel_over_the_last_minute() -> None:
    """Once the ring holds a minute, the card's prefill fit for the last minute is the
    line of that minute's requests alone, beside the fit since start (the levers stay
    since start), and the Prompt caching panel's last minute counts that minute's
    tokens and breaks."""
    from proxy.doctor.report import TokenRules
    from proxy.measure import PrefixRecord

    clock = Clock()
    metrics = Metrics(CollectorRegistry())
    data = ui_data.LiveData(metrics.registry, clock=clock)

    def stream(i: int, per_1k_s: float, missed: int) -> RequestRecord:
        tokens = 1000 + 100 * (i % 10)  # 4 bytes a token: the repeated tokens all missed
        rules = TokenRules(4 * tokens, 4 * missed, False, 0, 1)
        p = PrefixRecord(4 * tokens, 4 * missed, "system_changed", "system", 0, 0, rules=rules)
        return record(i, prompt_tokens=tokens, cached_prompt_tokens=0, queue_s=0.0,
                      ttft_s=0.05 + per_1k_s * tokens / 1000, prefix=p)

    for i in range(30):  # before the page's minute: 200 ms per 1,000 tokens
        metrics.observe(stream(i, 0.2, 100), measured=True)
    data.answer(("", "", ""))
    for second in range(61):
        clock.now += 1.0
        if 1 <= second <= 25:  # within it (it starts at the second reading): 100 ms
            metrics.observe(stream(100 + second, 0.1, 300), measured=True)
        answer = data.answer(("", "", ""))
    assert answer["span"]["kind"] == "minute"
    (card,) = answer["fix"]["selections"]
    window, total = card["fit"]["window"], card["fit"]["total"]
    assert window["requests"] == 25 and total["requests"] == 55
    assert window["ms_per_1k_tokens"] == pytest.approx(100.0)
    assert window["fixed_ms"] == pytest.approx(50.0)
    assert 100.0 < total["ms_per_1k_tokens"] < 200.0  # the two lines together
    assert card["requests"] == 55  # the levers: since start
    pc = answer["prompt_cache"]
    minute = pc["window"]
    assert minute["seconds"] == pytest.approx(60.0)
    assert minute["missed"]["tokens"] == 25 * 300 and minute["examined"] == 25
    assert minute["repeated"]["per_s"] == pytest.approx(25 * 300 / 60.0)
    assert [(b["reason"], b["count"]) for b in minute["breaks"]] == [("system_changed", 25)]
    assert pc["total"]["breaks"][0]["count"] == 55
    # Priced by the fit since start, in both spans (no examples: a bare registry).
    slope = total["ms_per_1k_tokens"] / 1000
    assert minute["missed_ms"] == pytest.approx(slope * 300)
    assert pc["total"]["missed_ms"] == pytest.approx(slope * (30 * 100 + 25 * 300) / 55)
    assert minute["breaks"][0]["example"] is None
    assert minute["breaks"][0]["sentence"] == (
        "The prompt differs from the most similar recent prompt, so everything after it "
        "is computed again: keep it identical across requests.")


def test_recent_breaks_keep_the_latest_of_each_and_stay_bounded() -> None:
    from proxy.measure import PrefixRecord
    from proxy.ui.breaks import RecentBreaks

    clock = Clock()
    breaks = RecentBreaks(clock, max_keys=3)

    def broken(i: int, model: str, reason: str, tokens: int | None = 1000) -> RequestRecord:
        p = PrefixRecord(4000, 0, reason, "message", i, 0, "user", 900, 256, 2000)
        return record(i, model=model, prompt_tokens=tokens, prefix=p)

    breaks.add(record(0))  # no doctor's finding: nothing kept
    breaks.add(broken(1, "a", "message_changed"))
    clock.now += 1
    breaks.add(broken(2, "b", "message_changed"))
    breaks.add(broken(3, "a", "variable_before_stable"))
    latest = breaks.latest(lambda key: True)
    assert {r: (k[1], e.index) for r, (k, e) in latest.items()} == {
        "message_changed": ("b", 2), "variable_before_stable": ("a", 3)}
    only_a = breaks.latest(lambda key: key[1] == "a")
    assert only_a["message_changed"][1].index == 1
    assert only_a["variable_before_stable"][1].stable_tokens == 500  # 2,000 bytes at 1/4
    # A request whose usage said no prompt tokens keeps the key's last ratio.
    breaks.add(broken(4, "a", "variable_before_stable", tokens=None))
    assert breaks.latest(lambda key: True)["variable_before_stable"][1].stable_tokens == 500
    breaks.add(broken(5, "c", "expired"))  # a fourth key: the least recently updated goes
    assert set(breaks.latest(lambda key: True)) == {"variable_before_stable", "expired",
                                                    "message_changed"}
    assert breaks.latest(lambda key: key[1] == "a").keys() == {"variable_before_stable"}


# ---------------------------------------------------------------------------
# Bad input


def page_with_counter() -> tuple[LivePage, Counting]:
    _, registry = observed()
    counting = Counting(registry)
    return LivePage(counting, clock=Clock()), counting


@pytest.mark.parametrize(
    ("query", "code"),
    [
        (b"x" * (MAX_QUERY + 1), "query_too_long"),
        (b"model=" + b"%41" * 400, "query_too_long"),
        (b"model=a&model=b", "invalid_selector"),
        (b"route=a&model=b&upstream=c&x=d", "invalid_selector"),
        (b"colour=red", "invalid_selector"),
        (b"model=%ff%fe", "invalid_selector"),
        (b"&" * 200, "invalid_selector"),
    ],
)
def test_malformed_queries_are_refused_before_the_registry_is_read(query: bytes, code: str) -> None:
    page, counting = page_with_counter()
    status, headers, body = page.respond("GET", "/ui/data", query)
    assert status == 400
    assert dict(headers)["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == code
    assert counting.reads == 0
    assert len(body) < 400  # the input is not echoed back whole


@pytest.mark.parametrize("query", [b"model=nope", b"route=%2Fv1%2Fembeddings", b"upstream=up2"])
def test_unknown_selectors_are_400_in_the_openai_shape(query: bytes) -> None:
    page, _ = page_with_counter()
    status, _, body = page.respond("GET", "/ui/data", query)
    assert status == 400
    error = json.loads(body)["error"]
    assert error["code"] == "unknown_selector" and "unknown" in error["message"]


def test_known_selectors_and_star_are_accepted() -> None:
    page, _ = page_with_counter()
    for query in (b"", b"model=m-a", b"route=%2Fv1%2Fcompletions&model=*", b"upstream=up&model="):
        status, _, body = page.respond("GET", "/ui/data", query)
        assert status == 200, body
    assert json.loads(body)["selection"] == {"route": "", "model": "", "upstream": "up"}


def test_only_get_and_head() -> None:
    page, _ = page_with_counter()
    status, _, body = page.respond("POST", "/ui/data", b"")
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"
    assert page.respond("HEAD", "/ui", b"")[0] == 200


def test_the_page_reaches_nothing_off_the_machine() -> None:
    page, _ = page_with_counter()
    _status, headers, body = page.respond("GET", "/ui", b"")
    html = body.decode()
    policy = dict(headers)["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "unsafe-inline" not in policy
    # Nothing loads from anywhere: no src, the one href is the empty data: icon; the only
    # absolute URL is SVG's namespace name, which is an identifier, not a request.
    assert " src=" not in html
    assert html.count("href=") == 1 and 'href="data:,"' in html
    assert set(_urls(html)) == {"http://www.w3.org/2000/svg"}
    assert "{{" not in html


def test_the_page_stays_small() -> None:
    """One document, its script and style inlined: docs/live-page.md gives its size. A new
    panel that takes it past this budget should say what it gave up for it. (Raised by
    3.5 KB, 0.7 KB gzipped, for the "What to fix" card and the "Prompt caching" panel:
    their drawing code and the notes that say what they count.)"""
    import gzip

    page, _ = page_with_counter()
    html = page.respond("GET", "/ui", b"")[2]
    assert len(html) < 35_500 and len(gzip.compress(html, 9)) < 11_700


def _urls(text: str) -> list[str]:
    import re

    return re.findall(r"https?://[^\s\"'`)]+", text)


# ---------------------------------------------------------------------------
# Slowest requests


def test_slowest_requests_per_series_and_only_the_last_minute() -> None:
    clock = Clock()
    slow = SlowRequests(clock)
    for i in range(30):
        slow.add(record(i, model="m-a", ttft_s=0.01 * i))
        clock.now += 0.1
    for i in range(3):
        slow.add(record(100 + i, model="m-b", ttft_s=0.001 * i))
    slow.add(record(200, model="m-b", ttft_s=None, duration_s=9.0, outcome=Outcome.UPSTREAM_TIMEOUT))
    slow.add(record(300, model="m-b", stream=False, ttft_s=None, duration_s=99.0))
    everything = slow.slowest(lambda key: True)
    assert len(everything) == KEEP
    assert everything[0]["request_id"] == "req-200" and everything[0]["outcome"] == "upstream_timeout"
    assert [r["request_id"] for r in everything[1:]] == [f"req-{i}" for i in range(29, 20, -1)]
    only_b = slow.slowest(lambda key: key[1] == "m-b")
    assert [r["request_id"] for r in only_b] == ["req-200", "req-102", "req-101", "req-100"]
    assert set(everything[0]) == {
        "request_id",
        "route",
        "model",
        "upstream",
        "ttft_s",
        "ttfa_s",
        "duration_s",
        "prompt_tokens",
        "cached_prompt_tokens",
        "completion_tokens",
        "outcome",
        "ago_s",
    }
    clock.now += 61.0
    assert slow.slowest(lambda key: True) == []


def test_a_slow_request_stays_in_the_table_for_the_whole_minute() -> None:
    """A slow request near the end of its 10 s slot, then one request every 10 s: 51.6 s
    later it is still one of the last minute's (the six slots kept, the current one
    among them, covered 50 to 60 s, and it went at 51.6 s), and gone after 60 s."""
    clock = Clock()
    clock.now = 9.9
    slow = SlowRequests(clock)
    slow.add(record(0, model="m-a", ttft_s=1.2))
    for i in range(1, 7):
        clock.now = 10.0 * i + 1.5  # 11.5, 21.5, ... 61.5: a new slot each
        slow.add(record(i, model="m-a", ttft_s=0.05))
    assert clock.now - 9.9 == pytest.approx(51.6)
    assert slow.slowest(lambda key: True)[0]["request_id"] == "req-0"
    clock.now = 9.9 + 60.5
    assert "req-0" not in [r["request_id"] for r in slow.slowest(lambda key: True)]


def test_the_slowest_requests_reach_the_page_through_metrics() -> None:
    settings = Settings(upstream_name="up")
    from proxy.app import create_app

    app = create_app(settings, registry=CollectorRegistry())
    assert app.metrics is not None and app.ui is not None
    for i in range(3):
        app.metrics.observe(record(i, ttft_s=0.1 * (i + 1)), measured=True)
    status, _, body = app.ui.respond("GET", "/ui/data", b"model=m-a")
    assert status == 200
    answer = json.loads(body)
    assert [r["request_id"] for r in answer["slow"]] == ["req-2", "req-1", "req-0"]
    # The app's page reads a registry restricted to the samples it uses: all of them.
    total = answer["figures"]["total"]
    assert total["requests"] == 3 and total["ttft"]["n"] == total["itl"]["n"] / 3 == 3
    # the time split's request: its first token (0.1 to 0.3 s, 0.2 s the mean), its gaps (0.09 s)
    assert total["tpot"]["n"] == 3 and total["time"]["request_s"] == pytest.approx(0.2 + 0.09)
    assert total["cache_hit_ratio"] == pytest.approx(0.25)


# ---------------------------------------------------------------------------
# Where it is served


async def get(app: Any, path: str) -> httpx.Response:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://proxy.test"
    ) as client:
        return await client.get(path)


@pytest.mark.parametrize(
    ("settings", "served"),
    [
        (Settings(), True),
        (Settings(ui=False), False),
        (Settings(measure=False), False),
        (Settings(metrics_port=9999), False),  # it went to the metrics port with /metrics
    ],
)
async def test_the_page_follows_metrics_on_the_main_port(settings: Settings, served: bool) -> None:
    from proxy.app import create_app

    app = create_app(settings, registry=CollectorRegistry())
    try:
        page, data = await get(app, "/ui"), await get(app, "/ui/data")
        metrics = await get(app, "/metrics")
        if served:
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "content-security-policy" in page.headers
            assert data.status_code == 200 and "figures" in data.json()
        else:
            assert page.status_code == data.status_code == 404
            assert "error" in data.json()
        assert (metrics.status_code == 200) == (served or settings.ui is False)
    finally:
        await app.aclose()


@pytest.mark.parametrize(
    ("settings", "pointer"),
    [
        (Settings(), "; the live page is at /ui, metrics at /metrics"),
        (Settings(ui=False), "; metrics are at /metrics"),
        (Settings(measure=False), ""),
        (Settings(metrics_port=9999), ""),  # app clients are not pointed at the metrics port
    ],
)
async def test_any_other_path_points_to_what_this_port_serves(
    settings: Settings, pointer: str
) -> None:
    from proxy.app import create_app

    app = create_app(settings, registry=CollectorRegistry())
    try:
        root = await get(app, "/")  # where a browser starts
        assert root.status_code == 404
        error = root.json()["error"]
        assert error["message"] == f"no route /; this proxy serves /v1/*{pointer}"
        assert (error["type"], error["code"]) == ("invalid_request_error", "not_found")
    finally:
        await app.aclose()


def test_ui_setting_from_flag_and_environment() -> None:
    from proxy import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    assert from_sources(parser.parse_args([]), environ={}).ui is True
    assert from_sources(parser.parse_args(["--no-ui"]), environ={}).ui is False
    assert from_sources(parser.parse_args([]), environ={"LLM_PROXY_UI": "false"}).ui is False


SIM = SimConfig(slots=8, itl=0.002, output_tokens=6, output_dist="fixed", prefill_rate=1e6, seed=3)


def stream_chat(base_url: str, n: int, model: str = "sim-llm") -> None:
    client = OpenAI(base_url=base_url + "/v1", api_key="sk-sim", max_retries=0, timeout=30)
    for i in range(n):
        for _ in client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"hello {i}"}],
            stream=True,
            stream_options={"include_usage": True},
        ):
            pass


@pytest.mark.e2e
async def test_metrics_port_serves_the_page_and_the_main_port_does_not() -> None:
    import anyio

    metrics_port = closed_port()
    with serve_in_thread(create_simulator_app(SIM)) as sim:
        async with proxy_process(sim.url, "--metrics-port", str(metrics_port)) as (_, port, _out):
            await anyio.to_thread.run_sync(stream_chat, f"http://127.0.0.1:{port}", 3)
            side = f"http://127.0.0.1:{metrics_port}"
            async with httpx.AsyncClient() as client:
                for path in ("/ui", "/ui/data"):
                    assert (await client.get(f"http://127.0.0.1:{port}{path}")).status_code == 404
                page = await client.get(side + "/ui")
                assert page.status_code == 200 and "<svg" not in page.text  # drawn by script
                assert "content-security-policy" in page.headers
                bad = await client.get(side + "/ui/data?model=nope")
                assert bad.status_code == 400 and bad.json()["error"]["code"] == "unknown_selector"
                metrics = await client.get(side + "/metrics")  # unchanged: the exposition
                assert metrics.headers["content-type"].startswith("text/plain")
                for _ in range(100):  # the record is made just after the client saw the end
                    data = (await client.get(side + "/ui/data")).json()
                    if data["figures"]["total"]["requests"] == 3:
                        break
                    await anyio.sleep(0.3)
                snap = promscrape.parse((await client.get(side + "/metrics")).text)
                assert (
                    data["figures"]["total"]["requests"]
                    == promscrape.total(snap, promscrape.REQUESTS)
                    == 3
                )
                assert [r["model"] for r in data["slow"]] == ["sim-llm"] * 3


@pytest.mark.e2e
async def test_with_workers_the_page_sums_every_worker() -> None:
    import anyio

    with serve_in_thread(create_simulator_app(SIM)) as sim:
        async with proxy_process(sim.url, "--workers", "2") as (proc, port, _out):
            base = f"http://127.0.0.1:{port}"
            try:
                await anyio.to_thread.run_sync(stream_chat, base, 10)
                async with httpx.AsyncClient() as client:
                    for _ in range(100):  # each worker records its requests as they end
                        snap = promscrape.parse((await client.get(base + "/metrics")).text)
                        if promscrape.total(snap, promscrape.REQUESTS) == 10:
                            break
                        await anyio.sleep(0.1)
                    # New connections, so that both workers answer some of them.
                    answers = [
                        (
                            await client.get(base + "/ui/data", headers={"connection": "close"})
                        ).json()
                        for _ in range(6)
                    ]
            finally:  # the supervisor stops its workers; a kill would leave them running
                proc.send_signal(signal.SIGTERM)
                await anyio.to_thread.run_sync(proc.wait, 15)
            ttft = promscrape.histogram(snap, TTFT)
            for answer in answers:
                total = answer["figures"]["total"]
                assert total["requests"] == 10 and total["ttft"]["n"] == 10
                assert total["ttft"]["mean"] == pytest.approx(ttft.mean)
                assert total["ttft"]["p90"] == pytest.approx(ttft.quantile(0.9))


def test_demo_prints_the_page_url_first() -> None:
    import anyio

    from proxy import demo
    from proxy.cli import build_parser

    args = build_parser().parse_args(
        [
            "demo",
            "--port",
            "0",
            "--duration",
            "0.5",
            "--burst-every",
            "0",
            "--slots",
            "2",
            "--refresh",
            "0.2",
        ]
    )
    out = io.StringIO()
    assert anyio.run(demo.Demo(args, out, tty=False).main) == 0
    first = out.getvalue().splitlines()[0]
    assert first.startswith("demo: live page at http://127.0.0.1:") and first.endswith("/ui")
