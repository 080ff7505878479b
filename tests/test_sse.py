"""SSE parser: every split point, every line ending, spans, boundary and memory bound.

Expected results come from ``reference_parse``, a deliberately naive whole-stream
reading of the WHATWG event-stream grammar written here independently of
:mod:`proxy.sse` (split lines on CRLF/LF/CR, blank line dispatches an event that had a
``data`` field, named by its last ``event`` line). The incremental parser must agree
with it whatever the chunking, and so must what a dialect reads from the events.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import tracemalloc
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
from hypothesis import event as hypothesis_event
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.dialects import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Dialect, EventInfo
from proxy.sse import SSEEvent, SSEParser

Expected = tuple[bytes, int, int, bool, bytes]  # data, start, end, oversize, event
_EOL = re.compile(rb"\r\n|\r|\n")


@functools.lru_cache(maxsize=64)
def reference_parse(stream: bytes, max_event_bytes: int = 1 << 20) -> list[Expected]:
    """Whole-stream parse: (data, start, end, oversize, event) for every dispatched event.

    An event's span runs from its first line to the end of the blank line that ends
    it; it is oversize when its bytes before that blank line are more than
    ``max_event_bytes``, and then its data and name are empty.
    """
    events: list[Expected] = []
    pos = 0
    start = -1
    data: list[bytes] = []
    has_data = False
    kind = b""
    for match in _EOL.finditer(stream):
        line = stream[pos : match.start()]
        end = match.end()
        if not line:
            if start >= 0 and has_data:
                if pos - start > max_event_bytes:
                    events.append((b"", start, end, True, b""))
                else:
                    events.append((b"\n".join(data), start, end, False, kind))
            start, data, has_data, kind = -1, [], False, b""
        else:
            if start < 0:
                start = pos
            if not line.startswith(b":"):
                name, _sep, value = line.partition(b":")
                value = value[1:] if value.startswith(b" ") else value
                if name == b"data":
                    has_data = True
                    data.append(value)
                elif name == b"event":
                    kind = value
        pos = end
    return events


def expected_for(
    stream: bytes, cuts: Iterable[int], max_event_bytes: int = 1 << 20
) -> list[Expected]:
    """The reference events for ``stream`` fed in pieces cut at ``cuts``.

    One documented difference from the whole stream: an event whose final CRLF is cut
    between CR and LF ends after the CR (it is dispatched on the read that brought the
    CR; the LF is reported as ``straddling_lf``).
    """
    where = set(cuts)
    out = []
    for data, start, end, oversize, kind in reference_parse(stream, max_event_bytes):
        if stream[end - 2 : end] == b"\r\n" and end - 1 in where:
            end -= 1
        out.append((data, start, end, oversize, kind))
    return out


def as_tuples(events: Iterable[SSEEvent]) -> list[Expected]:
    return [(e.data, e.start, e.end, e.oversize, e.event) for e in events]


def feed_pieces(pieces: Sequence[bytes], max_event_bytes: int = 1 << 20) -> list[Expected]:
    parser = SSEParser(max_event_bytes)
    out: list[SSEEvent] = []
    for piece in pieces:
        out.extend(parser.feed(piece))
    return as_tuples(out)


def build(events: Sequence[Sequence[bytes]], eol: bytes | Sequence[bytes]) -> bytes:
    """Each event is a list of lines, ended by a blank line; ``eol`` one or cycled."""
    eols = [eol] if isinstance(eol, bytes) else list(eol)
    out = bytearray()
    i = 0
    for lines in events:
        for line in [*lines, b""]:
            out += line + eols[i % len(eols)]
            i += 1
    return bytes(out)


EVENTS: list[list[bytes]] = [
    [b": keep-alive comment"],
    [b'data: {"choices":[{"delta":{"role":"assistant"}}]}'],
    [b"event: message", b"id: 7", b"data:no-space", b"retry: 10"],
    [b"data: line one", b"data: line two", b": comment inside", b"data:  two spaces"],
    [b"id: only-id"],  # no data field: not dispatched
    [b"data"],  # field without colon: empty data
    [b"data: [DONE]"],
    # named events (Responses, Messages), in the shapes the grammar allows
    [b"event: content_block_delta", b'data: {"type":"content_block_delta"}'],
    [b"event:ping"],  # a name but no data: not dispatched
    [b"data: late", b"event: named-after-data"],
    [b"event: first", b"event:  second", b"data: y"],  # the last event line wins
    [b"event", b"data: unnamed"],  # an event line without a colon: the empty name
]
EOLS: dict[str, bytes | list[bytes]] = {
    "lf": b"\n",
    "crlf": b"\r\n",
    "cr": b"\r",
    "mixed": [b"\r", b"\r\n", b"\n"],  # never a lone CR before an LF
}


@pytest.fixture(params=list(EOLS), ids=list(EOLS))
def eol_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def stream(eol_name: str) -> bytes:
    return build(EVENTS, EOLS[eol_name])


def test_reference_reading_of_the_sample() -> None:
    """Anchor the reference itself on a hand-checked case, so the comparisons mean something."""
    events = [(e[0], e[4]) for e in reference_parse(build(EVENTS, b"\n"))]
    assert events == [
        (b'{"choices":[{"delta":{"role":"assistant"}}]}', b""),
        (b"no-space", b"message"),
        (b"line one\nline two\n two spaces", b""),
        (b"", b""),
        (b"[DONE]", b""),
        (b'{"type":"content_block_delta"}', b"content_block_delta"),
        (b"late", b"named-after-data"),
        (b"y", b" second"),
        (b"unnamed", b""),
    ]


def test_whole_stream_matches_reference(stream: bytes) -> None:
    expected = reference_parse(stream)
    assert len(expected) == 9
    assert feed_pieces([stream]) == expected


def test_every_two_piece_split(stream: bytes) -> None:
    for cut in range(len(stream) + 1):
        assert feed_pieces([stream[:cut], stream[cut:]]) == expected_for(stream, [cut]), cut


def test_every_three_piece_split(eol_name: str) -> None:
    # four of the sample events (every kind of line), to keep the n^2 cuts fast
    stream = build(EVENTS[1:4] + EVENTS[5:6], EOLS[eol_name])
    assert len(expected_for(stream, [])) == 4
    n = len(stream)
    for a in range(n + 1):
        for b in range(a, n + 1):
            got = feed_pieces([stream[:a], stream[a:b], stream[b:]])
            assert got == expected_for(stream, [a, b]), (a, b)


def test_every_three_piece_split_of_named_events(eol_name: str) -> None:
    stream = build(EVENTS[7:12], EOLS[eol_name])
    assert [e[4] for e in expected_for(stream, [])] == [
        b"content_block_delta", b"named-after-data", b" second", b""]  # fmt: skip
    n = len(stream)
    for a in range(n + 1):
        for b in range(a, n + 1):
            got = feed_pieces([stream[:a], stream[a:b], stream[b:]])
            assert got == expected_for(stream, [a, b]), (a, b)


def test_byte_by_byte(stream: bytes) -> None:
    expected = expected_for(stream, range(len(stream)))
    assert feed_pieces([stream[i : i + 1] for i in range(len(stream))]) == expected


def test_crlf_split_between_chunks_is_one_line_ending() -> None:
    """A CR ending one chunk and an LF starting the next make one CRLF, not two lines."""
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\ndata: b\r") == []
    # If the LF were a line of its own the event would already have been dispatched
    # with only "a"; the CR + LF that follows ends the event with both lines.
    assert parser.straddling_lf == len(b"data: a\r")
    events = parser.feed(b"\n\r\n")
    assert parser.straddling_lf == len(b"data: a\r\ndata: b\r")
    assert [e.data for e in events] == [b"a\nb"]
    assert (events[0].start, events[0].end) == (0, len(b"data: a\r\ndata: b\r\n\r\n"))
    parser.feed(b"data: c\n")
    assert parser.straddling_lf == -1


def test_lone_cr_at_chunk_end_dispatches_at_once() -> None:
    """An event ended by CR at the end of a read is dispatched on that read (timing)."""
    parser = SSEParser()
    events = parser.feed(b"data: x\r\r")
    assert as_tuples(events) == [(b"x", 0, 9, False, b"")]
    assert parser.feed(b"\n") == []  # the second half of a CRLF, nothing more
    assert parser.straddling_lf == events[0].end  # so a caller can drop it with the event
    assert parser.boundary == 10


def test_events_without_data_are_not_dispatched() -> None:
    stream = b"event: ping\n\n: comment\n\nid: 3\nretry: 5\n\n"
    assert feed_pieces([stream]) == []
    assert feed_pieces([stream[i : i + 1] for i in range(len(stream))]) == []


def test_data_field_variants() -> None:
    stream = b"data:x\n\ndata: x\n\ndata:  x\n\ndata\n\ndata:\n\ndatax: y\n\nDATA: z\n\n"
    assert [e[0] for e in feed_pieces([stream])] == [b"x", b"x", b" x", b"", b""]


def test_event_name_kept_other_fields_ignored() -> None:
    stream = b"event: delta\nid: 42\ndata: payload\nretry: 100\nfoo: bar\n\n"
    assert [(e[0], e[4]) for e in feed_pieces([stream])] == [(b"payload", b"delta")]


def test_event_name_does_not_carry_over() -> None:
    """The name belongs to one event: the next one, or a nameless event after a
    data-less named block, has none."""
    stream = b"event: a\ndata: 1\n\ndata: 2\n\nevent: b\n\ndata: 3\n\n"
    for pieces in ([stream], [stream[i : i + 1] for i in range(len(stream))]):
        assert [(e[0], e[4]) for e in feed_pieces(pieces)] == [
            (b"1", b"a"), (b"2", b""), (b"3", b"")]  # fmt: skip


def test_named_events_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole LF events, named or not, never reach the line-by-line parser."""
    stream = (b"event: message_start\ndata: {}\n\n: ping\n\ndata: a\n\n"
              b"event:x\ndata:b\n\n")  # fmt: skip
    expected = reference_parse(stream)
    assert [(e[0], e[4]) for e in expected] == [
        (b"{}", b"message_start"),
        (b"a", b""),
        (b"b", b"x"),
    ]
    parser = SSEParser()
    monkeypatch.setattr(SSEParser, "_slow", lambda *a: pytest.fail("slow path taken"))
    assert as_tuples(parser.feed(stream)) == expected


def test_blank_lines_between_events_are_outside_spans() -> None:
    stream = b"\n\ndata: a\n\n\n\r\ndata: b\n\n"
    events = feed_pieces([stream])
    assert [e[0] for e in events] == [b"a", b"b"]
    assert [stream[e[1] : e[2]] for e in events] == [b"data: a\n\n", b"data: b\n\n"]


def test_removing_each_span_leaves_the_other_events(stream: bytes) -> None:
    events = feed_pieces([stream])
    for i, (_, start, end, _, _) in enumerate(events):
        rest = stream[:start] + stream[end:]
        others = [e[0] for j, e in enumerate(events) if j != i]
        assert [e[0] for e in feed_pieces([rest])] == others, i


def test_spans_tile_each_event_exactly(stream: bytes) -> None:
    """Each span re-parsed alone is exactly that one event, whatever the chunking."""
    for pieces in ([stream], [stream[i : i + 1] for i in range(len(stream))]):
        for data, start, end, _, kind in feed_pieces(pieces):
            alone = feed_pieces([stream[start:end]])
            assert [(e[0], e[4]) for e in alone] == [(data, kind)]
            assert (alone[0][1], alone[0][2]) == (0, end - start)


def test_boundary_after_every_split(stream: bytes) -> None:
    """Bytes before ``boundary`` hold exactly the events seen so far; none start after it."""
    expected = reference_parse(stream)
    for cut in range(len(stream) + 1):
        parser = SSEParser()
        seen = as_tuples(parser.feed(stream[:cut]))
        boundary = parser.boundary
        assert 0 <= boundary <= cut
        assert reference_parse(stream[:boundary]) == seen, cut
        assert all(e[2] <= boundary for e in seen)
        # the held-back tail belongs to an event that is not finished yet
        seen_starts = {e[1] for e in seen}
        later = [e for e in expected if e[1] not in seen_starts]
        assert all(e[1] >= boundary for e in later), cut


def test_boundary_is_the_offset_when_nothing_is_pending() -> None:
    parser = SSEParser()
    parser.feed(b"data: a\n\n")
    assert parser.boundary == 9
    parser.feed(b"data: b\n")
    assert parser.boundary == 9  # an event has started and is not finished
    parser.feed(b"\n")
    assert parser.boundary == 18


def test_done_marker_is_plain_data() -> None:
    events = feed_pieces([b'data: {"a":1}\n\ndata: [DONE]\n\n'])
    assert [e[0] for e in events] == [b'{"a":1}', b"[DONE]"]


def test_empty_chunks_are_harmless() -> None:
    parser = SSEParser()
    assert parser.feed(b"") == []
    assert [e.data for e in parser.feed(b"data: a\n\n")] == [b"a"]
    assert parser.feed(b"") == []
    assert parser.boundary == 9


# ---------------------------------------------------------------------------
# Over-long events: flagged, memory bounded, and the same whatever the chunking.

LIMIT = 64


def oversize_stream(eol: bytes) -> bytes:
    return build(
        [
            [b"data: small"],
            [b"data: " + b"x" * 200],  # one long line
            [b"data: " + b"y" * 40, b"data: " + b"z" * 40],  # long only in total
            [b": " + b"c" * 200],  # a long comment: still no event
            [b"data: after"],
            [b"event: " + b"n" * 200, b"data: x"],  # a long name: oversize, name dropped
            [b"event: small", b"data: " + b"d" * 60],  # named, long only in total
            [b"event: small", b"data: named"],
            [b"event: small", b"data: x", b": " + b"c" * 80],  # long only by its comment
        ],
        eol,
    )


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_oversize_flagged_and_parsing_continues(eol: bytes) -> None:
    stream = oversize_stream(eol)
    expected = reference_parse(stream, LIMIT)
    assert [(e[0], e[3], e[4]) for e in expected] == [
        (b"small", False, b""), (b"", True, b""), (b"", True, b""), (b"after", False, b""),
        (b"", True, b""), (b"", True, b""), (b"named", False, b"small"), (b"", True, b"")]  # fmt: skip
    assert feed_pieces([stream], LIMIT) == expected
    every = range(len(stream))
    assert feed_pieces([stream[i : i + 1] for i in every], LIMIT) == expected_for(
        stream, every, LIMIT
    )
    for cut in range(len(stream) + 1):
        got = feed_pieces([stream[:cut], stream[cut:]], LIMIT)
        assert got == expected_for(stream, [cut], LIMIT), cut


@pytest.mark.parametrize("size", range(LIMIT - 12, LIMIT + 4))
def test_oversize_threshold_does_not_depend_on_chunking(size: int) -> None:
    """Around the limit, the same event is oversize or not however it was cut."""
    stream = b"data: " + b"v" * size + b"\n\n"
    expected = reference_parse(stream, LIMIT)
    assert feed_pieces([stream], LIMIT) == expected
    for cut in range(len(stream) + 1):
        assert feed_pieces([stream[:cut], stream[cut:]], LIMIT) == expected, cut
    assert feed_pieces([stream[i : i + 1] for i in range(len(stream))], LIMIT) == expected


def test_memory_stays_bounded_for_an_endless_event() -> None:
    """The parser's memory, as the allocator sees it, stays far below what it was fed."""
    parser = SSEParser(LIMIT)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        parser.feed(b"data: ")
        for _ in range(2000):
            parser.feed(b"w" * 37)
        parser.feed(b"\ndata: more\n")
        for _ in range(100):
            parser.feed(b"data: " + b"q" * 50 + b"\n")
        held = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert held < 2000 * 37 // 4  # fed 2000 * 37 bytes of one event
    events = parser.feed(b"\n")
    assert as_tuples(events) == [(b"", events[0].start, events[0].end, True, b"")]
    assert [e.data for e in parser.feed(b"data: ok\n\n")] == [b"ok"]


# ---------------------------------------------------------------------------
# Property: any events, any line endings, cut anywhere: same as fed whole.

_text = st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_line = st.one_of(
    _text.map(lambda v: b"data:" + v),
    _text.map(lambda v: b"data: " + v),
    st.just(b"data"),
    _text.map(lambda v: b":" + v),
    _text.map(lambda v: b"event: " + v),
    _text.map(lambda v: b"id:" + v),
    _text.filter(lambda v: v[:1] not in (b"", b":")),  # any field name, maybe no colon
)
_eol = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    events = draw(st.lists(st.lists(_line, max_size=4), max_size=6))
    out = bytearray()
    for lines in events:
        for line in [*lines, b""]:
            out += line + draw(_eol)
    if draw(st.booleans()):  # an unfinished tail
        out += draw(_line)
    stream = bytes(out)
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    return stream, cuts


@settings(max_examples=250, deadline=None)
@given(streams(), st.sampled_from([LIMIT, 1 << 20]))
def test_property_chunking_never_changes_the_events(
    case: tuple[bytes, list[int]], limit: int
) -> None:
    stream, cuts = case
    bounds = [0, *cuts, len(stream)]
    pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    whole = feed_pieces([stream], limit)
    assert whole == reference_parse(stream, limit)
    assert feed_pieces(pieces, limit) == expected_for(stream, cuts, limit)
    assert [e[0] for e in feed_pieces(pieces, limit)] == [e[0] for e in whole]


# ---------------------------------------------------------------------------
# ``single``: the relay's fast path for a chunk that is exactly one one-line event.


def test_single_takes_one_data_line_event() -> None:
    parser = SSEParser()
    chunk = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    assert parser.single(chunk) == (b"", b'{"choices":[{"delta":{"content":"a"}}]}')
    assert (parser.boundary, parser.straddling_lf) == (len(chunk), -1)
    assert parser.single(b"data:x\n\n") == (b"", b"x")
    assert parser.single(b"data:\n\n") == (b"", b"")
    # The offsets moved on exactly as ``feed`` would have moved them.
    start = len(chunk) + len(b"data:x\n\n") + len(b"data:\n\n")
    assert as_tuples(parser.feed(b"data: y\n\n")) == [(b"y", start, start + 9, False, b"")]


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        (b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n',
         (b"content_block_delta", b'{"type":"content_block_delta"}')),
        (b"event:ping\ndata:{}\n\n", (b"ping", b"{}")),
        (b"event:  two\ndata:  x\n\n", (b" two", b" x")),  # one space is dropped, no more
        (b"event:\ndata: x\n\n", (b"", b"x")),
        (b"event: e\ndata:\n\n", (b"e", b"")),
        (b"event: a:b\ndata: c:d\n\n", (b"a:b", b"c:d")),
    ],
)  # fmt: skip
def test_single_takes_one_named_event(chunk: bytes, expected: tuple[bytes, bytes]) -> None:
    parser = SSEParser()
    assert parser.single(b"data: 0\n\n") == (b"", b"0")
    assert parser.single(chunk) == expected
    assert parser.boundary == 9 + len(chunk)
    assert [(e.event, e.data) for e in SSEParser().feed(chunk)] == [expected]


@pytest.mark.parametrize(
    "chunk",
    [
        b"data: a\n\ndata: b\n\n",  # two events
        b"data: a\r\n\r\n",  # CRLF
        b"data: a\r\r",  # CR
        b": keep-alive\n\n",  # a comment
        b"data: a\n",  # the event is not finished
        b"data: a",  # nor the line
        b"data: a\ndata: b\n\n",  # two data lines
        b"id: 1\ndata: a\n\n",  # another field first
        b"data: a\n\n\n",  # a blank line after the event
        b"",
        b"event: e\n\n",  # a name and no data: no event
        b"event: e\ndata: a\n",  # not finished
        b"event: e\ndata: a\r\n\r\n",  # CRLF
        b"event: e\r\ndata: a\n\n",  # CRLF in the name line
        b"event: e\nevent: f\ndata: a\n\n",  # two names
        b"event: e\ndata: a\ndata: b\n\n",  # two data lines
        b"data: a\nevent: e\n\n",  # the name after the data
        b"event: e\nid: 1\ndata: a\n\n",  # another field between
        b"event: e\ndata: a\n\nevent: f\ndata: b\n\n",  # two named events
        b"eventx: e\ndata: a\n\n",  # not the event field
    ],
    ids=[
        "two-events",
        "crlf",
        "cr",
        "comment",
        "partial-event",
        "partial-line",
        "multi-line",
        "field",
        "extra-blank",
        "empty",
        "named-no-data",
        "named-partial",
        "named-crlf",
        "named-crlf-name",
        "two-names",
        "named-multi-line",
        "name-after-data",
        "name-field",
        "two-named",
        "eventx",
    ],
)
def test_single_declines_anything_else_and_consumes_nothing(chunk: bytes) -> None:
    parser = SSEParser()
    assert parser.single(chunk) is None
    assert parser.boundary == 0
    assert as_tuples(parser.feed(chunk)) == feed_pieces([chunk])


@pytest.mark.parametrize(
    "before",
    [b"da", b"data: a\n", b"data: a\r\r"],
    ids=["carried-line", "open-event", "pending-cr"],
)
def test_single_declines_while_the_parser_holds_state(before: bytes) -> None:
    parser = SSEParser()
    parser.feed(before)
    chunk = b"data: b\n\n"
    assert parser.single(chunk) is None
    assert (
        as_tuples(parser.feed(chunk)) == feed_pieces([before, chunk])[len(feed_pieces([before])) :]
    )


def test_single_respects_the_event_limit() -> None:
    # The event size is its bytes up to its blank line: n - 1 for a one-line event.
    assert SSEParser(8).single(b"data: 1\n\n") == (b"", b"1")  # 8 bytes: at the limit
    parser = SSEParser(8)
    assert parser.single(b"data: 12\n\n") is None  # 9 bytes: oversize, left to feed
    assert as_tuples(parser.feed(b"data: 12\n\n")) == [(b"", 0, 10, True, b"")]
    named = b"event: e\ndata: 1\n\n"  # 17 bytes up to its blank line
    assert SSEParser(17).single(named) == (b"e", b"1")
    parser = SSEParser(16)
    assert parser.single(named) is None
    assert as_tuples(parser.feed(named)) == [(b"", 0, 18, True, b"")]


_value = st.one_of(_text, st.integers(LIMIT - 12, LIMIT + 4).map(lambda n: b"v" * n))


@st.composite
def event_chunks(draw: st.DrawFn) -> list[bytes]:
    """An SSE stream of one-line LF events (what ``single`` takes) mixed with everything
    it must decline, cut at event boundaries and at random points."""
    parts: list[bytes] = []
    kinds = st.sampled_from(["single", "single", "named", "lines", "oversize", "blank"])
    for kind in draw(st.lists(kinds, max_size=10)):
        eol = draw(_eol)
        if kind == "single":
            parts.append(draw(st.sampled_from([b"data:", b"data: "])) + draw(_value) + b"\n\n")
        elif kind == "named":
            name = draw(st.sampled_from([b"event:", b"event: "])) + draw(_text)
            parts.append(name + b"\ndata: " + draw(_value) + b"\n\n")
        elif kind == "lines":
            lines = draw(st.lists(_line, min_size=1, max_size=4))
            parts.append(b"".join(line + draw(_eol) for line in lines) + eol)
        elif kind == "oversize":
            size = draw(st.integers(LIMIT - 4, 3 * LIMIT))
            parts.append(b"data: " + b"o" * size + eol + b"data: more" + eol + eol)
        else:
            parts.append(eol)
    stream = b"".join(parts)
    edges = list(itertools.accumulate(map(len, parts), initial=0))
    keep = draw(st.lists(st.booleans(), min_size=len(edges), max_size=len(edges)))
    cuts = {edge for edge, kept in zip(edges, keep, strict=True) if kept}
    cuts |= draw(st.sets(st.integers(0, len(stream)), max_size=6))
    bounds = [0, *sorted(cuts), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(event_chunks(), st.sampled_from([LIMIT, 1 << 20]))
@example([b"data: a\n\n", b"data:b\n\n", b"data: c\n", b"\ndata: d\n\n"], LIMIT)
@example([b"data: a\r", b"\n\r", b"\ndata: b\n\n", b"data: " + b"v" * LIMIT + b"\n\n"], LIMIT)
@example([b"event: e\ndata: a\n\n", b"event: f\n", b"data: b\n\n", b"data: c\n\n"], LIMIT)
def test_property_single_then_feed_equals_feed(chunks: list[bytes], limit: int) -> None:
    """Trying ``single`` first and falling back to ``feed`` (as the relay does) is
    indistinguishable from ``feed`` alone: same events, same state after every chunk."""
    fast, plain = SSEParser(limit), SSEParser(limit)
    for chunk in chunks:
        one = fast.single(chunk)
        if one is not None:
            hypothesis_event("single took a named chunk" if one[0] else "single took a chunk")
            got = [(one[1], False, one[0])]
        else:
            got = [(e.data, e.oversize, e.event) for e in fast.feed(chunk)]
        assert got == [(e.data, e.oversize, e.event) for e in plain.feed(chunk)], chunk
        assert fast.boundary == plain.boundary, chunk
        assert fast.straddling_lf == plain.straddling_lf, chunk


# ---------------------------------------------------------------------------
# What a dialect reads from the events does not depend on how the bytes arrived.

SAMPLES: dict[str, tuple[Dialect, list[tuple[str, dict[str, Any]]]]] = {
    "chat": (CHAT, [
        ("", {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        ("", {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}),
        ("", {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}),
        ("", {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}),
        ("", {"error": {"message": "boom"}}),
    ]),
    "completions": (COMPLETIONS, [
        ("", {"choices": [{"index": 0, "text": "Hi"}]}),
        ("", {"choices": [{"index": 0, "text": ""}]}),
    ]),
    "responses": (RESPONSES, [
        ("response.created", {"type": "response.created", "response": {"usage": None}}),
        ("response.reasoning_text.delta",
         {"type": "response.reasoning_text.delta", "sequence_number": 1, "delta": "r"}),
        ("response.output_text.delta",
         {"type": "response.output_text.delta", "sequence_number": 2, "delta": "Hi"}),
        ("response.output_text.delta",
         {"type": "response.output_text.delta", "sequence_number": 3, "delta": ""}),
        ("response.completed",
         {"type": "response.completed", "response": {"usage": {"input_tokens": 3}}}),
        ("error", {"type": "error", "message": "m"}),
    ]),
    "messages": (MESSAGES, [
        ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 5}}}),
        ("ping", {"type": "ping"}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "thinking_delta", "thinking": "t"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": "Hi"}}),
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 2}}),
        ("error", {"type": "error", "error": {"type": "overloaded_error"}}),
    ]),
}  # fmt: skip


@st.composite
def dialect_streams(draw: st.DrawFn) -> tuple[Dialect, bytes, list[EventInfo]]:
    """A stream of one dialect's events, each written with or without its ``event:``
    line (without "type" sometimes when the line is there), compact or pretty-printed
    over several ``data:`` lines, any line endings, comments between; and what each
    event should read as."""
    dialect, samples = SAMPLES[draw(st.sampled_from(sorted(SAMPLES)))]
    out = bytearray()
    expected: list[EventInfo] = []
    for name, payload in draw(st.lists(st.sampled_from(samples), min_size=1, max_size=6)):
        eol = draw(_eol)
        named = bool(name) and draw(st.booleans())
        if named and draw(st.booleans()):
            payload = {k: v for k, v in payload.items() if k != "type"}
        if draw(st.booleans()):
            lines = [json.dumps(payload, separators=(",", ":"))]
        else:
            lines = json.dumps(payload, indent=1).split("\n")
        if draw(st.booleans()):
            out += b": keep-alive" + eol
        if named:
            out += b"event: " + name.encode() + eol
        for line in lines:
            out += b"data: " + line.encode() + eol
        out += eol
        expected.append(dialect.classify_payload(name.encode() if named else b"", payload))
    return dialect, bytes(out), expected


@settings(max_examples=150, deadline=None)
@given(dialect_streams())
def test_property_dialect_reads_the_same_whatever_the_reads(
    case: tuple[Dialect, bytes, list[EventInfo]],
) -> None:
    dialect, stream, expected = case
    for pieces in ([stream], [stream[i : i + 1] for i in range(len(stream))]):
        parser = SSEParser()
        got = [dialect.classify(e.event, e.data) for p in pieces for e in parser.feed(p)]
        assert got == expected


def test_one_leading_byte_order_mark_is_ignored_however_the_stream_is_cut(stream: bytes) -> None:
    """The SSE standard ignores one BOM opening the stream (a server writing through a
    UTF-8-with-BOM encoder): the first event is read, and every span is where its bytes
    are, after the BOM's three; only the first is ignored, and part of one is not one."""
    bom = b"\xef\xbb\xbf"
    marked = bom + stream
    shifted = [(d, s + 3, e + 3, o, k) for d, s, e, o, k in expected_for(stream, [])]
    assert shifted and feed_pieces([marked]) == shifted
    for cut in range(8):
        pieces = [marked[:cut], marked[cut:]]
        assert feed_pieces(pieces) == [
            (d, s + 3, e + 3, o, k) for d, s, e, o, k in expected_for(stream, [cut - 3])], cut
    assert feed_pieces([marked[i : i + 1] for i in range(len(marked))]) == [
        (d, s + 3, e + 3, o, k)
        for d, s, e, o, k in expected_for(stream, range(len(stream)))]
    twice = bom + marked  # the second is the first line's: not a field this parser knows
    assert feed_pieces([twice]) == reference_parse(twice)
    for part in (bom[:1], bom[:2]):
        broken = part + b"data: x\n\n" + stream
        assert feed_pieces([broken[:1], broken[1:]]) == reference_parse(broken)
