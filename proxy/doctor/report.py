"""The report in the reader's terms: tokens (:func:`cache_tokens`, with each provider's
minimum cacheable length and caching step) and words (:func:`explain_break`, one
sentence per break for the live page).

Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import NamedTuple

from proxy.dialects import Caching
from proxy.doctor.examine import PrefixReport


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
_PART_CHANGED = frozenset(
    {"tools_changed", "system_changed", "instructions_changed", "context_changed", "prompt_changed"}
)
# The sentence of each break that has no position in the prompt.
_SENTENCES = {
    "model_changed": "The same start of this prompt went recently to another model of this "
    "upstream: a cache is per model.",
    "cache_key_changed": "The same start of this prompt came recently with another "
    "prompt_cache_key or cache_salt: a cache is per key.",
    "first_seen": "Nothing like this prompt went to this upstream and model within the "
    "window: a new prompt, nothing to fix.",
}


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
    subject = where[0].upper() + where[1:]
    size = f" of {part_bytes:,}" if part_bytes else ""
    at = "" if offset is None else f" at byte {offset:,}{size}"
    if reason == "variable_before_stable" and offset is not None and changed_bytes is not None:
        sentence = (
            f"{subject} changes in bytes {offset:,}-{offset + changed_bytes:,}{size}; the "
            f"{stable_bytes or 0:,} bytes after them repeat: move the changing part after them"
        )
        if stable_tokens is not None:
            sentence += f" (about {round(stable_tokens):,} tokens a request could be cached"
            if saves_ms is not None:
                sentence += f", {saves_ms:,.0f} ms of first token by the prefill fit"
            sentence += ")"
        return sentence + "."
    if reason == "message_changed":
        return (
            f"{subject} differs{at} from the most similar recent prompt, before the newest "
            "message: an earlier turn was edited, reordered or dropped; append to the history "
            "instead of rewriting it."
        )
    if reason in _PART_CHANGED:
        return (
            f"{subject} differs{at} from the most similar recent prompt, so everything after "
            f"it is computed again: {_KEEP}."
        )
    if reason == "settings_changed":
        return (
            f"{subject} differs from the most similar recent prompt's: a provider reuses a "
            "cached prefix only under the same settings, so the whole prompt is computed "
            f"again: {_KEEP}."
        )
    if reason == "expired":
        return (
            f"The prefix up to {where}{at} was last sent longer ago than the prefix window "
            "(--prefix-window), so a provider no longer holds it: only steadier traffic keeps it."
        )
    if reason == "concurrent":
        return (
            f"The prefix up to {where}{at} was sent by requests in flight at the same time, "
            "whose prefill was done only after this one arrived, so no cache could serve it "
            "yet: nothing in the prompt to fix; to share the work, let one request's first "
            "token come before sending the others."
        )
    return _SENTENCES.get(reason, f"The prompt stopped repeating ({reason}).")


# -- tokens ----------------------------------------------------------------------------


class CacheTokens(NamedTuple):
    """A report in tokens (None: not known)."""

    repeated: int | None  # estimated tokens of the repeated prefix
    reported: int | None  # cached tokens the upstream reported
    missed: int | None  # repeated (cacheable part) - reported, floored at 0
    # of missed, those past the last cache breakpoint where only marked prefixes are
    # cached: no cache was asked to serve them (None: every prefix is cached, or unknown)
    unmarked: int | None = None


class TokenRules(NamedTuple):
    """What turns a report into tokens, but the usage: worked out with the report (in the
    doctor's batch) and kept in its record, so that whoever reads the record's tokens
    (:meth:`~proxy.measure.PrefixRecord.tokens`) does only :func:`token_counts`'s
    arithmetic."""

    prompt_bytes: int
    repeated_bytes: int
    # the prompt holds context the proxy cannot see, or media whose tokens follow no
    # bytes it sees (proxy.dialects.holds_media): no token figures
    unknown: bool
    minimum: int  # the upstream's minimum cacheable tokens
    step: int  # and the steps it caches in
    caching: Caching = Caching.IMPLICIT
    marked_bytes: int | None = None  # where the last cache breakpoint ends

    @classmethod
    def of(
        cls,
        report: PrefixReport,
        minimum: int = 0,
        step: int = 1,
        caching: Caching = Caching.IMPLICIT,
        marked_bytes: int | None = None,
        *,
        media: bool = False,
    ) -> TokenRules:
        """The rules for ``report`` under an upstream's ``minimum`` and ``step``; ``media``:
        the prompt holds an image, audio, a file or a video."""
        return tuple.__new__(cls, (  # every field: a C call, not the NamedTuple's frame
            report.prompt_bytes,
            report.repeated_bytes,
            report.unseen_context or media,
            minimum,
            step,
            caching,
            marked_bytes,
        ))


def token_counts(
    rules: TokenRules, prompt_tokens: int | None, cached_tokens: int | None
) -> tuple[int | None, int | None, int | None]:
    """(repeated, missed, unmarked) tokens by ``rules``, as :func:`cache_tokens` says: the
    order of :class:`~proxy.measure.PrefixRecord`'s last fields."""
    prompt_bytes, repeated_bytes, unknown, minimum, step, caching, marked_bytes = rules
    if prompt_tokens is None or prompt_tokens <= 0 or prompt_bytes <= 0 or unknown:
        return None, None, None
    ratio = prompt_tokens / prompt_bytes
    repeated = min(prompt_tokens, round(repeated_bytes * ratio))
    if cached_tokens is None:
        return repeated, None, None
    cacheable = min(repeated, prompt_tokens - 1)
    step = max(1, step)
    cacheable -= cacheable % step
    if cacheable < minimum:  # after rounding: 1,024 tokens round to 896 on OpenAI
        cacheable = 0
    missed = max(0, cacheable - cached_tokens)
    if caching is Caching.IMPLICIT:
        return repeated, missed, None
    asked = cacheable  # automatic: up to the last block
    if caching is Caching.MARKED:
        asked = min(cacheable, round((marked_bytes or 0) * ratio))
        asked = 0 if asked < minimum else asked - asked % step
    return repeated, missed, min(missed, cacheable - asked)


def cache_tokens(
    report: PrefixReport,
    prompt_tokens: int | None,
    cached_tokens: int | None,
    *,
    minimum_tokens: int = 0,
    granularity_tokens: int = 1,
    caching: Caching = Caching.IMPLICIT,
    marked_bytes: int | None = None,
    media: bool = False,
) -> CacheTokens:
    """Tokens of the repeated prefix and the cache the upstream missed (None: unknown, never
    0); the rules are ``docs/design/doctor.md``'s, step 4 of the examination. Where the
    request asks for caching by breakpoints (``caching``), the missed tokens past
    ``marked_bytes`` (the last breakpoint's end; None: none) are also said apart: a
    breakpoint whose prefix is below the minimum asks for nothing a cache could hold. A
    prompt that holds ``media`` has no token figures."""
    rules = TokenRules.of(
        report, minimum_tokens, granularity_tokens, caching, marked_bytes, media=media)
    repeated, missed, unmarked = token_counts(rules, prompt_tokens, cached_tokens)
    return CacheTokens(repeated, cached_tokens, missed, unmarked)


# The minimum cacheable prompt per model family, matched in order against the model name
# (the first hit wins; "" matches any): Anthropic's (its prompt-caching guide); through an
# OpenAI-style API, Gemini's (its context-caching guide, the table of minimum input tokens
# for implicit caching: 2,048 for the 2.5 models, 4,096 for the later ones), then OpenAI's.
_ANTHROPIC_MINIMUM: tuple[tuple[str, int], ...] = (
    ("haiku-4", 4096),
    ("opus-4-5", 4096),
    ("opus-4-6", 4096),
    ("sonnet-4-6", 2048),
    ("haiku", 2048),  # Claude 3 and 3.5 Haiku
    ("", 1024),
)
_OPENAI_MINIMUM: tuple[tuple[str, int], ...] = (
    ("gemini-2.5", 2048),
    ("gemini-", 4096),
    ("", 1024),  # OpenAI's own
)


@lru_cache(maxsize=256)  # per request, by a model name: a few in practice
def minimum_cacheable_tokens(api: str, model: str) -> int:
    """The default minimum cacheable prompt for a dialect (``"messages"`` is Anthropic's
    API, the others OpenAI's) and a model name, by the tables above. A self-hosted server
    caches from its first block (vLLM: 16 tokens), so an upstream of that kind should
    configure its own."""
    name = model.lower()
    families = _ANTHROPIC_MINIMUM if api == "messages" else _OPENAI_MINIMUM
    return next(tokens for family, tokens in families if family in name)


# OpenAI reports cached tokens in steps of 128 above its 1,024-token minimum (its
# prompt-caching guide), except from the GPT-5.6 family on, whose caching "no longer
# relies on 128-token rounding" (OpenAI's GPT-5.6 upgrade guide) and which reports the
# tokens it wrote (cache_write_tokens); Anthropic reads the cache up to a breakpoint,
# token exact.
OPENAI_GRANULARITY_TOKENS = 128
_GPT_VERSION = re.compile(r"gpt-(\d+)(?:\.(\d+))?")
_UNROUNDED_FROM = (5, 6)


@lru_cache(maxsize=256)  # per request, by a model name: a few in practice
def cache_granularity_tokens(api: str, model: str = "") -> int:
    """The default steps an upstream reports cached tokens in, for a dialect (``"messages"``
    is Anthropic's) and a model name, as the comment above says. A self-hosted server caches
    in its blocks (vLLM: 16 tokens), so an upstream of that kind should configure its own; a
    step larger than the server's understates the missed tokens (by less than a step per
    request), a smaller one would report a working cache as missing a step's remainder."""
    found = _GPT_VERSION.search(model.lower())
    version = (int(found[1]), int(found[2] or 0)) if found else (0, 0)
    return 1 if api == "messages" or version >= _UNROUNDED_FROM else OPENAI_GRANULARITY_TOKENS
