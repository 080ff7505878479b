"""API dialects: what one streamed event, and a whole answer, mean for each API the proxy
measures, and how each API reports token usage.

Four streaming APIs are measured, one module each: chat completions
(``/v1/chat/completions``, :mod:`proxy.dialects.chat`), completions (``/v1/completions``,
:mod:`proxy.dialects.completions`), the OpenAI Responses API (``/v1/responses``,
:mod:`proxy.dialects.responses`) and the Anthropic Messages API (``/v1/messages``,
:mod:`proxy.dialects.messages`). Each has a :class:`Dialect` that reads one SSE event (its
``event:`` name and its joined ``data``) into an :class:`EventInfo`, and a raw usage
mapping into a :class:`Usage` normalised so that one dashboard compares all four. What
they share is :mod:`proxy.dialects.base` (the readings, the protocol, usage merging, and
a non-stream answer read whole), :mod:`proxy.dialects.prompt` (a request's prompt as
parts, for the prompt-cache doctor) and :mod:`proxy.dialects.template` (a stream's
token events matched by their learned shape). Everything here is a pure function of its
input: no I/O, no clock, no HTTP, no metrics, and nothing raises on any input (a
malformed event is simply not counted).

Adding a fifth API is adding one module beside these, with its :class:`Dialect` and its
instance, and naming the instance in :data:`DIALECTS` below. This package's own
namespace holds every public name of its modules: ``from proxy.dialects import X`` is
how the rest of the proxy reads them.

Definitions common to every API (each API's module gives its own: which events carry
output, where usage is, what says why the answer stopped, the order of its prompt):

* TTFT ends at the first event carrying generated output, reasoning included. Time to
  first *answer* token ends at the first output event that is not reasoning
  (``EventInfo.answer``).
* Event name: the ``event:`` field when the event has one, else the data's ``"type"``.
  An event is read the same whether its name comes from one or the other.
* Response info (:class:`ResponseInfo`: id, the model that answered, why it stopped;
  for the trace only, never a metric label), as each API words it, read only from
  events that are decoded anyway or carry no output, so no token event is decoded for
  it. Non-stream answers: the same fields of the body. Only events without output
  carry it in :attr:`EventInfo.response`.
* A token count only counts when it is an ``int >= 0`` (not a bool).

Speed: most events of a stream are one token. Each dialect recognises its common token
event from the bytes, without decoding JSON (``benchmarks/profile.md`` has the cost of
a decode per event), and decodes everything else in full. The byte checks only return
an answer when the bytes leave no doubt about what the full decode would say for the
layouts servers write (compact JSON, keys written plainly, no duplicate keys); property
tests check them against :meth:`Dialect.classify_payload` on generated events.
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
from proxy.dialects.prompt import PART_KINDS, PromptPart, cache_scope, part_bound
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
    "ChatDialect",
    "CompletionsDialect",
    "Dialect",
    "EventInfo",
    "MessagesDialect",
    "PromptPart",
    "ResponseInfo",
    "ResponsesDialect",
    "TokenTemplate",
    "UpstreamReport",
    "Usage",
    "cache_scope",
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
