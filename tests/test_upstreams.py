"""The config file and routing by model, unit level: every start-up error is one line
naming the file, the upstream and the setting; the routing table picks exactly as
docs/upstreams.md says (first match in file order, routes, default, none)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from proxy import config
from proxy.config import Settings, from_sources, reload_specs
from proxy.config_values import SettingsError
from proxy.routing import RoutingTable
from proxy.upstream_spec import UpstreamSpec, _shadowed

TWO = """
client_label_from = "header:X-Team"
max_clients = 7
max_concurrency = 3

[[upstream]]
name = "openai"
url = "https://api.openai.com/v1"
models = ["gpt-*", "o3*"]
api_key_env = "TEST_OPENAI_KEY"
auth = "bearer"
default = true

[[upstream]]
name = "local-vllm"
url = "http://vllm:8000/v1"
models = ["meta-llama/*", "qwen*"]
max_concurrency = 64
read_timeout = 600
headers = { "X-Org" = "team-a" }

[[upstream]]
name = "anthropic"
url = "https://api.anthropic.com/v1"
models = ["claude-*"]
routes = ["/v1/messages"]
api_key_env = "TEST_ANTHROPIC_KEY"
auth = "x-api-key"
headers = { anthropic-version = "2023-06-01" }
"""
ENV = {"TEST_OPENAI_KEY": "sk-o", "TEST_ANTHROPIC_KEY": "sk-a"}


def write(tmp_path: Path, text: str, name: str = "proxy.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None,
         **flags: str) -> Settings:
    """Settings as ``serve`` builds them: ``flags`` (``max_concurrency="5"``) parsed as
    the command line's ``--max-concurrency 5``, the file through ``LLM_PROXY_CONFIG``."""
    path = write(tmp_path, text)
    keys = tmp_path / "client-keys"
    keys.write_text("0" * 64 + "\n")
    environ = {"LLM_PROXY_CONFIG": path, "LLM_PROXY_CLIENT_KEYS_FILE": str(keys),
               **ENV, **(env or {})}
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    argv = [part for name, value in flags.items()
            for part in ("--" + name.replace("_", "-"), value)]
    return from_sources(parser.parse_args(argv), environ)


def test_the_example_file_loads_with_defaults_from_the_top_level(tmp_path: Path) -> None:
    s = load(tmp_path, TWO)
    assert [u.name for u in s.upstreams] == ["openai", "local-vllm", "anthropic"]
    openai_, vllm, anthropic_ = s.upstreams
    assert openai_.default and not vllm.default
    assert openai_.models == ("gpt-*", "o3*")
    assert openai_.max_concurrency == 3  # the top-level setting is every upstream's default
    assert vllm.max_concurrency == 64 and vllm.read_timeout == 600.0
    assert vllm.headers == (("x-org", "team-a"),)
    assert anthropic_.auth == "x-api-key" and anthropic_.routes == ("/v1/messages",)
    assert s.client_label_from == "header:x-team" and s.max_clients == 7
    assert s.upstream_specs == s.upstreams


def test_flags_and_variables_override_the_file(tmp_path: Path) -> None:
    s = load(tmp_path, TWO, env={"LLM_PROXY_MAX_CLIENTS": "9"}, max_concurrency="5")
    assert s.max_clients == 9
    assert s.max_concurrency == 5
    assert s.upstreams[0].max_concurrency == 5 and s.upstreams[1].max_concurrency == 64


def test_without_a_file_one_upstream_takes_every_model() -> None:
    s = Settings(upstream="http://h:1/v1", upstream_name="solo", max_concurrency=2)
    (spec,) = s.upstream_specs
    assert spec == UpstreamSpec(name="solo", url="http://h:1/v1", models=("*",), default=True,
                                max_concurrency=2)


BASE = """
[[upstream]]
name = "a"
url = "http://a:1/v1"
models = ["gpt-*"]
default = true
"""


@pytest.mark.parametrize(("text", "expected"), [
    ("[[upstream]\nname=", "not valid TOML"),
    ("max_concurrency = 2\n", "no [[upstream]] table"),
    ("upstream = 3\n", "'upstream' must be [[upstream]] tables"),
    ("bogus = 1\n" + BASE, "bogus: unknown setting"),
    ("upstream_name = 'x'\n" + BASE, "upstream_name: unknown setting (declare upstreams as"),
    ("max_concurrency = -1\n" + BASE, "max_concurrency: must be an integer >= 0"),
    ("max_concurrency = true\n" + BASE, "max_concurrency: not a number (got 'true')"),
    (BASE.replace('default = true', 'colour = "red"'), "upstream 'a': colour: unknown setting"),
    (BASE.replace('name = "a"\n', ''), "upstream #1: name: missing"),
    (BASE.replace('url = "http://a:1/v1"\n', ''), "upstream 'a': url: missing"),
    (BASE.replace('http://a:1/v1', 'ftp://a/v1'), "upstream 'a': url: must be an http(s) URL"),
    (BASE.replace('["gpt-*"]', '"gpt-*"'), "upstream 'a': models: must be a list"),
    (BASE + 'api_key_env = "TEST_UNSET_KEY_VAR"\n',
     "upstream 'a': api_key_env: environment variable TEST_UNSET_KEY_VAR is empty or unset"),
    (BASE + 'auth = "x-api-key"\n', "upstream 'a': auth: only used with api_key_env"),
    (BASE + 'api_key_env = "TEST_OPENAI_KEY"\nauth = "basic"\n', "upstream 'a': auth: must be one of"),
    (BASE + 'max_queue = true\n', "upstream 'a': max_queue: must be an integer"),
    (BASE + 'read_timeout = 0\n', "upstream 'a': read_timeout: must be a number of seconds > 0"),
    (BASE + 'headers = { Authorization = "Bearer x" }\n', "upstream 'a': headers: 'Authorization' cannot be set"),
    (BASE + 'headers = { X-A = "line\\nbreak" }\n', "upstream 'a': headers: the value of 'X-A'"),
    (BASE + 'headers = { X-Org = "one", x-org = "two" }\n',
     "upstream 'a': headers: 'x-org' is given twice (header names are one whatever their case)"),
    (BASE + 'headers = { "x-bad name" = "v" }\n', "upstream 'a': headers: 'x-bad name' is not a header name"),
    (BASE + 'routes = ["/chat"]\n', "upstream 'a': routes: must be a list of /v1 routes"),
    (BASE + BASE, "upstream 'a': name: two upstreams are named alike"),
    (BASE + BASE.replace('"a"', '"b"'), "upstream 'b': default: 'a' is already the default"),
    (BASE + BASE.replace('"a"', '"b"').replace("default = true", ""),
     "upstream 'b': models: 'gpt-*' can never match: upstream 'a' comes first"),
    (BASE.replace('["gpt-*"]', '["*"]') + BASE.replace('"a"', '"b"').replace(
        '["gpt-*"]', '["llama-3"]').replace("default = true", ""),
     "upstream 'b': models: 'llama-3' can never match"),
    (BASE + '[[upstream]]\nname = "b"\nurl = "http://b:1/v1"\n',
     "upstream 'b': models: missing: an upstream that is not the default"),
])  # fmt: skip
def test_every_bad_file_stops_start_up_with_one_line_naming_it(
        tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(SettingsError) as raised:
        load(tmp_path, text)
    message = str(raised.value)
    assert expected in message
    assert "\n" not in message
    assert message.startswith(f"config {tmp_path / 'proxy.toml'}")


def test_a_pattern_behind_a_route_limited_upstream_is_not_shadowed(tmp_path: Path) -> None:
    text = """
    [[upstream]]
    name = "anthropic"
    url = "http://a:1/v1"
    models = ["*"]
    routes = ["/v1/messages"]
    [[upstream]]
    name = "openai"
    url = "http://b:1/v1"
    models = ["gpt-*"]
    """
    assert len(load(tmp_path, text).upstreams) == 2


@pytest.mark.parametrize(("earlier", "later", "shadowed"), [
    ("*", "anything-*", True), ("gpt-*", "gpt-4o*", True), ("gpt-*", "gpt-4o", True),
    ("gpt-4?", "gpt-4o", True), ("gpt-*", "gp*", False), ("gpt-4o", "gpt-*", False),
    ("*-mini", "gpt-*-mini", False), ("qwen*", "qwen", True), ("o3*", "o1", False),
])  # fmt: skip
def test_shadowing(earlier: str, later: str, shadowed: bool) -> None:
    assert _shadowed(earlier, later) is shadowed


def test_config_and_single_upstream_flags_together_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"--upstream: cannot be combined with "
                       r"LLM_PROXY_CONFIG"):
        load(tmp_path, TWO, upstream="http://x:1/v1")
    with pytest.raises(SettingsError, match=r"LLM_PROXY_UPSTREAM_AUTH: cannot be combined"):
        load(tmp_path, TWO, env={"LLM_PROXY_UPSTREAM_AUTH": "x-api-key"})


def test_an_upstream_key_requires_client_keys(tmp_path: Path) -> None:
    path = write(tmp_path, TWO)
    with pytest.raises(SettingsError, match=r"--client-keys-file: required when an upstream "
                       r"holds a key \(upstream 'openai' has api_key_env"):
        from_sources(None, {"LLM_PROXY_CONFIG": path, **ENV})


def test_key_fingerprints_need_the_secret(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="client-label-from=key: needs the secret in "
                       "LLM_PROXY_FINGERPRINT_SECRET"):
        load(tmp_path, TWO, client_label_from="key")
    s = load(tmp_path, TWO, env={"LLM_PROXY_FINGERPRINT_SECRET": "s3"}, client_label_from="key")
    assert s.client_label_from == "key"
    with pytest.raises(SettingsError, match="must be 'header:NAME'"):
        load(tmp_path, TWO, client_label_from="cookie")


def test_routing_table_first_match_routes_default_and_none() -> None:
    specs = [
        UpstreamSpec("anthropic", "http://a/v1", models=("claude-*",), routes=("/v1/messages",)),
        UpstreamSpec("openai", "http://o/v1", models=("gpt-*", "o3*", "exact-one")),
        UpstreamSpec("vllm", "http://v/v1", models=("meta-llama/*",), default=True,
                     routes=("/v1/chat/completions", "/v1/completions", "/v1/models")),
    ]
    table = RoutingTable(specs, cache_size=2)
    chat, messages = "/v1/chat/completions", "/v1/messages"
    assert table.pick("claude-3-5", messages) == 0
    assert table.pick("claude-3-5", chat) == 2  # anthropic serves only /v1/messages: default
    assert table.pick("gpt-4o", chat) == 1
    assert table.pick("o3-mini", chat) == 1
    assert table.pick("exact-one", chat) == 1
    assert table.pick("exact-one-more", chat) == 2
    assert table.pick("GPT-4o", chat) == 2  # case-sensitive, like model names
    assert table.pick("meta-llama/Llama-3.1-8B", chat) == 2
    assert table.pick(None, chat) == 2
    assert table.pick(None, "/v1/models/{...}") == 2  # a sub-route of a listed route
    assert table.pick("llama", messages) is None  # the default does not serve it
    assert table.pick("gpt-4o", messages) == 1  # openai names no routes: it serves them all
    assert table.pick(None, "/v1/embeddings") is None
    for i in range(50):  # past the cache bound decisions still hold
        assert table.pick(f"gpt-{i}", chat) == 1
    no_default = RoutingTable(specs[:2])
    assert no_default.pick("llama", chat) is None and no_default.pick(None, chat) is None


def test_reload_reads_the_tables_and_names_changed_top_level_keys(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    s = load(tmp_path, TWO)
    (tmp_path / "proxy.toml").write_text(
        textwrap.dedent(TWO).replace("max_clients = 7", "max_clients = 8").replace(
            'models = ["meta-llama/*", "qwen*"]', 'models = ["mistral*"]'))
    monkeypatch.setattr("os.environ", {**os.environ, **ENV})
    specs = reload_specs(s)
    assert specs[1].models == ("mistral*",)
    assert "top-level settings max_clients differ" in caplog.text


@pytest.mark.parametrize(("line", "says"), [
    ("max_concurency = 5", "max_concurency: unknown setting (did you mean max_concurrency?)"),
    ('read_timeout = "abc"', "read_timeout"),
])
def test_reload_refuses_a_file_that_start_up_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, says: str) -> None:
    """A typo'd or mistyped top-level key stops start-up; a reload used to take the file
    (the typo unmentioned, the bad value a 'differ' warning), so the mistake waited for
    the next restart. It is refused now, and the running table stays."""
    s = load(tmp_path, TWO)
    (tmp_path / "proxy.toml").write_text(line + "\n" + textwrap.dedent(TWO))
    monkeypatch.setattr("os.environ", {**os.environ, **ENV})
    with pytest.raises(SettingsError, match=re.escape(says)):
        reload_specs(s)


def test_serve_refuses_a_bad_file_with_exit_2_and_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + BASE)
    done = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", path],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [f"llm-latency-proxy: error: config {path}: upstream 'a': name: two "
                     "upstreams are named alike; names are the 'upstream' label and must differ"]
