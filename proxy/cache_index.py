"""The config file's ``[cache-index]`` table: where the prompt-cache doctor's shared index
lives, and the secret every replica hashes prompts with.

Without the table each process keeps its own index (:class:`~proxy.diagnosis.prefix_index.LruPrefixIndex`)
and hashes with a random secret of its own. Behind a load balancer, and with ``--workers``,
that index sees only the requests its process served, so it finds a repeat only when the
earlier request landed on the same process. With the table, every process exchanges with
one Redis or Valkey (:mod:`proxy.prefix_store`), so a repeat is found whichever process
served the earlier request, and the digests must then be the same everywhere: they are
keyed with :data:`PREFIX_SECRET_ENV`, which every replica is given, as the client
fingerprint's secret is. The store only ever holds keyed 8-byte digests and times.

Like an ``[[upstream]]`` table, the table is checked before the proxy listens, and a
problem is one line naming the file and the key. The store itself is not contacted at
start-up: a store that is down must not keep the proxy from relaying (it answers
requests and counts the ones it could not check, :mod:`proxy.prefix_check`). The table is
read at start only; ``SIGHUP`` does not re-read it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from proxy.config_values import SettingsError

CACHE_INDEX_TABLE = "cache-index"
PREFIX_SECRET_ENV = "LLM_PROXY_PREFIX_SECRET"
MIN_SECRET_BYTES = 16
DEFAULT_KEY_PREFIX = "llm-proxy:prefix:"
DEFAULT_TIMEOUT_MS = 50
DEFAULT_RETRY_MS = 1000
URL_SCHEMES = ("redis", "rediss", "unix")

# Keys of the table -> what the message says each must be.
CACHE_INDEX_KEYS = {
    "url": "a redis://HOST:PORT/DB, rediss:// (TLS) or unix:///PATH URL without credentials, "
           "e.g. redis://redis:6379/0",
    "username": "a non-empty string: the store's ACL user",
    "password_env": "the name of an environment variable holding the store's password",
    "key_prefix": "a non-empty string of at most 64 characters, prepended to every key",
    "timeout_ms": "an integer number of milliseconds, >= 1 and <= 10000",
    "retry_ms": "an integer number of milliseconds, >= 1 and <= 600000",
}
# What the absence of each key means (the settings reference shows it).
CACHE_INDEX_DEFAULTS = {
    "url": "required",
    "username": "none: the default user",
    "password_env": "none: the store takes no password",
    "key_prefix": f"'{DEFAULT_KEY_PREFIX}'",
    "timeout_ms": f"{DEFAULT_TIMEOUT_MS}: a request whose exchange (connecting included) takes "
                  "longer is counted as unchecked; a prompt of more than 1024 keys (about "
                  "128 KiB) is allowed 10 us more per key, for the store's own time per key",
    "retry_ms": f"{DEFAULT_RETRY_MS}: after a failed exchange the store is not asked again for "
                "this long (requests meanwhile are counted as unchecked), then by one request "
                "at a time; each failed retry doubles the pause, up to 30 s",
}


@dataclass(frozen=True, slots=True)
class CacheIndexSpec:
    """The shared index as configured (no secret here: the password and the prefix secret
    stay in the environment, named or fixed, and are read when the index is built)."""

    url: str
    username: str = ""
    password_env: str = ""
    key_prefix: str = DEFAULT_KEY_PREFIX
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000
    retry_s: float = DEFAULT_RETRY_MS / 1000


def parse_store_url(raw: str) -> str:
    """A store URL: redis://, rediss:// or unix://, without user info (the password goes
    in an environment variable named by ``password_env``, the user in ``username``)."""
    parts = urlsplit(raw.strip())
    if parts.scheme not in URL_SCHEMES:
        raise ValueError("must start with redis://, rediss:// or unix://")
    if "@" in parts.netloc:
        raise ValueError("must not carry credentials (user:password@host): put the password "
                         "in an environment variable named by password_env, the user in "
                         "username")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("a unix:// URL needs the socket's path, e.g. unix:///run/redis.sock")
    elif not parts.hostname:
        raise ValueError("needs a host, e.g. redis://redis:6379/0")
    _ = parts.port  # raises ValueError for a bad port
    return raw.strip()


def cache_index_spec(path: str, doc: Mapping[str, Any],
                     environ: Mapping[str, str] | None = None) -> CacheIndexSpec | None:
    """The ``[cache-index]`` table of config file ``path`` (parsed as ``doc``), checked;
    None without one. The prefix secret and the password variable are checked here too,
    so that a replica missing either does not start."""
    table = doc.get(CACHE_INDEX_TABLE)
    if table is None:
        return None
    env = os.environ if environ is None else environ
    where = f"config {path}: [{CACHE_INDEX_TABLE}]"
    if not isinstance(table, dict):
        raise SettingsError(f"{where}: must be a table ([{CACHE_INDEX_TABLE}] with url = ...)")

    def fail(key: str, problem: str) -> SettingsError:
        return SettingsError(f"{where}: {key}: {problem}")

    for key in table:
        if key not in CACHE_INDEX_KEYS:
            raise fail(key, "unknown setting (known: " + ", ".join(CACHE_INDEX_KEYS) + ")")

    def get(key: str, kind: type) -> Any:
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise fail(key, f"must be {CACHE_INDEX_KEYS[key]}, not {value!r}")
        return value

    if "url" not in table:
        raise fail("url", f"missing: must be {CACHE_INDEX_KEYS['url']}")
    try:
        url = parse_store_url(get("url", str))
    except ValueError as exc:
        raise fail("url", str(exc)) from None
    values: dict[str, Any] = {"url": url}
    for key, upper in (("username", 256), ("key_prefix", 64)):
        if key in table:
            value = get(key, str)
            if not value.strip() or len(value) > upper or not value.isprintable():
                raise fail(key, f"must be {CACHE_INDEX_KEYS[key]}, not {value!r}")
            values[key] = value
    if "password_env" in table:
        var = get("password_env", str)
        if not var.strip():
            raise fail("password_env", f"must be {CACHE_INDEX_KEYS['password_env']}")
        if not env.get(var, ""):
            raise fail("password_env", f"environment variable {var} is empty or unset")
        values["password_env"] = var
    for key, field, upper in (("timeout_ms", "timeout_s", 10_000), ("retry_ms", "retry_s", 600_000)):
        if key in table:
            ms = get(key, int)
            if not 1 <= ms <= upper:
                raise fail(key, f"must be {CACHE_INDEX_KEYS[key]}, not {ms!r}")
            values[field] = ms / 1000
    if importlib.util.find_spec("redis") is None:
        raise SettingsError(f"{where}: the shared index needs redis-py: pip install "
                            "'llm-latency-proxy[cache-index]'")
    secret = env.get(PREFIX_SECRET_ENV, "").strip()
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise SettingsError(
            f"{where}: a shared index needs the secret its prompt digests are keyed with in "
            f"{PREFIX_SECRET_ENV} (at least {MIN_SECRET_BYTES} bytes, the same on every "
            "replica, e.g. from `openssl rand -hex 32`), "
            + ("which is shorter" if secret else "which is empty or unset"))
    return CacheIndexSpec(**values)


def prefix_secret(environ: Mapping[str, str] | None = None) -> bytes:
    """The key of every prompt digest when the index is shared: derived from
    :data:`PREFIX_SECRET_ENV` (any length from :data:`MIN_SECRET_BYTES` up; the hash
    takes 16 to 64 bytes), so every replica given the same secret hashes alike."""
    env = os.environ if environ is None else environ
    raw = env.get(PREFIX_SECRET_ENV, "").strip().encode()
    if len(raw) < MIN_SECRET_BYTES:  # cache_index_spec refuses this at start-up
        raise ValueError(f"{PREFIX_SECRET_ENV} must hold at least {MIN_SECRET_BYTES} bytes")
    return hashlib.blake2b(raw, digest_size=32, person=b"prefix.secret").digest()
