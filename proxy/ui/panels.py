"""The live page's panels: each a function of a :class:`View` (one answer's collections,
selection and span), listed in :data:`PANELS`. A panel is added as a function and a line
there, its section in ``static/ui.html`` and its drawing in ``static/ui.js``'s ``PANELS``.
What each figure means: docs/design/live-page.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol

from proxy import evidence as ev
from proxy.diagnosis import levers
from proxy.diagnosis.fit import MODEL_WORDS
from proxy.doctor.examine import REASONS
from proxy.doctor.report import explain_break
from proxy.evidence import COMPLETION, ITL, QUEUE, TPOT, TTFT, Key, stream_total
from proxy.measure import Outcome
from proxy.ui.breaks import BreakExample, RecentBreaks
from proxy.ui.collect import (
    CACHED,
    COARSE_S,
    CODES,
    FULL_WINDOW_S,
    OUTCOME_NAMES,
    OVERHEAD,
    PROMPT,
    QUANTILES,
    TTFA,
    Collection,
    Selection,
    Series,
    matches,
)

MINUTE, START = "minute", "start"  # the span the page leads with
TABLE_MAX_ROWS = 60  # of the table by upstream and model; the rest are counted
CARD_MAX = 4  # selections on the "What to fix" card; the rest are counted
BREAKS_MAX = 4  # break reasons on the "Prompt caching" panel, the most frequent first

_CLIENT_LEFT = (str(Outcome.CLIENT_DISCONNECTED), str(Outcome.CLIENT_STALLED))
FAILED = tuple(o for o in OUTCOME_NAMES if o != Outcome.COMPLETED and o not in _CLIENT_LEFT)
NOT_STREAMED_5XX = "5xx, not streamed"  # the errors' other part, as the row names it


class LiveData(Protocol):
    """What the panels read of :class:`proxy.ui.data.LiveData` (which imports this
    module): its ring and its bucket estimates."""

    started: float
    edges: dict[str, tuple[float, ...]]
    breaks: RecentBreaks | None

    @property
    def coarse(self) -> Iterable[Collection]: ...

    def dist(self, series: Series, name: str) -> dict[str, Any] | None: ...

    def quantile(self, series: Series, name: str, q: float) -> float | None: ...
# A break example's fields that its sentence (explain_break) is not worded from.
_UNWORDED = ("model", "upstream", "prompt_bytes", "prompt_tokens", "ago_s")


class View:
    """One answer as its panels read it: the collection now, the one the last minute
    starts from, the selection, and the span the page leads with (module docstring)."""

    def __init__(self, data: LiveData, now: Collection, base: Collection, selection: Selection):
        self.data, self.now, self.base, self.selection = data, now, base, selection
        self.uptime_s = now.t - data.started
        self.window_s = now.t - base.t
        self.minute = self.window_s >= FULL_WINDOW_S
        self.since = base.t if self.minute else None  # what an answer's span depends on
        self.total = now.total(selection)
        self.window = self.total.minus(base.total(selection)) if self.minute else None

    def span(self) -> dict[str, Any]:
        if self.minute:
            return {"kind": MINUTE, "label": "last minute", "seconds": self.window_s}
        return {
            "kind": START,
            "label": "since start",
            "seconds": self.uptime_s,
            "minute_in_s": max(FULL_WINDOW_S - self.window_s, 0.0),
        }


def figures(view: View) -> dict[str, Any]:
    """Tiles, percentiles, outcomes, where the time goes: the last minute (None until the
    ring holds one) and since start."""
    window = view.window
    return {
        "window": _figures(view.data, window, view.window_s) if window is not None else None,
        "total": _figures(view.data, view.total, view.uptime_s),
    }


def histograms(view: View) -> dict[str, Any]:
    """TTFT and ITL counts per bucket."""
    return {name: _histogram(view.data, name, view.window, view.total) for name in (TTFT, ITL)}


def in_flight(view: View) -> float:
    """Requests in flight now, of the selected upstream (the gauge has no other label)."""
    upstream = view.selection[2]
    return sum(v for k, v in view.now.in_flight.items() if not upstream or k == upstream)


def over_time(view: View) -> dict[str, Any]:
    """Points every ``COARSE_S`` over the ring, each a whole interval between two of its
    collections (the one still running is left out); ``None`` where the ring has a gap
    (no page polled), so the lines break there."""
    now_t, selection = view.now.t, view.selection
    # (a copy, without what another thread's answer collected since this one's)
    points = [c for c in list(view.data.coarse) if c.t <= now_t]
    rows: list[dict[str, Any]] = []
    for before, after in itertools.pairwise(points):
        point = after.remember(
            ("point", selection, before.t), partial(_point, view.data, selection, before, after)
        )
        if after.t - before.t > 2.5 * COARSE_S:  # a gap: break the lines
            rows.append({"t": before.t - now_t + COARSE_S} | dict.fromkeys(point))
        rows.append({"t": after.t - now_t} | point)
    keys = [f"{h}.p{round(q * 100)}" for h in ("ttft", "ttfa", "itl") for q in QUANTILES]
    return {k: [r[k] for r in rows] for k in ("t", *keys, "requests_per_s", "output_tokens_per_s")}


def by_upstream(view: View) -> dict[str, Any]:
    """One row per (upstream, model), and route when more than one has traffic, over the
    span, whatever is selected (it is how one selects); the most requests first."""
    return view.now.remember(("table", view.since), partial(_table, view))


def _evidence(view: View, span: str) -> list[levers.Evidence]:
    """The levers' evidence of each (route, model, upstream) in the selection, over the
    span (``"window"``: the last minute, once the ring holds one; ``"total"``: since
    start), busiest first; computed once per reading."""
    now, base = view.now, view.base
    if now.reading is None or (span == "window" and (not view.minute or base.reading is None)):
        return []
    before = base.reading if span == "window" else None
    route, model, upstream = (value or None for value in view.selection)

    def compute() -> list[levers.Evidence]:
        return ev.evidence(
            now.reading or ev.Reading({}), before, route=route, model=model, upstream=upstream
        )

    key = ("evidence", view.selection, span, base.t if span == "window" else None)
    return now.remember(key, compute)


def _fit(evidence: levers.Evidence) -> dict[str, Any]:
    fit = evidence.fit
    return {
        "requests": fit.requests,
        "status": fit.status,
        "usable": levers.usable_fit(fit),
        "ms_per_1k_tokens": fit.ms_per_1k_tokens,
        "stderr_ms_per_1k_tokens": fit.stderr_ms_per_1k_tokens,
        "fixed_ms": fit.fixed_ms,
        "mean_uncached_tokens": fit.mean_uncached_tokens,
        "model": fit.model,  # proxy.diagnosis.fit.Model
        "summary": fit.summary(),  # the model's figures in words, as the card prints them
        "model_words": MODEL_WORDS[fit.model],
        "line_fixed_ms": fit.line_fixed_ms,
        "skipped": evidence.fit_skipped,  # streams with no prompt token count at all
        # of the fit's requests, those with the proxy's own token estimate (no usage)
        "estimated_requests": evidence.fit_estimated,
        "note": levers.fit_note(evidence),
    }


def what_to_fix(view: View) -> dict[str, Any]:
    """The "What to fix" card: the levers of ``llm-latency-proxy diagnose``
    (:mod:`proxy.diagnosis.levers`) for each (route, model, upstream) in the selection,
    busiest first, at most ``CARD_MAX``. The levers are ranked over since start, as the
    command ranks them by default: a minute of one selection rarely holds the
    ``levers.MIN_REQUESTS`` streams a lever needs. The prefill fit is given for both
    spans, so a change in the last minute shows beside the whole run."""

    def compute() -> dict[str, Any]:
        total = _evidence(view, "total")
        window = {(e.route, e.model, e.upstream): e for e in _evidence(view, "window")}
        out = []
        for evidence in total[:CARD_MAX]:
            d = levers.diagnose(evidence).as_json()  # as diagnose --json words it
            recent = window.get((evidence.route, evidence.model, evidence.upstream))
            fit = {"total": _fit(evidence), "window": _fit(recent) if recent is not None else None}
            card = {name: d[name] for name in ("route", "model", "upstream", "requests")}
            out.append(card | {"fit": fit, "first_token": d["first_token"], "levers": d["levers"]})
        return {"selections": out, "more": max(len(total) - CARD_MAX, 0)}

    return view.now.remember(("fix", view.selection, view.since), compute)


def prompt_cache(view: View) -> dict[str, Any]:
    """Prompt caching, per span: prompt tokens, the repeated prefix the prompt-cache
    doctor found, the cached tokens the upstream reported and the missed ones (repeated,
    not reported cached), per second and as shares of the prompt tokens; what the missed
    ones cost in first-token time by the prefill fit (since start, in both spans: the
    most data); and the top break reasons, each
    with the latest example this process kept (:mod:`proxy.ui.breaks`) and one sentence.
    ``measured`` is False while the registry has no sample of the doctor's counters."""

    def compute() -> dict[str, Any]:
        fits = {(e.route, e.model, e.upstream): e.fit for e in _evidence(view, "total")}
        breaks = view.data.breaks
        examples = breaks.latest(partial(matches, view.selection)) if breaks is not None else {}
        clock = breaks.clock() if breaks is not None else 0.0
        return {
            "measured": view.now.missed_measured,
            "total": _prompt_span(view, "total", fits, examples, clock),
            "window": _prompt_span(view, "window", fits, examples, clock) if view.minute else None,
            "examples": breaks is not None,
        }

    return view.now.remember(("prompt", view.selection, view.since), compute)


def _prompt_span(
    view: View,
    span: str,
    fits: dict[Key, Any],
    examples: dict[str, tuple[Key, BreakExample]],
    clock: float,
) -> dict[str, Any]:
    before = view.base.series if span == "window" else {}
    seconds = view.window_s if span == "window" else view.uptime_s
    s = Series.empty()
    missed_ms_sum = missed_fitted = examined_fitted = 0.0
    for key, series in view.now.series.items():
        if not matches(view.selection, key):
            continue
        old = before.get(key)
        change = series.minus(old) if old is not None else series
        s = s.plus(change)
        fit = fits.get(key)
        if fit is not None and levers.usable_fit(fit) and change.get("examined") > 0:
            missed = change.get("missed_tokens")
            missed_ms_sum += fit.rate_ms(missed) or 0.0
            missed_fitted += missed
            examined_fitted += change.get("examined")
    prompt = s.get(f"{PROMPT}_sum")
    missed_all = s.get("missed_tokens")

    def per_s(value: float) -> float | None:
        return value / seconds if seconds > 0 else None

    figures: dict[str, Any] = {"seconds": seconds}
    for name, value in (
        ("prompt", prompt),
        ("repeated", s.get("repeated_tokens")),
        # unknown where no upstream reported cached tokens, or none was examined with them
        ("cached", s.get(f"{CACHED}_sum") if s.get(f"{CACHED}_count") > 0 else None),
        ("missed", missed_all if s.get("examined") > 0 else None),
    ):
        figures[name] = {
            "tokens": value,
            "per_s": per_s(value) if value is not None else None,
            "share": value / prompt if value is not None and prompt > 0 else None,
        }
    figures["examined"] = s.get("examined")
    # Missed tokens per examined request at each selection's fitted prefill cost; the
    # share of missed tokens whose selection has a usable fit says what it covers.
    figures["missed_ms"] = missed_ms_sum / examined_fitted if examined_fitted > 0 else None
    figures["missed_ms_covers"] = missed_fitted / missed_all if missed_all > 0 else None
    counts = sorted(((s.get(f"break_{r}"), r) for r in (*REASONS, "other")), reverse=True)
    figures["breaks"] = [
        {"reason": r, "count": n, "per_s": per_s(n)} | _example(r, examples.get(r), fits, clock)
        for n, r in counts[:BREAKS_MAX]
        if n > 0
    ]
    figures["breaks_total"] = math.fsum(count for count, _ in counts)
    return figures


def _example(
    reason: str, found: tuple[Key, BreakExample] | None, fits: dict[Key, Any], clock: float
) -> dict[str, Any]:
    """A break reason's latest example, what moving its changing part would save, and its
    sentence."""
    if found is None:
        return {"example": None, "saves_ms": None, "sentence": explain_break(reason)}
    key, example = found
    fit = fits.get(key)
    tokens = example.stable_tokens if reason == "variable_before_stable" else None
    saves = (
        fit.rate_ms(tokens)
        if tokens is not None and fit is not None and levers.usable_fit(fit)
        else None
    )
    shown: dict[str, Any] = dict(zip(("route", "model", "upstream"), key, strict=True))
    shown |= example.as_json(clock) | {"stable_tokens": tokens}
    worded = {name: value for name, value in shown.items() if name not in _UNWORDED}
    sentence = explain_break(reason, **worded, saves_ms=saves)
    return {"example": shown, "saves_ms": saves, "sentence": sentence}


PANELS: tuple[tuple[str, Callable[[View], Any]], ...] = (
    ("figures", figures),
    ("hist", histograms),
    ("series", over_time),
    ("in_flight", in_flight),
    ("table", by_upstream),
    ("fix", what_to_fix),
    ("prompt_cache", prompt_cache),
)


def _figures(data: LiveData, s: Series, seconds: float) -> dict[str, Any]:
    def mean(name: str) -> float | None:
        count = s.get(f"{name}_count")
        return s.get(f"{name}_sum") / count if count > 0 else None

    ttft = data.dist(s, TTFT)
    return {
        "seconds": seconds,
        "requests": s.get("requests"),
        "requests_per_s": s.get("requests") / seconds if seconds > 0 else None,
        "output_tokens": s.get(f"{COMPLETION}_sum"),
        "output_tokens_per_s": s.get(f"{COMPLETION}_sum") / seconds if seconds > 0 else None,
        # unknown, not 0, where no upstream said what it served from its cache
        "cache_hit_ratio": (s.get(f"{CACHED}_sum") / s.get("prompt_reported")
                            if s.get("prompt_reported") > 0 else None),
        "ttft": ttft,
        "ttfa": data.dist(s, TTFA),
        "itl": data.dist(s, ITL),
        "tpot": data.dist(s, TPOT),
        "outcomes": {o: v for o in (*OUTCOME_NAMES, "other") if (v := s.get(f"outcome_{o}"))},
        "codes": {c: v for c in (*CODES, "other") if (v := s.get(f"code_{c}"))},
        "time": _time_split(
            stream_total(*s.sum_count(TTFT), s.sum_count(ITL)[0]),
            mean(QUEUE), mean(OVERHEAD), ttft["mean"] if ttft else None,
        ),
    }


def _histogram(data: LiveData, name: str, window: Series | None, total: Series) -> dict[str, Any]:
    edges = data.edges.get(name, ())

    def per_bucket(series: Series | None) -> list[float] | None:
        values = series.hists.get(name) if series is not None else None
        if values is None:
            return None
        counts = values[:-2]
        return [c - (counts[i - 1] if i else 0.0) for i, c in enumerate(counts)]

    return {
        "edges": [e for e in edges if math.isfinite(e)],
        "window": per_bucket(window),
        "total": per_bucket(total),
    }


def _point(
    data: LiveData, selection: Selection, before: Collection, after: Collection
) -> dict[str, Any]:
    d = after.total(selection).minus(before.total(selection))
    seconds = after.t - before.t
    point: dict[str, Any] = {}
    for short, name in (("ttft", TTFT), ("ttfa", TTFA), ("itl", ITL)):
        for q in QUANTILES:
            point[f"{short}.p{round(q * 100)}"] = data.quantile(d, name, q)
    point["requests_per_s"] = d.get("requests") / seconds
    point["output_tokens_per_s"] = d.get(f"{COMPLETION}_sum") / seconds
    return point


def _table(view: View) -> dict[str, Any]:
    before = view.base.series if view.minute else {}
    moved: dict[Key, Series] = {}
    for key, series in view.now.series.items():
        old = before.get(key)
        change = series.minus(old) if old is not None else series
        if change.get("requests") > 0:
            moved[key] = change
    by_route = len({key[0] for key in moved}) > 1
    rows: dict[Key, Series] = {}
    for (route, model, upstream), change in moved.items():
        key = (route if by_route else "", model, upstream)
        found = rows.get(key)
        rows[key] = change if found is None else found.plus(change)
    ordered = sorted(
        rows.items(), key=lambda kv: (-kv[1].get("requests"), kv[0][2], kv[0][1], kv[0][0])
    )
    return {
        "by_route": by_route,
        "missed_measured": view.now.missed_measured,
        "rows": [_row(view, key, s) for key, s in ordered[:TABLE_MAX_ROWS]],
        "more": max(len(ordered) - TABLE_MAX_ROWS, 0),
    }


def _row(view: View, key: Key, s: Series) -> dict[str, Any]:
    route, model, upstream = key
    q = partial(view.data.quantile, s)
    requests = s.get("requests")
    tpot = q(TPOT, 0.5)
    errors_by = {o: v for o in FAILED if (v := s.get(f"outcome_{o}"))}
    if not_streamed := s.get("nonstream_5xx"):
        errors_by[NOT_STREAMED_5XX] = not_streamed
    errors = math.fsum(errors_by.values())
    prompt = s.get(f"{PROMPT}_sum")
    missed = (s.get("missed_tokens")  # unknown where none of its requests had the figure
              if view.now.missed_measured and s.get("examined") > 0 else None)
    return {
        "route": route,
        "model": model,
        "upstream": upstream,
        "requests": requests,
        "ttft_p50": q(TTFT, 0.5),
        "ttft_p95": q(TTFT, 0.95),
        "ttfa_p50": q(TTFA, 0.5),
        "itl_p50": q(ITL, 0.5),
        "decode_tok_s": 1.0 / tpot if tpot else None,  # median of 1 / TPOT
        "errors": errors,
        "error_share": errors / requests,
        "errors_by": errors_by,
        "missed_cache": missed / prompt if missed is not None and prompt > 0 else None,
        "missed_tokens": missed,
        "prompt_tokens": prompt,
    }


def _time_split(
    duration: float | None, queue: float | None, overhead: float | None, ttft: float | None
) -> dict[str, Any] | None:
    """Mean time of a stream that had a first token (``duration``:
    :func:`proxy.evidence.stream_total`), in four parts that add up to it (see the module
    docstring); ``None`` until there is one."""
    if duration is None or ttft is None or duration <= 0:
        return None
    queue = min(queue or 0.0, ttft)
    overhead = min(overhead or 0.0, ttft - queue)
    first = max(ttft - queue - overhead, 0.0)
    decode = max(duration - ttft, 0.0)
    whole = queue + overhead + first + decode
    parts = {"queue": queue, "overhead": overhead, "first_token": first, "decode": decode}
    return {
        "request_s": duration,
        "parts_s": parts,
        "shares": {k: v / whole for k, v in parts.items()} if whole > 0 else None,
    }
