"""Where the doctor remembers which prompt keys were sent, and when: the
:class:`PrefixIndex` Protocol (one :meth:`~PrefixIndex.exchange` per request, all reads
before all writes, so a shared store answers it in one round trip) and the in-process
:class:`LruPrefixIndex`.

Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

SEEN = 0  # a plain sighting: recorded as ``ended``
CONTINUED = 1  # the request went on past this key
ENDED = 2  # the request's last block

# An upper bound of one entry's memory (an 8-byte key, the packed int, the OrderedDict's
# slot and node), from tracemalloc: tests/test_prefix_doctor.py checks it stays a bound.
BYTES_PER_ENTRY = 216
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_HORIZON_MS = 60 * 60 * 1000  # an hour: twelve 5-minute windows, Anthropic's long TTL
DEFAULT_WINDOW_MS = 5 * 60 * 1000  # how long a provider keeps a prefix

# An entry: four times in ticks (ms since the index's epoch; 0: none), 40 bits each
# (34 years): the ended run's latest and since, then the continued run's.
_TICK_BITS = 40
_TICK_MAX = (1 << _TICK_BITS) - 1
_ES = _TICK_BITS  # the shifts of the ended run's since, the continued run's latest, since
_CL = 2 * _TICK_BITS
_CS = 3 * _TICK_BITS


NEVER = -(1 << 62)  # the time of a sighting that never happened (or was forgotten)


class Sightings(NamedTuple):
    """What an index knew of each probe key, in the probe's order, for a request that
    arrived at ``t0``: the last time (ms) at or before ``t0`` that a request held the key
    and went on past it (a lower bound when sightings go on past ``t0``:
    ``docs/design/doctor.md``), and the same for one that held it as its last block (or
    merely saw it); :data:`NEVER` where none did. ``after``: by probe index, the keys neither kind held
    at or before ``t0`` but one held after it and at or before this request's own
    ``held_ms`` (a request whose prefill was done while this one's ran: concurrent with
    it), with the first such time; keys not in it had none. The upper bound makes it
    independent of the order of exchanges: a sighting stamped before this request's own
    was made ready before it, so it was written before this exchange. Flat lists of
    ints and a mostly empty dict, so that a prompt of thousands of blocks costs no object
    per key."""

    continued: Sequence[int]
    ended: Sequence[int]
    after: Mapping[int, int]

    def last(self, i: int) -> int:
        """The last time anything held key ``i``."""
        return max(self.continued[i], self.ended[i])


@dataclass(frozen=True, slots=True)
class Probe:
    """One request's question to the index: its keys, each with what this request does
    with it (:data:`SEEN`, :data:`CONTINUED`, :data:`ENDED`), in the order they should be
    touched (the last touched is the last an LRU forgets)."""

    keys: tuple[bytes, ...]
    marks: bytes  # one mark per key

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.marks):
            raise ValueError("a probe needs one mark per key")


class IndexUnanswered(Exception):
    """An index that could not answer an exchange (a shared store down, slow, failing).
    :meth:`proxy.doctor.examine.PrefixDoctor.look` sets ``hashed`` to the prompt's
    keys before it goes on: they are of use without the index's answer (a workload file's
    block ids), and hashing them again would double the cost of an outage."""

    hashed: object = None


class PrefixIndex(Protocol):
    """A store of key sightings: one exchange per request, all reads before all writes
    (a key the request holds twice is not seen by its own first write)."""

    def exchange(self, probe: Probe, now_ms: int, held_ms: int | None = None) -> Sightings:
        """What was known of each of ``probe.keys`` at or before ``now_ms`` (this request's
        arrival); then record that this request holds them from ``held_ms`` (its prefill
        done; ``now_ms`` when not given)."""
        ...


class LruPrefixIndex:
    """The in-process :class:`PrefixIndex`: least recently touched forgotten first.

    ``max_bytes`` bounds memory through :data:`BYTES_PER_ENTRY`; ``horizon_ms`` forgets
    entries untouched for that long; ``window_ms`` is the cache window the runs are
    cut by (``docs/design/doctor.md``). Times are stored as milliseconds since the first
    exchange (less the horizon, so that a stamp earlier than it still fits), 40 bits
    each, all four in one int, so an entry costs one small int.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        horizon_ms: int = DEFAULT_HORIZON_MS,
        window_ms: int = DEFAULT_WINDOW_MS,
        bytes_per_entry: int = BYTES_PER_ENTRY,
    ) -> None:
        if max_bytes < bytes_per_entry:
            raise ValueError(f"max_bytes must hold at least one entry ({bytes_per_entry} bytes)")
        if horizon_ms < 0:
            raise ValueError("horizon_ms must be >= 0")
        if window_ms < 0:
            raise ValueError("window_ms must be >= 0")
        self.capacity = max_bytes // bytes_per_entry
        self.horizon_ms = horizon_ms
        self.window_ms = window_ms
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._epoch: int | None = None  # the clock's ms at tick 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def _tick(self, ms: int) -> int:
        if self._epoch is None:
            self._epoch = ms - 1 - self.horizon_ms
        return min(max(1, ms - self._epoch), _TICK_MAX)

    def exchange(self, probe: Probe, now_ms: int, held_ms: int | None = None) -> Sightings:
        keys = probe.keys
        m, w = _TICK_MAX, self.window_ms
        with self._lock:
            entries = self._entries
            t = self._tick(now_ms)
            h = t if held_ms is None else self._tick(held_ms)
            self._forget_before(t - self.horizon_ms)
            get = entries.get
            before = [get(key, 0) for key in keys]
            touch = entries.move_to_end
            epoch = self._epoch if self._epoch is not None else 0
            continued: list[int] = []
            ended: list[int] = []
            after: dict[int, int] = {}
            went_on, ended_at = continued.append, ended.append
            never, on, cl_at = NEVER, CONTINUED, _CL  # locals: this loop runs per key
            fresh_on, fresh_end = (h << _CS) | (h << _CL), (h << _ES) | h
            for key, mark, old in zip(keys, probe.marks, before, strict=True):
                if not old:  # never held (or forgotten)
                    went_on(never)
                    ended_at(never)
                    entries[key] = fresh_on if mark == on else fresh_end
                    touch(key)
                    continue
                el, cl = old & m, (old >> cl_at) & m
                if cl <= t and el <= t:  # every sighting at or before t: the common case
                    went_on(cl + epoch if cl else never)
                    ended_at(el + epoch if el else never)
                else:
                    _read_late(old, t, h, w, epoch, len(continued), continued, ended, after)
                # write: this request's stamp h into the run of its kind; most stamps are
                # the run's new latest, within a window of the one before
                if mark == on:
                    if cl and cl <= h <= cl + w:
                        entries[key] = old + ((h - cl) << cl_at)
                    else:
                        entries[key] = _stamp(old, _CS, h, w)
                elif el and el <= h <= el + w:
                    entries[key] = old + (h - el)
                else:
                    entries[key] = _stamp(old, _ES, h, w)
                touch(key)
            for _ in range(len(entries) - self.capacity):
                entries.popitem(last=False)
        return Sightings(continued, ended, after)

    def _forget_before(self, oldest: int) -> None:
        """Drop the entries nobody touched since tick ``oldest`` (they are the first)."""
        entries = self._entries
        m = _TICK_MAX
        while entries:
            key = next(iter(entries))
            packed = entries[key]
            if max((packed >> _CL) & m, packed & m) >= oldest:
                break
            del entries[key]


def _read_late(
    old: int,
    t: int,
    h: int,
    w: int,
    epoch: int,
    i: int,
    continued: list[int],
    ended: list[int],
    after: dict[int, int],
) -> None:
    """Append key ``i``'s reads at tick ``t`` from an entry with a sighting after ``t``
    (``docs/design/doctor.md``), and its first sighting after ``t`` when that is all and
    it is at or before ``h``."""
    m = _TICK_MAX
    el, es, cl, cs = old & m, (old >> _ES) & m, (old >> _CL) & m, old >> _CS
    c = 0 if not cs or cs > t else cl if cl <= t else max(cs, t - w)
    e = 0 if not es or es > t else el if el <= t else max(es, t - w)
    continued.append(c + epoch if c else NEVER)
    ended.append(e + epoch if e else NEVER)
    if not c and not e:
        first = min(cs or m, es or m)
        if first <= h:
            after[i] = first + epoch


def _stamp(old: int, shift: int, h: int, w: int) -> int:
    """``old`` with the stamp ``h`` put into the run whose since is at ``shift`` (its
    latest is the 40 bits below): extended, restarted or left as it was."""
    m = _TICK_MAX
    since, latest = (old >> shift) & m, (old >> (shift - _TICK_BITS)) & m
    if not since or h > latest + w:
        since = latest = h
    elif h > latest:
        latest = h
    elif since - w <= h < since:
        since = h
    else:
        return old  # within the run already, or too late to count
    keep = old & ~(((1 << (2 * _TICK_BITS)) - 1) << (shift - _TICK_BITS))
    return keep | (since << shift) | (latest << (shift - _TICK_BITS))
