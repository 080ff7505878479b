"""Where the doctor remembers which prompt keys were sent, and when: the
:class:`PrefixIndex` Protocol (one :meth:`~PrefixIndex.exchange` per request, all reads
before all writes, so a shared store answers it in one round trip) and the in-process
:class:`LruPrefixIndex`.

Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import NamedTuple, Protocol, overload

SEEN = 0  # a plain sighting: recorded as ``ended``
CONTINUED = 1  # the request went on past this key
ENDED = 2  # the request's last block

# An upper bound of one entry's memory (an 8-byte key, the packed int, the OrderedDict's
# slot and node), from tracemalloc: tests/test_prefix_doctor.py checks it stays a bound.
BYTES_PER_ENTRY = 216
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_HORIZON_MS = 60 * 60 * 1000  # an hour: twelve 5-minute windows, Anthropic's long TTL
DEFAULT_WINDOW_MS = 5 * 60 * 1000  # how long a provider keeps a prefix
# A prompt held whole this small a share of the window ago is not written again: its
# stamps stay within that share of the truth (``LruPrefixIndex.exchange``).
SETTLE_PER_WINDOW = 256

# An entry: four times in ticks (ms since the index's epoch; 0: none), 40 bits each
# (34 years): the ended run's latest and since, then the continued run's.
_TICK_BITS = 40
_TICK_MAX = (1 << _TICK_BITS) - 1
_ES = _TICK_BITS  # the shifts of the ended run's since, the continued run's latest, since
_CL = 2 * _TICK_BITS
_CS = 3 * _TICK_BITS


_new = tuple.__new__  # a NamedTuple of all its fields, without its __new__'s Python frame
NEVER = -(1 << 62)  # the time of a sighting that never happened (or was forgotten)


class Sightings(Protocol):
    """What an index knew of each probe key, in the probe's order, for a request that
    arrived at ``t0``: the last time (ms) at or before ``t0`` that a request held the key
    and went on past it (a lower bound when sightings go on past ``t0``:
    ``docs/design/doctor.md``), and the same for one that held it as its last block (or
    merely saw it); :data:`NEVER` where none did. ``after``: by probe index, the keys
    neither kind held at or before ``t0`` but one held after it and at or before this
    request's own ``held_ms`` (a request whose prefill was done while this one's ran:
    concurrent with it), with the first such time; keys not in it had none. The upper
    bound makes it independent of the order of exchanges: a sighting stamped before
    this request's own was made ready before it, so it was written before this exchange.
    Read by key (:meth:`last`, :meth:`times`, :meth:`late`), so that a prompt of
    thousands of blocks costs no object per key: :class:`SightingLists` from a shared
    store, the in-process index's entries decoded where asked."""

    @property
    def continued(self) -> Sequence[int]: ...
    @property
    def ended(self) -> Sequence[int]: ...
    @property
    def after(self) -> Mapping[int, int]: ...

    def last(self, i: int) -> int:
        """The last time anything held key ``i``."""
        ...

    def times(self, i: int) -> tuple[int, int]:
        """Key ``i``'s two times: (continued, ended)."""
        ...

    def late(self, i: int) -> bool:
        """Whether key ``i`` is in :attr:`after`."""
        ...

    @property
    def unheld(self) -> tuple[int, int]:
        """Probe indices ``[lo, hi)`` whose keys no request held before this exchange (or
        all were forgotten): each reads as :data:`NEVER` and not :meth:`late`, so a
        reader may skip them. ``(0, 0)`` where the index does not say."""
        ...


class SightingLists(NamedTuple):
    """:class:`Sightings` as flat lists of ints and a mostly empty dict, as a shared store
    answers."""

    continued: Sequence[int]
    ended: Sequence[int]
    after: Mapping[int, int]

    def last(self, i: int) -> int:
        return max(self.continued[i], self.ended[i])

    def times(self, i: int) -> tuple[int, int]:
        return self.continued[i], self.ended[i]

    def late(self, i: int) -> bool:
        return i in self.after

    @property
    def unheld(self) -> tuple[int, int]:
        return (0, 0)  # a shared store does not say


class _ProbeFields(NamedTuple):
    keys: tuple[bytes, ...]
    marks: bytes  # one mark per key
    # keys[start:stop] nest: a request that held one held every key after it in the range
    # (a prompt's chain from its last block to its first)
    nested: tuple[int, int] = (0, 0)
    # per part of the prompt, in order (none past the first part without one): the probe
    # index past its chunks, and that of a chain key (in ``nested``) held only with the
    # part whole, so with its chunks (``proxy.doctor.keys._probe``)
    tied: tuple[tuple[int, int], ...] = ()
    # the probe index of a key in ``nested`` whose holders held every key past ``nested``
    # too (a prompt's scope: held with its first block of text); -1: none
    scoped: int = -1


class Probe(_ProbeFields):
    """One request's question to the index: its keys, each with what this request does
    with it (:data:`SEEN`, :data:`CONTINUED`, :data:`ENDED`), in the order they should be
    touched (the last touched is the last an LRU forgets). Checked when made; the
    hasher, whose probes agree by construction, makes them with ``tuple.__new__``
    (no Python frame a request)."""

    __slots__ = ()

    def __new__(
        cls,
        keys: tuple[bytes, ...],
        marks: bytes,
        nested: tuple[int, int] = (0, 0),
        tied: tuple[tuple[int, int], ...] = (),
        scoped: int = -1,
    ) -> Probe:
        if len(keys) != len(marks):
            raise ValueError("a probe needs one mark per key")
        if not 0 <= nested[0] <= nested[1] <= len(keys):
            raise ValueError("a probe's nested range must lie within its keys")
        return tuple.__new__(cls, (keys, marks, nested, tied, scoped))


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
    cut by (``docs/design/doctor.md``); ``settle_ms`` (default the window over
    :data:`SETTLE_PER_WINDOW`; 0: never) how recently a request must have ended on the
    same last key for an exchange to leave every entry as it is (:meth:`exchange`).
    Times are stored as milliseconds since the first
    exchange (less the horizon, so that a stamp earlier than it still fits), 40 bits
    each, all four in one int, so an entry costs one small int.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        horizon_ms: int = DEFAULT_HORIZON_MS,
        window_ms: int = DEFAULT_WINDOW_MS,
        settle_ms: int | None = None,
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
        self.settle_ms = window_ms // SETTLE_PER_WINDOW if settle_ms is None else settle_ms
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        self._epoch: int | None = None  # the clock's ms at tick 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def exchange(self, probe: Probe, now_ms: int, held_ms: int | None = None) -> Sightings:
        """See :meth:`PrefixIndex.exchange`. A key whose run of sightings of this
        request's kind already holds ``held_ms``, or ends at most ``settle_ms`` before it,
        is neither written nor touched (``docs/design/doctor.md``, "Settled keys"): a
        prompt held whole so (its last key) writes nothing and reads one key now, the
        rest when asked; of the others, the covered head of ``probe.nested`` (found by
        bisection: its keys nest) is skipped with the chunks ``probe.tied`` ties to it
        and, holding ``probe.scoped``, the keys past the range, and read only when
        asked, as the keys of a prompt held whole are: only the keys it writes or evicts
        keep their entries from before. The runs' latest stamps lag up to ``settle_ms``,
        so a run may be read as expired that much early."""
        keys, marks = probe.keys, probe.marks
        m, w, settle = _TICK_MAX, self.window_ms, self.settle_ms
        with self._lock:
            entries = self._entries
            epoch = self._epoch  # the clock's ms at tick 0, from the first exchange
            if epoch is None:
                epoch = self._epoch = now_ms - 1 - self.horizon_ms
            t = now_ms - epoch  # ticks: ms since the epoch, 1 to 40 bits
            t = 1 if t < 1 else m if t > m else t
            if held_ms is None:
                h = t
            else:
                h = held_ms - epoch
                h = 1 if h < 1 else m if h > m else h
            self._forget_before(t - self.horizon_ms)
            get = entries.get
            whole = marks.find(ENDED) if settle else -1
            old = get(keys[whole], 0) if whole >= 0 else 0
            el = old & m
            if el and (old >> _ES) & m <= h <= el + settle:  # nothing to write: read later
                return _new(_Snapshot, (keys, get, {}, len(keys), t, h, w, epoch, (0, 0)))
            before: dict[bytes, int] = {}  # the entries, before, of keys it writes or evicts
            start, stop = probe.nested
            cut = stop  # the covered head of the nested range: from here to ``stop``
            # a run ending at or after ``floor`` ends at most a settle before h (and is
            # one: floor >= 1); without a settle, none is
            floor = max(1, h - settle) if settle else m + 1
            if settle:
                low = start + 1 if start < stop and marks[start] == ENDED else start
                mid = low  # first the whole range: a new last part after a covered head
                while low < cut:  # where the covered head starts, by bisection
                    old = get(keys[mid], 0)
                    if (old >> _CL) & m >= floor and old >> _CS <= h:
                        cut = mid
                    else:
                        low = mid + 1
                    mid = (low + cut) // 2
            skip = 0  # the chunks of the parts the covered head holds whole
            for chunks_end, at in probe.tied:
                if at < cut:
                    break
                skip = chunks_end
            touch = entries.move_to_end
            on, cl_at = CONTINUED, _CL  # locals: this loop runs per key
            fresh_on, fresh_end = (h << _CS) | (h << _CL), (h << _ES) | h
            rest = stop if cut <= probe.scoped < stop else len(keys)  # the scope's: held
            # keys and marks: equal lengths, so no strict= (a keyword makes zip a slow call)
            written: Iterable[tuple[bytes, int]]
            written = zip(keys[skip:cut], marks[skip:cut])  # noqa: B905
            if rest > stop:
                written = chain(written, zip(keys[stop:rest], marks[stop:rest]))  # noqa: B905
            for key, mark in written:
                # this request's stamp h into the run of its kind, unless the run holds it
                # already or ends at most a settle before it; most stamps are the run's
                # new latest, within a window of the one before. A key held twice by the
                # prompt (two equal chunks) is read as before its first write.
                old = before.setdefault(key, get(key, 0))
                if not old:  # never held (or forgotten): written last, no touch
                    entries[key] = fresh_on if mark == on else fresh_end
                    continue
                if mark == on:
                    cl = (old >> cl_at) & m
                    if cl >= floor and old >> _CS <= h:
                        continue
                    if cl and cl <= h <= cl + w:
                        entries[key] = old + ((h - cl) << cl_at)
                    else:
                        entries[key] = _stamp(old, _CS, h, w)
                else:
                    el = old & m
                    if el >= floor and (old >> _ES) & m <= h:
                        continue
                    if el and el <= h <= el + w:
                        entries[key] = old + (h - el)
                    else:
                        entries[key] = _stamp(old, _ES, h, w)
                touch(key)
            over = len(entries) - self.capacity
            while over > 0:  # a key read later: as it was
                gone, old = entries.popitem(last=False)
                before.setdefault(gone, old)
                over -= 1
            lo = cut  # the keys it wrote that nobody held, from the covered head back
            while lo > skip and not before[keys[lo - 1]]:
                lo -= 1
        return _new(_Snapshot, (keys, get, before, len(keys), t, h, w, epoch, (lo, cut)))

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


def _read_late(old: int, t: int, h: int, w: int, epoch: int) -> tuple[int, int, int | None]:
    """A key's reads at tick ``t`` (continued, ended) from an entry with a sighting after
    ``t`` (``docs/design/doctor.md``), and its first sighting after ``t`` when that is all
    and it is at or before ``h`` (else None)."""
    m = _TICK_MAX
    el, es, cl, cs = old & m, (old >> _ES) & m, (old >> _CL) & m, old >> _CS
    c = 0 if not cs or cs > t else cl if cl <= t else max(cs, t - w)
    e = 0 if not es or es > t else el if el <= t else max(es, t - w)
    first = None
    if not c and not e:
        soonest = min(cs or m, es or m)
        if soonest <= h:
            first = soonest + epoch
    return c + epoch if c else NEVER, e + epoch if e else NEVER, first


class _Snapshot(NamedTuple):
    """The in-process index's :class:`Sightings`: a probe's entries as they were before an
    exchange's writes, decoded per key only when asked (by the rules of
    ``docs/design/doctor.md``; the columns and ``after`` too, made when read): a key the
    exchange wrote or evicted from its entry before (``before``, by key), any other from
    the index (``get``) when asked, by the same rules (a stamp written since is read as
    it would be had its exchange come first), without the lock: a lookup is whole under
    the GIL. Made by ``tuple.__new__`` with every field (a C call, not a frame)."""

    keys: Sequence[bytes]
    get: Callable[[bytes, int], int]
    before: dict[bytes, int]
    n: int  # len(keys)
    t: int
    h: int
    w: int
    epoch: int
    unheld: tuple[int, int]  # the Protocol's property, as a field

    def read(self, i: int) -> tuple[int, int, int | None]:
        key = self.keys[i]
        old = self.before.get(key, -1)  # written by the exchange: its entry before
        if old < 0:
            old = self.get(key, 0)
        if not old:
            return NEVER, NEVER, None
        m, t, epoch = _TICK_MAX, self.t, self.epoch
        el, cl = old & m, (old >> _CL) & m
        if cl <= t and el <= t:  # every sighting at or before t: the common case
            return cl + epoch if cl else NEVER, el + epoch if el else NEVER, None
        return _read_late(old, t, self.h, self.w, epoch)

    def last(self, i: int) -> int:
        """The later of :meth:`read`'s two times, decoded at once where every sighting is
        at or before ``t`` (the examination asks this of most keys it reads)."""
        key = self.keys[i]
        old = self.before.get(key, -1)  # written by the exchange: its entry before
        if old < 0:
            old = self.get(key, 0)
        if not old:
            return NEVER
        m, t = _TICK_MAX, self.t
        el, cl = old & m, (old >> _CL) & m
        if cl <= t and el <= t:
            return max(cl, el) + self.epoch
        continued, ended, _ = _read_late(old, t, self.h, self.w, self.epoch)
        return max(continued, ended)

    def times(self, i: int) -> tuple[int, int]:
        continued, ended, _ = self.read(i)  # decoded once for both
        return continued, ended

    def late(self, i: int) -> bool:
        return 0 <= i < self.n and self.read(i)[2] is not None

    @property
    def continued(self) -> Sequence[int]:
        return _Column(self, 0)

    @property
    def ended(self) -> Sequence[int]:
        return _Column(self, 1)

    @property
    def after(self) -> Mapping[int, int]:
        return _After(self)


class _Column(Sequence[int]):
    """One kind of read (0: continued, 1: ended) of a :class:`_Snapshot`, by probe index."""

    __hash__ = None  # type: ignore[assignment]  # equal to a list of the same reads
    __slots__ = ("_kind", "snapshot")

    def __init__(self, snapshot: _Snapshot, kind: int) -> None:
        self.snapshot, self._kind = snapshot, kind

    def __len__(self) -> int:
        return self.snapshot.n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            return [self[j] for j in range(self.snapshot.n)[i]]
        value = self.snapshot.read(i)[self._kind]
        assert value is not None
        return value


class _After(Mapping[int, int]):
    """The ``after`` reads of a :class:`_Snapshot`: keys held only after its ``t``."""

    __slots__ = ("_snapshot",)

    def __init__(self, snapshot: _Snapshot) -> None:
        self._snapshot = snapshot

    def __getitem__(self, i: int) -> int:
        first = self._snapshot.read(i)[2] if 0 <= i < self._snapshot.n else None
        if first is None:
            raise KeyError(i)
        return first

    def __contains__(self, i: object) -> bool:  # Mapping's raises and catches a KeyError
        return isinstance(i, int) and self._snapshot.late(i)

    def __iter__(self) -> Iterator[int]:
        read = self._snapshot.read
        return (i for i in range(self._snapshot.n) if read(i)[2] is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


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
