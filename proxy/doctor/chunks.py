"""Where a part's content-defined chunks end (:func:`chunk_ends`): cut at paragraph,
line and sentence ends, so that a run of text keeps its chunks wherever it moves.

Design: ``docs/design/doctor.md``, "The chunks".
"""

from __future__ import annotations

DEFAULT_CHUNK_BYTES = 1024  # a content chunk's least length (its most: four times that)
FIRST_CHUNK_BYTES = 16  # the least length of a part's first chunk


def chunk_ends(
    data: bytes, least: int, most: int, first: int = FIRST_CHUNK_BYTES, whole: int | None = None
) -> list[int]:
    """Where the content-defined chunks of ``data`` end, by the rules of
    ``docs/design/doctor.md``, "The chunks": a text of at most ``whole`` bytes (default
    ``least``) is one chunk.
    """
    n = len(data)
    if n <= (least if whole is None else whole):
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
        tail = max(
            data.rfind(b". ", start + first, n - 1) + 2, data.rfind(b"\n", start + first, n - 1) + 1
        )
        if tail > start + first:
            ends.append(tail)
        ends.append(n)
    return ends
