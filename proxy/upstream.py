"""The upstream side: the shared HTTP client, request building, error mapping.

Faithfulness rules (see README "What unchanged means"): method, path below the base
URL, query string, body bytes and headers are forwarded as received, except the
hop-by-hop headers (RFC 9110 section 7.6.1, plus any named in ``Connection``), ``Host``
and ``Content-Length`` (recomputed for the upstream), and ``Accept-Encoding`` on measured
routes (forced to ``identity`` so events can be parsed as they pass).

The proxy only ever talks to its configured upstream: the request target is the
configured base URL plus the path *below* ``/v1``, and a path whose segments decode to
``.``/``..`` or contain an encoded slash or backslash is refused before anything is
sent (:func:`safe_subpath`).

Transport errors are mapped to OpenAI-shaped errors using httpx's own exception
classes: cannot connect -> 502, timed out -> 504, anything else -> 502.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Protocol
from urllib.parse import unquote_to_bytes, urlsplit

import httpx

from proxy.config import Settings
from proxy.wire import WireTransport, origin_of, serialize


class UpstreamResponse(Protocol):
    """What the relay needs of a response: ``httpx.Response`` and
    :class:`proxy.wire.WireResponse` both have this shape."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> HeaderLookup: ...

    @property
    def stream(self) -> Any: ...

    async def aclose(self) -> None: ...


class HeaderLookup(Protocol):
    @property
    def raw(self) -> list[tuple[bytes, bytes]]: ...

    def get(self, key: str, default: Any = ...) -> Any: ...

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"proxy-connection", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})  # fmt: skip
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
_RESPONSE_DROP = HOP_BY_HOP | {b"content-length"}


class Upstream:
    """The shared upstream client: :meth:`open` sends a request, returns at the headers.

    Default (``--http-client builtin``): :class:`proxy.wire.WireTransport`; ``open``
    serializes the request itself (base path, Host and the target computed once), so
    no ``httpx`` object is built per request. Otherwise (``aiohttp``, ``httpx``, or an
    ``httpx.MockTransport`` injected by tests): ``httpx.AsyncClient`` builds the request
    (timeouts go into its extensions) and ``open`` calls the transport directly; the
    client's own ``send`` adds auth, redirect, cookie and elapsed-time layers a relay
    does not use, and wraps the body in two more iterators per chunk (issue 5).
    """

    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        timeout = httpx.Timeout(
            connect=settings.connect_timeout,
            read=settings.read_timeout,
            write=settings.write_timeout,
            pool=settings.connect_timeout,
        )
        base_url = httpx.URL(settings.upstream)
        client = settings.http_client
        if transport is None and client == "builtin":
            from proxy.transport import env_proxy

            if env_proxy(base_url.scheme, base_url.host) is not None:
                client = "aiohttp"  # the built-in client does not speak to HTTP proxies
            else:
                transport = WireTransport(
                    max_connections=settings.max_upstream_connections,
                    connect_timeout=settings.connect_timeout, read_timeout=settings.read_timeout,
                    write_timeout=settings.write_timeout)
        if transport is None and client == "aiohttp":
            from proxy.transport import AiohttpTransport

            transport = AiohttpTransport(
                max_connections=settings.max_upstream_connections,
                connect_timeout=settings.connect_timeout, read_timeout=settings.read_timeout)
        elif transport is None:
            limits = httpx.Limits(
                max_connections=settings.max_upstream_connections,
                max_keepalive_connections=settings.max_upstream_connections,
                keepalive_expiry=30.0,
            )
            transport = httpx.AsyncHTTPTransport(limits=limits, retries=0)
        self.transport = transport
        self.base = settings.upstream
        self._wire = transport if isinstance(transport, WireTransport) else None
        # Computed once: the base path, and Host exactly as httpx would write it.
        self._base_path = urlsplit(self.base).path.rstrip("/").encode()
        self._origin = origin_of(base_url)
        self._host_header = httpx.Request("GET", base_url).headers.raw[0][1]
        self.client = httpx.AsyncClient(transport=transport, timeout=timeout, follow_redirects=False)
        # httpx adds Accept, Accept-Encoding, Connection and User-Agent to every request;
        # forward only what the client sent (else a client that never asked for gzip gets it).
        self.client.headers.clear()

    async def open(self, method: str, subpath: bytes, query: bytes,
                   headers: list[tuple[bytes, bytes]], body: bytes) -> UpstreamResponse:
        """Send a request for ``<base><subpath>?<query>``; return once the response
        headers arrived (the body is ``response.stream``, not yet read)."""
        wire = self._wire
        if wire is not None:
            target = self._base_path + subpath + (b"?" + query if query else b"")
            payload = serialize(method, target, self._host_header, headers, body)
            return await wire.exchange(method, self._origin, payload)
        request = self.client.build_request(
            method, upstream_url(self.base, subpath, query), headers=headers, content=body)
        return await self.transport.handle_async_request(request)

    async def aclose(self) -> None:
        await self.client.aclose()


class UnsafePath(ValueError):
    """The request path would leave the upstream's base path."""


def safe_subpath(raw_path: bytes) -> bytes:
    """The part of ``raw_path`` below ``/v1``, refusing anything that could escape it."""
    if raw_path != b"/v1" and not raw_path.startswith(b"/v1/"):
        raise UnsafePath("path must start with /v1/")
    rest = raw_path[3:]
    if b"\\" in rest or b"#" in rest:
        raise UnsafePath("path contains a backslash or fragment")
    for segment in rest.split(b"/")[1:]:
        decoded = unquote_to_bytes(segment)
        if decoded in (b".", b"..") or b"/" in decoded or b"\\" in decoded or b"\x00" in decoded:
            raise UnsafePath("path contains a dot segment or an encoded slash")
    return rest


def upstream_url(base: str, subpath: bytes, query: bytes) -> httpx.URL:
    """``<base><subpath>?<query>`` with the base's scheme and host, whatever the path says."""
    parts = urlsplit(base)
    raw = parts.path.rstrip("/").encode() + subpath
    url = httpx.URL(scheme=parts.scheme, host=parts.hostname or "", port=parts.port,
                    raw_path=raw + (b"?" + query if query else b""))
    return url


def forward_headers(raw: Iterable[tuple[bytes, bytes]], *, identity: bool,
                    drop: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """Request headers for the upstream: hop-by-hop, Host and Content-Length removed."""
    items = list(raw)
    named = _connection_tokens(items)
    out = [
        (k, v) for k, v in items
        if k not in _REQUEST_DROP and k not in named and k not in drop
        and not (identity and k == b"accept-encoding")
    ]
    if identity:
        out.append((b"accept-encoding", b"identity"))
    return out


def response_headers(raw: Iterable[tuple[bytes, bytes]], *, keep_length: bool) -> list[tuple[bytes, bytes]]:
    """Response headers for the client: hop-by-hop removed, the rest unchanged."""
    items = list(raw)
    named = _connection_tokens(items)
    drop = HOP_BY_HOP if keep_length else _RESPONSE_DROP
    return [(k.lower(), v) for k, v in items if k.lower() not in drop and k.lower() not in named]


def _connection_tokens(items: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    tokens = [
        t.strip().lower()
        for k, v in items if k.lower() == b"connection"
        for t in v.split(b",")
    ]
    return frozenset(t for t in tokens if t)


def error_body(message: str, type_: str, code: str | None) -> bytes:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()


def map_transport_error(exc: httpx.TransportError) -> tuple[int, bytes]:
    """Status and OpenAI-shaped body for an upstream failure before response headers."""
    if isinstance(exc, httpx.ConnectTimeout | httpx.ConnectError):
        return 502, error_body(f"upstream unreachable: {type(exc).__name__}",
                               "upstream_error", "upstream_unreachable")
    if isinstance(exc, httpx.PoolTimeout):
        return 504, error_body("no upstream connection became free in time",
                               "upstream_error", "upstream_pool_timeout")
    if isinstance(exc, httpx.TimeoutException):
        return 504, error_body(f"upstream timed out: {type(exc).__name__}",
                               "upstream_error", "upstream_timeout")
    return 502, error_body(f"upstream failed: {type(exc).__name__}", "upstream_error",
                           "upstream_failed")
