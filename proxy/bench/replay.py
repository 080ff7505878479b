"""``bench --workload-file``: a workload file's requests sent at their recorded times.

Design: ``docs/design/workload.md``.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.workload_file import Workload, WorkloadRecord, group_of

from .client import RequestResult
from .stats import align_columns, ms, pct, quantile
from .workload import API_PATHS, PlannedRequest, request_body, route_of

# Three-letter words that o200k_base and cl100k_base each encode as one token when
# written with a leading space (tested); four characters each, one simulator token.
_WORD_TEXT = (
    "the and for are but not you all any can had her was one our out day get has him "
    "his how man new now old see two way who boy did its let put say she too use act "
    "add age ago air arm art ask bad bag bed big bit box bus buy car cat cup cut dog "
    "dry eat end eye far few fit fly fun gas got gun guy hit hot ice job key kid lay "
    "leg lie lot low map may mix net oil own pay per red run sat sea set sit six sky "
    "son sun tax ten top try war wet win yes yet"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
_SPACED = tuple(" " + w for w in WORDS)
CHARS_PER_WORD = 4
ROUTE_APIS = {route_of(api): api for api in API_PATHS}


def api_of_route(route: str | None) -> str | None:
    """The API a recorded route label names, or None (absent, or not one we send)."""
    return ROUTE_APIS.get(route) if route else None


CORPUS_WORDS = 1 << 18  # words of random text a seed draws once
SEGMENTS = 4  # slices of the corpus a block is made of


class BlockText:
    """Synthetic prompt text per hash id.

    A block is ``SEGMENTS`` slices of one corpus of random words (drawn once from the
    seed), at offsets from a digest of (seed, namespace, id, block size): a few string
    copies, not a word-by-word draw that would delay the sends of a burst. Two different
    blocks are equal only if all their offsets collide.
    """

    def __init__(self, block_size: int, *, seed: int = 0) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.seed = seed
        rng = random.Random(f"corpus:{seed}")
        self._corpus = "".join(rng.choices(_SPACED, k=CORPUS_WORDS))
        count = max(SEGMENTS, -(-block_size // (CORPUS_WORDS // 2)))
        base, extra = divmod(block_size, count)
        self._lengths = [n for j in range(count) if (n := base + (j < extra)) > 0]

    def _text(self, *key: object) -> str:
        """A full block's words for ``key``."""
        corpus = self._corpus
        seed = repr((self.seed, self.block_size, *key)).encode()
        parts = []
        for j, n in enumerate(self._lengths):
            digest = hashlib.blake2b(seed + bytes([j]), digest_size=8).digest()
            at = int.from_bytes(digest, "big") % (CORPUS_WORDS - n + 1) * CHARS_PER_WORD
            parts.append(corpus[at : at + n * CHARS_PER_WORD])
        return "".join(parts)

    def block(self, namespace: int, hash_id: int, tokens: int | None = None) -> str:
        """Block ``hash_id`` of ``namespace``, or its first ``tokens`` words."""
        text = self._text("block", namespace, hash_id)
        if tokens is None or tokens >= self.block_size:
            return text
        return text[: max(tokens, 0) * CHARS_PER_WORD]

    def unique(self, index: int, tokens: int) -> str:
        """``tokens`` words for the ``index``-th request, shared with nothing."""
        size = self.block_size
        chunks = [self._text("own", index, c) for c in range(-(-max(tokens, 0) // size))]
        return "".join(chunks)[: max(tokens, 0) * CHARS_PER_WORD]

    def prompt(self, record: WorkloadRecord, namespace: int, index: int) -> str:
        """The ``input_length`` tokens of ``record``'s prompt (at least one word)."""
        length = max(record.input_length, 1)
        size = self.block_size
        parts = []
        done = 0
        for hash_id in record.hash_ids:
            if done >= length:
                break
            take = min(size, length - done)
            parts.append(self.block(namespace, hash_id, take))
            done += take
        parts.append(self.unique(index, length - done))
        return "".join(parts)


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How a workload becomes requests (each a ``bench`` flag)."""

    speedup: float = 1.0
    model: str | None = None  # every request's model; None: the recorded one
    default_model: str = "sim-llm"  # when neither is given
    default_api: str = "chat"  # when the file names no route we send
    default_max_tokens: int = 128  # when a line has no output_length
    ignore_eos: bool = False
    seed: int = 0
    block_size: int | None = None  # None: the file's, else the default
    requests: int | None = None  # only the first N
    duration: float | None = None  # only those due within S seconds of replay


@dataclass(frozen=True, slots=True)
class Replay:
    """A workload planned as a run: the records sent, their send offsets in seconds from
    the first, their APIs, and the block size used."""

    workload: Workload
    records: tuple[WorkloadRecord, ...]
    namespaces: tuple[int, ...]
    offsets: tuple[float, ...]
    apis: tuple[str, ...]
    block_size: int
    options: ReplayOptions

    @property
    def span_s(self) -> float:
        return self.offsets[-1] if self.offsets else 0.0

    def requests(self) -> Iterator[PlannedRequest]:
        """The bodies, built one at a time (a long workload's prompts are never all in
        memory at once); the text's corpus is drawn now, before any clock starts."""
        return self._bodies(BlockText(self.block_size, seed=self.options.seed))

    def _bodies(self, text: BlockText) -> Iterator[PlannedRequest]:
        opts = self.options
        for i, (record, ns, api) in enumerate(
            zip(self.records, self.namespaces, self.apis, strict=True)
        ):
            model = opts.model or record.model or opts.default_model
            wanted = record.output_length
            max_tokens = max(wanted if wanted is not None else opts.default_max_tokens, 1)
            body = request_body(api, model, text.prompt(record, ns, i), max_tokens)
            if opts.ignore_eos and api in ("chat", "completions"):
                body["ignore_eos"] = True
            yield PlannedRequest(i, "workload", body, api)


def plan(workload: Workload, options: ReplayOptions) -> Replay:
    """The replay of ``workload``: which records, when, on which API."""
    if options.speedup <= 0 or not math.isfinite(options.speedup):
        raise ValueError("speedup must be a number > 0")
    block_size = workload.effective_block_size(options.block_size)
    records = workload.records
    namespaces = workload.namespaces
    if options.requests is not None:
        records, namespaces = records[: options.requests], namespaces[: options.requests]
    first = records[0].timestamp if records else 0.0
    offsets = [(r.timestamp - first) / 1000.0 / options.speedup for r in records]
    if options.duration is not None:
        keep = sum(1 for o in offsets if o < options.duration)
        records, namespaces, offsets = records[:keep], namespaces[:keep], offsets[:keep]
    apis = tuple(api_of_route(r.route) or options.default_api for r in records)
    return Replay(
        workload=workload,
        records=tuple(records),
        namespaces=tuple(namespaces),
        offsets=tuple(offsets),
        apis=apis,
        block_size=block_size,
        options=options,
    )


# -- the replay beside the workload file -----------------------------------------------

PERCENTILES = (0.5, 0.9, 0.95, 0.99)


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    data = sorted(values)
    return {f"p{round(q * 100)}": (quantile(data, q) if data else None) for q in PERCENTILES}


def _share(cached: int, prompt: int) -> float | None:
    return cached / prompt if prompt > 0 else None


def _side_recorded(records: Sequence[WorkloadRecord]) -> dict[str, Any]:
    done = [r for r in records if r.outcome in (None, "completed")]
    ttft = [r.ttft_ms / 1000.0 for r in done if r.ttft_ms is not None]
    itl = [r.itl_ms_mean / 1000.0 for r in done if r.itl_ms_mean is not None]
    with_cache = [r for r in done if r.cached_tokens is not None]
    outputs = [r.output_length for r in records if r.output_length is not None]
    return {
        "requests": len(records),
        "completed": sum(1 for r in records if r.outcome == "completed")
        if any(r.outcome is not None for r in records)
        else None,
        "ttft": {"count": len(ttft), **_pcts(ttft)},
        "itl_mean": {"count": len(itl), **_pcts(itl)},
        "cache_share": _share(
            sum(r.cached_tokens or 0 for r in with_cache), sum(r.input_length for r in with_cache)
        ),
        "prompt_tokens": sum(r.input_length for r in records),
        "output_tokens": sum(outputs) if outputs else None,
    }


def _side_replayed(results: Sequence[RequestResult]) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    itl = [sum(r.itl_s) / len(r.itl_s) for r in done if r.itl_s]
    with_cache = [r for r in done if r.cached_prompt_tokens is not None and r.prompt_tokens]
    return {
        "requests": len(results),
        "completed": len(done),
        "ttft": {"count": len(ttft), **_pcts(ttft)},
        "itl_mean": {"count": len(itl), **_pcts(itl)},
        "cache_share": _share(
            sum(r.cached_prompt_tokens or 0 for r in with_cache),
            sum(r.prompt_tokens or 0 for r in with_cache),
        ),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "output_tokens": sum(r.completion_tokens or 0 for r in done),
    }


def compare(replay: Replay, results: Sequence[RequestResult], base_url: str = "") -> dict[str, Any]:
    """The replay beside the workload file, JSON-ready: per group and for all requests, plus
    the schedule kept and the lengths achieved. ``results[i]`` is the result of
    ``replay.records[i]`` (by ``index``)."""
    by_index = {r.index: r for r in results}
    pairs = [(rec, by_index.get(i)) for i, rec in enumerate(replay.records)]
    sent = [(rec, res) for rec, res in pairs if res is not None]
    groups: dict[tuple[str, str], list[tuple[WorkloadRecord, RequestResult]]] = {}
    for rec, res in sent:
        model, route = group_of(rec)
        if route == "-":
            route = route_of(res.api)
        groups.setdefault((model, route), []).append((rec, res))

    def side_pair(rows: list[tuple[WorkloadRecord, RequestResult]]) -> dict[str, Any]:
        return {
            "recorded": _side_recorded([rec for rec, _ in rows]),
            "replayed": _side_replayed([res for _, res in rows]),
        }

    lags = [res.start_s - replay.offsets[res.index] for _, res in sent]
    done = [(rec, res) for rec, res in sent if res.ok]
    size = replay.block_size
    prompt_off = [
        (res.prompt_tokens - rec.input_length) / size
        for rec, res in done
        if res.prompt_tokens is not None
    ]
    asked = [(rec, res) for rec, res in done if rec.output_length]
    exact = sum(1 for rec, res in asked if res.completion_tokens == rec.output_length)
    short = sum(
        1
        for rec, res in asked
        if res.completion_tokens is not None and res.completion_tokens < (rec.output_length or 0)
    )
    out: dict[str, Any] = {
        "base_url": base_url,
        "speedup": replay.options.speedup,
        "block_size": size,
        "workload_requests": len(replay.workload.records),
        "replayed_requests": len(sent),
        "span_s": replay.span_s,
        "workload_start": replay.workload.start.isoformat() if replay.workload.start else None,
        "all": side_pair(sent),
        "groups": [
            {"model": model, "route": route, **side_pair(rows)}
            for (model, route), rows in sorted(groups.items())
        ],
        "schedule": {
            "count": len(lags),
            "lag_p50_s": quantile(sorted(lags), 0.5) if lags else None,
            "lag_p99_s": quantile(sorted(lags), 0.99) if lags else None,
            "lag_max_s": max(lags) if lags else None,
            "lag_min_s": min(lags) if lags else None,
        },
        "lengths": {
            "prompt_blocks_off_max": max((abs(x) for x in prompt_off), default=None),
            "prompt_blocks_off_mean": (sum(prompt_off) / len(prompt_off)) if prompt_off else None,
            "outputs_asked": len(asked),
            "outputs_exact": exact,
            "outputs_short": short,
        },
        "notes": list(replay.workload.notes),
    }
    out["headline"] = headline(out)
    return out


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 1.0 else f"{value * 1000:.0f} ms"


def headline(cmp: dict[str, Any]) -> str:
    """One sentence: the replay's TTFT p95 and ITL p50 against the file's."""
    rec, rep = cmp["all"]["recorded"], cmp["all"]["replayed"]
    where = cmp.get("base_url") or "the replay's upstream"
    parts = []
    for label, key, q in (("TTFT p95", "ttft", "p95"), ("ITL p50", "itl_mean", "p50")):
        now, then = rep[key].get(q), rec[key].get(q)
        if now is None:
            continue
        text = f"{label} {_seconds(now)}"
        if then is not None:
            text += f" instead of {_seconds(then)}"
        parts.append(text)
    share_now, share_then = rep["cache_share"], rec["cache_share"]
    if share_now is not None:
        text = f"prefix cache {share_now * 100:.0f}%"
        if share_then is not None:
            text += f" instead of {share_then * 100:.0f}%"
        parts.append(text)
    if not parts:
        return f"your traffic on {where}: no request completed"
    line = f"your traffic on {where}: " + ", ".join(parts)
    if rec["ttft"]["count"] == 0:
        line += " (the file records no timings: nothing to compare with)"
    return line


def comparison_rows(cmp: dict[str, Any]) -> list[tuple[str, ...]]:
    """The side-by-side table's cells, header first (printed, and drawn in the report)."""
    rows: list[tuple[str, ...]] = [("", "recorded", "replayed")]
    blocks = [("all requests", cmp["all"])]
    if len(cmp["groups"]) > 1:
        blocks += [(f"{g['model']} {g['route']}", g) for g in cmp["groups"]]
    for title, block in blocks:
        rec, rep = block["recorded"], block["replayed"]
        rows.append((title, "", ""))
        rows.append(
            ("  requests", str(rec["requests"]), f"{rep['completed']} of {rep['requests']}")
        )
        for label, key in (("TTFT", "ttft"), ("ITL mean/request", "itl_mean")):
            for q in ("p50", "p90", "p95", "p99"):
                rows.append((f"  {label} {q} ms", ms(rec[key][q]), ms(rep[key][q])))
        rows.append(("  prefix cache hit share", pct(rec["cache_share"]), pct(rep["cache_share"])))
        rows.append(("  prompt tokens", str(rec["prompt_tokens"]), str(rep["prompt_tokens"])))
        out_rec = rec["output_tokens"]
        rows.append(
            ("  output tokens", "-" if out_rec is None else str(out_rec), str(rep["output_tokens"]))
        )
    return rows


def format_comparison(cmp: dict[str, Any]) -> str:
    """The replay beside the workload file, as printed after a ``bench --workload-file`` run."""
    return "\n".join([cmp["headline"], "", *align_columns(comparison_rows(cmp)), *notes(cmp)])


def notes(cmp: dict[str, Any]) -> list[str]:
    """The lines under the table: the schedule kept, the lengths, what to know."""
    lines = []
    sched = cmp["schedule"]
    if sched["count"]:
        lines.append(
            f"schedule: sent {ms(sched['lag_p50_s'])} ms after the planned time at p50, "
            f"{ms(sched['lag_p99_s'])} ms at p99, {ms(sched['lag_max_s'])} ms at most "
            f"(speedup {cmp['speedup']:g}, {cmp['replayed_requests']} requests over "
            f"{cmp['span_s']:.1f} s)"
        )
    lengths = cmp["lengths"]
    if lengths["prompt_blocks_off_max"] is not None:
        lines.append(
            f"lengths: prompts within {lengths['prompt_blocks_off_max']:.2f} blocks of "
            f"{cmp['block_size']} tokens of the recorded input_length; "
            f"{lengths['outputs_exact']} of {lengths['outputs_asked']} outputs exactly the "
            "recorded length"
        )
    if lengths["outputs_short"]:
        lines.append(
            f"{lengths['outputs_short']} answers ended before the recorded output length: the "
            "upstream stopped at end of sequence (vLLM and SGLang: add --ignore-eos)"
        )
    lines += cmp["notes"]
    return lines
