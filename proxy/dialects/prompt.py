"""Prompt parts (:meth:`proxy.dialects.base.Dialect.prompt_parts`, for the prompt-cache
doctor, :mod:`proxy.doctor`): the request body's prompt as an ordered tuple of
:class:`PromptPart`, in the order the provider renders it, so that a prefix of the parts
is a prefix of what the upstream's prefix cache sees. Each API's module says its order.

Design: ``docs/design/dialects.md``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from operator import methodcaller
from typing import Any, NamedTuple

PART_KINDS: tuple[str, ...] = (
    "settings",
    "tools",
    "system",
    "instructions",
    "context",
    "message",
    "input",
    "prompt",
)


_new = tuple.__new__  # a NamedTuple of all its fields, without its __new__'s Python frame


class PromptPart(NamedTuple):
    """One piece of a request's prompt, in render order (see "Prompt parts").

    ``kind`` is one of :data:`PART_KINDS`; ``index`` the piece's position in its array
    in the body (tool *i*, message *i*, input item *i*; 0 for a single ``system`` or
    ``instructions``); ``role`` the message's role or the input item's type (bounded,
    ``""`` where there is none); ``data`` the canonical bytes. Held only while the
    doctor hashes it: never stored, logged or exported.
    """

    kind: str
    index: int  # type: ignore[assignment]  # a field: shadows tuple.index
    role: str
    data: bytes


class Caching(enum.Enum):
    """Which prefixes of a prompt the provider was asked to cache (``docs/prompt-caching.md``,
    "Cache breakpoints"): any repeated one, or only those up to a marked block."""

    IMPLICIT = "implicit"  # any repeated prefix: OpenAI by default, vLLM, llama.cpp
    AUTOMATIC = "automatic"  # Anthropic's request-level cache_control: up to the last block
    MARKED = "marked"  # only up to a marked block: Anthropic's cache_control, OpenAI explicit


class Prompt(NamedTuple):
    """The prompt parts, how the request asks the provider to cache them, and where the
    last marked block ends: a byte offset in the parts joined in order (the doctor's
    coordinates), None when no block is marked. Positions only, never text."""

    parts: tuple[PromptPart, ...]
    caching: Caching = Caching.IMPLICIT
    marked_bytes: int | None = None


class _Marks:
    """Where the last marked block ends, noted while the parts are built: the marker's
    key is looked up only in the dicts the builder reads anyway, and the part's place in
    the prompt is found once, at the end, so no second pass over the body is made."""

    __slots__ = ("end", "key", "part", "within")

    def __init__(self, key: str) -> None:
        self.key = key  # cache_control (Anthropic), prompt_cache_breakpoint (OpenAI)
        self.within: int | None = None  # in the part being built: the end of a marked block
        self.part: PromptPart | None = None  # the last part with a marked block
        self.end = 0  # ... and where in it the last one ends

    def marked(self, value: Any, out: list[bytes]) -> None:
        if isinstance(value, dict) and self.key in value:
            self.within = sum(map(len, out))

    def close(self, part: PromptPart) -> PromptPart:
        if self.within is not None:
            self.part, self.end, self.within = part, self.within, None
        return part

    def prompt(self, parts: list[PromptPart], caching: Caching) -> Prompt:
        """The prompt, with the offset of the last marked block's end in it."""
        last = self.part
        for i in range(len(parts) - 1, -1, -1) if last is not None else ():
            if parts[i] is last:
                return Prompt(tuple(parts), caching, sum(len(p.data) for p in parts[:i]) + self.end)
        return Prompt(tuple(parts), caching)


def explicit_marks(payload: Mapping[str, Any]) -> _Marks | None:
    """OpenAI's explicit mode (``prompt_cache_options.mode: "explicit"``): only the
    prefixes up to a block marked ``prompt_cache_breakpoint`` are cached; None otherwise."""
    options = payload.get("prompt_cache_options")
    if isinstance(options, dict) and options.get("mode") == "explicit":
        return _Marks(BREAKPOINT)
    return None


_ROLE_MAX = 32
_NESTING_MAX = 8
_SYSTEM_ROLES = frozenset(("system", "developer"))
_TEXT_PARTS = frozenset(("text", "input_text", "output_text"))
# Content the proxy cannot read as text: each enters as a hash of its JSON.
_OPAQUE_PARTS = frozenset(
    (
        "image",
        "image_url",
        "input_image",
        "audio",
        "input_audio",
        "file",
        "input_file",
        "document",
        "video",
        "video_url",
    )
)
# Cache breakpoint markers, not text the model sees: Anthropic's, and OpenAI's (GPT-5.6 on)
CACHE_CONTROL = "cache_control"
BREAKPOINT = "prompt_cache_breakpoint"


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # json.loads lets lone surrogates through


def _json_bytes(value: Any) -> bytes:
    try:
        return _utf8(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    except (ValueError, TypeError, RecursionError):
        return b""


def _without_marker(value: Any) -> Any:
    if isinstance(value, dict) and (CACHE_CONTROL in value or BREAKPOINT in value):
        return {k: v for k, v in value.items() if k != CACHE_CONTROL and k != BREAKPOINT}
    return value


def _role(value: Any) -> str:
    return value[:_ROLE_MAX] if isinstance(value, str) else ""


def _opaque(kind: str, value: Any) -> bytes:
    digest = hashlib.blake2b(_json_bytes(value), digest_size=16).hexdigest()
    return b"\x00" + _utf8(kind[:_ROLE_MAX]) + b":" + digest.encode() + b"\x00"


_MEDIA = re.compile(  # what _opaque makes of an image, audio, a file, a video
    b"\\x00(?:" + b"|".join(re.escape(kind.encode()) for kind in sorted(_OPAQUE_PARTS))
    + b"):[0-9a-f]{32}\\x00"
)


def holds_media(parts: Sequence[PromptPart]) -> bool:
    """Whether a part holds an image, audio, a file or a video (each enters as a hash of
    it): its tokens are in the upstream's usage but in proportion to no bytes the proxy
    sees, so no token figure of the prompt is derived from bytes
    (``docs/prompt-caching.md``, "Images, audio and files")."""
    for part in parts:
        if 0 in part.data:  # a NUL (an int: no buffer lookup): most prompts have none
            return any(_MEDIA.search(part.data) for part in parts)
    return False


def _content(value: Any, out: list[bytes], depth: int = 0, marks: _Marks | None = None) -> None:
    """Append the bytes of a message's ``content`` (a string, a list of parts, a part);
    ``marks`` notes where a marked part ends."""
    if isinstance(value, str):
        out.append(_utf8(value))
    elif isinstance(value, list):
        if depth >= _NESTING_MAX:
            out.append(_json_bytes(value))
            return
        if marks is None:
            for item in value:
                _content_part(item, out, depth + 1)
            return
        key = marks.key
        for item in value:
            _content_part(item, out, depth + 1, marks)
            if isinstance(item, dict) and key in item:  # inline: once per content block
                marks.within = sum(map(len, out))
    elif value is not None:
        _content_part(value, out, depth + 1, marks)
        if marks is not None:
            marks.marked(value, out)


def _content_part(part: Any, out: list[bytes], depth: int, marks: _Marks | None = None) -> None:
    if isinstance(part, str):
        out.append(_utf8(part))
        return
    if not isinstance(part, dict):
        out.append(_json_bytes(part))
        return
    kind = part.get("type")
    text = part.get("text")
    if isinstance(text, str) and (kind is None or (isinstance(kind, str) and kind in _TEXT_PARTS)):
        out.append(_utf8(text))
    elif isinstance(kind, str) and kind in _OPAQUE_PARTS:
        out.append(_opaque(kind, _without_marker(part)))
    elif kind == "tool_result" and depth < _NESTING_MAX:
        # The header (id, is_error) as JSON, then the result's content read like any
        # content: text stays text, an image in it is hashed.
        out.append(_json_bytes({k: v for k, v in _without_marker(part).items() if k != "content"}))
        _content(part.get("content"), out, depth, marks)
    else:
        out.append(_json_bytes(_without_marker(part)))


def _message(
    message: Any, index: int, kind: str, skip: frozenset[str], marks: _Marks | None = None
) -> PromptPart:
    """A chat message, Messages message or Responses input item as one part: its content,
    then any other field (tool calls, name, tool_call_id, ...) as JSON."""
    if not isinstance(message, dict):
        if isinstance(message, str):  # not valid in any API, but readable
            return PromptPart(kind, index, "", _utf8(message))
        return PromptPart(kind, index, "", _json_bytes(message))
    role = message.get("role")
    if not isinstance(role, str):  # a Responses item such as function_call: its JSON
        return PromptPart(
            kind, index, _role(message.get("type")), _json_bytes(_without_marker(message))
        )
    content = message.get("content")
    if len(message) == 2 and isinstance(content, str):  # role and text: most messages
        data = content.encode("utf-8", "surrogatepass")  # as _utf8, one call fewer
    else:
        out: list[bytes] = []
        _content(content, out, 0, marks)
        extras = {k: v for k, v in message.items() if k not in skip}
        if extras:
            out.append(b"\x00" + _json_bytes(extras))
        data = b"".join(out)
    if role in _SYSTEM_ROLES and kind != "instructions":
        kind = "system"
    part = _new(PromptPart, (kind, index, role[:_ROLE_MAX], data))  # a C call, not a frame
    return part if marks is None or marks.within is None else marks.close(part)


_CHAT_SKIP = frozenset(("role", "content", CACHE_CONTROL))
_ITEM_SKIP = frozenset(("role", "content", "type", CACHE_CONTROL))


def _tool_parts(
    payload: Mapping[str, Any], *names: str, marks: _Marks | None = None
) -> list[PromptPart]:
    parts: list[PromptPart] = []
    for name in names:
        tools = payload.get(name)
        if isinstance(tools, list):
            for tool in tools:
                part = PromptPart("tools", len(parts), "", _json_bytes(_without_marker(tool)))
                if marks is not None and isinstance(tool, dict) and marks.key in tool:
                    marks.within = len(part.data)
                    marks.close(part)
                parts.append(part)
    return parts


# Request settings a provider documents as keeping a prompt from reusing another's cache,
# per API, each a part of its own ahead of the prompt when the body gives it (a dotted
# name reads a nested field); docs/prompt-caching.md, "Settings", says whose
# documentation and when.
CHAT_SETTINGS = ("response_format", "reasoning_effort", "verbosity", "service_tier")
RESPONSES_SETTINGS = ("text.format", "text.verbosity", "reasoning.effort", "service_tier")
MESSAGES_SETTINGS = ("tool_choice", "thinking", "output_config")
# per such tuple, the body's fields its settings are read from (a dotted name's first)
_SETTING_HEADS: dict[tuple[str, ...], frozenset[str]] = {
    names: frozenset(name.partition(".")[0] for name in names)
    for names in (CHAT_SETTINGS, RESPONSES_SETTINGS, MESSAGES_SETTINGS)
}

# The body's arrays whose items become one part each, in any API; the other parts are
# single fields: a setting, a system prompt, the instructions, a context id, a prompt or
# input string. Each top-level field counts once per part it can make.
_PART_ARRAYS = frozenset(("tools", "functions", "messages", "input", "instructions", "prompt"))
_SINGLE_FIELDS: tuple[str, ...] = (
    "system",
    "instructions",
    "previous_response_id",
    "conversation",
    "input",
    "prompt",
    *(
        name.partition(".")[0]
        for name in dict.fromkeys((*CHAT_SETTINGS, *RESPONSES_SETTINGS, *MESSAGES_SETTINGS))
    ),
)
_SINGLE = frozenset(_SINGLE_FIELDS)  # each once; the fields that count more, and how much
_SINGLE_MORE = tuple((name, n - 1) for name, n in Counter(_SINGLE_FIELDS).items() if n > 1)
_CONTENT = methodcaller("get", "content")  # an item's content (a body parsed from JSON)
_IDS_PER_PIECE = 16  # token ids written as text cost about a content piece per this many


def part_bound(payload: Mapping[str, Any], *, walk_below: int = 0) -> int:
    """At least as many parts as any dialect's ``prompt_parts`` builds from ``payload``,
    known before any part is built: the prompt-cache doctor's cost follows it
    (``docs/design/doctor.md``, "Where").
    """
    count = len(_SINGLE.intersection(payload))  # the body's few fields: one look
    for name, more in _SINGLE_MORE:
        if name in payload:
            count += more
    arrays = _PART_ARRAYS.intersection(payload)  # the ones it gives: one look
    for name in arrays:
        value = payload[name]
        if isinstance(value, list):
            count += 1 if name == "prompt" and value and _token_id(value[0]) else len(value)
    if count >= walk_below:
        return count
    system = payload.get("system")
    count += _pieces(system, walk_below - count) if isinstance(system, list) else 0
    for name in ("messages", "input", "instructions", "prompt"):
        if name not in arrays or count >= walk_below:
            continue
        items = payload[name]
        if not isinstance(items, list):
            continue
        if name == "prompt":
            if items and _token_id(items[0]):
                count += len(items) // _IDS_PER_PIECE
                continue
            for item in items:
                if isinstance(item, list):
                    count += len(item) // _IDS_PER_PIECE
            continue
        try:  # most messages' content is a string: no array to walk, found at C speed
            if list not in map(type, map(_CONTENT, items)):
                continue
        except AttributeError:  # an item that is not an object: walked below
            pass
        for item in items:
            if isinstance(item, dict):
                content = item.get("content")
                if isinstance(content, list):
                    count += _pieces(content, walk_below - count)
                    if count >= walk_below:
                        break
    return count


def _pieces(value: list[Any], budget: int, depth: int = 0) -> int:
    """Pieces of a content array read one by one (its items, and a tool result's content
    within them), counted until past ``budget``."""
    n = len(value)
    if n >= budget or depth >= _NESTING_MAX:
        return n
    for item in value:
        if isinstance(item, dict) and item.get("type") == "tool_result":
            inner = item.get("content")
            if isinstance(inner, list):
                n += _pieces(inner, budget - n, depth + 1)
                if n >= budget:
                    break
    return n


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _settings_parts(payload: Mapping[str, Any], names: tuple[str, ...]) -> list[PromptPart]:
    """One ``settings`` part per request setting of ``names`` that the body gives (a
    dotted name reads a nested field: ``text.format``), in that order, the setting's name
    as the part's role and its JSON as the bytes: ahead of every other part, so that a
    changed setting breaks the prefix there and is named. A setting absent adds nothing,
    so a body without any keeps the parts it always had."""
    parts: list[PromptPart] = []
    heads = _SETTING_HEADS.get(names) or frozenset(name.partition(".")[0] for name in names)
    if heads.isdisjoint(payload):  # most bodies give none: one look, not one per name
        return parts
    for name in names:
        head, _, field = name.partition(".")
        value = payload.get(head)
        if field:
            value = value.get(field) if isinstance(value, dict) else None
        if value is not None:
            parts.append(PromptPart("settings", len(parts), name, _json_bytes(value)))
    return parts


def cache_scope(payload: Mapping[str, Any]) -> tuple[str, str]:
    """(model, cache key) of a parsed request body: prompts that differ in either never
    share a prefix cache. The key is OpenAI's ``prompt_cache_key`` and vLLM's
    ``cache_salt``, joined when both are given; ``""`` when neither."""
    model = payload.get("model")
    key, salt = payload.get("prompt_cache_key"), payload.get("cache_salt")
    if key is None and salt is None:  # most bodies: no list to build
        joined = ""
    else:
        joined = "\x00".join(v for v in (key, salt) if isinstance(v, str) and v)
    return (model if isinstance(model, str) else ""), joined
