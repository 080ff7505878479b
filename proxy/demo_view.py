"""The demo's terminal view: what the proxy measured between two ``/metrics`` snapshots,
as a full-screen table (a TTY) or one line per refresh (logs, CI).

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.bench.promscrape import Snapshot

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@dataclass(frozen=True, slots=True)
class Window:
    """Proxy figures between two scrapes."""

    seconds: float
    ttft: Any
    itl: Any
    tpot: Any
    queue: Any
    upstream_queue: Any
    duration: Any
    requests: float
    prompt_tokens: float
    cached_tokens: float
    completion_tokens: float
    outcomes: dict[str, float]


def window(before: Snapshot, after: Snapshot, seconds: float) -> Window:
    from proxy.bench import promscrape as p

    def h(name: str) -> Any:
        return p.histogram(after, name) - p.histogram(before, name)

    outcomes_before = p.by_label(before, p.OUTCOMES, "outcome")
    outcomes = {
        k: v - outcomes_before.get(k, 0.0)
        for k, v in p.by_label(after, p.OUTCOMES, "outcome").items()
    }
    return Window(
        seconds=seconds,
        ttft=h(p.TTFT),
        itl=h(p.ITL),
        tpot=h(p.TPOT),
        queue=h(p.QUEUE),
        upstream_queue=h(p.UPSTREAM_QUEUE),
        duration=h(p.DURATION),
        requests=p.total(after, p.REQUESTS) - p.total(before, p.REQUESTS),
        prompt_tokens=h(p.PROMPT_TOKENS).sum,
        cached_tokens=h(p.CACHED_TOKENS).sum,
        completion_tokens=h(p.COMPLETION_TOKENS).sum,
        outcomes={k: v for k, v in outcomes.items() if v},
    )


@dataclass(frozen=True, slots=True)
class RouteFigures:
    """One route's proxy figures between two scrapes."""

    route: str
    requests: float
    ttft: Any
    first_answer: Any | None  # None: the proxy does not export it
    itl: Any
    not_completed: float | None  # None: no stream outcomes recorded for the route


def by_route(
    before: Snapshot, after: Snapshot, routes: Sequence[str] = ROUTES, label: str = "route"
) -> list[RouteFigures]:
    """Figures per value of ``label`` (``route`` by default, or ``upstream``)."""
    from proxy.bench import promscrape as p

    has_first_answer = p.histogram(after, p.FIRST_ANSWER).count > 0
    out = []
    for route in routes:
        where = p.label_filter(**{label: route})

        def h(name: str, where: p.LabelFilter = where) -> Any:
            return p.histogram(after, name, where) - p.histogram(before, name, where)

        outcomes_before = p.by_label(before, p.OUTCOMES, "outcome", where)
        outcomes = {
            k: v - outcomes_before.get(k, 0.0)
            for k, v in p.by_label(after, p.OUTCOMES, "outcome", where).items()
        }
        out.append(
            RouteFigures(
                route=route,
                requests=p.total(after, p.REQUESTS, where) - p.total(before, p.REQUESTS, where),
                ttft=h(p.TTFT),
                first_answer=h(p.FIRST_ANSWER) if has_first_answer else None,
                itl=h(p.ITL),
                not_completed=(
                    sum(v for k, v in outcomes.items() if k != "completed") if outcomes else None
                ),
            )
        )
    return out


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.0f}"


def _row(hist: Any) -> list[str]:
    if not hist.count:
        return ["0", "-", "-", "-", "-"]
    return [
        f"{hist.count:.0f}",
        _ms(hist.quantile(0.5)),
        _ms(hist.quantile(0.9)),
        _ms(hist.quantile(0.99)),
        _ms(hist.mean),
    ]


def _ratio(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def _route_rows(
    routes: Sequence[RouteFigures], sent: Mapping[str, int], by: str = "route"
) -> list[list[str]]:
    rows = [
        [f"since start, by {by}", "sent", "n", "TTFT p50", "p90", "answer p50", "ITL p50", "not ok"]
    ]
    for r in routes:
        answer = "-" if r.first_answer is None else _ms(r.first_answer.quantile(0.5))
        rows.append(
            [
                r.route,
                str(sent.get(r.route, 0)),
                f"{r.requests:.0f}",
                _ms(r.ttft.quantile(0.5)),
                _ms(r.ttft.quantile(0.9)),
                answer,
                _ms(r.itl.quantile(0.5)),
                "-" if r.not_completed is None else f"{r.not_completed:.0f}",
            ]
        )
    return rows


def render(
    header: list[str],
    recent: Window,
    total: Window,
    in_flight: float,
    routes: Sequence[RouteFigures] = (),
    sent: Mapping[str, int] | None = None,
    upstreams: Sequence[RouteFigures] = (),
) -> list[str]:
    """The full-screen view as lines. ``sent`` counts the requests the demo sent per
    route and per upstream (client side), so a route the proxy does not measure still
    shows its traffic."""
    rows = [
        ["", "n", "p50", "p90", "p99", "mean", "n", "p50", "p90", "p99", "mean"],
    ]
    for label, attr in (
        ("TTFT ms", "ttft"),
        ("ITL ms", "itl"),
        ("TPOT ms", "tpot"),
        ("queue ms (upstream)", "upstream_queue"),
        ("request ms", "duration"),
    ):
        rows.append([label, *_row(getattr(recent, attr)), *_row(getattr(total, attr))])
    from proxy.bench.stats import align_columns, column_widths

    widths = column_widths(rows)
    table = align_columns(rows)
    left = sum(widths[:6]) + 2 * 5
    title = (
        f"{'':{widths[0]}}  {f'last {recent.seconds:.0f} s':^{left - widths[0] - 2}}  since start"
    )
    lines = [*header, "", title, *table, ""]
    for label, w in (("last", recent), ("total", total)):
        secs = max(w.seconds, 1e-9)
        outcomes = ", ".join(f"{k} {v:.0f}" for k, v in sorted(w.outcomes.items())) or "-"
        lines.append(
            f"{label:5} {w.requests:6.0f} {'request ' if w.requests == 1 else 'requests'} "
            f"({w.requests / secs:5.1f}/s)  "
            f"tokens: prompt {w.prompt_tokens:.0f} (cache hits {_ratio(w.cached_tokens, w.prompt_tokens)}), "
            f"completion {w.completion_tokens:.0f} ({w.completion_tokens / secs:.0f} tok/s)"
        )
        lines.append(f"      outcomes: {outcomes}")
    lines.append(f"in flight now: {in_flight:.0f}")
    if routes:
        lines += ["", *align_columns(_route_rows(routes, sent or {}))]
    if upstreams:
        lines += ["", *align_columns(_route_rows(upstreams, sent or {}, "upstream"))]
    return lines


def one_line(
    elapsed: float, recent: Window, total: Window, routes: Sequence[RouteFigures] = ()
) -> str:
    """The non-TTY view: one line per refresh, for logs and CI. Per route (since start):
    the proxy's request count and TTFT p50, as ``responses=12/140ms``."""
    outcomes = " ".join(f"{k}={v:.0f}" for k, v in sorted(total.outcomes.items()))

    def p50(hist: Any) -> str:
        value = _ms(hist.quantile(0.5))
        return value if value == "-" else value + "ms"

    per_route = "".join(
        f" {r.route.removeprefix('/v1/').replace('chat/completions', 'chat')}="
        f"{r.requests:.0f}/{p50(r.ttft)}"
        for r in routes
    )
    return (
        f"demo t={elapsed:.0f}s requests={total.requests:.0f} "
        f"ttft_p50={_ms(recent.ttft.quantile(0.5))}ms ttft_p99={_ms(recent.ttft.quantile(0.99))}ms "
        f"itl_p50={_ms(recent.itl.quantile(0.5))}ms itl_p99={_ms(recent.itl.quantile(0.99))}ms "
        f"upstream_queue_p90={_ms(recent.upstream_queue.quantile(0.9))}ms "
        f"cache_hits={_ratio(total.cached_tokens, total.prompt_tokens)} {outcomes}{per_route}"
    )
