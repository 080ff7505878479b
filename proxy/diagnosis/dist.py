"""One histogram of a selection, read as a distribution: its quantiles, the share at or
below a value, and what a cap would cut (:class:`Dist`), for :mod:`proxy.diagnosis.levers`.

Design: ``docs/design/diagnosis.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from proxy.buckets import fraction_at_most, histogram_quantile
from proxy.diagnosis import wording as say


@dataclass(frozen=True, slots=True)
class Dist:
    """One histogram of a selection: cumulative ``(le, count)`` pairs ending with
    ``+Inf``, and the sum of the observations."""

    buckets: tuple[tuple[float, float], ...]
    total: float

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        return say.finite(histogram_quantile(q, self.buckets)) if self.count > 0 else None

    def share_at_most(self, x: float) -> float | None:
        return say.finite(fraction_at_most(x, self.buckets)) if self.count > 0 else None

    def edge_at_or_above(self, x: float) -> float:
        """The bound of the bucket holding ``x``: the most a quantile interpolated at ``x``
        can truly be (``x`` itself in the last, unbounded bucket)."""
        return next((le for le, _ in sorted(self.buckets) if le >= x and not math.isinf(le)), x)

    def mean_excess(self, cap: float) -> float | None:
        """The mean of ``max(0, value - cap)``: the exact sum, less what the observations
        keep under ``cap``: those in buckets up to it, their bucket's middle; those in
        buckets above it, ``cap``; those in the bucket holding ``cap``, the least of
        ``cap`` and the mean the exact sum leaves that bucket (all at that mean: the least
        excess they can have, by convexity, so that answers all of one length high in
        their bucket are not taken as spread over it). Never more than the buckets allow
        (each observation above ``cap`` at most its bucket's bound above it), so that
        observations high in buckets below ``cap`` add none."""
        n = self.count
        if n <= 0:
            return None
        rows, lower, below = [], 0.0, 0.0
        for upper, cumulative in sorted(self.buckets):
            if cumulative > below:
                rows.append((lower, upper, cumulative - below))
            lower, below = upper, cumulative
        capped, most, others = 0.0, 0.0, 0.0
        holding: tuple[float, float, float] | None = None  # the bucket holding cap
        for lower, upper, k in rows:
            if upper > cap:
                most += k * (upper - cap)
            if upper <= cap:
                capped += k * (lower + upper) / 2
            elif lower >= cap or math.isinf(upper):
                capped += k * cap
            else:
                holding = (lower, upper, k)
                continue
            others += k * (lower if math.isinf(upper) else (lower + upper) / 2)
        if holding is not None:
            lower, upper, k = holding
            mean = min(max((self.total - others) / k, lower), upper)
            capped += k * min(mean, cap)
        return max(0.0, min(self.total - capped, most) / n)
