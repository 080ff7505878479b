"""Settings: one frozen object from flags, ``LLM_PROXY_*`` variables and a TOML config
file (``--config``), validated at start-up. Precedence: flag, then environment, then the
file's top-level keys, then default; the file's ``[[upstream]]`` tables declare several
upstreams (:mod:`proxy.upstream_spec`) and replace the single-upstream options.

Design: ``docs/design/serve.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import tomllib
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import urlsplit

from proxy.auth import CLIENT_KEY_HEADERS
from proxy.config_values import SettingsError
from proxy.deprecated import NewName, RenamedFlag, RenamedSwitch, warn_renamed
from proxy.doctor.index import DEFAULT_MAX_BYTES
from proxy.doctor.shared_index import CacheIndexSpec, cache_index_spec
from proxy.options import (
    BY_NAME,
    BY_OLD,
    OPTIONS,
    SINGLE_UPSTREAM_OPTIONS,
    Option,
    file_key,
    grouped,
)
from proxy.upstream_spec import UPSTREAM_LIMIT_SETTINGS, UpstreamSpec, upstream_specs

log = logging.getLogger("proxy")

# Bucket edges where users set targets (docs/definitions.md, "Labels").
TTFT_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0,
    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
# Bucket edges the shipped rules and alerts select (prometheus/rules: the TTFT SLO's
# target, the TTFT alerts' and the ITL alert's thresholds), per bucket setting: a layout
# without one makes them read wrong (the SLO would count every stream a miss).
RULE_EDGES: dict[str, tuple[tuple[float, str], ...]] = {
    "ttft_buckets": ((2.0, "the TTFT SLO, which would count every stream a miss"),
                     (5.0, "the TTFT p99 alert")),
    "itl_buckets": ((0.2, "the ITL p99 alert"),),
}
DURATION_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
)  # fmt: skip
QUEUE_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
OVERHEAD_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 1.0,
)  # fmt: skip
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(19))  # 1 .. 262144


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the proxy needs to know, resolved once before it listens."""

    upstream: str = "http://127.0.0.1:8000/v1"
    upstream_name: str = ""
    host: str = "127.0.0.1"
    port: int = 8080
    metrics_host: str = ""
    metrics_port: int = 0
    max_concurrency: int = 0
    max_queue: int = 1000
    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    max_upstream_connections: int = 1000
    upstream_keepalive_expiry: float = 4.0
    upstream_resend_on_reset: bool = True
    upstream_keep_warm: float = 900.0
    connect_timeout: float = 5.0
    read_timeout: float = 300.0
    write_timeout: float = 30.0
    body_timeout: float = 60.0
    client_write_timeout: float = 60.0
    inject_usage: bool = True
    measure: bool = True
    log_requests: str = ""
    log_requests_buffer: int = 10_000
    max_models: int = 100
    model_allowlist: tuple[str, ...] = ()
    ttft_buckets: tuple[float, ...] = TTFT_BUCKETS
    itl_buckets: tuple[float, ...] = ITL_BUCKETS
    duration_buckets: tuple[float, ...] = DURATION_BUCKETS
    token_buckets: tuple[float, ...] = TOKEN_BUCKETS
    workers: int = 1
    graceful_timeout: float = 30.0
    upstream_api_key_env: str = ""
    upstream_auth: str = "bearer"
    client_keys_file: str = ""
    secret_headers: tuple[str, ...] = ()
    access_log: bool = False
    ui: bool = True
    otlp_endpoint: str = ""
    propagate_trace: bool = True
    otlp_metrics: bool = False
    metrics_linger: int = 0
    config: str = ""
    client_label_from: str = ""
    max_clients: int = 50
    client_allowlist: tuple[str, ...] = ()
    prefix_doctor: bool = True
    prefix_window: float = 300.0
    prefix_index_bytes: int = DEFAULT_MAX_BYTES
    workload_file: str = ""
    workload_block_size: int = 512
    workload_rotate_bytes: int = 0
    workload_rotate_seconds: float = 0.0
    workload_client: bool = False
    # From the config file's [[upstream]] tables (not an option): empty without a file.
    upstreams: tuple[UpstreamSpec, ...] = ()
    # From the config file's [cache-index] table (proxy.doctor.shared_index): None without one,
    # and the prompt-cache doctor's index is then per process.
    cache_index: CacheIndexSpec | None = None

    @property
    def upstream_label(self) -> str:
        """The ``upstream`` label value: the configured name, else the upstream's host."""
        if self.upstream_name:
            return self.upstream_name
        parts = urlsplit(self.upstream)
        return parts.netloc.rsplit("@", 1)[-1] or "upstream"

    @property
    def holds_upstream_key(self) -> bool:
        """The proxy sends a key of its own to some upstream: clients must then present
        one of the proxy's keys (``--client-keys-file``)."""
        return bool(self.upstream_api_key_env) or any(u.api_key_env for u in self.upstreams)

    @property
    def checked_keys_file(self) -> str | None:
        """The client keys file the proxy checks keys against, None when it checks none."""
        return self.client_keys_file if self.holds_upstream_key else None

    @property
    def default_url(self) -> str:
        """The default upstream's URL (else the first's): where a request that was not
        routed would have gone, for telemetry attributes set before routing."""
        specs = self.upstream_specs
        return next((u.url for u in specs if u.default), specs[0].url)

    @property
    def upstream_specs(self) -> tuple[UpstreamSpec, ...]:
        """Every upstream: the config file's, else the one the single-upstream flags give."""
        if self.upstreams:
            return self.upstreams
        return (single_spec(self),)


def redact(text: str) -> str:
    """``text`` with the user info of any URL in it masked as ``***@``: never printed."""
    return re.sub(r"//[^/\s]*@", "//***@", text)


_FIELDS = {f.name for f in fields(Settings)}
assert all(o.name in _FIELDS for o in OPTIONS)


def shown_default(opt: Option) -> str:
    """``opt``'s default as ``--help`` shows it (the settings reference shows the same)."""
    default = getattr(Settings(), opt.name)
    text = ",".join(str(v) for v in default) if isinstance(default, tuple) else str(default)
    assert text or opt.unset, f"{opt.flag} has an empty default: say what its absence means"
    return text or opt.unset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every option as a flag, in its group; the default stays None so env can
    fill in."""
    for group, options in grouped():
        section = parser.add_argument_group(group.value)
        for opt in options:
            help_text = f"{opt.help} [env {opt.env}; default: {shown_default(opt)}]"
            if opt.flag_only_true:
                section.add_argument(opt.flag, dest=opt.name, default=None,
                                     action=argparse.BooleanOptionalAction, help=help_text)
            else:
                section.add_argument(opt.flag, dest=opt.name, default=None, metavar=opt.metavar,
                                     help=help_text, action=NewName if opt.old else "store")
            if opt.old:
                section.add_argument(opt.old_flag, dest=opt.name, default=None, new=opt.flag,
                                     action=RenamedSwitch if opt.flag_only_true else RenamedFlag)


def process_env() -> MutableMapping[str, str]:
    """The process environment: this module is the one in ``proxy/`` that reads it
    (tests/test_house.py checks). Each entry point takes it from here once and hands
    every part it builds the values, or the mapping, it reads; ``serve``'s supervisor
    writes its workers' variables into it."""
    return os.environ


def given_as(name: str, args: argparse.Namespace | None = None,
             environ: Mapping[str, str] | None = None) -> str:
    """How the operator gave setting ``name``: its flag, else its environment variable
    when that is set, else (not given at all) its flag. Error messages use it, so that
    they name what the operator has to change."""
    opt = BY_NAME[name]
    env = process_env() if environ is None else environ
    if args is not None and getattr(args, name, None) is not None:
        return opt.flag
    if opt.env in env:
        return opt.env
    if opt.old and opt.old_env in env:
        return opt.old_env
    return opt.flag


FINGERPRINT_SECRET_ENV = "LLM_PROXY_FINGERPRINT_SECRET"


def from_sources(args: argparse.Namespace | None = None,
                 environ: Mapping[str, str] | None = None) -> Settings:
    """Build and validate settings: flag, then ``LLM_PROXY_*`` variable, then the config
    file's top-level key, then default; then the file's ``[[upstream]]`` tables.

    An invalid value raises :class:`SettingsError` naming the flag when the flag was
    used, the variable (and its flag) when the variable was, or the file and key, with
    the value as given.
    """
    env = process_env() if environ is None else environ
    raw_values: dict[str, tuple[Any, str]] = {}  # option -> (raw value, where it came from)
    for opt in OPTIONS:
        raw = getattr(args, opt.name, None) if args is not None else None
        if raw is not None:
            raw_values[opt.name] = (raw, opt.flag)
        elif opt.env in env:
            raw_values[opt.name] = (env[opt.env], opt.env)
        elif opt.old and opt.old_env in env:
            warn_renamed(opt.old_env, opt.env)
            raw_values[opt.name] = (env[opt.old_env], opt.old_env)
    values = {name: _parse_option(BY_NAME[name], raw, where)
              for name, (raw, where) in raw_values.items()}
    path = values.get("config", "")
    doc: dict[str, Any] = {}
    if path:
        given = [raw_values[n][1] for n in SINGLE_UPSTREAM_OPTIONS if n in raw_values]
        if given:
            raise SettingsError(f"invalid setting {given[0]}: cannot be combined with "
                                f"{raw_values['config'][1]} {path}: its [[upstream]] tables "
                                "declare the upstreams")
        doc = read_file(path)
        for key, value in top_level(path, doc).items():
            values.setdefault(key, value)
    settings = Settings(**values)
    if path:
        settings = replace(settings, upstreams=upstream_specs(path, doc, upstream_limits(settings),
                                                              env),
                           cache_index=cache_index_spec(path, doc, env))
    _check_combinations(settings, lambda name: given_as(name, args, env), env)
    return settings


def _closest_key(key: str) -> str:
    """`` (did you mean NAME?)`` for a top-level config key that is a typo of a setting's
    name, or its flag or variable written as a key; there are too many settings to list
    them all, as an ``[[upstream]]`` table's few keys are."""
    import difflib

    names = [o.name for o in OPTIONS if o.name != "config" and o.name not in SINGLE_UPSTREAM_OPTIONS]
    plain = key.lower().lstrip("-").replace("-", "_").removeprefix("llm_proxy_")
    close = difflib.get_close_matches(plain, [*names, "upstream"], n=1, cutoff=0.75)
    if close == ["upstream"]:
        return " (declare upstreams as [[upstream]] tables)"
    if close:
        return f" (did you mean {close[0]}?)"
    return " (a key is a flag's name without -- and with _ for -, e.g. max_concurrency)"


def toml_value(opt: Option, raw: Any, where: str) -> Any:
    """A config file's value for ``opt``, parsed as its flag would be; a bad one raises
    :class:`SettingsError` naming ``where`` (the file and key)."""
    if isinstance(raw, bool):  # as text, so a number option refuses it like a flag would
        raw = "true" if raw else "false"
    elif isinstance(raw, list):
        raw = ",".join(str(v) for v in raw)
    return _parse_option(opt, raw, where, file=True)


def _parse_option(opt: Option, raw: Any, where: str, *, file: bool = False) -> Any:
    if isinstance(raw, bool):
        return raw
    try:
        return opt.parse(str(raw))
    except ValueError as exc:
        detail = str(exc) or "invalid value"
        if detail.startswith(("invalid literal", "could not convert")):
            detail = "not a number"
        shown = redact(repr(str(raw)))
        if file:
            raise SettingsError(f"{where}: {detail} (got {shown})") from None
        also = f" ({opt.flag})" if where != opt.flag else ""
        raise SettingsError(f"invalid setting {where}={shown}{also}: {detail}") from None


# -- the config file and its upstreams -------------------------------------------------


def read_file(path: str) -> dict[str, Any]:
    """The parsed TOML document; a file that cannot be read or parsed is one line."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise SettingsError(f"config {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config {path}: not valid TOML: {exc}") from None


def upstream_limits(settings: Settings) -> dict[str, Any]:
    """What an ``[[upstream]]`` table's absent limits and timeouts default to: the
    top-level settings of the same purpose, by table key."""
    return {key: getattr(settings, name) for key, name in UPSTREAM_LIMIT_SETTINGS.items()}


def single_spec(settings: Settings) -> UpstreamSpec:
    """The one upstream the single-upstream flags describe: every model, the default."""
    return UpstreamSpec(
        name=settings.upstream_label, url=settings.upstream, models=("*",), default=True,
        api_key_env=settings.upstream_api_key_env, auth=settings.upstream_auth,
        **upstream_limits(settings))


def top_level(path: str, doc: Mapping[str, Any], *, warn: bool = True) -> dict[str, Any]:
    """The config file's top-level settings, parsed, by option name (an old name read as
    its new one, with a warning when ``warn``); :class:`SettingsError` for a key that is
    no setting or a value of the wrong kind, whether or not a flag overrides it."""
    values = {}
    for key, raw in doc.items():
        if key in ("upstream", "cache-index"):
            continue
        found = BY_NAME.get(key)
        if found is None and key in BY_OLD:
            found = BY_OLD[key]
            if warn:
                warn_renamed(f"config {path}: {key}", found.name)
            key = found.name
        if found is None or not file_key(found):
            hint = (" (declare upstreams as [[upstream]] tables)"
                    if key in SINGLE_UPSTREAM_OPTIONS else _closest_key(key))
            raise SettingsError(f"config {path}: {key}: unknown setting{hint}")
        values[key] = toml_value(found, raw, f"config {path}: {key}")
    return values


def reload_specs(settings: Settings, environ: Mapping[str, str] | None = None
                 ) -> tuple[UpstreamSpec, ...]:
    """The ``[[upstream]]`` tables of ``settings.config`` as the file says now (SIGHUP),
    or :class:`SettingsError` when they cannot replace the running ones.

    Per-upstream defaults come from the running settings; top-level keys are read at
    start only, and one that changed is named in a warning rather than half-applied (so
    is a changed ``[cache-index]`` table); a file that start-up would refuse (an unknown
    key, a value of the wrong kind) is refused. Client keys are set up at start too: a
    file that gives an upstream a key when the running proxy checks none is refused.
    """
    path = settings.config
    doc = read_file(path)
    env = process_env() if environ is None else environ
    top = top_level(path, doc, warn=False)
    specs = upstream_specs(path, doc, upstream_limits(settings), env)
    if any(s.api_key_env for s in specs) and not settings.holds_upstream_key:
        raise SettingsError(f"config {path}: an upstream now holds a key (api_key_env) but "
                            "client keys were not set up at start (--client-keys-file): "
                            "restart to add one")
    changed = [key for key, value in top.items() if value != getattr(settings, key)]
    if cache_index_spec(path, doc, env) != settings.cache_index:
        changed.append("[cache-index]")
    if changed:
        log.warning(
            "config %s: top-level settings %s differ from the running ones (or a flag or "
            "variable overrides them); they are read at start only: restart to apply",
            path, ", ".join(changed))
    return specs


# Request headers that carry a secret whatever the settings say (the client key's, and the
# credentials of a proxy or a session): a client label read from one would write the
# secret into every metric and log line.
_SECRET_HEADERS = frozenset(
    {name.decode() for name in CLIENT_KEY_HEADERS} | {"proxy-authorization", "cookie"})


def _check_combinations(s: Settings, name: Callable[[str], str],
                        env: Mapping[str, str]) -> None:
    header = s.client_label_from.partition("header:")[2]
    if header and header in _SECRET_HEADERS | {h.lower() for h in s.secret_headers}:
        raise SettingsError(f"invalid setting {name('client_label_from')}=header:{header}: that "
                            "header carries a secret, and a label's value is written to every "
                            "metric and log line; use 'key' (a keyed fingerprint of the "
                            "client's key) or a header that names the client (header:X-Team)")
    if s.client_label_from == "key" and not env.get(FINGERPRINT_SECRET_ENV, "").strip():
        raise SettingsError(f"invalid setting {name('client_label_from')}=key: needs the "
                            f"secret in {FINGERPRINT_SECRET_ENV} (the same on every replica), "
                            "so that a key's label is a keyed fingerprint, never a plain hash")
    if s.upstream_api_key_env and not env.get(s.upstream_api_key_env, "").strip():
        raise SettingsError(f"invalid setting {name('upstream_api_key_env')}: environment "
                            f"variable {s.upstream_api_key_env} is empty or unset")
    if s.holds_upstream_key:
        if not s.client_keys_file:
            held = next((u for u in s.upstreams if u.api_key_env), None)
            why = (f"when an upstream holds a key (upstream {held.name!r} has api_key_env "
                   f"in {s.config})" if held is not None else
                   f"with {name('upstream_api_key_env')}")
            raise SettingsError(f"invalid setting {name('client_keys_file')}: required {why}")
        if not os.path.isfile(s.client_keys_file):
            raise SettingsError(f"invalid setting {name('client_keys_file')}: no such file "
                                f"{s.client_keys_file!r}")
    if not s.upstream_api_key_env and s.upstream_auth != "bearer":
        # Without a server-held key the client's own headers go upstream unchanged, so
        # the setting would silently do nothing.
        raise SettingsError(f"invalid setting {name('upstream_auth')}: only used with "
                            f"{name('upstream_api_key_env')} (without it the client's key "
                            "headers pass through unchanged)")
    off = name("prefix_doctor")  # how the operator turned the doctor off
    off = "--no-" + off[2:] if off.startswith("--") else off + "=false"
    if s.cache_index is not None and not s.prefix_doctor:
        raise SettingsError("the config file's [cache-index] table is the prompt-cache "
                            f"doctor's shared index, and the doctor is turned off ({off}): "
                            "leave it on (the default), or remove the table")
    if s.workload_file:
        if not s.prefix_doctor:
            raise SettingsError(f"invalid setting {name('workload_file')}: the workload file's hash ids are "
                                "the prompt-cache doctor's block hashes, and the doctor is "
                                f"turned off ({off}): leave it on (the default)")
        if not s.measure:
            raise SettingsError(f"invalid setting {name('workload_file')}: the workload file records the "
                                "measured usage and timings; it cannot be combined with "
                                f"{name('measure')}=false (--no-measure)")
        if s.workload_file == s.log_requests:
            raise SettingsError(f"invalid setting {name('workload_file')}: the same file as "
                                f"{name('log_requests')}")
        folder = os.path.dirname(os.path.abspath(s.workload_file))
        if not os.path.isdir(folder):
            raise SettingsError(f"invalid setting {name('workload_file')}: no such directory "
                                f"{folder!r}")
    elif s.workload_client:
        raise SettingsError(f"invalid setting {name('workload_client')}: only used with "
                            f"{name('workload_file')}")
    if s.workload_client and not s.client_label_from:
        raise SettingsError(f"invalid setting {name('workload_client')}: there is no client "
                            f"label to write without {name('client_label_from')}")
    if s.metrics_port and s.metrics_port == s.port:
        raise SettingsError(f"invalid setting {name('metrics_port')}: must differ from {name('port')}")

