"""Percentiles and the run summary: exact numbers from per-request records.

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .client import RequestResult

READING_PACE_TOK_S = 5.0
FAST_DECODE_TOK_S = 20.0


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of already sorted values, linear between closest ranks."""
    if not sorted_values:
        return math.nan
    if not 0.0 <= q <= 1.0:
        raise ValueError("q must be within [0, 1]")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


@dataclass(frozen=True, slots=True)
class Dist:
    """Count, mean and the usual percentiles of one quantity (NaN when empty)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Dist:
        data = sorted(values)
        if not data:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan)
        return cls(
            len(data),
            math.fsum(data) / len(data),
            quantile(data, 0.5),
            quantile(data, 0.9),
            quantile(data, 0.99),
            data[0],
            data[-1],
        )


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    completed: int
    errors: int
    error_kinds: dict[str, int]
    wall_s: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft: Dist
    itl: Dist
    tpot: Dist
    total: Dist
    rated_requests: int  # completed requests with a decode rate
    below_reading_pace_share: float  # decode rate < 5 tok/s
    above_20_tok_s_share: float
    tokens_from_usage: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    ttfb: Dist = field(default_factory=lambda: Dist.of(()))
    first_answer: Dist = field(default_factory=lambda: Dist.of(()))
    reasoned: int = 0  # completed requests whose first output was reasoning

    def as_json(self) -> dict[str, Any]:
        def clean(value: Any) -> Any:
            if isinstance(value, float) and not math.isfinite(value):
                return None
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            return value

        return {k: clean(v) for k, v in asdict(self).items()}


def summarize(results: Sequence[RequestResult], wall_s: float) -> Summary:
    done = [r for r in results if r.ok]
    kinds = Counter(r.outcome for r in results if not r.ok)
    tokens_from_usage = all(r.completion_tokens is not None for r in done)
    output_tokens = sum(
        r.completion_tokens if r.completion_tokens is not None else r.output_events for r in done
    )
    rates = [rate for r in done if (rate := r.decode_rate) is not None]
    rated = len(rates)
    per_s = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: math.nan)
    return Summary(
        requests=len(results),
        completed=len(done),
        errors=len(results) - len(done),
        error_kinds=dict(sorted(kinds.items())),
        wall_s=wall_s,
        requests_per_s=per_s(len(done)),
        output_tokens=output_tokens,
        output_tokens_per_s=per_s(output_tokens),
        ttft=Dist.of(r.ttft_s for r in done if r.ttft_s is not None),
        itl=Dist.of(gap for r in done for gap in r.itl_s),
        tpot=Dist.of(r.tpot_s for r in done if r.tpot_s is not None),
        total=Dist.of(r.total_s for r in done),
        rated_requests=rated,
        below_reading_pace_share=(sum(x < READING_PACE_TOK_S for x in rates) / rated)
        if rated
        else math.nan,
        above_20_tok_s_share=(sum(x > FAST_DECODE_TOK_S for x in rates) / rated)
        if rated
        else math.nan,
        tokens_from_usage=tokens_from_usage,
        ttfb=Dist.of(r.ttfb_s for r in done if r.ttfb_s is not None),
        first_answer=Dist.of(r.first_answer_s for r in done if r.first_answer_s is not None),
        reasoned=sum(
            1
            for r in done
            if r.first_answer_s is not None and r.ttft_s is not None and r.first_answer_s > r.ttft_s
        ),
    )


def ms(value: float | None) -> str:
    """Seconds as milliseconds; ``-`` for no value (None, NaN)."""
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.1f}"


def pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 100:.1f}%"


def column_widths(rows: Sequence[Sequence[str]]) -> list[int]:
    return [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]


def align_columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Text table lines: first column left-aligned, the others right-aligned."""
    widths = column_widths(rows)
    return [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]


def table_rows(summary: Summary) -> list[tuple[str, ...]]:
    """The distribution table's cells, header first: what :func:`format_table` prints and
    the HTML report shows (``--report``), so the two cannot disagree."""
    rows: list[tuple[str, ...]] = [("", "count", "mean ms", "p50 ms", "p90 ms", "p99 ms")]
    dists = [("TTFB", summary.ttfb), ("TTFT", summary.ttft)]
    if summary.reasoned:
        dists.append(("first answer", summary.first_answer))
    dists += [("ITL", summary.itl), ("TPOT", summary.tpot), ("total", summary.total)]
    for name, dist in dists:
        rows.append(
            (name, str(dist.count), ms(dist.mean), ms(dist.p50), ms(dist.p90), ms(dist.p99))
        )
    return rows


def summary_lines(summary: Summary) -> list[str]:
    """The lines under the table: requests and errors, throughput, decode rates."""
    errors = ", ".join(f"{k} {v}" for k, v in summary.error_kinds.items()) or "none"
    token_note = "" if summary.tokens_from_usage else " (some counts are output events: no usage)"
    return [
        f"requests   {summary.completed} completed of {summary.requests} in {summary.wall_s:.2f} s; errors: {summary.errors} ({errors})",
        f"throughput {summary.requests_per_s:.2f} req/s, {summary.output_tokens_per_s:.1f} output tok/s"
        f" ({summary.output_tokens} tokens){token_note}",
        f"decode     {pct(summary.below_reading_pace_share)} below reading pace (<{READING_PACE_TOK_S:g} tok/s), "
        f"{pct(summary.above_20_tok_s_share)} above {FAST_DECODE_TOK_S:g} tok/s "
        f"(of {summary.rated_requests} requests with 2+ tokens)",
    ]


def format_table(summary: Summary) -> str:
    """The human summary printed at the end of a run."""
    return "\n".join([*align_columns(table_rows(summary)), "", *summary_lines(summary)])


def summary_from_json(data: dict[str, Any]) -> Summary:
    """A :class:`Summary` back from :meth:`Summary.as_json` (``None`` was NaN)."""

    def number(value: Any) -> Any:
        return math.nan if value is None else value

    def dist(value: dict[str, Any]) -> Dist:
        return Dist(**{k: number(v) for k, v in value.items()})

    values = {k: number(v) for k, v in data.items()}
    for name in ("ttft", "itl", "tpot", "total", "ttfb", "first_answer"):
        if isinstance(data.get(name), dict):
            values[name] = dist(data[name])
    return Summary(**values)
