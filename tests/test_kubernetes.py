"""The Kubernetes manifests (deploy/kubernetes/), checked offline: no cluster needed.

``kubectl kustomize`` renders the base and every overlay as ``kubectl apply -k``
would; every core object is validated with kubernetes-validate against the
Kubernetes version below (strict: unknown fields fail); the Prometheus Operator
objects, which it has no schema for, get a structural check of the fields this
deployment relies on. The PrometheusRule and the dashboard ConfigMap must be exact,
current copies of prometheus/rules/ and grafana/dashboards/, and the PrometheusRule's
groups pass ``promtool check rules`` and the repository's promtool rule tests. The
several-upstreams overlay's config file, as mounted, loads with the proxy's own loader
together with the environment the Deployment gives the container; so does the
shared-prefix-index overlay's, whose store's config file, as mounted, starts Debian's
redis-server, which the proxy's shared index then uses.

Without ``kubectl`` (Debian ``kubernetes-client``) or ``promtool`` the tests that need
them are skipped on a developer machine and fail in CI (``CI=true``).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.config import from_sources
from proxy.config_values import SettingsError
from proxy.options import ENV_PREFIX
from proxy.routing import RoutingTable
from tests.test_observability import (
    DASHBOARD,
    DOCKERFILE,
    PROMETHEUS_YML,
    ROOT,
    RULE_TESTS,
    require_tool,
    run_tool,
)

# The schemas every core object is validated against; the oldest release the
# manifests are meant for (topologySpreadConstraints.matchLabelKeys is beta and on by
# default since 1.27; nothing newer is used).
KUBERNETES_VERSION = "1.32.0"

DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
OPERATOR_GROUP = "monitoring.coreos.com/v1"


def _load_generate() -> Any:
    spec = importlib.util.spec_from_file_location("generate", DEPLOY / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_generate()


def render(directory: Path) -> list[dict[str, Any]]:
    kubectl = require_tool("kubectl")
    result = run_tool(kubectl, "kustomize", str(directory))
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(DEPLOY)


@pytest.fixture(scope="module", params=[DEPLOY, *OVERLAYS], ids=lambda p: p.name)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def proxy_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The proxy's Deployment (an overlay may add another: the shared prefix index's store)."""
    return named(objects, "Deployment", "llm-latency-proxy")


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (proxy,) = proxy_deployment(objects)["spec"]["template"]["spec"]["containers"]
    return proxy


def settings(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The LLM_PROXY_* variables the proxy container gets from its ConfigMap."""
    env_from = container(objects)["envFrom"]
    names = {e["configMapRef"]["name"] for e in env_from}
    maps = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] in names]
    assert len(maps) == len(names) == 1
    data: dict[str, str] = maps[0]["data"]
    return data


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------
# Generated copies


def test_generated_files_are_current() -> None:
    for path, text in generate.outputs().items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} is stale: run python deploy/kubernetes/generate.py"
        )
    assert generate.main(["--check"]) == 0


def test_generated_copies_hold_the_sources_unchanged(base: list[dict[str, Any]]) -> None:
    rule = one(base, "PrometheusRule")
    sources = [
        g
        for p in sorted((ROOT / "prometheus" / "rules").glob("*.yml"))
        for g in yaml.safe_load(p.read_text())["groups"]
    ]
    assert rule["spec"]["groups"] == sources
    (dashboards,) = [
        o
        for o in base
        if o["kind"] == "ConfigMap"
        and o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    assert dashboards["data"] == {DASHBOARD.name: DASHBOARD.read_text()}


# ---------------------------------------------------------------------------
# Schemas


def test_every_core_object_validates(rendered: list[dict[str, Any]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kinds = set()
    for obj in rendered:
        if obj["apiVersion"] == OPERATOR_GROUP:
            continue  # no schema in kubernetes-validate: see the structural tests below
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        kinds.add(obj["kind"])
    assert kinds == {
        "ConfigMap",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    }
    assert not [o for o in rendered if o["kind"] == "Secret"], "keys never live in the repo"


def test_validation_rejects_a_wrong_field(base: list[dict[str, Any]]) -> None:
    """The validation above can fail: a misspelt field in the pod spec is refused."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = yaml.safe_load(yaml.safe_dump(proxy_deployment(base)))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 150
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# ---------------------------------------------------------------------------
# The Deployment


def _dockerfile_user() -> str:
    (user,) = re.findall(r"^USER\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    return user


def test_deployment_security(rendered: list[dict[str, Any]]) -> None:
    pod = proxy_deployment(rendered)["spec"]["template"]["spec"]
    proxy = container(rendered)
    uid, gid = _dockerfile_user().split(":")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == uid
    assert str(pod["securityContext"]["runAsGroup"]) == gid
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    sc = proxy["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc.get("privileged", False) is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "runAsUser" not in sc or str(sc["runAsUser"]) == uid


def test_multiprocess_directory_is_writable(rendered: list[dict[str, Any]]) -> None:
    """--workers makes its metrics directory with mkdtemp under TMPDIR (proxy/serve.py);
    with a read-only root that must be an emptyDir."""
    assert int(settings(rendered)["LLM_PROXY_WORKERS"]) > 1
    proxy = container(rendered)
    env = {e["name"]: e.get("value") for e in proxy["env"]}
    mounts = {m["mountPath"]: m["name"] for m in proxy["volumeMounts"]}
    volumes = {
        v["name"]: v for v in proxy_deployment(rendered)["spec"]["template"]["spec"]["volumes"]
    }
    assert "emptyDir" in volumes[mounts[env["TMPDIR"]]]


def test_probes_shutdown_and_resources(rendered: list[dict[str, Any]]) -> None:
    pod = proxy_deployment(rendered)["spec"]["template"]["spec"]
    proxy = container(rendered)
    config = settings(rendered)
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    assert ports["http"] == int(config["LLM_PROXY_PORT"])
    assert ports["metrics"] == int(config["LLM_PROXY_METRICS_PORT"])
    assert config["LLM_PROXY_HOST"] == config["LLM_PROXY_METRICS_HOST"] == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        # /healthz is answered by the proxy itself and never calls the upstream.
        assert proxy[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    # preStop, then SIGTERM, then up to the graceful timeout, then the metrics linger
    # (at least one scrape interval after the drain): all inside the grace period.
    command = proxy["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    graceful = float(config["LLM_PROXY_GRACEFUL_TIMEOUT"])
    linger = float(config["LLM_PROXY_METRICS_LINGER"])
    (endpoint,) = one(rendered, "ServiceMonitor")["spec"]["endpoints"]
    assert linger >= seconds(endpoint["interval"]) + seconds(endpoint["scrapeTimeout"])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + graceful + linger + 10
    assert proxy["resources"]["requests"]["cpu"] and proxy["resources"]["limits"]["memory"]
    keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
    assert "kubernetes.io/hostname" in keys
    pod_labels = pod_template_labels(rendered)
    for constraint in pod["topologySpreadConstraints"]:
        assert matches(constraint["labelSelector"]["matchLabels"], pod_labels)
    assert "replicas" not in proxy_deployment(rendered)["spec"], "the HPA owns the count"


def seconds(duration: str) -> float:
    """A Prometheus duration as the ServiceMonitor writes it (``15s``, ``1m``)."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in sorted(units, key=len, reverse=True):
        if duration.endswith(unit):
            return float(duration[: -len(unit)]) * units[unit]
    raise AssertionError(f"not a duration: {duration!r}")


def pod_template_labels(objects: list[dict[str, Any]]) -> dict[str, str]:
    labels: dict[str, str] = proxy_deployment(objects)["spec"]["template"]["metadata"]["labels"]
    return labels


def test_service_pdb_and_hpa_select_the_pods(rendered: list[dict[str, Any]]) -> None:
    pods = pod_template_labels(rendered)
    deployment = proxy_deployment(rendered)
    assert matches(deployment["spec"]["selector"]["matchLabels"], pods)
    service = named(rendered, "Service", "llm-latency-proxy")
    assert matches(service["spec"]["selector"], pods)
    # Apps get the http port only: the metrics port (/metrics and /ui, no key asked) is
    # reached through the headless metrics Service, which no app is pointed at.
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"http": "http"}
    carrying_metrics = {
        o["metadata"]["name"]
        for o in rendered
        if o["kind"] == "Service" and "metrics" in {p["name"] for p in o["spec"]["ports"]}
    }
    assert carrying_metrics == {"llm-latency-proxy-metrics"}
    assert matches(one(rendered, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pods)
    hpa = one(rendered, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"]
    assert hpa["minReplicas"] >= 2
    assert "cpu" in container(rendered)["resources"]["requests"], "utilization needs a request"



def test_install_block_deploys_the_image_it_pushes(tmp_path: Path) -> None:
    """docs/kubernetes.md's install block, run as written but for docker and the cluster:
    the overlay it writes renders to a Deployment running the image it built and pushed,
    not the base's placeholder, which no node can pull."""
    page = (ROOT / "docs" / "kubernetes.md").read_text()
    found = re.search(r"```sh\n(.*?)```", page, re.S)
    assert found, "docs/kubernetes.md has no install block"
    block = found[1]
    assert 'docker push "$IMAGE:$TAG"' in block, block
    applied = re.search(r"^kubectl apply -k (\S+)", block, re.M)
    assert applied, block
    script = "\n".join(
        line for line in block.splitlines() if not line.startswith(("docker ", "kubectl "))
    )
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    done = subprocess.run(
        ["bash", "-e", "-c", script + '\nprintf %s "$IMAGE:$TAG" > pushed'],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    pushed = (tmp_path / "pushed").read_text()
    assert pushed.startswith("registry.example.com/"), pushed
    assert container(render(tmp_path / applied[1]))["image"] == pushed
    assert container(render(DEPLOY))["image"] != pushed

# ---------------------------------------------------------------------------
# Prometheus Operator objects: the fields this deployment relies on


def test_service_monitor_scrapes_the_metrics_port(rendered: list[dict[str, Any]]) -> None:
    monitor = one(rendered, "ServiceMonitor")
    assert monitor["apiVersion"] == OPERATOR_GROUP
    spec = monitor["spec"]
    # Exactly one Service is scraped (two would scrape every pod twice and double every
    # sum): the headless one that keeps a terminating, draining pod listed.
    services = [
        o
        for o in rendered
        if o["kind"] == "Service"
        and matches(spec["selector"]["matchLabels"], o["metadata"]["labels"])
    ]
    assert len(services) == 1, [o["metadata"]["name"] for o in services]
    (service,) = services
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert matches(service["spec"]["selector"], pod_template_labels(rendered))
    assert "namespaceSelector" not in spec  # the monitor's own namespace, as the Service
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["path"] == "/metrics"
    assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    # The job label is the Service's app.kubernetes.io/name: the name the shipped
    # prometheus.yml scrapes under and the LLMProxyDown alert selects.
    job = service["metadata"]["labels"][spec["jobLabel"]]
    scrape_jobs = {
        j["job_name"] for j in yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
    }
    assert job == "llm-latency-proxy" and job in scrape_jobs
    rule = one(rendered, "PrometheusRule")
    assert f'job="{job}"' in yaml.safe_dump(rule["spec"])
    # Both Operator objects carry the same labels, so one ruleSelector/serviceMonitorSelector
    # of the Prometheus resource picks up both.
    assert monitor["metadata"]["labels"] == rule["metadata"]["labels"]


def test_prometheus_rule_structure(rendered: list[dict[str, Any]]) -> None:
    rule = one(rendered, "PrometheusRule")
    assert rule["apiVersion"] == OPERATOR_GROUP
    assert set(rule["spec"]) == {"groups"}
    names = [g["name"] for g in rule["spec"]["groups"]]
    assert len(names) == len(set(names)), "group names must be unique within the resource"
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"}, group["name"]
        for r in group["rules"]:
            assert ("record" in r) != ("alert" in r), r
            assert isinstance(r["expr"], str) and r["expr"].strip()
            assert set(r) <= {"record", "alert", "expr", "for", "labels", "annotations"}


def test_grafana_dashboard_configmap(rendered: list[dict[str, Any]]) -> None:
    maps = [
        o
        for o in rendered
        if o["kind"] == "ConfigMap"
        and o["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    assert len(maps) == 1
    assert all(key.endswith(".json") for key in maps[0]["data"])
    # kubectl apply keeps the whole object in an annotation limited to 256 KiB.
    assert len(yaml.safe_dump(maps[0])) < 200_000


@pytest.fixture(scope="module")
def generated_rules(
    tmp_path_factory: pytest.TempPathFactory, base: list[dict[str, Any]]
) -> Iterator[Path]:
    """The PrometheusRule's groups as a plain rule file, as the Operator hands them on."""
    path = tmp_path_factory.mktemp("rules") / "prometheusrule-groups.yml"
    path.write_text(yaml.safe_dump({"groups": one(base, "PrometheusRule")["spec"]["groups"]}))
    yield path


def test_promtool_check_generated_rules(generated_rules: Path) -> None:
    promtool = require_tool("promtool")
    result = run_tool(promtool, "check", "rules", str(generated_rules))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_tests_pass_on_generated_rules(generated_rules: Path, tmp_path: Path) -> None:
    """The repository's rule tests, pointed at the PrometheusRule's groups instead of
    prometheus/rules/*.yml: the deployed rules behave as the tested ones."""
    promtool = require_tool("promtool")
    copies = []
    for test in RULE_TESTS:
        doc = yaml.safe_load(test.read_text())
        doc["rule_files"] = [str(generated_rules)]
        copy = tmp_path / test.name
        copy.write_text(yaml.safe_dump(doc, sort_keys=False))
        copies.append(str(copy))
    result = run_tool(promtool, "test", "rules", *copies, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_TESTS), result.stdout


# ---------------------------------------------------------------------------
# The openai overlay


def test_openai_overlay_holds_the_key_by_reference() -> None:
    objects = render(DEPLOY / "overlays" / "openai")
    config = settings(objects)
    assert config["LLM_PROXY_UPSTREAM"] == "https://api.openai.com/v1"
    key_env = config["LLM_PROXY_UPSTREAM_API_KEY_ENV"]
    proxy = container(objects)
    (key,) = [e for e in proxy["env"] if e["name"] == key_env]
    ref = key["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is False and ref["name"] and ref["key"]
    mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    keys_file = Path(config["LLM_PROXY_CLIENT_KEYS_FILE"])
    assert mounts["client-keys"] == str(keys_file.parent)
    volumes = {
        v["name"]: v for v in proxy_deployment(objects)["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["client-keys"]["secret"]["secretName"]
    assert not proxy["image"].startswith("llm-latency-proxy:")
    for obj in objects:
        assert obj["metadata"].get("namespace") == "llm-proxy", obj["kind"]
    text = (DEPLOY / "overlays" / "openai" / "kustomization.yaml").read_text()
    assert not re.search(r"sk-[A-Za-z0-9]{8,}", text)


def test_no_key_in_any_manifest() -> None:
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            assert not re.search(r"sk-[A-Za-z0-9_-]{16,}", path.read_text()), path


# ---------------------------------------------------------------------------
# The several-upstreams overlay

SEVERAL = DEPLOY / "overlays" / "several-upstreams"


@pytest.fixture(scope="module")
def several() -> list[dict[str, Any]]:
    return render(SEVERAL)


def container_env(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """Every variable the proxy container gets: its ConfigMap's, then its own ``env``
    entries (a value, or the ``valueFrom`` reference)."""
    env: dict[str, Any] = dict(settings(objects))
    for entry in container(objects)["env"]:
        env[entry["name"]] = entry.get("value", entry.get("valueFrom"))
    return env


def mounted_file(objects: list[dict[str, Any]], path: str) -> tuple[dict[str, Any], str]:
    """The ConfigMap volume holding ``path`` in the proxy container, and the file's text."""
    file = PurePosixPath(path)
    mounts = {m["mountPath"]: m for m in container(objects)["volumeMounts"]}
    mount = mounts[str(file.parent)]
    assert "subPath" not in mount, "a subPath mount is never updated by the kubelet"
    volumes = proxy_deployment(objects)["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    config_map = named(objects, "ConfigMap", volume["configMap"]["name"])
    text: str = config_map["data"][file.name]
    return config_map, text


def test_several_upstreams_env_has_a_config_and_no_single_upstream(
    several: list[dict[str, Any]],
) -> None:
    """The base's LLM_PROXY_UPSTREAM* settings are gone (with a config file they stop
    the proxy at start), LLM_PROXY_CONFIG names the mounted file."""
    env = container_env(several)
    assert env["LLM_PROXY_CONFIG"] == "/etc/llm-proxy/config/proxy.toml"
    assert not [name for name in env if name.startswith(ENV_PREFIX + "UPSTREAM")]
    assert "UPSTREAM_API_KEY" not in env  # the base's single-upstream key variable
    assert settings(render(DEPLOY))["LLM_PROXY_UPSTREAM"], "the base keeps its upstream"


def test_several_upstreams_config_map_is_the_file_and_rolls_the_pods(
    several: list[dict[str, Any]],
) -> None:
    """The mounted file is the overlay's proxy.toml, in a ConfigMap whose name carries
    its hash: a change to the file is a new pod template, so the pods roll."""
    config_map, text = mounted_file(several, container_env(several)["LLM_PROXY_CONFIG"])
    assert text == (SEVERAL / "proxy.toml").read_text()
    name = config_map["metadata"]["name"]
    assert re.fullmatch(r"llm-latency-proxy-upstreams-[a-z0-9]{10}", name), name
    assert config_map["metadata"]["namespace"] == "llm-proxy"


def _start_env(several: list[dict[str, Any]], tmp_path: Path) -> dict[str, str]:
    """The container's environment as the proxy would see it: the mounted file and the
    client keys file written under ``tmp_path``, a made-up value in every variable a
    Secret fills."""
    env = container_env(several)
    _, text = mounted_file(several, env["LLM_PROXY_CONFIG"])
    config = tmp_path / "proxy.toml"
    config.write_text(text)
    keys_file = tmp_path / "client-keys"
    keys_file.write_text("0" * 64 + "\n")
    out: dict[str, str] = {}
    for name, value in env.items():
        if isinstance(value, dict):
            ref = value["secretKeyRef"]
            assert ref["optional"] is False, name  # the proxy needs every key it names
            out[name] = f"test-{ref['key']}-key"
        else:
            out[name] = value
    return out | {"LLM_PROXY_CONFIG": str(config), "LLM_PROXY_CLIENT_KEYS_FILE": str(keys_file)}


def test_several_upstreams_config_loads_with_the_deployment_env(
    several: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The mounted proxy.toml and the container's environment together pass the real
    loader: every api_key_env is a variable the Deployment fills from the Secret, the
    routing is what the file says, no top-level key is silently overridden."""
    env = _start_env(several, tmp_path)
    s = from_sources(None, env)
    assert [u.name for u in s.upstreams] == ["openai", "anthropic", "vllm"]
    secret_vars = {n for n, v in container_env(several).items() if isinstance(v, dict)}
    assert {u.api_key_env for u in s.upstreams if u.api_key_env} == secret_vars
    table = RoutingTable(s.upstreams)

    def routed(model: str, route: str = "/v1/chat/completions") -> str:
        index = table.pick(model, route)
        assert index is not None, model
        return s.upstreams[index].name

    assert routed("gpt-4o") == routed("o3-mini") == routed("unknown") == "openai"
    assert routed("claude-sonnet-4-5", "/v1/messages") == "anthropic"
    assert routed("meta-llama/Llama-3.1-8B-Instruct") == routed("Qwen/Qwen2.5-7B") == "vllm"
    assert s.upstreams[2].url == "http://vllm:8000/v1" and s.upstreams[2].provider == "vllm"
    assert s.workers == int(env["LLM_PROXY_WORKERS"])
    # A variable wins over the file's top-level key: none may be set for the same setting.
    doc = tomllib.loads((SEVERAL / "proxy.toml").read_text())
    for key in doc:
        if key != "upstream":
            assert ENV_PREFIX + key.upper() not in env, key
    assert s.client_label_from == "header:x-team" and s.max_clients == 50


def test_several_upstreams_with_the_base_upstream_would_not_start(
    several: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Why the overlay removes LLM_PROXY_UPSTREAM*: left in, even empty, the proxy
    refuses to start; and without a key variable it refuses too."""
    env = _start_env(several, tmp_path)
    base = settings(render(DEPLOY))
    with pytest.raises(SettingsError, match="LLM_PROXY_UPSTREAM: cannot be combined"):
        from_sources(None, env | {"LLM_PROXY_UPSTREAM": base["LLM_PROXY_UPSTREAM"]})
    with pytest.raises(SettingsError, match="LLM_PROXY_UPSTREAM="):  # blanked: still refused
        from_sources(None, env | {"LLM_PROXY_UPSTREAM": ""})
    with pytest.raises(SettingsError, match="LLM_PROXY_UPSTREAM_NAME: cannot be combined"):
        from_sources(None, env | {"LLM_PROXY_UPSTREAM_NAME": base["LLM_PROXY_UPSTREAM_NAME"]})
    with pytest.raises(SettingsError, match="OPENAI_API_KEY is empty or unset"):
        from_sources(None, {k: v for k, v in env.items() if k != "OPENAI_API_KEY"})


def test_several_upstreams_overlay_keeps_keys_out(several: list[dict[str, Any]]) -> None:
    proxy = container(several)
    assert not proxy["image"].startswith("llm-latency-proxy:")
    for obj in several:
        assert obj["metadata"].get("namespace") == "llm-proxy", obj["kind"]
    mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    keys_file = Path(settings(several)["LLM_PROXY_CLIENT_KEYS_FILE"])
    assert mounts["client-keys"] == str(keys_file.parent)
    volumes = {
        v["name"]: v for v in proxy_deployment(several)["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["client-keys"]["secret"]["secretName"]
    for path in SEVERAL.iterdir():
        assert not re.search(r"sk-[A-Za-z0-9_-]{8,}", path.read_text()), path


# ---------------------------------------------------------------------------
# The shared-prefix-index overlay

SHARED = DEPLOY / "overlays" / "shared-prefix-index"
STORE = "llm-latency-proxy-prefix-index"


@pytest.fixture(scope="module")
def shared_index() -> list[dict[str, Any]]:
    return render(SHARED)


def test_shared_prefix_index_config_loads_and_names_the_store(
    shared_index: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The mounted proxy.toml under the container's environment passes the real loader:
    one upstream, the base's vLLM Service; a [cache-index] table naming the store's
    Service and port; the digest secret and the password from the Secret, required."""
    env = {k: v for k, v in _start_env(shared_index, tmp_path).items()
           if k != "LLM_PROXY_CLIENT_KEYS_FILE"}
    refs = {n: v["secretKeyRef"] for n, v in container_env(shared_index).items()
            if isinstance(v, dict)}
    assert refs["LLM_PROXY_PREFIX_SECRET"]["name"] == STORE
    assert refs["LLM_PROXY_PREFIX_SECRET"]["optional"] is False
    assert not [name for name in env if name.startswith(ENV_PREFIX + "UPSTREAM")]
    s = from_sources(None, env | {"LLM_PROXY_PREFIX_SECRET": "x" * 64})
    (upstream,) = s.upstreams
    assert upstream.url == settings(render(DEPLOY))["LLM_PROXY_UPSTREAM"]
    index = s.cache_index
    assert index is not None and index.password_env in refs
    assert refs[index.password_env] == {"name": STORE, "key": "password", "optional": False}
    url = urlsplit(index.url)
    service = named(shared_index, "Service", STORE)
    assert url.hostname == STORE and url.port == service["spec"]["ports"][0]["port"]
    with pytest.raises(SettingsError, match="LLM_PROXY_PREFIX_SECRET"):
        from_sources(None, env | {"LLM_PROXY_PREFIX_SECRET": ""})
    doc = tomllib.loads((SHARED / "proxy.toml").read_text())
    # proxy-wide settings stay in config.env; this overlay is for the doctor, off by default
    assert set(doc) == {"upstream", "cache-index", "prefix_doctor"} and doc["prefix_doctor"]


def test_shared_prefix_index_store_is_one_locked_down_cache(
    shared_index: list[dict[str, Any]],
) -> None:
    store = named(shared_index, "Deployment", STORE)
    spec = store["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    (valkey,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    sc = valkey["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "$(PREFIX_INDEX_PASSWORD)" in valkey["args"]
    assert valkey["resources"]["limits"]["memory"]
    labels = spec["template"]["metadata"]["labels"]
    service = named(shared_index, "Service", STORE)
    assert matches(service["spec"]["selector"], labels)
    assert not matches(service["spec"]["selector"], pod_template_labels(shared_index))
    for other in ("llm-latency-proxy", "llm-latency-proxy-metrics"):
        assert not matches(named(shared_index, "Service", other)["spec"]["selector"], labels)
    assert not matches(one(shared_index, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                       labels)
    conf = store_conf(shared_index)
    assert {"maxmemory-policy allkeys-lru", 'save ""', "appendonly no"} <= set(conf)
    assert any(line.startswith("maxmemory ") for line in conf)


def store_conf(objects: list[dict[str, Any]]) -> list[str]:
    """The store's config file as mounted (comments and blank lines left out)."""
    pod = named(objects, "Deployment", STORE)["spec"]["template"]["spec"]
    (valkey,) = pod["containers"]
    path = PurePosixPath(valkey["args"][0])
    mount = {m["mountPath"]: m["name"] for m in valkey["volumeMounts"]}[str(path.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount]
    text: str = named(objects, "ConfigMap", volume["configMap"]["name"])["data"][path.name]
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_shared_prefix_index_store_config_runs_and_the_proxy_uses_it(
    shared_index: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The store's config file, as mounted, starts Debian's redis-server (Valkey reads
    the same directives), and the proxy's [cache-index] table, pointed at it, exchanges
    with it under the password the Secret would give both."""
    from proxy.doctor.index import NEVER, Probe
    from proxy.doctor.shared_index import RedisPrefixIndex, cache_index_spec
    from tests.redis_server import redis_server

    conf = tmp_path / "valkey.conf"
    conf.write_text("\n".join(line for line in store_conf(shared_index)
                              if not line.startswith("dir ")) + "\n")
    with redis_server(tmp_path, "--requirepass", "from-the-secret", config=conf) as server:
        import redis

        admin = redis.Redis(port=server.port, password="from-the-secret")
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert int(admin.config_get("maxmemory")["maxmemory"]) == 256 * 1024 * 1024
        admin.close()
        doc = tomllib.loads((SHARED / "proxy.toml").read_text())
        doc["cache-index"]["url"] = server.url
        env = {"PREFIX_INDEX_PASSWORD": "from-the-secret", "LLM_PROXY_PREFIX_SECRET": "s" * 32}
        spec = cache_index_spec("proxy.toml", doc, env)
        assert spec is not None
        index = RedisPrefixIndex(spec, horizon_ms=60_000, environ=env)
        try:
            probe = Probe((b"k" * 8,), b"\x00")
            index.exchange(probe, 0)
            assert index.exchange(probe, 1000).ended[0] != NEVER  # found: the store works
        finally:
            index.close()
