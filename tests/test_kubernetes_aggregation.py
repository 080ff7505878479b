"""Many replicas add up: every dashboard query, recording rule and alert aggregates
across scrape targets (pods, workers' hosts), offline.

With N proxy pods, Prometheus holds N copies of every series, told apart only by the
target's labels (``instance``, and on Kubernetes ``pod``, ``namespace``, ``service``,
...). A query is right for any N only if it

- takes ``rate``/``increase`` of each counter and histogram series *before* summing
  (a counter restarts at 0 with its pod; rate handles the reset, a sum of raw counters
  does not), and sums histogram buckets ``by (le, ...)`` before ``histogram_quantile``
  (percentiles cannot be averaged);
- sums the in-flight gauge (not avg or max: the total in flight is the sum);
- groups ``by`` named labels that are not the target's, never ``without`` (which would
  keep them).

And every alert's labels (inferred through the recording rules it reads) hold no pod or
instance label, so one fault pages once, not once per pod. tests/test_kubernetes_replicas.py
proves the same against a real Prometheus scraping three proxies.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import promql_parser as pp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_observability import (
    ALERT_RULES,
    RECORDING_RULES,
    dashboard_queries,
    load_rules,
    proxy_exposition,
)

# Labels that tell one scrape target from another: Prometheus's own and those the
# Prometheus Operator adds to every series of a ServiceMonitor target.
TARGET_LABELS = {"instance", "pod", "namespace", "service", "container", "endpoint", "job"}
ALERT_FORBIDDEN = {"instance", "pod"}
COUNTER_LIKE = {"counter", "histogram"}


@pytest.fixture(scope="module")
def metric_types() -> dict[str, str]:
    """Sample name -> family type ('counter', 'histogram', 'gauge'), from the proxy."""
    types = {}
    for family in text_string_to_metric_families(proxy_exposition()):
        for sample in family.samples:
            types[sample.name] = family.type
    return types


def expressions() -> Iterator[tuple[str, str]]:
    for title, ref, expr in dashboard_queries():
        yield f"panel {title} [{ref}]", expr
    for rule in load_rules(RECORDING_RULES):
        yield f"rule {rule['record']}", rule["expr"]
    for rule in load_rules(ALERT_RULES):
        yield f"alert {rule['alert']}", rule["expr"]


def children(node: Any) -> list[Any]:
    if isinstance(node, pp.AggregateExpr):
        return [node.expr] + ([node.param] if node.param is not None else [])
    if isinstance(node, pp.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, pp.Call):
        return list(node.args)
    if isinstance(node, pp.MatrixSelector):
        return [node.vector_selector]
    if isinstance(node, pp.ParenExpr | pp.UnaryExpr | pp.SubqueryExpr):
        return [node.expr]
    return []


def raw_selectors(
    node: Any, ancestors: tuple[Any, ...] = ()
) -> Iterator[tuple[Any, tuple[Any, ...]]]:
    """Each selector of a proxy metric as exported (not a recorded series), with its
    ancestors, nearest first."""
    if isinstance(node, pp.VectorSelector):
        if node.name.startswith("llm_proxy_") and ":" not in node.name:
            yield node, ancestors
        return
    for child in children(node):
        yield from raw_selectors(child, (node, *ancestors))


def _enclosing_aggregation(ancestors: tuple[Any, ...]) -> tuple[Any, list[Any]]:
    """The nearest aggregation, and what lies between it and the selector."""
    between = []
    for node in ancestors:
        if isinstance(node, pp.AggregateExpr):
            return node, between
        set_op = isinstance(node, pp.BinaryExpr) and str(node.op) in ("and", "or", "unless")
        if not isinstance(node, pp.ParenExpr) and not set_op:  # those pick series, as they are
            between.append(node)
    raise AssertionError("not aggregated")


def _set_filter_or_born(sel: Any, ancestors: tuple[Any, ...]) -> bool:
    """Whether ``sel`` is read for its labels, not summed as a rate: the right side of
    an ``and`` or ``unless`` (which series exist), or the left of ``S unless S offset
    r``: the series born inside the range, whose whole count is their increase
    (``proxy.evidence``; a series that restarted existed before, and takes ``increase``)."""
    parent = ancestors[0] if ancestors else None
    if not isinstance(parent, pp.BinaryExpr) or str(parent.op) not in ("and", "unless"):
        return False
    rhs = parent.rhs  # (the parser makes a new object at each read: compared as text)
    if isinstance(rhs, pp.VectorSelector) and str(rhs) == str(sel):
        return True
    return (str(parent.op) == "unless" and isinstance(rhs, pp.VectorSelector)
            and rhs.name == sel.name and rhs.offset is not None and sel.offset is None)


def _reset_filter(ancestors: tuple[Any, ...]) -> bool:
    """Whether the selector is read inside ``resets(S[r]) == 0``, the right side of an
    ``and``: which series did not restart within the range (a filter, not summed)."""
    up = [a for a in ancestors if not isinstance(a, pp.ParenExpr)]
    return (len(up) > 3 and isinstance(up[0], pp.MatrixSelector) and isinstance(up[1], pp.Call)
            and up[1].func.name == "resets" and isinstance(up[2], pp.BinaryExpr)
            and isinstance(up[3], pp.BinaryExpr) and str(up[3].op) == "and")


def _per_series_difference(sel: Any, between: list[Any]) -> bool:
    """Whether the selector is in one series' own difference, taken before the sum: ``S -
    S offset r`` (the series at two instants; kept only where it did not restart), or
    ``max_over_time(S[r]) - min_over_time(S[r])`` (what it gained within the range)."""
    if len(between) == 1 and isinstance(between[0], pp.BinaryExpr) and str(between[0].op) == "-":
        lhs, rhs = between[0].lhs, between[0].rhs
        return (isinstance(lhs, pp.VectorSelector) and isinstance(rhs, pp.VectorSelector)
                and lhs.name == rhs.name == sel.name and lhs.offset is None
                and rhs.offset is not None)
    if (len(between) == 3 and isinstance(between[0], pp.MatrixSelector)
            and isinstance(between[1], pp.Call) and isinstance(between[2], pp.BinaryExpr)
            and str(between[2].op) == "-"):
        lhs, rhs = between[2].lhs, between[2].rhs
        return (isinstance(lhs, pp.Call) and isinstance(rhs, pp.Call)
                and (lhs.func.name, rhs.func.name) == ("max_over_time", "min_over_time")
                and str(lhs.args[0]) == str(rhs.args[0]))
    return False


def aggregation_problems(expr: str, types: dict[str, str]) -> list[str]:
    problems = []
    for sel, ancestors in raw_selectors(pp.parse(expr)):
        if _set_filter_or_born(sel, ancestors) or _reset_filter(ancestors):
            continue
        kind = types.get(sel.name)
        if kind is None:
            problems.append(f"{sel.name}: not a metric the proxy exports")
            continue
        try:
            agg, between = _enclosing_aggregation(ancestors)
        except AssertionError:
            problems.append(f"{sel.name}: not summed across targets")
            continue
        if str(agg.op) != "sum":
            problems.append(f"{sel.name}: aggregated with {agg.op}, not sum")
        if agg.modifier is not None:
            if str(agg.modifier.type).endswith("Without"):
                problems.append(f"{sel.name}: sum without (...) keeps the target's labels")
            elif set(agg.modifier.labels) & TARGET_LABELS:
                problems.append(f"{sel.name}: summed by a target label {agg.modifier.labels}")
        if kind in COUNTER_LIKE:
            ok = (
                len(between) == 2
                and isinstance(between[0], pp.MatrixSelector)
                and isinstance(between[1], pp.Call)
                and between[1].func.name in ("rate", "increase")
            ) or _per_series_difference(sel, between)
            if not ok:
                problems.append(f"{sel.name}: a {kind} series must be rate()d, then summed")
        elif between:
            problems.append(f"{sel.name}: a gauge is summed as it is")
    return problems


def test_every_query_and_rule_sums_rates_across_targets(metric_types: dict[str, str]) -> None:
    problems = []
    checked = 0
    for where, expr in expressions():
        checked += sum(1 for _ in raw_selectors(pp.parse(expr)))
        problems += [f"{where}: {p}" for p in aggregation_problems(expr, metric_types)]
    assert checked > 80, checked  # every panel and rule reads the proxy's series
    assert not problems, "\n".join(problems)


def test_the_check_catches_per_target_mistakes(metric_types: dict[str, str]) -> None:
    """The check above is not vacuous: each of these is wrong with several replicas."""
    wrong = [
        "histogram_quantile(0.95, rate(llm_proxy_time_to_first_token_seconds_bucket[5m]))",
        "avg(llm_proxy_in_flight_requests)",
        "max by (upstream) (llm_proxy_in_flight_requests)",
        "rate(sum(llm_proxy_requests_total)[5m:])",
        "sum without (code) (rate(llm_proxy_requests_total[5m]))",
        "sum by (instance) (rate(llm_proxy_requests_total[5m]))",
        "sum(llm_proxy_requests_total)",
        "llm_proxy_in_flight_requests",
        "sum(llm_proxy_requests_total - llm_proxy_requests_total)",
        "sum(max_over_time(llm_proxy_requests_total[5m]))",
        "sum(max_over_time(llm_proxy_requests_total[5m]) - min_over_time(llm_proxy_in_flight_requests[5m]))",
        "sum(llm_proxy_requests_total and resets(llm_proxy_requests_total[5m]) == 0) "
        "+ sum(resets(llm_proxy_requests_total[5m]))",
    ]
    for expr in wrong:
        assert aggregation_problems(expr, metric_types), expr
    assert not aggregation_problems(
        "histogram_quantile(0.5, sum by (le) (rate(llm_proxy_time_to_first_token_seconds_bucket[5m])))",
        metric_types,
    )
    assert not aggregation_problems(  # each series' own difference, taken before the sum
        "sum by (le) (((llm_proxy_time_to_first_token_seconds_bucket - "
        "llm_proxy_time_to_first_token_seconds_bucket offset 5m) and "
        "(resets(llm_proxy_time_to_first_token_seconds_bucket[5m]) == 0)) or "
        "(max_over_time(llm_proxy_time_to_first_token_seconds_bucket[5m]) - "
        "min_over_time(llm_proxy_time_to_first_token_seconds_bucket[5m])))", metric_types)


# ---------------------------------------------------------------------------
# Labels an alert carries


ANY = None  # the label set is open: whatever the target's series carry


def output_labels(node: Any, recorded: dict[str, Any]) -> set[str] | None:
    """The labels an expression's result carries, or ANY when it keeps the target's."""
    if isinstance(node, pp.VectorSelector):
        if node.name in recorded:
            return output_labels(recorded[node.name], recorded)
        return ANY
    if isinstance(node, pp.NumberLiteral | pp.StringLiteral):
        return set()
    if isinstance(node, pp.AggregateExpr):
        if node.modifier is None:
            return set()
        if str(node.modifier.type).endswith("Without"):
            return ANY
        return set(node.modifier.labels)
    if isinstance(node, pp.Call):
        if node.func.name in ("vector", "scalar", "time"):
            return set()
        if node.func.name == "histogram_quantile":
            inner = output_labels(node.args[1], recorded)
            return ANY if inner is ANY else inner - {"le"}
        vectors = [
            output_labels(a, recorded)
            for a in node.args
            if not isinstance(a, pp.NumberLiteral | pp.StringLiteral)
        ]
        return vectors[0] if vectors else set()
    if isinstance(node, pp.BinaryExpr):
        sides = [output_labels(node.lhs, recorded), output_labels(node.rhs, recorded)]
        if ANY in sides:
            return ANY
        return set().union(*sides)
    (inner,) = children(node)
    return output_labels(inner, recorded)


def test_no_alert_carries_a_pod_or_instance_label() -> None:
    recorded = {r["record"]: pp.parse(r["expr"]) for r in load_rules(RECORDING_RULES)}
    for rule in load_rules(RECORDING_RULES):
        labels = output_labels(recorded[rule["record"]], recorded)
        assert labels is not ANY and not labels & TARGET_LABELS, (rule["record"], labels)
    for rule in load_rules(ALERT_RULES):
        labels = output_labels(pp.parse(rule["expr"]), recorded)
        assert labels is not ANY, f"{rule['alert']} keeps every label of the scraped series"
        assert not labels & ALERT_FORBIDDEN, (rule["alert"], labels)
        assert not set(rule.get("labels", {})) & ALERT_FORBIDDEN, rule["alert"]
        for text in rule.get("annotations", {}).values():
            for label in ALERT_FORBIDDEN:
                assert f"$labels.{label}" not in text, (rule["alert"], label)


def test_label_inference_sees_a_per_target_alert() -> None:
    recorded: dict[str, Any] = {}
    assert output_labels(pp.parse('up{job="x"} == 0'), recorded) is ANY
    assert output_labels(pp.parse("sum without (code) (rate(a_total[5m])) > 1"), recorded) is ANY
    assert output_labels(pp.parse("count by (job) (up == 0) > 0"), recorded) == {"job"}
