"""Histogram buckets: quantiles from cumulative buckets, the way PromQL's
``histogram_quantile`` estimates them, and many observations written into a
prometheus_client histogram at once (:func:`observe_many`).

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter as _Counter
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the readers of buckets (diagnose, the live page) import no client library
    from prometheus_client import Histogram


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


def observe_many(child: Histogram, values: Sequence[float]) -> None:
    """Observe many values at once: one increment per bucket touched, one for the sum.

    Same result as ``observe`` per value (each value still lands in its own bucket), at
    a fraction of the cost: ``observe`` walks the bucket list in Python and takes a lock
    per call (for ITL, per token; for the doctor's findings, per request). Relies on
    prometheus_client's histogram child internals (``_upper_bounds``, ``_buckets``,
    ``_sum``, stable since 0.4); falls back to ``observe`` if they are not there.
    """
    if not values:
        return
    try:
        bounds: list[float] = child._upper_bounds
        buckets = child._buckets
        total = child._sum
    except AttributeError:  # pragma: no cover - a future prometheus_client
        for value in values:
            child.observe(value)
        return
    counts = _Counter(map(bisect_left, repeat(bounds, len(values)), values))  # no frame a value
    for index, count in counts.items():
        buckets[index].inc(count)
    total.inc(math.fsum(values))
