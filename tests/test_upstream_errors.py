"""``proxy.upstream.error_response``: each of the wire's errors, mapped once.

Cannot connect -> 502 ``upstream_unreachable``; no free connection -> 504
``upstream_pool_timeout``; the upstream timed out -> 504 ``upstream_timeout``; anything
else -> 502 ``upstream_failed``. The outcome recorded for each
(:func:`proxy.stages.failure_outcome`) names the same cause: ``upstream_unreachable``,
``pool_timeout``, ``upstream_timeout``, ``upstream_interrupted`` (closed or reset before
an answer) or ``upstream_error`` (not HTTP). The message names the upstream's host and never a key
or a path: the failures here are real ones, produced by :class:`proxy.upstream.UpstreamClient`
for a request carrying a key in its header and query and a tenant in its base path, and
none of them may appear in what the client is told.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.config import Settings, single_spec
from proxy.measure import Outcome
from proxy.stages import failure_outcome
from proxy.upstream import UpstreamClient, error_response
from proxy.wire.errors import (
    ConnectError,
    ConnectTimeout,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    ResponseHeadTooLarge,
    UpstreamError,
    WriteTimeout,
)
from proxy.wire.pool import WireTransport
from proxy.wire.response import WireResponse
from tests.raw_upstream import closed_port
from tests.test_wire import (
    PROXY_VARIABLES,
    Scripted,
    anyio_backend,  # noqa: F401 (the fixture: every async test on asyncio and on uvloop)
    scripted,
    until_eof,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]

UNREACHABLE = (502, "upstream_unreachable")
POOL = (504, "upstream_pool_timeout")
TIMEOUT = (504, "upstream_timeout")
FAILED = (502, "upstream_failed")


@pytest.mark.parametrize(("error", "expected", "outcome"), [
    (ConnectError("cannot connect to h:1: refused"), UNREACHABLE, Outcome.UPSTREAM_UNREACHABLE),
    (ConnectTimeout("connecting to h:1 timed out"), UNREACHABLE, Outcome.UPSTREAM_UNREACHABLE),
    (PoolTimeout("no upstream connection became free in time"), POOL, Outcome.POOL_TIMEOUT),
    (ReadTimeout("no response headers from the upstream within 1 s"), TIMEOUT,
     Outcome.UPSTREAM_TIMEOUT),
    (WriteTimeout("request not sent to the upstream within 1 s"), TIMEOUT,
     Outcome.UPSTREAM_TIMEOUT),
    (ReadError("upstream closed the connection"), FAILED, Outcome.UPSTREAM_INTERRUPTED),
    (RemoteProtocolError("invalid HTTP from the upstream"), FAILED, Outcome.UPSTREAM_ERROR),
    (ResponseHeadTooLarge("response headers larger than 64 KiB"),
     (502, "upstream_headers_too_large"), Outcome.UPSTREAM_ERROR),
    (UpstreamError(), FAILED, Outcome.UPSTREAM_ERROR),
])
def test_each_error_class_maps_to_its_status_code_and_outcome(
        error: UpstreamError, expected: tuple[int, str], outcome: Outcome) -> None:
    status, body = error_response(error, "upstream.internal:8000")
    err = json.loads(body)["error"]
    assert (status, err["code"]) == expected
    assert failure_outcome(error) is outcome
    assert err["type"] == "upstream_error" and err["param"] is None
    assert "upstream.internal:8000" in err["message"]


# ---------------------------------------------------------------------------
# Real failures, and what their messages reveal

KEY = "sk-live-0123456789abcdef"
TENANT = "tenant-7f3a"
SECRETS = [KEY, TENANT, "/chat/completions", "api-key"]


async def silent(up: Scripted, n: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    await up.read_request(n, reader)
    await until_eof(reader, asyncio.Event())


async def hangs_up(up: Scripted, n: int, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> None:
    await up.read_request(n, reader)  # and close without a byte of answer


async def garbage(up: Scripted, n: int, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    await up.read_request(n, reader)
    writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
    await writer.drain()
    await until_eof(reader, asyncio.Event())


async def never_reads(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
    await asyncio.Event().wait()  # the request stays in the socket buffers


async def holds(up: Scripted, n: int, reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter) -> None:
    await up.read_request(n, reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nsome")
    await until_eof(reader, asyncio.Event())


@contextlib.asynccontextmanager
async def silent_proxy() -> AsyncIterator[int]:
    """An HTTP proxy that accepts and never answers CONNECT."""
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in held:
            writer.close()
        server.close()
        async with asyncio.timeout(5):
            await server.wait_closed()


async def request(upstream: UpstreamClient, body: bytes = b'{"model":"m"}') -> WireResponse:
    return await upstream.open("POST", b"/chat/completions", b"api-key=" + KEY.encode(),
                               [(b"authorization", b"Bearer " + KEY.encode()),
                                (b"content-type", b"application/json")], body)


@pytest.mark.parametrize(("case", "expected_error", "expected", "outcome"), [
    ("refused", ConnectError, UNREACHABLE, Outcome.UPSTREAM_UNREACHABLE),
    ("tunnel-timeout", ConnectTimeout, UNREACHABLE, Outcome.UPSTREAM_UNREACHABLE),
    ("pool", PoolTimeout, POOL, Outcome.POOL_TIMEOUT),
    ("silent", ReadTimeout, TIMEOUT, Outcome.UPSTREAM_TIMEOUT),
    ("never-reads", WriteTimeout, TIMEOUT, Outcome.UPSTREAM_TIMEOUT),
    ("hangs-up", ReadError, FAILED, Outcome.UPSTREAM_INTERRUPTED),
    ("not-http", RemoteProtocolError, FAILED, Outcome.UPSTREAM_ERROR),
], ids=["refused", "tunnel-timeout", "pool", "silent", "never-reads", "hangs-up", "not-http"])
async def test_real_failures_name_the_host_and_nothing_secret(
        case: str, expected_error: type[UpstreamError], expected: tuple[int, str],
        outcome: Outcome, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    handlers: dict[str, Any] = {"pool": holds, "silent": silent, "never-reads": never_reads,
                                "hangs-up": hangs_up, "not-http": garbage}
    held: list[WireResponse] = []
    async with contextlib.AsyncExitStack() as stack:
        if case == "refused":
            host = f"localhost:{closed_port()}"
            options: dict[str, Any] = {}
        elif case == "tunnel-timeout":
            proxy_port = await stack.enter_async_context(silent_proxy())
            monkeypatch.setenv("HTTPS_PROXY", f"http://relay:{KEY}@127.0.0.1:{proxy_port}")
            host = "localhost:8443"
            options = {}
        else:
            up = await stack.enter_async_context(scripted(handlers[case]))
            host = f"localhost:{up.port}"
            # A WriteTimeout needs a request larger than what the loopback socket
            # buffers take while the upstream reads nothing, and a longer read timeout.
            options = {"write_timeout": 0.2, "read_timeout": 5.0} if case == "never-reads" else {}
        scheme = "https" if case == "tunnel-timeout" else "http"
        transport = WireTransport(**{"max_connections": 1, "connect_timeout": 0.3,
                                     "read_timeout": 0.3, **options})
        upstream = UpstreamClient(single_spec(Settings(upstream=f"{scheme}://{host}/{TENANT}/v1")),
                                    transport=transport)
        stack.push_async_callback(upstream.aclose)
        body = b"x" * (64 * 1024 * 1024) if case == "never-reads" else b'{"model":"m"}'
        if case == "pool":
            held.append(await request(upstream))  # the only connection, still busy
            stack.push_async_callback(held[0].aclose)
        with pytest.raises(UpstreamError) as caught:
            await request(upstream, body)
    assert type(caught.value) is expected_error
    assert upstream.host == host
    status, raw = error_response(caught.value, upstream.host)
    err = json.loads(raw)["error"]
    assert (status, err["code"]) == expected
    assert failure_outcome(caught.value) is outcome
    assert host in err["message"]
    for secret in SECRETS:
        assert secret not in err["message"]
        assert secret not in str(caught.value)


async def test_an_ipv6_upstream_is_named_in_brackets_in_its_errors() -> None:
    """``upstream ::1:9 unreachable: cannot connect to ::1:9``: the port reads as part of
    the address. Named as in a URL, ``[::1]:9``, as its label already was."""
    transport = WireTransport(max_connections=1, connect_timeout=1.0, read_timeout=1.0)
    upstream = UpstreamClient(single_spec(Settings(upstream="http://[::1]:9/v1")),
                              transport=transport)
    try:
        with pytest.raises(UpstreamError) as caught:
            await request(upstream)
    finally:
        await upstream.aclose()
    assert upstream.host == "[::1]:9"
    _, raw = error_response(caught.value, upstream.host)
    message = json.loads(raw)["error"]["message"]
    assert message.startswith("upstream [::1]:9 unreachable: cannot connect to [::1]:9: "), message
