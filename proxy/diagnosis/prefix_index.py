"""Where the prompt-cache doctor remembers which prompt blocks were sent, and when.

The doctor (:mod:`proxy.diagnosis.prefix`) turns a prompt into opaque keys (keyed
hashes, never text) and asks an index one question per request: *when did a request
last hold each of these keys, and did it go on past it?*, while telling it that this
request holds them now. That question and its answer are :class:`Probe` and a sequence
of :class:`Sightings`, per key in the probe's order; :class:`PrefixIndex` is the
Protocol every index implements with one call, :meth:`PrefixIndex.exchange`, so that
an index on another machine (a shared Redis/Valkey for several replicas) answers it
in one pipelined round trip: read every key, then write every key.

Times are integer milliseconds of the caller's clock (one clock for the whole index),
so a window comparison is exact. Every key carries two times: when a request last
held it *and went on past it* (``continued``: the key is a block with a next block in
that request) and when a request last held it *as its last block* (``ended``). A plain
sighting (a key with no successor to speak of) is recorded as ``ended``. The doctor
needs both: a request that stops sharing a prefix right where a recent request ended
is a conversation growing by a turn, while one that stops where a recent request went
on is a break.

:class:`LruPrefixIndex` is the in-process one: an ``OrderedDict`` from key to the two
times packed in one int, least recently touched first, bounded by entries (the memory
bound divided by the measured cost of one entry, :data:`BYTES_PER_ENTRY`) and by age
(``horizon_ms``: entries nobody touched for that long are dropped even below the
bound; they are kept past the cache window so that the doctor can still say a prefix
*expired*). It is thread-safe (one lock), so the doctor may run in a worker thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

SEEN = 0  # a plain sighting: recorded as ``ended``
CONTINUED = 1  # the request went on past this key
ENDED = 2  # the request's last block

# Measured with tracemalloc (tests/test_prefix_index.py checks it stays an upper bound):
# an 8-byte bytes key (48 bytes allocated), the packed int (40), the OrderedDict's
# table slot and linked-list node (about 105 amortised over growth), rounded up.
BYTES_PER_ENTRY = 200
DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # about 335,000 entries
DEFAULT_HORIZON_MS = 60 * 60 * 1000  # an hour: twelve 5-minute windows, Anthropic's long TTL

_TICK_BITS = 40  # milliseconds: 34 years
_TICK_MAX = (1 << _TICK_BITS) - 1
_LOW = _TICK_MAX
_HIGH = _TICK_MAX << _TICK_BITS


NEVER = -(1 << 62)  # the time of a sighting that never happened (or was forgotten)


class Sightings(NamedTuple):
    """What an index knew before this request, per probe key, in the probe's order: the
    last time (ms) a request held the key and went on past it, and the last time one
    held it as its last block (or merely saw it); :data:`NEVER` where none did. Two flat
    lists of ints, so that a prompt of thousands of blocks costs no object per key."""

    continued: Sequence[int]
    ended: Sequence[int]

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


class PrefixIndex(Protocol):
    """A store of key sightings: one exchange per request, all reads before all writes
    (a key the request holds twice is not seen by its own first write)."""

    def exchange(self, probe: Probe, now_ms: int) -> Sightings:
        """What was known of each of ``probe.keys`` before now; then record that this
        request holds them at ``now_ms``."""
        ...


class LruPrefixIndex:
    """The in-process :class:`PrefixIndex`: least recently touched forgotten first.

    ``max_bytes`` bounds memory through :data:`BYTES_PER_ENTRY`; ``horizon_ms`` forgets
    entries untouched for that long. Times are stored as milliseconds since the first
    exchange (40 bits each, both in one int), so an entry costs one small int.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        horizon_ms: int = DEFAULT_HORIZON_MS,
        bytes_per_entry: int = BYTES_PER_ENTRY,
    ) -> None:
        if max_bytes < bytes_per_entry:
            raise ValueError(f"max_bytes must hold at least one entry ({bytes_per_entry} bytes)")
        if horizon_ms < 0:
            raise ValueError("horizon_ms must be >= 0")
        self.capacity = max_bytes // bytes_per_entry
        self.horizon_ms = horizon_ms
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._epoch: int | None = None  # the clock's ms at tick 1
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def _tick(self, now_ms: int) -> int:
        if self._epoch is None:
            self._epoch = now_ms - 1
        return min(max(1, now_ms - self._epoch), _TICK_MAX)

    def exchange(self, probe: Probe, now_ms: int) -> Sightings:
        keys = probe.keys
        with self._lock:
            entries = self._entries
            tick = self._tick(now_ms)
            self._forget_before(tick - self.horizon_ms)
            get = entries.get
            before = [get(key, 0) for key in keys]
            went_on = tick << _TICK_BITS
            touch = entries.move_to_end
            epoch = self._epoch if self._epoch is not None else 0
            continued: list[int] = []
            ended: list[int] = []
            for key, mark, old in zip(keys, probe.marks, before, strict=True):
                entries[key] = ((old & _LOW) | went_on if mark == CONTINUED
                                else (old & _HIGH) | tick)
                touch(key)
                continued.append((old >> _TICK_BITS) + epoch if old > _LOW else NEVER)
                ended.append((old & _LOW) + epoch if old & _LOW else NEVER)
            for _ in range(len(entries) - self.capacity):
                entries.popitem(last=False)
        return Sightings(continued, ended)

    def _forget_before(self, oldest: int) -> None:
        """Drop the entries nobody touched since tick ``oldest`` (they are the first)."""
        entries = self._entries
        while entries:
            key = next(iter(entries))
            packed = entries[key]
            if max(packed >> _TICK_BITS, packed & _LOW) >= oldest:
                break
            del entries[key]
