"""``/v1/completions``: the chat reading (:mod:`proxy.dialects.chat`: usage, errors,
response info) with ``choices[].text`` as the output.

* Output: a choice carries output when its ``text`` is a non-empty string (answer).
* Prompt parts: ``prompt`` (one part per prompt of a batch; token ids as text).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from proxy.dialects.chat import _ANSWER, _NONE, ChatDialect
from proxy.dialects.prompt import Prompt, PromptPart, _json_bytes, _token_id, _utf8


@dataclass(frozen=True, slots=True)
class CompletionsDialect(ChatDialect):
    """``/v1/completions``: the chat reading with ``choices[].text`` as the only output
    (and the byte scan keyed on ``"text"``, one per choice)."""

    name: str = "completions"
    route: str = "/v1/completions"
    injects_usage: bool = True
    token_keys: tuple[bytes, ...] = (b'"text":"',)

    _marker: ClassVar[bytes] = b'"text"'
    _answer_key: ClassVar[bytes] = b'"text"'
    _reasoning_delta: ClassVar[bytes] = b""
    _scan: ClassVar[re.Pattern[bytes]] = re.compile(rb'"(text)"\s*:\s*"[^"]')
    _answer_names: ClassVar[frozenset[bytes]] = frozenset((b"text",))
    _containers: ClassVar[tuple[bytes, ...]] = ()

    @staticmethod
    def _carries(choice: Any) -> int:
        if isinstance(choice, dict):
            text = choice.get("text")
            if isinstance(text, str) and text:
                return _ANSWER
        return _NONE

    def prompt_parts(self, payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
        return _completions_parts(payload)

    def prompt(self, payload: Mapping[str, Any]) -> Prompt:
        return Prompt(_completions_parts(payload))


def _completions_parts(payload: Mapping[str, Any]) -> tuple[PromptPart, ...]:
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return (PromptPart("prompt", 0, "", _utf8(prompt)),)
    if not isinstance(prompt, list):
        return ()
    # An array that opens with a token id is one prompt sent as token ids, whatever
    # follows (the API allows no mix): one part, as part_bound counts it, so that a
    # malformed array of many items never costs a part each.
    if prompt and _token_id(prompt[0]):
        prompt = [prompt]
    parts = []
    for i, item in enumerate(prompt):  # batched prompts: one part each
        if isinstance(item, str):
            parts.append(PromptPart("prompt", i, "", _utf8(item)))
        elif isinstance(item, list) and (not item or _token_id(item[0])):
            parts.append(PromptPart("prompt", i, "", _utf8(" ".join(map(str, item)))))
        else:
            parts.append(PromptPart("prompt", i, "", _json_bytes(item)))
    return tuple(parts)


COMPLETIONS = CompletionsDialect()
