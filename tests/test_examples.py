"""The example config files (``examples/*.toml``) load with the proxy's own loader.

Every file goes through :func:`proxy.config.from_sources` exactly as ``serve --config``
reads it, with a made-up value in each key variable it names and a client keys file, so
an example that drifts from the loader (a renamed key, a shadowed pattern, a setting
that no longer exists) fails here rather than for the user who copies it. Lines
commented out as alternatives (``# client_allowlist = ...``) are loaded uncommented too.
``load_config`` is shared with ``tests/test_kubernetes.py``, whose overlay holds a
``proxy.toml`` of its own.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

from proxy.config import Settings, from_sources
from proxy.config_values import SettingsError
from proxy.routing import RoutingTable

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def key_variables(path: Path) -> dict[str, str]:
    """A made-up value for every ``api_key_env`` the file names."""
    doc = tomllib.loads(path.read_text())
    return {
        t["api_key_env"]: f"test-key-{i}"
        for i, t in enumerate(doc.get("upstream", []))
        if "api_key_env" in t
    }


def load_config(path: Path, tmp: Path, environ: Mapping[str, str] | None = None) -> Settings:
    """``path`` loaded as ``serve`` would with ``LLM_PROXY_CONFIG=path``, the key
    variables set and a client keys file present; ``environ`` adds or overrides."""
    keys_file = tmp / "client-keys.sha256"
    keys_file.write_text(hashlib.sha256(b"a client key").hexdigest() + "\n")
    env = {
        "LLM_PROXY_CONFIG": str(path),
        "LLM_PROXY_CLIENT_KEYS_FILE": str(keys_file),
        **key_variables(path),
        **(environ or {}),
    }
    return from_sources(None, env)


def routed(settings: Settings, model: str | None, route: str = CHAT) -> str | None:
    """The name of the upstream that takes ``model`` on ``route`` (None: 404)."""
    index = RoutingTable(settings.upstreams).pick(model, route)
    return None if index is None else settings.upstreams[index].name


def test_there_are_examples() -> None:
    assert ROOT / "examples" / "proxy.toml" in EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads(path: Path, tmp_path: Path) -> None:
    settings = load_config(path, tmp_path)
    assert settings.config == str(path)
    assert settings.upstreams, "an example declares at least one upstream"
    assert len({u.name for u in settings.upstreams}) == len(settings.upstreams)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_commented_alternatives_load(path: Path, tmp_path: Path) -> None:
    """A setting shown commented out (``# key = value`` at the start of a line) is valid
    when uncommented."""
    text = path.read_text()
    commented = re.compile(r"^# ([a-z_]+ = .+)$", re.MULTILINE)
    if not commented.search(text):
        pytest.skip("no commented-out setting")
    copy = tmp_path / path.name
    copy.write_text(commented.sub(r"\1", text))
    original, uncommented = load_config(path, tmp_path), load_config(copy, tmp_path)
    for line in commented.findall(text):
        key = line.split(" = ")[0]
        if hasattr(original, key):  # a top-level setting (an upstream's is checked by loading)
            assert getattr(uncommented, key) != getattr(original, key), key


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_unset_key_variable_is_refused(path: Path, tmp_path: Path) -> None:
    """The loader above is the real one: without a key variable the file is refused,
    naming the variable."""
    names = key_variables(path)
    if not names:
        pytest.skip("no upstream holds a key")
    missing = next(iter(names))
    with pytest.raises(SettingsError, match=f"api_key_env: environment variable {missing} "):
        load_config(path, tmp_path, {missing: ""})


def test_proxy_toml_routes_and_settings(tmp_path: Path) -> None:
    """examples/proxy.toml does what its comments say."""
    s = load_config(ROOT / "examples" / "proxy.toml", tmp_path)
    assert [u.name for u in s.upstreams] == ["openai", "anthropic", "vllm"]
    openai, anthropic, vllm = s.upstreams
    assert s.client_label_from == "header:x-team" and s.max_clients == 50
    assert s.client_allowlist == ()  # commented out
    # OpenAI: the default, gpt-* and o-series, the key as a bearer token.
    for model in ("gpt-4o", "gpt-4.1-mini", "o1", "o3-mini", "o4-mini"):
        assert routed(s, model) == "openai", model
    assert routed(s, "some-unknown-model") == routed(s, None) == "openai"
    assert openai.default and openai.auth == "bearer" and openai.api_key_env
    assert openai.read_timeout == 600 and vllm.read_timeout == s.read_timeout == 300
    # Anthropic: claude-* on the Messages API only, x-api-key and its version header.
    assert routed(s, "claude-sonnet-4-5", MESSAGES) == "anthropic"
    assert routed(s, "claude-sonnet-4-5", MESSAGES + "/count_tokens") == "anthropic"
    assert routed(s, "claude-sonnet-4-5", CHAT) == "openai"  # not its route: the default
    assert anthropic.auth == "x-api-key" and anthropic.api_key_env
    assert ("anthropic-version", "2023-06-01") in anthropic.headers
    # vLLM: Llama and Qwen, its own limit and provider, no key held.
    for model in ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"):
        assert routed(s, model) == "vllm", model
        assert routed(s, model, MESSAGES) == "vllm", model
    assert vllm.provider == "vllm" and not vllm.api_key_env
    assert (vllm.max_concurrency, vllm.max_queue) == (32, 200)
    assert openai.max_concurrency == anthropic.max_concurrency == 0
    assert (vllm.min_cacheable_tokens, vllm.cache_granularity_tokens) == (16, 16)
    assert openai.min_cacheable_tokens is None  # the provider's default per API and model
