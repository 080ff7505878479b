"""Workload files in the Mooncake trace format: read, write, merge.

Design: ``docs/design/workload.md``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import secrets
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TextIO

from proxy.errors import CliError

DEFAULT_BLOCK_SIZE = 512  # tokens per hash id: the Mooncake traces' and AIPerf's default
DEFAULT_ID_CAPACITY = 262_144  # keys an IdMap remembers

STANDARD_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
OWN_FIELDS = (
    "model",
    "route",
    "upstream",
    "client",
    "cached_tokens",
    "ttft_ms",
    "itl_ms_mean",
    "outcome",
)
META_FIELDS = ("trace_start", "block_size", "trace_id")
_INT_FIELDS = {"cached_tokens"}
_FLOAT_FIELDS = {"ttft_ms", "itl_ms_mean"}
_OWN_SET = frozenset(OWN_FIELDS)
_TEXT_FIELDS = {"model", "route", "upstream", "client", "outcome"}


class WorkloadError(CliError, ValueError):
    """A workload file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class WorkloadRecord:
    """One request of a workload. Times in milliseconds; ``None``: not recorded.

    ``other`` keeps fields this tool does not know, in their order, so that a rewrite
    (``workload cut``, ``scale``, ``anonymise``) passes them on.
    """

    timestamp: float
    input_length: int
    output_length: int | None = None
    hash_ids: tuple[int, ...] = ()
    model: str | None = None
    route: str | None = None
    upstream: str | None = None
    client: str | None = None
    cached_tokens: int | None = None
    ttft_ms: float | None = None
    itl_ms_mean: float | None = None
    outcome: str | None = None
    other: tuple[tuple[str, Any], ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The line's fields in the order written: standard, ours, then the others."""
        ts = self.timestamp
        out: dict[str, Any] = {
            "timestamp": int(ts) if float(ts).is_integer() else ts,
            "input_length": self.input_length,
        }
        if self.output_length is not None:
            out["output_length"] = self.output_length
        out["hash_ids"] = list(self.hash_ids)
        for name in OWN_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        for name, value in self.other:
            out.setdefault(name, value)
        return out


@dataclass(frozen=True, slots=True)
class WorkloadMeta:
    """What the first line of a file (or segment) says about the lines after it."""

    start: datetime | None = None  # written as trace_start (the format's name)
    block_size: int | None = None
    workload_id: str | None = None  # written as trace_id (the format's name)

    def as_json(self) -> dict[str, Any]:
        start = format_time(self.start) if self.start is not None else None
        named = {"trace_start": start, "block_size": self.block_size, "trace_id": self.workload_id}
        return {name: value for name, value in named.items() if value is not None}

    @property
    def empty(self) -> bool:
        return self.start is None and self.block_size is None and self.workload_id is None


def format_time(when: datetime) -> str:
    """ISO 8601 in UTC with milliseconds, e.g. ``2026-12-01T10:00:00.000Z``."""
    return when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(text: str) -> datetime:
    """An ISO 8601 time with an offset (``Z`` allowed); raises ValueError."""
    when = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    if when.tzinfo is None:
        raise ValueError(f"{text!r} has no UTC offset")
    return when


def format_line(record: WorkloadRecord, meta: WorkloadMeta | None = None) -> str:
    """One line of a workload file, without its newline; ``meta`` fields go last."""
    obj = record.as_json()
    if meta is not None:
        obj.update(meta.as_json())
    return json.dumps(obj, separators=(", ", ": "), ensure_ascii=False, allow_nan=False)


# -- reading ---------------------------------------------------------------------------


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_record(obj: Any, where: str) -> tuple[WorkloadRecord, WorkloadMeta]:
    """A decoded line as a record and the metadata it carries; raises
    :class:`WorkloadError` naming ``where`` when a standard field is missing or wrong.

    Unknown fields are kept (:attr:`WorkloadRecord.other`); our own fields of the wrong
    type are dropped rather than refused (a public file may use a name differently).
    """
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: not a JSON object")
    ts = obj.get("timestamp")
    if ts is None:
        raise WorkloadError(
            f"{where}: no timestamp (lines scheduled by 'delay' within a session are not "
            "replayed by this tool)"
        )
    if not _number(ts) or ts < 0:
        raise WorkloadError(f"{where}: timestamp must be a number of milliseconds >= 0, got {ts!r}")
    length = obj.get("input_length")
    if length is None:
        carried = [k for k in ("text_input", "messages", "payload") if k in obj]
        why = (
            f" (it carries {carried[0]}: prompt text, which this tool does not replay)"
            if carried
            else ""
        )
        raise WorkloadError(f"{where}: no input_length{why}")
    if not _count(length):
        raise WorkloadError(f"{where}: input_length must be an integer >= 0, got {length!r}")
    out_len = obj.get("output_length")
    if out_len is not None and not _count(out_len):
        raise WorkloadError(f"{where}: output_length must be an integer >= 0, got {out_len!r}")
    ids = obj.get("hash_ids", [])
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(_count(i) for i in ids):
        raise WorkloadError(f"{where}: hash_ids must be a list of integers >= 0")
    own: dict[str, Any] = {}
    for name in OWN_FIELDS:
        value = obj.get(name)
        if value is None:
            continue
        if (
            (name in _INT_FIELDS and _count(value))
            or (name in _FLOAT_FIELDS and _number(value) and value >= 0)
            or (name in _TEXT_FIELDS and isinstance(value, str))
        ):
            own[name] = value
    known = {*STANDARD_FIELDS, *OWN_FIELDS, *META_FIELDS}
    other = tuple((k, v) for k, v in obj.items() if k not in known)
    record = WorkloadRecord(
        timestamp=ts,
        input_length=length,
        output_length=out_len,
        hash_ids=tuple(ids),
        other=other,
        **own,
    )
    return record, _parse_meta(obj, where)


def _parse_meta(obj: dict[str, Any], where: str) -> WorkloadMeta:
    start = obj.get("trace_start")
    when = None
    if start is not None:
        try:
            if not isinstance(start, str):
                raise ValueError("not a string")
            when = parse_time(start)
        except ValueError as exc:
            raise WorkloadError(
                f"{where}: trace_start must be an ISO 8601 time with an offset: {exc}"
            ) from None
    size = obj.get("block_size")
    if size is not None and (not _count(size) or size < 1):
        raise WorkloadError(f"{where}: block_size must be an integer >= 1, got {size!r}")
    workload_id = obj.get("trace_id")
    if workload_id is not None and not isinstance(workload_id, str):
        raise WorkloadError(f"{where}: trace_id must be a string")
    return WorkloadMeta(when, size, workload_id)


@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive lines of one file under one metadata line (or none)."""

    path: str
    first_line: int
    meta: WorkloadMeta
    records: tuple[WorkloadRecord, ...]


def read_segments(path: str) -> list[Segment]:
    """The segments of one file, records in file order; blank lines are skipped."""
    segments: list[Segment] = []
    meta = WorkloadMeta()
    first = 1
    records: list[WorkloadRecord] = []
    try:
        fh = open(path, encoding="utf-8")  # noqa: SIM115 - closed below, errors named
    except OSError as exc:
        raise WorkloadError(f"{path}: {exc.strerror or exc}") from None
    with fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise WorkloadError(f"{where}: not JSON: {exc}") from None
            record, line_meta = parse_record(obj, where)
            if not line_meta.empty and (line_meta != meta or not records):
                if records:
                    segments.append(Segment(path, first, meta, tuple(records)))
                meta, first, records = line_meta, number, []
            records.append(record)
    if records:
        segments.append(Segment(path, first, meta, tuple(records)))
    return segments


def expand_paths(patterns: Iterable[str]) -> list[str]:
    """Files named, or matched by a glob pattern (``'workload.jsonl.*'``), in order,
    each once. A pattern that matches nothing is kept, so opening it names it."""
    out: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for path in matches or [pattern]:
            if path not in out:
                out.append(path)
    return out


@dataclass(frozen=True, slots=True)
class Workload:
    """Records of one or more files on one time line, sorted by timestamp.

    ``namespaces[i]`` tells which id namespace ``records[i].hash_ids`` belong to
    (equal ids are equal blocks only within one namespace). ``start`` is the wall-clock
    time of timestamp 0 when the files say it. ``block_size`` is what the files say
    (``None``: they do not), ``notes`` what a reader should know (mismatched lengths).
    """

    records: tuple[WorkloadRecord, ...]
    namespaces: tuple[int, ...]
    start: datetime | None
    block_size: int | None
    paths: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def effective_block_size(self, given: int | None = None) -> int:
        if given is not None and self.block_size is not None and given != self.block_size:
            raise WorkloadError(
                f"block size {given} given, but the file says its hash_ids are blocks of "
                f"{self.block_size} tokens"
            )
        return given or self.block_size or DEFAULT_BLOCK_SIZE


def load(paths: Sequence[str], *, block_size: int | None = None) -> Workload:
    """Read ``paths`` (globs expanded) as one workload; ``docs/design/workload.md`` says
    how several files align. Raises :class:`WorkloadError`."""
    files = expand_paths(paths)
    if not files:
        raise WorkloadError("no workload file given")
    segments = [seg for path in files for seg in read_segments(path)]
    if not segments:
        raise WorkloadError(f"{', '.join(files)}: no requests in the workload")
    starts = [seg.meta.start for seg in segments]
    if any(s is None for s in starts) and any(s is not None for s in starts):
        bare = next(seg for seg in segments if seg.meta.start is None)
        raise WorkloadError(
            f"{bare.path}:{bare.first_line}: no trace_start, while other files or segments "
            "have one: their times cannot be aligned"
        )
    sizes = {seg.meta.block_size for seg in segments if seg.meta.block_size is not None}
    if len(sizes) > 1:
        raise WorkloadError(f"the files disagree on block_size: {sorted(sizes)}")
    file_size = next(iter(sizes)) if sizes else None
    origin = min((s for s in starts if s is not None), default=None)
    namespaces: dict[Hashable, int] = {}
    rows: list[tuple[float, int, WorkloadRecord, int]] = []
    for k, seg in enumerate(segments):
        key: Hashable = seg.meta.workload_id if seg.meta.workload_id is not None else ("segment", k)
        ns = namespaces.setdefault(key, len(namespaces))
        shift = 0.0
        if origin is not None and seg.meta.start is not None:
            shift = (seg.meta.start - origin).total_seconds() * 1000.0
        for record in seg.records:
            ts = record.timestamp + shift
            if shift:
                ts = round(ts, 3)
                record = replace(record, timestamp=ts)
            rows.append((ts, len(rows), record, ns))
    rows.sort(key=lambda row: (row[0], row[1]))
    size = block_size or file_size or DEFAULT_BLOCK_SIZE
    mismatched = sum(
        1
        for _, _, r, _ in rows
        if r.hash_ids and len(r.hash_ids) != max(1, -(-r.input_length // size))
    )
    notes = []
    if mismatched:
        notes.append(
            f"{mismatched} of {len(rows)} requests have a number of hash_ids that does not "
            f"match ceil(input_length / {size}): the block size may be wrong"
        )
    return Workload(
        records=tuple(r for _, _, r, _ in rows),
        namespaces=tuple(ns for _, _, _, ns in rows),
        start=origin,
        block_size=file_size,
        paths=tuple(files),
        notes=tuple(notes),
    )


# -- hash ids and writing --------------------------------------------------------------


class IdMap:
    """Keys to small integers, numbered in order of first appearance.

    Bounded: past ``capacity`` keys the least recently used is forgotten, and if it
    comes back it gets a new id (numbers are never reused, so it cannot collide). A
    prefix not seen for that long would have left any real cache as well.
    """

    def __init__(self, capacity: int = DEFAULT_ID_CAPACITY, first: int = 0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._ids: OrderedDict[Hashable, int] = OrderedDict()
        self._next = first

    def fresh(self) -> int:
        """An id no key has or will have: a block nothing else shares."""
        value = self._next
        self._next += 1
        return value

    def __call__(self, key: Hashable) -> int:
        ids = self._ids
        value = ids.get(key)
        if value is None:
            value = ids[key] = self.fresh()
            if len(ids) > self.capacity:
                ids.popitem(last=False)
        else:
            ids.move_to_end(key)
        return value


def digest_id(key: Hashable) -> int:
    """An id from a key's own bytes: the same in every process that computes the same
    digests (worker processes sharing the doctor's secret), for one id namespace across
    several files; below 2**63. Keys are ``bytes`` or tuples of ``bytes`` and ``int``
    (what :func:`token_block_keys` returns)."""
    h = hashlib.blake2b(digest_size=8)
    for part in key if isinstance(key, tuple) else (key,):
        if isinstance(part, bytes):
            h.update(part)
        elif isinstance(part, int):
            h.update(part.to_bytes(8, "big", signed=True))
        else:
            raise TypeError("digest_id needs bytes keys (or tuples of bytes and int)")
    return int.from_bytes(h.digest(), "big") >> 1


def token_block_keys(
    chain: Sequence[Hashable],
    block_ends: Sequence[int],
    prompt_bytes: int,
    input_tokens: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    bytes_per_token: float | None = None,
) -> list[Hashable]:
    """Keys per token block from a chain of byte-block keys.

    ``chain[j]`` names the prompt's prefix up to byte ``block_ends[j]`` (ascending;
    blocks may differ in size, like the doctor's, which cuts each prompt part on its
    own). Token block *i* ends at token ``min((i + 1) * block_size, input_tokens)``,
    placed in bytes with the request's ratio ``prompt_bytes / input_tokens``; its key
    is ``(chain[j], i)`` for the first *j* whose block ends at or after that byte, so
    equal keys promise equal prefixes through the token block. The last token block
    always takes the chain's last key. There are ``ceil(input_tokens / block_size)``
    keys; none without a chain or tokens. ``bytes_per_token``: the ratio to place them
    with instead, where the tokens follow no bytes the proxy sees in proportion (an image
    in the prompt): the blocks past the prompt's bytes take its last key.
    """
    if not chain or input_tokens <= 0 or prompt_bytes <= 0:
        return []
    if len(block_ends) != len(chain):
        raise ValueError("block_ends and chain differ in length")
    count = -(-input_tokens // block_size)
    ratio = bytes_per_token or prompt_bytes / input_tokens
    last = len(chain) - 1
    keys: list[Hashable] = []
    for i in range(count):
        end_tokens = min((i + 1) * block_size, input_tokens)
        if end_tokens == input_tokens:
            j = last
        else:
            j = min(bisect_left(block_ends, end_tokens * ratio - 1e-9), last)
        keys.append((chain[j], i))
    return keys


def new_workload_id() -> str:
    return secrets.token_hex(8)


class WorkloadWriter:
    """Writes one workload: a line per request, metadata on each file's first line.

    ``path``: the file, opened for appending. ``start``: (monotonic seconds, wall-clock
    seconds) of timestamp 0, read from ``clock`` and ``wall_clock`` now by default.
    ``ids``: key -> id; an :class:`IdMap` of ``id_capacity`` by default (small ids per
    writer), or :func:`digest_id` for one namespace across worker files. Not thread
    safe: one thread owns it (a capture's writer thread).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        workload_id: str | None = None,
        start: tuple[float, float] | None = None,
        ids: Callable[[Hashable], int] | None = None,
        id_capacity: int = DEFAULT_ID_CAPACITY,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.workload_id = workload_id or new_workload_id()
        self.start_monotonic, start_wall = start if start is not None else (clock(), wall_clock())
        self.start_wall = datetime.fromtimestamp(start_wall, UTC)
        self._map = IdMap(id_capacity) if ids is None else None
        self._ids: Callable[[Hashable], int] = ids if ids is not None else self._map  # type: ignore[assignment]
        self.path = os.fspath(path)
        self._fh: TextIO | None = None
        self._meta_due = True
        self.size = 0  # the open file's size, about (characters written counted as bytes)

    @property
    def meta(self) -> WorkloadMeta:
        return WorkloadMeta(self.start_wall, self.block_size, self.workload_id)

    def timestamp(self, started: float) -> int:
        """Whole milliseconds from timestamp 0 to the monotonic time ``started``."""
        return max(0, round((started - self.start_monotonic) * 1000.0))

    def hash_ids(self, keys: Sequence[Hashable], input_length: int) -> tuple[int, ...]:
        """Ids for ``keys`` (one per token block), padded with ids nothing shares or cut
        to ``ceil(input_length / block_size)``, the count readers expect."""
        count = -(-input_length // self.block_size) if input_length > 0 else 0
        out = [self._ids(key) for key in keys[:count]]
        while len(out) < count:
            out.append(self._map.fresh() if self._map is not None else secrets.randbits(63))
        return tuple(out)

    def record(
        self,
        *,
        started: float,
        input_length: int,
        output_length: int | None,
        block_keys: Sequence[Hashable] = (),
        **fields: Any,
    ) -> WorkloadRecord:
        """The record of a request that arrived at monotonic ``started``; ``fields``
        are our own (``model``, ``route``, ``upstream``, ``client``, ``cached_tokens``,
        ``ttft_ms``, ``itl_ms_mean``, ``outcome``), ``None`` ones left out."""
        if not fields.keys() <= _OWN_SET:
            unknown = fields.keys() - _OWN_SET
            raise TypeError(f"unknown workload fields: {', '.join(sorted(unknown))}")
        for name in _FLOAT_FIELDS:
            if fields.get(name) is not None:
                fields[name] = round(float(fields[name]), 3)
        return WorkloadRecord(
            timestamp=self.timestamp(started),
            input_length=input_length,
            output_length=output_length,
            hash_ids=self.hash_ids(block_keys, input_length),
            **fields,
        )

    def open(self) -> None:
        """Open the file now (it is opened at the first line otherwise): a path that
        cannot be written fails here, before any request."""
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
            self._meta_due = True
            self.size = os.fstat(self._fh.fileno()).st_size

    def write(self, record: WorkloadRecord, *, flush: bool = True) -> None:
        """Append one line (one ``write`` call, so a tailing reader never sees half)."""
        self.open()
        fh = self._fh
        assert fh is not None
        line = format_line(record, self.meta if self._meta_due else None)
        fh.write(line + "\n")
        self._meta_due = False
        self.size += len(line) + 1  # characters: bytes for the ASCII JSON lines are
        if flush:
            fh.flush()

    def rotate(self, path: str | os.PathLike[str]) -> None:
        """Close the current file; the next line starts ``path`` (with the metadata),
        same start, id namespace and ids."""
        self.close()
        self.path = os.fspath(path)

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def write_workload(
    out: TextIO,
    records: Iterable[WorkloadRecord],
    namespaces: Iterable[int],
    meta: WorkloadMeta,
) -> int:
    """Write records as one file: ids renumbered small in order of first appearance
    (per namespace, so two namespaces never merge), ``meta`` on the first line.
    Returns the number of lines."""
    ids = IdMap(capacity=1 << 62)
    count = 0
    for record, ns in zip(records, namespaces, strict=True):
        renamed = replace(record, hash_ids=tuple(ids((ns, i)) for i in record.hash_ids))
        out.write(format_line(renamed, meta if count == 0 else None) + "\n")
        count += 1
    return count


def group_of(record: WorkloadRecord) -> tuple[str, str]:
    """(model, route) for grouping; ``-`` where not recorded."""
    return record.model or "-", record.route or "-"
