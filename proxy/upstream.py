"""One live upstream: its client, request building, header filtering, error mapping.

Design: ``docs/design/upstream-client.md``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Protocol
from urllib.parse import unquote_to_bytes, urlsplit

from proxy.admission import Admission
from proxy.config_values import SettingsError
from proxy.tracing import upstream_attributes
from proxy.upstream_spec import UpstreamSpec
from proxy.wire.endpoint import Endpoint, ProxyEndpoint, authority
from proxy.wire.errors import (
    ConnectError,
    PoolTimeout,
    ResponseHeadTooLarge,
    UpstreamError,
    UpstreamTimeout,
)
from proxy.wire.http11 import serialize
from proxy.wire.pool import WireTransport
from proxy.wire.response import WireResponse

log = logging.getLogger("proxy")

# Never forwarded (RFC 9110 section 7.6.1), nor any field that Connection names.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"proxy-connection", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})  # fmt: skip
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
_RESPONSE_DROP = HOP_BY_HOP | {b"content-length"}


class UpstreamClient:
    """One upstream's client: :meth:`open` sends a request, returns at the headers.

    Everything that does not change per request is computed here once: the endpoint
    (pool key, with the HTTP proxy if one applies), the target prefix (the base path,
    or the absolute form through a plain-http proxy) and the ``Host`` header, so a
    request costs one ``bytes.join`` before it is written.
    """

    def __init__(self, spec: UpstreamSpec, transport: WireTransport | None = None) -> None:
        self.base = spec.url
        parts = urlsplit(self.base)
        scheme = parts.scheme
        hostname = parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        self.host = authority(hostname, port)
        self.hostname, self.port = hostname, port
        self.transport = (
            transport
            if transport is not None
            else WireTransport(
                max_connections=spec.max_connections,
                connect_timeout=spec.connect_timeout,
                read_timeout=spec.read_timeout,
                write_timeout=spec.write_timeout,
                keepalive_expiry=spec.keepalive_expiry,
                resend_on_reset=spec.resend_on_reset,
                keep_warm=spec.keep_warm,
            )
        )
        host_text = f"[{hostname}]" if ":" in hostname else hostname
        netloc = host_text.encode("idna") + (f":{parts.port}".encode() if parts.port else b"")
        self._host_header = netloc
        self._prefix = parts.path.rstrip("/").encode()
        self._proxy_headers: list[tuple[bytes, bytes]] = []
        self.endpoint = Endpoint(scheme, hostname, port)
        proxy_url = env_proxy(scheme, hostname)
        if proxy_url is not None:
            try:
                via = ProxyEndpoint.from_url(proxy_url)
            except ValueError as exc:  # an https:// or socks5:// proxy: said in one line
                raise SettingsError(f"{scheme.upper()}_PROXY for upstream {self.host}: {exc}; "
                                    "set NO_PROXY to reach it directly") from None
            if scheme == "https":
                self.endpoint = Endpoint(scheme, hostname, port, via)
                how = "a CONNECT tunnel"
            else:
                self.endpoint = Endpoint("http", via.host, via.port)
                self._prefix = b"http://" + netloc + self._prefix
                if via.authorization:
                    self._proxy_headers = [(b"proxy-authorization", via.authorization)]
                how = "absolute-form requests"
            log.info(
                "upstream %s is reached through the HTTP proxy %s:%d (%s_PROXY), with %s",
                self.host,
                via.host,
                via.port,
                scheme.upper(),
                how,
            )

    async def open(
        self,
        method: str,
        subpath: bytes,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        clock: Callable[[], float] = time.perf_counter,
    ) -> WireResponse:
        """Send a request for ``<base><subpath>?<query>``; return once the response
        headers arrived (the body is ``response.body``, not yet read). ``clock`` times
        the response's ``setup_s`` (the caller's clock, so durations add up)."""
        target = self._prefix + subpath + (b"?" + query if query else b"")
        if self._proxy_headers:
            headers = [*headers, *self._proxy_headers]
        payload = serialize(method, target, self._host_header, headers, body)
        return await self.transport.exchange(method, self.endpoint, payload, clock)

    async def aclose(self) -> None:
        await self.transport.aclose()


class Gauge(Protocol):
    def inc(self) -> None: ...
    def dec(self) -> None: ...


class _NoGauge:
    def inc(self) -> None:
        pass

    def dec(self) -> None:
        pass


_CLOSING: set[asyncio.Task[None]] = set()  # pools of retired upstreams being closed


class LiveUpstream:
    """One upstream, live: its client, its admission (``max_concurrency``/``max_queue``
    per upstream), the headers it adds, and its in-flight gauge. Everything is decided
    here once; a request only reads it."""

    __slots__ = (
        "active",
        "admission",
        "client",
        "closing",
        "headers",
        "in_flight",
        "key",
        "name",
        "spec",
        "telemetry",
    )

    def __init__(
        self,
        spec: UpstreamSpec,
        in_flight: Gauge | None = None,
        transport: WireTransport | None = None,
        key: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.client = UpstreamClient(spec, transport)
        self.admission = Admission(spec.max_concurrency, spec.max_queue)
        self.key = key  # the header with its own key (proxy.auth.key_header), if it holds one
        self.headers = tuple((k.encode(), v.encode()) for k, v in spec.headers)
        self.in_flight: Gauge = in_flight if in_flight is not None else _NoGauge()
        self.telemetry = upstream_attributes(spec.url, spec.provider)  # span/OTLP attributes
        self.active = 0  # requests using it now, so a reload closes it only when idle
        self.closing = False

    def enter(self) -> None:
        self.active += 1
        self.in_flight.inc()

    def leave(self) -> None:
        self.active -= 1
        self.in_flight.dec()
        if self.closing and not self.active:
            self.close_soon()

    def close_soon(self) -> None:
        """Close the pool from the loop (held until done: the loop keeps weak refs)."""
        task = asyncio.get_running_loop().create_task(self.client.aclose())
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)


def env_proxy(scheme: str, host: str) -> str | None:
    """The ``HTTP(S)_PROXY`` URL that applies to ``host``, unless ``NO_PROXY`` exempts it:
    as the standard library reads it, and also by address ranges (``10.0.0.0/8``), an
    IPv6 address in brackets and a ``*.`` wildcard, as curl and Go read it (Kubernetes
    clusters set ``NO_PROXY=10.0.0.0/8,.svc``)."""
    proxies = urllib.request.getproxies()  # the environment's, read once
    if urllib.request.proxy_bypass(host) or _no_proxy_match(host, proxies.get("no", "")):
        return None
    return proxies.get(scheme)


def _no_proxy_match(host: str, entries: str) -> bool:
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None
    name = host.lower().rstrip(".")
    for entry in (e.strip().lower() for e in entries.split(",")):
        if not entry:
            continue
        if entry.startswith("*."):  # a wildcard: the domain's names, and the domain
            entry = entry[1:]
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry.strip("[]"), strict=False):
                    return True
            except ValueError:
                pass
        elif entry.startswith(".") and (name.endswith(entry) or name == entry[1:]):
            return True
    return False


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


def forward_headers(
    raw: Iterable[tuple[bytes, bytes]], *, identity: bool, drop: frozenset[bytes] = frozenset()
) -> list[tuple[bytes, bytes]]:
    """Request headers for the upstream: hop-by-hop, Host and Content-Length removed."""
    items = list(raw)
    named = _connection_tokens(items)
    out = [
        (k, v)
        for k, v in items
        if k not in _REQUEST_DROP
        and k not in named
        and k not in drop
        and not (identity and k == b"accept-encoding")
    ]
    if identity:
        out.append((b"accept-encoding", b"identity"))
    return out


def response_headers(
    raw: Iterable[tuple[bytes, bytes]], *, keep_length: bool
) -> list[tuple[bytes, bytes]]:
    """Response headers for the client: hop-by-hop removed, the rest unchanged."""
    items = list(raw)
    named = _connection_tokens(items)
    drop = HOP_BY_HOP if keep_length else _RESPONSE_DROP
    return [(k.lower(), v) for k, v in items if k.lower() not in drop and k.lower() not in named]


def _connection_tokens(items: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    tokens = [
        t.strip().lower() for k, v in items if k.lower() == b"connection" for t in v.split(b",")
    ]
    return frozenset(t for t in tokens if t)


def error_body(message: str, type_: str, code: str | None) -> bytes:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": None, "code": code}}
    ).encode()


def error_response(exc: UpstreamError, host: str) -> tuple[int, bytes]:
    """Status and OpenAI-shaped body for an upstream failure before response headers."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, ConnectError):
        return 502, error_body(
            f"upstream {host} unreachable: {detail}", "upstream_error", "upstream_unreachable"
        )
    if isinstance(exc, PoolTimeout):
        return 504, error_body(
            f"no connection to upstream {host} became free in time",
            "upstream_error",
            "upstream_pool_timeout",
        )
    if isinstance(exc, UpstreamTimeout):
        return 504, error_body(
            f"upstream {host} timed out: {detail}", "upstream_error", "upstream_timeout"
        )
    if isinstance(exc, ResponseHeadTooLarge):
        return 502, error_body(
            f"upstream {host} sent {detail}", "upstream_error", "upstream_headers_too_large"
        )
    return 502, error_body(f"upstream {host} failed: {detail}", "upstream_error", "upstream_failed")
