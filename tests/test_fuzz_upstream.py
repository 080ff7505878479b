"""The upstream side under a fuzzer: any response bytes, cut at any read boundary.

Hypothesis builds an upstream's answer (:class:`Answer`): 1xx heads, a status, header
fields of any count and size (past the 64 KiB cap too), a framing (``Content-Length``,
chunked under any spelling the parser takes as chunked, ``gzip, chunked``, read until
the close, a transfer coding the proxy refuses, invalid framing), chunk sizes and
extensions, trailers (a flood included), a second response or garbage after the end,
and an early close (FIN) or reset (RST). The suite's raw upstream
(:class:`tests.fake_upstream.ScriptedUpstream` with a behaviour) writes the bytes cut at
random points, one write per piece with loop turns in between, so the proxy reads them
as pieces. The whole proxy (``create_app``, the production client ``proxy.wire``) runs
in-process on the same loop with one upstream connection in its pool.

For every case:

* the client gets exactly the bytes :func:`expect` derives from the answer (the
  content, de-chunked and decoded, up to where the upstream stopped; with a reset,
  whatever part the kernel delivered: a prefix), or a 502 in the OpenAI error shape
  before any byte; no trailer and nothing of a second response reaches it as a header;
* the traced memory of the exchange stays under :data:`MEMORY_BOUND`;
* a connection that saw anything but a clean, complete, keep-alive answer is not in the
  pool afterwards; the next request on the pool succeeds;
* the outcome recorded is the one the fault table of ``docs/operations.md`` names.

``FUZZ_EXAMPLES`` sets the examples per test (CI: :data:`CI_EXAMPLES`, a few seconds).
The long campaign: ``FUZZ_CAMPAIGN_SECONDS=600 nice python -m pytest -n 0 -m fuzz_campaign
tests/test_fuzz_upstream.py tests/test_fuzz_client.py -s`` (its count and findings go in
``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import os
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from proxy import dialects
from proxy.measure import StreamTimer
from proxy.sse import SSEParser
from proxy.wire.connection import ConnectionState
from proxy.wire.http11 import MAX_HEAD_BYTES
from tests.fake_upstream import Conn, normal, stream_events
from tests.upstream_fakes import CHAT, InProcess, RawResult, ScriptedClock, call_raw, make_app

CI_EXAMPLES = 150
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", CI_EXAMPLES))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
# The most the traced heap may grow during one exchange, whatever the upstream sends:
# the answers here are under 1 MiB, and a flood of trailers or headers must not be kept.
MEMORY_BOUND = 8 * 1024 * 1024

# Spellings of Transfer-Encoding the parser reads as chunked (each a list of field lines)
CHUNKED = [
    [b"chunked"],
    [b"Chunked"],
    [b"identity, chunked"],
    [b", chunked"],
    [b"chunked", b"chunked"],
    [b"identity", b"chunked"],
    [b"CHUNKED "],
]
# ... and ones the proxy refuses with a 502 before any byte
REFUSED = [
    [b"chunked, identity"],
    [b"chunked", b"identity"],
    [b"chunked, "],
    [b"chunked\t"],
    [b"br, chunked"],
    [b"chunked, gzip"],
    [b"compress"],
    [b"chunked;q=1"],
    [b"gzip, gzip, chunked"],
]
# Framing the parser itself refuses (invalid HTTP): a 502 too
INVALID = [
    [(b"content-length", b"3"), (b"transfer-encoding", b"chunked")],
    [(b"content-length", b"x")],
    [(b"content-length", b"3"), (b"content-length", b"4")],
]

PIECES = st.sampled_from(
    [
        b"data: ",
        b"\n",
        b"\r\n",
        b"\n\n",
        b"[DONE]",
        b"\x00\xff",
        b'{"choices":[{"index":0,"delta":{"content":"a"}}]}',
        b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}',
        b"{",
    ]
)
CONTENT = st.lists(PIECES | st.binary(max_size=40), max_size=30).map(b"".join)


@dataclass(frozen=True)
class Answer:
    """One generated upstream answer, and how its bytes go out."""

    interim: tuple[bytes, ...]  # whole 1xx heads before the answer
    status: int
    fields: tuple[tuple[bytes, bytes], ...]  # header fields, framing ones included
    framing: str  # length | chunked | gzip | close | refused | invalid
    content: bytes  # what the client should get, whole
    wire_body: bytes  # the body as sent (framed, coded)
    content_at: tuple[int, ...]  # per wire_body byte: content bytes complete up to it
    trailers: bytes  # trailer section (chunked), CRLF-terminated, or b""
    after: bytes  # bytes after the end of the answer
    end: str  # keep | fin | rst
    cut: int | None  # stop (FIN or RST, by ``end``) after this many bytes of the stream
    splits: tuple[int, ...]  # write boundaries

    @property
    def head(self) -> bytes:
        lines = [b"HTTP/1.1 %d X\r\n" % self.status]
        lines += [k + b": " + v + b"\r\n" for k, v in self.fields]
        return b"".join(lines) + b"\r\n"

    @property
    def stream(self) -> bytes:
        return b"".join(self.interim) + self.head + self.wire_body + self.trailers + self.after

    @property
    def sent(self) -> bytes:
        return self.stream if self.cut is None else self.stream[: self.cut]

    def pieces(self) -> list[bytes]:
        data = self.sent
        edges = [0, *sorted(p for p in set(self.splits) if 0 < p < len(data)), len(data)]
        return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


def _chunked(content: bytes, sizes: list[int], ext: bool) -> tuple[bytes, list[int]]:
    """``content`` in chunks of ``sizes`` (cycled), and per wire byte the content bytes
    complete up to it (a chunk's data byte counts once it arrived)."""
    out, at, done, pos, i = bytearray(), [], 0, 0, 0
    while pos < len(content):
        size = min(sizes[i % len(sizes)], len(content) - pos)
        i += 1
        line = b"%x%s\r\n" % (size, b";ext=1" if ext else b"")
        out += line
        at += [done] * len(line)
        for _ in range(size):
            done += 1
            at.append(done)
        out += content[pos : pos + size] + b"\r\n"
        at += [done] * 2
        pos += size
    out += b"0\r\n"
    at += [done] * 3
    return bytes(out), at


@st.composite
def answers(draw: st.DrawFn) -> Answer:
    interim = tuple(
        draw(
            st.lists(
                st.sampled_from(
                    [
                        b"HTTP/1.1 100 Continue\r\n\r\n",
                        b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n",
                    ]
                ),
                max_size=2,
            )
        )
    )
    status = draw(st.sampled_from([200, 200, 200, 201, 404, 500]))
    ctype = draw(st.sampled_from([b"text/event-stream", b"application/json"]))
    count = draw(st.integers(0, 12))
    size = draw(st.sampled_from([0, 10, 1000, 8000]))
    fields = [(b"content-type", ctype)] + [(b"x-f%d" % i, b"v" * size) for i in range(count)]
    framing = draw(
        st.sampled_from(["length", "chunked", "chunked", "gzip", "close", "refused", "invalid"])
    )
    content = draw(CONTENT)
    trailers = b""
    if framing == "length":
        fields.append((b"content-length", b"%d" % len(content)))
        wire_body, at = content, list(range(1, len(content) + 1))
    elif framing in ("chunked", "gzip"):
        lines = draw(st.sampled_from(CHUNKED)) if framing == "chunked" else [b"gzip, chunked"]
        fields += [(b"transfer-encoding", v) for v in lines]
        sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=5))
        coded = gzip.compress(content) if framing == "gzip" else content
        wire_body, at = _chunked(coded, sizes, draw(st.booleans()))
        names = draw(
            st.lists(
                st.sampled_from([b"x-queue-time", b"x-request-id", b"content-type", b"x-trailer"]),
                max_size=3,
            )
        )
        trailers = b"".join(n + b": 5000\r\n" for n in names)
        if draw(st.integers(0, 9)) == 0:  # a flood of trailer fields
            trailers += b"".join(b"x-t%05d: %s\r\n" % (i, b"t" * 500) for i in range(150))
        trailers += b"\r\n"
    elif framing == "close":
        if draw(st.booleans()):
            fields.append((b"transfer-encoding", b"identity"))
        wire_body, at = content, list(range(1, len(content) + 1))
    elif framing == "refused":
        fields += [(b"transfer-encoding", v) for v in draw(st.sampled_from(REFUSED))]
        wire_body, at = content, [0] * len(content)
    else:
        fields += draw(st.sampled_from(INVALID))
        wire_body, at = content, [0] * len(content)
    complete_framing = framing in ("length", "chunked", "gzip")
    after = b""
    if complete_framing and draw(st.integers(0, 4)) == 0:
        after = draw(
            st.sampled_from(
                [
                    b"HTTP/1.1 200 OK\r\nx-second: 1\r\ncontent-length: 50\r\n\r\nnot for anyone",
                    b"garbage\r\n\r\n",
                ]
            )
        )
    end = draw(
        st.sampled_from(["fin", "rst"] if not complete_framing else ["keep", "keep", "fin", "rst"])
    )
    total = (
        len(b"".join(interim))
        + len(
            Answer(
                interim,
                status,
                tuple(fields),
                framing,
                content,
                wire_body,
                (),
                trailers,
                after,
                end,
                None,
                (),
            ).head
        )
        + len(wire_body)
        + len(trailers)
        + len(after)
    )
    cut = draw(st.none() | st.integers(0, max(total - 1, 0))) if end != "keep" else None
    if cut is not None and end == "rst" and cut == total:
        cut = None
    splits = tuple(draw(st.lists(st.integers(1, max(total - 1, 1)), max_size=25)))
    return Answer(
        interim,
        status,
        tuple(fields),
        framing,
        content,
        wire_body,
        tuple(at),
        trailers,
        after,
        end,
        cut,
        splits,
    )


@dataclass(frozen=True)
class Expected:
    """What the client and the records should show for an :class:`Answer`."""

    refused: bool  # a 502 before any byte
    codes: frozenset[str] = frozenset()  # the error's code, when refused
    status: int = 0
    body: bytes = b""  # the content the client gets (a prefix of it with a reset)
    complete: bool = False
    outcomes: frozenset[str] = frozenset()
    exact: bool = True  # False: a reset, the kernel decides how much of it arrived
    pooled: bool = False  # a clean, complete keep-alive answer: its connection is reused


def _field_bytes(fields: tuple[tuple[bytes, bytes], ...]) -> int:
    return sum(len(k) + len(v) + 4 for k, v in fields)


def expect(a: Answer) -> Expected:
    """The proxy's promise for ``a``, from the fault table of docs/operations.md."""
    sent = len(a.sent)
    head_end = len(b"".join(a.interim)) + len(a.head)
    exact = a.end != "rst" or a.cut is None
    too_large = _field_bytes(a.fields) > MAX_HEAD_BYTES
    # a head the cap may or may not catch, by where the reads end (see proxy.wire)
    maybe_large = len(b"".join(a.interim)) + len(a.head) > MAX_HEAD_BYTES
    if sent < head_end or too_large or a.framing in ("refused", "invalid"):
        codes = {"upstream_failed"}
        outcomes = set()
        if sent >= head_end or too_large or maybe_large:
            if too_large or maybe_large:
                codes.add("upstream_headers_too_large")
            outcomes.add("upstream_error")
        if sent < head_end or a.end == "rst":
            outcomes.add("upstream_interrupted")
        if sent >= head_end and a.framing in ("refused", "invalid"):
            outcomes.add("upstream_error")
        if a.framing == "invalid":  # the parser may see it in the field, before the head ends
            outcomes.add("upstream_error")
        return Expected(True, frozenset(codes), outcomes=frozenset(outcomes), exact=exact)
    into_body = sent - head_end
    if a.framing == "close":
        body = a.content[:into_body]
        complete = a.end == "fin" and exact
    else:
        got = (
            a.content_at[into_body - 1]
            if 0 < into_body <= len(a.content_at)
            else (a.content_at[-1] if into_body > len(a.content_at) and a.content_at else 0)
        )
        coded = (gzip.compress(a.content) if a.framing == "gzip" else a.content)[:got]
        body = _gunzip_prefix(coded) if a.framing == "gzip" else coded
        complete = sent >= head_end + len(a.wire_body) + len(a.trailers)
    # trailer fields past the cap fail the answer once its content is through
    flood = len(a.trailers) > MAX_HEAD_BYTES and sent >= head_end + len(a.wire_body)
    complete = complete and not flood
    ok = 200 <= a.status < 300
    if not ok:
        outcome = {"upstream_4xx"} if a.status < 500 else {"upstream_5xx"}
    elif complete:
        outcome = {_stream_end(body, a)}
    else:
        outcome = {"upstream_interrupted"}
    pooled = complete and a.end == "keep" and not a.after
    return Expected(
        False,
        status=a.status,
        body=body,
        complete=complete,
        outcomes=frozenset(outcome),
        exact=exact,
        pooled=pooled,
    )


def _gunzip_prefix(coded: bytes) -> bytes:
    import zlib

    z = zlib.decompressobj(16 + zlib.MAX_WBITS)
    return z.decompress(coded)


def _stream_end(body: bytes, a: Answer) -> str:
    """How a 200 answer whose body ended well is recorded (the table's rows): an error
    event inside a stream is ``upstream_error``; a stream with neither its last event nor
    a finish reason ended before its answer did, ``upstream_interrupted``."""
    if not dict(a.fields).get(b"content-type", b"").lower().startswith(b"text/event-stream"):
        return "completed"
    timer = StreamTimer(dialects.CHAT)
    for ev in SSEParser().feed(body):  # an event the body ends inside is not one (WHATWG)
        timer.event(ev.event, ev.data, 1.0)
    if timer.error:
        return "upstream_error"
    if timer.ended_t is None and not timer.response().finish:
        return "upstream_interrupted"
    return "completed"


# ---------------------------------------------------------------------------
# The proxy and its upstream, one per module


@dataclass
class Rig:
    loop: asyncio.AbstractEventLoop
    proxy: InProcess
    answer: list[Answer] = field(default_factory=list)
    written: asyncio.Event | None = None

    def outcomes(self) -> dict[str, float]:
        """``llm_proxy_stream_outcomes_total`` by outcome (its one metric collected, not the
        registry: that would be most of an example's time)."""
        out: dict[str, float] = {}
        for metric in self.proxy.app.metrics.outcomes.collect():
            for s in metric.samples:
                if s.name == "llm_proxy_stream_outcomes_total":
                    out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
        return out

    def queue_reports(self) -> float:
        return sum(
            s.value
            for m in self.proxy.app.metrics.upstream_queue.collect()
            for s in m.samples
            if s.name.endswith("_count")
        )


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    loop = asyncio.new_event_loop()
    holder: list[Rig] = []

    async def behaviour(conn: Conn) -> None:
        if conn.request.model != "fuzz":
            await normal(conn)
            return
        r = holder[0]
        a = r.answer[0]
        try:
            for piece in a.pieces():
                await conn.write(piece)
                for _ in range(2):
                    await asyncio.sleep(0)  # a loop turn: the proxy reads the piece alone
            if a.end == "fin":
                conn.close()
            elif a.end == "rst":
                conn.reset()
        finally:
            assert r.written is not None
            r.written.set()
        if a.end == "keep" and a.after:
            await conn.until_closed(5)

    proxy, _ = make_app(
        None,
        ScriptedClock(),
        behaviour=behaviour,
        read_timeout=5.0,
        connect_timeout=2.0,
        max_upstream_connections=1,
        # What an exchange leaves in the pool is the property; a connection the pool
        # opens to keep one warm is not the exchange's (tests/test_upstream_setup.py).
        upstream_keep_warm=0.0,
    )
    holder.append(Rig(loop, proxy))
    try:
        loop.run_until_complete(proxy.scripted.start())
        yield holder[0]
    finally:
        loop.run_until_complete(proxy.aclose())
        loop.close()


def _body(model: str) -> bytes:
    return json.dumps(
        {"model": model, "stream": True, "messages": [], "stream_options": {"include_usage": True}}
    ).encode()


NORMAL = b"".join(stream_events(3, usage=True))


def run_case(rig: Rig, a: Answer) -> tuple[RawResult, int]:
    """One exchange; the traced memory's peak growth during it."""
    rig.answer[:] = [a]

    async def go() -> tuple[RawResult, int]:
        rig.written = asyncio.Event()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = await call_raw(rig.proxy, "POST", CHAT, body=_body("fuzz"))
        peak = tracemalloc.get_traced_memory()[1] - base
        async with asyncio.timeout(10):
            await rig.written.wait()
        for _ in range(5):
            await asyncio.sleep(0)  # bytes after the end, if any, reach the proxy
        return result, peak

    return rig.loop.run_until_complete(go())


def check(rig: Rig, a: Answer) -> None:
    e = expect(a)
    before, queue_before = rig.outcomes(), rig.queue_reports()
    result, peak = run_case(rig, a)
    after = rig.outcomes()
    got = {k for k in after if after[k] != before.get(k, 0.0)}
    event(f"{a.framing}: {', '.join(sorted(got))}")  # --hypothesis-show-statistics
    assert peak < MEMORY_BOUND, f"{peak} bytes traced during one exchange"
    assert len(got) == 1 and got <= e.outcomes, (got, e)
    # no header ever comes from trailers or a second response
    assert rig.queue_reports() == queue_before
    if not e.exact and result.status == 502 and got == {"upstream_interrupted"}:
        pass  # reset: the kernel dropped the head it had not delivered yet
    elif e.refused:
        assert result.status == 502
        error = json.loads(result.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] in e.codes, (error, e)
        assert result.completed
    else:
        assert result.status == e.status
        names = {k for k, _ in result.headers}
        assert not names & {b"x-queue-time", b"x-trailer", b"x-second"}
        assert not any(k.startswith(b"x-t0") for k in names)
        ctype = [v for k, v in result.headers if k == b"content-type"]
        assert ctype == [dict(a.fields)[b"content-type"]]
        if e.exact:
            assert result.body == e.body
        else:
            assert e.body.startswith(result.body)
        assert result.completed == e.complete or (not e.exact and not result.completed)
    transport = rig.proxy.app.upstream.transport
    pooled = [c for c in itertools.chain(*transport.idle.values())
              if c.state is not ConnectionState.CLOSED]
    if not e.pooled:
        assert pooled == [], "a connection that saw something unexpected was pooled"
    else:
        assert len(pooled) == 1
    nxt = rig.loop.run_until_complete(call_raw(rig.proxy, "POST", CHAT, body=_body("ok")))
    assert (nxt.status, nxt.body, nxt.completed) == (200, NORMAL, True)


CHUNK_ANSWER = dict(
    interim=(),
    status=200,
    fields=((b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")),
    framing="chunked",
    content=b"data: x\n\n",
    after=b"",
    end="keep",
    cut=None,
    splits=(),
)


def _chunk_answer(**over: Any) -> Answer:
    values: dict[str, Any] = {**CHUNK_ANSWER, **over}
    wire, at = _chunked(values["content"], [4], False)
    values.setdefault("trailers", b"\r\n")
    return Answer(wire_body=wire, content_at=tuple(at), **values)


@pytest.fixture(scope="module", autouse=True)
def traced() -> Iterator[None]:
    tracemalloc.start()
    yield
    tracemalloc.stop()


@FUZZ
@given(answers())
@example(_chunk_answer())
@example(_chunk_answer(trailers=b"x-queue-time: 5000\r\nx-trailer: 1\r\n\r\n"))
@example(  # found by the campaign: the parser refused a duplicate length mid-head
    Answer(
        (),
        200,
        (
            (b"content-type", b"text/event-stream"),
            (b"content-length", b"3"),
            (b"content-length", b"4"),
        ),
        "invalid",
        b"",
        b"",
        (),
        b"",
        b"",
        "fin",
        85,
        (),
    )
)
@example(
    _chunk_answer(
        fields=(
            (b"content-type", b"text/event-stream"),
            (b"transfer-encoding", b"chunked, identity"),
        ),
        framing="refused",
        end="fin",
    )
)
def test_any_upstream_answer_keeps_the_promises(rig: Rig, a: Answer) -> None:
    check(rig, a)


def run_campaign(name: str, strategy: st.SearchStrategy[Any], check_one: Any) -> None:
    """The long run of a fuzzer: its property again and again with new random examples,
    for ``FUZZ_CAMPAIGN_SECONDS``; prints how many examples ran (a failure stops it,
    shrunk). ``check_one`` checks one example drawn from ``strategy``."""
    seconds = float(os.environ.get("FUZZ_CAMPAIGN_SECONDS", "0"))
    if seconds <= 0:
        pytest.skip("set FUZZ_CAMPAIGN_SECONDS for the long campaign")
    count = 0

    @settings(FUZZ, max_examples=200)
    @given(strategy)
    def one(example: Any) -> None:
        nonlocal count
        count += 1
        check_one(example)

    start = time.monotonic()
    while time.monotonic() - start < seconds:
        one()
    took = time.monotonic() - start
    print(f"\n{name} campaign: {count} examples in {took:.0f} s, no failure")


@pytest.mark.fuzz_campaign
@pytest.mark.timeout(0)
def test_campaign(rig: Rig) -> None:
    """The long run of the property above (:func:`run_campaign`)."""
    run_campaign("upstream", answers(), lambda a: check(rig, a))
