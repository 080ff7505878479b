"""What to fix (proxy/diagnosis/levers.py): the first-token split, the decode and output
figures, the ranking, the thresholds and the sentences, from evidence built by hand."""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.bench.stats import FAST_DECODE_TOK_S, READING_PACE_TOK_S
from proxy.diagnosis import levers
from proxy.diagnosis.dist import Dist
from proxy.diagnosis.fit import FitSums, PrefillFit, fit
from proxy.diagnosis.levers import Diagnosis, Evidence, as_json, diagnose

INF = math.inf
ROUTE, MODEL, UPSTREAM = "/v1/chat/completions", "m", "u"


def line_fit(n: int = 200, *, ms_per_1k: float = 130.0, fixed_s: float = 0.617,
             mean_tokens: float = 9100.0, spread: float = 5000.0, noise_s: float = 0.02,
             seed: int = 1) -> PrefillFit:
    rng = random.Random(seed)
    points = []
    for i in range(n):
        tokens = mean_tokens - spread + 2 * spread * i / (n - 1)
        points.append((tokens, fixed_s + ms_per_1k / 1e6 * tokens + rng.gauss(0, noise_s)))
    return fit(FitSums.of(points))


# TPOT: 200 streams, most at 20-25 ms a token (40-50 tokens/s)
FAST_TPOT = Dist(((0.01, 0), (0.02, 10), (0.025, 150), (0.05, 200), (0.2, 200), (INF, 200)),
                 200 * 0.024)
# completion tokens: 200 answers, mean 780, most short and a long tail
LONG_TAIL = Dist(((64, 10), (128, 40), (256, 110), (512, 130), (1024, 150), (2048, 185),
                  (4096, 200), (INF, 200)), 200 * 780.0)


def example(**changes: object) -> Evidence:
    """The tracker's example: 9,100 uncached tokens at 0.13 ms each in a 1.8 s first token
    of which 0.4 s is the upstream's queue; 780-token answers at 24 ms a token."""
    ev = Evidence(ROUTE, MODEL, UPSTREAM, requests=200, streams=200, fit=line_fit(),
                  ttft_mean_s=1.8, queue_mean_s=0.0, upstream_queue_mean_s=0.4,
                  duration_mean_s=1.8 + 18.72, tpot=FAST_TPOT, completion=LONG_TAIL,
                  finish={"stop": 180.0, "length": 20.0})
    return replace(ev, **changes)  # type: ignore[arg-type]


def by_name(d: Diagnosis) -> dict[str, levers.Lever]:
    return {lever.name: lever for lever in d.levers}


def test_the_example_selection() -> None:
    d = diagnose(example())
    assert [lv.name for lv in d.levers] == [
        "output_length", "prefill", "upstream_queue", "fixed", "proxy_queue", "decode"]
    assert [lv.status for lv in d.levers] == ["lever"] * 4 + ["not_a_lever"] * 2
    got = by_name(d)
    assert got["prefill"].sentence == (
        "Prefill: 9,100 uncached prompt tokens at 0.13 ms per token are 1.2 s of the 1.8 s "
        "first token. Shorten the prompt, or put what does not change first so the upstream "
        "can cache it.")
    assert got["upstream_queue"].sentence == (
        "Queueing: 400 ms of the 1.8 s first token is waiting for a slot at the upstream. "
        "This is capacity, not the model.")
    assert got["decode"].sentence == (
        "Decoding at 43 tokens/s: above reading pace; a faster model would not be noticed "
        "by a reader.")
    # the rest of the first token, named so: the card's "fixed part" is the fit's intercept
    rest = got["fixed"]
    assert rest.sentence.startswith(f"Rest of the first token: {rest.saves_ms:.0f} ms of the "
                                    "1.8 s first token does not grow with the prompt")
    assert rest.numbers["rest_ms"] == rest.saves_ms
    out = got["output_length"].sentence
    assert out.startswith("Answers average 780 tokens (p95 2,700), 18.7 s at 24 ms per "
                          "token; capped at 256 tokens (the median is at most that) the mean "
                          "total would be ")
    assert got["output_length"].numbers["cap_tokens"] == 256  # the median's bucket: 128-256
    assert "10 % of answers already stop at their length limit" in out
    # the numbers behind each sentence travel with it
    assert got["prefill"].numbers["mean_uncached_tokens"] == pytest.approx(9100)
    assert got["output_length"].numbers["length_limited_share"] == 0.1


def test_the_first_token_split_adds_up() -> None:
    d = diagnose(example())
    split = d.first_token
    assert split.mean_ms == pytest.approx(1800)
    assert split.proxy_queue_ms == 0 and split.upstream_queue_ms == pytest.approx(400)
    assert d.prefill_ms_per_1k_tokens is not None
    assert split.prefill_ms == pytest.approx(d.prefill_ms_per_1k_tokens * 9.1)
    assert split.missed_cache_ms is None  # not known: not 0
    assert split.rest_ms is not None
    parts = [split.proxy_queue_ms, split.upstream_queue_ms, split.prefill_ms, split.rest_ms]
    assert sum(p for p in parts if p is not None) == pytest.approx(1800)


def test_missed_cache_hits_are_their_own_part_and_lever() -> None:
    d = diagnose(example(missed_cache_tokens=4000.0))
    split = d.first_token
    slope = d.prefill_ms_per_1k_tokens
    assert slope is not None
    assert split.missed_cache_ms == pytest.approx(slope * 4.0)
    assert split.prefill_ms == pytest.approx(slope * 5.1)
    parts = (split.proxy_queue_ms, split.upstream_queue_ms, split.prefill_ms,
             split.missed_cache_ms, split.rest_ms)
    assert sum(p or 0.0 for p in parts) == pytest.approx(1800)
    got = by_name(d)
    assert got["prompt_cache"].status == "lever"
    assert got["prompt_cache"].sentence.startswith(
        "Prompt cache: 4,000 prompt tokens a request could have read from the cache were "
        "computed again: 522 ms of the 1.8 s first token.")
    assert got["prefill"].sentence.startswith(  # with the missed ones: the mean uncached
        "Prefill: 5,100 uncached prompt tokens besides the 4,000 the cache missed, at 0.13 ms")
    assert got["prefill"].numbers["mean_uncached_tokens"] == pytest.approx(9100, rel=0.01)
    assert "prompt_cache" not in by_name(diagnose(example()))  # left out when not known


def test_the_prefill_sentence_and_the_missed_tokens_add_up_as_said() -> None:
    """162 uncached tokens besides 1,847 missed (a user's mean of 2,009): said as 200
    besides 1,800, which add up to the 2,000 the mean reads as; each rounded alone,
    "162 besides the 1,800" added up to nothing the card or the JSON says."""
    d = diagnose(example(missed_cache_tokens=1847.0,
                         fit=line_fit(mean_tokens=2009.0, spread=1500.0)))
    sentence = by_name(d)["prefill"].sentence
    found = re.search(r"Prefill: ([\d,]+) uncached prompt tokens besides the ([\d,]+) the "
                      r"cache missed", sentence)
    assert found is not None, sentence
    rest, missed = (int(g.replace(",", "")) for g in found.groups())
    assert (rest, missed) == (200, 1800)


def test_the_prompt_cache_lever_quotes_no_slope_while_the_fit_is_not_known() -> None:
    """Six requests: the prefill fit is not known yet, so neither is the missed tokens'
    cost; the lever's numbers said a slope all the same (from too little data)."""
    d = diagnose(example(missed_cache_tokens=1000.0, fit=line_fit(6)))
    lever = by_name(d)["prompt_cache"]
    assert lever.status == "too_little_data"
    assert lever.numbers["ms_per_1k_tokens"] is None
    assert lever.numbers["missed_cache_tokens"] == 1000.0


def test_a_prefill_scaled_down_to_the_first_token_still_names_the_prompt_as_counted() -> None:
    """The fit puts 1.2 s of prefill in a 0.5 s first token (0.4 s of it queue): the part
    is scaled down to what is left, and the sentence says so; the tokens it names are the
    mean uncached prompt as counted, not the scaled time over the slope (a user read 420
    tokens for a mean of 548)."""
    d = diagnose(example(ttft_mean_s=0.5))
    assert d.first_token.capped
    sentence = by_name(d)["prefill"].sentence
    assert sentence.startswith("Prefill: 9,100 uncached prompt tokens at 0.13 ms per token are "
                               "100 ms of the 500 ms first token (scaled down from 1.2 s"), sentence


def test_the_prompt_cache_lever_says_which_missed_tokens_a_breakpoint_would_serve() -> None:
    """Of the missed tokens, those past the last cache breakpoint (a route that caches only
    marked prefixes) call for a breakpoint; the rest were asked for and not served."""
    lever = by_name(diagnose(example(missed_cache_tokens=4000.0,
                                     unmarked_cache_tokens=3000.0)))["prompt_cache"]
    assert lever.sentence.endswith(
        "3,000 of them came after the last cache breakpoint, where no cache was asked to "
        "serve them: add a breakpoint after the stable part. The other 1,000 were asked for "
        "and not served.")
    assert lever.numbers["unmarked_cache_tokens"] == 3000.0
    implicit = by_name(diagnose(example(missed_cache_tokens=4000.0)))["prompt_cache"]
    assert implicit.sentence.endswith("Keep the shared part of the prompt first and identical.")


def test_an_upstream_that_reports_no_queue() -> None:
    d = diagnose(example(upstream_queue_mean_s=None))
    assert d.first_token.upstream_queue_ms is None
    got = by_name(d)
    assert got["upstream_queue"].status == "unknown"
    assert "does not report its queue time" in got["upstream_queue"].sentence
    assert "the upstream's queue" in got["fixed"].sentence  # the rest holds it
    assert d.levers[-1].name == "upstream_queue"  # unknown goes last


def test_too_little_data_says_so_and_gives_no_numbers() -> None:
    few = line_fit(12)
    d = diagnose(example(requests=12, streams=12, fit=few,
                         tpot=Dist(((0.05, 12), (INF, 12)), 0.3),
                         completion=Dist(((64, 12), (INF, 12)), 400.0)))
    assert d.prefill_ms_per_1k_tokens is None and d.fixed_ms is None
    assert {lv.status for lv in d.levers} == {"too_little_data"}
    got = by_name(d)
    assert got["prefill"].sentence == (
        "Prefill: too little data yet (12 streamed requests with a prompt token count, "
        "20 needed).")
    assert got["decode"].sentence == "Decoding: too little data yet (12 streams, 20 needed)."
    assert all(lv.saves_ms is None for lv in d.levers)
    assert d.first_token.prefill_ms is None and d.first_token.rest_ms is None


def test_prompts_of_one_length() -> None:
    points = [(2000.0, 0.3 + 0.01 * (i % 3)) for i in range(50)]
    d = diagnose(example(fit=fit(FitSums.of(points))))
    assert d.prefill_ms_per_1k_tokens is None and d.fixed_ms is None
    got = by_name(d)
    assert got["prefill"].status == "too_little_data"
    assert got["prefill"].sentence == (
        "Prefill: the prompts all have about one length (2,000 uncached tokens), so the time "
        "they take cannot be told apart from the fixed part.")
    assert got["fixed"].status == "too_little_data"


def test_a_slope_lost_in_noise_is_not_printed_as_a_number() -> None:
    noisy = line_fit(40, ms_per_1k=5.0, spread=200.0, noise_s=0.3)
    assert noisy.status == "fitted" and (noisy.relative_stderr or 0) > 0.25
    d = diagnose(example(fit=noisy))
    assert d.prefill_ms_per_1k_tokens is None
    sentence = by_name(d)["prefill"].sentence
    assert sentence.startswith("Prefill: not clear yet (")
    assert "first-token times vary more than prompt lengths explain" in sentence
    # nor is the rejected fit's fixed part, below zero or above the whole as it may be
    assert noisy.fixed_ms is not None and by_name(d)["fixed"].numbers["fixed_ms"] is None


def test_no_prefill_cost() -> None:
    flat = line_fit(100, ms_per_1k=-2.0, noise_s=0.001)
    got = by_name(diagnose(example(fit=flat)))
    assert got["prefill"].status == "not_a_lever" and got["prefill"].saves_ms == 0


def test_slow_decoding_is_a_lever_with_its_saving() -> None:
    # 100 streams at 0.25-0.4 s a token (2.5-4 tokens/s), 100-token answers
    slow = Dist(((0.05, 0), (0.2, 0), (0.5, 100), (INF, 100)), 100 * 0.33)
    answers = Dist(((64, 0), (128, 100), (INF, 100)), 100 * 100.0)
    d = diagnose(example(tpot=slow, completion=answers, duration_mean_s=1.8 + 33.0))
    got = by_name(d)["decode"]
    assert got.status == "lever"
    # what 20 tokens/s would save: the mean excess over 0.05 s (uniform in the 0.2-0.5 s
    # bucket: 0.35 - 0.05 = 0.30; the exact sum gives 0.33 - 0.05 = 0.28) x 99 tokens
    assert got.saves_ms == pytest.approx(0.28 * 99 * 1000)
    assert got.sentence.startswith(
        "Decoding at 2.9 tokens/s: 100 % of streams are slower than reading pace (5 "
        "tokens/s), so users wait on the model. Decoding at 20 tokens/s or more would save "
        "27.7 s a request")
    assert d.levers[0].name == "decode"


def test_streams_all_faster_than_the_cap_save_nothing() -> None:
    """Every stream at 69 tokens/s, high in the proxy's 10-15 ms bucket: the midpoints
    put the sum 2 ms a token above them, which read as a saving of 599 ms a request from
    decoding at 20 tokens/s, where no stream was under it."""
    buckets = ((0.005, 0), (0.01, 0), (0.015, 22), (0.025, 22), (0.05, 22), (INF, 22))
    fast = Dist(buckets, 22 * 0.0145)
    assert fast.mean_excess(1 / 20) == 0
    d = diagnose(example(tpot=fast))
    got = by_name(d)["decode"]
    assert (got.status, got.saves_ms) == ("not_a_lever", 0)
    assert got.sentence.startswith("Decoding at")
    # one stream in the bucket above the cap: at most that bucket's width above it
    one = Dist(((0.015, 21), (0.05, 21), (0.1, 22), (INF, 22)), 21 * 0.0145 + 0.1)
    assert one.mean_excess(0.05) == pytest.approx((0.1 - 0.05) / 22)


def test_mean_excess_against_uniform_data() -> None:
    rng = random.Random(2)
    edges = (1.0, 2.0, 4.0, 8.0, 16.0)
    values = [rng.uniform(lo, hi) for lo, hi in zip((0.0, *edges), edges, strict=False)
              for _ in range(2000)]
    buckets = tuple((e, float(sum(v <= e for v in values))) for e in (*edges, INF))
    dist = Dist(buckets, sum(values))
    for cap in (0.5, 2.0, 3.0, 10.0, 16.0, 20.0):
        exact = sum(max(0.0, v - cap) for v in values) / len(values)
        # at most the truth, by at most what the bucket holding cap can hide (its
        # observations taken at their mean: a fifth of them here, U(8, 16) at cap 10 the
        # most: 0.45 against 0.40)
        assert 0.85 * exact - 0.01 <= dist.mean_excess(cap) <= exact + 0.01, cap


def test_answers_all_of_one_length_save_nothing_capped_at_their_median() -> None:
    """32 answers of exactly 100 tokens, in the 64-128 bucket: the interpolated median
    is 96, and spread evenly over the bucket they read as 12 tokens over it each, a
    "worth acting on" 240 ms. Taken at their exact mean, a cap at 96 would cut 4 tokens
    from each, but 96 is no median of theirs: the cap is the bound of the median's
    bucket, 128, the most the median can be, and capping there saves nothing."""
    answers = Dist(((64, 0), (128, 32), (INF, 32)), 32 * 100.0)
    assert answers.quantile(0.5) == 96
    assert answers.mean_excess(96) == pytest.approx(4)
    at_20ms = Dist(((0.02, 32), (INF, 32)), 32 * 0.02)
    d = diagnose(example(completion=answers, tpot=at_20ms, duration_mean_s=0.25 + 2.0,
                         finish={"length": 32.0}))
    got = by_name(d)["output_length"]
    assert got.numbers["cap_tokens"] == 128
    assert (got.saves_ms, got.status) == (0, "not_a_lever")
    assert "capped at 128 tokens (the median is at most that)" in got.sentence


def test_json_contract() -> None:
    doc = as_json([diagnose(example()), diagnose(example(requests=3, streams=3,
                                                         fit=line_fit(3)))])
    text = json.dumps(doc, allow_nan=False)  # plain JSON: no NaN or inf anywhere
    assert set(doc) == {"selections"}
    first, second = doc["selections"]
    assert set(first) == {"route", "model", "upstream", "requests",
                          "prefill_ms_per_1k_tokens", "fixed_ms", "fit_model", "line_fixed_ms",
                          "fit_terms", "fit_note", "tokens_estimated_share", "first_token", "decode",
                          "output", "levers", "no_first_token_streams", "no_first_token_wait_ms"}
    assert (first["route"], first["model"], first["upstream"]) == (ROUTE, MODEL, UPSTREAM)
    assert set(first["first_token"]) == {"mean_ms", "proxy_queue_ms", "upstream_queue_ms",
                                         "prefill_ms", "missed_cache_ms", "rest_ms",
                                         "prefill_from", "capped"}
    assert first["first_token"]["missed_cache_ms"] is None
    for lever in first["levers"]:
        assert set(lever) == {"name", "status", "acts_on", "saves_ms", "sentence", "numbers"}
    saved = [lv["saves_ms"] for lv in first["levers"] if lv["status"] == "lever"]
    assert saved == sorted(saved, reverse=True)  # most valuable first
    assert second["prefill_ms_per_1k_tokens"] is None and second["fixed_ms"] is None
    assert "NaN" not in text


def test_thresholds_match_the_bench_reports_reading_pace() -> None:
    assert levers.READING_PACE_TOK_S == READING_PACE_TOK_S
    assert levers.FAST_TOK_S == FAST_DECODE_TOK_S


@st.composite
def evidence(draw: st.DrawFn) -> Evidence:
    n = draw(st.integers(0, 60))
    points = [(float(draw(st.integers(0, 50_000))), draw(st.floats(0.0, 30.0)))
              for _ in range(n)]

    def dist(edges: tuple[float, ...], scale: float) -> Dist | None:
        if not draw(st.booleans()):
            return None
        counts = draw(st.lists(st.integers(0, 50), min_size=len(edges) + 1,
                               max_size=len(edges) + 1))
        cumulative, total = [], 0
        for c in counts:
            total += c
            cumulative.append(float(total))
        mean = draw(st.floats(0.0, scale))
        return Dist(tuple(zip((*edges, INF), cumulative, strict=True)), mean * total)

    maybe = st.none() | st.floats(0.0, 60.0)
    return Evidence(
        ROUTE, MODEL, UPSTREAM, requests=draw(st.integers(0, 500)),
        streams=draw(st.integers(0, 500)), fit=fit(FitSums.of(points)),
        ttft_mean_s=draw(maybe), queue_mean_s=draw(maybe), upstream_queue_mean_s=draw(maybe),
        missed_cache_tokens=draw(st.none() | st.floats(0.0, 50_000.0)),
        duration_mean_s=draw(maybe),
        tpot=dist((0.01, 0.05, 0.2, 1.0), 2.0), completion=dist((16.0, 256.0, 4096.0), 8000.0),
        finish=draw(st.dictionaries(st.sampled_from(["length", "stop", "other"]),
                                    st.floats(0.0, 100.0))))


@given(evidence())
def test_no_advice_without_numbers(ev: Evidence) -> None:
    d = diagnose(ev)
    json.dumps(as_json([d]), allow_nan=False)
    statuses = [levers._ORDER[lv.status] for lv in d.levers]
    assert statuses == sorted(statuses)
    for lever in d.levers:
        assert lever.sentence.endswith(".") and "None" not in lever.sentence
        if lever.status in ("lever", "not_a_lever"):
            assert lever.saves_ms is not None and lever.saves_ms >= 0
        if lever.status == "lever":
            assert re.search(r"\d", lever.sentence), lever.sentence
            assert "unknown" not in lever.sentence, lever.sentence
        if lever.status in ("too_little_data", "unknown"):
            assert lever.saves_ms is None
        if "fixed_ms" in lever.numbers:  # the card's fixed part, never a rejected fit's
            assert lever.numbers["fixed_ms"] == d.fixed_ms


def test_superlinear_prefill_never_makes_a_part_larger_than_the_whole() -> None:
    """The card of a llama.cpp-like engine on CPU: the straight line's slope times the
    mean prompt exceeded the mean first token and its rest was below zero. Every part
    is now within the whole, the rest is not negative, and the note says which model:
    the quadratic, whose prefill of the mean request is the mean less its fixed part."""
    from tests.test_diagnosis_fit import superlinear_points

    points = superlinear_points()
    sums = FitSums.of(points)
    mean_s = sums.sy / sums.n
    d = diagnose(example(fit=fit(sums), ttft_mean_s=mean_s, upstream_queue_mean_s=None,
                         requests=60, streams=60))
    split = d.first_token
    assert split.mean_ms is not None and split.prefill_ms is not None
    assert split.rest_ms is not None and split.rest_ms >= 0
    assert 0 <= split.prefill_ms <= split.mean_ms
    assert d.fit_model == "quadratic" and d.fixed_ms == pytest.approx(50.0)
    assert d.line_fixed_ms is not None and d.line_fixed_ms < 0
    assert "faster than linearly" in d.fit_note and "quadratic fit" in d.fit_note
    # the quadratic explains the mean exactly: nothing capped, the rest is its fixed part
    assert not split.capped and split.rest_ms == pytest.approx(50.0)
    assert split.prefill_ms == pytest.approx(split.mean_ms - 50.0)
    assert by_name(d)["fixed"].saves_ms is not None and by_name(d)["fixed"].saves_ms >= 0


def test_the_split_is_capped_at_the_whole_when_the_fit_predicts_more() -> None:
    """All streams' mean first token below what the fitted streams predict: prefill and
    missed cache are scaled down together to what the queues leave, and it says so."""
    d = diagnose(example(ttft_mean_s=0.9, missed_cache_tokens=2000.0))
    split = d.first_token
    assert split.capped
    assert split.prefill_ms is not None and split.missed_cache_ms is not None
    assert split.rest_ms == pytest.approx(0, abs=1e-9)
    assert split.prefill_ms + split.missed_cache_ms == pytest.approx(900 - 400)


def test_the_engines_own_prefill_time_is_the_prefill_part() -> None:
    d = diagnose(example(engine_prefill_mean_s=1.0, engine_prefill_requests=200,
                         missed_cache_tokens=910.0))
    split = d.first_token
    assert split.prefill_from == "engine" and not split.capped
    assert split.missed_cache_ms == pytest.approx(100.0)  # 910 of 9,100 tokens: a tenth
    assert split.prefill_ms == pytest.approx(900.0)
    assert split.rest_ms == pytest.approx(1800 - 400 - 1000)
    lever = by_name(d)["prefill"]
    assert lever.saves_ms == pytest.approx(900.0)
    assert lever.sentence.startswith(  # what the engine reported, then the part
        "Prefill: the upstream's engine reports 1.0 s of prefill of the 1.8 s first token, "
        "900 ms of it besides the cache's misses (its own timings, 200 requests).")
    alone = by_name(diagnose(example(engine_prefill_mean_s=1.0, engine_prefill_requests=200)))
    assert alone["prefill"].sentence.startswith(
        "Prefill: the upstream's engine reports 1.0 s of prefill of the 1.8 s first token "
        "(its own timings, 200 requests).")
    capped = by_name(diagnose(example(engine_prefill_mean_s=2.0, engine_prefill_requests=200)))
    assert capped["prefill"].sentence.startswith(
        "Prefill: the upstream's engine reports 2.0 s of prefill of the 1.8 s first token, "
        "1.4 s of it within the first token")


def test_a_missing_fit_says_why() -> None:
    none = diagnose(example(fit=fit(FitSums()), fit_skipped=40, streams=40))
    assert none.fit_note.startswith("Prefill cost not known: none of the 40 streams")
    few = diagnose(example(fit=line_fit(5), fit_estimated=5))
    assert "5 streamed requests fitted, 20 needed" in few.fit_note
    assert "the proxy's own estimate" in few.fit_note
    assert few.tokens_estimated_share == 1.0
