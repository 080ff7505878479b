"""Three replicas and the prompt-cache doctor: per-process indexes miss the repeats that
landed on another replica; one shared index finds them, with the same answers as one
process that saw all the traffic.

Real proxy processes (``python -m proxy serve --config FILE``) stand in front of the
suite's scripted upstream (tests/fake_upstream.py) and, for the shared index, one real
``redis-server`` (tests/redis_server.py). The client is the official openai SDK, and it
takes turns: request *i* goes to replica *i* mod 3, as a round-robin load balancer
sends it. The workload is fixed and sent one request at a time (each response read to
its end, by which time its examination is recorded), so the three runs see the same
requests in the same order:

(a) three replicas, each with its own index;
(b) three replicas sharing one index on Redis;
(c) one process.

(b)'s repeated and missed tokens, breaks by reason and part, and repeated-share
histogram summed over its replicas equal (c)'s exactly, and so does every request's
own finding in the request logs; (a) finds less. Then the store fails under two
replicas: down when they start, back, killed mid-run, back again. Every request is
relayed byte for byte whatever the store does, each one the doctor could not check is
counted with its reason, and the doctor finds repeats across replicas again once the
store answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.doctor.shared_index import PREFIX_SECRET_ENV
from tests.fake_upstream import DONE, ScriptedUpstream, chunk_json, sse, usage_json
from tests.redis_server import RedisServer, redis_server

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
SECRET = "the secret all three replicas share"
SSE = {"content-type": "text/event-stream"}
UP = "up"
DOCTOR = ("llm_proxy_prompt_repeated_tokens", "llm_proxy_prompt_cache_missed_tokens",
          "llm_proxy_prompt_prefix_breaks", "llm_proxy_prompt_repeated_prefix_ratio",
          "llm_proxy_prompt_prefix_unchecked")
INDEX = ("llm_proxy_prompt_prefix_index_seconds",)
FINDING = ("prompt_bytes", "repeated_prefix_bytes", "repeated_prefix_tokens",
           "cache_missed_tokens", "prefix_break", "prefix_break_part", "prefix_break_index",
           "prefix_break_offset", "prefix_unchecked")


# ---------------------------------------------------------------------------
# The upstream: every answer a fixed function of the request


def words(n: int, seed: str) -> str:
    out = " ".join(f"{seed}{i}" for i in range(n))
    return out[:n]


def answer_events(body: dict[str, Any]) -> list[bytes]:
    """The stream the upstream sends for ``body``: its prompt tokens a quarter of the
    body's bytes, a quarter of those reported cached, whichever replica asks."""
    raw = json.dumps(body, sort_keys=True).encode()
    prompt = len(raw) // 4
    model = body["model"]
    return [sse(chunk_json({"role": "assistant", "content": ""}, model=model)),
            sse(chunk_json({"content": "ok"}, model=model)),
            sse(chunk_json({}, model=model, finish="stop")),
            sse(usage_json(prompt, 1, prompt // 4, model=model)), DONE]


async def upstream(request: httpx.Request) -> httpx.Response:
    events = answer_events(json.loads(request.content))

    async def body() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    return httpx.Response(200, headers=SSE, content=body())


def expected_bytes(body: dict[str, Any]) -> bytes:
    return b"".join(answer_events(body))


# ---------------------------------------------------------------------------
# The workload: conversations that grow, interleaved, with breaks of several kinds

SYSTEM = words(4000, "rule")
TOOLS = [{"type": "function", "function": {"name": f"tool{i}", "description": words(300, f"t{i}"),
                                           "parameters": {"type": "object"}}} for i in range(2)]
CONVERSATIONS, TURNS = 4, 5  # 4 is prime to 3: a conversation's turns visit every replica


def request(i: int) -> dict[str, Any]:
    """Request ``i``: conversation ``i % 4`` at turn ``i // 4``, each turn its previous
    turn grown by an answer and a question. Conversation 1 puts the time at the head of
    its system prompt (variable_before_stable); conversation 2 rewrites an old question
    at turn 3 (message_changed); conversation 3 asks another model from turn 2 on
    (model_changed, then repeats under it)."""
    c, turn = i % CONVERSATIONS, i // CONVERSATIONS
    system = f"Time now: 10:{turn:02d}.\n{SYSTEM}" if c == 1 else SYSTEM
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for t in range(turn + 1):
        question = words(600, f"c{c}q{t}-")
        if c == 2 and turn >= 3 and t == 1:
            question = words(600, f"c{c}rewritten{t}-")
        messages.append({"role": "user", "content": question})
        if t < turn:
            messages.append({"role": "assistant", "content": words(500, f"c{c}a{t}-")})
    model = "m2" if c == 3 and turn >= 2 else "m"
    return {"model": model, "messages": messages, "tools": TOOLS, "stream": True,
            "stream_options": {"include_usage": True}}


WORKLOAD = [request(i) for i in range(CONVERSATIONS * TURNS)]


# ---------------------------------------------------------------------------
# Replicas


@dataclass
class Replica:
    proc: subprocess.Popen[str]
    log: Path
    output: list[str] = field(default_factory=list)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self, names: tuple[str, ...] = DOCTOR
                ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text)
                if family.name in names for s in family.samples
                if not s.name.endswith("_created")}

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def write_config(path: Path, upstream_url: str, store: RedisServer | None, **index: Any) -> Path:
    table = ""
    if store is not None:
        extra = "".join(f"{key} = {json.dumps(value)}\n" for key, value in index.items())
        table = f'\n[cache-index]\nurl = "{store.url}"\n{extra}'
    # A vLLM-like upstream: it caches from one 16-token block, in 16-token steps.
    path.write_text(f'[[upstream]]\nname = "{UP}"\nurl = "{upstream_url}/v1"\ndefault = true\n'
                    "min_cacheable_tokens = 16\ncache_granularity_tokens = 16\n" + table)
    return path


@contextlib.contextmanager
def replicas(config: Path, count: int, tmp_path: Path, name: str,
             env: dict[str, str] | None = None) -> Iterator[list[Replica]]:
    """``count`` proxy processes on kernel-chosen ports, each with its request log;
    started together, waited for on their own start-up line; stopped with SIGTERM (so
    their logs are complete) when the block ends."""
    started: list[Replica] = []
    ready: list[threading.Event] = []
    for n in range(count):
        log = tmp_path / f"{name}-{n}.jsonl"
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", "0",
             "--prefix-doctor",
             "--log-requests", str(log), "--graceful-timeout", "5"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        replica, event = Replica(proc, log), threading.Event()

        def pump(replica: Replica = replica, event: threading.Event = event) -> None:
            assert replica.proc.stdout is not None
            for line in replica.proc.stdout:
                replica.output.append(line)
                found = re.search(r"Uvicorn running on http://[\d.]+:(\d+)", line)
                if found:
                    replica.port = int(found[1])
                    event.set()
            event.set()

        threading.Thread(target=pump, daemon=True).start()
        started.append(replica)
        ready.append(event)
    try:
        for replica, event in zip(started, ready, strict=True):
            assert event.wait(60) and replica.port, "".join(replica.output)
        yield started
    finally:
        for replica in started:
            if replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        for replica in started:
            try:
                replica.proc.wait(30)
            except subprocess.TimeoutExpired:
                replica.proc.kill()
                replica.proc.wait(10)
            if replica.proc.stdout is not None:
                replica.proc.stdout.close()


class RoundRobin:
    """The openai SDK behind a round-robin balancer: each request to the next replica."""

    def __init__(self, targets: list[Replica]) -> None:
        self.clients = [openai.OpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0,
                                      timeout=60) for r in targets]
        self.sent = 0

    def send(self, body: dict[str, Any]) -> bytes:
        """The response body, every byte as the client received it."""
        client = self.clients[self.sent % len(self.clients)]
        self.sent += 1
        params = {k: v for k, v in body.items() if k != "stream"}
        with client.chat.completions.with_streaming_response.create(stream=True,
                                                                    **params) as response:
            assert response.http_response.status_code == 200
            return b"".join(response.iter_bytes())

    def close(self) -> None:
        for client in self.clients:
            client.close()


def summed(targets: list[Replica]) -> Counter[tuple[str, tuple[tuple[str, str], ...]]]:
    total: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    for replica in targets:
        total.update(replica.metrics())
    return total


def run(targets: list[Replica]) -> Counter[tuple[str, tuple[tuple[str, str], ...]]]:
    client = RoundRobin(targets)
    try:
        for body in WORKLOAD:
            assert client.send(body) == expected_bytes(body)
    finally:
        client.close()
    return summed(targets)


def in_order(targets: list[Replica]) -> list[dict[str, Any]]:
    """Every request's log line, in the order sent (request i went to replica i mod n)."""
    logs = [replica.lines() for replica in targets]
    out = []
    for i in range(sum(len(lines) for lines in logs)):
        out.append(logs[i % len(targets)][i // len(targets)])
    return out


def total(metrics: Counter[Any], name: str, **labels: str) -> float:
    return sum(v for (n, lbls), v in metrics.items()
               if n == name and all(dict(lbls).get(k) == want for k, want in labels.items()))


# ---------------------------------------------------------------------------


def test_a_shared_index_finds_what_per_replica_indexes_miss_and_answers_as_one_process(
        tmp_path: Path) -> None:
    with ScriptedUpstream(upstream).running() as up, redis_server(tmp_path) as store:
        per_replica = write_config(tmp_path / "alone.toml", up.url, None)
        shared = write_config(tmp_path / "shared.toml", up.url, store, timeout_ms=2000)
        env = {PREFIX_SECRET_ENV: SECRET}
        with replicas(per_replica, 3, tmp_path, "a") as a, \
                replicas(shared, 3, tmp_path, "b", env) as b, \
                replicas(per_replica, 1, tmp_path, "c") as c:
            found = {name: run(targets) for name, targets in (("a", a), ("b", b), ("c", c))}
        logs = {"a": in_order(a), "b": in_order(b), "c": in_order(c)}
    a_, b_, c_ = found["a"], found["b"], found["c"]
    assert all(len(lines) == len(WORKLOAD) for lines in logs.values())
    for run_logs in logs.values():
        assert all(line["prefix_unchecked"] is None and line["outcome"] == "completed"
                   for line in run_logs)
    # (b) summed over its replicas is (c), series by series: exactly (token counts and
    # histogram counts are integers), the ratio's sum to the last bit of its additions.
    assert {k for k, v in b_.items() if v} == {k for k, v in c_.items() if v}
    for key, v in c_.items():
        assert b_[key] == (pytest.approx(v, rel=1e-12) if key[0].endswith("_sum") else v), key
    # ... and so is every request's own finding.
    for i, (shared_line, one_line) in enumerate(zip(logs["b"], logs["c"], strict=True)):
        assert {k: shared_line[k] for k in FINDING} == {k: one_line[k] for k in FINDING}, i
    repeated = "llm_proxy_prompt_repeated_tokens_total"
    missed = "llm_proxy_prompt_cache_missed_tokens_total"
    breaks = "llm_proxy_prompt_prefix_breaks_total"
    assert total(c_, repeated) > 0 and total(c_, missed) > 0
    # What the workload holds, as one process sees it.
    reasons = Counter(line["prefix_break"] for line in logs["c"])
    assert reasons["first_seen"] == 1  # the others share the tools and the system prompt
    assert reasons["variable_before_stable"] >= TURNS - 1
    assert reasons["message_changed"] >= 1 and reasons["model_changed"] == 1
    # (a): each replica finds only what it served itself, far less than the whole.
    assert total(a_, repeated) < 0.8 * total(c_, repeated)
    assert total(a_, breaks, reason="first_seen") > total(c_, breaks, reason="first_seen")
    # ... and reports breaks that are not there: a turn whose previous turn it never saw
    # looks like an edit of an older one.
    assert total(a_, breaks, reason="message_changed") > total(c_, breaks,
                                                               reason="message_changed")
    grown = [i for i, line in enumerate(logs["c"]) if line["prefix_break"] is None
             and line["repeated_prefix_bytes"] > len(SYSTEM) + 2000]
    missed_by_a = [i for i in grown if logs["a"][i]["repeated_prefix_bytes"]
                   < logs["c"][i]["repeated_prefix_bytes"]]
    assert len(missed_by_a) >= len(grown) // 2, (grown, missed_by_a)


def test_a_store_down_at_start_killed_and_back_costs_counted_misses_never_a_byte(
        tmp_path: Path) -> None:
    store = RedisServer(tmp_path)  # not started: down when the replicas start
    with ScriptedUpstream(upstream).running() as up:
        config = write_config(tmp_path / "shared.toml", up.url, store, timeout_ms=500,
                              retry_ms=100)
        try:
            with replicas(config, 2, tmp_path, "r", {PREFIX_SECRET_ENV: SECRET}) as targets:
                phases, metrics = drive(targets, store)
            lines = in_order(targets)
        finally:
            store.kill()
    why = [line["prefix_unchecked"] for line in lines]
    down_at_start, back, killed, _ = phases
    assert all(w in ("store_error", "store_down") for w in why[:down_at_start])
    assert why[:down_at_start].count("store_error") >= 2  # each replica tried, once at least
    assert all(line["outcome"] == "completed" for line in lines)
    # Back: the conversation's next turn, sent to the other replica, is found whole.
    grown = lines[back - 1]
    assert grown["prefix_unchecked"] is None and grown["prefix_break"] is None
    assert grown["repeated_prefix_bytes"] > len(SYSTEM)
    assert all(w in ("store_error", "store_down") for w in why[back:killed])
    assert why[back:killed].count("store_error") >= 2
    assert why[-1] is None
    counted = Counter(w for w in why if w)
    for reason, n in counted.items():
        assert total(metrics, "llm_proxy_prompt_prefix_unchecked_total", reason=reason) == n
    assert sum(counted.values()) == total(metrics, "llm_proxy_prompt_prefix_unchecked_total")


def drive(targets: list[Replica], store: RedisServer
          ) -> tuple[tuple[int, int, int, int], Counter[Any]]:
    """The store's life under two replicas; returns where each phase ended (requests
    sent so far: down at start, back, killed, back again) and the replicas' metrics."""
    client = RoundRobin(targets)

    def send(body: dict[str, Any]) -> None:
        assert client.send(body) == expected_bytes(body)  # relayed, byte for byte

    def until(examined: Callable[[Counter[Any]], bool], bodies: Iterator[dict[str, Any]]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            send(next(bodies))
            if examined(summed(targets)):
                return
        pytest.fail("the doctor did not come back with the store")

    def ok_per_replica(metrics_of: list[dict[Any, float]]) -> list[float]:
        return [sum(v for (n, lbls), v in m.items()
                    if n == "llm_proxy_prompt_prefix_index_seconds_count"
                    and dict(lbls).get("result") == "ok") for m in metrics_of]

    def every_replica_examined_since(before: list[float]) -> Callable[[Counter[Any]], bool]:
        def check(_: Counter[Any]) -> bool:
            now = ok_per_replica([r.metrics(INDEX) for r in targets])
            return all(n > b for n, b in zip(now, before, strict=True))
        return check

    filler = (request(i % len(WORKLOAD)) for i in range(10_000))
    try:
        for body in WORKLOAD[:4]:  # down at start
            send(body)
        down_at_start = client.sent
        store.start()
        until(every_replica_examined_since([0.0] * len(targets)), filler)
        # One conversation's turn on one replica, its next turn on the other: found.
        send(request(40))  # conversation 0, turn 10, to one replica
        send(request(44))  # its turn 11, to the other

        back = client.sent
        store.kill()
        for body in WORKLOAD[:6]:  # killed mid-run
            send(body)
        killed = client.sent
        store.start()
        until(every_replica_examined_since(ok_per_replica([r.metrics(INDEX) for r in targets])),
              filler)
        back_again = client.sent
        metrics = summed(targets)
    finally:
        client.close()
    return (down_at_start, back, killed, back_again), metrics
