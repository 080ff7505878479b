"""Client keys in every header form SDKs use, and the one header the server-held key
goes upstream in (``--upstream-auth``): unit level, no server."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from proxy.auth import (
    CLIENT_KEY_HEADERS,
    KeyCheck,
    key_header,
    load_key_check,
    presented_key,
    upstream_header,
)
from proxy.config import Settings, single_spec
from proxy.config_values import SettingsError
from proxy.upstream_spec import UPSTREAM_AUTH_MODES

KEY = b"cli-0123456789abcdef"


def key_check(settings: Settings, env: Mapping[str, str], *,
              given_as: tuple[str, str] | None = None) -> KeyCheck | None:
    """:func:`load_key_check` as the app calls it."""
    return load_key_check(settings.checked_keys_file, env=env, given_as=given_as,
                          upstream_key_env=settings.upstream_api_key_env)


@pytest.mark.parametrize(("headers", "expected"), [
    ([(b"authorization", b"Bearer " + KEY)], KEY),  # OpenAI SDKs, recent Anthropic SDKs
    ([(b"authorization", b"bearer  " + KEY + b" ")], KEY),
    ([(b"x-api-key", KEY)], KEY),  # Anthropic's raw API, older SDKs
    ([(b"api-key", b" " + KEY)], KEY),  # Azure OpenAI
    ([(b"content-type", b"application/json"), (b"x-api-key", KEY)], KEY),
    ([], None),
    ([(b"authorization", b"Basic " + KEY)], None),
    ([(b"authorization", b"Bearer ")], None),
    ([(b"x-api-key", b"  ")], None),
    ([(b"api-key", b"")], None),
    ([(b"x-other-key", KEY)], None),
])
def test_presented_key_in_each_header_form(headers: list[tuple[bytes, bytes]],
                                           expected: bytes | None) -> None:
    assert presented_key(headers) == expected


@pytest.mark.parametrize("headers", [
    [(b"authorization", b"Bearer first"), (b"x-api-key", b"second"), (b"api-key", b"third")],
    [(b"api-key", b"third"), (b"x-api-key", b"second"), (b"authorization", b"Bearer first")],
])
def test_authorization_wins_whatever_the_header_order(headers: list[tuple[bytes, bytes]]) -> None:
    assert presented_key(headers) == b"first"
    without_bearer = [(n, v) for n, v in headers if n != b"authorization"]
    assert presented_key(without_bearer) == b"second"
    # A header without a usable key does not hide one in a later header.
    assert presented_key([(b"authorization", b"Basic x"), *without_bearer]) == b"second"


def test_every_header_a_key_is_read_from_is_one_the_proxy_strips() -> None:
    """In server-held key mode a client key must never reach the upstream: whatever
    header the check reads it from is in the set removed from the upstream request."""
    assert {b"authorization", b"x-api-key", b"api-key"} == CLIENT_KEY_HEADERS
    for name in (b"authorization", b"x-api-key", b"api-key", b"x-other-key", b"proxy-authorization"):
        value = b"Bearer " + KEY if name == b"authorization" else KEY
        read = presented_key([(name, value)]) is not None
        assert read == (name in CLIENT_KEY_HEADERS), name


@pytest.mark.parametrize(("mode", "header"), [
    ("bearer", (b"authorization", b"Bearer srv-key")),
    ("x-api-key", (b"x-api-key", b"srv-key")),
    ("api-key", (b"api-key", b"srv-key")),
])
def test_upstream_header_per_mode(mode: str, header: tuple[bytes, bytes]) -> None:
    assert upstream_header(mode, "srv-key") == header
    spec = single_spec(Settings(upstream_api_key_env="K", upstream_auth=mode))
    assert key_header(spec, {"K": " srv-key\n"}) == header
    # The server-held key goes out in a header the proxy first removes from the client's
    # request, so the upstream sees it exactly once.
    assert header[0] in CLIENT_KEY_HEADERS


def test_every_documented_mode_has_a_header() -> None:
    assert {upstream_header(m, "k")[0] for m in UPSTREAM_AUTH_MODES} == CLIENT_KEY_HEADERS
    with pytest.raises(ValueError, match="basic"):
        upstream_header("basic", "k")


def test_key_check_accepts_only_stored_keys() -> None:
    check = KeyCheck([hashlib.sha256(b"other").digest(), hashlib.sha256(KEY).digest()])
    assert check.accepts(KEY)
    assert not check.accepts(KEY + b"x")
    assert not check.accepts(b"")
    assert not check.accepts(None)
    assert key_header(single_spec(Settings(upstream_api_key_env="K")), {"K": "srv"}) == (
        b"authorization", b"Bearer srv")  # the default mode
    assert key_header(single_spec(Settings()), {"K": "srv"}) is None  # no key held


def keys_file(tmp_path: Path) -> str:
    path = tmp_path / "client-keys"
    path.write_text("# clients\nsha256:" + hashlib.sha256(KEY).hexdigest() + "\n")
    return str(path)


@pytest.mark.parametrize("mode", UPSTREAM_AUTH_MODES)
def test_load_key_check_sends_the_key_per_upstream_auth(
        mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_AUTH_UPSTREAM_KEY", " srv-key\n")  # a trailing newline from a file
    check = key_check(Settings(upstream_api_key_env="TEST_AUTH_UPSTREAM_KEY",
                                    upstream_auth=mode, client_keys_file=keys_file(tmp_path)), os.environ)
    assert check is not None
    assert check.accepts(KEY)


def test_no_key_check_without_a_server_held_key() -> None:
    assert key_check(Settings(), os.environ) is None


@pytest.mark.parametrize("key", ["srv\r\nx-injected: 1", "srv key", "srv-ключ", "   "])
def test_a_key_that_cannot_be_a_header_value_fails_at_start_up(
        key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_AUTH_UPSTREAM_KEY", key)
    settings = Settings(upstream_api_key_env="TEST_AUTH_UPSTREAM_KEY",
                        client_keys_file=keys_file(tmp_path))
    with pytest.raises(SettingsError) as info:
        key_check(settings, os.environ)
    message = str(info.value)
    assert "--upstream-api-key-env" in message and "TEST_AUTH_UPSTREAM_KEY" in message
    assert "\n" not in message and "srv" not in message  # never the key itself


def test_keys_file_errors_name_the_setting_as_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_AUTH_UPSTREAM_KEY", "srv")
    bad = tmp_path / "bad"
    bad.write_text("not-a-digest\n")
    settings = Settings(upstream_api_key_env="TEST_AUTH_UPSTREAM_KEY", client_keys_file=str(bad))
    with pytest.raises(SettingsError, match=r"^invalid setting --client-keys-file: line 1 "):
        key_check(settings, os.environ)
    named = ("LLM_PROXY_UPSTREAM_API_KEY_ENV", "LLM_PROXY_CLIENT_KEYS_FILE")
    with pytest.raises(SettingsError, match=r"^invalid setting LLM_PROXY_CLIENT_KEYS_FILE: line 1 "):
        key_check(settings, os.environ, given_as=named)
    bad.write_text("# only a comment\n")
    with pytest.raises(SettingsError, match="no keys"):
        key_check(settings, os.environ)
    with pytest.raises(SettingsError, match="cannot read"):
        key_check(Settings(upstream_api_key_env="TEST_AUTH_UPSTREAM_KEY",
                                client_keys_file=str(tmp_path)), os.environ)  # a directory
