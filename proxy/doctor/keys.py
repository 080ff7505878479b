"""Prompt parts in, keys out: the keyed block chain, the content-defined chunks and the
anchors of one prompt (:class:`HashedPrompt`), and nothing of its text.

Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import starmap
from typing import Any, NamedTuple

from xxhash import xxh3_128_digest

from proxy.dialects import PromptPart
from proxy.doctor.chunks import DEFAULT_CHUNK_BYTES, chunk_ends
from proxy.doctor.index import CONTINUED, ENDED, SEEN, Probe

DEFAULT_BLOCK_BYTES = 256


class PartShape(NamedTuple):
    """A part without its bytes: what a report may say about it."""

    kind: str
    index: int  # type: ignore[assignment]  # a field: shadows tuple.index
    role: str
    size: int  # bytes


class HashedPrompt(NamedTuple):
    """A prompt as keys: what the index is asked about and the report is built from.

    ``keys`` and ``marks`` are the probe (:meth:`probe`), laid out while hashing: the
    chunks, then the chain from its last block to its first, then the root and the
    anchors (so an LRU, touching them in that order, forgets chunks before the chain and
    a chain's tail before its head). Chunk positions are kept for
    :func:`proxy.doctor.examine.examine` only: sizes, never text."""

    block_bytes: int
    parts: tuple[PartShape, ...]
    root: bytes  # the scope: held by every request under it
    chain: tuple[bytes, ...]  # one key per block, each covering the prefix up to it
    first_block: tuple[int, ...]  # per part, the chain index of its first block
    chunks: tuple[bytes, ...]  # content keys, every part's in order: a chunk's bytes only
    chunk_ends: tuple[int, ...]  # where each chunk ends, in bytes from its part's start
    first_chunk: tuple[int, ...]  # per part, the index of its first chunk
    chunk_bytes: int  # a chunk's least length past a part's first (the resolution)
    anchors: tuple[bytes, bytes]  # first block under (upstream, model), under (upstream)
    keys: tuple[bytes, ...]  # the probe's keys, in touch order
    marks: bytes  # the probe's marks, one per key
    query: Probe  # the probe itself, built once (:meth:`probe`)

    @property
    def prompt_bytes(self) -> int:
        return sum(part.size for part in self.parts)

    def block_ends(self) -> list[int]:
        """Where each chain block ends, in bytes from the prompt's start (ascending):
        blocks are cut per part, so a part's last block ends where the part does."""
        ends: list[int] = []
        start = 0
        for shape in self.parts:
            end = start + shape.size
            at = start + self.block_bytes
            while at < end:
                ends.append(at)
                at += self.block_bytes
            ends.append(end)
            start = end
        return ends

    def probe(self) -> Probe:
        """The question for the index: the keys in touch order, each with its mark."""
        return self.query


def _probe(
    keys: tuple[bytes, ...],
    marks: bytes,
    chunks: int,
    first_chunk: list[int],
    first_block: list[int],
    shapes: list[PartShape],
    block_bytes: int,
    anchor: int,
) -> Probe:
    """The probe of a prompt laid out as :class:`HashedPrompt` says (``chunks`` chunk keys,
    then the chain, then three of the scope), with its nested chain and each part's
    chunks tied to a chain key held only with the part whole: its last block's where
    that block is short (a short block ends every part that holds it), else the next
    part's first block's (a whole block may go on in a longer part: a chain key names
    bytes, not where a part ends); a last part of whole blocks, to none. The scope's
    keys are held with the first block of part ``anchor``, the first part of text after
    any settings parts, whose bytes the anchors name."""
    blocks = len(keys) - chunks - 3
    top = chunks + blocks - 1  # the probe index of chain block 0
    past = (*first_chunk[1:], chunks)  # each part's chunks end where the next's begin
    nexts = (*first_block[1:], blocks)  # each part's blocks end where the next's begin
    tied: list[tuple[int, int]] = []
    for end, after, shape in zip(past, nexts, shapes, strict=True):
        if shape.size % block_bytes or not shape.size:
            tied.append((end, top - after + 1))  # its last block
        elif after < blocks:
            tied.append((end, top - after))  # the next part's first block
        else:
            break
    # the scope's keys, with the first block of text: a settings part may be followed by
    # text in another prompt, whose anchors are that text's
    text = shapes[anchor].kind != "settings"
    scoped = top - first_block[anchor] if text else -1
    return _new(Probe, (keys, marks, (chunks, chunks + blocks), tuple(tied), scoped))


_new = tuple.__new__  # a NamedTuple of all its fields, without its __new__'s Python frame
_SEEN = bytes([SEEN])
_ENDED_CHAIN = bytes([ENDED])
_CONTINUED = bytes([CONTINUED])
_SCOPE_MARKS = bytes([CONTINUED, SEEN, SEEN])  # the root, the two anchors


def _field(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return len(data).to_bytes(4, "little") + data


# Part heads (kind and role), and first blocks' anchors, whose digests a hasher keeps
# between requests (a few in practice); past this many, all are dropped.
_HEADS_MAX = 64


# Parts already hashed after the same prefix (a system prompt, tools, the history of a
# conversation), whose keys a hasher keeps between requests, up to this many keys in
# all: the least recently used part goes first.
PART_CACHE_KEYS = 1 << 16
# What one cached key costs, its part's share included (an upper bound: an 8-byte bytes
# object and its tuple slot, the part's record, state and dict entry spread over its keys)
BYTES_PER_CACHED_KEY = 96


class _HashedPart(NamedTuple):
    """One part's keys after a given prefix, and the chain's state after it."""

    chain: tuple[bytes, ...]
    chunks: tuple[bytes, ...]
    ends: tuple[int, ...]
    state: Any  # the running keyed hash after the part (a blake2b object; copied on use)


class _Lead(NamedTuple):
    """A prompt's parts but its last, laid out as :class:`HashedPrompt` lays them out, for
    a prompt that goes on with a part of its own (one system prompt, a new question)."""

    parts: tuple[PartShape, ...]
    chain: tuple[bytes, ...]
    first_block: tuple[int, ...]
    chunks: tuple[bytes, ...]
    ends: tuple[int, ...]
    first_chunk: tuple[int, ...]
    tied: tuple[tuple[int, int], ...]  # per part: the chunk index past it, its tied block
    keys: tuple[bytes, ...]  # the chain from its last block to its first, the scope's keys
    anchors: tuple[bytes, bytes]
    anchor: int
    scoped: int | None  # the chain block the scope's keys are tied to (_probe)
    state: Any  # the running keyed hash after it (copied on use)

    def leads(self, parts: Sequence[PromptPart], anchor: int) -> bool:
        """Whether these are the parts of ``parts`` but its last, whose names matched: the
        same count, anchor part and indices (which the names leave out)."""
        if self.anchor != anchor or len(self.parts) != len(parts) - 1:
            return False
        # the shorter first: no strict= (a keyword makes zip a slow call), no generator
        for shape, part in zip(self.parts, parts):  # noqa: B905, SIM110
            if shape.index != part[1]:
                return False
        return True


def _keep(cache: dict[Any, Any], key: Any, value: Any) -> None:
    """Remember ``value`` in one of a hasher's small caches, emptied when full (what they
    hold costs a few digests to make again)."""
    if len(cache) >= _HEADS_MAX:
        cache.clear()
    cache[key] = value


class PromptHasher:
    """Keyed block and chunk digests of a prompt (``docs/design/doctor.md``, "The hasher").

    ``secret`` keys every digest (random per process by default; replicas that share an
    index share it); ``block_bytes`` is the block size; ``chunk_bytes`` the least length
    of a content chunk (at most four times that); ``part_cache_keys`` bounds the keys of
    recent parts kept to hash a part seen after the same prefix again at the cost of
    one digest of its bytes, and (an eighth of them) of whole prompts, given again as
    the same object; a prompt's last part, and the prompt, are kept the second time they
    are hashed (:meth:`_again`). Thread-safe: the loop and the hashing thread share it.
    """

    def __init__(
        self,
        secret: bytes | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        *,
        part_cache_keys: int = PART_CACHE_KEYS,
    ) -> None:
        if block_bytes < 1:
            raise ValueError("block_bytes must be >= 1")
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be >= 1")
        key = secrets.token_bytes(32) if secret is None else secret
        if not 16 <= len(key) <= 64:
            raise ValueError("the secret must be 16 to 64 bytes")
        self.block_bytes = block_bytes
        self.chunk_bytes = chunk_bytes
        self.chunk_max = 4 * chunk_bytes
        # a part of two blocks or less is one chunk (a changed head's block leaves less
        # than the block of stable text a break needs); a longer one, if a kilobyte or
        # less, has its head and its tail cut off as chunks all the same, so that a
        # timestamp ahead of a short document is named (variable_before_stable)
        self.chunk_whole = min(chunk_bytes, 2 * block_bytes)

        def keyed(person: bytes) -> hashlib.blake2b:  # one domain per use of a digest
            return hashlib.blake2b(key=key, digest_size=8, person=person)

        self._root = keyed(b"prefix.root")
        self._anchor = keyed(b"prefix.anchor")
        self._part = keyed(b"prefix.part")
        self._chain = keyed(b"prefix.chain")
        self._chunk = keyed(b"prefix.chunk")
        self._blocks = struct.Struct(f"{block_bytes}s").iter_unpack  # a view's whole blocks
        # the last (upstream, model, cache key) and its (root, chain state after the
        # root, anchor states after (upstream, model) and after (upstream)) (one
        # attribute, replaced whole: the hashing thread and the loop share it)
        self._last_scope: tuple[tuple[str, str, str], tuple[bytes, Any, Any, Any]] | None = None
        self._heads: dict[tuple[str, str], bytes] = {}  # (kind, role) -> head
        # the anchors of recent first blocks (most prompts of an app open alike), by the
        # chain key of the first block, which names its scope and its bytes
        self._anchors: dict[bytes, tuple[bytes, bytes]] = {}
        # parts hashed after a given prefix, by a keyed digest of (the chain key before
        # the part, its head, its bytes' XXH3-128): a part that came after the same
        # prefix before costs one digest of its bytes, not one per block
        self._part_key = keyed(b"prefix.partkey")
        self._parts: OrderedDict[bytes, _HashedPart] = OrderedDict()
        self._parts_keys = 0  # keys held by self._parts
        self._recall_max = part_cache_keys // 8  # keys of whole prompts recalled
        self._lead_max = part_cache_keys // 16  # keys of prompts' parts but their last
        self._parts_max = part_cache_keys - self._recall_max - self._lead_max
        self._parts_lock = threading.Lock()  # the loop and the hashing thread share it
        # whole prompts hashed a moment ago, by their last chain key and anchor part
        self._prompts: dict[tuple[bytes, int], HashedPrompt] = {}
        self._recall_keys = 0
        # prompts' parts but their last (:class:`_Lead`), by the name of their last part
        self._leads: dict[bytes, _Lead] = {}
        self._lead_keys = 0
        # the names of last parts hashed once and not kept (:meth:`_again`)
        self._sighted: set[bytes] = set()
        self._sighted_max = max(_HEADS_MAX, part_cache_keys // 16)

    def _again(self, name: bytes) -> bool:
        """Whether a prompt's last part of this name was hashed before: a last part is
        kept (and its prompt, for recall) the second time, so that a question no other
        request asks (most prompts' tails) costs the caches nothing and pushes out
        nothing others repeat; a conversation's last message is hashed again as the next
        turn's history, and kept then. The names seen once are bounded, then forgotten."""
        sighted = self._sighted
        if name in sighted:
            sighted.discard(name)
            return True
        if len(sighted) >= self._sighted_max:
            sighted.clear()
        sighted.add(name)
        return False

    def _remember(self, name: bytes, part: _HashedPart) -> None:
        """Keep a part's keys for the next prompt with the same part after the same
        prefix, within :data:`PART_CACHE_KEYS` keys in all."""
        size = len(part.chain) + len(part.chunks)
        if size > self._parts_max // 4:
            return  # one huge part would push out every other
        with self._parts_lock:
            cached = self._parts
            if name in cached:
                return
            cached[name] = part
            self._parts_keys += size
            while self._parts_keys > self._parts_max:
                _, gone = cached.popitem(last=False)
                self._parts_keys -= len(gone.chain) + len(gone.chunks)

    def _digest(self, base: hashlib.blake2b, *pieces: bytes) -> bytes:
        h = base.copy()
        for piece in pieces:
            h.update(piece)
        return h.digest()

    def _scope(self, upstream: str, model: str, cache_key: str) -> tuple[bytes, Any, Any, Any]:
        key = (upstream, model, cache_key)
        last = self._last_scope
        if last is not None and last[0] == key:
            return last[1]
        root = self._digest(self._root, _field(upstream), _field(model), _field(cache_key))
        chain = self._chain.copy()
        chain.update(root)
        by_model = self._anchor.copy()
        by_model.update(_field(upstream) + _field(model))
        by_upstream = self._anchor.copy()
        by_upstream.update(_field(upstream) + b"\xff\xff\xff\xff")
        scope = (root, chain, by_model, by_upstream)
        self._last_scope = (key, scope)
        return scope

    def _part_name(self, before: bytes, head: bytes, data: bytes) -> bytes:
        """What the part cache knows a part by: the chain key before it, its head and its
        bytes' XXH3-128."""
        h = self._part_key.copy()
        h.update(before + head + xxh3_128_digest(data))
        return h.digest()

    def _head(self, kind: str, role: str) -> bytes:
        head = self._heads.get((kind, role))
        if head is None:
            head = self._digest(self._part, _field(kind), _field(role))
            _keep(self._heads, (kind, role), head)
        return head

    def hash(
        self,
        parts: Sequence[PromptPart],
        *,
        upstream: str,
        model: str,
        cache_key: str = "",
        anchor: int = 0,
    ) -> HashedPrompt | None:
        """The keys of ``parts`` under the scope (upstream, model, cache key); None for a
        prompt without parts (nothing to compare). The anchors are taken from part
        ``anchor``'s first block (the first part of the prompt text, after any settings)."""
        if not parts:
            return None
        root, chain_start, by_model, by_upstream = self._scope(upstream, model, cache_key)
        names: list[bytes] = []  # each part's name, as far as the recall got
        recalled = self._recall(parts, root, anchor, names)
        if recalled is not None:
            return recalled
        last = len(parts) - 1
        led = len(names) > last > anchor  # every part before the last known, the anchor's too
        if led:
            lead = self._leads.get(names[-2])
            if lead is not None and lead.leads(parts, anchor):
                return self._after(lead, parts[last], names[last], root)
        size = self.block_bytes
        running = chain_start.copy()  # the keyed chain hash, updated part by part
        heads, head_of = self._heads, self._head
        chain: list[bytes] = []
        first_block: list[int] = []
        chunks: list[bytes] = []  # the probe: the chunks first
        ends: list[int] = []
        first_chunk: list[int] = []
        shapes: list[PartShape] = []
        cached = self._parts
        before = root  # the chain key before this part (the root before the first)
        kept = True  # the last part is kept (it was hashed before, or is known)
        for p, (kind, index, role, data) in enumerate(parts):
            head = heads.get((kind, role)) or head_of(kind, role)
            length = len(data)
            shapes.append(PartShape(kind, index, role, length))
            first_block.append(len(chain))
            first_chunk.append(len(chunks))
            name = names[p] if p < len(names) else self._part_name(before, head, data)
            with self._parts_lock:
                known = cached.get(name)
                if known is not None:
                    cached.move_to_end(name)
            if known is not None:  # the same part after the same prefix: its keys again
                chain.extend(known.chain)
                chunks.extend(known.chunks)
                ends.extend(known.ends)
                running = known.state.copy()
                before = chain[-1]
                continue
            hashed_part = self._new_part(running, head, data, root)
            chain.extend(hashed_part.chain)
            chunks.extend(hashed_part.chunks)
            ends.extend(hashed_part.ends)
            before = chain[-1]
            if p < len(parts) - 1 or self._again(name):
                self._remember(name, hashed_part)
            else:
                kept = False
        named = chain[first_block[anchor]]  # names the scope and the blocks up to the anchor's
        anchors = self._anchors.get(named)
        if anchors is None:
            first = parts[anchor]
            block = b"\x01" + head_of(first.kind, first.role) + first.data[:size]
            anchors = (self._digest(by_model, block), self._digest(by_upstream, block))
            _keep(self._anchors, named, anchors)
        marks = _SEEN * len(chunks) + _ENDED_CHAIN + _CONTINUED * (len(chain) - 1) + _SCOPE_MARKS
        keys = chunks.copy()
        keys.extend(reversed(chain))
        keys.append(root)
        keys.extend(anchors)
        probe_keys = tuple(keys)
        hashed = HashedPrompt(
            size,
            tuple(shapes),
            root,
            tuple(chain),
            tuple(first_block),
            tuple(chunks),
            tuple(ends),
            tuple(first_chunk),
            self.chunk_bytes,
            anchors,
            probe_keys,
            marks,
            _probe(probe_keys, marks, len(chunks), first_chunk, first_block, shapes, size, anchor),
        )
        if led:  # the next prompt with these parts before a part of its own: from here
            self._lead(hashed, names[-2], anchor)
        if kept:
            self._recalled(hashed, anchor)
        return hashed

    def _recalled(self, hashed: HashedPrompt, anchor: int) -> None:
        """Keep ``hashed`` for :meth:`_recall`, within a share of the part cache's keys."""
        size = len(hashed.keys)
        if size <= self._recall_max:
            if self._recall_keys + size > self._recall_max:
                self._prompts, self._recall_keys = {}, 0
            self._prompts[hashed.chain[-1], anchor] = hashed
            self._recall_keys += size

    def _lead(self, hashed: HashedPrompt, name: bytes, anchor: int) -> None:
        """Keep the parts of ``hashed`` but its last, whose last part's name is ``name``,
        as a :class:`_Lead`, within a sixteenth of the part cache's keys (all forgotten
        when full, as the prompts recalled)."""
        known = self._parts.get(name)
        parts, first_block, first_chunk = hashed.parts, hashed.first_block, hashed.first_chunk
        last = len(parts) - 1
        blocks, chunks = first_block[last], first_chunk[last]
        size = blocks + chunks + 3  # its keys
        if known is None or size > self._lead_max:
            return
        # the probe's ties and scope (_probe's rules) as chain blocks, not probe indices
        probe, top = hashed.query, len(hashed.keys) - 4  # block i is at probe index top - i
        tied = tuple((end, top - at) for end, at in probe.tied[:last])  # each has one
        lead = _Lead(
            parts[:last],
            hashed.chain[:blocks],
            first_block[:last],
            hashed.chunks[:chunks],
            hashed.chunk_ends[:chunks],
            first_chunk[:last],
            tied,
            (*hashed.chain[blocks - 1 :: -1], *hashed.keys[-3:]),
            hashed.anchors,
            anchor,
            None if probe.scoped < 0 else top - probe.scoped,
            known.state,
        )
        if self._lead_keys + size > self._lead_max:
            self._leads, self._lead_keys = {}, 0
        self._leads[name] = lead
        self._lead_keys += size

    def _new_part(
        self, running: Any, head: bytes, data: bytes, root: bytes, *, last: bool = False
    ) -> _HashedPart:
        """The keys of a part of ``data`` under ``head`` (its kind and role) not hashed
        before: its chain blocks, from ``running`` (the keyed hash of the prompt before
        it, updated in place; ``last``: the caller's own copy, which the part keeps as its
        state, updated no more), and its content chunks, under ``root``."""
        size, condense = self.block_bytes, xxh3_128_digest
        update, snapshot = running.update, running.copy
        length = len(data)
        update(head)  # a part's first block also covers its kind and role
        if length <= size and length <= self.chunk_whole:  # one block, one chunk: one leaf
            leaf = condense(data)  # most questions and short messages: as below, in brief
            update(leaf)
            key = snapshot().digest()
            under = self._chunk.copy()
            under.update(root + head + leaf)
            return _new(_HashedPart, (
                (key,), (under.digest(),), (length,), running if last else snapshot()))
        chain: list[bytes] = []
        view = memoryview(data)
        whole = length - length % size  # bytes in whole blocks
        leaf = b""
        if whole:  # whole blocks: condensed at C speed, one key after each
            for leaf in starmap(condense, self._blocks(view[:whole])):
                update(leaf)
                chain.append(snapshot().digest())
        if whole < length or not length:  # a short last block, or an empty part
            leaf = condense(view[whole:])
            update(leaf)
            chain.append(snapshot().digest())
        under = self._chunk.copy()
        under.update(root + head)
        cut = chunk_ends(data, self.chunk_bytes, self.chunk_max, whole=self.chunk_whole)
        if length <= size and len(cut) == 1:  # one block, one chunk: one leaf
            under.update(leaf)
            chunks: tuple[bytes, ...] = (under.digest(),)
        else:
            links: list[bytes] = []
            start = 0
            for end in cut:
                link = under.copy()
                link.update(condense(view[start:end]))
                links.append(link.digest())
                start = end
            chunks = tuple(links)
        return _new(_HashedPart, (tuple(chain), chunks, tuple(cut), snapshot()))

    def _after(self, lead: _Lead, part: PromptPart, name: bytes, root: bytes) -> HashedPrompt:
        """The keys of ``lead``'s parts followed by ``part`` (named ``name``): the part's
        keys (hashed, or from the part cache) laid after the lead's, as :meth:`hash`
        lays out a prompt it hashes whole."""
        kind, index, role, data = part
        head = self._heads.get((kind, role)) or self._head(kind, role)
        with self._parts_lock:
            known = self._parts.get(name)
            if known is not None:
                self._parts.move_to_end(name)
        kept = known is not None
        if known is None:
            known = self._new_part(lead.state.copy(), head, data, root, last=True)
            if self._again(name):
                self._remember(name, known)
                kept = True
        chain = lead.chain + known.chain
        chunks = lead.chunks + known.chunks
        n, blocks = len(chunks), len(chain)
        top = n + blocks - 1  # the probe index of chain block 0
        keys = (*chunks, *known.chain[::-1], *lead.keys)
        marks = _SEEN * n + _ENDED_CHAIN + _CONTINUED * (blocks - 1) + _SCOPE_MARKS
        tied = [(end, top - block) for end, block in lead.tied]
        length = len(data)
        if length % self.block_bytes or not length:  # a short last block: its chunks' tie
            tied.append((n, top - blocks + 1))
        scoped = -1 if lead.scoped is None else top - lead.scoped
        hashed = _new(HashedPrompt, (  # C calls, not the NamedTuples' __new__ frames
            self.block_bytes,
            (*lead.parts, _new(PartShape, (kind, index, role, length))),
            root,
            chain,
            (*lead.first_block, len(lead.chain)),
            chunks,
            lead.ends + known.ends,
            (*lead.first_chunk, len(lead.chunks)),
            self.chunk_bytes,
            lead.anchors,
            keys,
            marks,
            _new(Probe, (keys, marks, (n, n + blocks), tuple(tied), scoped)),
        ))
        if kept:
            self._recalled(hashed, lead.anchor)
        return hashed

    def _recall(
        self, parts: Sequence[PromptPart], root: bytes, anchor: int, names: list[bytes]
    ) -> HashedPrompt | None:
        """The keys of a prompt hashed a moment ago, the same object again (no key is
        copied or touched), when each of its parts came after the same prefix before
        (the part cache) and the whole prompt and its shapes are one recalled; else None,
        with ``names`` holding the names of the parts it got to."""
        cached, heads, head_of = self._parts, self._heads, self._head
        before = root
        for kind, _, role, data in parts:
            name = self._part_name(before, heads.get((kind, role)) or head_of(kind, role), data)
            names.append(name)
            known = cached.get(name)  # without the lock: one lookup
            if known is None:
                return None
            before = known.chain[-1]
        hashed = self._prompts.get((before, anchor))
        if hashed is None or len(hashed.parts) != len(parts):
            return None
        for shape, (kind, index, role, data) in zip(hashed.parts, parts, strict=True):
            if shape != (kind, index, role, len(data)):
                return None
        with self._parts_lock:  # its parts are in use: the last the part cache forgets
            for name in names:
                if name in cached:
                    cached.move_to_end(name)
        return hashed
