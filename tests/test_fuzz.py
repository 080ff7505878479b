"""Property tests (hypothesis) for the promises that must hold for *any* input.

* The relay: any byte string, cut into any chunks, reaches the client identical (less
  exactly the usage-only events in the one documented strip mode), and the relay never
  holds more than its limit of not-yet-forwarded bytes.
* The SSE parser: never raises, never buffers more than its event limit (plus a small
  constant), and finds the same events however the stream is cut.
* The measurement: ``inspect_event`` and the stream timer never raise on any payload.

The relay is driven directly with an ``httpx.Response`` over a lazy async iterator (as
a socket delivers it) and a recording ``send``; one property drives the whole app
through ``httpx.ASGITransport`` with an ``httpx.MockTransport`` upstream.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator, MutableMapping
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings
from proxy.measure import StreamTimer, inspect_event
from proxy.relay import relay
from proxy.sse import SSEParser

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
            if not e.oversize and inspect_event(e.data, text_route=False).usage_only]


def without(data: bytes, spans: list[tuple[int, int]]) -> bytes:
    out, pos = [], 0
    for start, end in spans:
        out.append(data[pos:start])
        pos = end
    out.append(data[pos:])
    return b"".join(out)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for all examples (a loop per example would dominate the run time)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


class Recorder:
    """Upstream body and client ``send`` in one: tracks how many bytes are held back."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.received = 0
        self.sent: list[bytes] = []
        self.sent_bytes = 0
        self.max_held = 0

    async def body(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            # Everything before this piece has been processed: what is not yet sent is held.
            self.max_held = max(self.max_held, self.received - self.sent_bytes)
            self.received += len(piece)
            yield piece

    async def send(self, message: MutableMapping[str, Any]) -> None:
        assert message["type"] == "http.response.body" and message["more_body"] is True
        self.sent.append(message["body"])
        self.sent_bytes += len(message["body"])


def drive(loop: asyncio.AbstractEventLoop, pieces: list[bytes], *, strip: bool,
          max_event: int = 1 << 20) -> Recorder:
    rec = Recorder(pieces)
    response = httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=rec.body())
    ticks = iter(range(10**9))
    result = loop.run_until_complete(relay(
        response, rec.send, lambda: float(next(ticks)), timer=StreamTimer(text_route=False),
        parser=SSEParser(max_event), strip_usage=strip))
    assert result.complete
    return rec


@FUZZ
@given(cut())
def test_relay_forwards_any_bytes_in_any_chunks_unchanged(
        loop: asyncio.AbstractEventLoop, case: tuple[bytes, list[bytes]]) -> None:
    data, pieces = case
    rec = drive(loop, pieces, strip=False)
    assert b"".join(rec.sent) == data
    assert rec.sent == pieces  # chunk for chunk, as they arrived: nothing buffered


@FUZZ
@given(cut(SSE_ISH))
@example((b"data: {\"choices\":[],\"usage\":{}}\r\n\r\ndata: x\n\n",
          [b"data: {\"choices\":[],\"usage\":{}}\r", b"\n\r\ndata: x\n\n"]))
def test_relay_strip_mode_removes_exactly_the_usage_only_events(
        loop: asyncio.AbstractEventLoop, case: tuple[bytes, list[bytes]]) -> None:
    data, pieces = case
    rec = drive(loop, pieces, strip=True)
    assert b"".join(rec.sent) == without(data, usage_only_spans(data))


@FUZZ
@given(cut(st.lists(PIECES | st.binary(min_size=100, max_size=400), max_size=12).map(b"".join)))
def test_relay_strip_mode_holds_back_a_bounded_number_of_bytes(
        loop: asyncio.AbstractEventLoop, case: tuple[bytes, list[bytes]]) -> None:
    """An event longer than the parser's limit is forwarded as it comes, not held whole."""
    data, pieces = case
    limit = 64
    rec = drive(loop, pieces, strip=True, max_event=limit)
    assert rec.max_held <= limit + 64
    usage_spans = [(a, b) for a, b in usage_only_spans(data) if b - a <= limit]
    assert b"".join(rec.sent) == without(data, usage_spans)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut())
def test_whole_app_relays_any_bytes_unchanged(
        loop: asyncio.AbstractEventLoop, case: tuple[bytes, list[bytes]]) -> None:
    data, pieces = case

    async def lazy() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    def upstream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=lazy())

    async def go() -> bytes:
        app = create_app(Settings(upstream="http://upstream.test/v1"),
                         transport=httpx.MockTransport(upstream), registry=CollectorRegistry())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy") as c:
            r = await c.post("/v1/chat/completions", json={
                "model": "m", "stream": True, "stream_options": {"include_usage": True}})
        await app.aclose()
        assert r.status_code == 200
        return r.content

    assert loop.run_until_complete(go()) == data


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
        assert parser.buffered_bytes <= limit + 16

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
def test_measurement_never_raises(data: bytes, text_route: bool) -> None:
    info = inspect_event(data, text_route=text_route)
    assert info.outputs >= 0
    timer = StreamTimer(text_route=text_route)
    timer.event(data, 1.0)
    timer.event(data, 2.0)
    assert timer.output_events in (0, 2)
