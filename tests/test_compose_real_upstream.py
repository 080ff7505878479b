"""docs/dashboards.md's "The stack against a real upstream" holds for docker-compose.yml: the
services it starts exist and need neither the simulator nor the load generator, the
variables it names are the ones the compose file reads, and its override example
merges into a valid configuration with the server-held key settings in place."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def section() -> str:
    page = (ROOT / "docs" / "dashboards.md").read_text()
    start = page.index("## The stack against a real upstream")
    end = page.index("\n## ", start + 4)
    return page[start:end]


def compose() -> dict[str, object]:
    loaded: dict[str, object] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def test_started_services_exist_and_leave_the_simulated_load_out() -> None:
    command = re.search(r"docker compose up --build ([a-z ]+?)\s*(#|$)", section(), re.M)
    assert command, section()
    started = set(command[1].split())
    services = compose()["services"]
    assert isinstance(services, dict)
    assert started <= set(services)
    assert {"simulator", "loadgen"} & started == set()
    for name in started:  # nothing started waits for a service left out
        depends = services[name].get("depends_on", [])
        assert not set(depends) - started, (name, depends)


def test_named_variables_are_the_ones_compose_substitutes() -> None:
    text = section()
    environment = compose()["services"]["proxy"]["environment"]  # type: ignore[index]
    for host_var, container_var in re.findall(r"^\| `([A-Z_]+)` \| `(LLM_PROXY_[A-Z_]+)` \|", text, re.M):
        assert environment[container_var].startswith(f"${{{host_var}:-"), (host_var, container_var)


def test_override_example_merges_into_a_valid_configuration(tmp_path: Path) -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (.ci/run installs it)")
    example = re.search(r"```yaml\n(.*?)```", section(), re.S)
    assert example
    shutil.copy(ROOT / "docker-compose.yml", tmp_path)
    (tmp_path / "docker-compose.override.yml").write_text(example[1])
    (tmp_path / "client-keys").write_text("")
    env = {**os.environ, "UPSTREAM_URL": "https://api.openai.com/v1", "UPSTREAM_KEY": "sk-test"}
    done = subprocess.run([binary, "config"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    proxy = yaml.safe_load(done.stdout)["services"]["proxy"]
    environment = proxy["environment"]
    assert environment["LLM_PROXY_UPSTREAM"] == "https://api.openai.com/v1"
    assert environment[environment["LLM_PROXY_UPSTREAM_API_KEY_ENV"]] == "sk-test"
    assert environment["LLM_PROXY_UPSTREAM_AUTH"] in ("bearer", "x-api-key", "api-key")
    mounted = [v.split(":")[1] for v in proxy["volumes"]]
    assert environment["LLM_PROXY_CLIENT_KEYS_FILE"] in mounted
