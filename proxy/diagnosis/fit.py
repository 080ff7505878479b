"""The prefill fit: first-token time against uncached prompt tokens, from sums that add.

Design: ``docs/design/diagnosis.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

KTOKENS = 1000.0  # x is uncached prompt tokens / KTOKENS
MIN_RELATIVE_SPREAD = 1e-4  # (n*Sxx - Sx^2) / (n*Sxx) below this: no slope
# The slope's standard error over the slope at most this: the slope is known (the levers
# print it; a line below zero at no tokens is then held at zero, see the docstring).
KNOWN_SLOPE_RELATIVE_STDERR = 0.25

# The exported counters (proxy.metrics) as their samples are named, by field.
SAMPLES: Mapping[str, str] = {
    "llm_proxy_prefill_fit_requests_total": "n",
    "llm_proxy_prefill_fit_uncached_ktokens_total": "sx",
    "llm_proxy_prefill_fit_first_token_seconds_total": "sy",
    "llm_proxy_prefill_fit_xy_total": "sxy",
    "llm_proxy_prefill_fit_xx_total": "sxx",
    "llm_proxy_prefill_fit_yy_total": "syy",
}
SKIPPED_SAMPLE = "llm_proxy_prefill_fit_skipped_total"

Status = Literal["fitted", "no_requests", "one_length"]
Model = Literal["line", "through_zero"]


@dataclass(frozen=True, slots=True)
class FitSums:
    """The sufficient statistics: x in thousands of uncached prompt tokens, y in seconds."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0

    @classmethod
    def of(cls, points: Iterable[tuple[float, float]]) -> FitSums:
        """The sums of ``(uncached prompt tokens, first-token seconds)`` pairs."""
        out = cls()
        for tokens, seconds in points:
            out = out.add(tokens, seconds)
        return out

    def add(self, uncached_tokens: float, first_token_s: float) -> FitSums:
        x = uncached_tokens / KTOKENS
        y = first_token_s
        return FitSums(self.n + 1, self.sx + x, self.sy + y, self.sxy + x * y,
                       self.sxx + x * x, self.syy + y * y)

    def plus(self, other: FitSums) -> FitSums:
        return FitSums(self.n + other.n, self.sx + other.sx, self.sy + other.sy,
                       self.sxy + other.sxy, self.sxx + other.sxx, self.syy + other.syy)

    def minus(self, before: FitSums) -> FitSums:
        """A window: these cumulative sums less earlier ones. Fewer requests now than
        before means the counters were reset (a restarted process or worker): the
        window is then everything since the reset, as PromQL's ``increase`` takes it."""
        if self.n < before.n:
            return self
        return FitSums(self.n - before.n, self.sx - before.sx, self.sy - before.sy,
                       self.sxy - before.sxy, self.sxx - before.sxx, self.syy - before.syy)

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
    """The fitted line, in milliseconds; None where the sums cannot say.

    ``ms_per_1k_tokens``: prefill milliseconds per 1,000 uncached prompt tokens;
    ``fixed_ms``: the first-token time of a prompt with nothing to compute;
    ``stderr_ms_per_1k_tokens``: the slope's standard error (three requests or more);
    the means are of the fitted requests. ``model``: which line (module docstring);
    ``line_ms_per_1k_tokens`` and ``line_fixed_ms``: the straight line's own figures,
    equal to the two above for ``"line"``.
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

    def prefill_ms(self, uncached_tokens: float) -> float | None:
        """What computing ``uncached_tokens`` costs by the slope."""
        if self.ms_per_1k_tokens is None:
            return None
        return self.ms_per_1k_tokens * uncached_tokens / KTOKENS

    @property
    def relative_stderr(self) -> float | None:
        """Standard error over the slope (inf for a zero slope); None when unknown."""
        if self.stderr_ms_per_1k_tokens is None or self.ms_per_1k_tokens is None:
            return None
        if self.ms_per_1k_tokens == 0:
            return math.inf
        return self.stderr_ms_per_1k_tokens / abs(self.ms_per_1k_tokens)


def fit(sums: FitSums) -> PrefillFit:
    """Least squares of y on x from the sums, with the spread guard of the module
    docstring: the same formulas as the recording rules."""
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
    if (fixed < 0 and slope > 0 and stderr is not None
            and stderr <= KNOWN_SLOPE_RELATIVE_STDERR * slope * 1000.0):
        # a slope known well and a fixed part below zero: prefill grows faster than
        # linearly (a noisy line that merely crosses zero stays a line, and unclear)
        return _through_zero(sums, requests, mean_tokens, mean_ms, slope, fixed, stderr)
    return PrefillFit(requests=requests, status="fitted", ms_per_1k_tokens=slope * 1000.0,
                      fixed_ms=fixed * 1000.0, stderr_ms_per_1k_tokens=stderr,
                      mean_uncached_tokens=mean_tokens, mean_first_token_ms=mean_ms,
                      line_ms_per_1k_tokens=slope * 1000.0, line_fixed_ms=fixed * 1000.0)


def _through_zero(sums: FitSums, requests: int, mean_tokens: float, mean_ms: float,
                  line_slope: float, line_fixed: float, line_stderr: float) -> PrefillFit:
    """The least-squares line with no fixed part: ``slope = Sxy / Sxx``. Its standard
    error is the larger of the straight line's and its own (residuals about it, n - 1
    degrees of freedom): holding the fixed part makes the slope look surer than the
    data say."""
    n = sums.n
    slope = sums.sxy / sums.sxx
    residual = max(0.0, sums.syy - slope * sums.sxy)
    stderr = max(line_stderr, math.sqrt(residual / ((n - 1) * sums.sxx)) * 1000.0)
    return PrefillFit(requests=requests, status="fitted", ms_per_1k_tokens=slope * 1000.0,
                      fixed_ms=0.0, stderr_ms_per_1k_tokens=stderr,
                      mean_uncached_tokens=mean_tokens, mean_first_token_ms=mean_ms,
                      model="through_zero", line_ms_per_1k_tokens=line_slope * 1000.0,
                      line_fixed_ms=line_fixed * 1000.0)
