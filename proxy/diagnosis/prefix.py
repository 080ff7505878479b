"""The prompt-cache doctor: how much of a prompt repeated a recent request's prefix,
how much of it the upstream reported as cached, and where and why the prefix broke.

A prefix cache reuses the work of a prompt's leading tokens when they are
byte-identical to a recent request's. The proxy sees every prompt, so it can tell what
a cache *could* have served, compare it with what the upstream *reports* it served,
and name the first place where a prompt stopped repeating. Everything here is a pure
function of its inputs (parts, keys, sightings, an injected time in milliseconds); the
one piece of state, the index of recent sightings, sits behind
:class:`~proxy.diagnosis.prefix_index.PrefixIndex`.

The steps, for one request:

1. :class:`PromptHasher` cuts the prompt's parts (:meth:`proxy.dialects.Dialect.prompt_parts`)
   into blocks of :data:`DEFAULT_BLOCK_BYTES` bytes and hashes them into a
   :class:`HashedPrompt`. No text is kept, only 8-byte digests.

   * The **chain**: block *i*'s key covers block *i* and block *i - 1*'s key, so it
     names the whole prefix up to it, seeded by the request's scope (upstream, model,
     ``prompt_cache_key``/``cache_salt``: two models never share a prefix). Blocks are
     cut from the start of each part, and a part's first block also covers its kind
     and role; a part's last block may be short. Cutting per part rather than across
     the joined text costs a short block per part but makes every part boundary exact:
     a conversation that grows by a message repeats its previous request whole, and a
     break is placed in the part where it happened.
   * The **chunks**: per part, content-defined chunks (:func:`chunk_ends`: cut at
     paragraph breaks, newlines and sentence ends, from a least to a most length), each
     keyed by its bytes, the part's kind and role and the scope, never its offset. So
     the same text has the same chunk keys wherever it sits in a part, and cuts line
     up again soon after a changed run of another length (a user name, a timestamp
     written differently). They answer "was the text after the break seen before?"
     anywhere in a part. A chunk other than a part's first and last is at least a
     block long (a paragraph of a quarter of :data:`DEFAULT_CHUNK_BYTES`), mostly a
     kilobyte or a paragraph, so a prompt has fewer chunk keys than blocks, and a part
     at most two more than its blocks.
   * Two **anchors**: the first block of prompt text (after any ``settings`` parts) under
     the upstream and model only, and under the upstream only: they tell a changed
     ``prompt_cache_key`` and a changed model from a prompt never seen.

   Every key is a keyed ``blake2b`` digest (8 bytes), with the secret random per process
   (:class:`PromptHasher` takes a shared one for several replicas), so a dump of the
   index cannot be matched against a dictionary of candidate prompts: each is one keyed
   digest of a short input, the bytes condensed first by XXH3-128 (xxhash), which costs
   a fraction of a keyed digest per block. A chain key is a snapshot of one running
   keyed state fed the part heads and block digests; a chunk key a keyed digest of the
   scope, the part head and the chunk's digest. Nothing unkeyed is stored: XXH3 is no
   pseudorandom function (its seed could be recovered or worked around from known text,
   and a chain built on it alone would let a dump confirm guessed text block by block),
   so it only condenses, and a secret keys every stored value (``docs/prompt-caching.md``,
   "Privacy", has the analysis; ``benchmarks/prefix_micro.py`` prices both hashes).

2. The index (:class:`~proxy.diagnosis.prefix_index.LruPrefixIndex` in process) answers
   when each key was last held at or before this request arrived, counting a request's
   sighting only from when its prefill was done (what a cache can serve), and by a
   request that went on past it or ended there, and records this request from when its
   own prefill was done (:meth:`HashedPrompt.probe` orders the keys so that an LRU
   forgets a prompt's chunks first, then its chain from the tail).

3. :func:`diagnose` reads the answer into a :class:`PrefixReport`:

   * **repeated**: the longest run of leading chain blocks some request held within the
     cache window (``PrefixPolicy.window_ms``, 5 minutes by default, what providers
     keep). With no eviction it equals the longest common block prefix with any
     request of the window (a property test checks that against brute force).
   * **where and why it broke**, when it stopped short of the whole prompt: ``expired``
     when the next block was held, but longer ago than the window; ``concurrent`` when
     it was held only by requests whose prefill was done after this one arrived and
     before its own was (the same prompt in flight at once: no cache could have served
     it). Otherwise, when the
     last repeated block is where a recent request *ended* (the previous turn of a
     conversation that grew), there is no break; when no recent request ever went
     past it, neither. When one did, the prompt broke from the most similar recent
     request (the one sharing the longest prefix) at the next block, in part *p*:
     ``settings_changed`` when *p* is a ``settings`` part (a request setting such as
     ``response_format``, named by its role; the settings parts come first, and only
     when the body gives them). Else ``variable_before_stable`` when, from that block
     on, part *p* has a short changed run (chunks not seen recently; at most ``short_run_bytes``, two blocks, a chunk's
     least length and 256 bytes by default) followed by a run of chunks seen recently,
     with ``stable_bytes`` (that run, plus the following parts seen whole when it
     reaches the part's end) at least ``min_stable_bytes`` (a block): the app put
     variable material ahead of stable material, anywhere in a part, the last one
     included (a timestamp ahead of a document in the newest message). When the whole
     rest of *p* was seen (a part moved, not varied), that is no changed run. Else, when
     *p* is the prompt's last part, no break: its newest message is new by nature (a
     new question after the same system prompt or the same document). Else a
     break named for *p*'s kind: ``tools_changed``, ``system_changed``,
     ``instructions_changed``, ``context_changed``, ``message_changed`` (messages and
     input items), ``prompt_changed``. When not even the first block repeated and
     nothing under this scope was held recently: ``cache_key_changed`` or
     ``model_changed`` when the first block was held under the same upstream and
     model with another key, or under the same upstream with another model, else
     ``first_seen``. A break inside a ``context`` part (Responses' stored context, named by
     ``previous_response_id`` or ``conversation``) is no break: a new id each turn is
     how that API works; and the repeat never runs past a ``conversation`` part, whose
     stored items grow under the same id (:func:`_stored_context`).
   * Positions (part kind, index, role, byte offset of the block in that part, the
     changed run and stable run) are multiples of the block size from the part's start
     (a stable run's start rounded up, its end down, unless it is the part's end, which
     is exact), so no chunk boundary, which follows the text, is reported. They belong
     in the request log and on the live page; only the
     reason and the part kind are bounded enough for a label.

4. :func:`cache_tokens` converts bytes to tokens with the request's own ratio
   (``prompt_tokens / prompt bytes``) once usage is known, and derives **missed** =
   repeated - reported (floored at 0; None when the upstream did not report cached
   tokens; None for a prompt with stored context the proxy cannot see, whose tokens the
   usage counts; 0 when the cacheable part of the repeated prefix, rounded down to the
   caching step, is shorter than the provider's minimum cacheable length,
   :func:`minimum_cacheable_tokens`).

The values made per request (:class:`PartShape`, :class:`HashedPrompt`,
:class:`PrefixReport`, :class:`CacheTokens`, the parts themselves) are NamedTuples, not
frozen dataclasses: as immutable, and cheaper to make (a frozen dataclass sets each
field through ``object.__setattr__``: 1.75 us for a report against about 0.8). Small
costs count here: code that runs once per request between other streams' events runs
with cold CPU caches, several times slower than in a loop (``benchmarks/timing_shim``
times it inside a running proxy).

Block size: 256 bytes, about 64 tokens at four bytes a token, chosen from
``benchmarks/prefix_micro.py`` (CPU per request of the whole doctor, parts to report,
and bytes per index entry with ``tracemalloc``; its figures are in
``benchmarks/RESULTS.md``). The cost is per key, not per byte: a keyed digest and an
index entry cost the same for any short input, so halving the block doubles CPU and
memory. A prompt has one chain key a block and mostly fewer chunk keys than blocks
(a part at most two more than its blocks), so about one to two index entries a block;
:data:`~proxy.diagnosis.prefix_index.BYTES_PER_ENTRY` bounds an entry, and
``docs/prompt-caching.md`` says how much distinct prompt text the default bound
remembers. What 256 bytes give up is resolution, and no report needs more: 64 tokens
is half the step OpenAI reports cached tokens in (128 after the first 1,024), a break
placed within 256 bytes points at the line that changed, and a part's last block is
exact. The routers' 64 bytes (one vLLM block of 16 tokens) fit a router, which matches
a bounded head of a prompt (a few hundred blocks) to pick a replica; the doctor hashes
all of it.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import struct
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import starmap
from typing import Any, NamedTuple

from xxhash import xxh3_128_digest

from proxy.diagnosis.prefix_index import (
    CONTINUED,
    DEFAULT_WINDOW_MS,
    ENDED,
    NEVER,
    SEEN,
    IndexUnanswered,
    PrefixIndex,
    Probe,
    Sightings,
)
from proxy.dialects import PromptPart

DEFAULT_BLOCK_BYTES = 256
DEFAULT_CHUNK_BYTES = 1024  # a content chunk's least length (its most: four times that)
FIRST_CHUNK_BYTES = 16  # the least length of a part's first chunk

# Why a prefix stopped repeating: bounded, fit for a metric label.
REASONS: tuple[str, ...] = (
    "settings_changed",
    "tools_changed",
    "system_changed",
    "instructions_changed",
    "context_changed",  # no longer given (a new stored context is no break); kept in the set
    "message_changed",
    "prompt_changed",
    "variable_before_stable",
    "expired",
    "concurrent",
    "model_changed",
    "cache_key_changed",
    "first_seen",
)
_KIND_REASON = {
    "settings": "settings_changed",
    "tools": "tools_changed",
    "system": "system_changed",
    "instructions": "instructions_changed",
    "context": "context_changed",
    "message": "message_changed",
    "input": "message_changed",
    "prompt": "prompt_changed",
}


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
    a chain's tail before its head). Chunk positions are kept for :func:`diagnose` only:
    sizes, never text."""

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
        return Probe(self.keys, self.marks)


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


def _keep(cache: dict[Any, Any], key: Any, value: Any) -> None:
    """Remember ``value`` in one of a hasher's small caches, emptied when full (what they
    hold costs a few digests to make again)."""
    if len(cache) >= _HEADS_MAX:
        cache.clear()
    cache[key] = value


def chunk_ends(data: bytes, least: int, most: int, first: int = FIRST_CHUNK_BYTES) -> list[int]:
    """Where the content-defined chunks of ``data`` end. A text of at most ``least``
    bytes is one chunk (an empty one too). Else each chunk ends just after the first
    paragraph break (a blank line) that leaves it longer than ``least // 4`` bytes, or
    the first newline or sentence end (``". "``) that leaves it longer than ``least``,
    whichever comes first; a part's first chunk after the first of any of them past
    ``first`` bytes, so that a short changing head such as a timestamp gets a chunk of
    its own. With none, a chunk ends after the first space past ``least``, else at
    ``most`` bytes. What remains (at most ``least`` bytes) is cut once more, before its
    last sentence or line, so that a changing tail (a new question after a document)
    is a chunk of its own too.

    A cut depends only on the bytes after the previous one, so two texts that differ
    in a head cut their common rest alike from the first cut they share on: the first
    after the head when the head is one sentence or line, or kept its length; else, in
    text with paragraphs, mostly the first paragraph break past it, which is a cut
    wherever the chunk before it began unless that was less than ``least // 4`` before.
    (A cut at every sentence would keep in step at once, but make several chunks a
    block; ``tests/test_prefix_doctor.py`` shows how soon they line up.) Text without
    such marks is cut by length, which only heads of unchanged length leave in step.
    One to three ``bytes.find`` calls per chunk: C speed, no per-byte Python."""
    n = len(data)
    if n <= least:
        return [n]
    ends: list[int] = []
    find = data.find
    start, weak, strong = 0, first, first
    while n - start > weak:
        high = start + most
        low = start + weak
        # a paragraph break before ``low`` (marks from there on are found below): where
        # paragraphs are short, the one search
        para = find(b"\n\n", start + strong, low + 1) if strong < weak else -1
        if para >= 0:
            start = para + 2
        else:
            stop = find(b". ", low, high)
            line = find(b"\n", low, stop if stop >= 0 else high)
            if line >= 0:  # a cut at a paragraph's first newline would split the break,
                # and a text whose chunk began elsewhere cuts after it: so do the same
                start = line + 2 if line + 1 < n and data[line + 1] == 10 else line + 1
            elif stop >= 0:
                start = stop + 2
            else:
                space = find(b" ", low, high)
                start = space + 1 if space >= 0 else min(high, n)
        ends.append(start)
        weak, strong = least, least // 4
    if start < n:
        # The last piece: its last sentence or line a chunk of its own, so that a
        # changing tail (a new question after a document) leaves the rest in step.
        tail = max(data.rfind(b". ", start + first, n - 1) + 2,
                   data.rfind(b"\n", start + first, n - 1) + 1)
        if tail > start + first:
            ends.append(tail)
        ends.append(n)
    return ends


class PromptHasher:
    """Keyed block and chunk digests of a prompt (see the module docstring).

    ``secret`` keys every digest (random per process by default; replicas that share an
    index share it); ``block_bytes`` is the block size; ``chunk_bytes`` the least length
    of a content chunk (at most four times that).

    Each stored key is a keyed ``blake2b`` digest over short inputs. The chain is one
    running keyed state: fed the root, then per part its head (a keyed digest of its
    kind and role, which no prompt text can forge without the secret) and the XXH3-128
    digest of each of its blocks, its key after each block is the digest of a copy of
    the state (one ``update``, ``copy`` and ``digest`` a block, of 16 bytes rather than
    the block's 256: one compression of the keyed hash where there were three). Whole
    blocks are cut and condensed at C speed (``struct.iter_unpack`` into
    ``xxh3_128_digest``). A chunk key is a keyed digest of
    the root, the part's head and the chunk's XXH3-128 digest. XXH3 (unseeded) only
    condenses: nothing it outputs leaves this object. What is fed is unambiguous: keys
    are taken only after a block's digest, and a head is as long as half a digest and
    keyed, so two prompts feed the same bytes up to a key only if their parts, heads
    and blocks agree. The part heads are kept between requests (:data:`_HEADS_MAX`),
    and so are the last scope's digests and running states: one entry, so that the
    index's memory bound (``--prefix-index-bytes``) stays the doctor's bound whatever
    the number of models. So are the anchors of up to :data:`_HEADS_MAX` recent first
    blocks (about 13 KB of digests at most): most requests of an app open with the
    same system prompt. And so are recent parts' keys (``part_cache_keys`` keys in all,
    least recently used first), by a keyed digest of the chain key before the part, its
    head and its bytes' XXH3-128: a system prompt, the tools and a conversation's
    history come again after the same prefix, and cost one digest of their bytes
    instead of one keyed digest per block.
    """

    def __init__(self, secret: bytes | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, *,
                 part_cache_keys: int = PART_CACHE_KEYS) -> None:
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
        self._parts_max = part_cache_keys
        self._parts_lock = threading.Lock()  # the loop and the hashing thread share it

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

    def _scope(self, upstream: str, model: str, cache_key: str
               ) -> tuple[bytes, Any, Any, Any]:
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

    def _head(self, kind: str, role: str) -> bytes:
        head = self._heads.get((kind, role))
        if head is None:
            head = self._digest(self._part, _field(kind), _field(role))
            _keep(self._heads, (kind, role), head)
        return head

    def hash(
        self, parts: Sequence[PromptPart], *, upstream: str, model: str, cache_key: str = "",
        anchor: int = 0,
    ) -> HashedPrompt | None:
        """The keys of ``parts`` under the scope (upstream, model, cache key); None for a
        prompt without parts (nothing to compare). The anchors are taken from part
        ``anchor``'s first block (the first part of the prompt text, after any settings)."""
        if not parts:
            return None
        size, least, most = self.block_bytes, self.chunk_bytes, self.chunk_max
        root, chain_start, by_model, by_upstream = self._scope(upstream, model, cache_key)
        condense, blocks_of, new_chunk = xxh3_128_digest, self._blocks, self._chunk.copy
        running = chain_start.copy()
        update, snapshot = running.update, running.copy
        heads, head_of = self._heads, self._head
        chain: list[bytes] = []
        first_block: list[int] = []
        chunks: list[bytes] = []  # the probe: the chunks first
        ends: list[int] = []
        first_chunk: list[int] = []
        shapes: list[PartShape] = []
        cached, part_key = self._parts, self._part_key.copy
        before = root  # the chain key before this part (the root before the first)
        for kind, index, role, data in parts:
            head = heads.get((kind, role)) or head_of(kind, role)
            length = len(data)
            shapes.append(PartShape(kind, index, role, length))
            first_block.append(len(chain))
            first_chunk.append(len(chunks))
            naming = part_key()
            naming.update(before + head + condense(data))
            name = naming.digest()
            with self._parts_lock:
                known = cached.get(name)
                if known is not None:
                    cached.move_to_end(name)
            if known is not None:  # the same part after the same prefix: its keys again
                chain.extend(known.chain)
                chunks.extend(known.chunks)
                ends.extend(known.ends)
                running = known.state.copy()
                update, snapshot = running.update, running.copy
                before = chain[-1]
                continue
            at_chain, at_chunk = len(chain), len(chunks)
            view = memoryview(data)
            update(head)  # a part's first block also covers its kind and role
            whole = length - length % size  # bytes in whole blocks
            leaf = b""
            if whole:  # whole blocks: condensed at C speed, one key after each
                for leaf in starmap(condense, blocks_of(view[:whole])):
                    update(leaf)
                    chain.append(snapshot().digest())
            if whole < length or not length:  # a short last block, or an empty part
                leaf = condense(view[whole:])
                update(leaf)
                chain.append(snapshot().digest())
            under = new_chunk()
            under.update(root + head)
            cut = chunk_ends(data, least, most)
            if length <= size and len(cut) == 1:  # one block, one chunk: one leaf
                link = under.copy()
                link.update(leaf)
                chunks.append(link.digest())
            else:
                start = 0
                for end in cut:
                    link = under.copy()
                    link.update(condense(view[start:end]))
                    chunks.append(link.digest())
                    start = end
            ends.extend(cut)
            before = chain[-1]
            self._remember(name, _HashedPart(tuple(chain[at_chain:]), tuple(chunks[at_chunk:]),
                                             tuple(cut), snapshot()))
        named = chain[first_block[anchor]]  # names the scope and the blocks up to the anchor's
        anchors = self._anchors.get(named)
        if anchors is None:
            first = parts[anchor]
            block = b"\x01" + head_of(first.kind, first.role) + first.data[:size]
            anchors = (self._digest(by_model, block), self._digest(by_upstream, block))
            _keep(self._anchors, named, anchors)
        marks = (_SEEN * len(chunks) + _ENDED_CHAIN + _CONTINUED * (len(chain) - 1)
                 + _SCOPE_MARKS)
        keys = chunks.copy()
        keys.extend(reversed(chain))
        keys.append(root)
        keys.extend(anchors)
        return HashedPrompt(size, tuple(shapes), root, tuple(chain), tuple(first_block),
                            tuple(chunks), tuple(ends), tuple(first_chunk), least, anchors,
                            tuple(keys), marks)


@dataclass(frozen=True, slots=True)
class PrefixPolicy:
    """How sightings are judged. ``window_ms``: how long a provider keeps a prefix (5
    minutes by default); ``short_run_bytes`` (default two blocks, one chunk's least
    length and 256 bytes: the block rounding on either side of the change, the chunk it
    falls in, plus a timestamp, a name, an id) and ``min_stable_bytes`` (default one
    block): the bounds of ``variable_before_stable``."""

    window_ms: int = DEFAULT_WINDOW_MS
    short_run_bytes: int | None = None
    min_stable_bytes: int | None = None


class PrefixReport(NamedTuple):
    """What the doctor says about one request's prompt (bytes; :func:`cache_tokens`
    gives tokens once usage is known). No text, only sizes and positions."""

    prompt_bytes: int  # the parts' bytes
    blocks: int  # chain blocks in the prompt
    repeated_blocks: int  # leading blocks some request held within the window
    repeated_bytes: int
    stale_bytes: int  # right after those: bytes held, but longer ago than the window
    reason: str | None  # one of REASONS; None: no break (a full repeat, a grown one, new tail)
    part: str | None = None  # where it broke: the part's kind, its index and role
    index: int | None = None  # type: ignore[assignment]  # a field: shadows tuple.index
    role: str | None = None
    offset: int | None = None  # byte offset in that part of the block where it broke
    part_bytes: int | None = None  # that part's size
    changed_bytes: int | None = None  # variable_before_stable: the changed run, block-rounded
    stable_bytes: int | None = None  # variable_before_stable: bytes after it seen before
    # the prompt names stored context the proxy cannot see (Responses' previous_response_id,
    # conversation): its tokens are in the usage, so no token figure can be derived
    unseen_context: bool = False

    @property
    def repeated_share(self) -> float:
        """Repeated bytes over prompt bytes (0 for an empty prompt)."""
        return self.repeated_bytes / self.prompt_bytes if self.prompt_bytes else 0.0


def _stored_context(parts: Sequence[PartShape], first_block: Sequence[int], blocks: int
                    ) -> tuple[bool, int]:
    """Whether the prompt names stored context the proxy cannot see (a ``context`` part:
    Responses' ``previous_response_id``, ``conversation``), and the chain block the repeat
    may not pass: the end of a ``conversation`` part, whose stored items grow under the
    same id, so that what follows it is at no known position (a previous response is
    immutable: the same id is the same context)."""
    unseen = False
    for p, shape in enumerate(parts):
        if shape.kind == "context":
            unseen = True
            if shape.role == "conversation":
                return True, first_block[p + 1] if p + 1 < len(parts) else blocks
    return unseen, blocks


def diagnose(
    hashed: HashedPrompt,
    seen: Sightings,
    now_ms: int,
    policy: PrefixPolicy = PrefixPolicy(),
) -> PrefixReport:
    """Read an index's answer to ``hashed.probe()`` at ``now_ms`` into a report (see the
    module docstring)."""
    blocks = len(hashed.chain)
    last = seen.last
    cutoff = now_ms - policy.window_ms
    # The probe's order: chunks, the chain from its last block, the root, the anchors.
    top = len(hashed.keys) - 4  # the probe index of chain block 0; block i is at top - i
    parts = hashed.parts
    unseen, limit = _stored_context(parts, hashed.first_block, blocks)
    if limit == blocks and last(top - blocks + 1) >= cutoff:
        # The last block's key names the whole prompt: a request held all of it, each
        # block at the same time, so no block before it need be read.
        repeated = blocks
    else:
        repeated = 0
        while repeated < limit and last(top - repeated) >= cutoff:
            repeated += 1
    if repeated == blocks:  # the whole prompt repeated: the common case, said at once
        total = sum(part.size for part in parts)
        return PrefixReport(total, blocks, blocks, total, 0, None, unseen_context=unseen)
    size = hashed.block_bytes
    short_run = (policy.short_run_bytes if policy.short_run_bytes is not None
                 else 2 * size + hashed.chunk_bytes + 256)
    min_stable = policy.min_stable_bytes if policy.min_stable_bytes is not None else size
    first_block = hashed.first_block
    root, model_anchor, upstream_anchor = top + 1, top + 2, top + 3

    part_start = [0] * len(parts)  # byte offset of each part in the prompt
    for p in range(1, len(parts)):
        part_start[p] = part_start[p - 1] + parts[p - 1].size
    total = part_start[-1] + parts[-1].size

    def position(block: int) -> tuple[int, int]:
        """(part, byte offset in it) of a chain block."""
        p = bisect_right(first_block, block) - 1
        return p, (block - first_block[p]) * size

    def bytes_before(block: int) -> int:
        if block >= blocks:
            return total
        p, offset = position(block)
        return part_start[p] + offset

    held = repeated
    while held < blocks and last(top - held) > NEVER:
        held += 1
    base = PrefixReport(
        prompt_bytes=total,
        blocks=blocks,
        repeated_blocks=repeated,
        repeated_bytes=bytes_before(repeated),
        stale_bytes=bytes_before(held) - bytes_before(repeated),
        reason=None,
        unseen_context=unseen,
    )
    if repeated == limit:  # after a conversation's stored items: nothing to compare
        return base._replace(stale_bytes=0)

    p, offset = position(repeated)
    shape = parts[p]
    at = base._replace(part=shape.kind, index=shape.index, role=shape.role, offset=offset,
                       part_bytes=shape.size)
    if held > repeated:
        return at._replace(reason="expired")
    if top - repeated in seen.after:
        # Held only by requests whose prefill was done after this one arrived and before
        # its own was: the same prefix in flight at once, which no cache could serve yet.
        return at._replace(reason="concurrent")
    if repeated == 0 and last(root) < cutoff:
        if last(model_anchor) >= cutoff:
            return base._replace(reason="cache_key_changed")
        if last(upstream_anchor) >= cutoff:
            return base._replace(reason="model_changed")
        return base._replace(reason="first_seen")
    if shape.kind == "context":
        return base  # another stored context (a new previous_response_id): how the API works
    parent = root if repeated == 0 else top - repeated + 1
    if seen.ended[parent] >= cutoff:
        return base  # grown from a recent request that ended right here
    if seen.continued[parent] < cutoff:
        return base  # no recent request went on past here
    if shape.kind == "settings":  # a request setting (its name is the role), never new text
        return at._replace(reason="settings_changed")

    # A recent request went on past the last repeated block; this one differs there.
    # After the change: part p's chunks from the block where it broke, seen recently.
    first_chunk, ends = hashed.first_chunk, hashed.chunk_ends
    stop = first_chunk[p + 1] if p + 1 < len(parts) else len(ends)
    j = bisect_right(ends, offset, first_chunk[p], stop)  # the chunk holding the offset
    while j < stop and last(j) >= cutoff:  # the broken block's head, or a moved part
        j += 1
    changed_from = j
    while j < stop and last(j) < cutoff:  # the changed run
        j += 1
    if changed_from < j < stop:  # then a run seen before: where does it start and end?
        stable_start = min(shape.size, -(-ends[j - 1] // size) * size)  # block-rounded up
        while j < stop and last(j) >= cutoff:
            j += 1
        if j < stop:  # it ends inside the part: rounded down to a block
            stable = max(0, ends[j - 1] // size * size - stable_start)
        else:  # it runs to the part's end, and on over the following parts seen whole
            stable = shape.size - stable_start
            for q in range(p + 1, len(parts)):
                following = range(first_chunk[q], first_chunk[q + 1] if q + 1 < len(parts)
                                  else len(ends))
                if not all(last(c) >= cutoff for c in following):
                    break
                stable += parts[q].size
        changed = stable_start - offset
        if 0 < changed <= short_run and stable >= min_stable:
            return at._replace(
                reason="variable_before_stable", changed_bytes=changed, stable_bytes=stable)
    if p == len(parts) - 1:
        return base  # the newest part is new by nature: a new question, not a break
    return at._replace(reason=_KIND_REASON.get(shape.kind, "message_changed"))


class PrefixDoctor:
    """Hash, exchange with the index, diagnose: the three steps for one request.

    Hashing and the exchange cost a few us per block (see the module docstring):
    run :meth:`examine` after the request is on its way upstream, and in a worker
    thread for large prompts (the in-process index is thread-safe).
    """

    def __init__(
        self,
        index: PrefixIndex,
        hasher: PromptHasher | None = None,
        policy: PrefixPolicy = PrefixPolicy(),
    ) -> None:
        window = getattr(index, "window_ms", policy.window_ms)
        if window != policy.window_ms:  # the index cuts its runs of sightings by it
            raise ValueError(f"the index's window_ms ({window}) is not the policy's "
                             f"({policy.window_ms})")
        self.index = index
        self.hasher = hasher if hasher is not None else PromptHasher()
        self.policy = policy

    def examine(
        self,
        parts: Sequence[PromptPart],
        *,
        upstream: str,
        model: str,
        cache_key: str = "",
        now_ms: int,
        held_ms: int | None = None,
    ) -> PrefixReport | None:
        """The report for one request (None: no prompt parts), recorded in the index.
        ``now_ms``: when the request arrived; ``held_ms``: when its prefill was done (its
        first output event; ``now_ms`` when not given), from when its blocks count for
        others (see :mod:`proxy.diagnosis.prefix_index`)."""
        looked = self.look(parts, upstream=upstream, model=model, cache_key=cache_key,
                           now_ms=now_ms, held_ms=held_ms)
        return looked[1] if looked is not None else None

    def look(
        self,
        parts: Sequence[PromptPart],
        *,
        upstream: str,
        model: str,
        cache_key: str = "",
        now_ms: int,
        held_ms: int | None = None,
    ) -> tuple[HashedPrompt, PrefixReport] | None:
        """:meth:`examine`, with the prompt's keys (a capture turns them into a trace's
        block ids, :mod:`proxy.capture`)."""
        anchor = 0  # the first part of prompt text, after the settings parts
        while anchor < len(parts) - 1 and parts[anchor].kind == "settings":
            anchor += 1
        hashed = self.hasher.hash(parts, upstream=upstream, model=model, cache_key=cache_key,
                                  anchor=anchor)
        if hashed is None:
            return None
        try:
            seen = self.index.exchange(hashed.probe(), now_ms, held_ms)
        except IndexUnanswered as exc:
            exc.hashed = hashed  # the keys outlive the failed exchange (see the class)
            raise
        return hashed, diagnose(hashed, seen, now_ms, self.policy)


# ---------------------------------------------------------------------------
# In words: one sentence per break, for the live page


def part_name(kind: str, index: int | None, role: str, route: str = "") -> str:
    """A part as a reader of the request body names it: ``message 0 (system)``, ``tool
    3``, ``the system prompt`` (Messages' ``system`` field), ``the instructions``,
    ``input item 2 (user)``. A system or developer message is of kind ``system`` in any
    API; ``route`` (the route label) says which array it sits in."""
    if kind == "system":
        if route.endswith("/messages"):
            return "the system prompt"
        kind = "input" if route.endswith("/responses") else "message"
    if kind == "instructions":
        return "the instructions"
    if kind == "settings":
        return f"the request setting {role}" if role else "a request setting"
    if kind == "context":
        return f"the context ({role})" if role else "the context"
    name = {"tools": "tool", "message": "message", "input": "input item"}.get(kind, kind)
    where = name if index is None else f"{name} {index}"
    return f"{where} ({role})" if role else where


_KEEP = "keep it identical across requests"


def explain_break(
    reason: str,
    *,
    part: str = "",
    index: int | None = None,
    role: str = "",
    route: str = "",
    offset: int | None = None,
    part_bytes: int | None = None,
    changed_bytes: int | None = None,
    stable_bytes: int | None = None,
    stable_tokens: float | None = None,
    saves_ms: float | None = None,
) -> str:
    """One sentence on a break of ``reason`` at the position given (a
    :class:`PrefixReport`'s fields), and for ``variable_before_stable`` what moving the
    changing part would save: ``stable_tokens`` a request and, with the prefill fit,
    ``saves_ms`` of first-token time. Positions are block-rounded, as the report's are."""
    where = part_name(part, index, role, route) if part else "the prompt"
    at = ""
    if offset is not None:
        at = f" at byte {offset:,}" + (f" of {part_bytes:,}" if part_bytes else "")
    if reason == "variable_before_stable" and offset is not None and changed_bytes is not None:
        size = f" of {part_bytes:,}" if part_bytes else ""
        sentence = (f"{where[0].upper()}{where[1:]} changes in bytes {offset:,}-"
                    f"{offset + changed_bytes:,}{size}; the {stable_bytes or 0:,} bytes after "
                    "them repeat: move the changing part after them")
        if stable_tokens is not None:
            sentence += f" (about {round(stable_tokens):,} tokens a request could be cached"
            if saves_ms is not None:
                sentence += f", {saves_ms:,.0f} ms of first token by the prefill fit"
            sentence += ")"
        return sentence + "."
    if reason == "message_changed":
        return (f"{where[0].upper()}{where[1:]} differs{at} from the most similar recent prompt, "
                "before the newest message: an earlier turn was edited, reordered or dropped; "
                "append to the history instead of rewriting it.")
    if reason in ("tools_changed", "system_changed", "instructions_changed",
                  "context_changed", "prompt_changed"):
        return (f"{where[0].upper()}{where[1:]} differs{at} from the most similar recent "
                f"prompt, so everything after it is computed again: {_KEEP}.")
    if reason == "settings_changed":
        return (f"{where[0].upper()}{where[1:]} differs from the most similar recent prompt's: "
                "a provider reuses a cached prefix only under the same settings, so the whole "
                f"prompt is computed again: {_KEEP}.")
    if reason == "expired":
        return (f"The prefix up to {where}{at} was last sent longer ago than the prefix "
                "window (--prefix-window), so a provider no longer holds it: only steadier "
                "traffic keeps it.")
    if reason == "concurrent":
        return (f"The prefix up to {where}{at} was sent by requests in flight at the same "
                "time, whose prefill was done only after this one arrived, so no cache could "
                "serve it yet: nothing in the prompt to fix; to share the work, let one "
                "request's first token come before sending the others.")
    if reason == "model_changed":
        return ("The same prompt went recently to another model of this upstream: a cache "
                "is per model.")
    if reason == "cache_key_changed":
        return ("The same prompt came recently with another prompt_cache_key or cache_salt: "
                "a cache is per key.")
    if reason == "first_seen":
        return ("Nothing like this prompt went to this upstream and model within the window: "
                "a new prompt, nothing to fix.")
    return f"The prompt stopped repeating ({reason})."


# ---------------------------------------------------------------------------
# Tokens


class CacheTokens(NamedTuple):
    """A report in tokens (None: not known)."""

    repeated: int | None  # estimated tokens of the repeated prefix
    reported: int | None  # cached tokens the upstream reported
    missed: int | None  # repeated (cacheable part) - reported, floored at 0


def cache_tokens(
    report: PrefixReport,
    prompt_tokens: int | None,
    cached_tokens: int | None,
    *,
    minimum_tokens: int = 0,
    granularity_tokens: int = 1,
) -> CacheTokens:
    """Tokens of the repeated prefix and the cache the upstream missed.

    Bytes become tokens at the request's own ratio (``prompt_tokens`` over the prompt's
    bytes); without usage nothing is known, and neither with stored context the proxy
    cannot see (``report.unseen_context``: the usage counts its tokens, the bytes do
    not). Missed is None when the upstream did not
    report cached tokens (an absent field is unknown, never 0). The cacheable part leaves
    out the last prompt token (a server computes it to produce the first output token)
    and is rounded down to ``granularity_tokens`` (the steps an upstream caches in: 16
    for vLLM's blocks, 128 for OpenAI's increments), so that a cache working as designed
    is not reported as missing a block's remainder; missed is 0 when that cacheable part
    is shorter than ``minimum_tokens`` (the provider would not cache it: a prompt of
    exactly 1,024 tokens has 896 cacheable on OpenAI, below its 1,024).
    """
    if (prompt_tokens is None or prompt_tokens <= 0 or report.prompt_bytes <= 0
            or report.unseen_context):
        return CacheTokens(None, cached_tokens, None)
    repeated = min(prompt_tokens, round(report.repeated_bytes * prompt_tokens / report.prompt_bytes))
    if cached_tokens is None:
        return CacheTokens(repeated, None, None)
    cacheable = min(repeated, prompt_tokens - 1)
    step = max(1, granularity_tokens)
    cacheable -= cacheable % step
    if cacheable < minimum_tokens:  # after rounding: 1,024 tokens round to 896 on OpenAI
        return CacheTokens(repeated, cached_tokens, 0)
    return CacheTokens(repeated, cached_tokens, max(0, cacheable - cached_tokens))


# Anthropic's minimum cacheable prompt per model family (its prompt-caching guide):
# matched in order against the model name, the first hit wins.
_ANTHROPIC_MINIMUM: tuple[tuple[str, int], ...] = (
    ("haiku-4", 4096),
    ("opus-4-5", 4096),
    ("opus-4-6", 4096),
    ("sonnet-4-6", 2048),
    ("haiku", 2048),  # Claude 3 and 3.5 Haiku
)
OPENAI_MINIMUM_TOKENS = 1024
ANTHROPIC_DEFAULT_MINIMUM_TOKENS = 1024
# Gemini through its OpenAI-compatible endpoint (its context-caching guide, the table of
# minimum input tokens for implicit caching): 2,048 for the 2.5 models, 4,096 for the
# later ones. Matched against the model name; any other name is not Gemini.
_GEMINI_MINIMUM: tuple[tuple[str, int], ...] = (
    ("gemini-2.5", 2048),
    ("gemini-", 4096),
)


def minimum_cacheable_tokens(api: str, model: str) -> int:
    """The default minimum cacheable prompt for a dialect (``"messages"`` is Anthropic's
    API, the others OpenAI's) and a model name: 1,024 tokens for OpenAI, per model
    family for Anthropic and for Gemini models served through an OpenAI-style API. A
    self-hosted server caches from its first block (vLLM: 16 tokens), so an upstream of
    that kind should configure its own."""
    name = model.lower()
    if api != "messages":
        for family, tokens in _GEMINI_MINIMUM:
            if family in name:
                return tokens
        return OPENAI_MINIMUM_TOKENS
    for family, tokens in _ANTHROPIC_MINIMUM:
        if family in name:
            return tokens
    return ANTHROPIC_DEFAULT_MINIMUM_TOKENS


# OpenAI reports cached tokens in steps of 128 above its 1,024-token minimum (its
# prompt-caching guide), except from the GPT-5.6 family on, whose caching "no longer
# relies on 128-token rounding" (OpenAI's GPT-5.6 upgrade guide) and which reports the
# tokens it wrote (cache_write_tokens); Anthropic reads the cache up to a breakpoint,
# token exact.
OPENAI_GRANULARITY_TOKENS = 128
_GPT_VERSION = re.compile(r"gpt-(\d+)(?:\.(\d+))?")
_UNROUNDED_FROM = (5, 6)


def cache_granularity_tokens(api: str, model: str = "") -> int:
    """The default steps an upstream reports cached tokens in, for a dialect and a model
    name: 128 tokens for OpenAI's APIs before the GPT-5.6 family, 1 from it on and for
    Anthropic's (``"messages"``). A self-hosted server caches in its blocks (vLLM: 16
    tokens), so an upstream of that kind should configure its own; a step larger than
    the server's understates the missed tokens (by less than a step per request), a
    smaller one would report a working cache as missing a step's remainder."""
    if api == "messages":
        return 1
    found = _GPT_VERSION.search(model.lower())
    if found is not None:
        version = (int(found.group(1)), int(found.group(2) or 0))
        if version >= _UNROUNDED_FROM:
            return 1
    return OPENAI_GRANULARITY_TOKENS


def missed_prefill_ms(missed_tokens: int, seconds_per_ktoken: float) -> float:
    """What a missed cache cost in first-token time, in milliseconds: the missed tokens
    at the upstream's prefill cost per uncached token, given as seconds per 1,000
    uncached prompt tokens (the prefill fit's slope; a simulator's ``1000 /
    prefill_rate``). Tokens / 1000 * s/ktoken * 1000 ms/s: the product, floored at 0
    (a noisy fit's negative slope saves nothing)."""
    return max(0.0, missed_tokens * seconds_per_ktoken)
