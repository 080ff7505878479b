"""The provider's own cache diagnostics, read as bounded words, and whether the doctor agrees.

Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# cache_miss_reason.type (anthropic-sdk-python, src/anthropic/types/cache_miss_reason.py)
ANTHROPIC_REASONS = (
    "model_changed",
    "system_changed",
    "tools_changed",
    "messages_changed",
    "previous_message_not_found",
    "unavailable",
)
# prompt_cache_diagnostics.reason of a cache_miss (OpenAI Responses)
OPENAI_REASONS = (
    "model_changed",
    "prompt_cache_key_changed",
    "tools_changed",
    "text_format_changed",
    "reasoning_effort_changed",
    "verbosity_changed",
    "context_compacted",
    "input_changed",
    "service_tier_changed",
)
# prompt_cache_diagnostics.type other than cache_miss
OPENAI_OUTCOMES = ("cache_hit", "comparison_response_not_found", "unavailable")
PENDING = "pending"  # Anthropic: diagnostics present, its reason null (still comparing)
OTHER = "other"

# The doctor's reasons (proxy.doctor.examine.REASONS) each provider reason agrees with.
_MESSAGES = frozenset({"message_changed", "variable_before_stable", "context_changed"})
_SAME: Mapping[str, frozenset[str]] = {
    "model_changed": frozenset({"model_changed"}),
    "system_changed": frozenset({"system_changed", "variable_before_stable"}),
    "tools_changed": frozenset({"tools_changed"}),
    "messages_changed": _MESSAGES,
    # Responses' input: its messages, the system ones among them, instructions, a stored prompt
    "input_changed": _MESSAGES | {"system_changed", "instructions_changed", "prompt_changed"},
    "prompt_cache_key_changed": frozenset({"cache_key_changed"}),
    # request settings: the doctor's settings parts (docs/prompt-caching.md, "Settings")
    "text_format_changed": frozenset({"settings_changed"}),
    "reasoning_effort_changed": frozenset({"settings_changed"}),
    "verbosity_changed": frozenset({"settings_changed"}),
    "service_tier_changed": frozenset({"settings_changed"}),
}
_NOT_COMPARED = frozenset(
    {"previous_message_not_found", "unavailable", "comparison_response_not_found", PENDING, OTHER}
)


def _word(value: Any, known: tuple[str, ...]) -> str:
    return value if isinstance(value, str) and value in known else OTHER


def _tokens(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def provider_reason(
    anthropic: Mapping[str, Any], openai: Mapping[str, Any]
) -> tuple[str, int | None]:
    """The provider's reason (a word of the tuples above, :data:`PENDING` or :data:`OTHER`;
    "" when it said none) and the tokens it says it missed (None: not said)."""
    if anthropic:
        reason = anthropic.get("cache_miss_reason")
        if reason is None:
            return PENDING, None
        if not isinstance(reason, Mapping):
            return OTHER, None
        return (
            _word(reason.get("type"), ANTHROPIC_REASONS),
            _tokens(reason.get("cache_missed_input_tokens")),
        )
    if openai:
        kind = openai.get("type")
        if kind == "cache_miss":
            return (
                _word(openai.get("reason"), OPENAI_REASONS),
                _tokens(openai.get("cache_missed_tokens")),
            )
        return _word(kind, OPENAI_OUTCOMES), (0 if kind == "cache_hit" else None)
    return "", None


def agreement(provider: str, doctor: str) -> str:
    """Whether the doctor's break (``doctor``: a reason of the doctor's, "" for none)
    says what the provider's reason says. The provider compares with the one response
    the app named, the doctor with every prompt of its window, so the two can differ
    without either being wrong: ``agree`` when the break names the same part (or both
    say nothing broke), ``disagree`` when it names another, ``doctor_silent`` when the
    provider names a miss and the doctor found none, ``doctor_blind`` when the provider
    names what the doctor cannot see (a compacted context), ``not_compared`` when the
    provider could not compare (pending, unavailable, the earlier response unknown)."""
    if provider in _NOT_COMPARED:
        return "not_compared"
    if provider == "cache_hit":
        return "agree" if not doctor else "disagree"
    same = _SAME.get(provider)
    if same is None:
        return "doctor_blind"  # what the doctor cannot see: a compacted context
    if not doctor:
        return "doctor_silent"
    return "agree" if doctor in same else "disagree"
