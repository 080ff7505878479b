"""``llm-latency-proxy workload``: look at a workload file, cut a window, scale its rate,
anonymise it, merge files into one.

Design: ``docs/design/workload.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, time, timedelta, tzinfo
from typing import Any, TextIO

from proxy.deprecated import warn_renamed
from proxy.errors import CliError
from proxy.workload_file import (
    DEFAULT_BLOCK_SIZE,
    Workload,
    WorkloadError,
    WorkloadMeta,
    WorkloadRecord,
    load,
    new_workload_id,
    write_workload,
)

_WEEKDAYS = {
    name: i
    for i, names in enumerate(
        (
            ("mon", "monday"),
            ("tue", "tues", "tuesday"),
            ("wed", "wednesday"),
            ("thu", "thur", "thurs", "thursday"),
            ("fri", "friday"),
            ("sat", "saturday"),
            ("sun", "sunday"),
        )
    )
    for name in names
}
_OFFSET = re.compile(r"^\+(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?$")
_TIME_OF_DAY = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}(?:\.\d+)?))?$")


class WhenError(CliError, ValueError):
    """A time the user gave cannot be read or placed."""


def _zone(name: str | None) -> tzinfo | None:
    if not name:
        return None  # the machine's time zone, daylight saving included
    if name.upper() == "UTC":
        from datetime import UTC

        return UTC
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise WhenError(f"unknown time zone {name!r} (e.g. UTC, Europe/Berlin)") from None


def _localize(naive: datetime, zone: tzinfo | None) -> datetime:
    return naive.astimezone() if zone is None else naive.replace(tzinfo=zone)


def resolve_when(text: str, start: datetime | None, zone: tzinfo | None) -> float:
    """Milliseconds from the workload's start to the moment ``text`` names."""
    text = text.strip()
    match = _OFFSET.match(text)
    if match and any(match.groups()):
        hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
        return (hours * 3600 + minutes * 60 + seconds) * 1000.0
    if start is None:
        raise WhenError(
            f"{text!r}: this file has no trace_start (a public trace?): give offsets from "
            "its start, e.g. +30m"
        )
    local_start = start.astimezone(zone) if zone is not None else start.astimezone()
    words = text.split()
    day = local_start.date()
    if len(words) == 2 and words[0].lower() in _WEEKDAYS:
        ahead = (_WEEKDAYS[words[0].lower()] - day.weekday()) % 7
        day = day + timedelta(days=ahead)
        text = words[1]
    clock = _TIME_OF_DAY.match(text)
    if clock:
        hh, mm = int(clock[1]), int(clock[2])
        ss = float(clock[3]) if clock[3] else 0.0
        if hh > 23 or mm > 59 or ss >= 60:
            raise WhenError(f"{text!r} is not a time of day")
        naive = datetime.combine(day, time(hh, mm)) + timedelta(seconds=ss)
        when = _localize(naive, zone)
    else:
        try:
            parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise WhenError(
                f"{text!r}: give an ISO time (2026-12-01T10:00), a time of day (10:00), a "
                "weekday and a time (Tue 10:00) or an offset (+30m)"
            ) from None
        when = parsed if parsed.tzinfo is not None else _localize(parsed, zone)
    return (when - start).total_seconds() * 1000.0


# -- the operations (pure: a workload in, records and metadata out) --------------------


def cut(
    workload: Workload, begin: str | None, end: str | None, zone: tzinfo | None = None
) -> tuple[list[WorkloadRecord], list[int], WorkloadMeta]:
    """The records of ``[begin, end)``, re-timed from ``begin``."""
    lo = resolve_when(begin, workload.start, zone) if begin else 0.0
    hi = resolve_when(end, workload.start, zone) if end else float("inf")
    if hi <= lo and end and _TIME_OF_DAY.match(end.strip()) and begin:
        hi += 24 * 3600 * 1000.0  # "--from 23:00 --to 01:00": across midnight
    if hi <= lo:
        raise WhenError(f"the window is empty: {end!r} is not after {begin!r}")
    rows = [
        (replace(r, timestamp=round(r.timestamp - lo)), ns)  # integer ms, as the format says
        for r, ns in zip(workload.records, workload.namespaces, strict=True)
        if lo <= r.timestamp < hi
    ]
    start = workload.start + timedelta(milliseconds=lo) if workload.start is not None else None
    return [r for r, _ in rows], [ns for _, ns in rows], _new_meta(start, workload)


def scale(workload: Workload, rate: float) -> tuple[list[WorkloadRecord], list[int], WorkloadMeta]:
    """Requests ``rate`` times as often: timestamps divided by ``rate``, rounded to whole
    milliseconds (the format's integers: strict readers such as Dynamo's take ``u64``)."""
    if not rate > 0:
        raise ValueError("--rate must be > 0")
    records = [replace(r, timestamp=round(r.timestamp / rate)) for r in workload.records]
    return records, list(workload.namespaces), _new_meta(workload.start, workload)


_TIMINGS = ("cached_tokens", "ttft_ms", "itl_ms_mean", "outcome")


def anonymise(
    workload: Workload,
    *,
    drop_models: bool = False,
    drop_timings: bool = False,
    drop_start: bool = False,
    mooncake_only: bool = False,
) -> tuple[list[WorkloadRecord], list[int], WorkloadMeta]:
    """Names replaced by numbered ones (or dropped), client and unknown fields dropped."""
    names: dict[tuple[str, str], str] = {}

    def pseudonym(kind: str, value: str | None) -> str | None:
        if value is None or drop_models or mooncake_only:
            return None
        key = (kind, value)
        if key not in names:
            names[key] = f"{kind}-{sum(1 for k, _ in names if k == kind) + 1}"
        return names[key]

    out = []
    for r in workload.records:
        fields: dict[str, Any] = {
            "model": pseudonym("model", r.model),
            "upstream": pseudonym("upstream", r.upstream),
            "client": None,
            "other": (),
        }
        if mooncake_only:
            fields["route"] = None
        if drop_timings or mooncake_only:
            fields.update(dict.fromkeys(_TIMINGS))
        out.append(replace(r, **fields))
    start = None if drop_start or mooncake_only else workload.start
    workload_id = None if mooncake_only else new_workload_id()
    return out, list(workload.namespaces), WorkloadMeta(start, workload.block_size, workload_id)


def merge(workload: Workload) -> tuple[list[WorkloadRecord], list[int], WorkloadMeta]:
    """The files as one: aligned, sorted, one id numbering."""
    return list(workload.records), list(workload.namespaces), _new_meta(workload.start, workload)


def _new_meta(start: datetime | None, workload: Workload) -> WorkloadMeta:
    """What a rewritten workload's first line says: its start, the block size, a new id."""
    return WorkloadMeta(start, workload.block_size, new_workload_id())


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def info(workload: Workload) -> list[str]:
    """What a workload holds, as lines to print."""
    from proxy.bench.stats import quantile

    recs = workload.records
    size = workload.block_size or DEFAULT_BLOCK_SIZE
    span_s = (recs[-1].timestamp - recs[0].timestamp) / 1000.0
    lines = [f"files      {', '.join(workload.paths)}", f"requests   {len(recs)}"]
    if workload.start is not None:
        first = workload.start + timedelta(milliseconds=recs[0].timestamp)
        last = workload.start + timedelta(milliseconds=recs[-1].timestamp)
        local = f"{first.astimezone():%a %Y-%m-%d %H:%M:%S %Z} to {last.astimezone():%a %H:%M:%S}"
        lines.append(f"time       {local} (machine time); trace_start {workload.start.isoformat()}")
    per_minute = Counter(int(r.timestamp // 60000) for r in recs)
    rate = f"{len(recs) / span_s:.2f} requests/s on average" if span_s > 0 else "one instant"
    lines.append(
        f"span       {span_s:.1f} s ({timedelta(seconds=round(span_s))}); {rate}, "
        f"{max(per_minute.values())} requests in the busiest minute"
    )
    said = "" if workload.block_size else " (not stated by the file: the default)"
    lines.append(f"block size {size} tokens{said}")
    for label, values in (
        ("input", sorted(r.input_length for r in recs)),
        ("output", sorted(r.output_length for r in recs if r.output_length is not None)),
    ):
        if values:
            p = [quantile(values, q) for q in (0.5, 0.9, 0.99)]
            lines.append(
                f"{label:<10} tokens p50 {p[0]:.0f}, p90 {p[1]:.0f}, p99 {p[2]:.0f}, "
                f"max {values[-1]}, total {sum(values)}"
            )
    seen: set[tuple[int, int]] = set()
    reusable = 0
    for r, ns in zip(recs, workload.namespaces, strict=True):
        lead = 0
        for hid in r.hash_ids:
            if (ns, hid) not in seen:
                break
            lead += 1
        reusable += min(lead * size, r.input_length)
        seen.update((ns, hid) for hid in r.hash_ids)
    total_in = sum(r.input_length for r in recs)
    if total_in:
        lines.append(
            f"prefixes   {reusable / total_in * 100:.1f}% of prompt tokens are in leading blocks "
            "an earlier request of the workload had (what an unbounded prefix cache could serve)"
        )
    cached = [r for r in recs if r.cached_tokens is not None]
    if cached:
        share = sum(r.cached_tokens or 0 for r in cached) / max(
            sum(r.input_length for r in cached), 1
        )
        lines.append(
            f"cached     {share * 100:.1f}% of prompt tokens reported cached by the upstream"
        )
    ttft = sorted(r.ttft_ms for r in recs if r.ttft_ms is not None)
    if ttft:
        lines.append(
            f"TTFT       p50 {_ms(quantile(ttft, 0.5))}, p95 {_ms(quantile(ttft, 0.95))}, "
            f"p99 {_ms(quantile(ttft, 0.99))} (recorded)"
        )
    itl = sorted(r.itl_ms_mean for r in recs if r.itl_ms_mean is not None)
    if itl:
        lines.append(
            f"ITL        per-request mean p50 {quantile(itl, 0.5):.1f} ms, p95 "
            f"{quantile(itl, 0.95):.1f} ms (recorded)"
        )
    for label, key in (
        ("models", "model"),
        ("routes", "route"),
        ("upstreams", "upstream"),
        ("outcomes", "outcome"),
    ):
        counts = Counter(getattr(r, key) for r in recs if getattr(r, key) is not None)
        if counts:
            lines.append(f"{label:<10} " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    lines += list(workload.notes)
    return lines


# -- command line ----------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser, *, output: bool = True) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="workload file(s) or quoted glob(s)")
    if output:
        p.add_argument(
            "-o", "--output", metavar="FILE", default="-", help="where to write [default stdout]"
        )


def add_parser(subparsers: Any) -> None:
    # "trace": the command's old name, kept for one release and left out of the command
    # list (a sub-command without help is not listed); run_command warns.
    for name, listed in (("workload", True), ("trace", False)):
        _add_command(subparsers, name, listed)


def _add_command(subparsers: Any, name: str, listed: bool) -> None:
    shown = "look at, cut, scale, anonymise or merge workload files (Mooncake trace format)"
    parser = subparsers.add_parser(
        name,
        **({"help": shown} if listed else {}),
        description=(
            "Work on workload files: the shape of traffic in the Mooncake trace format (JSON "
            "Lines with timestamp, input_length, output_length, hash_ids): what a proxy "
            "capture writes, what 'bench --workload-file' and AIPerf replay. See "
            "docs/workload.md."
        ),
    )
    parser.set_defaults(func=run_command)  # for every action
    sub = parser.add_subparsers(dest="workload_command", metavar="ACTION", required=True)
    p = sub.add_parser("info", help="what a workload holds: span, rate, lengths, sharing, timings")
    _add_common(p, output=False)
    p = sub.add_parser(
        "cut",
        help="a window of the workload, e.g. --from 'Tue 10:00' --to 'Tue 11:00'",
        description="Keep the requests in [--from, --to): ISO times, times of day (10:00), "
        "weekday and time (Tue 10:00) in --tz, or offsets from the start (+30m).",
    )
    _add_common(p)
    p.add_argument("--from", dest="begin", metavar="WHEN", default=None, help="window start")
    p.add_argument("--to", dest="end", metavar="WHEN", default=None, help="window end (excluded)")
    p.add_argument(
        "--tz",
        metavar="ZONE",
        default=None,
        help="time zone of times without an offset, e.g. UTC, Europe/Berlin [default: this machine's]",
    )
    p = sub.add_parser("scale", help="multiply the request rate (timestamps divided by F)")
    _add_common(p)
    p.add_argument(
        "--rate", metavar="F", type=float, required=True, help="2: twice the rate, half the gaps"
    )
    p = sub.add_parser(
        "anonymise",
        aliases=["anonymize"],
        help="numbered model and upstream names, no client label or unknown fields",
    )
    _add_common(p)
    p.add_argument("--drop-models", action="store_true", help="drop model and upstream names")
    p.add_argument(
        "--drop-timings",
        action="store_true",
        help="drop what the upstream measured: ttft_ms, itl_ms_mean, cached_tokens, outcome",
    )
    p.add_argument("--drop-start", action="store_true", help="drop the wall-clock trace_start")
    p.add_argument(
        "--mooncake-only",
        action="store_true",
        help="keep only timestamp, input_length, output_length, hash_ids and block_size",
    )
    p = sub.add_parser("merge", help="several files (rotated, one per worker) as one file")
    _add_common(p)


Operation = Callable[[Workload], tuple[list[WorkloadRecord], list[int], WorkloadMeta]]


def _operation(args: argparse.Namespace) -> Operation:
    name = args.workload_command
    if name == "cut":
        zone = _zone(args.tz)
        return lambda t: cut(t, args.begin, args.end, zone)
    if name == "scale":
        return lambda t: scale(t, args.rate)
    if name in ("anonymise", "anonymize"):
        return lambda t: anonymise(
            t,
            drop_models=args.drop_models,
            drop_timings=args.drop_timings,
            drop_start=args.drop_start,
            mooncake_only=args.mooncake_only,
        )
    return merge


def run_command(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BrokenPipeError:  # the reader (head, less) left: it took what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 0


def _run(args: argparse.Namespace) -> int:
    prog = f"llm-latency-proxy workload {args.workload_command}"
    if getattr(args, "command", "") == "trace":
        warn_renamed("llm-latency-proxy trace", "llm-latency-proxy workload")
    try:
        workload = load(args.files)
        if args.workload_command == "info":
            print("\n".join(info(workload)))
            return 0
        records, namespaces, meta = _operation(args)(workload)
    except (WorkloadError, WhenError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if not records:
        print(f"{prog}: no request left to write", file=sys.stderr)
        return 1
    try:
        count = _write(args.output, records, namespaces, meta)
    except BrokenPipeError:
        raise
    except OSError as exc:
        print(f"{prog}: error: cannot write {args.output}: {exc}", file=sys.stderr)
        return 2
    if args.output != "-":
        print(f"{prog}: {count} requests written to {args.output}", file=sys.stderr)
    return 0


def _write(
    path: str, records: Sequence[WorkloadRecord], namespaces: Sequence[int], meta: WorkloadMeta
) -> int:
    if path == "-":
        return write_workload(sys.stdout, records, namespaces, meta)
    fh: TextIO
    with open(path, "w", encoding="utf-8") as fh:
        return write_workload(fh, records, namespaces, meta)
