"""The Mooncake trace format (``proxy/workload_file.py``) and the replay's prompt text
(``proxy/bench/replay.py``), without servers.

* Public traces read as they are: lines from the FAST'25 Mooncake traces
  (``kvcache-ai/Mooncake``, ``FAST25-release/traces``), their block size (512) agreeing
  with their ids; unknown fields kept; bad lines refused with the file and line named.
* The writer: metadata on each file's first line only, whole milliseconds, small ids in
  order of first appearance, ``ceil(input_length / block_size)`` ids, rotation into a
  new file with the same namespace; several files aligned by their start, ids kept
  apart unless they share a ``trace_id``; files joined with ``cat`` still read right.
* Token blocks from a chain of byte-block digests: equal keys exactly when the prefix
  through the token block is equal.
* The prompt text: equal ids byte-identical, a partial block the prefix of its full
  block, exactly four characters a token, namespaces and seeds apart.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proxy.bench.replay import WORDS, BlockText, ReplayOptions, api_of_route, plan
from proxy.workload_file import (
    DEFAULT_BLOCK_SIZE,
    IdMap,
    WorkloadError,
    WorkloadMeta,
    WorkloadRecord,
    WorkloadWriter,
    digest_id,
    format_line,
    load,
    read_segments,
    token_block_keys,
    write_workload,
)

# Verbatim lines of kvcache-ai/Mooncake FAST25-release/traces/synthetic_trace.jsonl
# (ids 1145..1204 and 708..713 come back in later lines: shared prefixes).
FAST25 = """\
{"timestamp": 12709, "input_length": 30575, "output_length": 8, "hash_ids": [IDS_A]}
{"timestamp": 12772, "input_length": 913, "output_length": 3, "hash_ids": [1205, 1206]}
{"timestamp": 14514, "input_length": 30397, "output_length": 2, "hash_ids": [IDS_B]}
{"timestamp": 3437, "input_length": 2752, "output_length": 35, "hash_ids": [708, 709, 710, 711, 712, 713]}
{"timestamp": 16801, "input_length": 2754, "output_length": 50, "hash_ids": [708, 709, 710, 711, 712, 1469]}
{"timestamp": 529, "input_length": 28, "output_length": 445, "hash_ids": [298]}
""".replace("IDS_A", ", ".join(map(str, range(1145, 1205)))).replace(
    "IDS_B", ", ".join(map(str, [*range(1145, 1202), 1339, 1340, 1341]))
)


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_public_mooncake_trace_reads_as_it_is(tmp_path: Path) -> None:
    trace = load([write(tmp_path / "fast25.jsonl", FAST25)])
    assert [r.timestamp for r in trace.records] == [529, 3437, 12709, 12772, 14514, 16801]
    assert trace.start is None and trace.block_size is None
    assert trace.effective_block_size() == DEFAULT_BLOCK_SIZE == 512
    assert trace.notes == ()  # every line has ceil(input_length / 512) ids
    first = trace.records[2]
    assert (first.input_length, first.output_length, len(first.hash_ids)) == (30575, 8, 60)
    assert first.model is None and first.ttft_ms is None and first.other == ()
    assert len(set(trace.namespaces)) == 1


def test_unknown_fields_are_kept_and_written_back(tmp_path: Path) -> None:
    line = {"timestamp": 5.5, "input_length": 10, "output_length": 2, "hash_ids": [3],
            "session_id": "s1", "model": "m", "ttft_ms": "fast", "weird": [1, 2]}  # fmt: skip
    trace = load([write(tmp_path / "t.jsonl", json.dumps(line) + "\n")])
    record = trace.records[0]
    assert record.other == (("session_id", "s1"), ("weird", [1, 2]))
    assert record.model == "m" and record.ttft_ms is None  # a text where a number belongs
    again = json.loads(format_line(record))
    assert again == {"timestamp": 5.5, "input_length": 10, "output_length": 2, "hash_ids": [3],
                     "model": "m", "session_id": "s1", "weird": [1, 2]}  # fmt: skip


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "t.jsonl:2: not JSON"),
        ("[1, 2]", "t.jsonl:2: not a JSON object"),
        ('{"input_length": 3, "delay": 20}', "t.jsonl:2: no timestamp"),
        ('{"timestamp": -1, "input_length": 3}', "timestamp must be a number"),
        ('{"timestamp": 1, "text_input": "hi"}', "no input_length (it carries text_input"),
        ('{"timestamp": 1, "input_length": 2.5}', "input_length must be an integer"),
        ('{"timestamp": 1, "input_length": 3, "hash_ids": [1, -2]}', "hash_ids must be a list"),
        ('{"timestamp": 1, "input_length": 3, "output_length": true}', "output_length must be"),
        ('{"timestamp": 1, "input_length": 3, "block_size": 0}', "block_size must be an integer"),
        ('{"timestamp": 1, "input_length": 3, "trace_start": "yesterday"}', "trace_start must be"),
        ('{"timestamp": 1, "input_length": 3, "trace_start": "2026-01-01T10:00"}', "no UTC offset"),
    ],
)
def test_bad_lines_are_refused_naming_the_file_and_line(
    tmp_path: Path, line: str, message: str
) -> None:
    path = write(tmp_path / "t.jsonl", '{"timestamp": 0, "input_length": 1}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=re.escape(message)) as info:
        load([path])
    assert ":2:" in str(info.value)
    with pytest.raises(WorkloadError, match=r"(?i)no such file"):
        load([str(tmp_path / "missing.jsonl")])


def test_the_writer_puts_metadata_on_the_first_line_and_maps_ids_small(tmp_path: Path) -> None:
    now = [100.0]
    path = tmp_path / "cap.jsonl"
    writer = WorkloadWriter(path, block_size=4, clock=lambda: now[0], wall_clock=lambda: 1_800_000_000.0)
    shared = [b"a", b"b"]
    r1 = writer.record(started=100.0004, input_length=10, output_length=3,
                       block_keys=[*shared, b"x"], model="m", route="/v1/chat/completions",
                       ttft_ms=12.34567, cached_tokens=0, outcome="completed")  # fmt: skip
    writer.write(r1)
    # a shorter key list is padded with ids nothing shares; a longer one is cut
    r2 = writer.record(started=101.5, input_length=9, output_length=1, block_keys=[b"a"])
    writer.write(r2)
    r3 = writer.record(started=102.0, input_length=4, output_length=1, block_keys=[*shared, b"z"])
    writer.write(r3)
    writer.close()
    assert r1.hash_ids == (0, 1, 2) and r1.timestamp == 0 and r1.ttft_ms == 12.346
    assert r2.hash_ids == (0, 3, 4) and r2.timestamp == 1500
    assert r3.hash_ids == (0,)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["trace_start"] == "2027-01-15T08:00:00.000Z"
    assert lines[0]["block_size"] == 4 and lines[0]["trace_id"] == writer.workload_id
    assert all("trace_start" not in x and "block_size" not in x for x in lines[1:])
    assert list(lines[0])[:4] == ["timestamp", "input_length", "output_length", "hash_ids"]
    assert "client" not in lines[0] and "upstream" not in lines[0]
    with pytest.raises(TypeError, match="unknown workload fields: prompt"):
        writer.record(started=0, input_length=1, output_length=1, prompt="secret")


def test_rotated_files_share_one_namespace_and_worker_files_do_not(tmp_path: Path) -> None:
    clock = [0.0]
    start = (0.0, 1_800_000_000.0)
    one = WorkloadWriter(tmp_path / "a.1", block_size=2, start=start, clock=lambda: clock[0])
    one.write(one.record(started=1.0, input_length=4, output_length=1, block_keys=[b"s", b"t"]))
    one.rotate(tmp_path / "a.2")
    one.write(one.record(started=2.0, input_length=4, output_length=1, block_keys=[b"s", b"u"]))
    one.close()
    assert json.loads((tmp_path / "a.2").read_text())["trace_id"] == one.workload_id
    rotated = load([str(tmp_path / "a.*")])
    assert [r.hash_ids for r in rotated.records] == [(0, 1), (0, 2)]
    assert len(set(rotated.namespaces)) == 1
    # Two workers, each its own trace_id (ids per file): the same id 0 is two blocks.
    other = WorkloadWriter(tmp_path / "b", block_size=2, start=(0.0, 1_800_000_000.5))
    other.write(other.record(started=0.25, input_length=4, output_length=1, block_keys=[b"s"]))
    other.close()
    both = load([str(tmp_path / "a.1"), str(tmp_path / "b")])
    assert [r.timestamp for r in both.records] == [750, 1000]  # aligned by trace_start
    assert both.namespaces[0] != both.namespaces[1]
    # Workers sharing the doctor's secret: one trace_id and digest ids, one namespace.
    w1 = WorkloadWriter(tmp_path / "c.0", workload_id="t", ids=digest_id, start=start, block_size=2)
    w2 = WorkloadWriter(tmp_path / "c.1", workload_id="t", ids=digest_id, start=start, block_size=2)
    for w in (w1, w2):
        w.write(w.record(started=1.0, input_length=3, output_length=1, block_keys=[b"k1"]))
        w.close()
    shared = load([str(tmp_path / "c.*")])
    assert shared.records[0].hash_ids[0] == shared.records[1].hash_ids[0] == digest_id(b"k1")
    assert shared.records[0].hash_ids[1] != shared.records[1].hash_ids[1]  # padding: own
    assert len(set(shared.namespaces)) == 1 and digest_id(b"k1") < 2**63
    assert digest_id((b"k1", 0)) != digest_id((b"k1", 1))
    with pytest.raises(TypeError):
        digest_id("text")


def test_files_without_a_start_cannot_join_files_with_one(tmp_path: Path) -> None:
    public = write(tmp_path / "p.jsonl", FAST25)
    w = WorkloadWriter(tmp_path / "c.jsonl")
    w.write(w.record(started=w.start_monotonic, input_length=3, output_length=1))
    w.close()
    with pytest.raises(WorkloadError, match="no trace_start, while other files"):
        load([public, str(tmp_path / "c.jsonl")])
    w2 = WorkloadWriter(tmp_path / "d.jsonl", block_size=16)
    w2.write(w2.record(started=w2.start_monotonic, input_length=3, output_length=1))
    w2.close()
    with pytest.raises(WorkloadError, match="disagree on block_size"):
        load([str(tmp_path / "c.jsonl"), str(tmp_path / "d.jsonl")])
    with pytest.raises(WorkloadError, match="given, but the file says"):
        load([str(tmp_path / "d.jsonl")]).effective_block_size(512)


def test_files_joined_with_cat_are_segments(tmp_path: Path) -> None:
    parts = []
    for name, wall in (("x", 1_800_000_000.0), ("y", 1_800_000_010.0)):
        w = WorkloadWriter(tmp_path / name, start=(0.0, wall), block_size=2)
        for t in (0.0, 1.0):
            w.write(w.record(started=t, input_length=2, output_length=1, block_keys=[b"same"]))
        w.close()
        parts.append((tmp_path / name).read_text())
    joined = write(tmp_path / "joined", "".join(parts))
    assert len(read_segments(joined)) == 2
    trace = load([joined])
    assert [r.timestamp for r in trace.records] == [0, 1000, 10000, 11000]
    assert trace.namespaces == (0, 0, 1, 1)  # two writers: two namespaces


def test_id_map_is_bounded_and_never_reuses_a_number() -> None:
    ids = IdMap(capacity=2)
    assert [ids(k) for k in "aba"] == [0, 1, 0]
    assert ids("c") == 2  # "b" (least recently used) is forgotten: see the next line
    assert ids("b") == 3 and ids("a") == 4  # a forgotten key comes back as a new block
    assert ids.fresh() == 5


def chain(text: bytes, size: int = 8) -> tuple[list[bytes], list[int]]:
    keys, ends, parent = [], [], b""
    for start in range(0, len(text), size):
        parent = hashlib.blake2b(parent + text[start : start + size], digest_size=8).digest()
        keys.append(parent)
        ends.append(min(start + size, len(text)))
    return keys, ends


def test_token_blocks_from_byte_blocks_share_exactly_the_shared_prefix() -> None:
    rng = random.Random(5)
    base = bytes(rng.randrange(97, 123) for _ in range(400))
    for cut in (0, 7, 64, 100, 250, 399):
        other = base[:cut] + b"#" + base[cut + 1 :]
        a_keys, a_ends = chain(base)
        b_keys, b_ends = chain(other)
        # 4 bytes a token, token blocks of 5 tokens (20 bytes) over 8-byte digests
        ka = token_block_keys(a_keys, a_ends, 400, 100, 5)
        kb = token_block_keys(b_keys, b_ends, 400, 100, 5)
        assert len(ka) == len(kb) == 20
        shared = sum(1 for x, y in zip(ka, kb, strict=True) if x == y)
        # token block i (bytes up to 20 (i + 1)) takes the first digest block ending at or
        # after its end: equal when that digest block ends before the changed byte
        expected = sum(1 for i in range(19) if 8 * -(-20 * (i + 1) // 8) <= cut)
        assert shared == expected
        assert ka[:shared] == kb[:shared]
        assert all(x != y for x, y in zip(ka[shared:], kb[shared:], strict=True))
    assert token_block_keys([], [], 10, 3) == []
    keys, ends = chain(base[:30])
    last = token_block_keys(keys, ends, 30, 13, 4)  # 4 blocks, the last partial
    assert len(last) == 4 and last[-1] == (keys[-1], 3)
    with pytest.raises(ValueError):
        token_block_keys(keys, ends[:-1], 30, 13, 4)


def test_write_trace_renumbers_ids_per_namespace() -> None:
    import io

    out = io.StringIO()
    records = [WorkloadRecord(0, 4, 1, (7, 8)), WorkloadRecord(1, 4, 1, (7, 9)), WorkloadRecord(2, 4, 1, (7,))]
    meta = WorkloadMeta(datetime(2026, 1, 1, tzinfo=UTC), 2, "n")
    assert write_workload(out, records, [0, 0, 1], meta) == 3
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["hash_ids"] for x in lines] == [[0, 1], [0, 2], [3]]
    assert lines[0]["trace_start"] == "2026-01-01T00:00:00.000Z" and "trace_id" not in lines[1]


# ---------------------------------------------------------------------------
# The replay's prompts


def test_block_text_equal_ids_are_byte_identical_and_a_partial_block_is_a_prefix() -> None:
    text = BlockText(16, seed=3)
    a = text.block(0, 7)
    assert len(a) == 16 * 4 and a.startswith(" ")
    assert a.split() and all(w in WORDS for w in a.split()) and len(a.split()) == 16
    assert text.block(0, 8) != a and text.block(1, 7) != a  # namespaces apart
    assert text.block(0, 7) == a == BlockText(16, seed=3).block(0, 7)
    assert text.block(0, 7, 5) == a[:20]
    assert BlockText(16, seed=4).block(0, 7) != a
    assert BlockText(32, seed=3).block(0, 7)[:64] != a  # the block size is in the key
    blocks = {text.block(0, i) for i in range(5000)}
    assert len(blocks) == 5000
    odd = BlockText(3)  # fewer words than slices
    assert len(odd.block(0, 1)) == 12 and len(odd.unique(0, 7)) == 28


def test_prompts_have_the_recorded_length_and_share_what_the_ids_share() -> None:
    text = BlockText(8, seed=0)
    one = WorkloadRecord(0, 21, 1, (1, 2, 3))
    two = WorkloadRecord(1, 30, 1, (1, 2, 4, 5))
    p1, p2 = text.prompt(one, 0, 0), text.prompt(two, 0, 1)
    assert len(p1) == 21 * 4 and len(p2) == 30 * 4
    assert p1[:64] == p2[:64] and p1[64:68] != p2[64:68]
    assert text.prompt(two, 0, 1) == p2  # same request, same text
    # tokens beyond the ids, and no ids at all: own text, shared with nothing
    long = text.prompt(WorkloadRecord(0, 20, 1, (1,)), 0, 2)
    assert long[:32] == p1[:32] and len(long) == 80
    bare1, bare2 = text.prompt(WorkloadRecord(0, 8, 1), 0, 3), text.prompt(WorkloadRecord(0, 8, 1), 0, 4)
    assert bare1 != bare2 and len(bare1) == 32
    assert len(text.prompt(WorkloadRecord(0, 0, 1), 0, 5)) == 4  # at least one word


def test_the_replay_plan_follows_the_trace(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 1000, "input_length": 3, "output_length": 4, "route": "/v1/messages", "model": "a"},
        {"timestamp": 1500, "input_length": 3, "output_length": 0, "route": "/v1/{other}"},
        {"timestamp": 3000, "input_length": 3, "route": "/v1/responses", "model": "b"},
    ]  # fmt: skip
    trace = load([write(tmp_path / "t", "".join(json.dumps(x) + "\n" for x in lines))])
    replay = plan(trace, ReplayOptions(speedup=2, default_api="completions", ignore_eos=True))
    assert replay.offsets == (0.0, 0.25, 1.0)
    assert replay.apis == ("messages", "completions", "responses")
    bodies = [p.body for p in replay.requests()]
    assert bodies[0]["model"] == "a" and bodies[0]["max_tokens"] == 4 and "ignore_eos" not in bodies[0]
    assert bodies[1]["model"] == "sim-llm" and bodies[1]["max_tokens"] == 1 and bodies[1]["ignore_eos"]
    assert bodies[2]["max_output_tokens"] == 128 and bodies[2]["model"] == "b"
    only = plan(trace, ReplayOptions(model="x", duration=0.5, requests=2))
    assert len(only.records) == 1 and next(only.requests()).body["model"] == "x"
    assert api_of_route("/v1/chat/completions") == "chat" and api_of_route(None) is None
    with pytest.raises(ValueError):
        plan(trace, ReplayOptions(speedup=0))


def test_every_word_is_one_token_and_four_characters() -> None:
    assert len(WORDS) == len(set(WORDS)) >= 100
    assert all(len(w) == 3 and w.isascii() and w.isalpha() and w.islower() for w in WORDS)


def test_trace_start_round_trips_in_utc(tmp_path: Path) -> None:
    start = datetime(2026, 12, 1, 9, 30, tzinfo=UTC) + timedelta(milliseconds=5)
    meta = WorkloadMeta(start, 512, "id")
    line = format_line(WorkloadRecord(0, 1, 1), meta)
    assert json.loads(line)["trace_start"] == "2026-12-01T09:30:00.005Z"
    assert load([write(tmp_path / "t", line + "\n")]).start == start


def test_the_comparison_by_hand(tmp_path: Path) -> None:
    from proxy.bench.client import COMPLETED, HTTP_ERROR, RequestResult
    from proxy.bench.replay import compare, comparison_rows, format_comparison

    lines = [
        {"timestamp": 0, "input_length": 100, "output_length": 4, "route": "/v1/chat/completions",
         "model": "a", "ttft_ms": 100.0, "itl_ms_mean": 20.0, "cached_tokens": 0, "outcome": "completed"},
        {"timestamp": 1000, "input_length": 100, "output_length": 4, "route": "/v1/chat/completions",
         "model": "a", "ttft_ms": 300.0, "itl_ms_mean": 40.0, "cached_tokens": 50, "outcome": "completed"},
        {"timestamp": 2000, "input_length": 200, "output_length": 9, "route": "/v1/messages",
         "model": "b", "ttft_ms": 900.0, "outcome": "upstream_error"},
    ]  # fmt: skip
    trace = load([write(tmp_path / "t", "".join(json.dumps(x) + "\n" for x in lines))])
    replay = plan(trace, ReplayOptions(speedup=2, block_size=64))
    assert replay.offsets == (0.0, 0.5, 1.0)

    def result(i: int, start: float, ttft: float, gaps: tuple[float, ...], **kw: object) -> RequestResult:
        return RequestResult(i, "trace", start, COMPLETED, 200, 1.0, ttft_s=ttft, itl_s=gaps, **kw)  # type: ignore[arg-type]

    results = [
        result(0, 0.001, 0.05, (0.01, 0.01, 0.01), prompt_tokens=106, cached_prompt_tokens=0,
               completion_tokens=4),
        result(1, 0.503, 0.07, (0.03, 0.03), prompt_tokens=106, cached_prompt_tokens=96,
               completion_tokens=3),
        RequestResult(2, "trace", 1.010, HTTP_ERROR, 529, 0.1, api="messages"),
    ]  # fmt: skip
    cmp = compare(replay, results, "http://b/v1")
    rec, rep = cmp["all"]["recorded"], cmp["all"]["replayed"]
    assert rec["ttft"]["count"] == 2 and rec["ttft"]["p50"] == pytest.approx(0.2)  # not the failed one
    assert rec["itl_mean"]["p50"] == pytest.approx(0.03)
    assert rec["cache_share"] == pytest.approx(50 / 200)
    assert (rep["requests"], rep["completed"]) == (3, 2)
    assert rep["ttft"]["p50"] == pytest.approx(0.06) and rep["itl_mean"]["p90"] == pytest.approx(0.028)
    assert rep["cache_share"] == pytest.approx(96 / 212)
    assert [(g["model"], g["route"]) for g in cmp["groups"]] == [
        ("a", "/v1/chat/completions"),
        ("b", "/v1/messages"),
    ]
    sched = cmp["schedule"]
    assert sched["lag_max_s"] == pytest.approx(0.01) and sched["lag_p50_s"] == pytest.approx(0.003)
    assert cmp["lengths"]["prompt_blocks_off_max"] == pytest.approx(6 / 64)
    assert (cmp["lengths"]["outputs_exact"], cmp["lengths"]["outputs_short"]) == (1, 1)
    assert cmp["headline"] == (
        "your traffic on http://b/v1: TTFT p95 69 ms instead of 290 ms, ITL p50 20 ms "
        "instead of 30 ms, prefix cache 45% instead of 25%"
    )
    text = format_comparison(cmp)
    assert "1 answers ended before the recorded output length" in text and "--ignore-eos" in text
    rows = comparison_rows(cmp)
    assert rows[0] == ("", "recorded", "replayed") and ("a /v1/chat/completions", "", "") in rows
    assert ("  requests", "3", "2 of 3") in rows
