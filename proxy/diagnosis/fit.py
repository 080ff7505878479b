"""The prefill fit: first-token time against uncached prompt tokens, from sums that add.

Design: ``docs/design/diagnosis.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass
from fractions import Fraction
from typing import Literal

from proxy.diagnosis import wording as say

KTOKENS = 1000.0  # x is uncached prompt tokens / KTOKENS
MIN_RELATIVE_SPREAD = 1e-4  # (n*Sxx - Sx^2) / (n*Sxx) below this: no slope
# The slope's standard error over the slope at most this: the slope is known (the levers
# print it; a line below zero at no tokens is then held at zero, see the docstring).
KNOWN_SLOPE_RELATIVE_STDERR = 0.25
# The quadratic (docs/design/diagnosis.md, "Which model"): tried from this many requests,
# with prompt lengths spread at least this much (the relative spread above: a coefficient
# of variation of about a tenth) and squares not almost a line in the lengths (one minus
# their squared correlation: three or more distinct lengths, spread out) ...
MIN_QUADRATIC_REQUESTS = 10
MIN_QUADRATIC_SPREAD = 0.01
MIN_CURVE_SPREAD = 1e-4
# ... and taken when it leaves at most this share of the line's squared residuals, its
# x^2 term is above zero and known to within KNOWN_SLOPE_RELATIVE_STDERR, and what it
# explains beyond the line is more than float rounding (this share of Syy).
QUADRATIC_MAX_RESIDUAL_SHARE = 0.5
ROUNDING_SHARE = 1e-9

# The exported counters (proxy.metrics) as their samples are named, by field.
SAMPLES: Mapping[str, str] = {
    "llm_proxy_prefill_fit_requests_total": "n",
    "llm_proxy_prefill_fit_uncached_ktokens_total": "sx",
    "llm_proxy_prefill_fit_first_token_seconds_total": "sy",
    "llm_proxy_prefill_fit_xy_total": "sxy",
    "llm_proxy_prefill_fit_xx_total": "sxx",
    "llm_proxy_prefill_fit_yy_total": "syy",
    "llm_proxy_prefill_fit_xxx_total": "sxxx",
    "llm_proxy_prefill_fit_xxxx_total": "sxxxx",
    "llm_proxy_prefill_fit_xxy_total": "sxxy",
}
SKIPPED_SAMPLE = "llm_proxy_prefill_fit_skipped_total"

Status = Literal["fitted", "no_requests", "one_length"]
Model = Literal["line", "through_zero", "quadratic"]
# What the card says of each model, in a user's words.
MODEL_WORDS: Mapping[Model, str] = {
    "line": "prefill grows linearly with prompt length: straight-line fit",
    "through_zero": "prefill grows faster than linearly with prompt length, but a curve "
                    "does not fit clearly better: line held at a zero fixed part",
    "quadratic": "prefill grows faster than linearly with prompt length (attention): "
                 "quadratic fit",
}


@dataclass(frozen=True, slots=True)
class FitSums:
    """The sufficient statistics: x in thousands of uncached prompt tokens, y in seconds.
    ``sxxx``, ``sxxxx`` and ``sxxy`` are for the quadratic (0 from a proxy without them:
    then no quadratic is tried)."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sxxx: float = 0.0
    sxxxx: float = 0.0
    sxxy: float = 0.0

    @classmethod
    def of(cls, points: Iterable[tuple[float, float]]) -> FitSums:
        """The sums of ``(uncached prompt tokens, first-token seconds)`` pairs."""
        out = cls()
        for tokens, y in points:
            x = tokens / KTOKENS
            xx = x * x  # the same products, in the same order, as proxy.metrics adds
            out = out.plus(FitSums(1, x, y, x * y, xx, y * y, xx * x, xx * xx, xx * y))
        return out

    def plus(self, other: FitSums) -> FitSums:
        return FitSums(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @classmethod
    def from_samples(cls, samples: Iterable[tuple[str, float]]) -> FitSums:
        """Sum ``(sample name, value)`` pairs of the exported counters (every label set
        given is added in: pass only the series of one selection)."""
        totals = dict.fromkeys(SAMPLES.values(), 0.0)
        for name, value in samples:
            field = SAMPLES.get(name)
            if field is not None:
                totals[field] += value
        return cls(**totals)


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """The fitted model, in milliseconds; None where the sums cannot say.

    ``terms_ms``: the model's ``(a, b, c)``, first-token ms = a + b*x + c*x^2 with x in
    thousands of uncached prompt tokens (c = 0 for a line); ``fixed_ms`` is a, the
    first-token time of a prompt with nothing to compute; ``held``: the terms held at 0
    so that no part is below zero. ``ms_per_1k_tokens``: prefill milliseconds per 1,000
    uncached prompt tokens, for a quadratic their mean over the fitted requests' tokens;
    ``stderr_ms_per_1k_tokens`` its standard error (three requests or more);
    ``mean_prefill_ms``: the fitted prefill (b*x + c*x^2) of the mean fitted request;
    the means are of the fitted requests. ``model``: docs/design/diagnosis.md;
    ``line_ms_per_1k_tokens`` and ``line_fixed_ms``: the straight line's own figures.
    """

    requests: int
    status: Status
    ms_per_1k_tokens: float | None = None
    fixed_ms: float | None = None
    stderr_ms_per_1k_tokens: float | None = None
    mean_uncached_tokens: float | None = None
    mean_first_token_ms: float | None = None
    model: Model = "line"
    line_ms_per_1k_tokens: float | None = None
    line_fixed_ms: float | None = None
    terms_ms: tuple[float, float, float] | None = None
    mean_prefill_ms: float | None = None
    held: tuple[str, ...] = ()

    def prefill_ms(self, uncached_tokens: float) -> float | None:
        """What computing one prompt of ``uncached_tokens`` costs by the model (by the
        slope alone for a fit given only ``ms_per_1k_tokens``)."""
        if self.terms_ms is None:
            return self.rate_ms(uncached_tokens)
        x = uncached_tokens / KTOKENS
        return self.terms_ms[1] * x + self.terms_ms[2] * x * x

    def rate_ms(self, tokens: float) -> float | None:
        """``tokens`` at ``ms_per_1k_tokens``: linear in tokens, for a sum over requests
        or a part of a prompt (a quadratic's cost of a part depends on the rest)."""
        if self.ms_per_1k_tokens is None:
            return None
        return self.ms_per_1k_tokens * tokens / KTOKENS

    @property
    def relative_stderr(self) -> float | None:
        """Standard error over the slope (inf for a zero slope); None when unknown."""
        if self.stderr_ms_per_1k_tokens is None or self.ms_per_1k_tokens is None:
            return None
        if self.ms_per_1k_tokens == 0:
            return math.inf
        return self.stderr_ms_per_1k_tokens / abs(self.ms_per_1k_tokens)

    def summary(self) -> str:
        """The card's line of figures (a fitted model)."""
        if self.terms_ms is None:
            return ""
        a, b, c = self.terms_ms
        fixed = "0 ms" if a == 0 else say.dur(a)
        if self.model != "quadratic":
            held = ", line held at a zero fixed part" if self.model == "through_zero" else ""
            return (f"prefill {_figure(b)} ms per 1,000 uncached prompt tokens, fixed part "
                    f"{fixed}{held}")
        held = "".join(f", {name} held at 0" for name in self.held)
        return (f"prefill {_figure(b)} ms per 1,000 uncached prompt tokens + {_figure(c)} ms "
                f"per (1,000 tokens)^2, {_figure(self.ms_per_1k_tokens)} ms per 1,000 on "
                f"average over these requests, fixed part {fixed}{held}")

    def model_note(self) -> str:
        """One sentence on which model was fitted and why."""
        words = MODEL_WORDS[self.model]
        if self.model == "through_zero":
            return (f"{words[0].upper()}{words[1:]}: the straight line through the requests has "
                    f"a fixed part of {say.dur(self.line_fixed_ms)} (below zero).")
        if self.model == "quadratic":
            return (f"{words[0].upper()}{words[1:]}, which explains the first-token times "
                    "clearly better than a straight line.")
        return f"{words[0].upper()}{words[1:]} over the requests' prompt lengths."


def _figure(value: float | None) -> str:
    """As the card prints its numbers: 130.4, 0.5, 6,902."""
    if value is None:
        return "unknown"
    return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def fit(sums: FitSums) -> PrefillFit:
    """The model the data support (docs/design/diagnosis.md, "Which model"): the
    quadratic where it explains clearly more, else the line, held through zero when its
    fixed part is below zero and its slope known. The line's formulas are the recording
    rules'."""
    line = _line(sums)
    if line.status != "fitted":
        return line
    return _quadratic(sums, line) or line


def _line(sums: FitSums) -> PrefillFit:
    """Least squares of y on x from the sums, with the spread guard."""
    n = sums.n
    if n <= 0 or not math.isfinite(n):
        return PrefillFit(requests=0, status="no_requests")
    requests = round(n)
    mean_tokens = sums.sx / n * KTOKENS
    mean_ms = sums.sy / n * 1000.0
    spread = n * sums.sxx - sums.sx * sums.sx
    if not spread > MIN_RELATIVE_SPREAD * n * sums.sxx:
        return PrefillFit(requests=requests, status="one_length",
                          mean_uncached_tokens=mean_tokens, mean_first_token_ms=mean_ms)
    covariance = n * sums.sxy - sums.sx * sums.sy
    slope = covariance / spread  # seconds per 1,000 tokens
    fixed = (sums.sy * sums.sxx - sums.sx * sums.sxy) / spread  # seconds: (Sy - slope*Sx) / n
    stderr = None
    if n > 2:
        # residual sum of squares times n; rounding can take an exact line below zero
        residual = max(0.0, n * sums.syy - sums.sy * sums.sy - slope * covariance)
        stderr = math.sqrt(residual / ((n - 2) * spread)) * 1000.0
    model: Model = "line"
    line_slope, line_fixed = slope, fixed
    if (fixed < 0 and slope > 0 and stderr is not None
            and stderr <= KNOWN_SLOPE_RELATIVE_STDERR * slope * 1000.0):
        # a slope known well and a fixed part below zero: prefill grows faster than
        # linearly (a noisy line that merely crosses zero stays a line, and unclear)
        model, slope, fixed = "through_zero", sums.sxy / sums.sxx, 0.0
        # its standard error: the larger of the line's and its own (residuals about it,
        # n - 1 degrees of freedom): holding the fixed part makes the slope look surer
        residual = max(0.0, sums.syy - slope * sums.sxy)
        stderr = max(stderr, math.sqrt(residual / ((n - 1) * sums.sxx)) * 1000.0)
    return PrefillFit(requests=requests, status="fitted", ms_per_1k_tokens=slope * 1000.0,
                      fixed_ms=fixed * 1000.0, stderr_ms_per_1k_tokens=stderr,
                      mean_uncached_tokens=mean_tokens, mean_first_token_ms=mean_ms,
                      model=model, line_ms_per_1k_tokens=line_slope * 1000.0,
                      line_fixed_ms=line_fixed * 1000.0,
                      terms_ms=(fixed * 1000.0, slope * 1000.0, 0.0),
                      mean_prefill_ms=slope * sums.sx / n * 1000.0)


_HELD = ("fixed part", "linear term")  # what holding x^0, x^1 at 0 is called


def _quadratic(sums: FitSums, line: PrefillFit) -> PrefillFit | None:
    """The quadratic least squares with no term below zero (the fixed part or the linear
    term held at 0 where the free optimum has it below: the constrained optimum of the
    same sums), if it explains clearly more than the line; else None."""
    n = sums.n
    if (n < MIN_QUADRATIC_REQUESTS or sums.sxxxx <= 0
            or not all(math.isfinite(v) for v in astuple(sums))):
        return None
    if not _may_explain_more(sums):
        return None
    q = [Fraction(v) for v in astuple(sums)]
    fn, sx, sxx, sxxx, sxxxx = q[0], q[1], q[4], q[6], q[7]
    var_x, var_z = fn * sxx - sx * sx, fn * sxxxx - sxx * sxx
    if var_x < MIN_QUADRATIC_SPREAD * fn * sxx or var_z <= 0:
        return None
    covariance = fn * sxxx - sx * sxx
    if 1 - covariance * covariance / (var_x * var_z) < MIN_CURVE_SPREAD:
        return None  # x^2 almost a line in x: two lengths, or too close together
    straight = _least_squares(q, (0, 1))
    if straight is None:
        return None
    best = None
    for powers in ((0, 1, 2), (1, 2), (0, 2), (2,)):  # free; a at 0; b at 0; both at 0
        found = _least_squares(q, powers)
        if found is not None and all(c >= 0 for c in found[0]) and found[0][-1] > 0 and (
                best is None or found[1] < best[1][1]):
            best = (powers, found)
            if len(powers) == 3:
                break  # the free optimum has no term below zero: no face does better
    if best is None:
        return None
    powers, (coefs, residual, inverse) = best
    line_residual = straight[1]
    dof = fn - len(powers)
    variance = max(residual, Fraction(0)) / dof  # of one first-token time about the curve
    c_variance = variance * inverse[-1][-1]
    if not (residual <= Fraction(QUADRATIC_MAX_RESIDUAL_SHARE) * line_residual
            and line_residual - residual > Fraction(ROUNDING_SHARE) * q[5]
            and c_variance <= (Fraction(KNOWN_SLOPE_RELATIVE_STDERR) * coefs[-1]) ** 2):
        return None
    terms = dict(zip(powers, coefs, strict=True))
    a, b, c = (float(terms.get(p, 0)) for p in (0, 1, 2))
    # the mean prefill per 1,000 tokens: b + c * Sxx / Sx, and its standard error
    weight = [{0: Fraction(0), 1: Fraction(1), 2: sxx / sx}[p] for p in powers]
    rate_variance = variance * sum(wi * inverse[i][j] * wj for i, wi in enumerate(weight)
                                   for j, wj in enumerate(weight))
    rate = b + c * float(sxx / sx)
    return PrefillFit(
        requests=line.requests, status="fitted", ms_per_1k_tokens=rate * 1000.0,
        fixed_ms=a * 1000.0, stderr_ms_per_1k_tokens=math.sqrt(rate_variance) * 1000.0,
        mean_uncached_tokens=line.mean_uncached_tokens,
        mean_first_token_ms=line.mean_first_token_ms, model="quadratic",
        line_ms_per_1k_tokens=line.line_ms_per_1k_tokens, line_fixed_ms=line.line_fixed_ms,
        terms_ms=(a * 1000.0, b * 1000.0, c * 1000.0),
        mean_prefill_ms=(b * sums.sx + c * sums.sxx) / n * 1000.0,
        held=tuple(_HELD[p] for p in (0, 1) if p not in powers))


def _may_explain_more(sums: FitSums) -> bool:
    """In floats, about the mean: whether the free quadratic could leave at most
    QUADRATIC_MAX_RESIDUAL_SHARE of the line's residuals (with room for rounding). A
    quadratic with a term held at 0 leaves more, so where this says no, none can: most
    engines are lines, and this spares them the exact solves."""
    n, m = sums.n, sums.sx / sums.n
    d2 = sums.sxx - sums.sx * m  # sums of d^k, d = x - m
    d3 = sums.sxxx - 3 * m * sums.sxx + 3 * m * m * sums.sx - n * m**3
    d4 = (sums.sxxxx - 4 * m * sums.sxxx + 6 * m * m * sums.sxx - 4 * m**3 * sums.sx
          + n * m**4)
    dy, ddy = sums.sxy - m * sums.sy, sums.sxxy - 2 * m * sums.sxy + m * m * sums.sy
    w, q = ddy - sums.sy * d2 / n, d4 - d2 * d2 / n
    det = d2 * q - d3 * d3
    if not (d2 > 0 and det > 0):
        return True  # let the exact guards say
    line_residual = sums.syy - sums.sy * sums.sy / n - dy * dy / d2
    gain = (d2 * w - d3 * dy) ** 2 / (d2 * det)  # what the x^2 term takes off it
    return gain >= 0.5 * (1 - QUADRATIC_MAX_RESIDUAL_SHARE) * line_residual


def _least_squares(q: Sequence[Fraction], powers: Sequence[int]
                   ) -> tuple[list[Fraction], Fraction, list[list[Fraction]]] | None:
    """Least squares of y on ``x**p`` for p in ``powers``, exactly from the sums ``q``
    (:class:`FitSums`' fields): the coefficients, the residual sum of squares and the
    inverse of the normal matrix; None if it is singular."""
    moments = (q[0], q[1], q[4], q[6], q[7])  # sums of x^0 .. x^4
    with_y = (q[2], q[3], q[8])  # sums of y, x*y, x^2*y
    k = len(powers)
    rows = [[moments[p + r] for r in powers] + [Fraction(int(i == j)) for j in range(k)]
            for i, p in enumerate(powers)]
    for col in range(k):  # Gauss-Jordan, exact
        pivot = next((r for r in range(col, k) if rows[r][col] != 0), None)
        if pivot is None:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        head = rows[col][col]
        rows[col] = [v / head for v in rows[col]]
        for r in range(k):
            if r != col and rows[r][col] != 0:
                factor = rows[r][col]
                rows[r] = [v - factor * w for v, w in zip(rows[r], rows[col], strict=True)]
    inverse = [row[k:] for row in rows]
    v = [with_y[p] for p in powers]
    coefs = [sum((inverse[i][j] * v[j] for j in range(k)), Fraction(0)) for i in range(k)]
    residual = q[5] - sum((c * vi for c, vi in zip(coefs, v, strict=True)), Fraction(0))
    return coefs, residual, inverse
