"""An httpx transport for the upstream backed by aiohttp's connection pool.

Used with ``--http-client aiohttp``, and instead of the built-in client
(:mod:`proxy.wire`, the default) when an ``HTTP(S)_PROXY`` variable applies to the
upstream, since aiohttp speaks to HTTP proxies and the built-in client does not.

Why it was written (before :mod:`proxy.wire`): profiling the proxy at 64 concurrent
streams (py-spy, see benchmarks/profile.md) showed httpcore's pool costing about 45 % of the proxy's CPU: every request walks every
pooled connection and checks whether its socket is readable (``has_expired``), and every
body read asks anyio for socket attributes. aiohttp's pool and C HTTP parser do the same
job for a fraction of that. Keeping httpx as the *interface* (``httpx.AsyncClient`` on
top of this transport) keeps the app's seams: tests inject ``httpx.MockTransport``, and
``--http-client httpx`` selects httpx's own transport for comparison.

Faithfulness: no automatic headers (aiohttp would add ``User-Agent``, ``Accept`` and
``Accept-Encoding``), no decompression, no redirects, no cookies. Bodies arrive as
aiohttp reads them (``iter_any``), de-chunked like httpx's ``aiter_raw``.

Errors are raised as httpx's own exception classes, so callers map them once:
connect failures -> ``httpx.ConnectError``/``ConnectTimeout``, no headers or no bytes
within the read timeout -> ``httpx.ReadTimeout``, a connection that breaks mid-body ->
``httpx.ReadError``/``RemoteProtocolError``.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Callable

import aiohttp
import httpx


class AiohttpTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, max_connections: int, connect_timeout: float, read_timeout: float,
                 keepalive_expiry: float = 30.0) -> None:
        self._keepalive = keepalive_expiry
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout, sock_connect=connect_timeout,
            sock_read=read_timeout)
        self._session: aiohttp.ClientSession | None = None
        self._proxy_for: dict[str, str | None] = {}
        # The connection limit is ours, not aiohttp's, so that waiting for a free
        # connection is told apart from connecting (504 pool timeout vs 502 unreachable).
        self._slots = asyncio.Semaphore(max_connections)
        self._pool_timeout = connect_timeout

    def _get_session(self) -> aiohttp.ClientSession:
        # Created on first use, inside the running loop (aiohttp requires that).
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=self._keepalive,
                ttl_dns_cache=60)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                read_bufsize=1 << 16, max_line_size=1 << 16, max_field_size=1 << 16)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._slots.locked():
            try:
                async with asyncio.timeout(self._pool_timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpx.PoolTimeout("no upstream connection became free in time",
                                        request=request) from None
        else:
            await self._slots.acquire()  # free slot: returns at once
        try:
            response = await self._request(request)
        except BaseException:
            self._slots.release()
            raise
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_Body(response, request, self._slots.release),
            request=request,
            extensions={"reason_phrase": (response.reason or "").encode("latin-1", "replace")},
        )

    async def _request(self, request: httpx.Request) -> aiohttp.ClientResponse:
        session = self._get_session()
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw
                   if k.lower() not in (b"host", b"content-length", b"transfer-encoding")]
        body = request.content if request.content else None
        origin = f"{request.url.scheme}://{request.url.netloc.decode('ascii')}"
        proxy = self._proxy_for.get(origin, "")
        if proxy == "":
            proxy = self._proxy_for[origin] = env_proxy(request.url.scheme, request.url.host)
        try:
            return await session.request(
                request.method, str(request.url), headers=headers, data=body,
                allow_redirects=False, compress=None, chunked=None, proxy=proxy)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise as_httpx_error(exc, request) from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def as_httpx_error(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    """The httpx exception for an aiohttp (or socket) failure, before or during the body.

    Connect failures -> ``ConnectError``/``ConnectTimeout`` (502); no headers or no bytes
    within the read timeout -> ``ReadTimeout`` (504 before headers, outcome ``timeout``
    after); the peer breaking the exchange -> ``RemoteProtocolError``; anything else ->
    ``ReadError``.
    """
    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, TimeoutError):  # aiohttp.ServerTimeoutError is one too
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                  | aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.ReadError(message, request=request)


def env_proxy(scheme: str, host: str) -> str | None:
    """HTTP(S)_PROXY / NO_PROXY for the upstream, looked up once per origin.

    aiohttp's ``trust_env`` would redo this (and read ~/.netrc) on every request.
    """
    if urllib.request.proxy_bypass(host):
        return None
    return urllib.request.getproxies().get(scheme)


class _Body(httpx.AsyncByteStream):
    __slots__ = ("_done", "_release", "_request", "_response")

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request,
                 release: Callable[[], None]) -> None:
        self._response = response
        self._request = request
        self._done = False
        self._release: Callable[[], None] | None = release

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._response.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                yield chunk
        except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
            raise as_httpx_error(exc, self._request) from exc
        self._done = True

    async def aclose(self) -> None:
        if self._done:
            self._response.release()  # fully read: the connection goes back to the pool
        else:
            self._response.close()  # unfinished: drop the connection, the upstream sees it
        release = self._release
        if release is not None:  # the connection slot, exactly once
            self._release = None
            release()
