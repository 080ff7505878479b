"""The prompt-cache doctor (``proxy.diagnosis``): block keys, the index, every break
reason from a request pair built for it, tokens and missed tokens, and the repeated
prefix against a brute-force longest common block prefix over the window.

Requests are real bodies read by the dialects' ``prompt_parts``, as the proxy will read
them; time is an injected integer clock in milliseconds.
"""

from __future__ import annotations

import gc
import os
import random
import re
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.dialects import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Dialect, PromptPart, cache_scope
from proxy.doctor.chunks import DEFAULT_CHUNK_BYTES, chunk_ends
from proxy.doctor.examine import REASONS, PrefixDoctor, PrefixPolicy, PrefixReport, examine
from proxy.doctor.index import (
    BYTES_PER_ENTRY,
    CONTINUED,
    DEFAULT_HORIZON_MS,
    DEFAULT_WINDOW_MS,
    ENDED,
    NEVER,
    SEEN,
    LruPrefixIndex,
    Probe,
    SightingLists,
    Sightings,
)
from proxy.doctor.job import BATCH_JOBS
from proxy.doctor.keys import DEFAULT_BLOCK_BYTES, HashedPrompt, PromptHasher
from proxy.doctor.report import CacheTokens, cache_tokens, minimum_cacheable_tokens

ROOT = Path(__file__).resolve().parent.parent
WINDOW = DEFAULT_WINDOW_MS
BLOCK = DEFAULT_BLOCK_BYTES

STABLE = " ".join(f"Rule {i}: answer as a patient teacher would, in plain words." for i in range(60))
TOOLS = [
    {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool number {i} does one careful thing. " * 6,
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
    for i in range(3)
]


def words(n: int, seed: str) -> str:
    """``n`` bytes of text unique to ``seed``."""
    out = " ".join(f"{seed}-{i}" for i in range(n))
    return out[:n]


def prose(n_words: int, seed: str) -> str:
    """A document of ``n_words`` words in sentences of 4 to 24 words, paragraphs of a
    few sentences: the marks content-defined chunking cuts at."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choice("abcdefghijklmnoprstuvwy") for _ in range(rng.randint(2, 10)))
                  for _ in range(400)]
    out: list[str] = []
    left = n_words
    while left > 0:
        sentence = [rng.choice(vocabulary) for _ in range(min(left, rng.randint(4, 24)))]
        left -= len(sentence)
        out.append(" ".join(sentence).capitalize() + ".")
        out.append("\n\n" if rng.random() < 0.2 else " ")
    return "".join(out).rstrip()


class Doctor:
    """A doctor with a fresh index, fed whole request bodies."""

    def __init__(self, **policy: Any) -> None:
        self.index = LruPrefixIndex()
        self.doctor = PrefixDoctor(self.index, PromptHasher(), PrefixPolicy(**policy))

    def send(self, dialect: Dialect, body: dict[str, Any], now_ms: int,
             upstream: str = "up") -> PrefixReport:
        model, key = cache_scope(body)
        looked = self.doctor.look(dialect.prompt_parts(body), upstream=upstream, model=model,
                                  cache_key=key, now_ms=now_ms)
        assert looked is not None
        report = looked[1]
        assert report.reason is None or report.reason in REASONS
        return report


def sizes(dialect: Dialect, body: dict[str, Any]) -> list[int]:
    return [len(part.data) for part in dialect.prompt_parts(body)]


def chat(*messages: tuple[str, Any], model: str = "gpt-4o", tools: Any = None,
         **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [
        {"role": role, "content": content} for role, content in messages], **extra}
    if tools is not None:
        body["tools"] = tools
    return body


# ---------------------------------------------------------------------------
# Blocks and keys


def test_blocks_are_cut_per_part_from_its_start_and_chunks_by_content() -> None:
    hasher = PromptHasher(block_bytes=256, chunk_bytes=256)
    prose = b"".join(b"Sentence %02d of the prose: forty bytes. " % i for i in range(15))
    parts = [PromptPart("system", 0, "system", prose), PromptPart("message", 1, "user", b""),
             PromptPart("message", 2, "assistant", b"a" * 1100)]
    hashed = hasher.hash(parts, upstream="u", model="m")
    assert hashed is not None
    assert len(hashed.chain) == 3 + 1 + 5  # 256 + 256 + 73; an empty part is one block
    assert hashed.first_block == (0, 3, 4)
    # Chunks: a part's first at its first sentence end past 16 bytes, the others at the
    # first past 256 bytes, the last what remains; an empty part is one empty chunk;
    # text without marks is cut at four times 256.
    assert hashed.chunk_ends == (39, 312, 585, 0, 1024, 1100)
    assert hashed.first_chunk == (0, 3, 4)
    assert len(hashed.chunks) == 6 and hashed.chunk_bytes == 256
    assert [p.size for p in hashed.parts] == [585, 0, 1100]
    assert hashed.prompt_bytes == 1685
    keys = (hashed.root, *hashed.chain, *hashed.anchors, *hashed.chunks)
    assert all(len(k) == 8 for k in keys) and len(set(keys)) == len(keys)
    probe = hashed.probe()
    # chunks, the chain from its last block (ended) to its first, root, anchors
    assert probe.keys == (*hashed.chunks, *reversed(hashed.chain), hashed.root, *hashed.anchors)
    assert probe.marks == bytes([SEEN] * 6 + [ENDED] + [CONTINUED] * 8 + [CONTINUED, SEEN, SEEN])
    assert hasher.hash([], upstream="u", model="m") is None


def test_a_chunk_key_names_its_bytes_its_part_kind_and_role_and_the_scope() -> None:
    """Offset-independent: the same sentence opens a chunk of the same key wherever it
    sits in a part of the same kind and role, under the same scope."""
    hasher = PromptHasher(chunk_bytes=16)
    sentence = b"The same sentence, twice over. "

    def chunks(data: bytes, kind: str = "message", role: str = "user",
               model: str = "m") -> set[bytes]:
        hashed = hasher.hash([PromptPart(kind, 0, role, data)], upstream="u", model=model)
        assert hashed is not None
        return set(hashed.chunks)

    here = chunks(sentence + b"tail")
    assert here & chunks(b"Another head. " + sentence + b"tail")
    assert not here & chunks(sentence + b"tail", role="assistant")
    assert not here & chunks(sentence + b"tail", kind="system", role="system")
    assert not here & chunks(sentence + b"tail", model="other")


def test_keys_depend_on_the_secret_and_the_scope() -> None:
    parts = [PromptPart("system", 0, "system", STABLE.encode())]
    secret = os.urandom(32)
    one = PromptHasher(secret).hash(parts, upstream="u", model="m")
    same = PromptHasher(secret).hash(parts, upstream="u", model="m")
    other = PromptHasher().hash(parts, upstream="u", model="m")
    assert one is not None and same is not None and other is not None
    assert one == same  # a shared secret: replicas agree on every key
    assert not set(one.chain) & set(other.chain)  # a process's own secret: nothing in common
    hasher = PromptHasher(secret)
    model_b = hasher.hash(parts, upstream="u", model="b")
    keyed = hasher.hash(parts, upstream="u", model="m", cache_key="k")
    upstream_b = hasher.hash(parts, upstream="v", model="m")
    assert model_b is not None and keyed is not None and upstream_b is not None
    assert not set(one.chain) & (set(model_b.chain) | set(keyed.chain) | set(upstream_b.chain))
    assert keyed.anchors == one.anchors  # the key is not in the anchors
    assert model_b.anchors[0] != one.anchors[0] and model_b.anchors[1] == one.anchors[1]
    assert upstream_b.anchors[1] != one.anchors[1]
    # The part's kind and role are in its first block's key.
    user = hasher.hash([PromptPart("message", 0, "user", STABLE.encode())], upstream="u", model="m")
    assert user is not None and user.chain[0] != one.chain[0]


def test_a_hasher_that_keeps_state_between_prompts_gives_what_a_fresh_one_gives() -> None:
    """The last scope's digests, the part heads and the anchors of recent first blocks
    are kept between requests: every prompt's keys are still those of a new hasher."""
    secret = os.urandom(32)
    kept = PromptHasher(secret)
    prompts = [
        ([PromptPart("system", 0, "system", STABLE.encode()),
          PromptPart("message", 1, "user", f"question {i}".encode())], scope)
        for i in range(3)
        for scope in ({"upstream": "u", "model": "m"}, {"upstream": "u", "model": "b"},
                      {"upstream": "v", "model": "m", "cache_key": "k"})
    ]
    prompts.append(([PromptPart("message", 0, "user", STABLE.encode())],
                    {"upstream": "u", "model": "m"}))  # the same bytes, another role
    for parts, scope in prompts * 2:
        assert kept.hash(parts, **scope) == PromptHasher(secret).hash(parts, **scope)


@pytest.mark.parametrize("cache_keys", [8, 64, 1 << 16])
def test_parts_hashed_before_give_the_keys_hashing_them_again_gives(cache_keys: int) -> None:
    """The hasher keeps recent parts' keys by the prefix before them: a conversation that
    grows, a part that comes after another prefix, a part sent again in another scope or
    with another role, through a cache large enough for all and one that evicts, give
    the keys of a hasher that keeps no part (``part_cache_keys=0``)."""
    secret = os.urandom(32)
    kept = PromptHasher(secret, part_cache_keys=cache_keys)
    bare = PromptHasher(secret, part_cache_keys=0)
    doc = (STABLE * 6).encode()  # several blocks and chunks
    history = [PromptPart("system", 0, "system", STABLE.encode()),
               PromptPart("message", 1, "user", doc)]
    prompts: list[tuple[list[PromptPart], dict[str, str]]] = []
    for turn in range(4):
        history.append(PromptPart("message", len(history), "user", f"turn {turn}".encode()))
        prompts.append((list(history), {"upstream": "u", "model": "m"}))
    prompts += [
        (history[1:], {"upstream": "u", "model": "m"}),  # the same parts after another prefix
        (history, {"upstream": "u", "model": "other"}),  # another scope
        ([PromptPart("message", 0, "assistant", doc)], {"upstream": "u", "model": "m"}),
        ([PromptPart("message", 0, "user", b"")], {"upstream": "u", "model": "m"}),
    ]
    prompts += [  # the parts of the first prompt at other indices: their own shapes
        ([part._replace(index=part.index + 1) for part in prompts[0][0]], prompts[0][1]),
        ([*prompts[0][0], PromptPart("message", 3, "user", b"")], prompts[0][1]),
    ]
    for parts, scope in prompts * 2:
        assert kept.hash(parts, **scope) == bare.hash(parts, **scope)
    assert kept._parts_keys <= cache_keys and kept._recall_keys <= cache_keys // 8  # bounded
    assert kept._parts_keys + kept._recall_keys + kept._lead_keys <= cache_keys
    if cache_keys == 1 << 16:  # a prompt hashed a moment ago: recalled whole, no key copied
        assert kept.hash(prompts[0][0], **prompts[0][1]) is kept.hash(prompts[0][0], **prompts[0][1])


def test_a_last_part_is_kept_the_second_time_it_is_hashed() -> None:
    """Questions no other request asks cost the hasher's caches nothing: a prompt's last
    part, and the prompt for recall, are kept the second time they are hashed."""
    hasher = PromptHasher()
    system = PromptPart("system", 0, "system", STABLE.encode())

    def ask(question: bytes) -> HashedPrompt | None:
        return hasher.hash([system, PromptPart("message", 1, "user", question)],
                           upstream="u", model="m")

    for n in range(100):
        ask(f"question {n}".encode())
    assert len(hasher._parts) == 1 and not hasher._prompts  # the system part alone
    first, second, third = (ask(b"question 7") for _ in range(3))
    assert first == second and len(hasher._parts) == 2 and len(hasher._prompts) == 1
    assert third is second  # recalled whole


@pytest.mark.parametrize("kwargs", [{"secret": b"short"}, {"secret": b"x" * 65},
                                    {"block_bytes": 0}])
def test_hasher_rejects_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PromptHasher(**kwargs)


# ---------------------------------------------------------------------------
# The index


def test_index_answers_reads_before_writes_with_both_times() -> None:
    index = LruPrefixIndex()
    probe = Probe((b"a" * 8, b"b" * 8, b"a" * 8), bytes([CONTINUED, ENDED, CONTINUED]))
    first = index.exchange(probe, 1000)
    assert list(first.continued) == [NEVER] * 3 and list(first.ended) == [NEVER] * 3
    second = index.exchange(Probe((b"a" * 8, b"b" * 8), bytes([ENDED, SEEN])), 2500)
    assert (second.continued[0], second.ended[0]) == (1000, NEVER)
    assert (second.continued[1], second.ended[1]) == (NEVER, 1000)
    third = index.exchange(Probe((b"a" * 8,), bytes([SEEN])), 4000)
    assert (third.continued[0], third.ended[0], third.last(0)) == (1000, 2500, 2500)
    assert len(index) == 2
    with pytest.raises(ValueError):
        Probe((b"a" * 8,), b"")


Exchange = Callable[[Probe, int, int], Sightings]


def run_scenario(exchange: Exchange, slack: int = 0) -> None:
    """Sightings count from when their request's prefill was done (``held``), read at
    the reader's arrival, with a window of 1,000 ms, whatever the order of the exchanges.
    ``slack``: how far an index's times may be off (a store's clock moves between
    exchanges)."""
    key = (b"k" * 8,)
    went_on, ended = Probe(key, bytes([CONTINUED])), Probe(key, bytes([ENDED]))

    def near(got: int, want: int) -> bool:
        return got == want if want == NEVER else want - slack <= got <= want + slack

    # A arrives at 0, done at 100. B arrives at 50, before: A's sighting is after it.
    first = exchange(went_on, 0, 100)
    assert (list(first.continued), list(first.ended), dict(first.after)) == ([NEVER], [NEVER], {})
    assert first.times(0) == (NEVER, NEVER) and first.last(0) == NEVER and not first.late(0)
    b = exchange(went_on, 50, 150)
    assert (b.continued[0], b.ended[0]) == (NEVER, NEVER) and near(b.after[0], 100)
    # C arrives at 200, after both: the last sighting at or before it is B's, at 150.
    c = exchange(went_on, 200, 250)
    assert near(c.continued[0], 150) and not c.after
    # D arrives at 600; E, which arrived at 500, is done at 700 and examined first. Its
    # later stamp must not hide C's (250): the run [100, 700] still holds a sighting at
    # or before 600 within the window (a bound of it is answered: the run's first, or
    # the arrival less the window).
    exchange(went_on, 500, 700)
    d = exchange(went_on, 600, 800)
    assert near(d.continued[0], 100) and d.continued[0] >= 600 - 1000 - slack
    assert not d.after
    # A stamp more than a window after the run's last restarts it: the old run counts no
    # more, and one who arrived before the new stamp sees only that it came after.
    exchange(went_on, 2500, 3000)
    e = exchange(went_on, 2000, 3100)
    assert e.continued[0] == NEVER and near(e.after[0], 3000)
    # A stamp more than a window before the run's first came too late to count: dropped.
    exchange(went_on, 1000, 1500)
    f = exchange(went_on, 2900, 3200)
    assert f.continued[0] == NEVER and near(f.after[0], 3000)
    # The two kinds keep their own runs: an ended sighting, then both read.
    exchange(ended, 3300, 3400)
    g = exchange(ended, 3500, 3600)
    assert near(g.continued[0], 3200) and near(g.ended[0], 3400) and not g.after
    # Expired: the last sighting at or before the arrival, longer ago than the window.
    h = exchange(ended, 5000, 5100)
    assert near(h.continued[0], 3200) and near(h.ended[0], 3600)
    # Concurrent only while this request's own prefill ran: a sighting after it is not.
    other = Probe((b"o" * 8,), bytes([CONTINUED]))
    exchange(other, 9000, 9100)
    i = exchange(other, 8900, 9050)
    assert (i.continued[0], i.ended[0]) == (NEVER, NEVER) and not i.after
    assert near(exchange(other, 8950, 9200).after[0], 9050)


def test_index_counts_a_sighting_from_its_prefill_in_runs_of_sightings() -> None:
    index = LruPrefixIndex(window_ms=1000)
    run_scenario(index.exchange)


def test_index_forgets_entries_older_than_its_horizon_before_answering() -> None:
    index = LruPrefixIndex(horizon_ms=10_000)
    old, recent = Probe((b"o" * 8,), bytes([SEEN])), Probe((b"r" * 8,), bytes([SEEN]))
    index.exchange(old, 0)
    index.exchange(recent, 5_000)
    assert index.exchange(old, 10_000).ended[0] == 0  # exactly the horizon: kept
    index.exchange(recent, 15_000)
    assert index.exchange(Probe((b"x" * 8,), bytes([SEEN])), 20_001).ended[0] == NEVER
    assert index.exchange(old, 20_001).ended[0] == NEVER  # 10,001 ms untouched: forgotten
    assert index.exchange(recent, 20_001).ended[0] == 15_000


def test_index_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        LruPrefixIndex(BYTES_PER_ENTRY - 1)
    with pytest.raises(ValueError):
        LruPrefixIndex(horizon_ms=-1)


@pytest.mark.slow  # 100,000 requests through the doctor: seconds
def test_lru_bound_holds_under_100000_distinct_prompts_and_memory_is_measured() -> None:
    max_bytes = 4 * 1024 * 1024
    index = LruPrefixIndex(max_bytes)
    doctor = PrefixDoctor(index, PromptHasher())
    system = PromptPart("system", 0, "system", b"Be brief.")
    largest = 0
    for now in range(1, 100_001):
        question = PromptPart("message", 1, "user", b"question %d " % now + b"x" * (now % 300))
        doctor.look((system, question), upstream="u", model="m", now_ms=now)
        largest = max(largest, len(index))
    assert largest == index.capacity == max_bytes // BYTES_PER_ENTRY  # full, never over
    # The most recent prompts are the ones kept; the first one's tail is gone.
    looked = doctor.look((system, question), upstream="u", model="m", now_ms=100_001)
    assert looked is not None and looked[1].repeated_bytes == looked[1].prompt_bytes
    looked = doctor.look((system, PromptPart("message", 1, "user", b"question 1 x")),
                         upstream="u", model="m", now_ms=100_002)
    assert looked is not None and looked[1].repeated_bytes == len(system.data)
    # Memory: the same entries, taken by a fresh index through exchange (fresh keys, the
    # values the exchange computes), all allocations traced.
    entries = list(index._entries)
    gc.collect()
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    copy = LruPrefixIndex(max_bytes)
    for at in range(0, len(entries), 1000):
        batch = tuple(bytes(bytearray(key)) for key in entries[at : at + 1000])
        copy.exchange(Probe(batch, bytes([CONTINUED]) * len(batch)), at)
    del batch
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - start
    tracemalloc.stop()
    assert len(copy) == len(index)
    assert used <= max_bytes  # the bound is a memory bound
    assert used / len(copy) <= BYTES_PER_ENTRY


def test_eviction_forgets_a_prompt_from_its_tail() -> None:
    long = chat(("system", STABLE), ("user", words(3000, "doc")))
    hashed = PromptHasher().hash(CHAT.prompt_parts(long), upstream="u", model="m")
    assert hashed is not None
    keys = len(hashed.probe().keys)
    doctor = PrefixDoctor(LruPrefixIndex((keys + 20) * BYTES_PER_ENTRY))
    doctor.look(CHAT.prompt_parts(long), upstream="u", model="m", now_ms=1)
    for i in range(4):  # 4 small prompts of 5 keys each: 20 entries, then 20 more
        doctor.look([PromptPart("prompt", 0, "", b"other %d" % i)], upstream="u", model="m",
                    now_ms=2 + i)
    for i in range(4, 12):
        doctor.look([PromptPart("prompt", 0, "", b"other %d" % i)], upstream="u", model="m",
                    now_ms=2 + i)
    looked = doctor.look(CHAT.prompt_parts(long), upstream="u", model="m", now_ms=100)
    assert looked is not None
    again = looked[1]
    assert 0 < again.repeated_bytes < again.prompt_bytes  # the head survived, the tail did not


# ---------------------------------------------------------------------------
# Break reasons, one request pair each


def test_first_seen_then_a_full_repeat() -> None:
    doctor = Doctor()
    body = chat(("system", STABLE), ("user", "What is a prefix?"), tools=TOOLS)
    first = doctor.send(CHAT, body, 0)
    assert (first.reason, first.repeated_bytes, first.part) == ("first_seen", 0, None)
    assert first.prompt_bytes == sum(sizes(CHAT, body))
    again = doctor.send(CHAT, body, 1_000)
    assert again.reason is None
    assert again.repeated_bytes == again.prompt_bytes
    assert again.repeated_blocks == again.blocks


def test_tools_reordered_is_tools_changed() -> None:
    doctor = Doctor()
    doctor.send(CHAT, chat(("system", STABLE), ("user", "hi"), tools=TOOLS), 0)
    report = doctor.send(CHAT, chat(("system", STABLE), ("user", "hi"),
                                    tools=[TOOLS[1], TOOLS[0], TOOLS[2]]), 1_000)
    assert (report.reason, report.part, report.index, report.offset) == (
        "tools_changed", "tools", 0, 0)
    assert report.repeated_bytes == 0


def test_timestamp_at_the_head_of_the_system_prompt_is_variable_before_stable() -> None:
    doctor = Doctor()
    tools = [{"name": "search", "description": "Search the docs. " * 20,
              "input_schema": {"type": "object"}}]

    def body(now: str, question: str) -> dict[str, Any]:
        return {"model": "claude-sonnet-4-5", "max_tokens": 100, "tools": tools,
                "system": f"Current time is {now}.\n" + STABLE,
                "messages": [{"role": "user", "content": question}]}

    doctor.send(MESSAGES, body("15:09:20", "What changed?"), 0)
    report = doctor.send(MESSAGES, body("15:09:21", "What changed?"), 1_000)
    tool_bytes, system_bytes, question_bytes = sizes(MESSAGES, body("15:09:21", "What changed?"))
    assert (report.reason, report.part, report.index, report.role, report.offset) == (
        "variable_before_stable", "system", 0, "system", 0)
    assert report.repeated_bytes == tool_bytes  # the tools came first and still repeat
    assert report.changed_bytes is not None and 0 < report.changed_bytes <= 2 * BLOCK
    assert report.stable_bytes is not None
    assert report.stable_bytes == system_bytes - report.changed_bytes + question_bytes
    # A new question and a timestamp of another length: the same diagnosis.
    other = doctor.send(MESSAGES, body("9:05", "And now?"), 2_000)
    assert (other.reason, other.part, other.offset) == ("variable_before_stable", "system", 0)
    assert other.stable_bytes is not None and other.stable_bytes >= system_bytes - 2 * BLOCK


def test_a_message_edited_in_the_middle_is_message_changed() -> None:
    doctor = Doctor()
    history = [("system", STABLE), ("user", words(500, "q1")), ("assistant", words(700, "a1")),
               ("user", words(300, "q2")), ("assistant", words(400, "a2")), ("user", "q3?")]
    doctor.send(CHAT, chat(*history), 0)
    edited = list(history)
    edited[2] = ("assistant", words(650, "rewritten"))
    report = doctor.send(CHAT, chat(*edited), 1_000)
    assert (report.reason, report.part, report.index, report.role, report.offset) == (
        "message_changed", "message", 2, "assistant", 0)
    assert report.repeated_bytes == len(STABLE) + 500


def test_a_short_edit_ahead_of_a_long_unchanged_message_is_variable_before_stable() -> None:
    doctor = Doctor()
    document = words(3000, "doc")
    doctor.send(CHAT, chat(("system", STABLE), ("user", "Ticket 4711: " + document),
                           ("assistant", "ok"), ("user", "summarise")), 0)
    report = doctor.send(CHAT, chat(("system", STABLE), ("user", "Ticket 4712: " + document),
                                    ("assistant", "ok"), ("user", "summarise")), 1_000)
    assert (report.reason, report.part, report.index, report.role, report.offset) == (
        "variable_before_stable", "message", 1, "user", 0)
    assert report.stable_bytes is not None and report.stable_bytes >= len(document) - BLOCK


DOCUMENT = prose(500, "document")  # about 3 KB, as a retrieval app's context


def timed_question(clock: str, n: int, document: str = DOCUMENT) -> str:
    return f"Current time is {clock}. {document} Question {n}?"


def test_chunking_resynchronises_after_a_head_whose_length_changed() -> None:
    """Cuts depend on the bytes after the previous cut only: after heads of different
    lengths, the chunks of the same document line up from a cut both make on, the first
    after a head without marks of its own, at the latest the first paragraph break."""

    def cuts(head: str, document: str) -> list[int]:  # in the document's coordinates
        return [end - len(head) for end in chunk_ends((head + document).encode(), 512, 2048)]

    single = DOCUMENT.replace("\n\n", " ")  # one paragraph
    first_paragraph = DOCUMENT.index("\n\n") + 2
    first_sentence = DOCUMENT.index(". ") + 2
    for a, b, document, by in [
            ("Current time is 15:09:21. ", "Current time is 9:05. ", DOCUMENT, first_sentence),
            ("Current time is 15:09:21. ", "Current time is 9:05. ", single, first_sentence),
            ("Ticket 7: ", "Ticket 12345 (escalated twice, see the thread): ", single,
             first_sentence),
            ("", "A whole new opening sentence of some length.\n", DOCUMENT, first_paragraph),
            ("Hi. ", "Dear customer, thank you. We read your note.\n", DOCUMENT,
             first_paragraph)]:
        cut_a, cut_b = cuts(a, document), cuts(b, document)
        shared = set(cut_a) & set(cut_b)
        assert len(cut_a) > 4 and shared
        first = min(shared)
        assert first <= by, (a, b)
        assert [e for e in cut_a if e >= first] == [e for e in cut_b if e >= first]
    # Without the paragraph breaks, a head with a mark of its own may keep the cuts out
    # of step: why the break's stable run is then not found (the index still knows the
    # chunks of every recent head, so one of the same length finds it).
    apart = cuts("", single)[:-1], cuts("A whole new opening sentence, longer.\n", single)[:-1]
    assert not set(apart[0]) & set(apart[1])  # only the text's end in common


def test_a_time_ahead_of_a_document_in_the_last_message_is_variable_before_stable() -> None:
    """One user message, ``Current time is <t>. <document> Question <n>?``, every turn:
    the time changes ahead of a document seen before, in the newest part. The changed
    run is the time's block, the stable run the document up to the question's block."""
    doctor = Doctor()
    doctor.send(CHAT, chat(("system", "Be brief."), ("user", timed_question("15:09:20", 1))), 0)
    for turn, clock in enumerate(["15:09:21", "15:10:02", "9:05:00"], 2):
        body = chat(("system", "Be brief."), ("user", timed_question(clock, turn)))
        report = doctor.send(CHAT, body, turn * 1_000)
        size = sizes(CHAT, body)[1]
        assert (report.reason, report.part, report.index, report.role, report.offset,
                report.part_bytes) == ("variable_before_stable", "message", 1, "user", 0, size)
        assert report.repeated_bytes == len("Be brief.")
        assert report.changed_bytes == BLOCK  # "Current time is ...": one block, rounded
        assert report.stable_bytes is not None
        # the document, from the time's block to the question's, block-rounded
        assert size - 3 * BLOCK <= report.stable_bytes <= size - BLOCK - len(" Question 4?")
        assert report.stable_bytes % BLOCK == 0


@pytest.mark.parametrize("where", ["last", "mid-chat"])
@pytest.mark.parametrize("size", [700, 1000])  # bytes: under a chunk's least length
def test_a_time_ahead_of_a_short_document_is_variable_before_stable(where: str,
                                                                    size: int) -> None:
    """A message under a kilobyte (a chunk's least length) whose head changes ahead of
    text seen before: the head is still a chunk of its own, so the break is named where
    the time is, in the newest message or one before it; not "an earlier turn was
    edited" (message_changed), nor nothing at all."""
    document = prose(300, "short-doc")[:size - len("Current time is 10:00:00. ")]
    doctor = Doctor()

    def body(clock: str) -> dict[str, Any]:
        message = f"Current time is {clock}. {document}"
        assert 2 * BLOCK < len(message) <= DEFAULT_CHUNK_BYTES
        if where == "last":
            return chat(("system", STABLE), ("user", message))
        return chat(("system", STABLE), ("user", message), ("assistant", "ok"),
                    ("user", "Question?"))

    doctor.send(CHAT, body("10:00:00"), 0)
    for turn, clock in enumerate(["10:00:01", "10:00:02"], 1):
        report = doctor.send(CHAT, body(clock), turn * 1_000)
        assert (report.reason, report.part, report.index, report.role, report.offset) == (
            "variable_before_stable", "message", 1, "user", 0)
        assert report.stable_bytes is not None and report.stable_bytes >= BLOCK


def test_a_new_question_after_the_same_document_in_one_message_is_not_a_break() -> None:
    doctor = Doctor()
    doctor.send(CHAT, chat(("system", "Be brief."), ("user", f"{DOCUMENT} Question 1?")), 0)
    for turn in range(2, 5):
        report = doctor.send(CHAT, chat(("system", "Be brief."),
                                        ("user", f"{DOCUMENT} Question {turn}?")), turn * 1_000)
        assert report.reason is None
        assert report.repeated_bytes >= len("Be brief.") + len(DOCUMENT) - BLOCK
    # A longer question that still ends the message: the same.
    long = doctor.send(CHAT, chat(("system", "Be brief."), ("user", f"{DOCUMENT} " + prose(
        60, "a long question"))), 9_000)
    assert long.reason is None


@pytest.mark.parametrize("request_id", [False, True])
def test_a_changed_run_in_the_middle_of_a_part_is_found_where_it_is(request_id: bool) -> None:
    """Anywhere in a part: a date in the middle of a system prompt, the rest unchanged
    (its tail seen before), or the rest unchanged up to a request id at its end."""
    doctor = Doctor()
    head, tail = prose(150, "rules"), prose(400, "more rules")

    def body(day: str, question: str, n: int) -> dict[str, Any]:
        end = f"\nRequest {n}." if request_id else ""
        return chat(("system", f"{head}\nToday is {day}.\n{tail}{end}"), ("user", question))

    doctor.send(CHAT, body("Monday", "What now?", 1), 0)
    report = doctor.send(CHAT, body("Tuesday", "And then?", 2), 1_000)
    at = len(head.encode()) // BLOCK * BLOCK  # the block where the date is
    assert (report.reason, report.part, report.index, report.offset) == (
        "variable_before_stable", "system", 0, at)
    assert report.repeated_bytes == at
    assert report.changed_bytes is not None
    assert 0 < report.changed_bytes <= 2 * BLOCK + DEFAULT_CHUNK_BYTES
    assert report.stable_bytes is not None
    # lost to the resolution: at most a chunk and a block on either side of the run
    assert report.stable_bytes >= len(tail.encode()) - (1 + request_id) * (
        DEFAULT_CHUNK_BYTES + BLOCK)


def test_a_part_moved_whole_is_not_a_variable_run() -> None:
    """The whole of the part where it broke was seen recently (two messages swapped):
    nothing changed in it, so the break is named for its kind."""
    doctor = Doctor()
    one, two = prose(200, "first"), prose(200, "second")
    doctor.send(CHAT, chat(("system", STABLE), ("user", one), ("user", two), ("user", "q?")), 0)
    report = doctor.send(CHAT, chat(("system", STABLE), ("user", two), ("user", one),
                                    ("user", "q?")), 1_000)
    assert (report.reason, report.index) == ("message_changed", 1)


def test_an_image_part_changed_is_message_changed_at_its_block() -> None:
    doctor = Doctor()

    def body(image: str) -> dict[str, Any]:
        content = [{"type": "text", "text": words(600, "caption")},
                   {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]
        return chat(("system", STABLE), ("user", content), ("assistant", "A cat."),
                    ("user", "What colour?"))

    doctor.send(CHAT, body("iVBORw0KGgo" * 50), 0)
    report = doctor.send(CHAT, body("R0lGODlhAQ" * 50), 1_000)
    assert (report.reason, report.part, report.index, report.role, report.offset) == (
        "message_changed", "message", 1, "user", 512)  # the block after 600 bytes of text
    assert report.repeated_bytes == len(STABLE) + 512


def test_an_expired_prefix_is_expired_and_the_window_is_inclusive() -> None:
    doctor = Doctor()
    body = chat(("system", STABLE), ("user", "hi"))
    doctor.send(CHAT, body, 0)
    assert doctor.send(CHAT, body, WINDOW).reason is None  # exactly the window: still held
    late = doctor.send(CHAT, body, 2 * WINDOW + 1)
    assert (late.reason, late.part, late.index, late.offset) == ("expired", "system", 0, 0)
    assert (late.repeated_bytes, late.stale_bytes) == (0, late.prompt_bytes)


def test_expiry_after_a_recent_head() -> None:
    doctor = Doctor()
    doctor.send(CHAT, chat(("system", STABLE), ("user", words(900, "first"))), 0)
    doctor.send(CHAT, chat(("system", STABLE), ("user", "another")), 200_000)
    report = doctor.send(CHAT, chat(("system", STABLE), ("user", words(900, "first")),
                                    ("assistant", "ok"), ("user", "more")), 400_000)
    assert (report.reason, report.part, report.index) == ("expired", "message", 1)
    assert (report.repeated_bytes, report.stale_bytes) == (len(STABLE), 900)


def test_another_model_is_model_changed_and_another_cache_key_is_cache_key_changed() -> None:
    doctor = Doctor()
    doctor.send(CHAT, chat(("system", STABLE), ("user", "hi"), prompt_cache_key="a"), 0)
    key = doctor.send(CHAT, chat(("system", STABLE), ("user", "hi"), prompt_cache_key="b"), 1)
    assert (key.reason, key.repeated_bytes, key.part) == ("cache_key_changed", 0, None)
    model = doctor.send(CHAT, chat(("system", STABLE), ("user", "hi"), model="gpt-4.1"), 2)
    assert (model.reason, model.repeated_bytes) == ("model_changed", 0)
    # Another upstream has its own cache: nothing like it there.
    assert doctor.send(CHAT, chat(("system", STABLE), ("user", "hi")), 3,
                       upstream="other").reason == "first_seen"


def test_instructions_context_and_prompt_changes_are_named_for_their_part() -> None:
    doctor = Doctor()
    doctor.send(RESPONSES, {"model": "m", "instructions": "Be terse.", "input": "hi"}, 0)
    report = doctor.send(RESPONSES, {"model": "m", "instructions": "Be verbose.", "input": "hi"}, 1)
    assert (report.reason, report.part) == ("instructions_changed", "instructions")

    doctor.send(RESPONSES, {"model": "m", "instructions": STABLE, "previous_response_id": "resp_1",
                            "input": "hi"}, 2)
    report = doctor.send(RESPONSES, {"model": "m", "instructions": STABLE,
                                     "previous_response_id": "resp_2", "input": "hi"}, 3)
    # a new stored context each turn is how the API works: no break, tokens unknown
    assert (report.reason, report.part, report.unseen_context) == (None, None, True)
    assert report.repeated_bytes == len(STABLE)
    assert cache_tokens(report, 20_000, 19_000) == CacheTokens(None, 19_000, None)
    # so are a prompt's with a picture: its tokens follow no bytes the doctor sees
    plain = report._replace(unseen_context=False)
    assert cache_tokens(plain, 20_000, 19_000).repeated is not None
    assert cache_tokens(plain, 20_000, 19_000, media=True) == CacheTokens(None, 19_000, None)

    doctor.send(COMPLETIONS, {"model": "m", "prompt": ["alpha " * 10, "beta " * 10]}, 4)
    report = doctor.send(COMPLETIONS, {"model": "m", "prompt": ["gamma " * 10, "beta " * 10]}, 5)
    assert (report.reason, report.part, report.index) == ("prompt_changed", "prompt", 0)


# ---------------------------------------------------------------------------
# What is not a break


def test_a_conversation_growing_by_a_turn_is_not_a_break() -> None:
    doctor = Doctor()
    turn1 = chat(("system", STABLE), ("user", words(700, "q1")))
    doctor.send(CHAT, turn1, 0)
    turn2 = doctor.send(CHAT, chat(("system", STABLE), ("user", words(700, "q1")),
                                   ("assistant", words(500, "a1")), ("user", "next?")), 1_000)
    assert turn2.reason is None
    assert turn2.repeated_bytes == sum(sizes(CHAT, turn1))  # the whole previous request


def test_a_new_question_after_the_same_system_prompt_is_not_a_break() -> None:
    doctor = Doctor()
    doctor.send(CHAT, chat(("system", STABLE), ("user", "What is a prefix?")), 0)
    report = doctor.send(CHAT, chat(("system", STABLE), ("user", "What is a suffix?")), 1_000)
    assert report.reason is None and report.repeated_bytes == len(STABLE)


def test_a_branch_from_a_request_that_went_on_is_a_break() -> None:
    doctor = Doctor()
    doctor.send(CHAT, chat(("system", STABLE), ("user", "q1"), ("assistant", words(400, "a")),
                           ("user", "q2")), 0)
    report = doctor.send(CHAT, chat(("system", STABLE), ("user", "q1"),
                                    ("assistant", words(400, "b")), ("user", "q2")), 1_000)
    assert (report.reason, report.index, report.role) == ("message_changed", 2, "assistant")


def test_a_request_that_ended_where_this_one_goes_on_makes_it_growth() -> None:
    doctor = Doctor()
    doctor.send(CHAT, chat(("system", STABLE), ("user", "q1")), 0)  # ended after q1
    doctor.send(CHAT, chat(("system", STABLE), ("user", "q1"), ("assistant", words(400, "a")),
                           ("user", "q2")), 1_000)  # went on past q1
    report = doctor.send(CHAT, chat(("system", STABLE), ("user", "q1"),
                                    ("assistant", words(400, "b")), ("user", "q3")), 2_000)
    assert report.reason is None  # it extends the first: the previous turn, regenerated


def test_a_request_without_parts_gets_no_report() -> None:
    doctor = PrefixDoctor(LruPrefixIndex())
    assert doctor.look((), upstream="u", model="m", now_ms=0) is None


def test_reasons_are_bounded_labels() -> None:
    assert len(REASONS) == len(set(REASONS)) == 13
    assert all(reason.replace("_", "").isalpha() for reason in REASONS)


# ---------------------------------------------------------------------------
# Tokens


def report_of(prompt_bytes: int, repeated_bytes: int) -> PrefixReport:
    return PrefixReport(prompt_bytes=prompt_bytes, blocks=1, repeated_blocks=0,
                        repeated_bytes=repeated_bytes, stale_bytes=0, reason=None)


def test_tokens_use_the_requests_own_ratio_and_missed_is_floored() -> None:
    report = report_of(4000, 3000)
    assert cache_tokens(report, 1000, 500) == CacheTokens(750, 500, 250)
    assert cache_tokens(report, 1000, 800) == CacheTokens(750, 800, 0)  # floored at 0
    assert cache_tokens(report, 1000, 0) == CacheTokens(750, 0, 750)  # reported 0 is a real 0
    assert cache_tokens(report_of(4000, 4000), 1000, 0).missed == 999  # the last token is computed


def test_missed_is_unknown_when_nothing_says_it() -> None:
    report = report_of(4000, 3000)
    assert cache_tokens(report, 1000, None) == CacheTokens(750, None, None)  # absent: unknown
    assert cache_tokens(report, None, 500) == CacheTokens(None, 500, None)  # no usage, no ratio
    assert cache_tokens(report_of(0, 0), 10, 0) == CacheTokens(None, 0, None)


def test_a_prefix_shorter_than_the_minimum_is_not_missed() -> None:
    report = report_of(8000, 4000)  # 1,000 of 2,000 tokens
    assert cache_tokens(report, 2000, 0, minimum_tokens=1024) == CacheTokens(1000, 0, 0)
    assert cache_tokens(report, 2000, 0, minimum_tokens=1000) == CacheTokens(1000, 0, 1000)
    # Rounded down to the steps the upstream caches in: no phantom block remainders.
    assert cache_tokens(report, 2000, 896, granularity_tokens=128).missed == 0
    assert cache_tokens(report, 2000, 768, granularity_tokens=128).missed == 128
    # The minimum applies to what is cacheable after that: a whole prompt of 1,024
    # tokens leaves 1,023, rounded to 896, below OpenAI's 1,024.
    whole = report_of(4096, 4096)
    assert cache_tokens(whole, 1024, 0, minimum_tokens=1024, granularity_tokens=128) == (
        CacheTokens(1024, 0, 0))
    assert cache_tokens(whole, 1153, 0, minimum_tokens=1024, granularity_tokens=128) == (
        CacheTokens(1153, 0, 1152))


def test_default_minimum_cacheable_lengths() -> None:
    assert minimum_cacheable_tokens("chat", "gpt-4o") == 1024
    assert minimum_cacheable_tokens("responses", "anything") == 1024
    assert minimum_cacheable_tokens("messages", "claude-sonnet-4-5") == 1024
    assert minimum_cacheable_tokens("messages", "claude-3-5-haiku-latest") == 2048
    assert minimum_cacheable_tokens("messages", "claude-haiku-4-5") == 4096
    assert minimum_cacheable_tokens("messages", "claude-opus-4-5") == 4096


def test_the_doctor_with_usage_end_to_end() -> None:
    doctor = Doctor()
    tools = [{"name": "search", "description": "Search the docs. " * 300,
              "input_schema": {"type": "object"}}]
    body = {"model": "claude-sonnet-4-5", "max_tokens": 10, "tools": tools,
            "system": "Today is Monday.\n" + STABLE, "messages": [{"role": "user", "content": "hi"}]}
    doctor.send(MESSAGES, body, 0)
    report = doctor.send(MESSAGES, {**body, "system": "Today is Tuesday.\n" + STABLE}, 1_000)
    assert report.reason == "variable_before_stable"
    prompt_tokens = report.prompt_bytes // 4
    tokens = cache_tokens(report, prompt_tokens, 0,
                          minimum_tokens=minimum_cacheable_tokens("messages", body["model"]))
    assert tokens.repeated == round(report.repeated_bytes / 4)
    assert tokens.missed == tokens.repeated > 1024  # the tools repeated, nothing was read
    short = cache_tokens(report, prompt_tokens * 2, 0, minimum_tokens=4096)
    assert short.missed == 0 and short.repeated is not None and short.repeated < 4096


# ---------------------------------------------------------------------------
# The repeated prefix is the longest common block prefix over the window


TEXTS = st.sampled_from([b"", b"a", b"ab", b"abcd", b"abcde", b"abcdefgh", b"abcdefghij",
                         b"xbcdefghij", b"abcdefghiX", b"\x00\xff"])
PART = st.tuples(st.sampled_from(["system", "message", "tools"]),
                 st.sampled_from(["", "user", "assistant"]), TEXTS)
REQUEST = st.tuples(st.lists(PART, min_size=1, max_size=5), st.sampled_from(["m1", "m2"]),
                    st.sampled_from([0, 1, 1_000, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW]))


def blocks_of(parts: list[tuple[str, str, bytes]], size: int) -> list[tuple[Any, ...]]:
    """What a chain block stands for: a part's first block with its kind and role."""
    out: list[tuple[Any, ...]] = []
    for kind, role, data in parts:
        out.append(("first", kind, role, data[:size]))
        out.extend(("next", data[at : at + size]) for at in range(size, len(data), size))
    return out


def common(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(REQUEST, min_size=1, max_size=12))
def test_repeated_prefix_is_the_longest_common_block_prefix_over_the_window(
        requests: list[tuple[list[tuple[str, str, bytes]], str, int]]) -> None:
    size = 4
    hasher = PromptHasher(block_bytes=size)
    index = LruPrefixIndex(settle_ms=0)  # exact stamps: steps land on the window's edge
    history: list[tuple[int, str, list[tuple[Any, ...]], list[int]]] = []
    now = 0
    for parts, model, step in requests:
        now += step
        prompt = [PromptPart(kind, i, role, data) for i, (kind, role, data) in enumerate(parts)]
        hashed = hasher.hash(prompt, upstream="u", model=model)
        assert hashed is not None
        report = examine(hashed, index.exchange(hashed.probe(), now), now)
        mine = blocks_of(parts, size)
        lengths = [len(b[-1]) for b in mine]
        in_window = [common(mine, theirs) for t, m, theirs, _ in history
                     if m == model and t >= now - WINDOW]
        # the index forgets what nobody touched for its horizon (an hour by default)
        ever = [common(mine, theirs) for t, m, theirs, _ in history
                if m == model and t >= now - DEFAULT_HORIZON_MS]
        expected = max(in_window, default=0)
        held = max(ever, default=0)
        assert report.repeated_blocks == expected
        assert report.repeated_bytes == sum(lengths[:expected])
        assert report.stale_bytes == sum(lengths[expected:held])
        assert report.blocks == len(mine)
        if expected == len(mine):
            assert report.reason is None
        history.append((now, model, mine, lengths))


# Steps that never bring two requests within a settle of the window's edge: a dozen of
# the short ones span less than the window less a settle, a long one more than the
# window and a settle.
SETTLE_STEPS = st.sampled_from([0, 1, 10, 500, 20_000, 2 * WINDOW])


# Parts that may open with request settings, whose keys the scope's anchors leave out
SETTLED_PART = st.tuples(st.sampled_from(["settings", "system", "message", "tools"]),
                         st.sampled_from(["", "user", "assistant"]), TEXTS)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(SETTLED_PART, min_size=1, max_size=4),
                          st.sampled_from(["m1", "m2"]),
                          SETTLE_STEPS, st.sampled_from([0, 5, 30])), min_size=1, max_size=12),
       st.randoms(use_true_random=False))
def test_a_settled_index_reports_what_one_that_writes_every_stamp_reports(
        requests: list[tuple[list[tuple[str, str, bytes]], str, int, int]],
        rng: random.Random) -> None:
    """The in-process index leaves alone the entries whose runs already cover a stamp
    (``settle_ms``): every report is the one an index writing every stamp gives, with
    prompts repeated whole or by their first parts (often, here) within the settle, and
    prefills done out of order."""
    hasher = PromptHasher(block_bytes=4, chunk_bytes=4)
    settled, exact = LruPrefixIndex(), LruPrefixIndex(settle_ms=0)
    assert settled.settle_ms > 30
    now, earlier = 0, []
    for parts, model, step, prefill in requests:
        if earlier and rng.random() < 0.6:
            head, model = rng.choice(earlier)  # the prompt again, or its first parts
            again = rng.random() < 0.5  # then others (a shared head, a new tail)
            parts = head if again else head[: rng.randint(1, len(head))] + parts
        earlier.append((parts, model))
        now += step
        prompt = [PromptPart(kind, i, role, data) for i, (kind, role, data) in enumerate(parts)]
        anchor = 0  # the first part of prompt text, as PrefixDoctor.look finds it
        while anchor < len(prompt) - 1 and prompt[anchor].kind == "settings":
            anchor += 1
        hashed = hasher.hash(prompt, upstream="u", model=model, anchor=anchor)
        assert hashed is not None
        seen = settled.exchange(hashed.probe(), now, now + prefill)
        truth = exact.exchange(hashed.probe(), now, now + prefill)
        assert examine(hashed, seen, now) == examine(hashed, truth, now)
        # every key read (no range said unheld): the report the keys it skips would give
        listed = SightingLists(list(seen.continued), list(seen.ended), dict(seen.after))
        assert examine(hashed, seen, now) == examine(hashed, listed, now)
        cutoff = now - WINDOW  # what any report asks of a key: held within the window, how
        for i in range(len(hashed.keys)):
            assert (seen.continued[i] >= cutoff, seen.ended[i] >= cutoff, i in seen.after) == (
                truth.continued[i] >= cutoff, truth.ended[i] >= cutoff, i in truth.after), i


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(SETTLED_PART, min_size=1, max_size=4), st.booleans(),
                          st.integers(0, 2)), min_size=1, max_size=16),
       st.randoms(use_true_random=False))
def test_a_prompts_parts_before_its_last_recalled_give_the_keys_a_bare_hasher_gives(
        requests: list[tuple[list[tuple[str, str, bytes]], bool, int]],
        rng: random.Random) -> None:
    """Prompts that share their parts but the last (one system prompt, a question of
    each request's own) are laid out from the hasher's record of those parts: with
    settings ahead, parts of whole blocks, empty parts, indices moved, a last part seen
    before, an anchor on a settings part, the keys are a bare hasher's (no part kept)."""
    secret = os.urandom(32)
    kept = PromptHasher(secret, block_bytes=4, chunk_bytes=4)
    bare = PromptHasher(secret, block_bytes=4, chunk_bytes=4, part_cache_keys=0)
    earlier: list[list[tuple[str, str, bytes]]] = []
    for parts, moved, model in requests:
        if earlier and rng.random() < 0.7:  # an earlier prompt's parts but its last, then
            lead = rng.choice(earlier)
            parts = lead[:-1] + parts[-1:] if len(lead) > 1 else lead + parts[-1:]
        earlier.append(parts)
        prompt = [PromptPart(kind, i + moved, role, data)
                  for i, (kind, role, data) in enumerate(parts)]
        anchor = 0  # the first part of text, as PrefixDoctor.look finds it; or the first
        while anchor < len(prompt) - 1 and prompt[anchor].kind == "settings" and moved:
            anchor += 1
        model_name = f"m{model}"
        assert kept.hash(prompt, upstream="u", model=model_name, anchor=anchor) == bare.hash(
            prompt, upstream="u", model=model_name, anchor=anchor)


def test_a_system_prompt_before_new_questions_is_laid_out_from_its_record() -> None:
    """From the third prompt on (the first keeps the system part, the second records
    it as the parts before a last one), a new question's keys are laid after the
    record's, as a bare hasher lays them out."""
    secret = os.urandom(32)
    kept = PromptHasher(secret)
    bare = PromptHasher(secret, part_cache_keys=0)
    system = PromptPart("system", 0, "system", (STABLE * 3).encode())
    with mock.patch.object(kept, "_after", wraps=kept._after) as laid:
        for n in range(4):
            prompt = [system, PromptPart("message", 1, "user", f"question {n}".encode())]
            assert kept.hash(prompt, upstream="u", model="m") == bare.hash(
                prompt, upstream="u", model="m")
    assert laid.call_count == 2 and len(kept._leads) == 1 and not bare._leads


def test_a_part_that_heads_another_requests_part_still_has_its_chunks_written() -> None:
    """A part whose bytes are a block-aligned head of another request's part (``abcd``
    in ``abcdefghij``) shares its last chain key with that part, not its chunks: held
    within the settle, the key is left alone, but the chunks are written, as an index
    writing every stamp writes them."""
    hasher = PromptHasher(block_bytes=4, chunk_bytes=4)
    settled, exact = LruPrefixIndex(), LruPrefixIndex(settle_ms=0)

    def send(parts: list[tuple[str, str, bytes]], at: int) -> tuple[Sightings, Sightings]:
        prompt = [PromptPart(kind, i, role, data) for i, (kind, role, data) in enumerate(parts)]
        hashed = hasher.hash(prompt, upstream="u", model="m")
        assert hashed is not None
        return settled.exchange(hashed.probe(), at), exact.exchange(hashed.probe(), at)

    send([("tools", "user", b"abcdefghij")], 0)  # holds the chain key of "abcd"
    head = [("tools", "user", b"abcd"), ("message", "user", b"x")]
    send(head, 10)  # its first part ends at that key: the key is settled, the chunk new
    seen, truth = send(head, 20)
    assert truth.ended[0] == 10  # the first part's chunk, as the second request held it
    assert seen.ended[0] == truth.ended[0]


def test_the_scopes_keys_are_written_unless_the_covered_head_holds_the_texts_first_block(
) -> None:
    """The root and the anchors are skipped with a covered head only where it holds the
    first block of prompt text (the anchors name it): a head of request settings alone
    does not, so a new text after the same settings still has its anchors written."""
    hasher = PromptHasher(block_bytes=4, chunk_bytes=4)
    settled, exact = LruPrefixIndex(), LruPrefixIndex(settle_ms=0)

    def send(text: bytes, at: int) -> tuple[HashedPrompt, Sightings, Sightings]:
        prompt = [PromptPart("settings", 0, "tools", b"abcdefgh"),
                  PromptPart("message", 1, "user", text)]
        hashed = hasher.hash(prompt, upstream="u", model="m", anchor=1)
        assert hashed is not None
        probe = hashed.probe()
        return hashed, settled.exchange(probe, at), exact.exchange(probe, at)

    send(b"first question", 0)
    send(b"other question", 10)  # the settings' blocks covered, the text's not
    hashed, seen, truth = send(b"other question", 20)
    anchors = range(len(hashed.keys) - 2, len(hashed.keys))
    assert [truth.ended[i] for i in anchors] == [10, 10]
    assert [seen.ended[i] for i in anchors] == [truth.ended[i] for i in anchors]


def test_a_new_question_after_a_repeated_system_prompt_is_said_from_the_unheld_keys() -> None:
    """The exchange says which keys it wrote that nobody held (the new question's): the
    examination says the system prompt repeated without reading them, as it would
    reading them."""
    hasher = PromptHasher()
    index = LruPrefixIndex()
    system = PromptPart("system", 0, "system", (STABLE * 4).encode())

    def ask(question: bytes, at: int) -> tuple[HashedPrompt, Sightings]:
        hashed = hasher.hash([system, PromptPart("message", 1, "user", question)],
                             upstream="u", model="m")
        assert hashed is not None
        return hashed, index.exchange(hashed.probe(), at, at + 5)

    ask(b"What is this?", 0)
    hashed, seen = ask(b"And that?", 100)
    lo, hi = seen.unheld
    question = range(hashed.first_chunk[1], len(hashed.keys) - 4 - hashed.first_block[1] + 1)
    assert lo <= question.start and hi >= question.stop  # its chunk and its block
    assert all(seen.last(i) == NEVER and not seen.late(i) for i in range(lo, hi))
    report = examine(hashed, seen, 100)
    listed = SightingLists(list(seen.continued), list(seen.ended), dict(seen.after))
    assert report == examine(hashed, listed, 100)
    assert report.repeated_bytes == len(system.data) and report.reason is None
    # the same prompt again, held whole a moment ago: nothing written, nothing said unheld
    assert ask(b"And that?", 200)[1].unheld == (0, 0)


P = PromptPart
UNHELD_CASES = {
    # earlier prompts, then the one examined: (kind, role, text) per part
    "the first prompt": ([], [("message", "user", "hello")]),
    "a new question": ([[("system", "system", "abcdefgh"), ("message", "user", "q1")]],
                       [("system", "system", "abcdefgh"), ("message", "user", "q2")]),
    "a last part whose first block was held": (
        [[("system", "system", "abcdefgh"), ("message", "user", "same one")]],
        [("system", "system", "abcdefgh"), ("message", "user", "same two")]),
    "stored context before it": (
        [[("context", "previous_response_id", "resp_1"), ("message", "user", "q1")]],
        [("context", "previous_response_id", "resp_1"), ("message", "user", "q2")]),
    "a conversation before it": (
        [[("context", "conversation", "conv_1"), ("message", "user", "q1")]],
        [("context", "conversation", "conv_1"), ("message", "user", "q2")]),
    "a setting removed": (
        [[("settings", "tools", "[1]"), ("settings", "verbosity", "low"),
          ("message", "user", "hello there")]],
        [("settings", "tools", "[1]"), ("message", "user", "hello world")]),
    "a setting changed last": ([[("settings", "tools", "[1]"), ("settings", "verbosity", "low")]],
                               [("settings", "tools", "[1]"), ("settings", "verbosity", "high")]),
}


@pytest.mark.parametrize("case", UNHELD_CASES)
def test_the_unheld_keys_read_unread_give_the_report_reading_them_gives(case: str) -> None:
    """Where the exchange says which keys nobody held, the report is the one every key
    read gives (each prompt anchored as PrefixDoctor.look anchors it)."""
    earlier, examined = UNHELD_CASES[case]
    hasher, index = PromptHasher(block_bytes=4, chunk_bytes=4), LruPrefixIndex()
    for at, parts in enumerate([*earlier, examined]):
        prompt = [P(kind, i, role, text.encode()) for i, (kind, role, text) in enumerate(parts)]
        anchor = next((i for i, part in enumerate(prompt) if part.kind != "settings"),
                      len(prompt) - 1)
        hashed = hasher.hash(prompt, upstream="u", model="m", anchor=anchor)
        assert hashed is not None
        seen = index.exchange(hashed.probe(), 100 * at, 100 * at + 5)
    removed = "verbosity" if case == "a setting removed" else ""
    assert seen.unheld[0] < seen.unheld[1]  # the examined prompt's new keys, said unheld
    listed = SightingLists(list(seen.continued), list(seen.ended), dict(seen.after))
    now = 100 * len(earlier)
    assert examine(hashed, seen, now, removed=removed) == examine(
        hashed, listed, now, removed=removed)


def test_a_prompt_held_whole_within_the_settle_writes_nothing() -> None:
    hasher = PromptHasher()
    index = LruPrefixIndex()
    prompt = [PromptPart("system", 0, "", STABLE.encode()), PromptPart("message", 1, "user", b"Hi")]
    hashed = hasher.hash(prompt, upstream="u", model="m")
    assert hashed is not None
    index.exchange(hashed.probe(), 0, 10)
    written = dict(index._entries)
    order = list(index._entries)
    # arrived after the first was done, done within the settle: nothing written or moved
    seen = index.exchange(hashed.probe(), 100, 10 + index.settle_ms)
    assert dict(index._entries) == written and list(index._entries) == order
    assert examine(hashed, seen, 100).repeated_blocks == len(hashed.chain)
    assert seen.last(len(hashed.chunks)) == 10 and not seen.after
    # arrived before the first was done, done within its run: read as such, not written
    seen = index.exchange(hashed.probe(), 5, 10)
    assert dict(index._entries) == written and seen.after
    # done before the run's first: written (the run starts earlier)
    index.exchange(hashed.probe(), 2, 8)
    assert dict(index._entries) != written
    # done later than the settle after the run's latest: written (its latest moves)
    written = dict(index._entries)
    index.exchange(hashed.probe(), 300, 11 + index.settle_ms)
    assert dict(index._entries) != written


# ---------------------------------------------------------------------------
# The micro-benchmark runs


def run_benchmark(script: str, *args: str) -> str:
    """What ``benchmarks/<script> args`` prints, once it exited 0."""
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
def test_prefix_micro_benchmark_smoke_run() -> None:
    stdout = run_benchmark("prefix_micro.py", "--quick", "--sizes", "2048", "--blocks", "256")
    assert "| 2,048 B | 256 |" in stdout
    assert "index bytes/entry" in stdout


@pytest.mark.slow
def test_the_doctor_job_benchmark_runs_the_request_paths_calls() -> None:
    """Its child run (what cachegrind counts) drives the job as the request path does:
    every request after the first in a batch is found repeated whole."""
    stdout = run_benchmark("doctor_job_micro.py", "--child", "48", "--sizes", "2048")
    assert "48 requests, 47 found repeated whole" in stdout


@pytest.mark.slow
def test_the_doctor_job_benchmark_counts_bytecodes_per_function() -> None:
    """``--opcodes`` traces the second half's requests and names the doctor's functions
    with the bytecodes each runs per request; the harness's and the loop's are not
    counted."""
    requests = 2 * BATCH_JOBS  # whole batches, the second traced
    stdout = run_benchmark(
        "doctor_job_micro.py", "--opcodes", "--requests", str(requests), "--sizes", "2048")
    assert f"({BATCH_JOBS} requests traced)" in stdout
    rows = dict(re.findall(r"^\| `(\S+)` \| ([\d,.]+) \|", stdout, re.M))
    assert float(rows["job.py:begin"]) > 0
    assert float(rows["examine.py:look"].replace(",", "")) > 0
    assert not any(name.startswith(("doctor_job_micro.py", "base_events.py")) for name in rows)
