"""``GET /v1/models`` with several upstreams: one list, merged from every upstream's.

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from proxy.logs import RateLimitedLog
from proxy.upstream import LiveUpstream
from proxy.wire.errors import UpstreamError

ALL_UPSTREAMS = "all"  # the upstream label of the merged list
LIST_LIMIT = 8 * 1024 * 1024  # bytes of one upstream's list read at most

Headers = list[tuple[bytes, bytes]]


Refusal = tuple[int, bytes]  # an upstream's 401 or 403: its status and body


async def merged_models(targets: Sequence[LiveUpstream],
                        headers_for: Callable[[LiveUpstream], Headers], query: bytes,
                        warnings: RateLimitedLog) -> tuple[int, bytes] | None:
    """The answer: 200 and the merged list; when every upstream refused the client's key
    (401 or 403: a key the proxy passes through), the first refusal as it came, the
    client's to mend, not an upstream failure; None when no upstream answered with a
    list. ``headers_for`` gives the headers a request to an upstream carries."""
    lists = await asyncio.gather(*(_model_list(t, headers_for, query, warnings)
                                   for t in targets))
    refusals = [items for items in lists if isinstance(items, tuple)]
    if refusals and len(refusals) == len(lists):
        return refusals[0]
    if all(not isinstance(items, list) for items in lists):
        return None
    seen: set[Any] = set()
    data: list[Any] = []
    for items in lists:
        for item in items if isinstance(items, list) else ():
            key = item.get("id") if isinstance(item, dict) else None
            if key is None or key in seen:
                continue
            seen.add(key)
            data.append(item)
    return 200, list_body(data)


def list_body(data: list[Any]) -> bytes:
    """The answer's body: the list object OpenAI's API returns, with the merged items."""
    return json.dumps({"object": "list", "data": data}).encode()


async def _model_list(target: LiveUpstream, headers_for: Callable[[LiveUpstream], Headers],
                      query: bytes, warnings: RateLimitedLog) -> list[Any] | Refusal | None:
    out = headers_for(target)
    try:
        response = await target.client.open("GET", b"/models", query, out, b"")
        try:
            body = await response.body.read(LIST_LIMIT)
        finally:
            await response.aclose()
    except UpstreamError as exc:
        warnings.warning("model list: upstream %s left out: %s: %s", target.name,
                         type(exc).__name__, exc)
        return None
    parsed = json_object(body) if 200 <= response.status_code < 300 else None
    items = parsed.get("data") if parsed is not None else None
    if not isinstance(items, list):
        warnings.warning("model list: upstream %s left out: HTTP %s%s", target.name,
                         response.status_code, "" if parsed is None else " without a data list")
        if response.status_code in (401, 403) and json_object(body) is not None:
            return response.status_code, body
        return None
    return items


def json_object(body: bytes) -> dict[str, Any] | None:
    """``body`` as a JSON object; None when it is not JSON or not an object."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
