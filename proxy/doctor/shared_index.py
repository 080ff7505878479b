"""The doctor's index shared by every replica: the config file's ``[cache-index]`` table,
the secret every replica hashes prompts with, and :class:`RedisPrefixIndex`, the
:class:`~proxy.doctor.index.PrefixIndex` on one Redis or Valkey.

Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.util
import logging
import math
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from proxy.config_values import SettingsError
from proxy.doctor.index import (
    DEFAULT_WINDOW_MS,
    NEVER,
    IndexUnanswered,
    Probe,
    SightingLists,
    Sightings,
)

CACHE_INDEX_TABLE = "cache-index"
PREFIX_SECRET_ENV = "LLM_PROXY_PREFIX_SECRET"
MIN_SECRET_BYTES = 16
DEFAULT_KEY_PREFIX = "llm-proxy:prefix:"
DEFAULT_TIMEOUT_MS = 50
DEFAULT_RETRY_MS = 1000

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
    "longer is counted as unchecked; a prompt of more than 1024 keys is "
    "allowed the store's own time for as many keys as a request may send, "
    "on top",
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


def cache_index_spec(
    path: str, doc: Mapping[str, Any], env: Mapping[str, str]
) -> CacheIndexSpec | None:
    """The ``[cache-index]`` table of config file ``path`` (parsed as ``doc``), checked;
    None without one. The prefix secret and the password variable are checked here too,
    so that a replica missing either does not start."""
    table = doc.get(CACHE_INDEX_TABLE)
    if table is None:
        return None
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
    url = get("url", str).strip()
    try:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must start with redis://, rediss:// or unix://")
        if "@" in parts.netloc:
            raise ValueError(
                "must not carry credentials (user:password@host): put the password in an "
                "environment variable named by password_env, the user in username"
            )
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError(
                    "a unix:// URL needs the socket's path, e.g. unix:///run/redis.sock"
                )
        elif not parts.hostname:
            raise ValueError("needs a host, e.g. redis://redis:6379/0")
        _ = parts.port  # raises ValueError for a bad port
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
    for key, upper in (("timeout_ms", 10_000), ("retry_ms", 600_000)):
        if key in table:
            ms = get(key, int)
            if not 1 <= ms <= upper:
                raise fail(key, f"must be {CACHE_INDEX_KEYS[key]}, not {ms!r}")
            values[key.removesuffix("_ms") + "_s"] = ms / 1000
    if importlib.util.find_spec("redis") is None:
        raise SettingsError(
            f"{where}: the shared index needs redis-py: pip install "
            "'llm-latency-proxy[cache-index]'"
        )
    secret = env.get(PREFIX_SECRET_ENV, "").strip()
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise SettingsError(
            f"{where}: a shared index needs the secret its prompt digests are keyed with in "
            f"{PREFIX_SECRET_ENV} (at least {MIN_SECRET_BYTES} bytes, the same on every "
            "replica, e.g. from `openssl rand -hex 32`), "
            + ("which is shorter" if secret else "which is empty or unset")
        )
    return CacheIndexSpec(**values)


def prefix_secret(env: Mapping[str, str]) -> bytes:
    """The key of every prompt digest when the index is shared: derived from
    :data:`PREFIX_SECRET_ENV` in ``env`` (any length from :data:`MIN_SECRET_BYTES` up; the
    hash takes 16 to 64 bytes), so every replica given the same secret hashes alike."""
    raw = env.get(PREFIX_SECRET_ENV, "").strip().encode()
    if len(raw) < MIN_SECRET_BYTES:  # cache_index_spec refuses this at start-up
        raise ValueError(f"{PREFIX_SECRET_ENV} must hold at least {MIN_SECRET_BYTES} bytes")
    return hashlib.blake2b(raw, digest_size=32, person=b"prefix.secret").digest()


log = logging.getLogger("proxy")

LARGE_KEYS = 1024  # a probe with more keys uses the connection with the longer timeout
MAX_KEYS = 32_768  # keys a request may send (PrefixCheck.place refuses a prompt that could pass)
PER_KEY_S = 10e-6  # the store's time per key, with room (benchmarks/prefix_store.py)
MAX_PAUSE_S = 30.0
WARN_EVERY_S = 60.0

# Reasons an exchange did not happen (the unchecked counter's label values).
STORE_DOWN = "store_down"  # the breaker is open: not tried
STORE_TIMEOUT = "store_timeout"
STORE_ERROR = "store_error"
TOO_LARGE = "too_large"

SCRIPT = """
-- The prompt-cache doctor's exchange (proxy/doctor/shared_index.py): read every key of the
-- probe, then write every key, in one call that runs alone on the store.
-- ARGV: 1 the key prefix, 2 the digests (each ARGV[5] bytes, concatenated), 3 one mark
-- per digest (0 seen, 1 continued past it, 2 ended there), 4 the TTL in ms, 6 how long
-- ago (ms) this request arrived, 7 how long ago its prefill was done, 8 the window.
-- A value: four little-endian int64, the store's ms: the run of sightings (first, last;
-- consecutive gaps within the window) of requests that went on past the key, then of
-- those that held it otherwise (0: never). docs/design/doctor.md says why.
-- The answer: per key, three ages in ms (now - time; -1: none), little-endian int64:
-- the last sighting of each run at or before the arrival, and where neither has one,
-- the first after it if it is at or before this request's own prefill.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local prefix, digests, marks, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local size = tonumber(ARGV[5])
local at, held, window = now - tonumber(ARGV[6]), now - tonumber(ARGV[7]), tonumber(ARGV[8])
local n = #marks
local names = {}
for i = 1, n do names[i] = prefix .. string.sub(digests, (i - 1) * size + 1, i * size) end
local old = {}
for i = 1, n, 512 do
  local got = redis.call('MGET', unpack(names, i, math.min(i + 511, n)))
  for j = 1, #got do old[i + j - 1] = got[j] end
end
local function last(s, l)
  if s == 0 or s > at then return -1 end
  if l <= at then return math.max(0, now - l) end
  return math.max(0, now - math.max(s, at - window))
end
local function put(s, l)
  if s == 0 or held > l + window then return held, held end
  if held > l then return s, held end
  if held < s and held >= s - window then return held, l end
  return s, l
end
local out = {}
for i = 1, n do
  local cs, cl, es, el = 0, 0, 0, 0
  local v = old[i]
  if v and #v == 32 then
    cs, cl, es, el = struct.unpack('<i8i8i8i8', v)
  elseif v and #v == 16 then  -- written by an earlier version: one time per kind
    cl, el = struct.unpack('<i8i8', v)
    cs, es = cl, el
  end
  local c, e = last(cs, cl), last(es, el)
  local first = -1
  if c < 0 and e < 0 then
    if cs > 0 then first = cs end
    if es > 0 and (first < 0 or es < first) then first = es end
    if first > held then first = -1 end
  end
  out[i] = struct.pack('<i8i8i8', c, e, first > 0 and math.max(0, now - first) or -1)
  if string.byte(marks, i) == 1 then cs, cl = put(cs, cl) else es, el = put(es, el) end
  redis.call('SET', names[i], struct.pack('<i8i8i8i8', cs, cl, es, el), 'PX', ttl)
end
return table.concat(out)
"""


class IndexUnavailable(IndexUnanswered):
    """The shared index did not answer this exchange: ``reason`` is one of
    :data:`STORE_DOWN`, :data:`STORE_TIMEOUT`, :data:`STORE_ERROR`, :data:`TOO_LARGE`;
    ``round_trip_s`` how long the failed attempt took (None: nothing was sent)."""

    def __init__(self, reason: str, round_trip_s: float | None = None, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.round_trip_s = round_trip_s


class Admitted(enum.Enum):
    """What :meth:`Breaker.admit` lets through."""

    CLOSED = "closed"  # the store answers: every exchange
    TRIAL = "trial"  # the one exchange that tries a store that failed


class Breaker:
    """When to ask the store: always while it answers; after a failure, not for
    ``first_s``, then one try at a time, each failed try doubling the pause up to
    ``max_s``. Thread-safe; ``clock`` is monotonic seconds."""

    def __init__(
        self,
        first_s: float,
        max_s: float = MAX_PAUSE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.first_s = first_s
        self.max_s = max(max_s, first_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._until: float | None = None  # None: closed
        self.pause_s = first_s
        self._trying = False
        self.down_since: float | None = None
        self.failed_tries = 0

    def admit(self) -> Admitted | None:
        """How this exchange may try the store (:class:`Admitted`); None: it may not."""
        with self._lock:
            if self._until is None:
                return Admitted.CLOSED
            if self._trying or self._clock() < self._until:
                return None
            self._trying = True
            return Admitted.TRIAL

    def succeeded(self, admitted: Admitted) -> bool:
        """Close; True when that ends an outage (the caller says so once)."""
        with self._lock:
            if self._until is None or (admitted != Admitted.TRIAL and self._trying):
                return False
            self._until, self._trying, self.pause_s = None, False, self.first_s
            return True

    def failed(self, admitted: Admitted) -> bool:
        """Open, or stay open longer; True when this failure starts an outage."""
        with self._lock:
            now = self._clock()
            if admitted == Admitted.TRIAL:
                self._trying = False
                self.pause_s = min(self.pause_s * 2, self.max_s)
                self.failed_tries += 1
            elif self._until is not None:
                return False  # another thread's exchange already opened it
            else:  # closed: the pause is first_s
                self.down_since, self.failed_tries = now, 1
            self._until = now + self.pause_s
            return admitted != Admitted.TRIAL


class RedisPrefixIndex:
    """A :class:`~proxy.doctor.index.PrefixIndex` on Redis or Valkey. ``horizon_ms`` is every
    key's TTL; ``window_ms`` the cache window that cuts runs of sightings; ``environ`` holds
    the password variable the spec names (None: no password); ``clock`` (monotonic seconds)
    times the breaker; ``caller_clock`` (monotonic seconds, ``clock`` when not given) is the
    caller's, whose milliseconds :meth:`exchange` takes and answers in. Thread-safe:
    redis-py's connection pool gives each thread its own connection."""

    def __init__(
        self,
        spec: CacheIndexSpec,
        *,
        horizon_ms: int,
        window_ms: int = DEFAULT_WINDOW_MS,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        caller_clock: Callable[[], float] | None = None,
    ) -> None:
        from redis import Redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        password = (environ or {}).get(spec.password_env) if spec.password_env else None
        self.url = spec.url
        self.horizon_ms = horizon_ms
        self.window_ms = window_ms
        self._prefix = spec.key_prefix.encode()
        self._clock = clock
        self._caller_clock = clock if caller_clock is None else caller_clock
        self.breaker = Breaker(spec.retry_s, clock=clock)
        self._local = threading.local()
        self._warned_at = -math.inf
        self._held_back = 0
        self._announced = False  # whether this outage's failure line was logged

        def client(timeout_s: float) -> Any:
            return Redis.from_url(
                spec.url,
                username=spec.username or None,
                password=password or None,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                client_name="llm-latency-proxy",
            )

        self._small = client(spec.timeout_s)
        self._large = client(spec.timeout_s + MAX_KEYS * PER_KEY_S)
        self._scripts = (self._small.register_script(SCRIPT), self._large.register_script(SCRIPT))

    def exchange(self, probe: Probe, now_ms: int, held_ms: int | None = None) -> Sightings:
        """What the store knew of each of ``probe.keys`` at or before ``now_ms``; then record
        that a request holds them from ``held_ms`` (``now_ms`` when not given). Both are
        the caller's clock, sent as ages (the clock's now less each) and answered as
        ages, so the store's clock never meets the caller's. Raises
        :class:`IndexUnavailable`."""
        from redis.exceptions import RedisError
        from redis.exceptions import TimeoutError as RedisTimeout

        self._local.round_trip_s = None
        n = len(probe.keys)
        if n > MAX_KEYS:
            raise IndexUnavailable(TOO_LARGE, detail=f"{n} keys")
        if n == 0:
            return SightingLists([], [], {})
        size = len(probe.keys[0])
        digests = b"".join(probe.keys)
        if len(digests) != n * size:
            raise ValueError("a shared index takes keys of one length")
        admitted = self.breaker.admit()
        if admitted is None:
            raise IndexUnavailable(STORE_DOWN)
        script = self._scripts[n > LARGE_KEYS]
        current = round(self._caller_clock() * 1000)
        arrived = max(0, current - now_ms)
        held = max(0, current - (now_ms if held_ms is None else held_ms))
        start = time.perf_counter()
        try:
            reply = script(
                args=[
                    self._prefix,
                    digests,
                    probe.marks,
                    self.horizon_ms,
                    size,
                    arrived,
                    held,
                    self.window_ms,
                ]
            )
            if not isinstance(reply, bytes) or len(reply) != 24 * n:
                raise RedisError(
                    f"the script answered {type(reply).__name__} "
                    f"of {len(reply) if isinstance(reply, bytes) else '?'} bytes, "
                    f"not {24 * n}"
                )
        except (RedisError, OSError) as exc:
            elapsed = time.perf_counter() - start
            reason = STORE_TIMEOUT if isinstance(exc, RedisTimeout) else STORE_ERROR
            if self.breaker.failed(admitted):
                self._warn_down(reason, exc)
            raise IndexUnavailable(reason, elapsed, f"{type(exc).__name__}: {exc}") from None
        self._local.round_trip_s = time.perf_counter() - start
        if self.breaker.succeeded(admitted) and self._announced:
            # one line for the end of an outage whose start had one; one held back (a
            # minute after the last) ends as quietly, and the next failure line counts it
            self._announced = False
            since = self.breaker.down_since
            log.warning(
                "prompt-cache doctor: the shared index at %s answers again (down %.1f s, "
                "%d failed tries); requests are examined again",
                self.url,
                self._clock() - since if since is not None else 0.0,
                self.breaker.failed_tries,
            )
        ages = struct.unpack(f"<{3 * n}q", reply)
        return SightingLists(
            [current - age if age >= 0 else NEVER for age in ages[0::3]],
            [current - age if age >= 0 else NEVER for age in ages[1::3]],
            {i: current - age for i, age in enumerate(ages[2::3]) if age >= 0},
        )

    def round_trip_s(self) -> float | None:
        """The calling thread's last successful exchange's round trip, in seconds (None:
        it failed, or none yet)."""
        value: float | None = getattr(self._local, "round_trip_s", None)
        return value

    def _warn_down(self, reason: str, exc: BaseException) -> None:
        now = self._clock()
        if now - self._warned_at < WARN_EVERY_S:
            self._held_back += 1
            self._announced = False
            return
        held, self._held_back, self._warned_at = self._held_back, 0, now
        self._announced = True
        also = f" ({held} more outages since the last such line)" if held else ""
        log.warning(
            "prompt-cache doctor: the shared index at %s failed (%s, %s: %s); requests "
            "are not examined but counted in llm_proxy_prompt_prefix_unchecked_total "
            "until it answers: next try in %.3g s, then less often while it fails "
            "(at most every %.0f s)%s",
            self.url,
            reason,
            type(exc).__name__,
            exc,
            self.breaker.pause_s,
            self.breaker.max_s,
            also,
        )

    def close(self) -> None:
        """Close the connections (the process is stopping)."""
        for client in (self._small, self._large):
            client.close()
