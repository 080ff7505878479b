"""The prefill fit from sums (proxy/diagnosis/fit.py), against exact arithmetic.

The reference is the least-squares line computed in rational numbers
(:class:`fractions.Fraction`) from the points themselves, so a formula slip, a unit
slip (thousands of tokens, milliseconds) or a window taken the wrong way shows as a
difference, not as two float errors agreeing.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from proxy import evidence as ev
from proxy.diagnosis.fit import (
    KTOKENS,
    MIN_QUADRATIC_REQUESTS,
    MIN_RELATIVE_SPREAD,
    SAMPLES,
    FitSums,
    PrefillFit,
    fit,
)

Point = tuple[float, float]
PROMTOOL_CASE = Path(__file__).resolve().parent.parent / "prometheus" / "tests" / "prefill_fit_test.yml"


def exact_line(points: list[Point]) -> tuple[Fraction, Fraction, Fraction]:
    """(slope in ms per 1,000 tokens, fixed ms, slope standard error squared), exactly."""
    xs = [Fraction(t) / 1000 for t, _ in points]
    ys = [Fraction(y) for _, y in points]
    n = len(points)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    fixed = my - slope * mx
    sse = sum((y - fixed - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    var = sse / (n - 2) / sxx * 10**6
    return slope * 1000, fixed * 1000, var


def noisy_points(rng: random.Random, n: int, *, rate_ms: float = 0.05,
                 fixed_s: float = 0.03) -> list[Point]:
    out = []
    for _ in range(n):
        tokens = rng.randrange(10, 20_000)
        out.append((float(tokens), fixed_s + rate_ms / 1000 * tokens + rng.gauss(0, 0.01)))
    return out


def test_fit_matches_exact_least_squares() -> None:
    points = noisy_points(random.Random(5), 500)
    got = fit(FitSums.of(points))
    slope, fixed, var = exact_line(points)
    assert got.status == "fitted" and got.requests == 500
    assert got.ms_per_1k_tokens == pytest.approx(float(slope), rel=1e-12)
    assert got.fixed_ms == pytest.approx(float(fixed), rel=1e-10)
    assert got.stderr_ms_per_1k_tokens == pytest.approx(math.sqrt(float(var)), rel=1e-8)
    assert got.mean_uncached_tokens == pytest.approx(sum(t for t, _ in points) / 500)
    assert got.mean_first_token_ms == pytest.approx(sum(y for _, y in points) / 500 * 1000)
    # the data's own line: 50 ms per 1,000 tokens, 30 ms fixed
    assert got.ms_per_1k_tokens == pytest.approx(50, rel=0.01)
    assert got.fixed_ms == pytest.approx(30, abs=2)
    assert got.prefill_ms(2000) == pytest.approx(2 * got.ms_per_1k_tokens)


@given(st.lists(st.tuples(st.integers(0, 200_000), st.floats(0.0, 120.0)),
                min_size=3, max_size=40))
def test_any_points_fit_as_exact_arithmetic_says(points: list[tuple[int, float]]) -> None:
    pts = [(float(t), y) for t, y in points]
    got = fit(FitSums.of(pts))
    if got.status != "fitted":
        assert got.status == "one_length"
        # the guard refuses only what it says: a relative spread at or below 1e-4
        xs = [Fraction(t) for t, _ in points]
        n = len(xs)
        sxx = sum(x * x for x in xs)
        assert sxx == 0 or (n * sxx - sum(xs) ** 2) / (n * sxx) <= MIN_RELATIVE_SPREAD * 1.001
        return
    slope, fixed, _ = exact_line(pts)
    scale = max(1.0, max(y for _, y in pts) * 1000)  # ms: the y the fit works in
    assert got.line_ms_per_1k_tokens is not None and got.line_fixed_ms is not None
    assert abs(got.line_ms_per_1k_tokens - float(slope)) <= 1e-6 * scale
    assert abs(got.line_fixed_ms - float(fixed)) <= 1e-6 * scale
    if got.model == "line":
        assert (got.ms_per_1k_tokens, got.fixed_ms) == (got.line_ms_per_1k_tokens,
                                                       got.line_fixed_ms)
    elif got.model == "through_zero":  # the line's fixed part below zero, its slope known
        assert got.fixed_ms == 0 and got.line_fixed_ms < 0
    else:  # no term below zero: no part of any first token below zero or above it
        assert got.terms_ms is not None and min(got.terms_ms) >= 0 and got.terms_ms[2] > 0


def windowed(after: FitSums, before: FitSums) -> PrefillFit:
    """The fit of the window between two readings of the counters holding these sums,
    as diagnose takes it (proxy.evidence)."""

    def reading(sums: FitSums) -> ev.Reading:
        key = (("route", "r"), ("model", "m"), ("upstream", "u"))
        return ev.read_snapshot({(name, key): getattr(sums, f) for name, f in SAMPLES.items()})

    (found,) = ev.evidence(reading(after), reading(before))
    return found.fit


def test_sums_add_across_replicas_and_subtract_to_a_window() -> None:
    rng = random.Random(7)
    a, b, c = noisy_points(rng, 200), noisy_points(rng, 300), noisy_points(rng, 100)
    union = fit(FitSums.of(a + b))
    summed = fit(FitSums.of(a).plus(FitSums.of(b)))
    assert summed.requests == 500
    assert summed.ms_per_1k_tokens == pytest.approx(union.ms_per_1k_tokens, rel=1e-12)
    assert summed.fixed_ms == pytest.approx(union.fixed_ms, rel=1e-10)
    # cumulative readings before and after c: the window is c alone
    before = FitSums.of(a)
    after = before.plus(FitSums.of(c))
    window = windowed(after, before)
    alone = fit(FitSums.of(c))
    assert window.requests == 100
    assert window.ms_per_1k_tokens == pytest.approx(alone.ms_per_1k_tokens, rel=1e-6)
    assert window.fixed_ms == pytest.approx(alone.fixed_ms, rel=1e-6)


def test_a_reset_counts_everything_since_it() -> None:
    before = FitSums.of(noisy_points(random.Random(1), 50))
    restarted = FitSums.of(noisy_points(random.Random(2), 10))
    assert windowed(restarted, before) == fit(restarted)


def test_no_requests_and_too_few() -> None:
    assert fit(FitSums()) == PrefillFit(requests=0, status="no_requests")
    one = fit(FitSums.of([(1000.0, 0.1)]))
    assert one.status == "one_length" and one.ms_per_1k_tokens is None
    assert one.mean_uncached_tokens == 1000 and one.mean_first_token_ms == pytest.approx(100)
    two = fit(FitSums.of([(1000.0, 0.1), (3000.0, 0.3)]))
    assert two.status == "fitted"
    assert two.ms_per_1k_tokens == pytest.approx(100) and two.fixed_ms == pytest.approx(0, abs=1e-9)
    assert two.stderr_ms_per_1k_tokens is None  # two points: no residual to judge by
    assert two.relative_stderr is None


def test_prompts_of_one_length_give_no_slope() -> None:
    """All one length: n*Sxx - Sx^2 is zero in exact arithmetic, but in floats it is
    rounding noise of either sign; the guard says "one length" instead of a slope."""
    rng = random.Random(3)
    points = [(123_457.0, 0.5 + rng.gauss(0, 0.05)) for _ in range(10_000)]
    sums = FitSums.of(points)
    assert sums.n * sums.sxx - sums.sx**2 != 0  # the noise the guard is for
    got = fit(sums)
    assert got.status == "one_length"
    assert got.ms_per_1k_tokens is None and got.fixed_ms is None
    assert got.mean_uncached_tokens == pytest.approx(123_457)


@pytest.mark.parametrize(("spread", "fitted"), [(0.005, False), (0.02, True)])
def test_the_guard_sits_at_a_relative_spread_of_1e_4(spread: float, fitted: bool) -> None:
    """Prompts of 100,000 tokens varying by +-0.5 % (g ~ 0.8e-5) get no slope; by +-2 %
    (g ~ 1.3e-4) they do, and on an exact line the slope is right to 1e-6."""
    mean = 100_000.0
    xs = [mean * (1 + spread * (2 * i / 999 - 1)) for i in range(1000)]
    points = [(x, 0.02 + 0.0001 * x) for x in xs]  # 100 ms per 1,000 tokens, 20 ms fixed
    sums = FitSums.of(points)
    g = (sums.n * sums.sxx - sums.sx**2) / (sums.n * sums.sxx)
    assert (g > MIN_RELATIVE_SPREAD) == fitted
    got = fit(sums)
    assert (got.status == "fitted") == fitted
    if fitted:
        assert got.ms_per_1k_tokens == pytest.approx(100, rel=1e-6)
        assert got.fixed_ms == pytest.approx(20, abs=0.01)


def test_from_samples_reads_the_exported_counter_names() -> None:
    sums = FitSums.of([(1000.0, 0.2), (3000.0, 0.4), (2000.0, 0.35)])
    samples = [(name, getattr(sums, field)) for name, field in SAMPLES.items()]
    samples.append(("llm_proxy_requests_total", 99.0))  # others are ignored
    assert FitSums.from_samples(samples) == sums
    twice = FitSums.from_samples(samples + samples)
    assert twice == sums.plus(sums)
    assert KTOKENS == 1000


def test_the_recording_rules_case_fits_the_same_in_python() -> None:
    """prometheus/tests/prefill_fit_test.yml feeds the recording rules two replicas'
    counters; the Python fit over the same per-minute sums (one replica's plus the
    other's) finds the line the rules are tested to record, and each replica alone
    finds its own, different one."""
    doc = yaml.safe_load(PROMTOOL_CASE.read_text())
    by_replica: dict[str, dict[str, float]] = {}
    for entry in doc["tests"][0]["input_series"]:
        name, labels = entry["series"].split("{", 1)
        if 'model="m"' not in labels:
            continue
        replica = re.search(r'instance="(\w+)"', labels)
        step = re.fullmatch(r"0\+([\d.]+)x\d+", entry["values"])
        assert replica and step, entry
        by_replica.setdefault(replica[1], {})[SAMPLES[name]] = float(step[1])
    a, b = (FitSums(**by_replica[r]) for r in ("a", "b"))
    union = fit(a.plus(b))
    assert (union.ms_per_1k_tokens, union.fixed_ms) == (62.5, 312.5)
    assert (fit(a).ms_per_1k_tokens, fit(a).fixed_ms) == (187.5, 187.5)
    assert (fit(b).ms_per_1k_tokens, fit(b).fixed_ms) == (31.25, 250.0)
    recorded = {case["expr"].split(":")[1]: case["exp_samples"][0]["value"]
                for case in doc["tests"][0]["promql_expr_test"] if ":fit5m" in case["expr"]}
    assert recorded == {"llm_proxy_prefill_seconds_per_ktoken": 0.0625,
                        "llm_proxy_first_token_fixed_seconds": 0.3125}


def superlinear_points(n: int = 60) -> list[tuple[float, float]]:
    """Prefill that grows faster than linearly (attention on a CPU engine): a 50 ms fixed
    part, then 4 s per 1,000 tokens plus 2 s per (1,000 tokens)^2, prompts of 200 to
    1,600 tokens."""
    out = []
    for i in range(n):
        k = 0.2 + 1.4 * i / (n - 1)
        out.append((k * 1000, 0.05 + 4.0 * k + 2.0 * k * k))
    return out


def test_a_line_below_zero_at_no_tokens_is_held_at_zero() -> None:
    """The straight line through superlinear prefill is right in slope but its fixed part
    is below zero. Without the quadratic's sums (a proxy from before them, a Prometheus
    without their rules) the fit says so and holds the fixed part at 0 (least squares
    with the intercept constrained, Sxy / Sxx), so no part of a first token is negative."""
    sums = dataclasses.replace(FitSums.of(superlinear_points()), sxxx=0, sxxxx=0, sxxy=0)
    got = fit(sums)
    assert got.model == "through_zero"
    assert got.line_fixed_ms is not None and got.line_fixed_ms < 0
    assert got.fixed_ms == 0.0
    assert got.ms_per_1k_tokens == pytest.approx(sums.sxy / sums.sxx * 1000)
    assert got.line_ms_per_1k_tokens is not None
    assert got.stderr_ms_per_1k_tokens is not None and got.relative_stderr is not None
    assert got.relative_stderr < 0.25


def test_a_noisy_line_that_crosses_zero_stays_a_line() -> None:
    rng = random.Random(3)
    points = [(1000.0 + 10 * i, 0.2 + rng.gauss(0, 0.3)) for i in range(40)]
    got = fit(FitSums.of(points))
    assert got.model == "line"
    assert got.fixed_ms == got.line_fixed_ms


# ---------------------------------------------------------------------------
# Which model: the quadratic where the data support it


def engine(a: float, b: float, c: float, n: int = 40) -> list[Point]:
    """First-token seconds a + b*x + c*x^2 at x = 0.5 .. 8 thousand uncached tokens."""
    xs = [0.5 + 7.5 * i / (n - 1) for i in range(n)]
    return [(x * 1000, a + b * x + c * x * x) for x in xs]


def test_a_quadratic_engine_is_fitted_as_one_and_its_terms_recovered() -> None:
    """y = 0.05 + 2.0 x + 0.8 x^2 (attention): the line through it has a fixed part far
    below zero (before, the fit held that line at zero: too high at short prompts, too
    low at long ones); the quadratic explains it exactly and is chosen."""
    points = engine(0.05, 2.0, 0.8)
    got = fit(FitSums.of(points))
    assert got.model == "quadratic" and got.held == ()
    assert got.terms_ms == pytest.approx((50.0, 2000.0, 800.0), rel=1e-9)
    assert got.fixed_ms == pytest.approx(50.0, rel=1e-9)
    assert got.line_fixed_ms is not None and got.line_fixed_ms < 0
    assert got.prefill_ms(4000) == pytest.approx(2000 * 4 + 800 * 16, rel=1e-9)
    mean_y_ms = sum(y for _, y in points) / len(points) * 1000
    assert got.mean_prefill_ms == pytest.approx(mean_y_ms - 50.0, rel=1e-9)
    # the mean cost per 1,000 tokens times the mean tokens is the mean prefill
    assert got.rate_ms(got.mean_uncached_tokens or 0) == pytest.approx(got.mean_prefill_ms)
    assert got.relative_stderr is not None and got.relative_stderr < 1e-6
    # no part below zero or above the whole, at any length the requests have
    for tokens, y in points:
        part = got.prefill_ms(tokens)
        assert part is not None and 0 <= part <= y * 1000 + 1e-6
    assert "quadratic fit" in got.summary() + got.model_note()
    assert "faster than linearly" in got.model_note()


def test_a_linear_engine_stays_a_line() -> None:
    got = fit(FitSums.of(engine(0.05, 2.0, 0.0)))
    assert got.model == "line"
    assert got.terms_ms == pytest.approx((50.0, 2000.0, 0.0), rel=1e-9)
    assert got.prefill_ms(4000) == pytest.approx(8000.0, rel=1e-9)
    assert "straight-line fit" in got.model_note()


@pytest.mark.parametrize("n", [MIN_QUADRATIC_REQUESTS, 20, 40, 400])
def test_noise_does_not_turn_a_line_into_a_quadratic(n: int) -> None:
    """A linear engine with noisy first tokens (a loaded machine): over 300 draws of n
    requests, the quadratic is never taken; the same noise on a quadratic engine
    still finds the quadratic (from 20 requests)."""
    flipped = []
    for seed in range(300):
        rng = random.Random(seed)
        points = [(t, y + rng.gauss(0, 0.3)) for t, y in engine(0.05, 2.0, 0.0, n)]
        if fit(FitSums.of(points)).model == "quadratic":
            flipped.append(seed)
    assert flipped == []
    if n >= 20:
        rng = random.Random(1)
        points = [(t, y + rng.gauss(0, 0.3)) for t, y in engine(0.05, 2.0, 0.8, n)]
        assert fit(FitSums.of(points)).model == "quadratic"


def test_a_term_below_zero_is_held_at_zero() -> None:
    """Free, the quadratic through y = 0.3 - 0.4 x + 1.0 x^2 has a linear term below zero
    (prefill below zero at short prompts); the fit holds it at 0, which is least squares
    of y on x^2 alone: the constrained optimum of the same sums."""
    points = [(x * 1000, 0.3 - 0.4 * x + 1.0 * x * x) for x in (0.1 + 0.1 * i for i in range(30))]
    got = fit(FitSums.of(points))
    assert got.model == "quadratic" and got.held == ("linear term",)
    zs = [Fraction(t) ** 2 / 10**6 for t, _ in points]
    ys = [Fraction(y) for _, y in points]
    mz, my = sum(zs) / len(zs), sum(ys) / len(ys)
    c = sum((z - mz) * (y - my) for z, y in zip(zs, ys, strict=True)) / sum((z - mz) ** 2 for z in zs)
    assert got.terms_ms == pytest.approx((float(my - c * mz) * 1000, 0.0, float(c) * 1000), rel=1e-9)
    assert "linear term held at 0" in got.summary()


def test_quadratic_sums_add_across_replicas() -> None:
    a, b = engine(0.05, 2.0, 0.8, 30), engine(0.05, 2.0, 0.8, 17)
    summed = fit(FitSums.of(a).plus(FitSums.of(b)))
    assert summed.model == "quadratic" and summed.requests == 47
    assert summed.terms_ms == pytest.approx((50.0, 2000.0, 800.0), rel=1e-9)
    window = windowed(FitSums.of(a).plus(FitSums.of(b)), FitSums.of(a))
    assert window.requests == 17 and window.terms_ms == pytest.approx((50.0, 2000.0, 800.0), rel=1e-6)
    # PromQL's increase() scales every sum of a series by one factor: the terms stay
    scaled = FitSums(*(v * 1.037 for v in dataclasses.astuple(FitSums.of(a))))
    assert fit(scaled).terms_ms == pytest.approx((50.0, 2000.0, 800.0), rel=1e-9)


def test_two_lengths_or_too_few_requests_give_no_quadratic() -> None:
    two = [(1000.0, 0.5), (4000.0, 9.0)] * 20  # any curve fits two lengths
    assert fit(FitSums.of(two)).model != "quadratic"
    few = engine(0.05, 2.0, 0.8, MIN_QUADRATIC_REQUESTS - 1)
    assert fit(FitSums.of(few)).model == "through_zero"
