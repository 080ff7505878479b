"""Request bodies: what the proxy decodes from them and the usage request it adds.

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.model_list import json_object

# Bodies larger than this are decoded (and re-encoded) in pieces in a worker thread; the
# threshold is where the inline work stops being shorter than the GIL switch interval
# the loop may wait while a thread works (benchmarks/RESULTS.md, loop_micro.py body).
LARGE_BODY = 1 << 20
PIECE = 64 * 1024  # characters decoded or encoded per call into the C code
_FIRST_WINDOW = 256

_WS = re.compile(r"[ \t\n\r]*").match  # JSON whitespace, as json.decoder's WHITESPACE
_raw_decode = json.JSONDecoder().raw_decode
_scanstring: Callable[[str, int, bool], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
# allow_nan=False: a number past a float's range (1e400) decodes as inf, which would be
# written back as Infinity, not JSON; such a body is forwarded as it came instead
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB]").match
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F]").match


def compact(value: Any) -> bytes:
    """``value`` as the proxy sends a JSON body it re-encodes: compact, UTF-8; raises
    ValueError where that would not be JSON (a NaN or an infinity)."""
    return _encode(value).encode()


@dataclass(slots=True)
class Decoded:
    """A body's JSON value, and the containers that were walked: by id (they live as
    long as the value does), the length of each member's text in the body. :meth:`dumps`
    encodes piece by piece where the decoding went piece by piece, runs of small members
    in one call."""

    value: Any
    walked: dict[int, list[int]]
    piece: int = PIECE

    def dumps(self, value: Any) -> bytes:
        """``value`` (this body's value, or a shallow copy of a walked container, e.g.
        with one key added) as :func:`compact` writes it."""
        parts: list[str] = []
        self._put(value, parts, top=True)
        return b"".join(part.encode() for part in parts)

    def _put(self, value: Any, parts: list[str], top: bool = False) -> None:
        piece = self.piece
        if isinstance(value, str) and len(value) > piece:
            parts.append('"')
            for start in range(0, len(value), piece):  # escaping is per character
                parts.append(_encode(value[start:start + piece])[1:-1])
            parts.append('"')
            return
        sizes = self.walked.get(id(value))
        if (sizes is None and not top) or not isinstance(value, (dict, list)):
            parts.append(_encode(value))
            return
        is_dict = isinstance(value, dict)
        parts.append("{" if is_dict else "[")
        members: list[Any] = list(value.items()) if isinstance(value, dict) else value
        if sizes is None:  # a new container (the body with a key added): no run
            sizes = [piece + 1] * len(members)
        run: list[Any] = []  # small members, encoded in one call
        run_size = 0
        written = False
        for member, size in zip(members, sizes, strict=True):
            if size <= piece and not self._large(member):
                if run_size + size > piece:
                    written = self._run(run, is_dict, written, parts)
                    run, run_size = [], 0
                run.append(member)
                run_size += size
                continue
            written = self._run(run, is_dict, written, parts)
            run, run_size = [], 0
            if written:
                parts.append(",")
            if is_dict:
                self._put(member[0], parts)
                parts.append(":")
                self._put(member[1], parts)
            else:
                self._put(member, parts)
            written = True
        self._run(run, is_dict, written, parts)
        parts.append("}" if is_dict else "]")

    def _large(self, member: Any) -> bool:
        """A member holding a walked container or a long string: not for a run."""
        if isinstance(member, tuple):  # a dict's (key, value)
            return any(self._large(part) for part in member)
        return (id(member) in self.walked
                or (isinstance(member, str) and len(member) > self.piece))

    @staticmethod
    def _run(run: list[Any], is_dict: bool, written: bool, parts: list[str]) -> bool:
        """Encode ``run`` as one container and keep what is inside its brackets."""
        if not run:
            return written
        if written:
            parts.append(",")
        parts.append(_encode(dict(run) if is_dict else run)[1:-1])
        return True


def loads(body: bytes, piece: int = PIECE) -> Decoded | None:
    """``body`` decoded as ``json.loads`` decodes it, in pieces of at most ``piece``
    characters (16 or more); None where ``json.loads`` raises ``ValueError`` (the body
    is not JSON)."""
    if piece < 16:
        raise ValueError("piece must be at least 16 characters: a cut keeps 12 together")
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        walk = _Walk(text, piece)
        value, end = walk.value(_WS(text, 0).end())  # type: ignore[union-attr]
        if _WS(text, end).end() != len(text):  # type: ignore[union-attr]
            return None  # "Extra data"
        return Decoded(value, walk.walked, piece)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError included
        return None
    except RecursionError:  # deeper than this walk can go: json itself decides
        try:
            return Decoded(json.loads(body), {}, piece)
        except (ValueError, RecursionError):
            return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Walk:
    """One body's text, decoded value by value (``docs/design/request-path.md``)."""

    def __init__(self, text: str, piece: int) -> None:
        self.text = text
        self.piece = piece
        self.walked: dict[int, list[int]] = {}
        self.first = min(_FIRST_WINDOW, piece)
        self.window = self.first  # follows the sizes of the values met, up to a piece

    def value(self, at: int) -> tuple[Any, int]:
        text, piece = self.text, self.piece
        if text[at:at + 1] == '"':  # a string finds its own end, a window at a time
            return self._string(at + 1)
        window = self.window
        while True:
            if len(text) - at <= window:
                return _raw_decode(text, at)  # all of the rest fits: one call
            part = text[at:at + window]
            try:
                value, end = _raw_decode(part)
            except ValueError:
                pass
            else:
                # Ended inside the window: exactly as on the whole text, unless it is a
                # number the window cut ("1.5e+" of "1.5e+30" reads as 1.5).
                if end < len(part) - (2 if _is_number(value) else 0):
                    self.window = max(self.first, min(piece, 2 * end))
                    return value, at + end
            if window >= piece:
                break
            window = min(piece, 4 * window)
        first = text[at]
        if first == "{":
            return self._object(at + 1)
        if first == "[":
            return self._array(at + 1)
        return _raw_decode(text, at)  # a number longer than a piece, or not JSON

    def _object(self, at: int) -> tuple[dict[str, Any], int]:
        text = self.text
        members: dict[str, Any] = {}
        sizes: list[int] = []
        self.walked[id(members)] = sizes
        at = _WS(text, at).end()  # type: ignore[union-attr]
        if text[at:at + 1] == "}":
            return members, at + 1
        while True:
            if text[at:at + 1] != '"':
                raise ValueError("Expecting property name enclosed in double quotes")
            begin = at
            key, at = self._string(at + 1)
            at = _WS(text, at).end()  # type: ignore[union-attr]
            if text[at:at + 1] != ":":
                raise ValueError("Expecting ':' delimiter")
            repeated = key in members  # its first place, its last value (as json)
            members[key], at = self.value(_WS(text, at + 1).end())  # type: ignore[union-attr]
            if repeated:
                sizes[list(members).index(key)] = at - begin
            else:
                sizes.append(at - begin)
            at = _WS(text, at).end()  # type: ignore[union-attr]
            follows = text[at:at + 1]
            if follows == "}":
                return members, at + 1
            if follows != ",":
                raise ValueError("Expecting ',' delimiter")
            at = _WS(text, at + 1).end()  # type: ignore[union-attr]

    def _array(self, at: int) -> tuple[list[Any], int]:
        text = self.text
        items: list[Any] = []
        sizes: list[int] = []
        self.walked[id(items)] = sizes
        at = _WS(text, at).end()  # type: ignore[union-attr]
        if text[at:at + 1] == "]":
            return items, at + 1
        while True:
            begin = at
            item, at = self.value(at)
            items.append(item)
            sizes.append(at - begin)
            if text[at:at + 1] != ",":
                at = _WS(text, at).end()  # type: ignore[union-attr]
            follows = text[at:at + 1]
            if follows == "]":
                return items, at + 1
            if follows != ",":
                raise ValueError("Expecting ',' delimiter")
            at = _WS(text, at + 1).end()  # type: ignore[union-attr]

    def _string(self, at: int) -> tuple[str, int]:
        """The string whose text starts at ``at`` (after its opening quote), and the
        position after its closing quote. Decoded a window at a time (growing, as for
        values, up to a piece), each window cut where no escape sequence and no
        surrogate pair is split, by ``scanstring``: it stops at the closing quote if
        the window holds it, else at the quote put after the window."""
        text, piece = self.text, self.piece
        parts: list[str] = []
        start, window = at, self.first
        while True:
            limit = start + window
            cut = len(text) if limit >= len(text) else self._cut(start, limit)
            chunk, end = _scanstring(text[start:cut] + '"', 0, True)
            if end <= cut - start:  # the closing quote was in the window
                if not parts:
                    return chunk, start + end
                parts.append(chunk)
                return "".join(parts), start + end
            if cut >= len(text):
                raise ValueError("Unterminated string")
            parts.append(chunk)
            start, window = cut, min(piece, 4 * window)

    def _cut(self, start: int, limit: int) -> int:
        """A position in (start, limit] where the string's text may be cut: not inside
        an escape sequence, not between the two halves of an escaped surrogate pair.
        ``start`` is such a position already (the string's start, or the last cut)."""
        text = self.text
        slash = text.rfind("\\", max(start, limit - 6), limit)
        if slash < 0:
            return limit  # no escape (six characters at most) reaches over the cut
        if not self._begins_escape(slash, start):
            return slash + 1  # text[slash] is the escaped one of two backslashes
        # text[slash] begins an escape: cut before it, unless it is the low half of a
        # pair whose high half is the escape just before (then before that one)
        if (_LOW_SURROGATE(text, slash) and slash - 6 > start
                and _HIGH_SURROGATE(text, slash - 6)
                and self._begins_escape(slash - 6, start)):
            return slash - 6
        return slash

    def _begins_escape(self, slash: int, start: int) -> bool:
        """Whether the backslash at ``slash`` begins an escape: an even run of
        backslashes before it, counted back to ``start`` (where escapes begin afresh)."""
        text = self.text
        run = 0
        while slash - 1 - run >= start and text[slash - 1 - run] == "\\":
            run += 1
        return run % 2 == 0


def meant_as_json(measured: bool, body: bytes) -> bool:
    """A body that should have been a JSON object: any body on the four JSON APIs, and
    on other routes a body that starts as one (not a multipart upload) and was parsed
    (at most 1 MiB off the measured routes, see :meth:`proxy.routes.V1Handler._decode`)."""
    if not body.strip():
        return False
    return measured or (body.lstrip()[:1] == b"{" and len(body) <= 1 << 20)


def not_an_object(body: bytes) -> str:
    """What is wrong with a body that is not a JSON object, without quoting it: where
    the parser stopped, or which JSON type it is."""
    try:
        value = json.loads(body)
    except RecursionError:
        return "the request body is not valid JSON (nested too deeply)"
    except ValueError as exc:
        where = f" ({exc.msg}: line {exc.lineno} column {exc.colno})" if isinstance(
            exc, json.JSONDecodeError) else " (not UTF-8)"
        return f"the request body is not valid JSON{where}"
    kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")
    return f"the request body is JSON ({kind}) but not an object"


def decode_body(body: bytes, inject: bool, *, large: bool = False
                ) -> tuple[dict[str, Any] | None, bytes | None]:
    """The body as a JSON object, or None; and when ``inject`` and it asks for a stream,
    the body with the usage request (None: unchanged). ``large``: in pieces, for a
    worker thread (:func:`loads`): the same object and the same bytes."""
    encode: Callable[[Any], bytes] = compact
    if large:
        decoded = loads(body)
        payload = decoded.value if decoded is not None else None
        if decoded is not None:
            encode = decoded.dumps
    else:
        payload = json_object(body)
    if not isinstance(payload, dict):
        return None, None
    if not inject or payload.get("stream") is not True:
        return payload, None
    return payload, _with_usage(payload, encode)


def _with_usage(payload: dict[str, Any], encode: Callable[[Any], bytes] = compact
                ) -> bytes | None:
    """The request body with ``stream_options.include_usage`` set, or None if it already is."""
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return None  # malformed: leave the request alone, the upstream will say
    if options is not None and options.get("include_usage") is True:
        return None
    changed = dict(payload)
    changed["stream_options"] = {**(options or {}), "include_usage": True}
    try:
        return encode(changed)
    except ValueError:  # a lone surrogate escaped in the JSON, a number past a float's range
        return None  # forward the body as it came; tokens fall back to counting
