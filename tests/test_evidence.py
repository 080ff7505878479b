"""The evidence the levers read (proxy/evidence.py), from the three sources, against
figures worked out here from the records themselves.

The proxy's own Metrics (a fresh registry) observes hand-built records; then the same
registry read directly (the live page's way), through its text exposition (``diagnose
--url``'s way) and as Prometheus would answer the command's queries over it must give
the same evidence, and that evidence must be what the records say: counts, means, the
fit of the records' points, buckets, finish reasons. Windows (a difference of two
readings, a reset between them), filters, the ring's sharing of unchanged figures and
the prompt-cache doctor's counters (present or not) are covered too. The Prometheus
queries are checked to add up across replicas the way the dashboard's must
(tests/test_kubernetes_aggregation.py) and to read recording rules that exist.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import promql_parser
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy import evidence as ev
from proxy.bench import promscrape
from proxy.diagnosis import levers
from proxy.diagnosis.fit import FitSums, fit
from proxy.diagnosis.levers import Evidence
from proxy.measure import Outcome, PrefixRecord, RequestRecord
from proxy.metrics import Metrics, MetricsOptions
from tests.test_kubernetes_aggregation import aggregation_problems
from tests.test_observability import proxy_exposition, recorded_names

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def read_scrape(text: str) -> ev.Reading:
    """A ``/metrics`` text read as the ``diagnose`` command reads it."""
    return ev.read_snapshot(promscrape.parse(text))


def record(i: int, **kw: Any) -> RequestRecord:
    values: dict[str, Any] = {
        "request_id": f"req-{i}", "route": CHAT, "model": "m-a", "upstream": "up",
        "stream": True, "status": 200, "outcome": Outcome.COMPLETED, "duration_s": 1.0,
        "overhead_s": 0.001, "queue_s": 0.0, "ttft_s": 0.2, "tpot_s": 0.03,
        "itl_s": (0.02, 0.03), "output_events": 3, "prompt_tokens": 100,
        "cached_prompt_tokens": 0, "completion_tokens": 3, "finish_reasons": ("stop",),
    }
    values.update(kw)
    return RequestRecord(**values)


def traffic(start: int = 0, n: int = 30) -> Iterator[RequestRecord]:
    """Streams of m-a on chat with prompts from 500 to about 9,000 tokens (some cached),
    a queue in the proxy and at the upstream; every fifth not streamed; every seventh
    cut off at its length limit; and m-b on completions, a few streams without usage."""
    for i in range(start, start + n):
        prompt = 500 + 290 * i
        yield record(
            i, stream=i % 5 != 4, prompt_tokens=prompt, cached_prompt_tokens=(i % 3) * 100,
            ttft_s=0.05 + 0.0001 * prompt + 0.01 * (i % 4), queue_s=0.002 * (i % 3),
            upstream_queue_s=0.004 * (i % 2), duration_s=0.5 + 0.01 * i,
            tpot_s=0.01 + 0.002 * (i % 20), completion_tokens=10 + 7 * i,
            finish_reasons=("length",) if i % 7 == 0 else ("stop",))
    for i in range(start, start + n // 3):
        yield record(1000 + i, route=COMPLETIONS, model="m-b", ttft_s=0.3 + 0.01 * i,
                     prompt_tokens=None if i % 4 == 0 else 40 + i, completion_tokens=5,
                     tpot_s=0.25, upstream_queue_s=None, finish_reasons=())


def observe(metrics: Metrics, records: Iterator[RequestRecord]) -> list[RequestRecord]:
    out = list(records)
    for r in out:
        metrics.observe(r, measured=True)
    return out


def fresh(**options: Any) -> tuple[Metrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return Metrics(registry, MetricsOptions(**options)), registry


def by_key(found: list[Evidence]) -> dict[tuple[str, str], Evidence]:
    return {(e.route, e.model): e for e in found}


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def test_the_registry_gives_what_the_records_say() -> None:
    metrics, registry = fresh()
    records = observe(metrics, traffic())
    found = ev.evidence(ev.read_registry(registry))
    assert [(e.route, e.model) for e in found] == [(CHAT, "m-a"), (COMPLETIONS, "m-b")]
    chat = found[0]
    mine = [r for r in records if r.route == CHAT]
    streams = [r for r in mine if r.stream]
    assert chat.requests == len(mine) == 30
    assert chat.streams == len(streams)
    assert chat.ttft_mean_s == pytest.approx(mean([r.ttft_s or 0 for r in streams]), rel=1e-12)
    assert chat.queue_mean_s == pytest.approx(mean([r.queue_s or 0 for r in streams]),
                                              rel=1e-12)
    assert chat.upstream_queue_mean_s == pytest.approx(
        mean([r.upstream_queue_s or 0 for r in mine]), rel=1e-12)
    # the mean total time is of the streams that had a first token: it, then their gaps
    assert chat.duration_mean_s == pytest.approx(
        mean([r.ttft_s + math.fsum(r.itl_s) for r in streams if r.ttft_s is not None]),
        rel=1e-12)
    points = [((r.prompt_tokens or 0) - (r.cached_prompt_tokens or 0),
               (r.ttft_s or 0) - (r.queue_s or 0)) for r in streams]
    expected = fit(FitSums.of(points))
    assert chat.fit.status == "fitted" and chat.fit.requests == len(streams)
    assert chat.fit.ms_per_1k_tokens == pytest.approx(expected.ms_per_1k_tokens, rel=1e-9)
    assert chat.fit.fixed_ms == pytest.approx(expected.fixed_ms, rel=1e-9)
    assert chat.fit.ms_per_1k_tokens == pytest.approx(100.0, rel=0.05)  # 0.1 ms a token
    assert chat.tpot is not None and chat.completion is not None
    assert chat.tpot.count == len(streams)
    assert chat.tpot.total == pytest.approx(math.fsum(r.tpot_s or 0 for r in streams))
    assert chat.tpot.buckets[-1][0] == math.inf
    assert chat.completion.count == len(mine)
    assert chat.completion.total == sum(r.completion_tokens or 0 for r in mine)
    assert chat.finish == {"length": 5.0, "stop": 25.0}
    assert chat.missed_cache_tokens is None  # the doctor did not look at these records

    other = found[1]
    assert other.requests == 10 and other.streams == 10
    assert other.upstream_queue_mean_s is None  # reported by none: unknown, not 0
    assert other.fit.requests == 7  # three streams had no prompt tokens in their usage
    assert other.finish == {}


def test_the_queue_in_the_first_token_is_the_streams_own() -> None:
    """Streams that never queued and requests not streamed that queued for a second: the
    queue part of the first token is the streams' (0), where the queue histogram, of
    every request, read as 0.75 s of a 0.2 s first token ("queueing in the proxy: 750
    ms of the 200 ms first token"). The non-streamed waits stay in /metrics."""
    metrics, registry = fresh()
    observe(metrics, (record(i, queue_s=0.0) for i in range(20)))
    observe(metrics, (record(20 + i, stream=False, queue_s=1.0, ttft_s=None) for i in range(60)))
    (chat,) = ev.evidence(ev.read_registry(registry))
    assert chat.streams == 20 and chat.queue_mean_s == 0
    split = levers.diagnose(chat).first_token
    assert split.proxy_queue_ms == 0 and split.mean_ms == pytest.approx(200)
    sample = registry.get_sample_value
    assert sample("llm_proxy_queue_time_seconds_sum", {
        "route": CHAT, "model": "m-a", "upstream": "up", "stream": "false"}) == 60.0


def test_text_registry_and_prometheus_answers_give_the_same_evidence() -> None:
    metrics, registry = fresh()
    observe(metrics, traffic())
    direct = ev.evidence(ev.read_registry(registry))
    text = generate_latest(registry).decode()
    assert ev.evidence(read_scrape(text)) == direct
    result = [item for q in ev.prometheus_queries("1h", fit_from_rules=False)
              for item in prometheus_answer(q, promscrape.parse(text))]
    assert ev.evidence(ev.reading_from_prometheus(result)) == direct
    assert ev.has_fit(result)


def prometheus_answer(query: ev.Query, snapshot: promscrape.Snapshot) -> list[dict[str, Any]]:
    """What ``sum by (route, model, upstream[, le | finish_reason]) (increase(...))``
    answers over counters that started at 0 inside the range: the sums themselves."""
    by = ["route", "model", "upstream"]
    if query.sample.endswith("_bucket"):
        by.append("le")
    if query.sample == ev.FINISH:
        by.append("finish_reason")
    sums: dict[tuple[str, ...], float] = {}
    for (name, labels), value in snapshot.items():
        mapping = dict(labels)
        if name != query.sample:
            continue
        if name.startswith(ev.QUEUE) and mapping.get("stream") != "true":
            continue
        group = tuple(mapping[k] for k in by)
        sums[group] = sums.get(group, 0.0) + value
    return [{"metric": {**dict(zip(by, group, strict=True)), ev.SAMPLE_LABEL: query.sample},
             "value": [0, repr(v)]} for group, v in sums.items()]


def test_labels_the_diagnosis_does_not_select_on_are_summed() -> None:
    """A client label (and stream, code): the same evidence as without it."""
    plain, plain_registry = fresh()
    labelled, labelled_registry = fresh(client_label=True)
    observe(plain, traffic())
    observe(labelled, (record_with_client(r, i) for i, r in enumerate(traffic())))
    assert 'client="team-1"' in generate_latest(labelled_registry).decode()
    same(ev.evidence(ev.read_registry(labelled_registry)),
         ev.evidence(ev.read_registry(plain_registry)))


def flat(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from flat(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, Mapping):
        for k in sorted(value):
            yield from flat(value[k], f"{path}[{k}]")
    elif isinstance(value, list | tuple):
        yield f"{path}#", len(value)
        for i, item in enumerate(value):
            yield from flat(item, f"{path}[{i}]")
    else:
        yield path, value


def same(a: Any, b: Any) -> None:
    """Equal, floats to rounding (sums taken over more series add in another order)."""
    left, right = dict(flat(a)), dict(flat(b))
    assert left.keys() == right.keys()
    for k, v in left.items():
        if isinstance(v, float) and isinstance(right[k], float):
            assert v == pytest.approx(right[k], rel=1e-9), k
        else:
            assert v == right[k], k


def record_with_client(r: RequestRecord, i: int) -> RequestRecord:
    from dataclasses import replace

    return replace(r, client=f"team-{i % 3}")


def test_a_window_is_the_difference_of_two_readings() -> None:
    metrics, registry = fresh()
    observe(metrics, traffic(0, 30))
    before = ev.read_registry(registry)
    later = observe(metrics, traffic(30, 30))
    window = ev.evidence(ev.read_registry(registry), before)
    chat = by_key(window)[(CHAT, "m-a")]
    streams = [r for r in later if r.route == CHAT and r.stream]
    assert chat.requests == 30 and chat.streams == len(streams)
    assert chat.ttft_mean_s == pytest.approx(mean([r.ttft_s or 0 for r in streams]), rel=1e-9)
    points = [((r.prompt_tokens or 0) - (r.cached_prompt_tokens or 0),
               (r.ttft_s or 0) - (r.queue_s or 0)) for r in streams]
    assert chat.fit.ms_per_1k_tokens == pytest.approx(
        fit(FitSums.of(points)).ms_per_1k_tokens, rel=1e-6)
    # nothing since the last reading: nothing to diagnose
    assert ev.evidence(ev.read_registry(registry), ev.read_registry(registry)) == []


def test_a_reset_between_two_readings_counts_from_the_reset() -> None:
    metrics, registry = fresh()
    observe(metrics, traffic(0, 30))
    before = ev.read_registry(registry)
    restarted, registry2 = fresh()  # a restarted process: counters from 0
    observe(restarted, traffic(0, 6))
    window = by_key(ev.evidence(ev.read_registry(registry2), before))
    since_restart = by_key(ev.evidence(ev.read_registry(registry2)))
    assert window == since_restart
    assert window[(CHAT, "m-a")].requests == 6


def test_filters_pick_selections_by_exact_value() -> None:
    metrics, registry = fresh()
    observe(metrics, traffic())
    now = ev.read_registry(registry)
    assert [e.model for e in ev.evidence(now, model="m-b")] == ["m-b"]
    assert [e.route for e in ev.evidence(now, route=CHAT, upstream="up")] == [CHAT]
    assert ev.evidence(now, model="m") == []  # exact, not a prefix or a regex
    assert ev.evidence(now, route=CHAT, model="m-b") == []
    assert ev.known_values(now) == {"route": [CHAT, COMPLETIONS], "model": ["m-a", "m-b"],
                                    "upstream": ["up"]}


def test_a_route_only_relayed_is_not_a_selection() -> None:
    metrics, registry = fresh()
    metrics.observe(record(1, route="/v1/models", stream=False), measured=False)
    assert ev.evidence(ev.read_registry(registry)) == []


def test_a_ring_of_readings_shares_what_did_not_change() -> None:
    metrics, registry = fresh()
    observe(metrics, traffic())
    first = ev.read_registry(registry)
    metrics.observe(record(99, prompt_tokens=700), measured=True)  # chat m-a only
    second = ev.read_registry(registry, previous=first)
    assert second.figures[(COMPLETIONS, "m-b", "up")] is first.figures[(COMPLETIONS, "m-b", "up")]
    assert second.figures[(CHAT, "m-a", "up")] is not first.figures[(CHAT, "m-a", "up")]
    assert second.figures[(CHAT, "m-a", "up")].get(ev.REQUESTS) == 31


def test_one_collect_can_feed_the_live_page_and_the_diagnosis() -> None:
    metrics, registry = fresh()
    observe(metrics, traffic())
    seen: list[str] = []
    reading = ev.read_registry(registry, also=lambda name, labels, value: seen.append(name),
                               names=ev.SAMPLE_NAMES | {"llm_proxy_inter_token_latency_seconds_count"})
    assert ev.evidence(reading) == ev.evidence(read_scrape(generate_latest(registry).decode()))
    assert "llm_proxy_inter_token_latency_seconds_count" in seen and ev.REQUESTS in seen


def test_missed_cache_tokens_from_the_doctors_findings() -> None:
    """Through the proxy's own Metrics: the mean of the missed tokens the doctor knew
    (a request whose usage had no cached field is unknown, not 0)."""
    from proxy.doctor.report import TokenRules

    metrics, registry = fresh()
    p = PrefixRecord(8000, 6000, rules=TokenRules(8000, 6000, False, 0, 1))  # 1,500 tokens
    for i, cached in enumerate((300, 1500, 600, None)):  # 1,200, 0, 900, unknown missed
        metrics.observe(record(i, prompt_tokens=2000, cached_prompt_tokens=cached, prefix=p),
                        measured=True)
    (chat,) = ev.evidence(ev.read_registry(registry))
    assert chat.missed_cache_tokens == (1200 + 0 + 900) / 3
    (same_from_text,) = ev.evidence(read_scrape(generate_latest(registry).decode()))
    assert same_from_text.missed_cache_tokens == chat.missed_cache_tokens


def missed_exposition(missed: float | None, examined: float | None, fitted: int) -> str:
    """The prompt-cache doctor's counters as the proxy exports them, beside the fit's."""
    registry = CollectorRegistry()
    labels = ("route", "model", "upstream")
    key = (CHAT, "m-a", "up")
    n = Counter("llm_proxy_prefill_fit_requests", "n", labels, registry=registry)
    n.labels(*key).inc(fitted)
    ttft = Histogram("llm_proxy_time_to_first_token_seconds", "t", labels, registry=registry)
    ttft.labels(*key).observe(0.1)
    if missed is not None:
        counter = Counter("llm_proxy_prompt_cache_missed_tokens", "m", labels, registry=registry)
        counter.labels(*key).inc(missed)
    if examined is not None:
        hist = Histogram("llm_proxy_prompt_cache_missed_tokens_per_request", "h", labels,
                         registry=registry)
        child = hist.labels(*key)  # the doctor makes both children at once
        for _ in range(int(examined)):
            child.observe(1)
    return generate_latest(registry).decode()


@pytest.mark.parametrize(("missed", "examined", "fitted", "expected"), [
    (None, None, 20, None),  # no prompt-cache doctor: unknown
    (3000.0, 10.0, 20, 300.0),  # per request the doctor examined
    (3000.0, None, 20, 150.0),  # without its histogram: per fitted request
    (0.0, 0.0, 20, None),  # the doctor examined nothing yet
])
def test_missed_cache_tokens_per_request(missed: float | None, examined: float | None,
                                         fitted: int, expected: float | None) -> None:
    (found,) = ev.evidence(read_scrape(missed_exposition(missed, examined, fitted)))
    assert found.missed_cache_tokens == expected


def test_prometheus_queries_add_up_across_replicas_and_read_rules_that_exist() -> None:
    types = exported_types()
    recorded = recorded_names()
    where = ev.matchers(route=CHAT, model='we"ird\\name', upstream=None)
    assert where == 'route="/v1/chat/completions",model="we\\"ird\\\\name"'
    for range_ in ("5m", "1h", "90m"):
        queries = ev.prometheus_queries(range_, where)
        assert {q.sample for q in queries} == ev.SAMPLE_NAMES
        rules = [q for q in queries if q.rule]
        assert len(rules) == (9 if range_ in ev.RULE_RANGES else 0)
        for q in queries:
            if q.rule:
                name = q.expr.split("{", 1)[0]
                assert name in recorded, name
            else:
                assert f"[{range_}]" in q.expr and where in q.expr
        # the one query sent parses, and every series in it is summed after increase()
        one = ev.prometheus_query(queries)
        assert promql_parser.parse(one) is not None  # raises on what Prometheus would refuse
        assert not aggregation_problems(one, types), one
        assert one.count(f'"{ev.SAMPLE_LABEL}"') == len(queries)


def exported_types() -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    types = {}
    for family in text_string_to_metric_families(proxy_exposition()):
        for sample in family.samples:
            types[sample.name] = family.type
    # the prompt-cache doctor's series (exported once it has examined a request)
    types[ev.MISSED] = "counter"
    types[ev.UNMARKED] = "counter"  # on routes that cache by breakpoints
    for part in ("sum", "count"):
        types[f"{ev.MISSED_PER_REQUEST}_{part}"] = "histogram"
    # exported once a request had its tokens estimated, or an engine timed its prefill
    types[ev.ESTIMATED] = "counter"
    for part in ("sum", "count"):
        types[f"{ev.ENGINE_PREFILL}_{part}"] = "histogram"
    return types


@pytest.mark.parametrize(("text", "seconds"), [
    ("1h", 3600), ("5m", 300), ("90m", 5400), ("1h30m", 5400), ("2d", 172800),
    ("30s", 30), ("1w", 604800), ("500ms", 0.5),
])
def test_durations(text: str, seconds: float) -> None:
    assert ev.duration_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "1", "h", "1.5h", "-1h", "0m", "1x", "m5", "1h 30m"])
def test_not_durations(text: str) -> None:
    assert ev.duration_seconds(text) is None


def test_a_series_born_inside_the_range_counts_whole_in_prometheus(tmp_path: Any) -> None:
    """diagnose --prometheus's query, run by Prometheus's own engine (promtool): a model
    whose series is older than the range counts its increase over it; one that first
    appeared inside the range, on a target Prometheus scraped all along (its first scrape
    already 8 requests: a burst, then one a minute), counts all 16, where increase()
    alone lost most of the first 8 (8.5); on a target Prometheus only began to scrape
    within the range, what the first scrape held may predate the range: what it gained
    from its first scrape to its last (8). Not extrapolated: on that target, a histogram
    whose 32-token bucket was empty at the first scrape (every earlier answer longer)
    and whose answers since were all 32 tokens gains 8 in that bucket and 8 in the next,
    where increase() stretched the two by different factors (8 and 8.5), which diagnose
    read as answers above the cap that were never there."""
    import json
    import subprocess

    from tests.test_observability import require_tool

    promtool = require_tool("promtool")
    queries = ev.prometheus_queries("10m")
    (query,) = (q for q in queries if q.sample == "llm_proxy_requests_total")
    (buckets,) = (q for q in queries if q.sample == "llm_proxy_completion_tokens_bucket")
    tokens = ('llm_proxy_completion_tokens_bucket{job="p",instance="late",'
              'route="/v1/chat/completions",upstream="u",model="long",le="%s"}')
    where = ('{job="p",instance="%s",route="/v1/chat/completions",upstream="u",stream="true",'
             'code="200",model="%s"}')
    series = [
        ("up" + '{job="p",instance="a"}', "1x30"),
        ("up" + '{job="p",instance="late"}', "_x22 1x8"),
        ("llm_proxy_requests_total" + where % ("a", "old"), "0+10x30"),
        ("llm_proxy_requests_total" + where % ("a", "new"), "_x22 8+1x8"),
        ("llm_proxy_requests_total" + where % ("late", "seen-late"), "_x22 8+1x8"),
        (tokens % "32", "_x22 0+1x8"),  # 200 longer answers before, then 32 a minute
        (tokens % "64", "_x22 200+1x8"),
        (tokens % "+Inf", "_x22 200+1x8"),
    ]
    bucket = '{route="/v1/chat/completions",upstream="u",model="long",le="%s"}'
    labels = '{route="/v1/chat/completions",upstream="u",model="%s"}'
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": name, "values": values} for name, values in series],
            "promql_expr_test": [{
                "expr": query.expr,
                "eval_time": "30m",
                "exp_samples": [
                    {"labels": labels % "old", "value": 100},
                    {"labels": labels % "new", "value": 16},
                    {"labels": labels % "seen-late", "value": 8},
                ],
            }, {
                "expr": buckets.expr,
                "eval_time": "30m",
                "exp_samples": [{"labels": bucket % le, "value": 8}
                                for le in ("32", "64", "+Inf")],
            }],
        }],
    }
    path = tmp_path / "born_test.yml"
    path.write_text(json.dumps(spec))  # YAML is a superset of JSON
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
