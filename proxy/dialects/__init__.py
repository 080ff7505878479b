"""API dialects: what one streamed event, and a whole answer, mean for each API the proxy
measures, and how each API reports token usage.

Design: ``docs/design/dialects.md``.
"""

from __future__ import annotations

from dataclasses import replace

from proxy.dialects.base import (
    ANSWER,
    END,
    ERROR,
    NO_RESPONSE,
    NOT_COUNTED,
    REASONING,
    AnswerInfo,
    Dialect,
    EventInfo,
    ResponseInfo,
    UpstreamReport,
    Usage,
    merge_usage,
    read_answer,
    read_report,
    report_of,
    upstream_queue_seconds,
)
from proxy.dialects.chat import CHAT, ChatDialect
from proxy.dialects.completions import COMPLETIONS, CompletionsDialect
from proxy.dialects.messages import MESSAGES, MessagesDialect
from proxy.dialects.prompt import (
    PART_KINDS,
    Caching,
    Prompt,
    PromptPart,
    cache_scope,
    holds_media,
    part_bound,
)
from proxy.dialects.responses import RESPONSES, ResponsesDialect
from proxy.dialects.template import TokenTemplate

__all__ = [
    "ANSWER",
    "CHAT",
    "COMPLETIONS",
    "DIALECTS",
    "DIALECTS_WITHOUT_RESPONSE_INFO",
    "END",
    "ERROR",
    "MESSAGES",
    "NOT_COUNTED",
    "NO_RESPONSE",
    "PART_KINDS",
    "REASONING",
    "RESPONSES",
    "AnswerInfo",
    "Caching",
    "ChatDialect",
    "CompletionsDialect",
    "Dialect",
    "EventInfo",
    "MessagesDialect",
    "Prompt",
    "PromptPart",
    "ResponseInfo",
    "ResponsesDialect",
    "TokenTemplate",
    "UpstreamReport",
    "Usage",
    "cache_scope",
    "holds_media",
    "merge_usage",
    "part_bound",
    "read_answer",
    "read_report",
    "report_of",
    "upstream_queue_seconds",
]

DIALECTS: dict[str, Dialect] = {d.route: d for d in (CHAT, COMPLETIONS, RESPONSES, MESSAGES)}
# The same, not reading response info where that costs a decode per stream (chat and
# completions' finish chunk): for a proxy with no trace, OTLP metrics or request log.
DIALECTS_WITHOUT_RESPONSE_INFO: dict[str, Dialect] = {
    d.route: d for d in (replace(CHAT, response_info=False),
                         replace(COMPLETIONS, response_info=False), RESPONSES, MESSAGES)}
