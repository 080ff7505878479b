"""What to fix: the first token split into its causes, decode and output against reading
pace, and the levers ranked by the time they would save, each with one plain sentence.

Design: ``docs/design/diagnosis.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from proxy.diagnosis import wording as say
from proxy.diagnosis.dist import Dist
from proxy.diagnosis.fit import KNOWN_SLOPE_RELATIVE_STDERR, PrefillFit

# -- thresholds --------------------------------------------------------------------

MIN_REQUESTS = 20  # fewer measured requests in a selection: too little data to advise
# The slope's standard error over the slope: above this, the prefill cost is not
# known well enough to be a number worth printing (no spread of prompt lengths, or
# first-token times that vary for other reasons: queueing, a shared machine).
MAX_SLOPE_RELATIVE_STDERR = KNOWN_SLOPE_RELATIVE_STDERR
# A lever is worth acting on when it saves at least WORTH_MS and at least WORTH_SHARE
# of what it acts on (the mean first token, or the mean total time).
WORTH_MS = 50.0
WORTH_SHARE = 0.10
READING_PACE_TOK_S = 5.0  # a reader keeps pace with about this
FAST_TOK_S = 20.0  # above this a faster decoder is invisible to a reader

Status = Literal["lever", "not_a_lever", "too_little_data", "unknown"]
ActsOn = Literal["first_token", "total"]
_ORDER: dict[str, int] = {"lever": 0, "not_a_lever": 1, "too_little_data": 2, "unknown": 3}


# -- inputs ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Evidence:
    """Everything :func:`diagnose` reads about one selection, over one window.

    Means in seconds; None where the source does not have the figure. ``requests``:
    the measured requests of the selection (the card's "requests"); ``streams``: those
    streamed with a first token (the mean first token is theirs).
    """

    route: str
    model: str
    upstream: str
    requests: int
    fit: PrefillFit
    streams: int = 0
    ttft_mean_s: float | None = None
    queue_mean_s: float | None = None  # in the proxy
    upstream_queue_mean_s: float | None = None  # None: the upstream reports none
    missed_cache_tokens: float | None = None  # mean per request, from a prompt-cache check
    unmarked_cache_tokens: float | None = None  # of those, past the last cache breakpoint
    fit_skipped: int = 0  # streams left out of the fit: no prompt token count at all
    fit_estimated: int = 0  # of the fit's requests, those with the proxy's own token estimate
    engine_prefill_mean_s: float | None = None  # the engine's own prefill time, mean
    engine_prefill_requests: int = 0  # the requests that reported it
    duration_mean_s: float | None = None  # mean time of the streams with a first token
    tpot: Dist | None = None  # seconds per output token, one per stream
    completion: Dist | None = None  # completion tokens per response
    finish: Mapping[str, float] = field(default_factory=dict)  # by llm_proxy_finish_reasons label
    no_first_token: int = 0  # 2xx streams that ended before a first token, not completed
    no_first_token_wait_s: float | None = None  # their mean wait


# -- what the figures say ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FirstTokenSplit:
    """The mean first token and its parts, in milliseconds (None: unknown)."""

    mean_ms: float | None
    proxy_queue_ms: float | None
    upstream_queue_ms: float | None
    prefill_ms: float | None
    missed_cache_ms: float | None
    rest_ms: float | None
    # where the prefill part comes from: "fit", "engine" (its own timings), None: unknown
    prefill_from: str | None = None
    capped: bool = False  # prefill and missed cache scaled down to what the mean leaves


@dataclass(frozen=True, slots=True)
class DecodeFigures:
    streams: int  # with a TPOT (two or more output tokens)
    median_tokens_per_s: float | None
    below_reading_pace_share: float | None  # decode rate < 5 tokens/s
    above_fast_share: float | None  # decode rate > 20 tokens/s
    slow_ms: float | None  # per request, what decoding at 20 tokens/s or more would save


@dataclass(frozen=True, slots=True)
class OutputFigures:
    responses: int
    mean_tokens: float | None
    p50_tokens: float | None
    p95_tokens: float | None
    ms_per_token: float | None
    decode_ms: float | None  # the mean answer at that per-token time
    capped_saving_ms: float | None  # capped at cap_tokens
    mean_total_ms: float | None
    length_limited_share: float | None  # stopped at their length limit
    cap_tokens: float | None = None  # the bound of the median's bucket: the most it can be


@dataclass(frozen=True, slots=True)
class Lever:
    """One thing to change, what it would save, and the numbers that say so."""

    name: str
    status: Status
    acts_on: ActsOn
    saves_ms: float | None
    sentence: str
    numbers: Mapping[str, float | int | None] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "acts_on": self.acts_on,
                "saves_ms": say.rounded(self.saves_ms), "sentence": self.sentence,
                "numbers": {k: say.rounded(v) for k, v in self.numbers.items()}}


@dataclass(frozen=True, slots=True)
class Diagnosis:
    route: str
    model: str
    upstream: str
    requests: int
    prefill_ms_per_1k_tokens: float | None  # None: too little data or no spread
    fixed_ms: float | None
    first_token: FirstTokenSplit
    decode: DecodeFigures
    output: OutputFigures
    levers: tuple[Lever, ...]  # most valuable first
    fit_model: str | None = None  # proxy.diagnosis.fit.Model
    line_fixed_ms: float | None = None  # the straight line's own fixed part
    fit_terms_ms: tuple[float, float, float] | None = None  # PrefillFit.terms_ms
    fit_summary: str = ""  # the fitted model's figures, as the card prints them
    fit_note: str = ""  # why the prefill cost is not known, or which model was fitted
    tokens_estimated_share: float | None = None  # of the fit's requests; None: no fit
    no_first_token: int = 0  # streams that ended before a first token (Evidence's)
    no_first_token_wait_ms: float | None = None  # their mean wait

    def as_json(self) -> dict[str, Any]:
        return {
            "route": self.route, "model": self.model, "upstream": self.upstream,
            "requests": self.requests,
            "prefill_ms_per_1k_tokens": say.rounded(self.prefill_ms_per_1k_tokens),
            "fixed_ms": say.rounded(self.fixed_ms),
            "fit_model": self.fit_model,
            "line_fixed_ms": say.rounded(self.line_fixed_ms),
            "fit_terms": None if self.fit_terms_ms is None else dict(zip(
                ("fixed_ms", "ms_per_1k_tokens", "ms_per_1k_tokens_squared"),
                map(say.rounded, self.fit_terms_ms), strict=True)),
            "fit_note": self.fit_note,
            "tokens_estimated_share": say.rounded(self.tokens_estimated_share),
            "no_first_token_streams": self.no_first_token,
            "no_first_token_wait_ms": say.rounded(self.no_first_token_wait_ms),
            "first_token": _rounded(self.first_token),
            "decode": _rounded(self.decode),
            "output": _rounded(self.output),
            "levers": [lever.as_json() for lever in self.levers],
        }


def _rounded(figures: FirstTokenSplit | DecodeFigures | OutputFigures) -> dict[str, Any]:
    """Figures as JSON, each float rounded as :func:`say.rounded` does."""
    return {k: say.rounded(v) if isinstance(v, float) else v for k, v in asdict(figures).items()}


def as_json(diagnoses: Sequence[Diagnosis]) -> dict[str, Any]:
    """The ``--json`` contract: ``{"selections": [...]}``, one entry per selection."""
    return {"selections": [d.as_json() for d in diagnoses]}


# -- the figures ---------------------------------------------------------------------


def usable_fit(fit: PrefillFit) -> bool:
    """Enough requests and a slope known to within MAX_SLOPE_RELATIVE_STDERR."""
    rel = fit.relative_stderr
    return (fit.status == "fitted" and fit.requests >= MIN_REQUESTS and rel is not None
            and rel <= MAX_SLOPE_RELATIVE_STDERR)


def first_token_split(ev: Evidence) -> FirstTokenSplit:
    fit = ev.fit
    mean = say.ms(ev.ttft_mean_s)
    proxy_q = say.ms(ev.queue_mean_s)
    upstream_q = say.ms(ev.upstream_queue_mean_s)
    prefill = missed = rest = None
    source: str | None = None
    missed_tokens = None
    uncached = fit.mean_uncached_tokens if fit.status != "no_requests" else None
    if ev.missed_cache_tokens is not None and uncached is not None:
        missed_tokens = min(max(0.0, ev.missed_cache_tokens), uncached)
    engine = say.ms(ev.engine_prefill_mean_s) if ev.engine_prefill_requests > 0 else None
    if engine is not None:
        source, prefill = "engine", engine
    elif usable_fit(fit) and uncached is not None:
        source, prefill = "fit", fit.mean_prefill_ms  # the fitted prefill of the requests
    if prefill is not None and missed_tokens is not None and uncached:
        # divided by token counts: the mean rate where it ran (a line's slope)
        missed = prefill * missed_tokens / uncached
        prefill -= missed
    capped = False
    if mean is not None and prefill is not None:
        room = max(0.0, mean - (proxy_q or 0.0) - (upstream_q or 0.0))
        prefill = max(0.0, prefill)
        computed = prefill + (missed or 0.0)
        if computed > room:
            # the fit's streams and all streams differ, or the line over-predicts where
            # prefill grows faster than linearly: no part may exceed the whole
            scale = room / computed if computed > 0 else 0.0
            prefill *= scale
            missed = missed * scale if missed is not None else None
            capped = True
        rest = max(0.0, room - prefill - (missed or 0.0))
    return FirstTokenSplit(mean, proxy_q, upstream_q, prefill, missed, rest, source, capped)


def decode_figures(ev: Evidence) -> DecodeFigures:
    tpot = ev.tpot
    if tpot is None or tpot.count <= 0:
        return DecodeFigures(0, None, None, None, None)
    median = tpot.quantile(0.5)
    below = tpot.share_at_most(1.0 / READING_PACE_TOK_S)
    excess = tpot.mean_excess(1.0 / FAST_TOK_S)
    tokens = ev.completion.mean() if ev.completion is not None else None
    slow = (excess * max(0.0, tokens - 1) * 1000.0
            if excess is not None and tokens is not None else None)
    return DecodeFigures(
        streams=round(tpot.count),
        median_tokens_per_s=(1.0 / median) if median else None,
        below_reading_pace_share=None if below is None else 1.0 - below,
        above_fast_share=tpot.share_at_most(1.0 / FAST_TOK_S),
        slow_ms=slow)


def output_figures(ev: Evidence) -> OutputFigures:
    done = sum(ev.finish.values())
    limited = ev.finish.get("length", 0.0) / done if done > 0 else None
    completion = ev.completion
    per_token = say.ms(ev.tpot.mean() if ev.tpot is not None else None)
    total = say.ms(ev.duration_mean_s)
    if completion is None or completion.count <= 0:
        return OutputFigures(0, None, None, None, per_token, None, None, total, limited)
    mean = completion.mean()
    p50 = completion.quantile(0.5)
    # capped where the median surely is at or below: an interpolated median can sit below
    # every answer (all of 30 tokens read as 24), and a cap there cuts every one
    cap = completion.edge_at_or_above(p50) if p50 is not None else None
    excess = completion.mean_excess(cap) if cap is not None else None
    return OutputFigures(
        responses=round(completion.count), mean_tokens=mean, p50_tokens=p50,
        p95_tokens=completion.quantile(0.95), ms_per_token=per_token,
        decode_ms=(per_token * mean) if per_token is not None and mean is not None else None,
        capped_saving_ms=(per_token * excess) if per_token is not None and excess is not None
        else None,
        mean_total_ms=total, length_limited_share=limited, cap_tokens=cap)


# -- the levers ----------------------------------------------------------------------


def diagnose(ev: Evidence) -> Diagnosis:
    """The split, the figures and the ranked levers of one selection."""
    split = first_token_split(ev)
    decode = decode_figures(ev)
    output = output_figures(ev)
    total = output.mean_total_ms
    levers = [
        _prefill(ev, split),
        *([_missed_cache(ev, split)] if ev.missed_cache_tokens is not None else []),
        _proxy_queue(ev, split),
        _upstream_queue(ev, split),
        _rest(ev, split),
        _decode(ev, decode, total),
        _output(ev, output),
    ]
    levers.sort(key=lambda lv: (_ORDER[lv.status], -(lv.saves_ms or 0.0)))
    good = usable_fit(ev.fit)
    fit = ev.fit
    return Diagnosis(
        route=ev.route, model=ev.model, upstream=ev.upstream, requests=ev.requests,
        prefill_ms_per_1k_tokens=fit.ms_per_1k_tokens if good else None,
        fixed_ms=fit.fixed_ms if good else None,
        first_token=split, decode=decode, output=output, levers=tuple(levers),
        fit_model=fit.model if good else None,
        line_fixed_ms=fit.line_fixed_ms if good else None,
        fit_terms_ms=fit.terms_ms if good else None, fit_summary=fit.summary() if good else "",
        fit_note=fit_note(ev),
        tokens_estimated_share=(ev.fit_estimated / fit.requests if fit.requests > 0
                                else None),
        no_first_token=ev.no_first_token,
        no_first_token_wait_ms=say.ms(ev.no_first_token_wait_s))


def fit_note(ev: Evidence) -> str:
    """One sentence: why the prefill cost is not known, or how it was fitted."""
    fit = ev.fit
    estimated = ""
    if ev.fit_estimated > 0:
        estimated = (f" Prompt tokens of {ev.fit_estimated:,} of its {fit.requests:,} requests "
                     "are the proxy's own estimate (the upstream sent no usage).")
    if fit.status == "no_requests":
        if ev.fit_skipped > 0:
            return (f"Prefill cost not known: none of the {ev.fit_skipped:,} streams had a "
                    "prompt token count to fit.")
        if ev.streams > 0:
            return ("Prefill cost not known: no streamed request with a first token was "
                    "fitted in this window.")
        return "Prefill cost not known: no streamed request with a first token in this window."
    if fit.requests < MIN_REQUESTS:
        return (f"Prefill cost not known yet: {fit.requests:,} streamed "
                f"{say.plural(fit.requests, 'request')} fitted, {MIN_REQUESTS} needed." + estimated)
    if fit.status == "one_length":
        return (f"Prefill cost not known: the prompts all have about one length "
                f"({say.tokens(fit.mean_uncached_tokens)} uncached tokens), so prefill cannot be "
                "told apart from the fixed part." + estimated)
    if not usable_fit(fit):
        return (f"Prefill cost not known: {say.sig(fit.ms_per_1k_tokens)} ± "
                f"{say.sig(fit.stderr_ms_per_1k_tokens)} ms per 1,000 uncached tokens over "
                f"{fit.requests:,} requests; first-token times vary more than prompt lengths "
                "explain." + estimated)
    return fit.model_note() + estimated


def _worth(saves_ms: float, of_ms: float | None) -> Status:
    if saves_ms >= WORTH_MS and (of_ms is None or saves_ms >= WORTH_SHARE * of_ms):
        return "lever"
    return "not_a_lever"


def _too_few(name: str, acts_on: ActsOn, what: str, have: int) -> Lever:
    return Lever(name, "too_little_data", acts_on, None,
                 f"{what}: too little data yet ({have:,} {say.plural(have, 'stream')}, "
                 f"{MIN_REQUESTS} needed).", {"streams": have})


def _prefill(ev: Evidence, split: FirstTokenSplit) -> Lever:
    fit = ev.fit
    if split.prefill_from == "engine" and split.prefill_ms is not None:
        return _engine_prefill(ev, split)
    if fit.requests < MIN_REQUESTS:
        return Lever("prefill", "too_little_data", "first_token", None,
                     f"Prefill: too little data yet ({fit.requests:,} streamed "
                     f"{say.plural(fit.requests, 'request')} with a prompt token count, "
                     f"{MIN_REQUESTS} needed).", {"requests": fit.requests})
    numbers: dict[str, float | int | None] = {
        "requests": fit.requests, "mean_uncached_tokens": fit.mean_uncached_tokens,
        "ms_per_1k_tokens": fit.ms_per_1k_tokens,
        "stderr_ms_per_1k_tokens": fit.stderr_ms_per_1k_tokens,
        "first_token_ms": split.mean_ms}
    if fit.status == "one_length":
        return Lever("prefill", "too_little_data", "first_token", None,
                     f"Prefill: the prompts all have about one length "
                     f"({say.tokens(fit.mean_uncached_tokens)} uncached tokens), so the time they "
                     "take cannot be told apart from the fixed part.", numbers)
    if not usable_fit(fit):
        return Lever("prefill", "too_little_data", "first_token", None,
                     f"Prefill: not clear yet ({say.sig(fit.ms_per_1k_tokens)} ± "
                     f"{say.sig(fit.stderr_ms_per_1k_tokens)} ms per 1,000 uncached prompt "
                     f"tokens over {fit.requests:,} requests): first-token times vary more "
                     "than prompt lengths explain.", numbers)
    assert fit.ms_per_1k_tokens is not None and split.prefill_ms is not None
    if fit.ms_per_1k_tokens <= 0:
        return Lever("prefill", "not_a_lever", "first_token", 0.0,
                     "Prefill: first-token time does not grow with the uncached prompt here "
                     f"({fit.requests:,} requests); a shorter prompt would not be faster.",
                     numbers)
    saves = split.prefill_ms
    # the tokens as counted (the split's time, scaled down where it was capped, is not
    # the prompt): the mean uncached prompt, the missed cache hits apart
    uncached = fit.mean_uncached_tokens or 0.0
    of_missed = (min(max(0.0, ev.missed_cache_tokens), uncached)
                 if ev.missed_cache_tokens is not None and split.missed_cache_ms else 0.0)
    shown, besides = say.tokens(uncached - of_missed), ""
    if of_missed:  # the two as said add up to the mean uncached prompt, as said
        said = say.rounded_tokens(of_missed)
        shown = f"{max(0, say.rounded_tokens(uncached) - said):,}"
        besides = f" besides the {said:,} the cache missed,"
    mean = " on average" if fit.model == "quadratic" else ""  # its cost grows with length
    scaled = ""
    if split.capped and fit.mean_prefill_ms is not None and uncached:
        fitted = fit.mean_prefill_ms * (1 - of_missed / uncached)  # before it was scaled
        scaled = (f" (scaled down from {say.dur(fitted)}: the fit puts more in it than the "
                  "first token leaves)")
    head = (f"Prefill: {shown} uncached prompt tokens{besides} at "
            f"{say.sig(fit.ms_per_1k_tokens / 1000)} ms per token{mean} are "
            f"{say.dur(saves)}{say.of_first(split.mean_ms)}{scaled}.")
    status = _worth(saves, split.mean_ms)
    advice = (" Shorten the prompt, or put what does not change first so the upstream can "
              "cache it." if status == "lever" else " Not worth shortening for speed.")
    return Lever("prefill", status, "first_token", saves, head + advice, numbers)


def _engine_prefill(ev: Evidence, split: FirstTokenSplit) -> Lever:
    """Prefill as the engine timed it (llama.cpp's timings): no fit needed to know it."""
    saves = split.prefill_ms
    assert saves is not None
    numbers: dict[str, float | int | None] = {
        "engine_requests": ev.engine_prefill_requests,
        "engine_prefill_ms": say.ms(ev.engine_prefill_mean_s),
        "mean_uncached_tokens": ev.fit.mean_uncached_tokens,
        "first_token_ms": split.mean_ms}
    status = _worth(saves, split.mean_ms)
    # the cache's misses are split off the engine's time (the prompt_cache lever), and a
    # time past the whole is capped to it: the part is then less than what it reports
    besides = (f", {say.dur(saves)} of it besides the cache's misses" if split.missed_cache_ms
               else f", {say.dur(saves)} of it within the first token" if split.capped else "")
    reported = say.dur(say.ms(ev.engine_prefill_mean_s))
    sentence = (f"Prefill: the upstream's engine reports {reported} "
                f"of prefill{say.of_first(split.mean_ms)}{besides} (its own timings, "
                f"{ev.engine_prefill_requests:,} {say.plural(ev.engine_prefill_requests, 'request')}).")
    sentence += (" Shorten the prompt, or put what does not change first so the upstream can "
                 "cache it." if status == "lever" else " Not worth shortening for speed.")
    return Lever("prefill", status, "first_token", saves, sentence, numbers)


def _missed_cache(ev: Evidence, split: FirstTokenSplit) -> Lever:
    saves = split.missed_cache_ms
    numbers = {"missed_cache_tokens": ev.missed_cache_tokens,
               "ms_per_1k_tokens": ev.fit.ms_per_1k_tokens, "first_token_ms": split.mean_ms}
    if saves is None:  # the fit's slope, not usable yet, is no cost to quote either
        numbers["ms_per_1k_tokens"] = None
        return Lever("prompt_cache", "too_little_data", "first_token", None,
                     "Prompt cache: the prefill cost is not known yet, so neither is what "
                     "the missed cache hits cost.", numbers)
    status = _worth(saves, split.mean_ms)
    sentence = (f"Prompt cache: {say.tokens(ev.missed_cache_tokens)} prompt tokens a request "
                f"could have read from the cache were computed again: "
                f"{say.dur(saves)}{say.of_first(split.mean_ms)}.")
    unmarked = min(ev.unmarked_cache_tokens or 0.0, ev.missed_cache_tokens or 0.0)
    if unmarked >= 0.5:  # of them, past the last cache breakpoint: none asked for
        numbers["unmarked_cache_tokens"] = ev.unmarked_cache_tokens
        asked = (ev.missed_cache_tokens or 0.0) - unmarked
        sentence += (f" {say.tokens(unmarked)} of them came after the last cache breakpoint, "
                     "where no cache was asked to serve them: add a breakpoint after the "
                     "stable part." + (f" The other {say.tokens(asked)} were asked for and "
                                       "not served." if asked >= 0.5 else ""))
    elif status == "lever":
        sentence += " Keep the shared part of the prompt first and identical."
    return Lever("prompt_cache", status, "first_token", saves, sentence, numbers)


def _proxy_queue(ev: Evidence, split: FirstTokenSplit) -> Lever:
    return _queue_lever(
        ev, split, "proxy_queue", "Queueing in the proxy", split.proxy_queue_ms, "queue_ms",
        unknown="not measured.", none="none; requests never waited for a slot.",
        waiting="Queueing in the proxy: {} is waiting for one of the proxy's "
                "--max-concurrency slots.",
        advice=" Raise the limit if the upstream has room, or add capacity behind it.")


def _upstream_queue(ev: Evidence, split: FirstTokenSplit) -> Lever:
    return _queue_lever(
        ev, split, "upstream_queue", "Queueing at the upstream", split.upstream_queue_ms,
        "upstream_queue_ms",
        unknown="it does not report its queue time (vLLM's usage metrics or an x-queue-time "
                "header), so any wait there is in the rest of the first token.",
        none="none reported.", waiting="Queueing: {} is waiting for a slot at the upstream.",
        advice=" This is capacity, not the model.")


def _queue_lever(ev: Evidence, split: FirstTokenSplit, name: str, title: str,
                 wait: float | None, key: str, *, unknown: str, none: str, waiting: str,
                 advice: str) -> Lever:
    """A wait for a slot (in the proxy or at the upstream), as a share of the first token."""
    if ev.streams < MIN_REQUESTS:
        return _too_few(name, "first_token", title, ev.streams)
    numbers = {key: wait, "first_token_ms": split.mean_ms}
    if wait is None:
        return Lever(name, "unknown", "first_token", None, f"{title}: {unknown}", numbers)
    status = _worth(wait, split.mean_ms)
    if wait <= 0:
        sentence = f"{title}: {none}"
    else:
        sentence = waiting.format(f"{say.dur(wait)}{say.of_first(split.mean_ms)}")
        if status == "lever":
            sentence += advice
    return Lever(name, status, "first_token", wait, sentence, numbers)


def _rest(ev: Evidence, split: FirstTokenSplit) -> Lever:
    rest = split.rest_ms
    fixed = ev.fit.fixed_ms if usable_fit(ev.fit) else None  # the card's, not a rejected fit's
    numbers = {"rest_ms": rest, "fixed_ms": fixed, "first_token_ms": split.mean_ms}
    if rest is None:
        if ev.fit.requests < MIN_REQUESTS or split.mean_ms is None:
            return _too_few("fixed", "first_token", "Rest of the first token",
                            ev.fit.requests)
        return Lever("fixed", "too_little_data", "first_token", None,
                     "Rest of the first token: not known until the prefill cost is.",
                     numbers)
    saves = max(0.0, rest)
    status = _worth(saves, split.mean_ms)
    what = ("network, the upstream's own scheduling and first decode step, and the proxy"
            if split.upstream_queue_ms is not None else
            "network, the upstream's queue and scheduling and first decode step, and the proxy")
    # the rest of the first token, not the fit's fixed part (the card's header), which
    # is the line's intercept: the two differ where prefill is not the line's
    sentence = (f"Rest of the first token: {say.dur(saves)}{say.of_first(split.mean_ms)} "
                f"does not grow with the prompt ({what}).")
    if status == "lever":
        sentence += " Run closer to the upstream, or use one with less overhead per request."
    return Lever("fixed", status, "first_token", saves, sentence, numbers)


def _decode(ev: Evidence, decode: DecodeFigures, total_ms: float | None) -> Lever:
    if decode.streams < MIN_REQUESTS:
        return _too_few("decode", "total", "Decoding", decode.streams)
    rate = decode.median_tokens_per_s
    below, fast, slow = (decode.below_reading_pace_share, decode.above_fast_share,
                         decode.slow_ms)
    numbers = asdict(decode)
    if rate is None:
        return Lever("decode", "unknown", "total", None, "Decoding: rate not measured.",
                     numbers)
    saves = slow
    status: Status = _worth(saves, total_ms) if saves is not None else "unknown"
    if rate >= FAST_TOK_S and status != "lever":
        sentence = (f"Decoding at {say.rate(rate)} tokens/s: above reading pace; a faster model "
                    "would not be noticed by a reader.")
    elif (below or 0.0) >= 0.5:
        sentence = (f"Decoding at {say.rate(rate)} tokens/s: {say.pct(below)} of streams are "
                    f"slower than reading pace ({READING_PACE_TOK_S:g} tokens/s), so users "
                    "wait on the model.")
    else:
        sentence = (f"Decoding at {say.rate(rate)} tokens/s: readers keep up, but "
                    f"{say.pct(1.0 - (fast or 0.0))} of streams are under {FAST_TOK_S:g} "
                    "tokens/s.")
    if saves is not None and status == "lever":
        sentence += (f" Decoding at {FAST_TOK_S:g} tokens/s or more would save {say.dur(saves)} "
                     "a request: a smaller or quantised model, or less batching at the "
                     "upstream.")
    return Lever("decode", status, "total", saves, sentence, numbers)


def _output(ev: Evidence, out: OutputFigures) -> Lever:
    if out.responses < MIN_REQUESTS:
        return _too_few("output_length", "total", "Output length", out.responses)
    numbers = {"responses": out.responses, "mean_tokens": out.mean_tokens,
               "p50_tokens": out.p50_tokens, "p95_tokens": out.p95_tokens,
               "ms_per_token": out.ms_per_token, "decode_ms": out.decode_ms,
               "mean_total_ms": out.mean_total_ms, "capped_saving_ms": out.capped_saving_ms,
               "length_limited_share": out.length_limited_share, "cap_tokens": out.cap_tokens}
    if out.ms_per_token is None or out.capped_saving_ms is None or out.decode_ms is None:
        return Lever("output_length", "unknown", "total", None,
                     f"Output length: answers average {say.tokens(out.mean_tokens)} tokens (p50 "
                     f"{say.tokens(out.p50_tokens)}, p95 {say.tokens(out.p95_tokens)}); the time per "
                     "token is not measured, so neither is what shorter answers would save.",
                     numbers)
    saves = out.capped_saving_ms
    sentence = (f"Answers average {say.tokens(out.mean_tokens)} tokens (p95 "
                f"{say.tokens(out.p95_tokens)}), {say.dur(out.decode_ms)} at "
                f"{say.sig(out.ms_per_token)} ms per token")
    capped = f"capped at {say.tokens(out.cap_tokens)} tokens (the median is at most that)"
    if out.mean_total_ms is not None:
        sentence += (f"; {capped} the mean total would be "
                     f"{say.dur(out.mean_total_ms - saves)} instead of "
                     f"{say.dur(out.mean_total_ms)}.")
    else:
        sentence += f"; {capped} each would take {say.dur(saves)} less on average."
    if out.length_limited_share is not None and out.length_limited_share > 0:
        sentence += (f" {say.pct(out.length_limited_share)} of answers already stop at their "
                     "length limit (cut off).")
    status = _worth(saves, out.mean_total_ms)
    if status == "lever":
        sentence += " Ask for less output (max_tokens, or a prompt asking for brevity)."
    return Lever("output_length", status, "total", saves, sentence, numbers)
