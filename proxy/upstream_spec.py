"""One upstream as configured (:class:`UpstreamSpec`), and the config file's
``[[upstream]]`` tables that declare them.

Design: ``docs/design/relay-and-export.md``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.config_values import HEADER_NAME, SettingsError, parse_upstream_url

UPSTREAM_AUTH_MODES = ("bearer", "x-api-key", "api-key")

# Keys of an [[upstream]] table: name -> (kind, what the message says it must be).
_UPSTREAM_KEYS = {
    "name": "a non-empty string",
    "url": "an http(s) base URL with its version segment, e.g. https://api.openai.com/v1",
    "models": "a list of model names or shell-style patterns, e.g. [\"gpt-*\", \"o3*\"]",
    "routes": "a list of /v1 routes this upstream serves, e.g. [\"/v1/messages\"]",
    "api_key_env": "the name of an environment variable holding the upstream's key",
    "auth": "one of " + ", ".join(UPSTREAM_AUTH_MODES),
    "default": "true or false",
    "provider": "the gen_ai.provider.name on spans and OTLP metrics, e.g. \"vllm\"",
    "max_concurrency": "an integer >= 0 (0: unlimited)",
    "max_queue": "an integer >= 0",
    "max_connections": "an integer >= 1",
    "connect_timeout": "a number of seconds > 0",
    "read_timeout": "a number of seconds > 0",
    "write_timeout": "a number of seconds > 0",
    "keepalive_expiry": "a number of seconds > 0",
    "resend_on_reset": "true or false",
    "keep_warm": "a number of seconds >= 0 (0: off)",
    "headers": "a table of header names to values, e.g. { anthropic-version = \"2023-06-01\" }",
    "min_cacheable_tokens": "an integer >= 0 (tokens: the shortest prefix it caches)",
    "cache_granularity_tokens": "an integer >= 1 (tokens: the steps it caches in)",
}
# Keys whose absence means the top-level setting of the same purpose: key -> Settings field.
UPSTREAM_LIMIT_SETTINGS = {
    "max_concurrency": "max_concurrency",
    "max_queue": "max_queue",
    "max_connections": "max_upstream_connections",
    "connect_timeout": "connect_timeout",
    "read_timeout": "read_timeout",
    "write_timeout": "write_timeout",
    "keepalive_expiry": "upstream_keepalive_expiry",
    "resend_on_reset": "upstream_resend_on_reset",
    "keep_warm": "upstream_keep_warm",
}
# What the absence of each other key means; the settings reference shows it beside
# _UPSTREAM_KEYS' wording (docs/generate.py refuses a key that has neither).
UPSTREAM_KEY_DEFAULTS = {
    "name": "required",
    "url": "required",
    "models": "required, except on the default upstream, which then takes only the "
              "requests no other upstream's patterns match",
    "routes": "every route",
    "api_key_env": "none: the proxy sends this upstream no key of its own; the client's key "
                   "headers pass through to it unless some upstream has api_key_env, and then "
                   "they go to no upstream",
    "auth": "bearer (used only with api_key_env)",
    "default": "false",
    "provider": "from the URL's host for a known provider, else from the API",
    "headers": "none",
    "min_cacheable_tokens": "the provider's: 1024 on OpenAI's APIs, per model family on "
                            "Anthropic's (1024 to 4096) and for Gemini models (2048 for "
                            "gemini-2.5, 4096 for later ones)",
    "cache_granularity_tokens": "the provider's: 128 on OpenAI's APIs (1 from the GPT-5.6 "
                                "family on), 1 on Anthropic's",
}
# Headers the proxy owns: set through other settings, or meaningless to set per upstream.
_RESERVED_HEADERS = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
    "te", "trailer", "proxy-authorization", "proxy-connection", "authorization", "x-api-key",
    "api-key", "accept-encoding", "expect",
})  # fmt: skip
_HEADER_VALUE = re.compile(r"^[\x20-\x7e]*$")
_LABEL = re.compile(r"^[\x21-\x7e]{1,64}$")
_WILDCARD = re.compile(r"[*?\[]")  # what makes a model name a shell-style pattern
# A key the proxy writes into a header itself: visible ASCII only, so a stray newline in
# the environment variable can never start a second header line.
_KEY_VALUE = re.compile(r"^[\x21-\x7e]+$")


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """One upstream as configured (no live objects: those are
    :class:`proxy.upstream.LiveUpstream`)."""

    name: str
    url: str
    models: tuple[str, ...] = ("*",)
    routes: tuple[str, ...] = ()  # empty: every route
    api_key_env: str = ""
    auth: str = "bearer"
    default: bool = False
    max_concurrency: int = 0
    max_queue: int = 1000
    max_connections: int = 1000
    connect_timeout: float = 5.0
    read_timeout: float = 300.0
    write_timeout: float = 30.0
    keepalive_expiry: float = 4.0
    resend_on_reset: bool = True  # a POST reset unread is sent again (proxy.wire)
    keep_warm: float = 900.0  # seconds after the last request with one idle connection kept
    headers: tuple[tuple[str, str], ...] = ()
    provider: str = ""  # gen_ai.provider.name; empty: from the host, else from the API
    # The prompt-cache doctor (proxy.doctor.job); None: the provider's default per API
    min_cacheable_tokens: int | None = None
    cache_granularity_tokens: int | None = None

    def serves(self, route: str) -> bool:
        return not self.routes or any(route == r or route.startswith(r + "/") for r in self.routes)


def key_problem(var: str, env: Mapping[str, str]) -> str:
    """Why the key in environment variable ``var`` cannot be sent upstream, or ``""``."""
    key = env.get(var, "").strip()
    if not key:
        return f"environment variable {var} is empty or unset"
    if not _KEY_VALUE.match(key):
        return (f"environment variable {var} holds a space, control or non-ASCII character, "
                "which a header value cannot carry")
    return ""


# -- the tables ------------------------------------------------------------------------


def upstream_specs(path: str, doc: Mapping[str, Any], limits: Mapping[str, Any],
                   env: Mapping[str, str]) -> tuple[UpstreamSpec, ...]:
    """Every ``[[upstream]]`` of ``doc`` (the config file ``path``), validated; an absent
    limit or timeout is ``limits``' value for its key (the top-level settings, with the
    flags and variables applied: :func:`proxy.config.upstream_limits`)."""
    tables = doc.get("upstream")
    if tables is None:
        raise SettingsError(f"config {path}: no [[upstream]] table: declare at least one")
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables) or not tables:
        raise SettingsError(f"config {path}: 'upstream' must be [[upstream]] tables")
    specs: list[UpstreamSpec] = []
    for index, table in enumerate(tables, 1):
        specs.append(_spec(path, index, table, limits, env))
    _check_table(path, specs)
    return tuple(specs)


def _spec(path: str, index: int, table: Mapping[str, Any], limits: Mapping[str, Any],
          env: Mapping[str, str]) -> UpstreamSpec:
    raw_name = table.get("name")
    who = (f"upstream {raw_name!r}" if isinstance(raw_name, str) and raw_name
           else f"upstream #{index}")

    def fail(key: str, problem: str) -> SettingsError:
        return SettingsError(f"config {path}: {who}: {key}: {problem}")

    for key in table:
        if key not in _UPSTREAM_KEYS:
            raise fail(key, "unknown setting (known: " + ", ".join(_UPSTREAM_KEYS) + ")")

    def get(key: str, kind: type | tuple[type, ...], check: Callable[[Any], bool] = lambda v: True
            ) -> Any:
        value = table[key]
        if isinstance(value, bool) and kind is not bool:
            raise fail(key, f"must be {_UPSTREAM_KEYS[key]}")
        if not isinstance(value, kind) or not check(value):
            raise fail(key, f"must be {_UPSTREAM_KEYS[key]}, not {value!r}")
        return value

    if "name" not in table:
        raise fail("name", "missing: every upstream needs a name (its 'upstream' label value)")
    name = get("name", str, lambda v: bool(_LABEL.match(v)))
    if "url" not in table:
        raise fail("url", f"missing: must be {_UPSTREAM_KEYS['url']}")
    try:
        url = parse_upstream_url(get("url", str))
    except ValueError as exc:
        raise fail("url", str(exc)) from None
    values: dict[str, Any] = {"name": name, "url": url, **limits}
    if "models" in table:
        models = get("models", list, lambda v: all(isinstance(m, str) and m for m in v))
        values["models"] = tuple(models)
    else:
        values["models"] = ()
    if "routes" in table:
        routes = get("routes", list, lambda v: bool(v) and all(
            isinstance(r, str) and r.startswith("/v1/") for r in v))
        values["routes"] = tuple(r.rstrip("/") for r in routes)
    for key in ("default", "resend_on_reset"):
        if key in table:
            values[key] = get(key, bool)
    if "provider" in table:
        values["provider"] = get("provider", str, lambda v: bool(_LABEL.match(v)))
    if "auth" in table:
        values["auth"] = get("auth", str, lambda v: v in UPSTREAM_AUTH_MODES)
    if "api_key_env" in table:
        var = get("api_key_env", str, lambda v: bool(v.strip()))
        problem = key_problem(var, env)
        if problem:
            raise fail("api_key_env", problem)
        values["api_key_env"] = var
    elif "auth" in table:
        raise fail("auth", "only used with api_key_env (without it the client's key headers "
                   "pass through unchanged)")
    for key, minimum in (("max_concurrency", 0), ("max_queue", 0), ("max_connections", 1),
                         ("min_cacheable_tokens", 0), ("cache_granularity_tokens", 1)):
        if key in table:
            values[key] = get(key, int, _at_least(minimum))
    for key in ("connect_timeout", "read_timeout", "write_timeout", "keepalive_expiry"):
        if key in table:
            values[key] = float(get(key, (int, float), lambda v: 0 < v < float("inf")))
    if "keep_warm" in table:
        values["keep_warm"] = float(get("keep_warm", (int, float), lambda v: 0 <= v < float("inf")))
    if "headers" in table:
        headers = get("headers", dict)
        pairs: list[tuple[str, str]] = []
        for header, value in headers.items():
            if not HEADER_NAME.match(header):
                raise fail("headers", f"{header!r} is not a header name (letters, digits "
                           "and !#$%&'*+-.^_`|~, no space)")
            if header.lower() in _RESERVED_HEADERS:
                raise fail("headers", f"{header!r} cannot be set here (keys go through "
                           "api_key_env and auth; hop-by-hop and framing headers are the "
                           "proxy's)")
            if any(name == header.lower() for name, _ in pairs):
                raise fail("headers", f"{header!r} is given twice (header names are one "
                           "whatever their case)")
            if not isinstance(value, str) or not _HEADER_VALUE.match(value):
                raise fail("headers", f"the value of {header!r} must be a string of visible "
                           "ASCII characters")
            pairs.append((header.lower(), value))
        values["headers"] = tuple(pairs)
    spec = UpstreamSpec(**values)
    if not spec.models and not spec.default:
        raise fail("models", "missing: an upstream that is not the default needs model "
                   "patterns, or it never receives a request")
    return spec


def _at_least(minimum: int) -> Callable[[Any], bool]:
    return lambda v: bool(v >= minimum)


def _check_table(path: str, specs: Sequence[UpstreamSpec]) -> None:
    seen: set[str] = set()
    defaults = []
    for spec in specs:
        if spec.name in seen:
            raise SettingsError(f"config {path}: upstream {spec.name!r}: name: two upstreams "
                                "are named alike; names are the 'upstream' label and must differ")
        seen.add(spec.name)
        if spec.default:
            defaults.append(spec.name)
    if len(defaults) > 1:
        raise SettingsError(f"config {path}: upstream {defaults[1]!r}: default: "
                            f"{defaults[0]!r} is already the default; only one may be")
    for later_index, later in enumerate(specs):
        for pattern in later.models:
            for earlier in specs[:later_index]:
                if not _covers_routes(earlier, later):
                    continue
                catcher = next((p for p in earlier.models if _shadowed(p, pattern)), None)
                if catcher is not None:
                    raise SettingsError(
                        f"config {path}: upstream {later.name!r}: models: {pattern!r} can never "
                        f"match: upstream {earlier.name!r} comes first and its pattern "
                        f"{catcher!r} catches every model it would")


def _covers_routes(earlier: UpstreamSpec, later: UpstreamSpec) -> bool:
    """Whether ``earlier`` serves every route ``later`` serves."""
    if not earlier.routes:
        return True
    if not later.routes:
        return False
    return all(earlier.serves(r) for r in later.routes)


def is_pattern(model: str) -> bool:
    """Whether ``model`` is a shell-style pattern rather than an exact name."""
    return _WILDCARD.search(model) is not None


def _shadowed(earlier: str, later: str) -> bool:
    """True when every model ``later`` matches is matched by ``earlier`` already.

    Exact for the shapes people write: ``*`` catches everything; ``prefix*`` (one
    trailing star, no other wildcard) catches every pattern whose literal prefix starts
    with ``prefix``; an exact name is caught by any pattern that matches it. Other
    pairs (two patterns with inner wildcards) are not decided and never refused.
    """
    if not is_pattern(later):
        return fnmatch.fnmatchcase(later, earlier)
    if earlier.endswith("*") and not is_pattern(earlier[:-1]):
        return _WILDCARD.split(later, maxsplit=1)[0].startswith(earlier[:-1])  # its literal prefix
    return False
