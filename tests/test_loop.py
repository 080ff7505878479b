"""Nothing big on the event loop: ``/metrics`` renders and large request bodies.

Every stall of the event loop is added to the inter-token latency of every stream the
proxy relays at that moment, which is the figure it measures. These tests prove, with
events rather than time:

* ``/metrics`` is rendered in a worker thread: while a render is held inside the
  registry (a collector that waits for the test), the same loop answers ``/healthz``
  and relays; scrapes arriving together share one render, scrapes arriving during a
  render share the next one (never older figures than their own arrival), formats
  apart.
* A large request body is decoded and re-encoded in a worker thread, in pieces
  (:mod:`proxy.bodies`): the same object and the same bytes as ``json`` (random and
  built-to-break documents, every piece size), the same bytes reaching the upstream
  as the inline path sends; and while it is decoded, another stream's events keep
  reaching its client (counted between the large body's last byte being taken and its
  request reaching the upstream).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy import bodies
from proxy.bodies import LARGE_BODY, _with_usage
from tests.fake_upstream import DONE, Conn, chunk_json, content_event, normal, sse
from tests.upstream_fakes import CHAT, RawResult, ScriptedClock, call_raw, make_app

pytestmark = pytest.mark.anyio

WAIT_S = 30.0  # generous bound on every wait for an event: a loaded 2-core machine
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


class HeldRender(Collector):
    """A collector that holds each render until the test releases it, and counts the
    renders: ``test_held_render_renders`` is the number of the render that read it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.renders = 0
        self.held_too_long = False  # the release never came: the loop was blocked

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.renders += 1
        self.started.set()
        if not self.release.wait(WAIT_S):
            self.held_too_long = True
        yield GaugeMetricFamily("test_held_render_renders", "renders so far", self.renders)


def renders_seen(result: RawResult) -> int:
    assert result.status == 200, result.body[:200]
    for line in result.body.decode().splitlines():
        if line.startswith("test_held_render_renders "):
            return int(float(line.split()[1]))
    raise AssertionError("the held collector was not rendered")


def scrape(app: Any, accept: str = "") -> asyncio.Task[RawResult]:
    headers = [(b"accept", accept.encode())] if accept else []
    return asyncio.ensure_future(call_raw(app, "GET", "/metrics", headers=headers))


async def test_metrics_render_off_the_loop_shares_renders_and_never_answers_stale() -> None:
    app, registry = make_app(_unused, ScriptedClock())
    held = HeldRender()
    registry.register(held)
    async with app:
        first = scrape(app)
        assert await asyncio.to_thread(held.started.wait, WAIT_S)
        # The render is held inside the registry: the loop still serves.
        health = await call_raw(app, "GET", "/healthz")
        assert (health.status, health.body) == (200, b"ok\n")
        # Two scrapes arrive during the render: they wait for it and share the next.
        late = [scrape(app), scrape(app)]
        for _ in range(50):  # loop passes, not time: both are waiting, none rendered
            await asyncio.sleep(0)
        assert held.renders == 1 and not any(t.done() for t in late)
        held.release.set()
        assert renders_seen(await first) == 1
        a, b = await asyncio.gather(*late)
        assert renders_seen(a) == renders_seen(b) == 2
        assert a.body == b.body
        assert not held.held_too_long
        assert app.scrapes.renders == 2


async def test_scrapes_arriving_together_share_one_render_formats_apart() -> None:
    app, registry = make_app(_unused, ScriptedClock())
    held = HeldRender()
    held.release.set()
    registry.register(held)
    async with app:
        texts = [scrape(app) for _ in range(3)]
        om = [scrape(app, OPENMETRICS) for _ in range(2)]
        text_results = await asyncio.gather(*texts)
        om_results = await asyncio.gather(*om)
    assert len({r.body for r in text_results}) == 1
    assert len({r.body for r in om_results}) == 1
    assert held.renders == 2  # one per format
    for r in text_results:
        assert dict(r.headers)[b"content-type"].startswith(b"text/plain")
        assert b"# EOF" not in r.body
    for r in om_results:
        assert dict(r.headers)[b"content-type"].startswith(b"application/openmetrics-text")
        assert r.body.rstrip().endswith(b"# EOF")


async def test_a_failed_render_fails_its_scrapes_and_the_next_one_renders() -> None:
    class FailsOnce(Collector):
        def __init__(self) -> None:
            self.calls = 0

        def collect(self) -> Iterator[GaugeMetricFamily]:
            self.calls += 1
            if self.calls == 1:
                raise OSError("a worker's metrics file is unreadable")
            yield GaugeMetricFamily("test_fails_once", "calls", self.calls)

    app, registry = make_app(_unused, ScriptedClock())
    registry.register(FailsOnce())
    async with app:
        with pytest.raises(OSError, match="unreadable"):
            await call_raw(app, "GET", "/metrics")
        again = await call_raw(app, "GET", "/metrics")
    assert again.status == 200
    assert b"test_fails_once 2.0" in again.body


async def _unused(request: Any) -> Any:
    raise AssertionError("no upstream request expected")


# ---------------------------------------------------------------------------
# Large bodies: decoded in pieces, the same result as json


def reference(body: bytes) -> tuple[bool, Any, bytes | None]:
    """What ``json`` makes of ``body``: decodes?, the value, its compact encoding (None
    where encoding fails, as for a lone surrogate)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return False, None, None
    try:
        return True, value, bodies.compact(value)
    except ValueError:  # a lone surrogate (UnicodeEncodeError), NaN or an infinity
        return True, value, None


def same(a: Any, b: Any) -> bool:
    """Equal JSON values, NaN equal to NaN, a lone surrogate not equal to a pair."""
    def exact(value: Any) -> bytes:
        return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")

    return exact(a) == exact(b)


def assert_same_as_json(body: bytes, piece: int) -> None:
    ok, value, encoded = reference(body)
    decoded = bodies.loads(body, piece)
    if not ok:
        assert decoded is None, (piece, body[:120])
        return
    assert decoded is not None, (piece, body[:120])
    assert same(decoded.value, value), (piece, body[:120])
    try:
        mine = decoded.dumps(decoded.value)
    except ValueError:
        mine = None
    assert mine == encoded, (piece, body[:120])
    if isinstance(value, dict):  # what the proxy sends with its usage request
        assert _with_usage(decoded.value, decoded.dumps) == _with_usage(value), piece


ATOMS = ["a", "é", "中", "\U0001f600", "\n", '"', "\\", "/", "\t", "\u2028", "\x01", " ",
         "\ud83d", "\ude00"]  # the last two: lone surrogates


def random_document(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 4 or r < 0.3:
        return rng.choice([
            "".join(rng.choice(ATOMS) for _ in range(rng.choice([0, 1, 5, 30, 120]))),
            rng.randint(-10**20, 10**20), rng.random() * 1e300, 1.5e-7, True, False, None,
            float("nan"), float("inf"), -0.0])
    if r < 0.65:
        return [random_document(rng, depth + 1) for _ in range(rng.randint(0, 8))]
    return {"".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 6))):
            random_document(rng, depth + 1) for _ in range(rng.randint(0, 8))}


def random_body(rng: random.Random) -> bytes:
    value = {"model": "m", "stream": True, "messages": random_document(rng, 1),
             "x": random_document(rng, 1)}
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]),
                      separators=rng.choice([None, (",", ":"), (" , ", " : ")]))
    if rng.random() < 0.1:
        text = " \n" + text + " \t"
    if rng.random() < 0.1:  # not JSON any more
        text = rng.choice([text[:rng.randint(0, len(text))], text.replace(",", ",,", 1),
                           text + "}", text.replace(":", "", 1)])
    return text.encode("utf-8", "surrogatepass")


@pytest.mark.parametrize("seed", range(4))
def test_pieces_decode_and_encode_as_json_random_documents(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(150):
        body = random_body(rng)
        for piece in (16, 23, 64):
            assert_same_as_json(body, piece)


ESCAPES = ["\\u00e9", "\\ud83d\\ude00", "\\\\", '\\"', "\\n", "\\/", "\\ude00", "\\ud83d", "x"]


def test_pieces_cut_strings_anywhere_without_splitting_an_escape() -> None:
    """Strings made of every escape, including surrogate pairs, lone halves and runs of
    escaped backslashes, at every offset against every piece size."""
    for a in ESCAPES:
        for b in ESCAPES:
            for offset in range(8):
                raw = "x" * offset + (a + b) * 40
                body = ('{"model":"m","messages":"' + raw + '","n":1}').encode()
                for piece in (16, 17, 19, 24):
                    assert_same_as_json(body, piece)


def test_pieces_numbers_cut_by_a_window_and_other_edges() -> None:
    numbers = ["1.5e+300", "-12.75E-5", "123456789012345678901234567890", "0", "-0.0", "1e5",
               "Infinity", "-Infinity", "NaN", "1" * 5000]  # int too long for Python: not JSON
    for number in numbers:
        for offset in range(40):
            body = ('{"pad":"' + "p" * offset + '","v":[' + ",".join([number] * 6) + "]}").encode()
            for piece in (16, 31):
                assert_same_as_json(body, piece)
    edges = [
        b'\xef\xbb\xbf{"a": 1}',  # UTF-8 BOM: json.loads of bytes accepts it
        json.dumps({"a": ["\u00e9" * 40]}).encode("utf-16"),
        b'{"a": 1, "a": [2, 3], "b": 4}',  # the first key's place, the last value
        b'{"a": [1, 2,]}', b'{"a": 1,}', b"{}", b"[]", b'"just a string"', b"  7  ",
        b'{"a": "\x01"}',  # a control character inside a string: not JSON
        b'{"a": "\\x"}',  # an unknown escape: not JSON
        b"[" * 5000 + b"]" * 5000,  # deeper than json goes: it says not JSON
        b'{"a": ' + b"[" * 300 + b"]" * 300 + b"}",  # deep, fine for json
    ]
    for body in edges:
        for piece in (16, 64):
            assert_same_as_json(body, piece)


def large_body(stream: bool, turns: int = 3000) -> bytes:
    """A chat body over ``LARGE_BODY``, written the way Python clients write JSON
    (non-ASCII escaped): many turns, strings longer than a piece, surrogate pairs."""
    long_turn = "Ünïcode ünd \U0001f600 emoji, quotes \" and \\ backslashes.\n" * 3000
    messages = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i}: " + "é" * 300}
                for i in range(turns)]
    messages.insert(turns // 3, {"role": "user", "content": long_turn})
    messages.append({"role": "user", "content": [{"type": "text", "text": long_turn}]})
    body = json.dumps({"model": "big", "stream": stream, "temperature": 0.25,
                       "stream_options": {"note": "kept"}, "messages": messages}).encode()
    assert len(body) > LARGE_BODY and len(long_turn) > bodies.PIECE
    return body


@pytest.mark.parametrize("stream", [True, False])
async def test_a_large_body_reaches_the_upstream_as_the_inline_path_sends_it(
        stream: bool) -> None:
    body = large_body(stream)
    app, registry = make_app(None, ScriptedClock(), behaviour=normal)
    async with app:
        result = await call_raw(app, "POST", CHAT, body=body,
                                headers=[(b"content-type", b"application/json")])
    assert result.status == 200
    [seen] = app.scripted.requests
    if stream:  # what the inline path sends: json's own decoding and encoding
        assert seen.body == _with_usage(json.loads(body))
        assert seen.json["stream_options"] == {"note": "kept", "include_usage": True}
    else:
        assert seen.body == body  # nothing to add: the client's bytes
    assert registry.get_sample_value("llm_proxy_requests_total", {
        "route": CHAT, "model": "big", "upstream": "upstream.test:8000",
        "stream": "true" if stream else "false", "code": "200"}) == 1


class Notifying(list[MutableMapping[str, Any]]):
    """The messages a client received, with a callback per body message."""

    def __init__(self, on_body: Any) -> None:
        super().__init__()
        self.on_body = on_body
        self.changed = asyncio.Event()

    def append(self, message: MutableMapping[str, Any]) -> None:
        super().append(message)
        self.changed.set()
        if message["type"] == "http.response.body" and message.get("body"):
            self.on_body()


async def test_streams_flow_while_a_large_body_is_decoded() -> None:
    """Stream A relays event by event (its upstream sends the next event once A's client
    has the last one) while request B brings a large body. From B's last body byte being
    taken by the proxy until B's request head reaches the upstream, the proxy decodes and
    re-encodes B: A's events must keep arriving all along. Decoded on the loop, none
    can; decoded by ``json`` in one call, even in a thread, none can while that call
    runs (it keeps the GIL): then the longest gap between A's events is most of the
    window, here it is a small part of it (the loop takes the GIL back every 5 ms)."""
    got = asyncio.Event()
    stop = asyncio.Event()
    b_taken: list[float] = []
    during: list[float] = []  # when A's events arrived while B was being decoded

    async def ping_pong(conn: Conn) -> None:
        await conn.head(200)
        await conn.chunk(sse(chunk_json({"role": "assistant", "content": ""})))
        n = 0
        while not stop.is_set():
            got.clear()
            await conn.chunk(content_event(f" t{n}"))
            await got.wait()
            n += 1
        await conn.chunk(sse(chunk_json({}, finish="stop")))
        await conn.chunk(DONE)
        await conn.end()

    async def behaviour(conn: Conn) -> None:
        await (ping_pong if conn.request.model == "a" else normal)(conn)

    app, _ = make_app(None, ScriptedClock(), behaviour=behaviour)
    heads = app.scripted.heads

    def on_a_event() -> None:
        if b_taken and len(heads) < 2:  # B is taken, not at the upstream yet
            during.append(time.perf_counter())
        got.set()

    async with app:
        a_messages = Notifying(on_a_event)
        a_body = json.dumps({"model": "a", "stream": True, "messages": []}).encode()
        a = asyncio.ensure_future(call_raw(app, "POST", CHAT, body=a_body, record=a_messages))
        while len(a_messages) < 3:  # A is relaying: head, role chunk, a token
            a_messages.changed.clear()
            await asyncio.wait_for(a_messages.changed.wait(), WAIT_S)
        b_body = large_body(stream=True, turns=12_000)  # about 12 MB: a long window
        b = asyncio.ensure_future(_post_noting_body_taken(app, b_body, b_taken))
        await asyncio.wait_for(b, WAIT_S)
        stop.set()
        got.set()
        await asyncio.wait_for(a, WAIT_S)
    assert len(heads) == 2
    assert len(during) >= 5, f"only {len(during)} of A's events while B was decoded"
    start, end = b_taken[0], heads[1][1]
    marks = [start, *during, end]
    longest = max(later - earlier for earlier, later in itertools.pairwise(marks))
    assert longest < 0.5 * (end - start), (
        f"A waited {longest * 1000:.1f} ms of the {(end - start) * 1000:.1f} ms B took")


async def _post_noting_body_taken(app: Any, body: bytes, taken: list[float],
                                  taken_event: asyncio.Event | None = None,
                                  status: int = 200) -> None:
    delivered = False

    async def receive() -> MutableMapping[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            taken.append(time.perf_counter())
            if taken_event is not None:
                taken_event.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50001),
             "server": ("proxy.test", 80),
             "headers": [(b"content-type", b"application/json")]}
    await app(scope, receive, send)
    assert RawResult(sent).status == status


async def test_a_request_cancelled_while_its_large_body_is_decoded_is_finished_as_cancelled(
        tmp_path: Any) -> None:
    """The server cancels requests still running when its shutdown grace period ends;
    one whose large body is being decoded (an await the inline path did not have) is
    still finished once, as ``cancelled`` with 503, never sent upstream."""
    log_file = tmp_path / "requests.jsonl"
    app, registry = make_app(None, ScriptedClock(), behaviour=normal,
                             log_requests=str(log_file))
    taken = asyncio.Event()
    async with app:
        task = asyncio.ensure_future(
            _post_noting_body_taken(app, large_body(stream=True), [], taken, status=503))
        await asyncio.wait_for(taken.wait(), WAIT_S)  # the proxy took the body
        task.cancel()  # what uvicorn does after --graceful-timeout
        await task  # ended by the handler (a 503 sent), not by the cancellation
    [line] = [json.loads(text) for text in log_file.read_text().splitlines()]
    assert (line["status"], line["outcome"]) == (503, "cancelled")
    assert line["duration_s"] >= 0
    assert app.scripted.requests == []
    assert registry.get_sample_value("llm_proxy_requests_total", {
        "route": CHAT, "model": "unknown", "upstream": "upstream.test:8000",
        "stream": "false", "code": "503"}) == 1
