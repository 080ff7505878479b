"""Quantiles from cumulative histogram buckets, the way PromQL's ``histogram_quantile``
estimates them.

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """PromQL's ``histogram_quantile`` over cumulative ``(le, count)`` pairs."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][0] != math.inf:
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    observations = ordered[-1][1]
    if observations <= 0 or math.isnan(q):
        return math.nan
    rank = q * observations
    index = next(i for i, (_, count) in enumerate(ordered) if count >= rank)
    if index == len(ordered) - 1:
        return ordered[-2][0] if len(ordered) > 1 else math.nan
    upper, count = ordered[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, below = 0.0, 0.0
    else:
        lower, below = ordered[index - 1]
    in_bucket = count - below
    if in_bucket <= 0:
        return upper
    return lower + (upper - lower) * (rank - below) / in_bucket


def fraction_at_most(x: float, buckets: Iterable[tuple[float, float]]) -> float:
    """Share of observations at or below ``x``, interpolated within its bucket like
    :func:`histogram_quantile` (the inverse question); NaN without observations."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][0] != math.inf or ordered[-1][1] <= 0:
        return math.nan
    if x < 0:
        return 0.0
    total = ordered[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in ordered:
        if x < upper:
            if upper == math.inf:
                return below / total
            return (below + (count - below) * (x - lower) / (upper - lower)) / total
        lower, below = upper, count
    return 1.0
