"""Property tests (hypothesis) for the promises that must hold for *any* input.

* The relay: any byte string, cut into any chunks, reaches the client identical and read
  for read (less exactly the usage-only events in the one documented strip mode), and
  the relay never holds more than its limit of not-yet-forwarded bytes.
* The SSE parser: never raises, never buffers more than its event limit (plus a small
  constant), and finds the same events however the stream is cut.
* The measurement: every dialect and the stream timer never raise on any payload.

The relay properties run the production path: the upstream client
(:class:`proxy.wire.pool.WireTransport`) against the suite's scripted upstream on loopback,
whose chunks go out in lockstep with the relay (one chunk per upstream read, see
tests/fake_upstream.py), and :func:`proxy.relay.relay` handing them to a recording
``send``. The whole-app property drives the app the same way. One event loop, one
upstream and one keep-alive connection serve every example of the module, so the
examples stay cheap.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from proxy import dialects
from proxy.measure import Meter, StreamTimer
from proxy.relay import relay
from proxy.sse import SSEParser
from proxy.wire.endpoint import Endpoint
from proxy.wire.http11 import serialize
from proxy.wire.pool import WireTransport
from tests.fake_upstream import ScriptedClock, ScriptedUpstream
from tests.upstream_fakes import CHAT, InProcess, call_raw, make_app

FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Pieces that make SSE-shaped streams likely: field names, every line ending, output,
# usage-only and malformed payloads, binary bytes.
PIECES = st.sampled_from([
    b"data: ", b"data:", b"event: e", b"id: 1", b"retry: 5", b": comment", b"\n", b"\r",
    b"\r\n", b"\n\n", b" ", b"[DONE]", b"\x00", b"\xff\xfe",
    b'{"choices":[{"index":0,"delta":{"content":"a"}}]}',
    b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
    b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}',
    b'{"choices":[{"delta":{"tool_calls":[{"id":"x"}]}}],"usage":null}', b'{"choices":', b"{",
])
SSE_ISH = st.lists(PIECES | st.binary(max_size=24), max_size=40).map(b"".join)
ANY_BYTES = SSE_ISH | st.binary(max_size=600)


@st.composite
def cut(draw: st.DrawFn, data_strategy: st.SearchStrategy[bytes] = ANY_BYTES) -> tuple[bytes, list[bytes]]:
    """A byte string and one way of cutting it into non-empty chunks."""
    data = draw(data_strategy)
    if len(data) < 2:
        return data, [data] if data else []
    points = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=30)))
    edges = [0, *points, len(data)]
    return data, [data[a:b] for a, b in itertools.pairwise(edges)]


def usage_only_spans(data: bytes) -> list[tuple[int, int]]:
    """Where the usage-only events are, by parsing the whole stream at once."""
    parser = SSEParser()
    events = parser.feed(data)
    return [(e.start, e.end) for e in events
            if not e.oversize and dialects.CHAT.classify(e.event, e.data).usage_only]


def without(data: bytes, spans: list[tuple[int, int]]) -> bytes:
    out, pos = [], 0
    for start, end in spans:
        out.append(data[pos:start])
        pos = end
    out.append(data[pos:])
    return b"".join(out)


class Script:
    """The current example's upstream body, and what the client got of it so far.

    ``body`` yields the pieces; the upstream writes each one and waits until the relay
    has handed it on (lockstep), so before each piece everything earlier has been
    processed, and what has not been sent yet is held by the relay."""

    def __init__(self) -> None:
        self.reset([])

    def reset(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.received = 0
        self.sent: list[bytes] = []
        self.sent_bytes = 0
        self.max_held = 0

    async def body(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            self.max_held = max(self.max_held, self.received - self.sent_bytes)
            self.received += len(piece)
            yield piece

    async def handler(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self.body())

    async def send(self, message: MutableMapping[str, Any]) -> None:
        assert message["type"] == "http.response.body" and message["more_body"] is True
        self.sent.append(message["body"])
        self.sent_bytes += len(message["body"])


@dataclass
class Wire:
    loop: asyncio.AbstractEventLoop
    clock: ScriptedClock
    script: Script
    upstream: ScriptedUpstream
    transport: WireTransport


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for all examples (a loop per example would dominate the run time)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def wire(loop: asyncio.AbstractEventLoop) -> Iterator[Wire]:
    """The production upstream client and one scripted upstream, for the whole module."""
    clock = ScriptedClock()
    script = Script()
    upstream = ScriptedUpstream(script.handler, clock)
    transport = WireTransport(max_connections=1, connect_timeout=5.0, read_timeout=5.0)
    try:
        loop.run_until_complete(upstream.start())
        yield Wire(loop, clock, script, upstream, transport)
    finally:
        loop.run_until_complete(transport.aclose())
        loop.run_until_complete(upstream.aclose())


def drive(wire: Wire, pieces: list[bytes], *, strip: bool, max_event: int = 1 << 20) -> Script:
    """One exchange through the production client; the body relayed to ``script.send``."""
    script = wire.script
    script.reset(pieces)
    endpoint = Endpoint("http", "127.0.0.1", wire.upstream.port)
    host = f"127.0.0.1:{wire.upstream.port}".encode()
    payload = serialize("POST", CHAT.encode(), host, [], b"{}")

    async def go() -> None:
        response = await wire.transport.exchange("POST", endpoint, payload)
        try:
            assert response.status_code == 200
            meter = Meter(StreamTimer(dialects.CHAT), SSEParser(max_event))
            result = await relay(response.body, script.send, wire.clock, meter=meter,
                                 strip_usage=strip)
        finally:
            await response.aclose()
        assert result.complete

    wire.loop.run_until_complete(go())
    return script


@FUZZ
@given(cut())
@example((b"", []))
@example((b"data: x\n\n", [b"data: x\n\n"]))
def test_relay_forwards_any_bytes_in_any_chunks_unchanged(
        wire: Wire, case: tuple[bytes, list[bytes]]) -> None:
    data, pieces = case
    script = drive(wire, pieces, strip=False)
    assert b"".join(script.sent) == data
    assert script.sent == pieces  # read for read, as they arrived: nothing buffered


def test_one_connection_serves_every_example(wire: Wire) -> None:
    """The examples above and below share one keep-alive connection (or the run slows
    down by a connect per example without any test failing)."""
    before = wire.upstream.connections
    for pieces in ([b"data: a\n\n"], [b"da", b"ta: b\n\n"], []):
        drive(wire, pieces, strip=False)
    assert wire.upstream.connections - before in (0, 1)  # at most the first reconnects
    after = wire.upstream.connections
    drive(wire, [b"data: c\n\n"], strip=True)
    assert wire.upstream.connections == after


@FUZZ
@given(cut(SSE_ISH))
@example((b"data: {\"choices\":[],\"usage\":{}}\r\n\r\ndata: x\n\n",
          [b"data: {\"choices\":[],\"usage\":{}}\r", b"\n\r\ndata: x\n\n"]))
def test_relay_strip_mode_removes_exactly_the_usage_only_events(
        wire: Wire, case: tuple[bytes, list[bytes]]) -> None:
    data, pieces = case
    script = drive(wire, pieces, strip=True)
    assert b"".join(script.sent) == without(data, usage_only_spans(data))


@FUZZ
@given(cut(st.lists(PIECES | st.binary(min_size=100, max_size=400), max_size=12).map(b"".join)))
def test_relay_strip_mode_holds_back_a_bounded_number_of_bytes(
        wire: Wire, case: tuple[bytes, list[bytes]]) -> None:
    """An event longer than the parser's limit is forwarded as it comes, not held whole."""
    data, pieces = case
    limit = 64
    script = drive(wire, pieces, strip=True, max_event=limit)
    assert script.max_held <= limit + 64
    usage_spans = [(a, b) for a, b in usage_only_spans(data) if b - a <= limit]
    assert b"".join(script.sent) == without(data, usage_spans)


@pytest.fixture(scope="module")
def app(loop: asyncio.AbstractEventLoop) -> Iterator[tuple[InProcess, Script]]:
    """The whole proxy in front of one scripted upstream, for every example."""
    script = Script()
    proxy, _ = make_app(script.handler, ScriptedClock())
    try:
        loop.run_until_complete(proxy.scripted.start())
        yield proxy, script
    finally:
        loop.run_until_complete(proxy.aclose())


def through_app(loop: asyncio.AbstractEventLoop, app: tuple[InProcess, Script],
                pieces: list[bytes], **request: Any) -> list[bytes]:
    """POST a stream request through the app; the body messages it sent, in order."""
    proxy, script = app
    script.reset(pieces)
    body = json.dumps({"model": "m", "stream": True, **request}).encode()
    result = loop.run_until_complete(call_raw(proxy, "POST", CHAT, body=body))
    assert result.status == 200
    assert result.completed
    return [m["body"] for m in result.messages
            if m["type"] == "http.response.body" and m.get("more_body")]


@FUZZ
@given(cut())
def test_whole_app_relays_any_bytes_unchanged(
        loop: asyncio.AbstractEventLoop, app: tuple[InProcess, Script],
        case: tuple[bytes, list[bytes]]) -> None:
    """The client asked for usage itself: nothing is removed, and each upstream read
    goes out as one body message."""
    data, pieces = case
    sent = through_app(loop, app, pieces, stream_options={"include_usage": True})
    assert b"".join(sent) == data
    assert sent == pieces


@FUZZ
@given(cut(SSE_ISH))
def test_whole_app_removes_only_the_usage_event_it_asked_for(
        loop: asyncio.AbstractEventLoop, app: tuple[InProcess, Script],
        case: tuple[bytes, list[bytes]]) -> None:
    """The client did not ask for usage, so the proxy asks for it and removes exactly the
    usage-only events from what the client gets."""
    data, pieces = case
    sent = through_app(loop, app, pieces)
    assert b"".join(sent) == without(data, usage_only_spans(data))


# ---------------------------------------------------------------------------
# The SSE parser


@FUZZ
@given(cut(), st.integers(1, 200))
def test_parser_never_raises_and_stays_within_its_limit(
        case: tuple[bytes, list[bytes]], limit: int) -> None:
    parser = SSEParser(limit)
    last_end = fed = 0
    for piece in case[1]:
        fed += len(piece)
        for event in parser.feed(piece):
            assert last_end <= event.start < event.end <= fed  # in order, no overlap
            assert event.oversize or len(event.data) <= limit
            last_end = event.end

@FUZZ
@given(cut(SSE_ISH))
def test_parser_finds_the_same_events_however_the_stream_is_cut(
        case: tuple[bytes, list[bytes]]) -> None:
    data, pieces = case
    whole = SSEParser().feed(data)
    parser = SSEParser()
    split = [event for piece in pieces for event in parser.feed(piece)]
    assert split == whole


# ---------------------------------------------------------------------------
# The measurement

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["choices", "delta", "content", "text", "usage", "tool_calls",
                         "reasoning", "refusal", "metrics", "queue_time_ms", "index",
                         "prompt_tokens", "completion_tokens", "prompt_tokens_details",
                         "cached_tokens", "function_call"]) | st.text(max_size=3),
        inner, max_size=5),
    max_leaves=25,
)


@FUZZ
@given(st.binary(max_size=300) | JSON.map(lambda v: json.dumps(v).encode()) | SSE_ISH,
       st.booleans())
@example(b"[" * 20_000, False)
@example(b'{"a":' * 20_000, True)
@example(b'{"choices":[{"delta":{"content":"x"}}],"usage":{"metrics":{"queue_time_ms":1e999}}}', False)
@example(b'{"type":"content_block_delta","delta":{"type":"text_delta","text":"x"}}', False)
@example(b'{"type":"response.output_text.delta","delta":"x"}', True)
def test_measurement_never_raises(data: bytes, text_route: bool) -> None:
    for dialect in dialects.DIALECTS.values():
        for name in (b"", b"message_start", b"response.completed", b"error"):
            info = dialect.classify(name, data)
            dialect.usage(info.usage)  # normalising any usage it found never raises either
    name = b""
    dialect = dialects.COMPLETIONS if text_route else dialects.CHAT
    info = dialect.classify(name, data)
    timer = StreamTimer(dialect)
    assert timer.event(name, data, 1.0) == info
    assert timer.event(name, data, 2.0) == info  # the same payload classifies the same
    outputs = 1 if info.outputs else 0
    assert timer.output_events == 2 * outputs
    assert timer.output_choices == 2 * info.outputs
    assert timer.gaps == [1.0] * outputs
    assert (timer.first_t, timer.last_t) == ((1.0, 2.0) if outputs else (None, None))
