"""The proxy in process: ``httpx.ASGITransport`` in front, the suite's scripted upstream
behind (tests/fake_upstream.py: a real loopback server, so the production upstream client
runs, exactly as users run it).

ASGITransport joins the response body, so timing is asserted only through the scripted
clock (see tests/upstream_fakes.py): the fake upstream sets the clock before each
chunk, and every expected metric is computed from that script. Where the app ends a
response without completing it (the upstream broke mid-stream), the app is driven
directly with a recording ``send`` instead. Every app is used as ``async with app:``, so
its upstream client and the scripted server are closed however the test ends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.config import QUEUE_BUCKETS, Settings
from proxy.measure import tpot
from proxy.upstream import error_body
from tests import upstream_fakes as fakes
from tests.upstream_fakes import (
    CHAT,
    COMPLETIONS,
    SSE_HEADERS,
    UPSTREAM_LABEL,
    FakeUpstream,
    InProcess,
    ScriptedClock,
    call_raw,
    chunk_json,
    expected_buckets,
    histogram,
    json_upstream,
    labels,
    lazy,
    make_app,
    sse,
    text_json,
    usage_json,
)

pytestmark = pytest.mark.anyio

T0 = 64.0  # when the proxy receives the request
BODY_READ = 1 / 512  # when it has the whole body: the overhead with no queueing



def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy.test")


class BodyClock:
    """ASGI wrapper: the clock moves to ``T0 + BODY_READ`` when the body has been read."""

    def __init__(self, app: InProcess, clock: ScriptedClock) -> None:
        self.app = app
        self.clock = clock

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def timed_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                self.clock.now = T0 + BODY_READ
            return message

        self.clock.now = T0
        await self.app(scope, timed_receive, send)


async def until_queued(app: InProcess, count: int = 1) -> None:
    """Run the loop until ``count`` requests wait for a slot (loop passes, not time)."""
    for _ in range(10_000):
        if app.admission.waiting >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError("no request ever queued")


def stream_request(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "stream": True,
            "messages": [{"role": "user", "content": "SECRET PROMPT TEXT"}], **extra}


# A chat stream: role-only chunk, outputs of several kinds, finish, usage, [DONE].
OUTPUT_TIMES = [T0 + 0.5, T0 + 0.5078125, T0 + 0.53125, T0 + 0.6875, T0 + 1.25]
USAGE = usage_json(13, 21, cached=8)


def chat_script(usage: dict[str, Any] | None = USAGE, eol: bytes = b"\n"
                ) -> list[tuple[float, bytes]]:
    deltas: list[dict[str, Any]] = [{"reasoning_content": "hm"}, {"content": "Hel"}, {"content": "lo"},
              {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
              {"refusal": "no"}]
    script = [(T0 + 0.25, sse(chunk_json({"role": "assistant"}), eol))]
    script += [(t, sse(chunk_json(d), eol)) for t, d in zip(OUTPUT_TIMES, deltas, strict=True)]
    script.append((T0 + 1.375, sse(chunk_json({}, finish="stop"), eol)))
    if usage is not None:
        script.append((T0 + 1.5, sse(usage, eol)))
    script.append((T0 + 1.625, b"data: [DONE]" + eol + eol))
    return script


STREAM_END = T0 + 1.75


def sse_upstream(clock: ScriptedClock, script: Sequence[tuple[float, bytes]], *,
                 end: float | None = STREAM_END, **kwargs: Any) -> FakeUpstream:
    return fakes.sse_upstream(clock, script, headers_at=T0 + 0.125, end=end, **kwargs)


def strip_event(stream: bytes, event: bytes) -> bytes:
    assert stream.count(event) == 1
    return stream.replace(event, b"")


async def post(app: Any, path: str, payload: Any, **kwargs: Any) -> httpx.Response:
    async with client_for(app) as client:
        return await client.post(path, content=json.dumps(payload).encode(), **kwargs)


# ---------------------------------------------------------------------------
# Byte identity and the usage injection


async def test_bytes_identical_when_client_asked_for_usage() -> None:
    clock = ScriptedClock()
    script = chat_script()
    up = sse_upstream(clock, script)
    app, _ = make_app(up, clock)
    async with app:
        request = stream_request(stream_options={"include_usage": True})
        raw = json.dumps(request).encode()
        async with client_for(app) as client:
            response = await client.post(CHAT, content=raw)
        assert response.status_code == 200
        assert response.content == b"".join(c for _, c in script)
        assert up.seen[0].body == raw  # nothing injected, body bytes untouched


async def test_bytes_identical_with_injection_off() -> None:
    clock = ScriptedClock()
    script = chat_script(usage=None)
    up = sse_upstream(clock, script)
    app, registry = make_app(up, clock, inject_usage=False)
    async with app:
        raw = json.dumps(stream_request()).encode()
        async with client_for(app) as client:
            response = await client.post(CHAT, content=raw)
        assert response.content == b"".join(c for _, c in script)
        assert up.seen[0].body == raw
        # no usage: completion tokens are the output-bearing events, prompt an estimate
        completion = histogram(registry, "llm_proxy_completion_tokens", labels())
        assert completion.sum == len(OUTPUT_TIMES)
        prompt = histogram(registry, "llm_proxy_prompt_tokens", labels())
        assert prompt.count == 1


async def test_injection_asks_for_usage_and_strips_the_usage_event() -> None:
    clock = ScriptedClock()
    script = chat_script()
    up = sse_upstream(clock, script)
    app, registry = make_app(up, clock)
    async with app:
        request = stream_request(stream_options={"other": 1}, temperature=0.5)
        response = await post(app, CHAT, request)
        upstream_stream = b"".join(c for _, c in script)
        assert response.content == strip_event(upstream_stream, sse(USAGE))
        sent = up.seen[0].json
        assert sent["stream_options"] == {"other": 1, "include_usage": True}
        assert {k: v for k, v in sent.items() if k != "stream_options"} == {
            k: v for k, v in request.items() if k != "stream_options"}
        # the length header of the upstream cannot hold for the shortened body
        assert "content-length" not in response.headers
        assert histogram(registry, "llm_proxy_completion_tokens", labels()).sum == 21


async def test_injection_when_include_usage_is_false() -> None:
    clock = ScriptedClock()
    up = sse_upstream(clock, chat_script())
    app, _ = make_app(up, clock)
    async with app:
        await post(app, CHAT, stream_request(stream_options={"include_usage": False}))
        assert up.seen[0].json["stream_options"] == {"include_usage": True}


async def test_a_body_that_would_not_encode_as_json_goes_out_as_it_came() -> None:
    """1e400 is JSON, but decodes as an infinity that json writes back as Infinity,
    which is not: no usage request is added, the bytes go to the upstream unchanged."""
    clock = ScriptedClock()
    up = sse_upstream(clock, chat_script())
    app, _ = make_app(up, clock)
    async with app:
        raw = json.dumps(stream_request()).encode().replace(b"{", b'{"temperature":1e400,', 1)
        async with client_for(app) as client:
            response = await client.post(CHAT, content=raw)
        assert response.status_code == 200
        assert up.seen[0].body == raw


@pytest.mark.parametrize("body", [
    {"error": {"message": "model overloaded", "type": "server_error", "code": None}},
    {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
    {"error": "overloaded"},
])
async def test_an_error_object_answered_200_is_an_upstream_error(body: dict[str, Any]) -> None:
    """Some servers answer a failure with status 200 and an error object, as JSON, to a
    stream request: it is no completed stream."""
    clock = ScriptedClock()
    raw = json.dumps(body).encode()
    app, registry = make_app(json_upstream(200, raw), clock)
    async with app:
        response = await post(app, CHAT, stream_request())
        assert response.status_code == 200 and response.content == raw
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(outcome="upstream_error")) == 1
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(outcome="completed")) == 0


async def test_no_injection_for_non_streaming() -> None:
    clock = ScriptedClock()
    up = json_upstream(200, json.dumps({"choices": [], "usage": USAGE["usage"]}).encode())
    app, _ = make_app(up, clock)
    async with app:
        raw = json.dumps({"model": "m", "messages": []}).encode()
        async with client_for(app) as client:
            await client.post(CHAT, content=raw)
        assert up.seen[0].body == raw


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["lf", "crlf"])
async def test_stripping_whatever_the_chunking(eol: bytes) -> None:
    """Every 2-way split in and around the usage event (the CRLF split too), and some
    elsewhere; the parser's own tests cover every split point of every stream."""
    clock = ScriptedClock()
    script = chat_script(eol=eol)
    stream = b"".join(c for _, c in script)
    event = sse(USAGE, eol)
    start = stream.index(event)
    expected = strip_event(stream, event)
    end = start + len(event)
    cuts = sorted({*range(start - 8, start + 9), *range(start, end, 13),
                   *range(end - 8, end + 9), *range(1, len(stream), 61)})
    failures = []
    for cut in cuts:
        pieces = [(T0 + 0.5, stream[:cut]), (T0 + 1.0, stream[cut:])]
        up = sse_upstream(clock, pieces)
        app, registry = make_app(up, clock)
        async with app:
            response = await post(app, CHAT, stream_request())
            if response.content != expected:
                failures.append(cut)
            tokens = histogram(registry, "llm_proxy_completion_tokens", labels())
            assert tokens.sum == 21, cut
    assert failures == []


async def test_stripping_with_three_way_splits_around_the_usage_event() -> None:
    clock = ScriptedClock()
    script = chat_script(eol=b"\r\n")
    stream = b"".join(c for _, c in script)
    event = sse(USAGE, b"\r\n")
    start = stream.index(event)
    expected = stream.replace(event, b"")
    end = start + len(event)
    around = [*range(start - 2, start + 3), len(b"data: ") + start + 7, *range(end - 3, end + 2)]
    for a, b in itertools.combinations(around, 2):
        pieces = [(T0 + 0.5, stream[:a]), (T0 + 0.75, stream[a:b]), (T0 + 1.0, stream[b:])]
        app, _ = make_app(sse_upstream(clock, pieces), clock)
        async with app:
            response = await post(app, CHAT, stream_request())
            assert response.content == expected, (a, b)


async def test_stripping_passes_an_over_long_event_through() -> None:
    """An event longer than the parser's limit is forwarded whole (never held, never
    removed) and the usage event after it is still removed."""
    clock = ScriptedClock()
    huge = sse(chunk_json({"content": "x" * ((1 << 20) + 4096)}))
    stream = b"".join(c for _, c in chat_script()[:2]) + huge + b"".join(
        c for _, c in chat_script()[2:])
    step = 1 << 16
    pieces = [(T0 + 0.5 + i / 1024, stream[i : i + step]) for i in range(0, len(stream), step)]
    app, registry = make_app(sse_upstream(clock, pieces), clock)
    async with app:
        response = await post(app, CHAT, stream_request())
        assert response.content == strip_event(stream, sse(USAGE))
        assert histogram(registry, "llm_proxy_completion_tokens", labels()).sum == 21


# ---------------------------------------------------------------------------
# Request and response headers


HOP_BY_HOP_REQUEST = [
    (b"connection", b"keep-alive, X-Drop-Me"),
    (b"x-drop-me", b"1"),
    (b"keep-alive", b"timeout=5"),
    (b"te", b"trailers"),
    (b"trailer", b"x-t"),
    (b"upgrade", b"h2c"),
    (b"proxy-authorization", b"Basic cHJveHk="),
    (b"proxy-connection", b"keep-alive"),
    (b"transfer-encoding", b"chunked"),
]
END_TO_END_REQUEST = [
    (b"authorization", b"Bearer sk-client-key"),
    (b"content-type", b"application/json"),
    (b"openai-organization", b"org-1"),
    (b"x-custom", b"a"),
    (b"x-custom", b"b"),
    (b"user-agent", b"my-app/1.0"),
    (b"accept", b"text/event-stream"),
]


@pytest.mark.parametrize(
    ("method", "path", "measured"),
    [("POST", CHAT, True), ("POST", COMPLETIONS, True), ("GET", "/v1/models", False),
     ("POST", "/v1/embeddings", False)],
)
async def test_request_headers(method: str, path: str, measured: bool) -> None:
    clock = ScriptedClock()
    up = json_upstream(200, b"{}")
    app, _ = make_app(up, clock)
    async with app:
        body = json.dumps({"model": "m"}).encode()
        headers = [(b"host", b"proxy.test:8080"), (b"content-length", str(len(body)).encode()),
                   (b"accept-encoding", b"gzip, br"), *HOP_BY_HOP_REQUEST, *END_TO_END_REQUEST]
        result = await call_raw(app, method, path, body=body, headers=headers)
        assert result.status == 200
        seen = up.seen[0]
        names = [k.lower() for k, _ in seen.headers]
        for name, _ in HOP_BY_HOP_REQUEST:
            assert name not in names, name
        assert seen.header_values("host") == [f"127.0.0.1:{app.scripted.port}"]
        assert seen.header_values("accept-encoding") == (["identity"] if measured else ["gzip, br"])
        assert seen.header_values("content-length") == [str(len(body))]
        # the end-to-end headers arrive as sent, in order, and nothing else is added
        rest = [(k.lower(), v) for k, v in seen.headers
                if k.lower() not in (b"host", b"accept-encoding", b"content-length")]
        assert rest == END_TO_END_REQUEST
        assert seen.method == method
        assert seen.body == body


async def test_no_default_headers_are_added_upstream() -> None:
    """A client that sends no Accept-Encoding must not be answered compressed."""
    clock = ScriptedClock()
    up = json_upstream(200, b"{}")
    app, _ = make_app(up, clock)
    async with app:
        await call_raw(app, "GET", "/v1/models", headers=[(b"host", b"proxy.test")])
        names = {k.lower() for k, _ in up.seen[0].headers}
        assert names == {b"host"}


@pytest.mark.parametrize(
    ("base_path", "path", "query", "target"),
    [
        ("/v1", "/v1/models", b"", "/v1/models"),
        ("/openai/v1", "/v1/files/file-1/content", b"a=1&b=x%20y",
         "/openai/v1/files/file-1/content?a=1&b=x%20y"),
        ("/v1", "/v1/chat/completions", b"api-version=2024", "/v1/chat/completions?api-version=2024"),
        ("/v1", "/v1", b"", "/v1"),
    ],
)
async def test_path_mapping_and_query(base_path: str, path: str, query: bytes, target: str) -> None:
    clock = ScriptedClock()
    up = json_upstream(200, b"{}")
    app, _ = make_app(up, clock, base_path=base_path)
    async with app:
        method = "POST" if path.endswith("completions") else "GET"
        result = await call_raw(app, method, path, query=query, body=b"{}" if method == "POST" else b"")
        assert result.status == 200
        assert up.seen[0].target == target


@pytest.mark.parametrize("path", ["/v1/../admin", "/v1/models/%2e%2e/x", "/v1/a%2Fb"])
async def test_paths_that_would_leave_the_base_are_refused(path: str) -> None:
    clock = ScriptedClock()
    up = json_upstream(200, b"{}")
    app, _ = make_app(up, clock)
    async with app:
        result = await call_raw(app, "GET", path)
        assert result.status == 400
        assert up.seen == []


async def test_response_headers() -> None:
    clock = ScriptedClock()
    script = chat_script(usage=None)
    up = sse_upstream(clock, script, headers={
        "connection": "close, X-Hop", "x-hop": "1", "keep-alive": "timeout=5",
        "x-request-id": "req-upstream-7", "openai-processing-ms": "12",
        "set-cookie": "a=b"})
    app, _ = make_app(up, clock)
    async with app:
        request = stream_request(stream_options={"include_usage": True})
        result = await call_raw(app, "POST", CHAT, body=json.dumps(request).encode())
        got = dict(result.headers)
        names = [k for k, _ in result.headers]
        for hop in (b"connection", b"x-hop", b"keep-alive", b"transfer-encoding"):
            assert hop not in names
        assert got[b"x-request-id"] == b"req-upstream-7"
        assert names.count(b"x-request-id") == 1
        assert got[b"openai-processing-ms"] == b"12"
        assert got[b"set-cookie"] == b"a=b"
        assert got[b"x-accel-buffering"] == b"no"
        assert got[b"content-type"] == SSE_HEADERS["content-type"].encode()


async def test_request_id_generated_when_upstream_has_none() -> None:
    clock = ScriptedClock()
    app, _ = make_app(json_upstream(200, b'{"data": []}'), clock)
    async with app:
        async with client_for(app) as client:
            first = await client.get("/v1/models")
            second = await client.get("/v1/models")
        ids = [r.headers.get("x-request-id") for r in (first, second)]
        assert all(ids) and ids[0] != ids[1]
        assert "x-accel-buffering" not in first.headers  # not an event stream
        assert first.content == b'{"data": []}'
        assert first.headers["content-length"] == str(len(first.content))


# ---------------------------------------------------------------------------
# Errors


def failing_upstream(how: str) -> FakeUpstream:
    """Fails before any byte of the answer: reset, silence, or nobody listening."""
    async def respond(request: httpx.Request) -> httpx.Response:
        if how == "silent":
            await asyncio.Event().wait()
        raise ConnectionResetError("reset before the headers")

    return FakeUpstream(respond)


@pytest.mark.parametrize(
    ("how", "status", "code", "outcome"),
    [("refused", 502, "upstream_unreachable", "upstream_unreachable"),
     ("silent", 504, "upstream_timeout", "upstream_timeout"),
     ("reset", 502, "upstream_failed", "upstream_interrupted")],
)
async def test_upstream_failures_before_headers(how: str, status: int, code: str,
                                                outcome: str) -> None:
    clock = ScriptedClock()
    up = failing_upstream(how)
    app, registry = make_app(up, clock, read_timeout=0.2)
    async with app:
        if how == "refused":
            await app.scripted.aclose()  # nobody listens on the port any more
        response = await post(app, CHAT, stream_request())
        assert response.status_code == status
        error = response.json()["error"]
        assert {"message", "type", "code"} <= set(error)
        assert error["code"] == code
        assert "127.0.0.1" in error["message"]  # the upstream host is named
        assert response.headers["content-type"] == "application/json"
        assert len(response.headers["x-request-id"]) == 32  # a fresh uuid4 hex
        assert registry.get_sample_value(
            "llm_proxy_requests_total", labels(stream="true", code=str(status))) == 1
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(outcome=outcome)) == 1


@pytest.mark.parametrize(
    ("status", "body", "content_type"),
    [(429, b'{"error": {"message": "slow down", "type": "rate_limit"}}', "application/json"),
     (401, b'{"error": {"message": "bad key"}}', "application/json"),
     (500, b"Internal Server Error", "text/plain"),
     (503, b"<html>busy</html>", "text/html")],
)
async def test_upstream_error_status_passed_through(status: int, body: bytes,
                                                    content_type: str) -> None:
    clock = ScriptedClock()
    up = json_upstream(status, body, {"content-type": content_type, "retry-after": "7"})
    app, registry = make_app(up, clock)
    async with app:
        response = await post(app, CHAT, stream_request())
        assert response.status_code == status
        assert response.content == body
        assert response.headers["content-type"] == content_type
        assert response.headers["retry-after"] == "7"
        # a first request refused for its key: its model name takes no label place
        model = "other" if status == 401 else "m"
        assert registry.get_sample_value("llm_proxy_requests_total",
                                         labels(model=model, stream="true",
                                                code=str(status))) == 1
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total",
            labels(model=model, outcome="upstream_4xx" if status < 500 else "upstream_5xx")) == 1
        assert histogram(registry, "llm_proxy_time_to_first_token_seconds",
                         labels(model=model)).count == 0


@pytest.mark.parametrize("body", [b"not json {", b"[1, 2, 3]", b'"str"', b"", b"\xff\xfe"])
async def test_body_not_a_json_object_forwarded_unchanged(body: bytes) -> None:
    clock = ScriptedClock()
    up = json_upstream(400, b'{"error": {"message": "bad body"}}')
    app, registry = make_app(up, clock)
    async with app:
        async with client_for(app) as client:
            response = await client.post(CHAT, content=body)
        assert response.status_code == 400
        assert up.seen[0].body == body
        assert registry.get_sample_value(
            "llm_proxy_requests_total", labels(model="unknown", stream="false", code="400")) == 1


async def test_body_too_large_with_content_length() -> None:
    clock = ScriptedClock()
    up = json_upstream(200, b"{}")
    app, registry = make_app(up, clock, max_body_bytes=100)
    async with app:
        body = json.dumps({"model": "m", "pad": "x" * 100}).encode()
        reads = 0
        sent: list[Any] = []

        async def receive() -> Any:
            nonlocal reads
            reads += 1
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": CHAT, "raw_path": CHAT.encode(),
                 "query_string": b"", "headers": [(b"content-length", str(len(body)).encode())]}
        await app(scope, receive, send)
        assert sent[0]["status"] == 413
        assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
        assert reads == 0  # refused on the declared length, nothing read
        assert up.seen == []
        assert registry.get_sample_value(
            "llm_proxy_requests_total", labels(model="unknown", stream="false", code="413")) == 1


async def test_body_too_large_chunked() -> None:
    clock = ScriptedClock()
    up = json_upstream(200, b"{}")
    app, _ = make_app(up, clock, max_body_bytes=100)
    async with app:

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield b"x" * 30

        async with client_for(app) as client:
            response = await client.post(CHAT, content=chunks())
        assert response.status_code == 413
        assert set(response.json()["error"]) >= {"message", "type", "code"}
        assert up.seen == []
        # exactly at the limit is fine
        async with client_for(app) as client:
            response = await client.post(CHAT, content=b"x" * 100)
        assert response.status_code == 200


# ---------------------------------------------------------------------------
# Labels: model cap, allow-list, route templates


async def test_model_cardinality_cap() -> None:
    clock = ScriptedClock()
    app, registry = make_app(json_upstream(200, b"{}"), clock, max_models=2)
    async with app:
        models = ["m1", "m2", "m3", "m1", "m4", "m2"]
        for model in models:
            await post(app, CHAT, {"model": model})
        expected: dict[str, int] = {}
        for model in models:
            label = model if model in ("m1", "m2") else "other"
            expected[label] = expected.get(label, 0) + 1
        for label, count in expected.items():
            assert registry.get_sample_value(
                "llm_proxy_requests_total", labels(model=label, stream="false", code="200")) == count
        assert registry.get_sample_value(
            "llm_proxy_requests_total", labels(model="m3", stream="false", code="200")) is None


async def test_model_names_the_upstream_refuses_take_no_label_place() -> None:
    """A client sends three names the upstream does not serve (404), then a real one:
    the refused names are labelled other and take none of the two places, so the real
    model keeps its name. Before, the first 100 names sent took the places, served or
    not, and every later model was other for the life of the process."""
    async def respond(request: httpx.Request) -> httpx.Response:
        known = json.loads(request.content)["model"] == "real"
        body = b"{}" if known else error_body("model not found", "invalid_request_error",
                                              "model_not_found")
        return httpx.Response(200 if known else 404, content=body,
                              headers={"content-type": "application/json"})

    app, registry = make_app(FakeUpstream(respond), ScriptedClock(), max_models=2)
    async with app:
        for model in ("junk-1", "junk-2", "junk-3", "real", "real"):
            await post(app, CHAT, {"model": model})
    assert registry.get_sample_value(
        "llm_proxy_requests_total", labels(model="real", stream="false", code="200")) == 2
    assert registry.get_sample_value(
        "llm_proxy_requests_total", labels(model="other", stream="false", code="404")) == 3
    assert registry.get_sample_value(
        "llm_proxy_requests_total", labels(model="junk-1", stream="false", code="404")) is None


async def test_model_allowlist() -> None:
    clock = ScriptedClock()
    app, registry = make_app(json_upstream(200, b"{}"), clock, model_allowlist=("gpt-x",))
    async with app:
        for model in ("gpt-x", "gpt-y", "z"):
            await post(app, CHAT, {"model": model})
        assert registry.get_sample_value(
            "llm_proxy_requests_total", labels(model="gpt-x", stream="false", code="200")) == 1
        assert registry.get_sample_value(
            "llm_proxy_requests_total", labels(model="other", stream="false", code="200")) == 2


async def test_route_label_only_from_templates() -> None:
    clock = ScriptedClock()
    app, registry = make_app(json_upstream(200, b"{}"), clock)
    async with app:
        paths = ["/v1/models", "/v1/models/gpt-4o", "/v1/zzz-random", "/v1/zzz/deeper/path",
                 "/v1/files/file-abc/content", "/v1/chat/completions/extra", "/v1/.env"]
        async with client_for(app) as client:
            for path in paths:
                await client.get(path)
            await client.post(CHAT, json={"model": "m"})
        routes = set()
        for metric in registry.collect():
            for sample in metric.samples:
                if "route" in sample.labels:
                    routes.add(sample.labels["route"])
        assert routes <= {"/v1/models", "/v1/models/{...}", "/v1/{other}", "/v1/files/{...}",
                          "/v1/chat/{...}", CHAT}
        assert not any(part in route for route in routes
                       for part in ("zzz", "gpt-4o", "file-abc", ".env", "extra"))


# ---------------------------------------------------------------------------
# Metrics, exactly as scripted


async def test_stream_metrics_exactly_as_scripted() -> None:
    clock = ScriptedClock()
    script = chat_script(usage=usage_json(13, 21, cached=8,
                                          metrics={"queue_time_ms": 250}))
    up = sse_upstream(clock, script, headers={"x-request-id": "req-42"})
    app, registry = make_app(up, clock)
    async with app:
        async with client_for(BodyClock(app, clock)) as client:
            response = await client.post(CHAT, json=stream_request())
        assert response.status_code == 200
        lbl = labels()

        ttft = histogram(registry, "llm_proxy_time_to_first_token_seconds", lbl)
        assert (ttft.count, ttft.sum) == (1, OUTPUT_TIMES[0] - T0)
        assert ttft.buckets == expected_buckets(Settings().ttft_buckets, [OUTPUT_TIMES[0] - T0])

        gaps = [b - a for a, b in itertools.pairwise(OUTPUT_TIMES)]
        itl = histogram(registry, "llm_proxy_inter_token_latency_seconds", lbl)
        assert (itl.count, itl.sum) == (len(gaps), sum(gaps))
        assert itl.buckets == expected_buckets(Settings().itl_buckets, gaps)

        per_token = tpot(OUTPUT_TIMES[0], OUTPUT_TIMES[-1], 21)
        assert per_token is not None
        tp = histogram(registry, "llm_proxy_time_per_output_token_seconds", lbl)
        assert (tp.count, tp.sum) == (1, per_token)

        overhead = histogram(registry, "llm_proxy_overhead_seconds", lbl)
        assert (overhead.count, overhead.sum) == (1, BODY_READ)
        queue = histogram(registry, "llm_proxy_queue_time_seconds", {**lbl, "stream": "true"})
        assert (queue.count, queue.sum) == (1, 0.0)
        upstream_queue = histogram(registry, "llm_proxy_upstream_queue_time_seconds", lbl)
        assert (upstream_queue.count, upstream_queue.sum) == (1, 250 / 1000)

        for name, value in (("llm_proxy_prompt_tokens", 13), ("llm_proxy_cached_prompt_tokens", 8),
                            ("llm_proxy_completion_tokens", 21)):
            h = histogram(registry, name, lbl)
            assert (h.count, h.sum) == (1, value), name
            assert h.buckets == expected_buckets(Settings().token_buckets, [value]), name

        duration = histogram(registry, "llm_proxy_request_duration_seconds", labels(stream="true"))
        assert (duration.count, duration.sum) == (1, STREAM_END - T0)
        assert registry.get_sample_value(
            "llm_proxy_requests_total", labels(stream="true", code="200")) == 1
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(outcome="completed")) == 1
        assert registry.get_sample_value(
            "llm_proxy_in_flight_requests", {"upstream": UPSTREAM_LABEL}) == 0


async def test_completions_route_metrics() -> None:
    clock = ScriptedClock()
    times = [T0 + 0.25, T0 + 0.375, T0 + 0.875]
    script = [(T0 + 0.125, sse(text_json("")))]
    script += [(t, sse(text_json(f"w{i}"))) for i, t in enumerate(times)]
    script.append((T0 + 1.0, sse(usage_json(5, 3))))
    up = sse_upstream(clock, script)
    app, registry = make_app(up, clock)
    async with app:
        async with client_for(BodyClock(app, clock)) as client:
            await client.post(COMPLETIONS, json={"model": "m", "prompt": "p", "stream": True})
        lbl = labels(route=COMPLETIONS)
        assert histogram(registry, "llm_proxy_time_to_first_token_seconds", lbl).sum == times[0] - T0
        itl = histogram(registry, "llm_proxy_inter_token_latency_seconds", lbl)
        assert itl.sum == sum(b - a for a, b in itertools.pairwise(times))
        assert histogram(registry, "llm_proxy_time_per_output_token_seconds", lbl).sum == tpot(
            times[0], times[-1], 3)


async def test_non_stream_metrics_and_x_queue_time_header() -> None:
    clock = ScriptedClock()
    body = {"id": "x", "choices": [{"message": {"content": "hi"}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                      "prompt_tokens_details": {"cached_tokens": 2}}}

    async def respond(request: httpx.Request) -> httpx.Response:
        clock.now = T0 + 0.75
        return httpx.Response(200, headers={"content-type": "application/json",
                                            "x-queue-time": "125"},
                              content=lazy(json.dumps(body).encode()))

    app, registry = make_app(FakeUpstream(respond), clock)
    async with app:
        async with client_for(BodyClock(app, clock)) as client:
            response = await client.post(CHAT, json={"model": "m", "messages": []})
        assert response.json() == body
        lbl = labels()
        assert histogram(registry, "llm_proxy_upstream_queue_time_seconds", lbl).sum == 125 / 1000
        assert histogram(registry, "llm_proxy_prompt_tokens", lbl).sum == 7
        assert histogram(registry, "llm_proxy_cached_prompt_tokens", lbl).sum == 2
        assert histogram(registry, "llm_proxy_completion_tokens", lbl).sum == 3
        assert histogram(registry, "llm_proxy_time_to_first_token_seconds", lbl).count == 0
        duration = histogram(registry, "llm_proxy_request_duration_seconds", labels(stream="false"))
        assert duration.sum == 0.75
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(outcome="completed")) is None


async def test_queue_time_under_the_concurrency_limit() -> None:
    clock = ScriptedClock()
    gate = asyncio.Event()
    waited = 0.5

    async def respond(request: httpx.Request) -> httpx.Response:
        first = request.headers["x-test"] == "a"

        async def body() -> AsyncIterator[bytes]:
            if first:
                await gate.wait()
            yield sse(chunk_json({"content": "x"}))

        return httpx.Response(200, headers=SSE_HEADERS, content=body())

    app, registry = make_app(FakeUpstream(respond), clock, max_concurrency=1)
    async with app:
        clock.now = T0
        async with client_for(app) as client:
            a = asyncio.create_task(client.post(CHAT, json=stream_request(), headers={"x-test": "a"}))
            b = asyncio.create_task(client.post(CHAT, json=stream_request(), headers={"x-test": "b"}))
            await until_queued(app)  # b waits behind a
            assert not a.done()
            clock.now = T0 + waited
            gate.set()
            await asyncio.gather(a, b)
        queue = histogram(registry, "llm_proxy_queue_time_seconds", {**labels(), "stream": "true"})
        assert (queue.count, queue.sum) == (2, waited)
        assert queue.buckets == expected_buckets(QUEUE_BUCKETS, [0.0, waited])


async def test_queue_full_answers_429() -> None:
    clock = ScriptedClock()
    gate = asyncio.Event()

    async def respond(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            await gate.wait()
            yield b"data: {}\n\n"

        return httpx.Response(200, headers=SSE_HEADERS, content=body())

    app, registry = make_app(FakeUpstream(respond), clock, max_concurrency=1, max_queue=1)
    async with app:
        async with client_for(app) as client:
            first = asyncio.create_task(client.post(CHAT, json=stream_request()))
            second = asyncio.create_task(client.post(CHAT, json=stream_request()))
            await until_queued(app)
            third = await client.post(CHAT, json=stream_request())
            gate.set()
            await asyncio.gather(first, second)
        assert third.status_code == 429
        assert third.headers["retry-after"] == "1"
        assert third.json()["error"]["type"] == "rate_limit_error"
        assert registry.get_sample_value(
            "llm_proxy_requests_total", labels(stream="true", code="429")) == 1


# ---------------------------------------------------------------------------
# Per-request log, /metrics, /healthz


async def test_request_log_line(tmp_path: Path) -> None:
    clock = ScriptedClock()
    log_file = tmp_path / "requests.jsonl"
    up = sse_upstream(clock, chat_script(), headers={"x-request-id": "req-log-1"})
    app, _ = make_app(up, clock, log_requests=str(log_file))
    async with app, client_for(BodyClock(app, clock)) as client:
        await client.post(CHAT, json=stream_request(),
                          headers={"authorization": "Bearer sk-very-secret-key"})
    lines = log_file.read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    for key in ("request_id", "route", "model", "upstream", "stream", "status", "outcome",
                "duration_s", "overhead_s", "queue_s", "upstream_queue_s", "ttft_s", "tpot_s",
                "itl_count", "itl_mean_s", "itl_max_s", "output_events", "prompt_tokens",
                "cached_prompt_tokens", "completion_tokens", "time"):
        assert key in record, key
    assert record["request_id"] == "req-log-1"
    assert record["ttft_s"] == OUTPUT_TIMES[0] - T0
    assert record["itl_count"] == len(OUTPUT_TIMES) - 1
    assert record["outcome"] == "completed"
    assert record["completion_tokens"] == 21
    assert "sk-very-secret-key" not in lines[0]
    assert "SECRET PROMPT TEXT" not in lines[0]
    assert "authorization" not in lines[0].lower()


async def test_metrics_openmetrics_with_request_id_exemplar() -> None:
    clock = ScriptedClock()
    up = sse_upstream(clock, chat_script(), headers={"x-request-id": "req-exemplar-9"})
    app, _ = make_app(up, clock)
    async with app:
        async with client_for(BodyClock(app, clock)) as client:
            await client.post(CHAT, json=stream_request())
            om = await client.get("/metrics", headers={"accept": "application/openmetrics-text; "
                                                                 "version=1.0.0; charset=utf-8"})
            text = await client.get("/metrics")
        assert om.status_code == 200
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.rstrip().endswith("# EOF")
        ttft_lines = [line for line in om.text.splitlines()
                      if line.startswith("llm_proxy_time_to_first_token_seconds_bucket")
                      and 'request_id="req-exemplar-9"' in line]
        assert len(ttft_lines) == 1
        assert ttft_lines[0].split(" # ")[1].split()[1] == str(OUTPUT_TIMES[0] - T0)
        assert any(line.startswith("llm_proxy_request_duration_seconds_bucket")
                   and 'request_id="req-exemplar-9"' in line for line in om.text.splitlines())
        assert text.headers["content-type"].startswith("text/plain")
        assert "# EOF" not in text.text
        assert "request_id" not in text.text
        assert "llm_proxy_time_to_first_token_seconds_bucket" in text.text


async def test_healthz_does_not_call_upstream() -> None:
    async def respond(request: httpx.Request) -> httpx.Response:
        raise AssertionError("upstream called")

    up = FakeUpstream(respond)
    app, _ = make_app(up, ScriptedClock())
    async with app:
        async with client_for(app) as client:
            response = await client.get("/healthz")
        assert response.status_code == 200
        assert up.seen == []


# ---------------------------------------------------------------------------
# Streams that end badly (driven with a recording send: the response is incomplete)


@pytest.mark.parametrize(
    ("failure", "outcome"),
    [(ConnectionResetError("reset"), "upstream_interrupted"),
     (RuntimeError("closed without the chunked terminator"), "upstream_interrupted"),
     (None, "upstream_timeout")],
)
@pytest.mark.parametrize("inject", [True, False])
async def test_upstream_failure_mid_stream(failure: Exception | None, outcome: str,
                                           inject: bool) -> None:
    clock = ScriptedClock()
    script = chat_script(usage=None)[:4]  # role chunk + three outputs, then it breaks
    # the last chunk read before the failure ends in the middle of an event
    script.append((T0 + 0.75, b'data: {"choices": [{"delta": {"cont'))
    closed = asyncio.Event()
    silent = asyncio.Event() if failure is None else None  # never set: a stall
    broken = sse_upstream(clock, script, end=None, fail=failure, closed=closed, hold=silent)
    healthy = sse_upstream(clock, chat_script())

    async def respond(request: httpx.Request) -> httpx.Response:
        return await (broken if not broken.seen else healthy)(request)

    app, registry = make_app(respond, clock, inject_usage=inject, read_timeout=0.3)
    async with app:
        result = await call_raw(app, "POST", CHAT, body=json.dumps(stream_request()).encode())
        assert result.status == 200
        assert result.body == b"".join(c for _, c in script)  # every byte that arrived
        assert not result.completed  # the stream breaks as the upstream's did
        await asyncio.wait_for(closed.wait(), 5)
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(outcome=outcome)) == 1
        ttft = histogram(registry, "llm_proxy_time_to_first_token_seconds", labels())
        assert ttft.sum == OUTPUT_TIMES[0] - T0
        itl = histogram(registry, "llm_proxy_inter_token_latency_seconds", labels())
        assert itl.count == 2
        assert registry.get_sample_value(
            "llm_proxy_in_flight_requests", {"upstream": UPSTREAM_LABEL}) == 0
        # and the proxy keeps serving
        result = await call_raw(app, "POST", CHAT, body=json.dumps(stream_request()).encode())
        assert result.completed
        assert len(healthy.seen) == 1
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(outcome="completed")) == 1


async def test_client_stalled_under_plain_asgi_send() -> None:
    """Under an ASGI server other than uvicorn nothing says whether the client takes
    bytes: a ``send`` that has not returned after --client-write-timeout ends the request
    as client_stalled, the upstream request is closed and the slot freed; the response is
    left incomplete for the server to close."""
    clock = ScriptedClock()
    closed = asyncio.Event()
    script = chat_script(usage=None)
    up = sse_upstream(clock, script, end=None, closed=closed)
    app, registry = make_app(up, clock, client_write_timeout=0.2, max_concurrency=1)
    messages: list[dict[str, Any]] = []
    stuck = asyncio.Event()
    requests = [{"type": "http.request", "body": json.dumps(stream_request()).encode(),
                 "more_body": False}]

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)
        if sum(m["type"] == "http.response.body" for m in messages) == 2:
            stuck.set()
            await asyncio.Event().wait()  # the client stopped reading: send never returns

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(),
             "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 50000), "server": ("proxy.test", 80)}
    async with app:
        async with asyncio.timeout(10):
            await app(scope, receive, send)
        assert stuck.is_set()
        assert not any(m["type"] == "http.response.body" and not m.get("more_body")
                       for m in messages)  # not completed
        await asyncio.wait_for(closed.wait(), 5)  # the upstream request was closed
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(outcome="client_stalled")) == 1
        assert registry.get_sample_value(
            "llm_proxy_in_flight_requests", {"upstream": UPSTREAM_LABEL}) == 0
        assert app.admission.active == 0


async def test_client_disconnect_closes_the_upstream_stream() -> None:
    clock = ScriptedClock()
    closed = asyncio.Event()
    never = asyncio.Event()
    script = chat_script(usage=None)[:3]
    up = sse_upstream(clock, script, end=None, hold=never, closed=closed)
    app, registry = make_app(up, clock)
    async with app:
        result = await call_raw(app, "POST", CHAT, body=json.dumps(stream_request()).encode(),
                                disconnect_after_body_messages=len(script))
        assert result.body == b"".join(c for _, c in script)
        await asyncio.wait_for(closed.wait(), 5)  # the upstream request was closed, not left generating
        assert registry.get_sample_value(
            "llm_proxy_stream_outcomes_total", labels(outcome="client_disconnected")) == 1
        assert registry.get_sample_value(
            "llm_proxy_in_flight_requests", {"upstream": UPSTREAM_LABEL}) == 0
