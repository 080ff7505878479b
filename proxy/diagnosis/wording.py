"""Numbers as the diagnosis card and its JSON word them: rounding, durations, token
counts, shares. One wording for :mod:`proxy.diagnosis.levers`' sentences and figures.
"""

from __future__ import annotations

import math


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def rounded(value: float | int | None) -> float | int | None:
    if value is None or isinstance(value, int):
        return value
    if not math.isfinite(value):
        return None
    return float(f"{value:.4g}")


def sig(value: float | None) -> str:
    """Two significant figures: 0.13, 1.2, 24, 130."""
    if value is None:
        return "unknown"
    if value == 0:
        return "0"
    digits = max(0, 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{digits}f}"


def dur(ms: float | None) -> str:
    """A duration as the card words it: ``340 ms``, ``1.2 s``, ``18.7 s``, ``0.4 ms``."""
    if ms is None:
        return "unknown"
    if abs(ms) >= 1000:
        return f"{ms / 1000:,.1f} s"
    if abs(ms) >= 10:
        return f"{ms:.0f} ms"
    return f"{ms:.1f} ms"


def of_first(mean_ms: float | None) -> str:
    return f" of the {dur(mean_ms)} first token" if mean_ms is not None else " of the first token"


def tokens(value: float | None) -> str:
    return "unknown" if value is None else f"{rounded_tokens(value):,}"


def rounded_tokens(value: float) -> int:
    """A token figure as a sentence says it: 9,137 -> 9,100 (bucket estimates are no
    finer than that)."""
    whole = round(value)
    if whole >= 1000:
        scale = 10 ** (len(str(whole)) - 2)
        whole = round(whole / scale) * scale
    return whole


def rate(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def pct(share: float | None) -> str:
    return "unknown" if share is None else f"{share * 100:.0f} %"


def plural(n: int, word: str) -> str:
    return word if n == 1 else word + "s"
