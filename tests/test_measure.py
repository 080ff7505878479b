"""Measurement: the stream timer over the chat and completions dialects, usage, queue time
and TPOT, with a scripted clock (the dialects themselves: tests/test_dialects.py).

Events are built from Python objects with ``json.dumps`` and the times come from a
script, so every expected value is computed from the same script the timer was fed.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from typing import Any

import pytest

from proxy.config import ITL_BUCKETS
from proxy.dialects import (
    CHAT,
    COMPLETIONS,
    NOT_COUNTED,
    Dialect,
    EventInfo,
    ResponseInfo,
    Usage,
    upstream_queue_seconds,
)
from proxy.dialects import base as dialect_base
from proxy.measure import (
    Outcome,
    RequestRecord,
    StreamTimer,
    estimate_prompt_tokens,
    tpot,
)
from tests.fake_upstream import chunk_json, sse, text_json, usage_json

# Payloads from the suite's one chunk builder (tests/fake_upstream.py), as the bytes of
# an SSE ``data`` field.


def inspect_event(data: bytes, *, text_route: bool) -> EventInfo:
    return (COMPLETIONS if text_route else CHAT).classify(b"", data)


def inspect_payload(payload: Any, *, text_route: bool) -> EventInfo:
    return (COMPLETIONS if text_route else CHAT).classify_payload(b"", payload)


def dialect(text_route: bool) -> Dialect:
    return COMPLETIONS if text_route else CHAT


def chat(*deltas: dict[str, Any], **extra: Any) -> bytes:
    """A chat.completion.chunk with one choice per delta."""
    return json.dumps(chunk_json(*deltas, **extra)).encode()


def text(*texts: str) -> bytes:
    return json.dumps(text_json(*texts)).encode()


def usage_chunk(prompt: int, completion: int, cached: int | None = None,
                **extra: Any) -> bytes:
    return json.dumps(usage_json(prompt, completion, cached, **extra)).encode()


def run(script: Sequence[tuple[float, bytes]], *, text_route: bool = False) -> StreamTimer:
    timer = StreamTimer(dialect(text_route))
    for t, data in script:
        timer.event(b"", data, t)
    return timer


# ---------------------------------------------------------------------------
# What carries output


@pytest.mark.parametrize(
    ("delta", "outputs"),
    [
        ({"role": "assistant"}, 0),
        ({"role": "assistant", "content": ""}, 0),
        ({"content": ""}, 0),
        ({}, 0),
        ({"content": None}, 0),
        ({"content": "Hi"}, 1),
        ({"role": "assistant", "content": "Hi"}, 1),
        ({"reasoning_content": "thinking"}, 1),
        ({"reasoning": "thinking"}, 1),
        ({"reasoning_content": "", "content": ""}, 0),
        ({"content": None, "reasoning_content": "x"}, 1),
        ({"refusal": "I can't"}, 1),
        ({"refusal": None}, 0),
        ({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}, 1),
        ({"tool_calls": []}, 0),
        ({"function_call": {"name": "f", "arguments": ""}}, 1),
        ({"function_call": None}, 0),
        ({"content": "a", "reasoning_content": "b"}, 1),  # one choice: one output
    ],
)
def test_chat_delta_outputs(delta: dict[str, Any], outputs: int) -> None:
    info = inspect_event(chat(delta), text_route=False)
    assert info.outputs == outputs
    assert info.usage is None
    assert not info.usage_only


@pytest.mark.parametrize(("texts", "outputs"), [(("",), 0), (("x",), 1), (("x", "", "y"), 2)])
def test_completions_text(texts: tuple[str, ...], outputs: int) -> None:
    assert inspect_event(text(*texts), text_route=True).outputs == outputs
    # the chat reading of the same event finds no delta: no output
    assert inspect_event(text(*texts), text_route=False).outputs == 0


def test_chat_delta_is_not_text_output() -> None:
    assert inspect_event(chat({"content": "x"}), text_route=True).outputs == 0


def test_n_greater_than_one_counts_choices() -> None:
    info = inspect_event(chat({"content": "a"}, {"role": "assistant"}, {"content": "c"}),
                         text_route=False)
    assert info.outputs == 2


def test_usage_chunk_is_usage_only() -> None:
    data = usage_chunk(11, 7, cached=4)
    info = inspect_event(data, text_route=False)
    assert info.usage_only
    assert info.outputs == 0
    assert info.usage == json.loads(data)["usage"]
    assert CHAT.usage(info.usage) == Usage(11, 4, 7)


def test_usage_on_a_content_chunk_is_not_usage_only() -> None:
    """Some servers put usage on the last content chunk: keep it, never strip it."""
    data = chat({"content": "end"}, usage={"prompt_tokens": 3, "completion_tokens": 2})
    info = inspect_event(data, text_route=False)
    assert info.outputs == 1
    assert not info.usage_only
    assert CHAT.usage(info.usage) == Usage(3, None, 2)


def test_usage_without_choices_key_is_not_usage_only() -> None:
    data = json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
    info = inspect_event(data, text_route=False)
    assert info.usage is not None
    assert not info.usage_only


@pytest.mark.parametrize(
    "data",
    [
        b"[DONE]", b"", b" ", b"{", b"{not json}", b'{"choices": "nope"}', b"[1, 2]",
        b"null", b"42", b'"text"', b'{"choices": [null, 1, "x", {"delta": "str"}]}',
        b'{"choices": [{"delta": {"content": 5}}]}', b'{"usage": "many"}',
        b"\xff\xfe{", b"{" * 100_000, b"[" * 100_000, b'{"choices": [{"delta": {"tool_calls": 0}}]}',
        b'{"n": 1' + b"0" * 5000 + b"}",  # int longer than Python's digit limit
        b'{"usage": {"prompt_tokens": -1, "completion_tokens": true}}',
    ],
)
def test_malformed_events_never_raise(data: bytes) -> None:
    info = inspect_event(data, text_route=False)
    assert info.outputs == 0
    assert not info.usage_only
    if info.usage is not None:
        assert CHAT.usage(info.usage) == Usage(None, None, None)
    assert inspect_event(data, text_route=True).outputs == 0
    timer = StreamTimer(dialect(False))
    timer.event(b"", data, 1.0)
    assert timer.first_t is None


def test_non_dict_payload_is_not_counted() -> None:
    payloads: list[Any] = [[], [{"choices": []}], None, 3.5, "x"]
    for payload in payloads:
        assert inspect_payload(payload, text_route=False) is NOT_COUNTED


def test_leading_whitespace_before_json_is_tolerated() -> None:
    assert inspect_event(b"  " + chat({"content": "x"}), text_route=False).outputs == 1


# ---------------------------------------------------------------------------
# Upstream-reported queue time


def test_vllm_queue_time_inside_usage() -> None:
    data = usage_chunk(5, 5, metrics={"queue_time_ms": 250})
    info = inspect_event(data, text_route=False)
    assert info.upstream_queue_s == 250 / 1000
    assert info.usage_only


def test_vllm_queue_time_top_level() -> None:
    payload = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1},
               "metrics": {"queue_time_ms": 12.5}}
    info = inspect_event(json.dumps(payload).encode(), text_route=False)
    assert info.upstream_queue_s == 12.5 / 1000


def test_queue_time_alone_is_still_reported() -> None:
    info = inspect_event(b'{"metrics": {"queue_time_ms": 8}}', text_route=False)
    assert info is not NOT_COUNTED
    assert info.upstream_queue_s == 8 / 1000


@pytest.mark.parametrize("value", [-1, "12", None, True, [], float("nan"), float("inf")])
def test_bad_queue_time_is_ignored(value: Any) -> None:
    payload = {"usage": {"metrics": {"queue_time_ms": value}}}
    assert upstream_queue_seconds(payload) is None
    # the same through the JSON text, where NaN/Infinity are accepted by json.loads
    info = inspect_event(json.dumps(payload).encode(), text_route=False)
    assert info.upstream_queue_s is None


# ---------------------------------------------------------------------------
# The timer, driven by a scripted clock


def test_role_only_first_chunk_does_not_start_ttft() -> None:
    script = [
        (0.125, chat({"role": "assistant"})),
        (0.25, chat({"role": "assistant", "content": ""})),
        (0.5, chat({"content": "Hel"})),
        (0.625, chat({"content": "lo"})),
        (0.75, chat({}, finish="stop")),
        (0.875, usage_chunk(9, 2)),
        (0.9375, b"[DONE]"),
    ]
    timer = run(script)
    outputs = [t for t, d in script if inspect_event(d, text_route=False).outputs]
    assert timer.first_t == outputs[0] == 0.5
    assert timer.last_t == outputs[-1]
    assert timer.gaps == [b - a for a, b in itertools.pairwise(outputs)]
    assert timer.output_events == len(outputs)
    assert CHAT.usage(timer.usage) == Usage(9, None, 2)


def test_every_gap_between_output_events_is_kept() -> None:
    times = [0.5, 0.5078125, 0.53125, 0.6875, 1.0, 1.0009765625]
    kinds: list[dict[str, Any]] = [{"reasoning_content": "r"}, {"reasoning": "r"}, {"content": "c"},
             {"tool_calls": [{"index": 0}]}, {"refusal": "no"},
             {"function_call": {"arguments": "x"}}]
    script: list[tuple[float, bytes]] = []
    for i, (t, delta) in enumerate(zip(times, kinds, strict=True)):
        script.append((t, chat(delta)))
        script.append((t + 0.0001 * (i + 1), chat({"content": ""})))  # not a token
    timer = run(script)
    assert timer.first_t == times[0]
    assert timer.last_t == times[-1]
    assert timer.gaps == [b - a for a, b in itertools.pairwise(times)]
    assert timer.output_events == len(times)


def test_n_choices_first_output_of_any_choice() -> None:
    script = [
        (0.25, chat({"role": "assistant"}, {"role": "assistant"})),
        (0.5, chat({"role": "assistant"}, {"content": "b1"})),  # choice 1 first
        (0.75, chat({"content": "a1"}, {"content": "b2"})),
        (1.0, chat({"content": "a2"}, {})),
    ]
    timer = run(script)
    assert timer.first_t == 0.5
    assert timer.output_events == 3
    assert timer.output_choices == sum(
        inspect_event(d, text_route=False).outputs for _, d in script)
    assert timer.output_choices == 4
    assert timer.gaps == [0.75 - 0.5, 1.0 - 0.75]


def test_completions_route_timer() -> None:
    script = [(0.25, text("")), (0.5, text("A")), (1.0, text("B")), (1.5, usage_chunk(3, 2))]
    timer = run(script, text_route=True)
    assert (timer.first_t, timer.last_t) == (0.5, 1.0)
    assert timer.gaps == [0.5]
    assert CHAT.usage(timer.usage).completion_tokens == 2


def test_malformed_event_mid_stream_is_skipped() -> None:
    script = [(0.5, chat({"content": "a"})), (0.75, b"{broken"), (1.0, b"\x00"),
              (1.25, chat({"content": "b"}))]
    timer = run(script)
    assert timer.gaps == [0.75]
    assert timer.output_events == 2


def test_queue_time_from_final_usage_chunk() -> None:
    timer = run([(0.5, chat({"content": "a"})),
                 (0.75, usage_chunk(1, 1, metrics={"queue_time_ms": 40}))])
    assert timer.upstream_queue_s == 40 / 1000


def test_event_returns_its_classification() -> None:
    timer = StreamTimer(dialect(False))
    info = timer.event(b"", chat({"content": "x"}), 0.5)
    assert isinstance(info, EventInfo)
    assert info.outputs == 1


# ---------------------------------------------------------------------------
# What the stream says about its answer, without decoding its token events


class CountingJson:
    """``json`` for the dialects' decodes (proxy.dialects.base), counting them."""

    def __init__(self) -> None:
        self.loads_calls = 0

    def loads(self, data: Any) -> Any:
        self.loads_calls += 1
        return json.loads(data)


def compact_chunk(delta: dict[str, Any] | None, finish: str | None = None,
                  **extra: Any) -> bytes:
    choices = [] if delta is None else [
        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}]
    return sse({"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1,
                "model": "served-model", "choices": choices}, compact=True)


def metered(chunks: Sequence[bytes], monkeypatch: pytest.MonkeyPatch) -> tuple[StreamTimer, int]:
    """The stream through the production Meter; the decodes it took."""
    counting = CountingJson()
    monkeypatch.setattr(dialect_base, "json", counting)
    timer = StreamTimer(CHAT)
    meter = Meter(timer, SSEParser())
    for t, chunk in enumerate(chunks):
        meter.chunk(chunk, float(t))
    return timer, counting.loads_calls


TOKENS = [compact_chunk({"content": f"w{i} "}) for i in range(20)]


def test_openai_stream_says_why_from_its_finish_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    usage = sse(usage_json(5, 20, model="served-model"), compact=True)
    chunks = [compact_chunk({"role": "assistant", "content": ""}), *TOKENS,
              compact_chunk({}, "stop"), usage, b"data: [DONE]\n\n"]
    timer, decodes = metered(chunks, monkeypatch)
    assert decodes == 2  # the finish chunk and the usage chunk; no token event
    assert timer.response() == ResponseInfo("c1", "served-model", ((0, "stop"),))
    assert timer.output_events == 20


def test_vllm_stream_says_why_on_its_last_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason rides on the last token's event: read once, at the end."""
    last = compact_chunk({"content": "end"}, "length", stop_reason=None)
    timer, decodes = metered([*TOKENS, last, b"data: [DONE]\n\n"], monkeypatch)
    assert decodes == 0
    assert timer.response() == ResponseInfo("chatcmpl-7", "served-model", ((0, "length"),))
    assert timer.output_events == 21


def test_stream_cut_short_still_names_its_response(monkeypatch: pytest.MonkeyPatch) -> None:
    timer, _ = metered(TOKENS[:3], monkeypatch)
    assert timer.response() == ResponseInfo("chatcmpl-7", "served-model")
    assert StreamTimer(CHAT).response() == ResponseInfo()


# ---------------------------------------------------------------------------
# TPOT


@pytest.mark.parametrize("tokens", [2, 3, 17, 1000])
def test_tpot_formula(tokens: int) -> None:
    first, last = 0.5, 2.75
    assert tpot(first, last, tokens) == (last - first) / (tokens - 1)


@pytest.mark.parametrize("tokens", [None, 0, 1])
def test_tpot_needs_two_tokens(tokens: int | None) -> None:
    assert tpot(0.5, 2.75, tokens) is None


def test_tpot_needs_output() -> None:
    assert tpot(None, None, 10) is None


def test_tpot_from_a_timed_stream() -> None:
    script = [(0.5, chat({"content": "a"})), (0.625, chat({"content": "bc"})),
              (1.0, chat({"content": "d"})), (1.25, usage_chunk(4, 4))]
    timer = run(script)
    usage = CHAT.usage(timer.usage)
    assert usage.completion_tokens is not None
    assert tpot(timer.first_t, timer.last_t, usage.completion_tokens) == (1.0 - 0.5) / (4 - 1)


# ---------------------------------------------------------------------------
# Usage, estimates and the log record


def test_usage_parsing_rejects_bad_values() -> None:
    assert CHAT.usage(None) == Usage()
    assert CHAT.usage({}) == Usage()
    assert CHAT.usage({"prompt_tokens": "3", "completion_tokens": 2.0,
                               "prompt_tokens_details": {"cached_tokens": False}}) == Usage()
    assert CHAT.usage({"prompt_tokens": 3, "prompt_tokens_details": None}) == Usage(3)


def test_estimate_prompt_tokens() -> None:
    messages = [{"role": "user", "content": "x" * 40},
                {"role": "user", "content": [{"type": "text", "text": "y" * 40}]}]
    assert estimate_prompt_tokens({"messages": messages}) == round(80 / 4)
    assert estimate_prompt_tokens({"prompt": "z" * 12}) == 3
    assert estimate_prompt_tokens({"prompt": ["ab", "cd", 5]}) == 1
    assert estimate_prompt_tokens({"model": "m"}) is None


def test_record_log_has_every_field() -> None:
    record = RequestRecord("rid", "/v1/chat/completions", "m", "up", True, 200,
                           outcome=Outcome.COMPLETED,
                           duration_s=2.0, itl_s=(0.25, 0.75))
    log = record.as_log()
    assert log["itl_count"] == 2
    assert log["itl_mean_s"] == 0.5
    assert log["itl_max_s"] == 0.75
    assert log["outcome"] == "completed"
    fields = set(RequestRecord.__dataclass_fields__) - {"itl_s", "prefix"}
    assert fields <= set(log)
    # The prompt-cache doctor's finding, flattened; null when it did not look.
    prefix_keys = {"prompt_bytes", "repeated_prefix_bytes", "repeated_prefix_tokens",
                   "cache_missed_tokens", "prefix_break", "prefix_break_part",
                   "prefix_break_index", "prefix_break_role", "prefix_break_offset",
                   "prefix_unchecked"}
    assert {log[key] for key in prefix_keys} == {None}
    assert json.loads(json.dumps(log)) == log
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in log.values())


# --- the byte scan must agree with the full decode -----------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_texts = st.one_of(st.just(""), st.text(max_size=8),
                   st.sampled_from(['"', '\\', '"content":"x"', '\\"text\\": \\"y', "é", "\n"]))
_deltas = st.dictionaries(
    st.sampled_from(["content", "reasoning_content", "reasoning", "refusal", "role", "text"]),
    st.one_of(_texts, st.none()), max_size=3)
_tool_calls = st.lists(st.fixed_dictionaries(
    {"index": st.integers(0, 2), "function": st.fixed_dictionaries({"arguments": _texts})}),
    max_size=2)


@st.composite
def _chunks(draw: st.DrawFn) -> tuple[bytes, bool]:
    text_route = draw(st.booleans())
    choices = []
    for i in range(draw(st.integers(0, 3))):
        if text_route:
            choices.append({"index": i, "text": draw(_texts), "finish_reason": None})
        else:
            delta = draw(_deltas)
            calls = draw(_tool_calls)
            if calls:
                delta["tool_calls"] = calls
            if draw(st.integers(0, 5)) == 0:
                delta["function_call"] = draw(st.one_of(
                    st.just({}), st.fixed_dictionaries({"arguments": _texts})))
            finish = draw(st.sampled_from([None, "stop", "tool_calls"]))
            choices.append({"index": i, "delta": delta, "finish_reason": finish})
    payload: dict[str, Any] = {"id": "c", "object": "chunk", "choices": choices}
    usage = draw(st.sampled_from(["absent", "null", "object"]))
    if usage == "null":
        payload["usage"] = None
    elif usage == "object":
        payload["usage"] = {"prompt_tokens": 3, "completion_tokens": 2}
    if draw(st.booleans()) and usage == "object":
        payload["usage"]["metrics"] = {"queue_time_ms": 5}
    if draw(st.integers(0, 7)) == 0:
        payload["metrics"] = {"queue_time_ms": 7}
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (",", " : ")]))
    ascii_only = draw(st.booleans())
    return json.dumps(payload, separators=separators, ensure_ascii=ascii_only).encode(), text_route


@settings(max_examples=600, deadline=None)
@given(_chunks())
def test_byte_scan_agrees_with_full_decode(chunk: tuple[bytes, bool]) -> None:
    data, text_route = chunk
    assert inspect_event(data, text_route=text_route) == inspect_payload(
        json.loads(data), text_route=text_route)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(min_value=0, max_value=20, allow_nan=False),
                          st.sampled_from(ITL_BUCKETS)), max_size=50))
def test_observe_many_equals_observe_each(values: list[float]) -> None:
    """The batched observation (ITL, the doctor's findings) gives exactly the histogram
    per-value observe gives (a value on a bound included)."""
    from prometheus_client import CollectorRegistry, Histogram

    from proxy.buckets import observe_many

    registry = CollectorRegistry()
    batched = Histogram("batched", "h", buckets=ITL_BUCKETS, registry=registry)
    single = Histogram("single", "h", buckets=ITL_BUCKETS, registry=registry)
    observe_many(batched, values)
    for value in values:
        single.observe(value)
    for bound in [*ITL_BUCKETS, float("inf")]:
        le = "+Inf" if bound == float("inf") else str(bound)
        assert registry.get_sample_value("batched_bucket", {"le": le}) == \
            registry.get_sample_value("single_bucket", {"le": le})
    assert registry.get_sample_value("batched_count") == len(values)
    assert math.isclose(registry.get_sample_value("batched_sum") or 0.0,
                        registry.get_sample_value("single_sum") or 0.0, abs_tol=1e-9)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**9), max_size=20))
def test_add_equals_inc(amounts: list[int]) -> None:
    """The doctor's counters, incremented without the checks, equal ``inc``."""
    from prometheus_client import CollectorRegistry, Counter

    from proxy.doctor.metrics import add

    registry = CollectorRegistry()
    added = Counter("added", "c", ["route"], registry=registry)
    inced = Counter("inced", "c", ["route"], registry=registry)
    for amount in [0, *amounts]:
        add(added.labels("r"), amount)
        inced.labels("r").inc(amount)
    assert registry.get_sample_value("added_total", {"route": "r"}) == sum(amounts) == \
        registry.get_sample_value("inced_total", {"route": "r"})


# ---------------------------------------------------------------------------
# The token template (proxy.measure.TokenTemplate) against the full path

from proxy.measure import Meter  # noqa: E402
from proxy.relay import _Forwarder  # noqa: E402
from proxy.sse import SSEParser  # noqa: E402

_token_texts = st.one_of(
    st.text(min_size=0, max_size=6),
    st.sampled_from(['"', "\\", "\\\\", '\\"', "\n", "é", "}", '"},{', "data: x", " "]))


@st.composite
def _token_streams(draw: st.DrawFn) -> tuple[list[bytes], bool, bool]:
    """A stream of compact JSON token events as servers write them (one event per read,
    sometimes two), with the shapes the template must cope with: a role-only first
    chunk, a key change (reasoning then content), a field that varies per event, empty
    texts, escapes, a finish chunk and a usage-only chunk."""
    text_route = draw(st.booleans())
    varying = draw(st.booleans())
    events: list[bytes] = []

    def event(choice: dict[str, Any], n: int) -> bytes:
        payload: dict[str, Any] = {"id": "chatcmpl-1", "object": "chunk", "created": 7,
                                   "model": "m", "choices": [choice]}
        if varying:
            payload["obfuscation"] = "x" * (n % 3)
        return sse(payload, compact=True)

    if not text_route:
        events.append(event({"index": 0, "delta": {"role": "assistant", "content": ""}}, 0))
    keys = ["reasoning_content", "content"] if draw(st.booleans()) else ["content"]
    n = 0
    for key in keys:
        for text in draw(st.lists(_token_texts, max_size=12)):
            n += 1
            choice: dict[str, Any] = ({"index": 0, "text": text} if text_route
                                      else {"index": 0, "delta": {key: text}})
            events.append(event({**choice, "finish_reason": None}, n))
    events.append(event({"index": 0, "delta": {}, "finish_reason": "stop"}, n + 1))
    if draw(st.booleans()):
        events.append(b'data: {"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":3,'
                      b'"completion_tokens":%d}}\n\n' % n)
    events.append(b"data: [DONE]\n\n")
    chunks: list[bytes] = []
    i = 0
    while i < len(events):  # mostly one event per read, sometimes two
        step = 2 if draw(st.integers(0, 4)) == 0 else 1
        chunks.append(b"".join(events[i:i + step]))
        i += step
    return chunks, text_route, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(_token_streams())
def test_token_template_path_measures_exactly_what_the_full_path_does(
        stream: tuple[list[bytes], bool, bool]) -> None:
    chunks, text_route, strip = stream
    fast = StreamTimer(dialect(text_route))
    forwarder = _Forwarder(Meter(fast, SSEParser()), strip, 0)
    sent = bytearray()
    for t, chunk in enumerate(chunks):
        sent += forwarder.take(chunk)
        forwarder.observe(float(t))
    sent += forwarder.tail()

    full = StreamTimer(dialect(text_route))
    parser = SSEParser()
    expected = bytearray()
    for t, chunk in enumerate(chunks):
        for ev in parser.feed(chunk):
            info = inspect_payload(json.loads(ev.data), text_route=text_route) \
                if ev.data.startswith(b"{") else NOT_COUNTED
            if info is not NOT_COUNTED:
                full.observe(info, float(t))
            if not (strip and info.usage_only):
                expected += b"data: " + ev.data + b"\n\n"
    assert (fast.first_t, fast.last_t, fast.output_events, fast.output_choices, fast.gaps,
            fast.usage) == (full.first_t, full.last_t, full.output_events,
                            full.output_choices, full.gaps, full.usage)
    assert bytes(sent) == bytes(expected)


# ---------------------------------------------------------------------------
# Metrics.observe: a request is counted only once all its observations are in

from prometheus_client import CollectorRegistry  # noqa: E402

from proxy.metrics import Metrics  # noqa: E402


def test_requests_total_is_incremented_after_every_other_observation() -> None:
    """Whoever polls ``llm_proxy_requests_total`` (a test thread, a scrape) and sees the
    request must also see its TTFT, ITL and TPOT (an e2e test raced exactly this)."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    route, model = "/v1/chat/completions", "m"
    counted = {"route": route, "model": model, "upstream": "u", "stream": "true", "code": "200"}
    seen: list[float | None] = []
    tpot = metrics.children(route, model, "u").tpot  # the last histogram observe() touches
    original = tpot.observe

    def spy(value: float, *args: Any) -> None:
        seen.append(registry.get_sample_value("llm_proxy_requests_total", counted))
        original(value, *args)

    tpot.observe = spy  # type: ignore[method-assign]
    metrics.observe(RequestRecord(
        "id", route, model, "u", True, 200, Outcome.COMPLETED, 1.0, ttft_s=0.1, tpot_s=0.02,
        itl_s=(0.02, 0.02), output_events=3, completion_tokens=3), measured=True)
    assert seen == [None]  # TPOT observed while the request was not yet counted
    assert registry.get_sample_value("llm_proxy_requests_total", counted) == 1.0
