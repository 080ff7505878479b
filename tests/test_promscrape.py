"""``proxy.bench.promscrape`` reads expositions through prometheus_client's parser.

What these add to the promscrape tests in ``tests/test_bench.py``: a malformed line in the
middle of a scrape costs only that line (the library's parser stops at the first bad
line, so the samples after it must still be read), the parser's rules that callers see
(counter naming, timestamps, NaN, every label escape), and a round trip through
``generate_latest`` of every metric kind the proxy exports, read back exactly.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proxy.bench import promscrape


def test_a_bad_line_costs_only_itself() -> None:
    text = (
        "# TYPE llm_proxy_requests_total counter\n"
        'llm_proxy_requests_total{model="a"} 1\n'
        "this line is garbage {\n"
        'llm_proxy_requests_total{model="b"} 2\n'
        'broken{label="unterminated} 3\n'
        'llm_proxy_in_flight_requests{upstream="u"} 4\n'
    )
    assert promscrape.parse(text) == {
        ("llm_proxy_requests_total", (("model", "a"),)): 1.0,
        ("llm_proxy_requests_total", (("model", "b"),)): 2.0,
        ("llm_proxy_in_flight_requests", (("upstream", "u"),)): 4.0,
    }


def test_parser_rules_callers_see() -> None:
    text = (
        "# HELP c A counter declared without _total.\n"
        "# TYPE c counter\n"
        "c 2\n"
        'g{b="2",a="1"} NaN 1700000000000\n'
        'e{v="new\\nline \\"quoted\\" back\\\\slash"} -Inf\n'
        "\n"
        "# a free comment\n"
        "i 7\n"
    )
    snap = promscrape.parse(text)
    assert snap.keys() == {
        ("c_total", ()),  # the parser's (OpenMetrics) name for the counter
        ("g", (("a", "1"), ("b", "2"))),  # labels sorted; the timestamp dropped
        ("e", (("v", 'new\nline "quoted" back\\slash'),)),
        ("i", ()),
    }
    assert snap[("c_total", ())] == 2.0 and isinstance(snap[("i", ())], float)
    assert math.isnan(snap[("g", (("a", "1"), ("b", "2")))])
    assert snap[("e", (("v", 'new\nline "quoted" back\\slash'),))] == -math.inf
    assert promscrape.parse("") == {} and promscrape.parse("garbage {\n") == {}


def test_round_trip_of_what_the_proxy_exports() -> None:
    registry = CollectorRegistry()
    requests = Counter("llm_proxy_requests", "r", ["model", "code"], registry=registry)
    outcomes = Counter("llm_proxy_stream_outcomes", "o", ["model", "outcome"], registry=registry)
    in_flight = Gauge("llm_proxy_in_flight_requests", "f", ["upstream"], registry=registry)
    ttft = Histogram(
        "llm_proxy_time_to_first_token_seconds",
        "t",
        ["model"],
        buckets=(0.1, 0.5, 1.0),
        registry=registry,
    )
    odd = 'm "x"\\y\nz'
    requests.labels("a", "200").inc(3)
    requests.labels(odd, "503").inc()
    outcomes.labels("a", "completed").inc(2)
    outcomes.labels("a", "client_disconnected").inc()
    in_flight.labels("u").set(5)
    for value in (0.05, 0.2, 0.3, 0.7, 2.0):
        ttft.labels("a").observe(value)
    ttft.labels(odd).observe(0.05)
    snap = promscrape.parse(generate_latest(registry).decode())

    assert promscrape.total(snap, promscrape.REQUESTS) == 4
    assert promscrape.by_label(snap, promscrape.REQUESTS, "model") == {"a": 3.0, odd: 1.0}
    assert promscrape.by_label(snap, promscrape.OUTCOMES, "outcome") == {
        "completed": 2.0,
        "client_disconnected": 1.0,
    }
    assert promscrape.total(snap, promscrape.IN_FLIGHT) == 5
    only_a = promscrape.label_filter(model="a")
    h = promscrape.histogram(snap, promscrape.TTFT, only_a)
    assert h.buckets == ((0.1, 1.0), (0.5, 3.0), (1.0, 4.0), (math.inf, 5.0))
    assert h.count == 5 and h.sum == pytest.approx(3.25) and h.mean == pytest.approx(0.65)
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.4 * (2.5 - 1) / 2)
    both = promscrape.histogram(snap, promscrape.TTFT)
    assert both.count == 6 and both.buckets[0] == (0.1, 2.0)
    assert promscrape.has_proxy_metrics(snap)


def test_view_between_two_scrapes_of_one_registry() -> None:
    registry = CollectorRegistry()
    ttft = Histogram(
        "llm_proxy_time_to_first_token_seconds",
        "t",
        ["model"],
        buckets=(0.1, 1.0),
        registry=registry,
    )
    requests = Counter("llm_proxy_requests", "r", ["model"], registry=registry)
    outcomes = Counter("llm_proxy_stream_outcomes", "o", ["model", "outcome"], registry=registry)
    ttft.labels("a").observe(0.05)
    requests.labels("a").inc()
    outcomes.labels("a", "completed").inc()
    before = promscrape.parse(generate_latest(registry).decode())
    for value in (0.05, 0.5, 0.5, 5.0):
        ttft.labels("a").observe(value)
        requests.labels("a").inc()
    outcomes.labels("a", "completed").inc(3)
    outcomes.labels("a", "client_disconnected").inc()
    after = promscrape.parse(generate_latest(registry).decode())

    view = promscrape.ProxyView.between(before, after)
    assert view.requests == 4
    assert view.ttft.buckets == ((0.1, 1.0), (1.0, 3.0), (math.inf, 4.0))
    assert view.ttft.count == 4 and view.ttft.sum == pytest.approx(6.05)
    assert view.ttft.quantile(0.5) == pytest.approx(0.1 + 0.9 * (2 - 1) / 2)
    assert view.ttft.quantile(0.99) == 1.0  # in the +Inf bucket: the highest finite edge
    assert view.outcomes == {"completed": 3.0, "client_disconnected": 1.0}
    assert view.itl.count == 0 and math.isnan(view.itl.quantile(0.5))
