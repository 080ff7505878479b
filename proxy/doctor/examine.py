"""The examination: an index's answer to a prompt's keys read into a :class:`PrefixReport`
(how much repeated, where and why it broke), and :class:`PrefixDoctor`, the three steps
for one request (hash, exchange, examine). Pure but for the index it is given; time is
passed in. ``docs/design/doctor.md`` gives the rules for each break reason.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from proxy.dialects import PromptPart
from proxy.doctor.index import DEFAULT_WINDOW_MS, NEVER, IndexUnanswered, PrefixIndex, Sightings
from proxy.doctor.keys import HashedPrompt, PartShape, PromptHasher

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
_KIND, _SIZE = itemgetter(0), itemgetter(3)  # a PartShape's kind, its size
# A report's fields from its reason to its stable_bytes where nothing broke: a report
# made as ``tuple.__new__(PrefixReport, (sizes..., *_UNBROKEN, unseen))``, a C call
# where the NamedTuple's __new__ would be a frame
_UNBROKEN = (None,) * 8
_NONE_ADDED: tuple[str, ...] = ()
SETTINGS_MEMORY = 1024  # prompt openings whose settings a doctor remembers (then forgotten)
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


def _stored_context(
    parts: Sequence[PartShape], first_block: Sequence[int], blocks: int
) -> tuple[bool, int]:
    """Whether the prompt names stored context the proxy cannot see (a ``context`` part:
    Responses' ``previous_response_id``, ``conversation``), and the chain block the repeat
    may not pass: the end of a ``conversation`` part, whose stored items grow under the
    same id, so that what follows it is at no known position (a previous response is
    immutable: the same id is the same context)."""
    if "context" not in map(_KIND, parts):  # most prompts: one look at C speed
        return False, blocks
    unseen = False
    for p, shape in enumerate(parts):
        if shape.kind == "context":
            unseen = True
            if shape.role == "conversation":
                return True, first_block[p + 1] if p + 1 < len(parts) else blocks
    return unseen, blocks


def examine(
    hashed: HashedPrompt,
    seen: Sightings,
    now_ms: int,
    policy: PrefixPolicy = PrefixPolicy(),
    *,
    removed: str = "",
    added: tuple[str, ...] = (),
) -> PrefixReport:
    """Read an index's answer to ``hashed.probe()`` at ``now_ms`` into a report
    (``docs/design/doctor.md`` gives the rules). ``removed``: a request setting the last
    prompt with the same opening gave and this one does not, which names a break ahead
    of the prompt text; ``added``: the settings this one gives and that one did not."""
    blocks = len(hashed.chain)
    last = seen.last  # bound once: the examination reads most keys through it
    cutoff = now_ms - policy.window_ms
    # The probe's order: chunks, the chain from its last block, the root, the anchors.
    top = len(hashed.keys) - 4  # the probe index of chain block 0; block i is at top - i
    parts = hashed.parts
    unseen, limit = _stored_context(parts, hashed.first_block, blocks)
    # A block's key names the prompt up to it: whoever held it held every block before
    # it, at the same time. So the whole prompt is read from its last key, and whole
    # parts from theirs, before the blocks of the part where the repeat stops.
    # Each key is read once: past the whole prompt's, which was not repeated if read,
    # neither the loop over the parts nor the one over the blocks reads it again.
    first_block = hashed.first_block
    lo, hi = seen.unheld  # keys nobody held before: read as never, without a read
    if limit == blocks and not lo <= top - blocks + 1 < hi and last(top - blocks + 1) >= cutoff:
        repeated = blocks
    else:
        repeated = 0
        for end in first_block[1:]:
            if end > limit or last(top - end + 1) < cutoff:
                break
            repeated = end
        p = len(parts) - 1
        if (repeated == first_block[p] and repeated and lo <= hashed.first_chunk[p]
                and hi > top - repeated and not unseen and not removed
                and parts[p].kind != "settings"):
            # Every part repeated but a last one none of whose keys anybody held: a new
            # question, no break (what the steps below find, its keys unread).
            total = sum(map(_SIZE, parts))
            return tuple.__new__(PrefixReport, (
                total, blocks, repeated, total - parts[p].size, 0, *_UNBROKEN, False))
        upto = blocks - 1 if limit == blocks else limit
        while repeated < upto and last(top - repeated) >= cutoff:
            repeated += 1
    if repeated == blocks:  # the whole prompt repeated: the common case, said at once
        total = sum(map(_SIZE, parts))
        return tuple.__new__(PrefixReport, (total, blocks, blocks, total, 0, *_UNBROKEN, unseen))
    size = hashed.block_bytes
    short_run = (
        policy.short_run_bytes
        if policy.short_run_bytes is not None
        else 2 * size + hashed.chunk_bytes + 256
    )
    min_stable = policy.min_stable_bytes if policy.min_stable_bytes is not None else size
    root, model_anchor, upstream_anchor = top + 1, top + 2, top + 3

    part_start = [0] * len(parts)  # byte offset of each part in the prompt
    for p in range(1, len(parts)):
        part_start[p] = part_start[p - 1] + parts[p - 1].size
    total = part_start[-1] + parts[-1].size

    held = repeated
    while held < blocks and last(top - held) > NEVER:
        held += 1
    # where the repeat stops (repeated < blocks): its part, and its byte offset there
    p = bisect_right(first_block, repeated) - 1
    offset = (repeated - first_block[p]) * size
    repeated_bytes = part_start[p] + offset
    if held == repeated or repeated == limit:  # none held past it, or a conversation's
        stale = 0  # stored items after it: nothing to compare
    elif held == blocks:
        stale = total - repeated_bytes
    else:
        q = bisect_right(first_block, held) - 1
        stale = part_start[q] + (held - first_block[q]) * size - repeated_bytes
    base = tuple.__new__(PrefixReport, (
        total, blocks, repeated, repeated_bytes, stale, *_UNBROKEN, unseen))
    if repeated == limit:
        return base

    shape = parts[p]
    if held > repeated:
        return _at(base, shape, offset, "expired")
    if seen.late(top - repeated):
        # Held only by requests whose prefill was done after this one arrived and before
        # its own was: the same prefix in flight at once, which no cache could serve yet.
        return _at(base, shape, offset, "concurrent")
    if repeated == 0 and last(root) < cutoff:
        if last(model_anchor) >= cutoff:
            return base._replace(reason="cache_key_changed")
        if last(upstream_anchor) >= cutoff:
            return base._replace(reason="model_changed")
        return base._replace(reason="first_seen")
    if shape.kind == "context":
        return base  # another stored context (a new previous_response_id): how the API works
    parent = root if repeated == 0 else top - repeated + 1
    continued, ended = seen.times(parent)
    if ended >= cutoff:
        return base  # grown from a recent request that ended right here
    if continued < cutoff:
        return base  # no recent request went on past here
    if shape.kind == "settings" and (not removed or shape.role in added):
        # a request setting (its name is the role), never new text: one changed, or
        # given now and not before (though another was removed as well)
        return _at(base, shape, offset, "settings_changed")
    if removed and offset == 0 and all(s.kind == "settings" for s in parts[:p]):
        # broken ahead of the text, or at a setting given before too (moved up, as one
        # ahead of it went), where the removed setting was: named by it
        return base._replace(reason="settings_changed", part="settings", role=removed)
    if shape.kind == "settings":
        return _at(base, shape, offset, "settings_changed")

    # A recent request went on past the last repeated block; this one differs there.
    # After the change: part p's chunks from the block where it broke, seen recently.
    first_chunk, ends = hashed.first_chunk, hashed.chunk_ends
    stop = first_chunk[p + 1] if p + 1 < len(parts) else len(ends)
    j = bisect_right(ends, offset, first_chunk[p], stop)  # the chunk holding the offset
    while j < stop and last(j) >= cutoff:  # the broken block's head, or a moved part
        j += 1
    changed_from = j
    j = min(j + 1, stop)  # the chunk that stopped the loop, read as changed: not again
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
                following = range(
                    first_chunk[q], first_chunk[q + 1] if q + 1 < len(parts) else len(ends)
                )
                if not all(last(c) >= cutoff for c in following):
                    break
                stable += parts[q].size
        changed = stable_start - offset
        if 0 < changed <= short_run and stable >= min_stable:
            return _at(base, shape, offset, "variable_before_stable", changed, stable)
    if p == len(parts) - 1:
        return base  # the newest part is new by nature: a new question, not a break
    return _at(base, shape, offset, _KIND_REASON.get(shape.kind, "message_changed"))


def _at(
    base: PrefixReport,
    shape: PartShape,
    offset: int,
    reason: str,
    changed: int | None = None,
    stable: int | None = None,
) -> PrefixReport:
    """``base`` broken for ``reason`` at ``offset`` in the part ``shape``."""
    return base._replace(
        reason=reason, part=shape.kind, index=shape.index, role=shape.role, offset=offset,
        part_bytes=shape.size, changed_bytes=changed, stable_bytes=stable)


class PrefixDoctor:
    """Hash, exchange with the index, examine: the three steps for one request, run
    after the request is on its way upstream (:mod:`proxy.doctor.job` says where).

    It also remembers, per prompt opening, which settings the last prompt so opened gave,
    so that a setting removed since is named (``docs/design/doctor.md``, step 3).
    """

    def __init__(
        self,
        index: PrefixIndex,
        hasher: PromptHasher | None = None,
        policy: PrefixPolicy = PrefixPolicy(),
    ) -> None:
        window = getattr(index, "window_ms", policy.window_ms)
        if window != policy.window_ms:  # the index cuts its runs of sightings by it
            raise ValueError(
                f"the index's window_ms ({window}) is not the policy's ({policy.window_ms})"
            )
        self.index = index
        self.hasher = hasher if hasher is not None else PromptHasher()
        self.policy = policy
        self._settings: dict[bytes, tuple[str, ...]] = {}  # opening anchor -> setting names

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
        """The prompt's keys and its report (None: no prompt parts), recorded in the
        index. ``now_ms``: when the request arrived; ``held_ms``: when its prefill was
        done (``now_ms`` when not given), from when its blocks count for others. The keys
        outlive a failed exchange (:class:`~proxy.doctor.index.IndexUnanswered`)."""
        anchor = 0  # the first part of prompt text, after the settings parts
        while anchor < len(parts) - 1 and parts[anchor].kind == "settings":
            anchor += 1
        hashed = self.hasher.hash(
            parts, upstream=upstream, model=model, cache_key=cache_key, anchor=anchor
        )
        if hashed is None:
            return None
        names = tuple(part.role for part in parts[:anchor]) if anchor else ()
        opening = hashed.anchors[0]
        before = self._settings.get(opening, ())
        removed, added = "", _NONE_ADDED
        if before != names:
            if len(self._settings) >= SETTINGS_MEMORY:
                self._settings.clear()
            self._settings[opening] = names
            removed = next((name for name in before if name not in names), "")
            added = tuple(name for name in names if name not in before)
        try:
            seen = self.index.exchange(hashed.query, now_ms, held_ms)  # probe(): a frame
        except IndexUnanswered as exc:
            exc.hashed = hashed  # the keys outlive the failed exchange (see the class)
            raise
        return hashed, examine(hashed, seen, now_ms, self.policy, removed=removed,
                               added=added)
