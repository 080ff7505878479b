"""What a new upstream connection costs a request, and who pays it.

The upstream here is an ``https`` server whose TLS handshake starts ``HANDSHAKE_S`` after
it accepts (a far server, or a slow TLS terminator), so every new connection costs a
request at least that much, and a pooled one does not. The proxy runs as ``serve`` runs
it (uvicorn on uvloop, settings as the flags give them), trusting the test's certificate
through ``SSL_CERT_FILE`` as it would trust a system CA:

* ``llm_proxy_overhead_seconds`` counts a new connection's set-up: it says what the proxy
  added before the upstream had the request, on the new-connection path as on a pooled
  one;
* with ``--upstream-keep-warm`` the pool replaces its last idle connection when it
  expires, so the first request after a pause finds a connection ready.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings
from tests.servers import serve_in_thread
from tests.test_http_proxy import certificate  # noqa: F401 (the fixture)
from tests.test_wire import until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

HANDSHAKE_S = 0.3
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ANSWER = json.dumps({
    "id": "c", "object": "chat.completion", "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}).encode()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class SlowTls:
    port: int
    accepted: int = 0  # connections accepted
    secured: int = 0  # TLS handshakes completed
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@contextlib.contextmanager
def slow_tls_upstream(cert: tuple[Path, Path]) -> Iterator[SlowTls]:
    """An https upstream on 127.0.0.1 (reached as localhost) that waits ``HANDSHAKE_S``
    after accepting before its TLS handshake, then answers every chat request; a thread
    per connection, blocking sockets (the handshake waits in the kernel's buffer)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*cert)
    listener = socket.create_server(("127.0.0.1", 0))
    up = SlowTls(listener.getsockname()[1])
    stop = threading.Event()

    def serve(raw: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError), raw:
            stop.wait(HANDSHAKE_S)  # the scripted server's behaviour: a slow TLS start
            with context.wrap_socket(raw, server_side=True) as conn:
                with up.lock:
                    up.secured += 1
                reader = conn.makefile("rb")
                while not stop.is_set():
                    head = b""
                    while not head.endswith(b"\r\n\r\n"):
                        line = reader.readline()
                        if not line:
                            return
                        head += line
                    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                    reader.read(int(length[1]) if length else 0)
                    with up.lock:
                        up.requests += 1
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                raw, _ = listener.accept()
                with up.lock:
                    up.accepted += 1
                threading.Thread(target=serve, args=(raw,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield up
    finally:
        stop.set()
        listener.close()


def overhead_total(registry: CollectorRegistry) -> tuple[float, float]:
    """(count, sum) of ``llm_proxy_overhead_seconds`` over every label set."""
    count = total = 0.0
    for metric in registry.collect():
        if metric.name == "llm_proxy_overhead_seconds":
            for s in metric.samples:
                if s.name.endswith("_count"):
                    count += s.value
                elif s.name.endswith("_sum"):
                    total += s.value
    return count, total


async def one_overhead(client: httpx.AsyncClient, registry: CollectorRegistry) -> float:
    """Send one chat request; the overhead the proxy recorded for it."""
    count, total = overhead_total(registry)
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    await until(lambda: overhead_total(registry)[0] == count + 1)
    return overhead_total(registry)[1] - total


@contextlib.asynccontextmanager
async def proxy_in_front(up: SlowTls, cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                         **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient,
                                                                 CollectorRegistry, Any]]:
    monkeypatch.setenv("SSL_CERT_FILE", str(cert[0]))  # the proxy's default TLS context
    registry = CollectorRegistry()
    app = create_app(Settings(upstream=f"https://localhost:{up.port}/v1", **settings),
                     registry=registry)
    with serve_in_thread(app, loop="uvloop") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            yield client, registry, app


async def test_overhead_counts_a_new_connections_set_up(
        certificate: tuple[Path, Path],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    with slow_tls_upstream(certificate) as up:
        async with proxy_in_front(
                up, certificate, monkeypatch, upstream_keep_warm=0.0) as (client, registry, _):
            first = await one_overhead(client, registry)  # a new connection: TCP + slow TLS
            pooled = await one_overhead(client, registry)  # the same connection, reused
    assert up.accepted == 1 and up.requests == 2
    assert first >= HANDSHAKE_S, first
    assert pooled < HANDSHAKE_S / 2, pooled


async def test_a_connection_kept_warm_serves_the_first_request_after_a_pause(
        certificate: tuple[Path, Path],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    expiry = 0.5
    with slow_tls_upstream(certificate) as up:
        async with proxy_in_front(
                up, certificate, monkeypatch, upstream_keepalive_expiry=expiry,
                upstream_keep_warm=60.0) as (client, registry, app):
            first = await one_overhead(client, registry)
            pool = app.upstreams.targets[0].client.transport
            idle = pool.idle[next(iter(pool.idle))]
            # The pause: the first connection expires and the pool replaces it.
            await until(lambda: up.secured == 2 and len(idle) == 1, within=10 * expiry + 5)
            after_pause = await one_overhead(client, registry)
            assert up.accepted == 2 and up.requests == 2  # no new connection for it
    assert first >= HANDSHAKE_S, first
    assert after_pause < HANDSHAKE_S / 2, after_pause
