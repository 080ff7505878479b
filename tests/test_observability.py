"""The observability bundle, checked without a running stack.

Grafana dashboard, Prometheus configuration, recording and alert rules (with their
``promtool`` unit tests), Alertmanager configuration, Dockerfile and compose file. What
can be checked offline is checked here; that every panel query and recording rule
returns data from a real Prometheus scraping a real proxy is
``test_prometheus_integration.py``.

External tools (``promtool``, ``amtool``, ``docker-compose``, ``hadolint``) are
installed by ``.ci/run``. Without one, its test is skipped on a developer machine but
fails in CI (``CI=true``), so a missing install step cannot pass unnoticed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.config import Settings

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana" / "dashboards" / "llm-latency-proxy.json"
PROMETHEUS_DIR = ROOT / "prometheus"
PROMETHEUS_YML = PROMETHEUS_DIR / "prometheus.yml"
RECORDING_RULES = PROMETHEUS_DIR / "rules" / "recording.yml"
ALERT_RULES = PROMETHEUS_DIR / "rules" / "alerts.yml"
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
ALERTMANAGER_YML = PROMETHEUS_DIR / "alertmanager.yml"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCS = ROOT / "docs" / "dashboards.md"

# What Grafana puts in place of its macros. The windows are wide enough to cover a
# short test run's traffic; Grafana computes $__rate_interval as at least four scrape
# intervals, which is 20 s with the shipped data source (timeInterval 5s).
GRAFANA_MACROS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}
_MACRO = re.compile(r"\$\{?(\w+)(?::\w+)?\}?")


# ---------------------------------------------------------------------------
# Helpers shared with test_prometheus_integration.py (import by name only).


def require_tool(name: str) -> str:
    """Path of an external program; skip without it, except in CI where it must exist."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (.ci/run installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + "; in CI it must be there")
        pytest.skip(message)
    return path


def run_tool(*argv: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False)


def load_dashboard() -> dict[str, Any]:
    with DASHBOARD.open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def dashboard_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that shows data (rows are layout only), nested rows included."""
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def substitute_macros(expr: str, variables: dict[str, str]) -> str:
    """Replace Grafana macros and dashboard variables the way Grafana would."""

    def repl(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in GRAFANA_MACROS:
            return GRAFANA_MACROS[name]
        if name in variables:
            return variables[name]
        raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")

    out = _MACRO.sub(repl, expr)
    assert "$" not in out, out
    return out


VARIABLES = ("upstream", "model", "route", "client")  # the dashboard's label filters
ALL = {name: ".*" for name in VARIABLES}
# Metrics that carry the optional `client` label when the proxy labels clients (it is
# absent otherwise, so the default exposition does not show it). Queue time, overhead,
# time to first byte, TPOT, stream outcomes and the in-flight gauge never carry it.
CLIENT_METRICS = (
    "llm_proxy_requests_total",
    "llm_proxy_time_to_first_token_seconds",
    "llm_proxy_wait_without_first_token_seconds",
    "llm_proxy_time_to_first_answer_token_seconds",
    "llm_proxy_inter_token_latency_seconds",
    "llm_proxy_request_duration_seconds",
    "llm_proxy_prompt_tokens",
    "llm_proxy_cached_prompt_tokens",
    "llm_proxy_completion_tokens",
    "llm_proxy_reasoning_tokens",
    "llm_proxy_cache_write_prompt_tokens",
)


def carries_client(sample_name: str) -> bool:
    return any(sample_name == m or sample_name in (f"{m}_bucket", f"{m}_sum", f"{m}_count")
               for m in CLIENT_METRICS)


def dashboard_queries(variables: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL with macros substituted) for every panel target."""
    out = []
    for panel in dashboard_panels(load_dashboard()):
        for target in panel.get("targets", []):
            out.append((panel["title"], target["refId"],
                        substitute_macros(target["expr"], variables or ALL)))
    return out


def load_rules(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return [rule for group in doc["groups"] for rule in group["rules"]]


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def proxy_exposition() -> str:
    """The proxy's /metrics text with one child of every labelled metric created, so
    every sample name and bucket edge shows (a fresh registry, no traffic needed)."""
    import anyio

    async def fetch() -> str:
        app = create_app(Settings(upstream="http://127.0.0.1:9/v1", upstream_name="sim"),
                         registry=CollectorRegistry())
        assert app.metrics is not None
        app.metrics.children("/v1/chat/completions", "m", "sim")
        app.metrics.requests.labels("/v1/chat/completions", "m", "sim", "true", "200")
        app.metrics.duration.labels("/v1/chat/completions", "m", "sim", "true")
        app.metrics.no_first_token.labels("/v1/chat/completions", "m", "sim")
        app.metrics.outcomes.labels("/v1/chat/completions", "m", "sim", "completed")
        for counter in (app.metrics.fit_n, app.metrics.fit_x, app.metrics.fit_y,
                        app.metrics.fit_xy, app.metrics.fit_xx, app.metrics.fit_yy,
                        app.metrics.fit_xxx, app.metrics.fit_xxxx, app.metrics.fit_xxy,
                        app.metrics.fit_skipped):
            counter.labels("/v1/chat/completions", "m", "sim")
        app.metrics.finish_reasons.labels("/v1/chat/completions", "m", "sim", "stop")
        doctor = app.metrics.prefix
        for metric in (doctor.repeated_tokens, doctor.missed_tokens, doctor.repeated_ratio,
                       doctor.missed_per_request):
            metric.labels("/v1/chat/completions", "m", "sim")
        doctor.breaks.labels("/v1/chat/completions", "m", "sim", "variable_before_stable",
                             "system")
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
                response = await client.get("/metrics")
                response.raise_for_status()
                return response.text
        finally:
            await app.aclose()

    return anyio.run(fetch)


def sample_names(exposition: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            names.add(sample.name)
    return names


def recorded_names() -> set[str]:
    return {rule["record"] for rule in load_rules(RECORDING_RULES)}


@pytest.fixture(scope="module")
def exposition() -> str:
    return proxy_exposition()


# ---------------------------------------------------------------------------
# Grafana


def test_dashboard_is_valid_json_with_unique_ids_and_sane_layout() -> None:
    dashboard = load_dashboard()
    assert dashboard["uid"] == "llm-latency-proxy"
    assert dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]


def test_every_panel_has_title_description_and_queries() -> None:
    panels = list(dashboard_panels(load_dashboard()))
    assert len(panels) >= 15
    for panel in panels:
        assert panel.get("title", "").strip(), panel
        assert len(panel.get("description", "").strip()) >= 60, panel["title"]
        assert panel.get("targets"), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["expr"].strip()
            assert target["datasource"]["uid"] == "${datasource}"


def test_dashboard_variables_datasource_upstream_model_route_client() -> None:
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in VARIABLES:
        var = variables[name]
        assert var["type"] == "query"
        assert var["multi"] and var["includeAll"] and var["allValue"] == ".*"
        assert name in var["definition"]
        assert var["query"]["query"] == var["definition"]
    assert "$upstream" in variables["model"]["definition"]
    assert variables["route"]["definition"] == "label_values(llm_proxy_requests_total, route)"
    assert variables["client"]["definition"] == (
        'label_values(llm_proxy_requests_total{upstream=~"$upstream"}, client)')


def _series_labels(exposition: str) -> dict[str, set[str]]:
    """Label names of every sample name the proxy exports (``client`` included where
    the proxy adds it when labelling clients), and of every recorded series (the level
    before the first colon lists them: upstream_model_route_client:...)."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
            if carries_client(sample.name):
                found[sample.name].add("client")
    for name in recorded_names():
        found[name] = set(name.split(":", 1)[0].split("_"))
    return found


def test_every_query_filters_on_each_variable_its_series_carry(exposition: str) -> None:
    """A series with a route (upstream, model, client) label is always narrowed by
    $route ($upstream, $model, $client): picking one API on the dashboard narrows every
    panel that can be narrowed, and no panel silently shows all routes. A series without
    the label is never filtered on it: picking a client would empty that panel."""
    series_labels = _series_labels(exposition)
    marks = {name: f"VAR_{name}" for name in VARIABLES}
    for title, ref, expr in dashboard_queries(marks):
        for sel in selectors(expr):
            regex = {m.name: m.value for m in sel.matchers.matchers if str(m.op) == "MatchOp.Re"}
            for name in VARIABLES:
                if name in series_labels[sel.name or ""]:
                    assert regex.get(name) == marks[name], (
                        f"{title} {ref}: {sel.name} has a {name} label but no {name}=~\"${name}\"")
                else:
                    assert name not in regex, f"{title} {ref}: {sel.name} has no {name} label"


def test_every_query_parses_after_macro_substitution() -> None:
    queries = dashboard_queries()
    assert len(queries) >= 25
    for title, ref, expr in queries:
        try:
            promql_parser.parse(expr)
        except Exception as exc:  # the parser raises its own error types
            pytest.fail(f"{title} {ref}: {exc}\n{expr}")


def test_every_dashboard_metric_exists_in_metrics_output(exposition: str) -> None:
    exported = sample_names(exposition)
    recorded = recorded_names()
    for title, ref, expr in dashboard_queries():
        for sel in selectors(expr):
            assert sel.name in exported or sel.name in recorded, (
                f"{title} {ref}: {sel.name} is neither in the proxy's /metrics nor a recording rule")


def _bucket_edges(exposition: str) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                edges.setdefault(sample.name, set()).add(sample.labels["le"])
    return edges


def _check_le_and_quantiles(where: str, expr: str, edges: dict[str, set[str]]) -> None:
    for sel in selectors(expr):
        for matcher in sel.matchers.matchers:
            if matcher.name == "le":
                assert str(matcher.op) == "MatchOp.Equal", f"{where}: le must be matched exactly"
                assert matcher.value in edges[sel.name], (
                    f"{where}: le={matcher.value!r} is not a bucket edge of {sel.name} "
                    f"(edges: {sorted(edges[sel.name], key=float)})")

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.Call) and node.func.name == "histogram_quantile":
            inner = node.args[1]
            assert isinstance(inner, promql_parser.AggregateExpr), where
            assert str(inner.op) == "sum" and inner.modifier is not None, where
            assert "le" in inner.modifier.labels, f"{where}: sum by must keep le"
            assert isinstance(inner.expr, promql_parser.Call), where
            assert inner.expr.func.name == "rate", f"{where}: quantile over rate(...)"

    promql_parser.walk(promql_parser.parse(expr), visit)


def test_slo_targets_sit_on_bucket_edges_and_percentiles_aggregate(exposition: str) -> None:
    """le="X" must be an exact edge the proxy exports (as it formats it), and every
    percentile is histogram_quantile over sum by (le, ...) (rate(...))."""
    edges = _bucket_edges(exposition)
    for title, ref, expr in dashboard_queries():
        _check_le_and_quantiles(f"{title} {ref}", expr, edges)
    for rule in load_rules(RECORDING_RULES) + load_rules(ALERT_RULES):
        _check_le_and_quantiles(rule.get("record") or rule["alert"], rule["expr"], edges)


def test_dashboard_uses_only_defined_recording_rules() -> None:
    recorded = recorded_names()
    for title, ref, expr in dashboard_queries():
        for sel in selectors(expr):
            if ":" in sel.name:
                assert sel.name in recorded, f"{title} {ref}: {sel.name}"


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    prov = ROOT / "grafana" / "provisioning"
    datasources = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    prometheus = [d for d in datasources["datasources"] if d["type"] == "prometheus"]
    assert len(prometheus) == 1 and prometheus[0]["uid"] == "prometheus"
    assert prometheus[0]["isDefault"] is True
    providers = yaml.safe_load((prov / "dashboards" / "llm-latency-proxy.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    compose = yaml.safe_load(COMPOSE.read_text())
    grafana = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    # The datasource variable's default is the provisioned data source.
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == prometheus[0]["uid"]


# ---------------------------------------------------------------------------
# Prometheus and Alertmanager


def test_promtool_check_config() -> None:
    promtool = require_tool("promtool")
    result = run_tool(promtool, "check", "config", str(PROMETHEUS_YML))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules() -> None:
    promtool = require_tool("promtool")
    result = run_tool(promtool, "check", "rules", str(RECORDING_RULES), str(ALERT_RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests() -> None:
    """Each alert fires on a series that should fire it and stays silent on one that
    should not (prometheus/tests/*.yml)."""
    promtool = require_tool("promtool")
    assert len(RULE_TESTS) >= 3
    result = run_tool(promtool, "test", "rules", *map(str, RULE_TESTS), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_TESTS), result.stdout


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    tested: set[str] = set()
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        for group in doc["tests"]:
            for case in group.get("alert_rule_test", []):
                if case.get("exp_alerts"):
                    tested.add(case["alertname"])
    alerts = {rule["alert"] for rule in load_rules(ALERT_RULES)}
    assert alerts <= tested, f"alerts never shown firing in a unit test: {alerts - tested}"


def test_alerts_are_labelled_annotated_and_documented() -> None:
    docs = DOCS.read_text(encoding="utf-8")
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", docs, flags=re.M)}
    for rule in load_rules(ALERT_RULES):
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], name
        runbook = annotations["runbook"]
        assert runbook.startswith("docs/dashboards.md#"), name
        assert runbook.split("#", 1)[1] in anchors, f"{name}: no section {runbook} in the docs"
        # The alert table row names every threshold of the expression and the 'for'.
        rows = [line for line in docs.splitlines() if line.startswith(f"| {name} |")]
        assert len(rows) == 1, f"{name}: one row in the docs' alert table"
        row = rows[0]
        for number in _thresholds(rule["expr"]):
            assert re.search(rf"(?<![\d.]){re.escape(number)}(?![\d.])", row), (
                f"{name}: threshold {number} not in its docs row: {row}")
        assert rule["for"] in row, f"{name}: 'for: {rule['for']}' not in its docs row"


def _thresholds(expr: str) -> list[str]:
    """Numbers an alert compares against: '> 2', '> 0.05', '(14.4 * budget)'."""
    without_comments = re.sub(r"#.*", "", expr)
    found = re.findall(r"[<>]=?\s*\(?\s*([\d.]+)", without_comments)
    found += re.findall(r"\(\s*([\d.]+)\s*\*", without_comments)
    return found


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


TTFT_METRIC = "llm_proxy_time_to_first_token_seconds"


def _aggregations(expr: str) -> list[promql_parser.AggregateExpr]:
    found: list[promql_parser.AggregateExpr] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.AggregateExpr):
            found.append(node)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def test_ttft_rules_and_alerts_cover_every_route() -> None:
    """Every rule over the TTFT histogram selects no route and keeps ``route`` in each
    aggregation (so /v1/responses and /v1/messages are covered like chat, and not
    averaged away by it); every TTFT alert reads those per-route series and names the
    route in its summary, so a page says which API is slow."""
    per_route: set[str] = set()
    for rule in load_rules(RECORDING_RULES):
        reads = [s for s in selectors(rule["expr"]) if (s.name or "").startswith(TTFT_METRIC)]
        if not reads:
            continue
        for sel in reads:
            assert all(m.name != "route" for m in sel.matchers.matchers), rule["record"]
        for agg in _aggregations(rule["expr"]):
            assert agg.modifier is not None, rule["record"]
            assert str(agg.modifier.type) == "AggModifierType.By", rule["record"]
            assert "route" in agg.modifier.labels, f"{rule['record']}: sum by must keep route"
        assert "route" in rule["record"].split(":")[0].split("_"), rule["record"]
        per_route.add(rule["record"])
    assert len(per_route) == 10  # TTFT p50/p95/p99 and seven SLO windows
    ttft_alerts = 0
    for rule in load_rules(ALERT_RULES):
        recorded = {s.name or "" for s in selectors(rule["expr"]) if ":" in (s.name or "")}
        if recorded & per_route:
            ttft_alerts += 1
            assert recorded - {"llm_proxy:ttft_slo:error_budget"} <= per_route, rule["alert"]
            assert "{{ $labels.route }}" in rule["annotations"]["summary"], rule["alert"]
    assert ttft_alerts == 4


def _level(record: str) -> set[str]:
    return set(record.split(":", 1)[0].split("_"))


def test_alerts_name_their_upstream_and_route_and_ttft_alerts_their_client() -> None:
    """With several upstreams behind one proxy an alert must say which one: every alert
    but LLMProxyDown reads only recorded series kept per upstream, model and route, and
    its summary names the upstream and the route. The TTFT rules also keep ``client``
    (absent when the proxy does not label clients, then grouping as without it), and
    the TTFT alerts name the client only when the label is there."""
    for rule in load_rules(RECORDING_RULES):
        if any((sel.name or "").startswith(TTFT_METRIC) for sel in selectors(rule["expr"])):
            assert "client" in _level(rule["record"]), rule["record"]
            for agg in _aggregations(rule["expr"]):
                assert agg.modifier is not None and "client" in agg.modifier.labels, rule["record"]
    for rule in load_rules(ALERT_RULES):
        if rule["alert"] == "LLMProxyDown":
            continue
        recorded = {s.name or "" for s in selectors(rule["expr"])} - {
            "llm_proxy:ttft_slo:error_budget"}
        assert recorded and all(":" in name for name in recorded), rule["alert"]
        summary = rule["annotations"]["summary"]
        for name in recorded:
            assert {"upstream", "model", "route"} <= _level(name), (rule["alert"], name)
        for label in ("upstream", "model", "route"):
            assert f"{{{{ $labels.{label} }}}}" in summary, (rule["alert"], label)
            assert f"{{{{ $labels.{label} }}}}" in rule["annotations"]["description"]
        ttft = any(TTFT_METRIC in name or "ttft" in name for name in recorded)
        for text in (summary, rule["annotations"]["description"]):
            if ttft:
                assert all("client" in _level(name) for name in recorded), rule["alert"]
                assert "{{ with $labels.client }}" in text, rule["alert"]
            else:
                assert "client" not in text, rule["alert"]


def test_slo_objective_lives_in_one_rule() -> None:
    """Changing the 99 % objective is one edit: the error budget rule."""
    budget = [r for r in load_rules(RECORDING_RULES) if r["record"] == "llm_proxy:ttft_slo:error_budget"]
    assert len(budget) == 1
    value = float(re.fullmatch(r"vector\(([\d.]+)\)", budget[0]["expr"].strip()).group(1))  # type: ignore[union-attr]
    assert math.isclose(value, 0.01)
    for rule in load_rules(ALERT_RULES):
        if rule["labels"].get("slo") == "ttft":
            assert "0.01" not in rule["expr"] and "0.99" not in rule["expr"], rule["alert"]
            assert "llm_proxy:ttft_slo:error_budget" in rule["expr"]


def test_every_panel_is_documented() -> None:
    docs = DOCS.read_text(encoding="utf-8")
    for panel in dashboard_panels(load_dashboard()):
        assert panel["title"] in docs, f"panel {panel['title']!r} is not described in {DOCS.name}"


def test_alertmanager_config() -> None:
    amtool = require_tool("amtool")
    result = run_tool(amtool, "check-config", str(ALERTMANAGER_YML))
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(ALERTMANAGER_YML.read_text())
    severities = {m.split("=", 1)[1].strip('"') for r in config["route"]["routes"]
                  for m in r["matchers"]}
    assert {"critical", "warning"} <= severities


# ---------------------------------------------------------------------------
# Containers


def test_compose_file_validates() -> None:
    compose = require_tool("docker-compose")
    result = run_tool(compose, "-f", str(COMPOSE), "config", "-q")
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_switches_upstream_with_one_variable() -> None:
    compose_bin = require_tool("docker-compose")
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["proxy"]["environment"]
    assert raw["LLM_PROXY_UPSTREAM"] == "${UPSTREAM_URL:-http://simulator:8000/v1}"
    env = {**os.environ, "UPSTREAM_URL": "https://api.openai.com/v1"}
    result = subprocess.run([compose_bin, "-f", str(COMPOSE), "config"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["services"]["proxy"]["environment"]["LLM_PROXY_UPSTREAM"] == "https://api.openai.com/v1"


def test_compose_has_the_whole_stack() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert {"proxy", "simulator", "loadgen", "prometheus", "alertmanager", "grafana"} <= set(services)
    assert services["simulator"]["command"][0] == "simulate"
    assert "bench" in services["loadgen"]["command"][0]
    assert "http://proxy:8080/v1" in services["loadgen"]["command"][0]
    prometheus_mounts = services["prometheus"]["volumes"]
    assert "./prometheus:/etc/prometheus:ro" in prometheus_mounts
    # The proxy job scrapes the compose service by name, on its metrics port (which takes
    # no client key, so a keys override leaves the scrape working).
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "llm-latency-proxy")
    proxy_env = services["proxy"]["environment"]
    assert job["static_configs"][0]["targets"] == [f"proxy:{proxy_env['LLM_PROXY_METRICS_PORT']}"]
    assert proxy_env["LLM_PROXY_METRICS_HOST"] == "0.0.0.0"
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    # Longer than the proxy's drain time, so docker stop does not cut streams short.
    grace = services["proxy"]["stop_grace_period"]
    assert int(grace.rstrip("s")) > int(services["proxy"]["environment"]["LLM_PROXY_GRACEFUL_TIMEOUT"])


def test_hadolint_dockerfile() -> None:
    hadolint = require_tool("hadolint")
    result = run_tool(hadolint, "--no-color", str(DOCKERFILE))
    assert result.returncode == 0, result.stdout + result.stderr


def _instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_shape() -> None:
    """Multi-stage, non-root, health check on /healthz, env configuration and exec-form
    entry point (the proxy is PID 1 and gets SIGTERM itself)."""
    instructions = _instructions()
    froms = [rest for kw, rest in instructions if kw == "FROM"]
    assert len(froms) >= 2 and any(" AS " in f.upper() for f in froms)
    users = [rest for kw, rest in instructions if kw == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (healthcheck,) = [rest for kw, rest in instructions if kw == "HEALTHCHECK"]
    assert "/healthz" in healthcheck and "curl" not in healthcheck
    env = " ".join(rest for kw, rest in instructions if kw == "ENV")
    assert "LLM_PROXY_HOST=0.0.0.0" in env and "LLM_PROXY_PORT=8080" in env
    (entrypoint,) = [rest for kw, rest in instructions if kw == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["llm-latency-proxy"]
    (cmd,) = [rest for kw, rest in instructions if kw == "CMD"]
    assert json.loads(cmd) == ["serve"]


def dockerfile_healthcheck_argv() -> list[str]:
    """The HEALTHCHECK command (exec form), for running it against a live proxy."""
    (healthcheck,) = [rest for kw, rest in _instructions() if kw == "HEALTHCHECK"]
    argv: list[str] = json.loads(healthcheck.split("CMD", 1)[1].strip())
    return argv


def dockerfile_env() -> dict[str, str]:
    """ENV key=value pairs of the final stage (what the container's proxy starts with)."""
    env: dict[str, str] = {}
    for kw, rest in _instructions():
        if kw == "FROM":
            env = {}
        elif kw == "ENV":
            for pair in rest.split():
                key, _, value = pair.partition("=")
                env[key] = value
    return env
