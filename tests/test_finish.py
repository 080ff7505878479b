"""One finish per request: every answer is logged once, counted once, and upstream
failures leave one rate-limited warning that carries no secret.

:class:`proxy.routes.V1Handler` ends every request in one ``_finish``, whatever step
refused it. Each refusal the proxy makes itself (400 path, 401 key, 408 body timeout,
413 body size declared and streamed, 431 headers, 429 queue full, 502 unreachable, 504
timeout) must produce exactly one ``--log-requests`` line with its status, outcome and
the request id the client got, and exactly one ``llm_proxy_requests_total`` increment
with its code. The app runs in process in front of the scripted upstream
(tests/fake_upstream.py), so the production upstream client meets each fault.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.logs import RateLimitedLog
from tests.fake_upstream import stream_events
from tests.upstream_fakes import (
    CHAT,
    SSE_HEADERS,
    UPSTREAM_LABEL,
    FakeUpstream,
    InProcess,
    Message,
    RawResult,
    ScriptedClock,
    call_raw,
    make_app,
)

pytestmark = pytest.mark.anyio

CLIENT_KEY = "sk-client-KEY-never-logged"
SERVER_KEY = "sk-server-KEY-never-logged"
PROMPT = "SECRET PROMPT TEXT never logged"
CHAT_BODY = json.dumps({"model": "m", "stream": True,
                        "messages": [{"role": "user", "content": PROMPT}]}).encode()


async def exchange(app: InProcess, method: str, path: str, *, parts: Sequence[bytes] = (),
                   headers: Sequence[tuple[bytes, bytes]] = (),
                   incomplete: bool = False, gone: asyncio.Event | None = None) -> RawResult:
    """Drive the app with ``parts`` as the request body, one ``http.request`` message
    each; ``incomplete``: the client then stops sending (the last part says more is
    coming). The client disconnects when ``gone`` is set, else never."""
    messages: list[Message] = []
    queue = list(parts) or [b""]
    disconnect = gone if gone is not None else asyncio.Event()

    async def receive() -> Message:
        if queue:
            part = queue.pop(0)
            return {"type": "http.request", "body": part,
                    "more_body": bool(queue) or incomplete}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"proxy.test"), *headers],
        "client": ("127.0.0.1", 50000), "server": ("proxy.test", 80),
    }
    await app(scope, receive, send)
    return RawResult(messages)


def request_id(result: RawResult) -> str:
    ids = [v.decode() for k, v in result.headers if k == b"x-request-id"]
    assert len(ids) == 1, result.headers
    return ids[0]


def requests_total(registry: CollectorRegistry) -> dict[tuple[str, str, str, str], float]:
    """``llm_proxy_requests_total`` by (route, model, stream, code), of the codes answered
    (a label set's failure codes are made at 0 with its first request)."""
    return {(s.labels["route"], s.labels["model"], s.labels["stream"], s.labels["code"]): s.value
            for family in registry.collect() for s in family.samples
            if s.name == "llm_proxy_requests_total" and s.value}


def log_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def hold(request: httpx.Request) -> httpx.Response:
    """An upstream that accepts the request and never answers."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def normal_stream(request: httpx.Request) -> httpx.Response:
    async def body() -> AsyncIterator[bytes]:
        for event in stream_events(2, usage=True):
            yield event

    return httpx.Response(200, headers=SSE_HEADERS, content=body())


@dataclass
class Refusal:
    status: int
    outcome: str
    code: str  # the OpenAI error code in the body
    route: str
    stream: str  # the stream label: "true" once the body was read and asked for a stream
    settings: dict[str, Any]
    run: Callable[[InProcess], Awaitable[RawResult]]
    handler: Callable[[httpx.Request], Awaitable[httpx.Response]] = normal_stream
    reaches_upstream: bool = False


def _post(*, parts: Sequence[bytes] = (CHAT_BODY,), headers: Sequence[tuple[bytes, bytes]] = (),
          incomplete: bool = False, path: str = CHAT) -> Callable[[InProcess], Awaitable[RawResult]]:
    async def run(app: InProcess) -> RawResult:
        return await exchange(app, "POST", path, parts=parts, headers=headers,
                              incomplete=incomplete)
    return run


async def _unreachable(app: InProcess) -> RawResult:
    await app.scripted.aclose()  # nobody listens on the port any more
    return await _post()(app)


async def _queue_full(app: InProcess) -> RawResult:
    """One request holds the only slot (its upstream never answers), the next finds
    no room in the queue; then the first one's client goes away."""
    gone = asyncio.Event()
    first = asyncio.ensure_future(exchange(app, "POST", CHAT, parts=[CHAT_BODY], gone=gone))
    for _ in range(10_000):  # loop passes, not time
        if app.scripted.requests:
            break
        await asyncio.sleep(0)
    assert app.admission.active == 1, "the first request never reached the upstream"
    try:
        return await _post()(app)
    finally:
        gone.set()
        assert (await first).messages == []  # it never got an answer


REFUSALS = {
    "400-path": Refusal(400, "rejected", "invalid_path", "/v1/{other}", "false", {},
                        _post(path="/v1/../admin")),
    "401-key": Refusal(401, "rejected", "invalid_api_key", CHAT, "false",
                       {"upstream_api_key_env": "TEST_FINISH_UPSTREAM_KEY"},
                       _post(headers=[(b"authorization", b"Bearer " + CLIENT_KEY.encode()
                                       + b"-wrong")])),
    "408-body-timeout": Refusal(408, "rejected", "body_timeout", CHAT, "false",
                                {"body_timeout": 0.05},
                                _post(parts=[CHAT_BODY[:20]], incomplete=True)),
    "413-declared": Refusal(413, "rejected", "request_too_large", CHAT, "false",
                            {"max_body_bytes": 100},
                            _post(parts=[CHAT_BODY],
                                  headers=[(b"content-length", str(len(CHAT_BODY)).encode())])),
    "413-streamed": Refusal(413, "rejected", "request_too_large", CHAT, "false",
                            {"max_body_bytes": 100},
                            _post(parts=[CHAT_BODY[i:i + 60]
                                         for i in range(0, len(CHAT_BODY), 60)])),
    "431-headers": Refusal(431, "rejected", "headers_too_large", CHAT, "false",
                           {"max_header_bytes": 1024},
                           _post(headers=[(b"x-filler", b"f" * 2000)])),
    "429-queue-full": Refusal(429, "rejected", "proxy_queue_full", CHAT, "true",
                              {"max_concurrency": 1, "max_queue": 0}, _queue_full, hold),
    "502-unreachable": Refusal(502, "upstream_unreachable", "upstream_unreachable", CHAT, "true",
                               {}, _unreachable),
    "504-upstream-timeout": Refusal(504, "upstream_timeout", "upstream_timeout", CHAT, "true",
                                    {"read_timeout": 0.05}, _post(), hold,
                                    reaches_upstream=True),
}


@pytest.mark.parametrize("case", list(REFUSALS.values()), ids=list(REFUSALS))
async def test_each_refusal_is_logged_and_counted_once(
        case: Refusal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    log_file = tmp_path / "requests.jsonl"
    settings = dict(case.settings)
    if "upstream_api_key_env" in settings:
        monkeypatch.setenv("TEST_FINISH_UPSTREAM_KEY", SERVER_KEY)
        keys = tmp_path / "keys"
        keys.write_text(hashlib.sha256(CLIENT_KEY.encode()).hexdigest() + "\n")
        settings["client_keys_file"] = str(keys)
    caplog.set_level(logging.WARNING, logger="proxy")
    app, registry = make_app(FakeUpstream(case.handler), ScriptedClock(),
                             log_requests=str(log_file), **settings)
    async with app:
        result = await case.run(app)
    assert result.status == case.status
    error = json.loads(result.body)["error"]
    assert error["code"] == case.code
    rid = request_id(result)

    lines = log_lines(log_file)
    mine = [line for line in lines if line["request_id"] == rid]
    assert len(mine) == 1, lines
    assert (mine[0]["status"], mine[0]["outcome"], mine[0]["route"]) == (
        case.status, case.outcome, case.route)
    others = [line for line in lines if line["request_id"] != rid]
    # only the queue test has a second request: the slot holder, whose client went away
    assert [(o["status"], o["outcome"]) for o in others] == (
        [(499, "client_disconnected")] if case.status == 429 else [])

    counted = requests_total(registry)
    model = "m" if case.stream == "true" else "unknown"
    expected = {(case.route, model, case.stream, str(case.status)): 1.0}
    if case.status == 429:
        expected[(CHAT, "m", "true", "499")] = 1.0
    assert counted == expected
    assert registry.get_sample_value(
        "llm_proxy_in_flight_requests", {"upstream": UPSTREAM_LABEL}) == 0
    assert len(app.scripted.requests) == (1 if case.reaches_upstream or case.status == 429 else 0)

    warnings = [r for r in caplog.records if r.name == "proxy" and r.levelno == logging.WARNING]
    assert len(warnings) == (1 if case.status in (502, 504) else 0)
    for text in (CLIENT_KEY, SERVER_KEY, PROMPT):
        assert text not in caplog.text
        assert text not in log_file.read_text()


TEAM = (b"x-team", b"team-a")


@pytest.mark.parametrize("case", ["413-declared", "413-streamed", "408-body-timeout"])
async def test_a_body_refused_takes_no_client_label(case: str, tmp_path: Path) -> None:
    """A body refused for its size or its time is counted with an empty client, however
    its size came (declared, or found while reading a chunked body), so that refused
    requests never use up the client label's values (--max-clients)."""
    refusal, log_file = REFUSALS[case], tmp_path / "requests.jsonl"
    parts = {"413-declared": [CHAT_BODY], "413-streamed": [
        CHAT_BODY[i:i + 60] for i in range(0, len(CHAT_BODY), 60)],
        "408-body-timeout": [CHAT_BODY[:20]]}[case]
    length = [(b"content-length", str(len(CHAT_BODY)).encode())] if case == "413-declared" else []
    app, _ = make_app(FakeUpstream(refusal.handler), ScriptedClock(), log_requests=str(log_file),
                      client_label_from="header:x-team", **refusal.settings)
    async with app:
        refused = await _post(parts=parts, headers=[TEAM, *length],
                              incomplete=case.startswith("408"))(app)
        assert refused.status == refusal.status
        small = b'{"model": "m", "messages": []}'  # under any of the limits
        assert (await _post(parts=[small], headers=[TEAM])(app)).status == 200  # served
    first, served = log_lines(log_file)
    assert (first["status"], first["client"]) == (refusal.status, None)  # no label
    assert served["client"] == "team-a"


# ---------------------------------------------------------------------------
# Requests that end without an answer from the proxy are still finished properly


@pytest.mark.parametrize("when", ["during-body", "before-headers"])
async def test_every_log_line_has_a_request_id(when: str, tmp_path: Path) -> None:
    log_file = tmp_path / "requests.jsonl"
    app, _ = make_app(FakeUpstream(hold), ScriptedClock(), log_requests=str(log_file))
    async with app:
        gone = asyncio.Event()
        if when == "during-body":
            gone.set()
            await exchange(app, "POST", CHAT, parts=[CHAT_BODY[:10]], incomplete=True, gone=gone)
        else:
            task = asyncio.ensure_future(exchange(app, "POST", CHAT, parts=[CHAT_BODY], gone=gone))
            for _ in range(10_000):  # loop passes, not time
                if app.scripted.requests:
                    break
                await asyncio.sleep(0)
            gone.set()
            await task
    [line] = log_lines(log_file)
    assert (line["status"], line["outcome"]) == (499, "client_disconnected")
    assert line["request_id"] != ""


@pytest.mark.parametrize("when", ["mid-stream", "before-headers"])
async def test_a_request_cancelled_by_the_server_is_finished_as_cut_short(
        when: str, tmp_path: Path) -> None:
    log_file = tmp_path / "requests.jsonl"
    closed = asyncio.Event()

    async def stuck(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                yield stream_events(1, usage=False)[0]
                await asyncio.Event().wait()
            finally:
                closed.set()

        if when == "before-headers":
            try:
                await asyncio.Event().wait()
            finally:
                closed.set()
        return httpx.Response(200, headers=SSE_HEADERS, content=body())

    app, registry = make_app(FakeUpstream(stuck), ScriptedClock(), log_requests=str(log_file))
    async with app:
        sent: list[Message] = []
        task = asyncio.ensure_future(call_raw(app, "POST", CHAT, body=CHAT_BODY, record=sent))
        for _ in range(10_000):  # loop passes, not time
            if (sent if when == "mid-stream" else app.scripted.requests):
                break
            await asyncio.sleep(0)
        task.cancel()  # what uvicorn does to a request still running after the grace period
        await task  # ended by the handler, not by the cancellation: no traceback
        await asyncio.wait_for(closed.wait(), 5)  # the upstream request was closed
    if when == "before-headers":  # answered in the OpenAI shape, not uvicorn's 500
        assert sent[0]["status"] == 503
        assert json.loads(sent[1]["body"])["error"]["code"] == "proxy_shutting_down"
    [line] = log_lines(log_file)
    assert line["status"] == (200 if when == "mid-stream" else 503)
    assert line["outcome"] == "cancelled"
    assert line["request_id"]
    outcomes = sum(s.value for f in registry.collect() for s in f.samples
                   if s.name == "llm_proxy_stream_outcomes_total")
    assert outcomes == 1


# ---------------------------------------------------------------------------
# Upstream failures: one warning line each, with what an operator needs and no secret


async def _reset_mid_stream(request: httpx.Request) -> httpx.Response:
    async def body() -> AsyncIterator[bytes]:
        yield stream_events(1, usage=False)[0]
        raise ConnectionResetError("upstream crashed")

    return httpx.Response(200, headers=SSE_HEADERS, content=body())


async def _reset_mid_body(request: httpx.Request) -> httpx.Response:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"id": "c1", "object": "chat.completion", '
        raise ConnectionResetError("upstream crashed")

    return httpx.Response(200, headers={"content-type": "application/json"}, content=body())


async def _stall_mid_stream(request: httpx.Request) -> httpx.Response:
    async def body() -> AsyncIterator[bytes]:
        yield stream_events(1, usage=False)[0]
        await asyncio.Event().wait()

    return httpx.Response(200, headers=SSE_HEADERS, content=body())


async def _server_error(request: httpx.Request) -> httpx.Response:
    return httpx.Response(500, headers={"x-request-id": "req-upstream-500"},
                          text="Internal Server Error")


@pytest.mark.parametrize(
    ("how", "status", "reason"),
    [("unreachable", 502, "ConnectError: cannot connect to 127.0.0.1:"),
     ("timeout", 504, "ReadTimeout: no response headers from the upstream within 0.05 s"),
     ("reset-mid-stream", 200, "stream upstream_interrupted"),
     ("reset-mid-body", 200, "body upstream_interrupted"),  # not a stream: not said to be
     ("stall-mid-stream", 200, "stream upstream_timeout"),
     ("5xx", 500, "HTTP 500")],
)
async def test_upstream_failure_logs_one_warning_without_secrets(
        how: str, status: int, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    handler = {"unreachable": normal_stream, "timeout": hold,
               "reset-mid-stream": _reset_mid_stream, "stall-mid-stream": _stall_mid_stream,
               "reset-mid-body": _reset_mid_body,
               "5xx": _server_error}[how]
    caplog.set_level(logging.DEBUG, logger="proxy")
    app, _ = make_app(FakeUpstream(handler), ScriptedClock(), read_timeout=0.05)
    async with app:
        host = app.upstream.host
        if how == "unreachable":
            await app.scripted.aclose()
        result = await exchange(app, "POST", CHAT, parts=[CHAT_BODY], headers=[
            (b"authorization", b"Bearer " + CLIENT_KEY.encode())])
    assert result.status == status
    rid = request_id(result)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [(r.name, r.levelno) for r in warnings] == [("proxy", logging.WARNING)]
    message = warnings[0].getMessage()
    for part in (f"request_id={rid}", f"route={CHAT}", "model=m", f"upstream={host}",
                 f"status={status}", reason):
        assert part in message, (part, message)
    for text in (CLIENT_KEY, PROMPT, "authorization"):
        assert text not in caplog.text


async def test_a_healthy_request_logs_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    app, _ = make_app(FakeUpstream(normal_stream), ScriptedClock())
    async with app:
        result = await exchange(app, "POST", CHAT, parts=[CHAT_BODY])
    assert result.status == 200 and result.completed
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_warnings_of_a_failing_upstream_are_rate_limited(
        caplog: pytest.LogCaptureFixture) -> None:
    """The handler's own limiter: 10 lines per 10 s, whatever the failure rate."""
    caplog.set_level(logging.WARNING, logger="proxy")
    app, registry = make_app(FakeUpstream(normal_stream), ScriptedClock())
    async with app:
        await app.scripted.aclose()
        for _ in range(25):
            result = await exchange(app, "POST", CHAT, parts=[CHAT_BODY])
            assert result.status == 502
    assert len([r for r in caplog.records if r.name == "proxy"]) == 10
    assert requests_total(registry) == {(CHAT, "m", "true", "502"): 25.0}


# ---------------------------------------------------------------------------
# RateLimitedLog, with a scripted clock


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rate_limited_log_writes_n_per_interval_then_one_suppressed_line(
        caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.ratelimited")
    caplog.set_level(logging.WARNING, logger="test.ratelimited")
    clock = Clock()
    limited = RateLimitedLog(logger, per_interval=3, interval_s=10.0, clock=clock)

    def lines() -> list[str]:
        out = [r.getMessage() for r in caplog.records if r.name == "test.ratelimited"]
        caplog.clear()
        return out

    for i in range(5):
        limited.warning("failure %d", i)
    assert lines() == ["failure 0", "failure 1", "failure 2"]
    clock.now += 9.99  # still the same interval
    limited.warning("failure %d", 5)
    assert lines() == []
    clock.now = 1010.0  # the next interval opens with the next line
    limited.warning("failure %d", 6)
    assert lines() == ["3 upstream failure lines were suppressed (at most 3 per 10 s)", "failure 6"]
    limited.warning("failure %d", 7)
    limited.warning("failure %d", 8)
    limited.warning("failure %d", 9)  # the fourth of this interval
    assert lines() == ["failure 7", "failure 8"]
    clock.now = 1030.0
    limited.warning("failure %d", 10)
    assert lines() == ["1 upstream failure lines were suppressed (at most 3 per 10 s)", "failure 10"]
    clock.now = 1050.0  # nothing held back: no suppressed line
    limited.warning("failure %d", 11)
    assert lines() == ["failure 11"]
