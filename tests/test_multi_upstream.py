"""Several upstreams behind one proxy, in process, on the production path: the settings
come from a real config file (``from_sources``), each upstream is the suite's scripted
loopback server (tests/fake_upstream.py), and the production upstream client talks to
them. Times are scripted (lockstep clock), so each upstream's TTFT is exact."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import textwrap
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import ProxyApp, create_app
from proxy.clients import fingerprint
from proxy.config import from_sources
from tests.fake_upstream import Handler, ScriptedClock, ScriptedUpstream
from tests.upstream_fakes import (
    CHAT,
    SSE_HEADERS,
    call_raw,
    chunk_json,
    histogram,
    lazy,
    sse,
    timed_body,
    usage_json,
)

pytestmark = pytest.mark.anyio

T0 = 64.0
MESSAGES = "/v1/messages"
CLIENT_KEY = "cli-key-0123456789"
KEYS = {"TEST_MU_KEY_A": "sk-upstream-a", "TEST_MU_KEY_B": "sk-upstream-b",
        "LLM_PROXY_FINGERPRINT_SECRET": "fp-secret"}


def chat_stream(clock: ScriptedClock, first: float, gap: float, n: int = 3,
                hold: asyncio.Event | None = None) -> Handler:
    """A chat stream: headers at T0, a role chunk, then ``n`` tokens from ``first`` on."""
    async def respond(request: httpx.Request) -> httpx.Response:
        clock.now = T0
        script = [(T0, sse(chunk_json({"role": "assistant"})))]
        script += [(first + i * gap, sse(chunk_json({"content": f"t{i}"}))) for i in range(n)]
        script += [(first + n * gap, sse(usage_json(5, n))), (first + n * gap, b"data: [DONE]\n\n")]
        return httpx.Response(200, headers=SSE_HEADERS,
                              content=timed_body(clock, script, first + n * gap, hold=hold))

    return respond


def json_answer(status: int, payload: Any) -> Handler:
    async def respond(request: httpx.Request) -> httpx.Response:
        body = json.dumps(payload).encode()
        return httpx.Response(status, headers={"content-type": "application/json",
                                               "content-length": str(len(body))},
                              content=lazy(body))

    return respond


@dataclass
class Stack:
    app: ProxyApp
    registry: CollectorRegistry
    a: ScriptedUpstream
    b: ScriptedUpstream
    path: Path

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                 base_url="http://proxy.test")


@asynccontextmanager
async def two_upstreams(tmp_path: Path, clock: ScriptedClock, handler_a: Handler,
                        handler_b: Handler, text: Callable[[str, str], str], *,
                        monkeypatch: pytest.MonkeyPatch, **env: str) -> AsyncIterator[Stack]:
    """Upstreams A and B on loopback, the proxy configured by ``text(url_a, url_b)``."""
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    a, b = ScriptedUpstream(handler_a, clock), ScriptedUpstream(handler_b, clock)
    path = tmp_path / "proxy.toml"
    path.write_text(textwrap.dedent(text(a.url + "/v1", b.url + "/v1")))
    settings = from_sources(None, {"LLM_PROXY_CONFIG": str(path), **KEYS, **env})
    registry = CollectorRegistry()
    app = create_app(settings, registry=registry, clock=clock)
    try:
        await a.start()
        await b.start()
        yield Stack(app, registry, a, b, path)
    finally:
        await app.aclose()
        await a.aclose()
        await b.aclose()


def plain(url_a: str, url_b: str) -> str:
    return f"""
    [[upstream]]
    name = "fast"
    url = "{url_a}"
    models = ["gpt-*"]

    [[upstream]]
    name = "slow"
    url = "{url_b}"
    models = ["claude-*", "llama-3"]
    """


def body(model: str, stream: bool = True) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


def lbl(upstream: str, model: str, route: str = CHAT) -> dict[str, str]:
    return {"route": route, "model": model, "upstream": upstream}


async def test_each_model_goes_to_its_upstream_and_the_label_carries_its_own_ttft(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ScriptedClock()
    async with two_upstreams(tmp_path, clock, chat_stream(clock, T0 + 0.125, 0.0078125),
                             chat_stream(clock, T0 + 1.5, 0.0625), plain,
                             monkeypatch=monkeypatch) as s, s.http() as http:
        for model in ("gpt-4o", "claude-3", "llama-3", "gpt-4o"):
            clock.now = T0
            r = await http.post(CHAT, json=body(model))
            assert r.status_code == 200 and b"data: [DONE]" in r.content
        assert [r.model for r in s.a.requests] == ["gpt-4o", "gpt-4o"]
        assert [r.model for r in s.b.requests] == ["claude-3", "llama-3"]
        ttft = "llm_proxy_time_to_first_token_seconds"
        fast = histogram(s.registry, ttft, lbl("fast", "gpt-4o"))
        assert (fast.count, fast.sum) == (2, 0.25)
        slow = histogram(s.registry, ttft, lbl("slow", "claude-3"))
        assert (slow.count, slow.sum) == (1, 1.5)
        itl = histogram(s.registry, "llm_proxy_inter_token_latency_seconds", lbl("slow", "llama-3"))
        assert (itl.count, itl.sum) == (2, 0.125)
        # each upstream's in-flight gauge went up and came back down
        for name in ("fast", "slow"):
            assert s.registry.get_sample_value("llm_proxy_in_flight_requests",
                                               {"upstream": name}) == 0


async def test_a_model_nobody_serves_is_a_404_that_reaches_no_upstream(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ScriptedClock()
    async with two_upstreams(tmp_path, clock, chat_stream(clock, T0, 0.0),
                             chat_stream(clock, T0, 0.0), plain,
                             monkeypatch=monkeypatch) as s, s.http() as http:
        r = await http.post(CHAT, json=body("mistral-large"))
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
        assert "mistral-large" in error["message"]
        assert "127.0.0.1" not in error["message"]  # no upstream address in the answer
        r = await http.post("/v1/embeddings", json={"input": "x"})  # no model, no default
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert not s.a.requests and not s.b.requests
        assert s.registry.get_sample_value("llm_proxy_requests_total", {
            **lbl("none", "mistral-large"), "stream": "true", "code": "404"}) == 1


@pytest.mark.parametrize(("route", "content", "message"), [
    (CHAT, b'{"model": "gpt-4o", "stream": true,}',
     "the request body is not valid JSON (Expecting property name enclosed in double quotes: "
     "line 1 column 36)"),
    (MESSAGES, b"model=claude-3", "the request body is not valid JSON (Expecting value: line 1 "
     "column 1)"),
    (CHAT, b'[{"model": "gpt-4o"}]', "the request body is JSON (an array) but not an object"),
    ("/v1/embeddings", b'{"model": "gpt-4o", "input": "x"', "the request body is not valid JSON "
     "(Expecting ',' delimiter: line 1 column 33)"),
])
async def test_a_body_that_is_not_a_json_object_with_no_default_is_a_400_saying_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str, content: bytes,
        message: str) -> None:
    """With no default upstream such a body cannot be routed; the answer says why (with a
    default it is forwarded unchanged, tests/test_proxy_inprocess.py)."""
    clock = ScriptedClock()
    answer = json_answer(200, {"id": "x"})
    async with two_upstreams(tmp_path, clock, answer, answer, plain,
                             monkeypatch=monkeypatch) as s, s.http() as http:
        r = await http.post(route, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": message + ", so it names no model to route by (and no upstream is the "
            "default)", "type": "invalid_request_error", "param": None, "code": "invalid_json"}
        # A body that is not meant as JSON (a multipart upload) is still unroutable, not invalid.
        r = await http.post("/v1/audio/transcriptions", content=b"--b\r\nmodel\r\n--b--\r\n",
                            headers={"content-type": "multipart/form-data; boundary=b"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert not s.a.requests and not s.b.requests


def with_keys(url_a: str, url_b: str) -> str:
    return f"""
    [[upstream]]
    name = "openai"
    url = "{url_a}"
    models = ["gpt-*"]
    api_key_env = "TEST_MU_KEY_A"
    default = true
    headers = {{ OpenAI-Organization = "org-proxy" }}

    [[upstream]]
    name = "anthropic"
    url = "{url_b}"
    models = ["claude-*"]
    routes = ["/v1/messages"]
    api_key_env = "TEST_MU_KEY_B"
    auth = "x-api-key"
    headers = {{ anthropic-version = "2023-06-01" }}
    """


async def test_each_upstream_gets_its_own_key_in_its_own_header_and_its_headers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "client-keys"
    keys.write_text(hashlib.sha256(CLIENT_KEY.encode()).hexdigest() + "\n")
    clock = ScriptedClock()
    async with two_upstreams(tmp_path, clock, json_answer(200, {"id": "a"}),
                             json_answer(200, {"id": "b"}), with_keys, monkeypatch=monkeypatch,
                             LLM_PROXY_CLIENT_KEYS_FILE=str(keys)) as s, s.http() as http:
        me = {"authorization": f"Bearer {CLIENT_KEY}"}
        r = await http.post(CHAT, json=body("gpt-4o", stream=False),
                            headers={**me, "openai-organization": "org-client"})
        assert r.status_code == 200
        r = await http.post(MESSAGES, json=body("claude-3", stream=False),
                            headers={"x-api-key": CLIENT_KEY, "anthropic-version": "2020-01-01"})
        assert r.status_code == 200
        r = await http.post(CHAT, json=body("claude-3", stream=False), headers=me)
        assert r.status_code == 200  # anthropic serves only /v1/messages: the default took it
        r = await http.post(CHAT, json=body("gpt-4o"), headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        (first, third), (second,) = s.a.requests, s.b.requests
        assert first.header_values("authorization") == ["Bearer sk-upstream-a"]
        assert first.header_values("openai-organization") == ["org-proxy"]  # config wins
        assert first.header("x-api-key") is None
        assert second.header_values("x-api-key") == ["sk-upstream-b"]
        assert second.header("authorization") is None
        assert second.header_values("anthropic-version") == ["2023-06-01"]
        assert third.model == "claude-3"
        for seen in (first, second, third):
            assert CLIENT_KEY not in repr(seen.headers)


async def test_routes_match_the_real_path_and_the_model_list_asks_only_who_serves_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``routes = ["/v1/messages"]`` takes what lies under it (count_tokens, batches),
    whose route label is ``/v1/{other}``: it used to be matched against the label, so
    count_tokens went to the default upstream with the Anthropic key's header. And the
    merged ``GET /v1/models`` asks only the upstreams whose routes take it: one that
    serves Messages alone is neither asked (nor sent the client's key) nor listed."""
    clock = ScriptedClock()

    def passthrough(url_a: str, url_b: str) -> str:
        return f"""
        [[upstream]]
        name = "openai"
        url = "{url_a}"
        models = ["gpt-*"]
        default = true

        [[upstream]]
        name = "vllm"
        url = "{url_a}"
        models = ["llama-*"]

        [[upstream]]
        name = "anthropic"
        url = "{url_b}"
        models = ["claude-*"]
        routes = ["/v1/messages"]
        """

    listing = {"object": "list", "data": [{"id": "gpt-4o"}]}
    async with two_upstreams(tmp_path, clock, json_answer(200, listing),
                             json_answer(200, {"input_tokens": 3}), passthrough,
                             monkeypatch=monkeypatch) as s, s.http() as http:
        ant = {"x-api-key": "sk-ant-client"}
        for path in ("/v1/messages/count_tokens", "/v1/messages/batches"):
            r = await http.post(path, json=body("claude-3", stream=False), headers=ant)
            assert r.status_code == 200 and s.b.requests[-1].target == path
        assert not s.a.requests  # none of it reached the other upstream, nor its key
        r = await http.get("/v1/models", headers={"authorization": "Bearer sk-openai-client"})
        assert r.status_code == 200 and r.json()["data"] == [{"id": "gpt-4o"}]
        assert [x.target for x in s.a.requests] == ["/v1/models", "/v1/models"]  # both on A
        assert [x.target for x in s.b.requests] == ["/v1/messages/count_tokens",
                                                     "/v1/messages/batches"]


async def test_admission_is_per_upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ScriptedClock()
    hold = asyncio.Event()

    def limited(url_a: str, url_b: str) -> str:
        return plain(url_a, url_b).replace('models = ["gpt-*"]',
                                           'models = ["gpt-*"]\n    max_concurrency = 1')

    async with two_upstreams(tmp_path, clock, chat_stream(clock, T0 + 0.5, 0.0, hold=hold),
                             chat_stream(clock, T0 + 0.25, 0.0), limited,
                             monkeypatch=monkeypatch) as s:
        fast = next(t for t in s.app.upstreams.targets if t.name == "fast")
        slow = next(t for t in s.app.upstreams.targets if t.name == "slow")
        payload = json.dumps(body("gpt-4o")).encode()
        first = asyncio.create_task(call_raw(s.app, "POST", CHAT, body=payload))
        for _ in range(10_000):
            if s.a.requests:
                break
            await asyncio.sleep(0)
        second = asyncio.create_task(call_raw(s.app, "POST", CHAT, body=payload))
        for _ in range(10_000):
            if fast.admission.waiting:
                break
            await asyncio.sleep(0)
        assert fast.admission.waiting == 1 and fast.admission.active == 1
        # the other upstream is not held up by the first one's queue
        other = await call_raw(s.app, "POST", CHAT, body=json.dumps(body("claude-3")).encode())
        assert other.status == 200 and slow.admission.active == 0
        assert fast.admission.waiting == 1
        hold.set()
        results = await asyncio.gather(first, second)
        assert [r.status for r in results] == [200, 200]
        queue = histogram(s.registry, "llm_proxy_queue_time_seconds",
                          {**lbl("fast", "gpt-4o"), "stream": "true"})
        assert queue.count == 2 and queue.sum > 0


async def test_model_list_is_the_union_and_an_upstream_down_is_left_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock = ScriptedClock()
    a_models = {"object": "list", "data": [{"id": "gpt-4o", "owned_by": "a"},
                                           {"id": "shared", "owned_by": "a"}]}
    b_models = {"data": [{"id": "claude-3", "type": "model"}, {"id": "shared", "owned_by": "b"}],
                "has_more": False}
    async with two_upstreams(tmp_path, clock, json_answer(200, a_models),
                             json_answer(200, b_models), plain,
                             monkeypatch=monkeypatch) as s, s.http() as http:
        r = await http.get("/v1/models")
        assert r.status_code == 200
        assert r.json() == {"object": "list", "data": [
            {"id": "gpt-4o", "owned_by": "a"}, {"id": "shared", "owned_by": "a"},
            {"id": "claude-3", "type": "model"}]}
        assert [x.target for x in s.a.requests] == ["/v1/models"]
        # /v1/models/{id} goes where that model lives
        r = await http.get("/v1/models/claude-3")
        assert r.status_code == 200 and s.b.requests[-1].target == "/v1/models/claude-3"
        await s.b.aclose()  # B is down now
        r = await http.get("/v1/models")
        assert r.status_code == 200
        assert [m["id"] for m in r.json()["data"]] == ["gpt-4o", "shared"]
        assert "model list: upstream slow left out" in caplog.text
        await s.a.aclose()
        r = await http.get("/v1/models")
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_failed"


async def test_a_key_every_upstream_refuses_gets_the_model_list_refused_not_a_502(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy holds no key, and the client's is wrong: both upstreams answer 401.
    The merged list answers the first refusal as it came (the client's to mend, where
    a 502 upstream_failed counted toward the 5xx alert); one upstream answering is still
    the list."""
    clock = ScriptedClock()
    refused = {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                         "code": "invalid_api_key"}}
    listing = {"object": "list", "data": [{"id": "claude-3"}]}
    async with two_upstreams(tmp_path, clock, json_answer(401, refused),
                             json_answer(401, refused), plain,
                             monkeypatch=monkeypatch) as s, s.http() as http:
        r = await http.get("/v1/models", headers={"authorization": "Bearer sk-wrong"})
        assert (r.status_code, r.json()) == (401, refused)
        outcomes = s.registry.get_sample_value("llm_proxy_requests_total", {
            "route": "/v1/models", "model": "unknown", "upstream": "all", "stream": "false",
            "code": "401"})
        assert outcomes == 1
        s.b.handler = json_answer(200, listing)  # one upstream takes the key now
        r = await http.get("/v1/models", headers={"authorization": "Bearer sk-wrong"})
        assert (r.status_code, r.json()["data"]) == (200, [{"id": "claude-3"}])


async def test_client_label_from_a_header_is_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ScriptedClock()
    async with two_upstreams(tmp_path, clock, json_answer(200, {}), json_answer(200, {}), plain,
                             monkeypatch=monkeypatch, LLM_PROXY_CLIENT_LABEL_FROM="header:X-Team",
                             LLM_PROXY_MAX_CLIENTS="50") as s, s.http() as http:
        await http.post(CHAT, json=body("gpt-4o", stream=False), headers={"x-team": "search"})
        await http.post(CHAT, json=body("gpt-4o", stream=False))  # no header
        rng = random.Random(7)
        for _ in range(1000):
            team = "".join(rng.choice("abcdefghij0123456789") for _ in range(12))
            await http.post(CHAT, json=body("gpt-4o", stream=False), headers={"x-team": team})
        values = {sample.labels["client"]
                  for metric in s.registry.collect() if metric.name == "llm_proxy_requests"
                  for sample in metric.samples}
        assert {"search", "unknown", "other"} <= values
        assert len(values) == 50 + 1  # 50 kept (unknown among them), then other
        assert s.registry.get_sample_value("llm_proxy_requests_total", {
            **lbl("fast", "gpt-4o"), "client": "search", "stream": "false", "code": "200"}) == 1
        # the labels that do not say who is waiting stay without it
        names = {m.name: m for m in s.registry.collect()}
        assert all("client" not in smp.labels for smp in names["llm_proxy_overhead_seconds"].samples)


async def test_client_label_from_the_key_is_a_keyed_fingerprint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ScriptedClock()
    async with two_upstreams(tmp_path, clock, chat_stream(clock, T0 + 0.25, 0.0),
                             json_answer(200, {}), plain, monkeypatch=monkeypatch,
                             LLM_PROXY_CLIENT_LABEL_FROM="key") as s, s.http() as http:
        clock.now = T0
        r = await http.post(CHAT, json=body("gpt-4o"), headers={"authorization": f"Bearer {CLIENT_KEY}"})
        assert r.status_code == 200
        expected = fingerprint(b"fp-secret", CLIENT_KEY.encode())
        ttft = histogram(s.registry, "llm_proxy_time_to_first_token_seconds",
                         {**lbl("fast", "gpt-4o"), "client": expected})
        assert (ttft.count, ttft.sum) == (1, 0.25)
        label = expected.removeprefix("key-")
        assert CLIENT_KEY not in expected
        assert label not in hashlib.sha256(CLIENT_KEY.encode()).hexdigest()  # not a plain hash
        assert label not in hashlib.md5(CLIENT_KEY.encode()).hexdigest()
        assert fingerprint(b"other-secret", CLIENT_KEY.encode()) != expected
        exposition = s.app.metrics.exposition(None)[0] if s.app.metrics else b""
        assert CLIENT_KEY.encode() not in exposition


async def test_reload_keeps_a_stream_in_flight_and_routes_the_next_request_anew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock = ScriptedClock()
    hold = asyncio.Event()
    async with two_upstreams(tmp_path, clock, chat_stream(clock, T0 + 0.5, 0.0, hold=hold),
                             chat_stream(clock, T0 + 0.75, 0.0), plain,
                             monkeypatch=monkeypatch) as s:
        messages: list[Any] = []
        payload = json.dumps(body("gpt-4o")).encode()
        first = asyncio.create_task(call_raw(s.app, "POST", CHAT, body=payload, record=messages))
        for _ in range(10_000):  # until the held stream has sent its tokens
            if sum(1 for m in messages if b"t2" in m.get("body", b"")):
                break
            await asyncio.sleep(0)
        old_fast = next(t for t in s.app.upstreams.targets if t.name == "fast")
        # gpt-* moves to the slow upstream
        s.path.write_text(s.path.read_text().replace('["gpt-*"]', '["gpt-3*"]').replace(
            '["claude-*", "llama-3"]', '["claude-*", "llama-3", "gpt-*"]'))
        assert s.app.reload()
        assert old_fast.closing and old_fast.active == 1
        hold.set()
        result = await first
        assert result.status == 200 and result.body.endswith(b"data: [DONE]\n\n")
        clock.now = T0
        r = await call_raw(s.app, "POST", CHAT, body=payload)
        assert r.status == 200
        assert [x.model for x in s.b.requests] == ["gpt-4o"]
        assert old_fast.active == 0
        # a bad file is refused, and the running table stays
        s.path.write_text("[[upstream]\n")
        assert not s.app.reload()
        assert "config reload refused, the running upstreams stay" in caplog.text
        clock.now = T0
        r = await call_raw(s.app, "POST", CHAT, body=payload)
        assert r.status == 200 and len(s.b.requests) == 2
