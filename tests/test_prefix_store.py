"""The prompt-cache doctor's shared index on a real Redis, its config table
(proxy/doctor/shared_index.py), and the proxy with it (proxy/doctor/job.py).

Every test starts its own ``redis-server`` on a loopback port (tests/redis_server.py).
The index must answer as the in-process one does: the same sightings for any sequence
of probes (the store's clock against the test's, within the time each exchange took),
and through the doctor the same report for every break reason. A store that is down,
hung or refusing costs each request a counted miss: the request is relayed, the record
says why it was not examined, the metrics count it, the breaker keeps the store from
being asked per request, and the doctor comes back when the store does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config import from_sources
from proxy.config_values import SettingsError
from proxy.dialects import DIALECTS, cache_scope
from proxy.doctor.examine import PrefixDoctor, PrefixPolicy
from proxy.doctor.index import CONTINUED, ENDED, NEVER, SEEN, LruPrefixIndex, Probe
from proxy.doctor.keys import PromptHasher
from proxy.doctor.shared_index import (
    MAX_KEYS,
    PREFIX_SECRET_ENV,
    SCRIPT,
    STORE_DOWN,
    STORE_ERROR,
    STORE_TIMEOUT,
    TOO_LARGE,
    Admitted,
    Breaker,
    CacheIndexSpec,
    IndexUnavailable,
    RedisPrefixIndex,
    cache_index_spec,
    prefix_secret,
)
from proxy.ui import index_scope
from tests.fake_upstream import ScriptedClock
from tests.redis_server import RedisServer, redis_server
from tests.test_prefix_doctor import run_scenario
from tests.test_prefix_proxy import (
    CHAT,
    PAIRS,
    STABLE,
    T0,
    Answers,
    chat,
    conversation,
    doctor_app,
    lines,
    post,
    value,
)

pytestmark = pytest.mark.integration

SECRET = "a secret every replica shares, 32+"
UNCHECKED = "llm_proxy_prompt_prefix_unchecked_total"
INDEX_SECONDS = "llm_proxy_prompt_prefix_index_seconds"
_prefixes = itertools.count()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path) as server:
        yield server


def spec_of(server: RedisServer, **extra: Any) -> CacheIndexSpec:
    """A spec with a key prefix of its own, so that tests sharing a store never meet."""
    return CacheIndexSpec(url=server.url, key_prefix=f"t{next(_prefixes)}:", **extra)


class StepClock:
    """The breaker's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def now_ms() -> int:
    return round(time.monotonic() * 1000)


# ---------------------------------------------------------------------------
# The index answers as the in-process one does


KEYS = [bytes([i]) * 8 for i in range(6)]
PROBE = st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from([SEEN, CONTINUED, ENDED])),
                 min_size=1, max_size=8)


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(PROBE, min_size=1, max_size=10))
def test_the_shared_index_answers_as_the_in_process_one(
        shared_store: RedisServer, probes: list[list[tuple[bytes, int]]]) -> None:
    """Same probes, same sightings: which keys were held, and how (went on past them or
    ended there), with a key held twice in one probe not seen by its own first write.
    The times are the store's clock turned into the caller's: a sighting from exchange k
    seen at exchange j lies within what the two exchanges' durations allow."""
    lru = LruPrefixIndex(settle_ms=0)  # the shared index writes every stamp
    called = [0.0]  # the caller's clock: each exchange's own start (ages of 0)
    shared = RedisPrefixIndex(spec_of(shared_store, timeout_s=10.0), horizon_ms=3_600_000,
                              caller_clock=lambda: called[0])
    spans: dict[int, int] = {}  # exchange start ms -> latest end ms among those starts
    try:
        for pairs in probes:
            probe = Probe(tuple(k for k, _ in pairs), bytes(m for _, m in pairs))
            start = now_ms()
            called[0] = start / 1000
            theirs = shared.exchange(probe, start)
            end = now_ms()
            ours = lru.exchange(probe, start)
            for mine, seen in ((ours.continued, theirs.continued), (ours.ended, theirs.ended)):
                for expected, got in zip(mine, seen, strict=True):
                    if expected == NEVER:
                        assert got == NEVER
                        continue
                    assert got != NEVER
                    # stored at store time in [expected, spans[expected]], read at store
                    # time in [start, end]: got = start - age
                    assert expected - (end - start) - 2 <= got <= spans[expected] + 2
            spans[start] = max(spans.get(start, start), end)
    finally:
        shared.close()


def test_the_shared_index_counts_a_sighting_from_its_prefill_in_runs(store: RedisServer) -> None:
    """The in-process index's scenario (tests/test_prefix_doctor.py), on the store: the
    same runs of sightings, in the caller's clock (fixed here, so each exchange sends its
    times as exact ages), within the few milliseconds the store's clock moves between
    exchanges."""
    called = [1000.0]
    index = RedisPrefixIndex(spec_of(store, timeout_s=10.0), horizon_ms=3_600_000,
                             window_ms=1000, caller_clock=lambda: called[0])
    try:
        run_scenario(index.exchange, slack=50)
    finally:
        index.close()


def test_a_value_of_one_time_per_kind_is_read_as_runs_of_one(store: RedisServer) -> None:
    """A key written by the earlier script (16 bytes: one time per kind) still counts."""
    import struct

    import redis

    spec = spec_of(store)
    index = RedisPrefixIndex(spec, horizon_ms=60_000, caller_clock=lambda: 1000.0)
    client = redis.Redis(port=store.port)
    try:
        key = os.urandom(8)
        seconds, micros = client.time()
        store_ms = int(seconds) * 1000 + int(micros) // 1000
        client.set(spec.key_prefix.encode() + key, struct.pack("<qq", store_ms - 5000, 0))
        seen = index.exchange(Probe((key,), bytes([SEEN])), 1_000_000)
        assert 1_000_000 - 5000 - 50 <= seen.continued[0] <= 1_000_000 - 5000
        assert seen.ended == [NEVER] and not seen.after
    finally:
        index.close()


def test_one_exchange_is_one_script_call_and_keys_expire_after_the_horizon(
        store: RedisServer) -> None:
    import redis

    spec = spec_of(store)
    index = RedisPrefixIndex(spec, horizon_ms=7_200_000)
    client = redis.Redis(port=store.port)
    try:
        client.config_resetstat()
        keys = tuple(os.urandom(8) for _ in range(40))
        index.exchange(Probe(keys, bytes([CONTINUED] * 40)), 0)
        stats = client.info("commandstats")
        # The first exchange loads the script once (NOSCRIPT, then SCRIPT LOAD); the
        # script's own MGET and SETs count as calls inside it, not round trips.
        assert {k for k in stats if k.startswith("cmdstat_")} >= {"cmdstat_evalsha"}
        client.config_resetstat()
        index.exchange(Probe(keys, bytes([ENDED] * 40)), 0)
        calls = {k: v["calls"] for k, v in client.info("commandstats").items()}
        assert calls["cmdstat_evalsha"] == 1  # one round trip per request
        name = spec.key_prefix.encode() + keys[0]
        assert 7_100_000 < client.pttl(name) <= 7_200_000  # the horizon, from the last touch
        assert client.strlen(name) == 32  # four int64 times, no text
        usage = client.memory_usage(name)
        assert usage is not None and usage <= 128  # 120 on Redis 7.0.15 (benchmarks/RESULTS.md, 2026-12-05)
        assert client.dbsize() == 40
        assert index.round_trip_s() is not None
    finally:
        index.close()
        client.close()


def test_the_script_reads_everything_before_writing() -> None:
    # A key held twice in a probe: the in-process index answers both from before the
    # request; the script does too because it MGETs every key before its first SET.
    reads = SCRIPT.index("MGET")
    assert reads < SCRIPT.index("'SET'")


# ---------------------------------------------------------------------------
# Failures: a counted miss, a breaker, and recovery


def test_a_store_that_is_down_fails_fast_then_is_not_asked_until_its_pause_is_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(tmp_path)  # not started: nothing listens on its port
    clock = StepClock()
    index = RedisPrefixIndex(spec_of(server, retry_s=1.0), horizon_ms=60_000, clock=clock)
    probe = Probe((b"k" * 8,), bytes([SEEN]))
    try:
        with caplog.at_level(logging.WARNING, logger="proxy"):
            with pytest.raises(IndexUnavailable) as refused:
                index.exchange(probe, 0)
            assert refused.value.reason == STORE_ERROR
            assert refused.value.round_trip_s is not None and refused.value.round_trip_s < 1
            for _ in range(3):  # paused: not asked, no time spent
                with pytest.raises(IndexUnavailable) as down:
                    index.exchange(probe, 0)
                assert down.value.reason == STORE_DOWN and down.value.round_trip_s is None
            clock.now += 1.0  # the pause is over: one try, which fails, doubles the pause
            with pytest.raises(IndexUnavailable) as again:
                index.exchange(probe, 0)
            assert again.value.reason == STORE_ERROR
            clock.now += 1.5
            with pytest.raises(IndexUnavailable) as still:
                index.exchange(probe, 0)
            assert still.value.reason == STORE_DOWN  # 2 s now
            server.start()
            clock.now += 0.5
            assert index.exchange(probe, 5).ended == [NEVER]  # back, and empty
            assert index.exchange(probe, 9).ended[0] != NEVER
            # a second outage within the minute: its failure line is held back, and so
            # is its end, so that no recovery is said of an outage never announced
            server.kill()
            clock.now += 10.0
            with pytest.raises(IndexUnavailable):
                index.exchange(probe, 10)
            server.start()
            clock.now += 1.0
            index.exchange(probe, 11)
            # a third, past the minute: said, with the one held back
            server.kill()
            clock.now += 60.0
            with pytest.raises(IndexUnavailable):
                index.exchange(probe, 12)
        down_lines = [r for r in caplog.records if "failed (store_error" in r.getMessage()]
        assert len(down_lines) == 2  # one line an outage, at most one a minute
        assert "llm_proxy_prompt_prefix_unchecked_total" in down_lines[0].getMessage()
        assert "(1 more outages since the last such line)" in down_lines[1].getMessage()
        back = [r for r in caplog.records if "answers again" in r.getMessage()]
        assert len(back) == 1 and "2 failed tries" in back[0].getMessage()
    finally:
        index.close()
        server.kill()


def test_a_hung_store_times_out_within_its_timeout(store: RedisServer) -> None:
    index = RedisPrefixIndex(spec_of(store, timeout_s=0.05), horizon_ms=60_000)
    probe = Probe((b"h" * 8,), bytes([SEEN]))
    try:
        index.exchange(probe, 0)  # connected, script loaded
        store.pause()
        start = time.perf_counter()
        with pytest.raises(IndexUnavailable) as hung:
            index.exchange(probe, 0)
        waited = time.perf_counter() - start
        assert hung.value.reason == STORE_TIMEOUT
        assert 0.05 <= waited < 5  # the timeout, not forever (loaded machines are slow)
        with pytest.raises(IndexUnavailable) as down:
            index.exchange(probe, 0)
        assert down.value.reason == STORE_DOWN
    finally:
        store.resume()
        index.close()


def test_an_error_answer_and_a_wrong_password_are_store_errors(tmp_path: Path) -> None:
    with redis_server(tmp_path, "--requirepass", "sesame") as server:
        probe = Probe((b"p" * 8,), bytes([SEEN]))
        good = RedisPrefixIndex(spec_of(server, password_env="STORE_PASSWORD"),
                                horizon_ms=60_000, environ={"STORE_PASSWORD": "sesame"})
        wrong = RedisPrefixIndex(spec_of(server, password_env="STORE_PASSWORD"),
                                 horizon_ms=60_000, environ={"STORE_PASSWORD": "open"})
        try:
            assert good.exchange(probe, 0).ended == [NEVER]
            with pytest.raises(IndexUnavailable) as refused:
                wrong.exchange(probe, 0)
            assert refused.value.reason == STORE_ERROR
            # A store out of memory that evicts nothing refuses the script's writes.
            import redis

            admin = redis.Redis(port=server.port, password="sesame")
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", "1")
            with pytest.raises(IndexUnavailable) as full:
                good.exchange(probe, 0)
            assert full.value.reason == STORE_ERROR and "OutOfMemoryError" in str(full.value)
            admin.close()
        finally:
            good.close()
            wrong.close()


def test_a_probe_beyond_the_bound_is_never_sent(store: RedisServer) -> None:
    index = RedisPrefixIndex(spec_of(store, timeout_s=5.0), horizon_ms=60_000)
    try:
        keys = tuple(i.to_bytes(8, "little") for i in range(MAX_KEYS + 1))
        with pytest.raises(IndexUnavailable) as large:
            index.exchange(Probe(keys, bytes(len(keys))), 0)
        assert large.value.reason == TOO_LARGE and large.value.round_trip_s is None
        assert index.breaker.admit() == Admitted.CLOSED  # not the store's fault
        # At the bound itself: sent, over the connection allowed the longer timeout.
        seen = index.exchange(Probe(keys[:MAX_KEYS], bytes(MAX_KEYS)), 0)
        assert len(seen.ended) == MAX_KEYS
    finally:
        index.close()


def test_the_breaker_lets_one_try_through_at_a_time_and_doubles_its_pause() -> None:
    clock = StepClock()
    breaker = Breaker(0.5, max_s=3.0, clock=clock)
    first = breaker.admit()
    assert first == Admitted.CLOSED
    concurrent = breaker.admit()
    assert breaker.failed(first) is True  # the outage starts
    assert concurrent is not None and breaker.failed(concurrent) is False  # the same outage
    assert breaker.admit() is None
    pauses = []
    for _ in range(5):
        clock.now += breaker.pause_s
        trial = breaker.admit()
        assert trial == Admitted.TRIAL and breaker.admit() is None  # one at a time
        assert breaker.failed(trial) is False
        pauses.append(breaker.pause_s)
    assert pauses == [1.0, 2.0, 3.0, 3.0, 3.0]
    clock.now += 3.0
    trial = breaker.admit()
    assert trial is not None and breaker.succeeded(trial) is True
    assert breaker.admit() == Admitted.CLOSED and breaker.pause_s == 0.5


# ---------------------------------------------------------------------------
# Through the proxy


def shared_app(answers: Answers, clock: ScriptedClock, tmp_path: Path, server: RedisServer,
               **spec: Any) -> Any:
    return doctor_app(answers, clock, tmp_path, cache_index=spec_of(server, **spec))


@pytest.mark.anyio
@pytest.mark.parametrize("case", [c for c in PAIRS if PAIRS[c][4] != "expired"])
async def test_each_break_reason_with_the_shared_index(
        case: str, tmp_path: Path, store: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pairs of tests/test_prefix_proxy.py, same answers (expiry is the store's clock,
    which a scripted clock does not move: tested below with real time)."""
    monkeypatch.setenv(PREFIX_SECRET_ENV, SECRET)
    route, first, second, _gap, reason, part, index, offset = PAIRS[case]
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = shared_app(answers, clock, tmp_path, store)
    assert app.v1.prefix is not None and app.v1.prefix.shared is not None
    async with app:
        assert (await post(app, clock, route, first)).status_code == 200
        assert (await post(app, clock, route, second, at=T0 + 1)).status_code == 200
    line = lines(log_file)[1]
    assert (line["prefix_break"], line["prefix_break_part"] or "none") == (reason, part)
    assert (line["prefix_break_index"], line["prefix_break_offset"]) == (index, offset)
    assert line["prefix_unchecked"] is None
    assert value(registry, "llm_proxy_prompt_prefix_breaks_total", route, second["model"],
                 reason=reason, part=part) == 1
    ok = registry.get_sample_value(INDEX_SECONDS + "_count", {"result": "ok"})
    assert ok == 2  # one round trip per request


def test_the_same_reports_as_one_process_expiry_included(store: RedisServer) -> None:
    """The doctor on the shared index and on the in-process one, fed the same bodies at
    the same times (real time: the window is a second), says the same about each."""
    secret = prefix_secret({PREFIX_SECRET_ENV: SECRET})
    policy = PrefixPolicy(window_ms=1000)
    called = [0.0]  # the caller's clock at each exchange: its request's own time
    shared = RedisPrefixIndex(spec_of(store, timeout_s=5.0), horizon_ms=3_600_000,
                              window_ms=1000, caller_clock=lambda: called[0])
    doctors = (PrefixDoctor(LruPrefixIndex(window_ms=1000), PromptHasher(secret), policy),
               PrefixDoctor(shared, PromptHasher(secret), policy))
    bodies = [(route, body) for route, first, second, gap, *_ in PAIRS.values()
              if gap < 300 for body in (first, second)]

    def examine(route: str, body: dict[str, Any]) -> list[Any]:
        model, key = cache_scope(body)
        now = now_ms()
        called[0] = now / 1000
        looks = [d.look(DIALECTS[route].prompt_parts(body), upstream="up", model=model,
                        cache_key=key, now_ms=now) for d in doctors]
        return [looked[1] if looked is not None else None for looked in looks]

    try:
        for route, body in bodies:
            one, other = examine(route, body)
            assert one == other
        time.sleep(1.3)  # the subject: the window passes
        for reason in ("expired", None):  # held too long ago; then just now, whole
            one, other = examine(*bodies[0])
            assert one == other and one is not None and one.reason == reason
    finally:
        shared.close()


@pytest.mark.anyio
async def test_a_store_hung_down_or_back_costs_the_proxy_a_counted_miss(
        tmp_path: Path, store: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hung (SIGSTOP): the exchange times out; the next request is not tried. Back: found
    again after the pause. Killed: refused at once; not tried again during the pause.
    Started again, empty: back. Every request is relayed whole; the record and the
    metrics say why each was not examined."""
    monkeypatch.setenv(PREFIX_SECRET_ENV, SECRET)
    clock, answers = ScriptedClock(T0), Answers()
    app, registry, log_file = shared_app(answers, clock, tmp_path, store, timeout_s=0.05,
                                         retry_s=1.0)
    body = {**chat(("system", STABLE), ("user", "hi")), "stream": True}
    at = itertools.count(1)

    async def send() -> None:
        response = await post(app, clock, CHAT, body, at=T0 + next(at))
        assert response.status_code == 200 and response.content.endswith(b"data: [DONE]\n\n")

    def examined() -> float:
        return registry.get_sample_value(INDEX_SECONDS + "_count", {"result": "ok"}) or 0

    async def until_examined() -> None:
        before = examined()
        for _ in range(500):  # the pause (1 s) must pass first
            await send()
            if examined() > before:
                return
            await asyncio.sleep(0.01)
        pytest.fail("the doctor did not come back with the store")

    async with app:
        await send()  # examined: first_seen
        store.pause()
        await send()  # times out
        await send()  # not tried
        store.resume()
        await until_examined()  # the same store: a full repeat
        store.kill()
        await send()  # refused
        await send()  # not tried
        store.start()
        await until_examined()  # an empty store: first seen
    log = lines(log_file)
    codes = "".join({None: "o", STORE_TIMEOUT: "t", STORE_DOWN: "d", STORE_ERROR: "e"}[
        line["prefix_unchecked"]] for line in log)
    assert re.fullmatch("otdd*oedd*o", codes), codes
    examined_lines = [line for line in log if line["prefix_unchecked"] is None]
    assert [line["prefix_break"] for line in examined_lines] == ["first_seen", None, "first_seen"]
    assert examined_lines[1]["repeated_prefix_bytes"] == examined_lines[1]["prompt_bytes"]
    assert all(line["outcome"] == "completed" for line in log)
    assert all(line["prompt_bytes"] is None for line in log if line["prefix_unchecked"])
    counted = {reason: registry.get_sample_value(UNCHECKED, {
        "route": CHAT, "model": "m", "upstream": "up", "reason": reason}) or 0
        for reason in (STORE_TIMEOUT, STORE_DOWN, STORE_ERROR)}
    assert counted == {STORE_TIMEOUT: 1, STORE_DOWN: codes.count("d"), STORE_ERROR: 1}
    assert registry.get_sample_value(INDEX_SECONDS + "_count", {"result": "timeout"}) == 1
    assert registry.get_sample_value(INDEX_SECONDS + "_sum", {"result": "timeout"}) >= 0.05
    assert registry.get_sample_value(INDEX_SECONDS + "_count", {"result": "error"}) == 1
    # A request not examined is in none of the doctor's other counters.
    assert value(registry, "llm_proxy_prompt_prefix_breaks_total", CHAT,
                 reason="first_seen", part="none") == 2
    ratio = registry.get_sample_value("llm_proxy_prompt_repeated_prefix_ratio_count", {
        "route": CHAT, "model": "m", "upstream": "up"})
    assert ratio == 3


@pytest.mark.anyio
async def test_while_the_store_is_down_the_trace_keeps_the_prompts_keys(
        tmp_path: Path, store: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store gone (refused, then not asked during the pause): neither request is
    examined, but both trace lines carry their prompt's block ids, and the second turn of a
    conversation shares the first turn's ids."""
    monkeypatch.setenv(PREFIX_SECRET_ENV, SECRET)
    clock, answers = ScriptedClock(T0), Answers()
    trace = tmp_path / "trace.jsonl"
    app, _, log_file = doctor_app(answers, clock, tmp_path, cache_index=spec_of(store),
                                  workload_file=str(trace), workload_block_size=16)
    turn1, turn2 = conversation(CHAT, 1), conversation(CHAT, 2)
    answers.queue(2500, 0)
    answers.queue(3000, 0)
    store.kill()
    async with app:
        await post(app, clock, CHAT, turn1)
        await post(app, clock, CHAT, turn2, at=T0 + 1)
    assert [line["prefix_unchecked"] for line in lines(log_file)] == [STORE_ERROR, STORE_DOWN]
    first, second = [line for line in lines(trace) if "hash_ids" in line]
    assert (len(first["hash_ids"]), len(second["hash_ids"])) == (-(-2500 // 16), -(-3000 // 16))
    shared = len(first["hash_ids"]) - 1  # the first turn's blocks but its partial last one
    assert second["hash_ids"][:shared] == first["hash_ids"][:shared]


# ---------------------------------------------------------------------------
# The config table


def write(tmp_path: Path, table: str, name: str = "proxy.toml", doctor: bool = True) -> str:
    path = tmp_path / name
    path.write_text(("" if doctor else "prefix_doctor = false\n\n")  # on by default
                    + '[[upstream]]\nname = "up"\nurl = "http://u:8000/v1"\ndefault = true\n\n'
                    + table)
    return str(path)


def test_the_table_is_read_with_its_defaults_and_needs_the_secret(tmp_path: Path) -> None:
    path = write(tmp_path, '[cache-index]\nurl = "redis://redis:6379/0"\n')
    env = {"LLM_PROXY_CONFIG": path, PREFIX_SECRET_ENV: SECRET}
    settings = from_sources(None, env)
    assert settings.cache_index == CacheIndexSpec(url="redis://redis:6379/0")
    spec = settings.cache_index
    assert (spec.timeout_s, spec.retry_s, spec.key_prefix) == (0.05, 1.0, "llm-proxy:prefix:")
    assert from_sources(None, {"LLM_PROXY_CONFIG": write(tmp_path, "", "plain.toml")}).cache_index is None
    off = write(tmp_path, '[cache-index]\nurl = "redis://redis:6379/0"\n', "off.toml", doctor=False)
    with pytest.raises(SettingsError, match=r"\[cache-index\] table is the prompt-cache doctor's"):
        from_sources(None, {"LLM_PROXY_CONFIG": off, PREFIX_SECRET_ENV: SECRET})
    for secret, problem in (("", "empty or unset"), ("short", "shorter")):
        with pytest.raises(SettingsError, match=f"LLM_PROXY_PREFIX_SECRET .*{problem}"):
            from_sources(None, {"LLM_PROXY_CONFIG": path, PREFIX_SECRET_ENV: secret})
    full = write(tmp_path, '[cache-index]\nurl = "rediss://store.internal:6380/2"\n'
                 'username = "proxy"\npassword_env = "STORE_PASSWORD"\n'
                 'key_prefix = "team-a:"\ntimeout_ms = 20\nretry_ms = 5000\n', "full.toml")
    spec = from_sources(None, {"LLM_PROXY_CONFIG": full, PREFIX_SECRET_ENV: SECRET,
                               "STORE_PASSWORD": "pw"}).cache_index
    assert spec == CacheIndexSpec("rediss://store.internal:6380/2", "proxy", "STORE_PASSWORD",
                                  "team-a:", 0.02, 5.0)


@pytest.mark.parametrize(("table", "message"), [
    ('url = "http://redis:6379"', "url: must start with redis://"),
    ('url = "redis://user:pw@redis:6379"', "url: must not carry credentials"),
    ('url = "redis://:6379"', "url: needs a host"),
    ('url = "unix://"', "url: a unix:// URL needs the socket's path"),
    ('url = "redis://r:99999"', "url: Port out of range"),
    ("url = 6379", "url: must be a redis://HOST:PORT/DB"),
    ("timeout_ms = 50", "url: missing"),
    ('url = "redis://r"\ntimeout_ms = 0', "timeout_ms: must be an integer number"),
    ('url = "redis://r"\ntimeout_ms = 0.5', "timeout_ms: must be an integer number"),
    ('url = "redis://r"\nretry_ms = true', "retry_ms: must be an integer number"),
    ('url = "redis://r"\nkey_prefix = ""', "key_prefix: must be a non-empty string"),
    ('url = "redis://r"\npassword_env = "NOT_SET_ANYWHERE"',
     "password_env: environment variable NOT_SET_ANYWHERE is empty or unset"),
    ('url = "redis://r"\nttl = 5', r"ttl: unknown setting \(known: url, username"),
])
def test_a_bad_table_stops_start_up_naming_the_key(tmp_path: Path, table: str,
                                                    message: str) -> None:
    path = write(tmp_path, "[cache-index]\n" + table + "\n")
    with pytest.raises(SettingsError, match=f"proxy.toml: \\[cache-index\\]: {message}") as bad:
        from_sources(None, {"LLM_PROXY_CONFIG": path, PREFIX_SECRET_ENV: SECRET})
    assert str(bad.value).count("[cache-index]") == 1  # where, said once
    assert cache_index_spec("p", {}, {}) is None
    with pytest.raises(SettingsError, match="must be a table"):
        cache_index_spec("p", {"cache-index": "redis://r"}, {PREFIX_SECRET_ENV: SECRET})


def test_the_live_page_is_told_which_index_it_reads() -> None:
    assert index_scope(doctor=False, shared=False, workers=1) is None
    alone = index_scope(doctor=True, shared=False, workers=1)
    assert alone is not None and alone["index"] == "per-process" and "replica" in alone["note"]
    workers = index_scope(doctor=True, shared=False, workers=3)
    assert workers is not None and "3 worker processes" in workers["note"]
    shared = index_scope(doctor=True, shared=True, workers=1)
    assert shared is not None and shared["index"] == "shared"


def test_the_secret_keys_the_digests_the_same_everywhere() -> None:
    one = prefix_secret({PREFIX_SECRET_ENV: SECRET})
    assert one == prefix_secret({PREFIX_SECRET_ENV: "  " + SECRET + "\n"})
    assert one != prefix_secret({PREFIX_SECRET_ENV: SECRET + "!"})
    assert len(one) == 32
    long = prefix_secret({PREFIX_SECRET_ENV: "x" * 500})  # any length from 16 bytes up
    assert PromptHasher(long).block_bytes == 256
    with pytest.raises(ValueError):
        prefix_secret({})


@pytest.mark.anyio
async def test_the_live_page_data_says_which_index_the_figures_come_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    monkeypatch.setenv(PREFIX_SECRET_ENV, SECRET)
    nowhere = CacheIndexSpec(url="redis://127.0.0.1:1/0")  # never asked: nothing is sent
    for cache_index, kind in ((None, "per-process"), (nowhere, "shared")):
        clock, answers = ScriptedClock(T0), Answers()
        app, _, _ = doctor_app(answers, clock, tmp_path, cache_index=cache_index)
        async with app:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
                data = (await client.get("/ui/data")).json()
        assert data["prefix_index"]["index"] == kind
        assert data["prefix_index"]["note"]


def test_the_store_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/prefix_store.py, smoke run against a store of the test's own."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    with redis_server(tmp_path) as server:
        out = subprocess.run(
            [sys.executable, "benchmarks/prefix_store.py", "--quick", "--url", server.url,
             "--sizes", "2048,20000", "--entries", "500"],
            cwd=root, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 2")]
    assert len(rows) == 4 and "exchanges/s" in out and "MEMORY USAGE" in out, out


@pytest.mark.anyio
async def test_a_full_backlog_for_the_store_is_a_counted_miss(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With a shared index every prompt waits for a store thread; past
    MAX_PENDING_SHARED waiting, a request is not examined and its record says busy."""
    import threading

    from proxy.doctor import job as doctor_job
    from proxy.doctor.job import Place, PrefixCheck, PrefixJob
    from proxy.upstream_spec import UpstreamSpec

    monkeypatch.setattr(doctor_job, "MAX_PENDING_SHARED", 2)
    check = PrefixCheck(cache_index=CacheIndexSpec(url="redis://127.0.0.1:1/0"),
                        env={PREFIX_SECRET_ENV: SECRET})
    gate = threading.Event()
    try:
        held = [check.submit(lambda: gate.wait(30) and None, Place.SHARED) for _ in range(2)]
        assert all(f is not None for f in held)
        spec = UpstreamSpec(name="up", url="http://u/v1")
        job = PrefixJob(check, DIALECTS[CHAT], chat(("system", STABLE), ("user", "hi")), spec,
                        0, place=Place.SHARED)
        with caplog.at_level(logging.WARNING, logger="proxy"):
            job.start()
        assert "prompts already wait for the shared index" in caplog.text
        record = job.record
        assert record is not None and record.unchecked == "busy"
    finally:
        gate.set()
        check.close()


def test_every_reason_is_in_the_metrics_help() -> None:
    from proxy.doctor.job import UNCHECKED_REASONS
    from proxy.metric_help import PREFIX_HELP

    for reason in UNCHECKED_REASONS:
        assert f"{reason}: " in PREFIX_HELP["unchecked"], reason
