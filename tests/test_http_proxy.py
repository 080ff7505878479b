"""``HTTP_PROXY`` / ``HTTPS_PROXY`` with a real forward proxy (tinyproxy).

A plain ``http`` upstream is asked through the proxy in absolute form by
:class:`proxy.upstream.UpstreamClient`; an ``https`` one is reached through a ``CONNECT``
tunnel by :class:`proxy.wire.pool.WireTransport`, TLS inside. Both are proved against
tinyproxy, a forward proxy users actually run, which logs every request line: the
absolute-form POST and the CONNECT are read from its log, and the upstream sees what
tinyproxy forwarded (its ``Via`` header, the origin-form target).

The upstream is addressed as ``localhost``: common ``NO_PROXY`` defaults exempt
``127.0.0.1``, and the tests clear ``NO_PROXY`` anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings, single_spec
from proxy.upstream import UpstreamClient, error_response
from proxy.wire.endpoint import Endpoint, ProxyEndpoint
from proxy.wire.errors import ConnectError, ConnectTimeout
from proxy.wire.pool import WireTransport
from tests.raw_upstream import RawUpstream, closed_port
from tests.servers import ROOT, serve_in_thread
from tests.test_wire import (
    PROXY_VARIABLES,
    anyio_backend,  # noqa: F401 (the fixture: every async test on asyncio and on uvloop)
    until,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

TINYPROXY = shutil.which("tinyproxy")


def needs_tinyproxy(test: Callable[..., Any]) -> Callable[..., Any]:
    """An integration test: skipped, saying why, where tinyproxy is not installed."""
    test = pytest.mark.integration(test)
    return pytest.mark.skipif(TINYPROXY is None, reason="tinyproxy is not installed "
                              "(apt-get install tinyproxy; .ci/run installs it)")(test)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def proxy_environment(monkeypatch: pytest.MonkeyPatch, **variables: str) -> None:
    """Exactly ``variables`` (e.g. ``HTTP_PROXY=...``) and no other proxy setting."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


# ---------------------------------------------------------------------------
# tinyproxy in the foreground, its log read line by line


@dataclass
class Tinyproxy:
    port: int
    lines: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def url(self, userinfo: str = "") -> str:
        return f"http://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}"

    def logged(self, pattern: str) -> list[str]:
        regex = re.compile(pattern)
        with self.changed:
            return [line for line in self.lines if regex.search(line)]


@contextlib.contextmanager
def tinyproxy(directory: Path, *config: str) -> Iterator[Tinyproxy]:
    """tinyproxy on a free loopback port with ``config`` lines added; yields once it
    logged that it accepts connections."""
    assert TINYPROXY is not None
    for _ in range(3):  # the free port may be taken between choosing and binding
        tp = Tinyproxy(closed_port())
        conf = directory / f"tinyproxy-{tp.port}.conf"
        conf.write_text("\n".join([f"Port {tp.port}", "Listen 127.0.0.1", "Allow 127.0.0.1",
                                   "LogLevel Info", "MaxClients 50", *config]) + "\n")
        process = subprocess.Popen([TINYPROXY, "-d", "-c", str(conf)], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()

        def pump(process: subprocess.Popen[str] = process, tp: Tinyproxy = tp,
                 ready: threading.Event = ready) -> None:
            assert process.stdout is not None
            for line in process.stdout:
                with tp.changed:
                    tp.lines.append(line)
                    tp.changed.notify_all()
                if "Accepting connections" in line:
                    ready.set()
            ready.set()  # it exited

        reader = threading.Thread(target=pump, daemon=True, name="tinyproxy-log")
        reader.start()
        try:
            assert ready.wait(10), "tinyproxy did not start"
            if process.poll() is None and tp.logged("Accepting connections"):
                yield tp
                return
        finally:
            process.terminate()
            process.wait(10)
            reader.join(10)
            assert process.stdout is not None
            process.stdout.close()
    raise RuntimeError("tinyproxy did not start:\n" + "".join(tp.lines))


@pytest.fixture
def tiny(tmp_path: Path) -> Iterator[Tinyproxy]:
    with tinyproxy(tmp_path) as tp:
        yield tp


# ---------------------------------------------------------------------------
# A TLS upstream for localhost, with a certificate made for the test


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate and key for ``localhost``, made with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key


@dataclass
class TlsUpstream:
    port: int
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0


@contextlib.asynccontextmanager
async def tls_upstream(certificate: tuple[Path, Path]) -> AsyncIterator[TlsUpstream]:
    """An https upstream on 127.0.0.1 (reached as localhost) answering every request on
    a connection with a small JSON body naming the request's target."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    tasks: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        up.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                raw = head + (await reader.readexactly(int(length[1])) if length else b"")
                up.requests.append(raw)
                answer = json.dumps({"target": raw.split(b" ", 2)[1].decode()}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError,
                asyncio.CancelledError):
            pass
        finally:
            tasks.discard(task)
            writer.transport.abort()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    up = TlsUpstream(server.sockets[0].getsockname()[1])
    try:
        yield up
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        async with asyncio.timeout(5):
            await server.wait_closed()


def trusting(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    """What the proxy would get from the system CAs, had the test's CA been installed."""
    return ssl.create_default_context(cafile=str(certificate[0]))


def wire_transport(certificate: tuple[Path, Path], **options: float) -> WireTransport:
    return WireTransport(**{"max_connections": 4, "connect_timeout": 5.0, "read_timeout": 5.0,
                            **options}, ssl_context=trusting(certificate))


# ---------------------------------------------------------------------------
# Plain http through HTTP_PROXY: the whole proxy, absolute-form requests


@needs_tinyproxy
@pytest.mark.e2e
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the proxy's loop is its own thread's
@pytest.mark.parametrize("auth", [False, True], ids=["open-proxy", "basic-auth"])
async def test_http_upstream_through_http_proxy(tmp_path: Path, auth: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    config = ["BasicAuth relay s3cret-pw"] if auth else []
    with tinyproxy(tmp_path, *config) as tp, RawUpstream().running() as upstream:
        proxy_environment(monkeypatch, HTTP_PROXY=tp.url("relay:s3cret-pw" if auth else ""))
        settings = Settings(upstream=f"http://localhost:{upstream.port}/v1")
        app = create_app(settings, registry=CollectorRegistry())
        assert app.upstream.endpoint == Endpoint("http", "127.0.0.1", tp.port)
        with serve_in_thread(app) as server:
            # trust_env=False: the test's own client must not go through tinyproxy.
            async with httpx.AsyncClient(base_url=server.url, timeout=10,
                                         trust_env=False) as client:
                for _ in range(2):  # tinyproxy closes after each answer: the pool copes
                    r = await client.post("/v1/chat/completions", json=CHAT)
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["message"]["content"] == "hi"
    target = f"http://localhost:{upstream.port}/v1/chat/completions"
    assert len(tp.logged(rf"Request \(file descriptor \d+\): POST {re.escape(target)} HTTP/1.1")) == 2
    assert [(seen.method, seen.target) for seen in upstream.requests] == [
        ("POST", "/v1/chat/completions")] * 2  # tinyproxy asked in origin form
    for seen in upstream.requests:
        assert "tinyproxy" in (seen.header("via") or "")
        assert seen.header("host") == f"localhost:{upstream.port}"
        assert seen.header("proxy-authorization") is None  # the proxy's, never forwarded
        assert seen.json == CHAT


@needs_tinyproxy
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_http_proxy_that_wants_credentials_is_a_407_not_a_relay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the proxy URL's user info the request is refused by the proxy: what the
    client gets is tinyproxy's answer, and the upstream sees nothing."""
    with tinyproxy(tmp_path, "BasicAuth relay s3cret-pw") as tp, \
            RawUpstream().running() as upstream:
        proxy_environment(monkeypatch, HTTP_PROXY=tp.url())
        up = UpstreamClient(single_spec(Settings(upstream=f"http://localhost:{upstream.port}/v1")))
        try:
            response = await up.open("POST", b"/chat/completions", b"", [],
                                     json.dumps(CHAT).encode())
            assert response.status_code == 407
            await response.aclose()
        finally:
            await up.aclose()
    assert upstream.requests == []


# ---------------------------------------------------------------------------
# https through HTTPS_PROXY: a CONNECT tunnel, TLS inside


@needs_tinyproxy
@pytest.mark.parametrize("auth", [False, True], ids=["open-proxy", "basic-auth"])
async def test_https_upstream_through_a_connect_tunnel(
        tmp_path: Path, certificate: tuple[Path, Path], auth: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = ["BasicAuth relay s3cret-pw"] if auth else []
    with tinyproxy(tmp_path, *config) as tp:
        async with tls_upstream(certificate) as tls:
            proxy_environment(monkeypatch,
                              HTTPS_PROXY=tp.url("relay:s3cret-pw" if auth else ""))
            transport = wire_transport(certificate)
            up = UpstreamClient(single_spec(Settings(upstream=f"https://localhost:{tls.port}/v1")),
                                transport=transport)
            assert up.endpoint.via is not None
            assert (up.endpoint.via.host, up.endpoint.via.port) == ("127.0.0.1", tp.port)
            try:
                for _ in range(2):
                    response = await up.open("POST", b"/chat/completions", b"",
                                             [(b"content-type", b"application/json")],
                                             json.dumps(CHAT).encode())
                    assert response.status_code == 200
                    assert json.loads(await response.body.read(1000)) == {
                        "target": "/v1/chat/completions"}
                    await response.aclose()
                # The pooled connection is the tunnel: its socket goes to tinyproxy.
                [conn] = transport.idle[up.endpoint]
                assert conn.transport is not None
                assert conn.transport.get_extra_info("peername")[1] == tp.port
                assert conn.transport.get_extra_info("ssl_object") is not None
            finally:
                await up.aclose()
    # One CONNECT, both requests inside it; tinyproxy saw no HTTP inside the tunnel.
    assert len(tp.logged(rf"Request \(file descriptor \d+\): CONNECT localhost:{tls.port} ")) == 1
    assert tp.logged("POST") == []
    assert tls.connections == 1
    assert [raw.split(b"\r\n", 2)[:2] for raw in tls.requests] == [
        [b"POST /v1/chat/completions HTTP/1.1", b"Host: localhost:%d" % tls.port]] * 2
    for raw in tls.requests:
        assert b"proxy-authorization" not in raw.lower()


@needs_tinyproxy
async def test_proxy_refusing_connect_is_a_connect_error_naming_the_proxy(
        tmp_path: Path, certificate: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with tinyproxy(tmp_path, "ConnectPort 443") as tp:  # CONNECT only to port 443
        async with tls_upstream(certificate) as tls:
            proxy_environment(monkeypatch, HTTPS_PROXY=tp.url("relay:s3cret-pw"))
            up = UpstreamClient(single_spec(Settings(upstream=f"https://localhost:{tls.port}/v1")),
                                transport=wire_transport(certificate))
            try:
                with pytest.raises(ConnectError) as caught:
                    await up.open("POST", b"/chat/completions", b"", [], b"{}")
            finally:
                await up.aclose()
    message = str(caught.value)
    assert f"through the proxy 127.0.0.1:{tp.port}" in message
    assert "refused CONNECT" in message and "403" in message
    assert "s3cret" not in message
    status, body = error_response(caught.value, up.host)
    assert status == 502
    assert json.loads(body)["error"]["code"] == "upstream_unreachable"
    assert tls.connections == 0


@dataclass
class FakeProxy:
    """A forward proxy that does one wrong thing with every CONNECT."""

    behaviour: str  # "close": hang up; "silent": never answer; "407": want credentials
    connects: list[bytes] = field(default_factory=list)


@contextlib.asynccontextmanager
async def fake_proxy(behaviour: str) -> AsyncIterator[tuple[FakeProxy, int]]:
    fake = FakeProxy(behaviour)
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            fake.connects.append(await reader.readuntil(b"\r\n\r\n"))
            if behaviour == "407":
                writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                             b"proxy-authenticate: Basic realm=x\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
            elif behaviour == "silent":
                held.append(writer)
                return
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield fake, server.sockets[0].getsockname()[1]
    finally:
        for writer in held:
            writer.close()
        server.close()
        async with asyncio.timeout(5):
            await server.wait_closed()


@pytest.mark.parametrize(("behaviour", "error", "says"), [
    ("407", ConnectError, "refused CONNECT: HTTP/1.1 407"),
    ("close", ConnectError, "closed the connection during CONNECT"),
    ("silent", ConnectTimeout, "timed out"),
], ids=["407", "close", "silent"])
async def test_connect_failures_name_the_proxy(behaviour: str, error: type[ConnectError],
                                               says: str) -> None:
    async with fake_proxy(behaviour) as (fake, port):
        transport = WireTransport(max_connections=1, connect_timeout=0.3, read_timeout=1.0)
        endpoint = Endpoint("https", "upstream.example", 443,
                            ProxyEndpoint.from_url(f"http://user:s3cret@127.0.0.1:{port}"))
        try:
            with pytest.raises(error) as caught:
                await transport.exchange("GET", endpoint, b"GET / HTTP/1.1\r\n\r\n")
        finally:
            await transport.aclose()
    message = str(caught.value)
    assert type(caught.value) is error
    assert says in message
    assert f"upstream.example:443 through the proxy 127.0.0.1:{port}" in message
    assert "s3cret" not in message
    assert fake.connects == [b"CONNECT upstream.example:443 HTTP/1.1\r\n"
                             b"Host: upstream.example:443\r\n"
                             b"Proxy-Authorization: Basic dXNlcjpzM2NyZXQ=\r\n\r\n"]


# ---------------------------------------------------------------------------
# A CONNECT that never gets through closes its socket


@dataclass
class StuckProxy:
    """A forward proxy whose accept queue is full: the kernel drops every new SYN, so a
    connect to it stays pending until the proxy's client gives up (the connect timeout)
    or the request is cancelled (its own client went away)."""

    port: int
    fillers: list[socket.socket]

    def open_sockets(self) -> int:
        """This process's descriptors for sockets to the stuck proxy, fillers excepted:
        a socket's inode in ``/proc/net/tcp`` (remote port = the proxy's) matched against
        ``/proc/self/fd``."""
        skip = {s.getsockname()[1] for s in self.fillers}
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.read().splitlines()[1:]:
                    fields = line.split()
                    local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
                    if remote == self.port and local not in skip:
                        inodes.add(f"socket:[{fields[9]}]")
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/self/fd/{fd}") in inodes
        return count


@contextlib.contextmanager
def stuck_proxy() -> Iterator[StuckProxy]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)  # room for one, never accepted
    port = listener.getsockname()[1]
    fillers: list[socket.socket] = []
    try:
        for _ in range(2):  # the one the queue takes, and one more for good measure
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        yield StuckProxy(port, fillers)
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_a_connect_stuck_while_connecting_closes_its_socket(how: str) -> None:
    """The socket is closed when the attempt ends, not whenever the garbage collector
    gets to it: here the errors are kept, as a log record or a trace span may keep them."""
    kept: list[BaseException] = []
    with stuck_proxy() as stuck:
        transport = WireTransport(max_connections=4, read_timeout=1.0,
                                  connect_timeout=0.2 if how == "timeout" else 30.0)
        endpoint = Endpoint("https", "upstream.example", 443,
                            ProxyEndpoint("127.0.0.1", stuck.port))
        try:
            for _ in range(5):
                attempt = asyncio.ensure_future(
                    transport.exchange("GET", endpoint, b"GET / HTTP/1.1\r\n\r\n"))
                if how == "cancel":
                    await until(lambda: stuck.open_sockets() == 1)  # connecting
                    attempt.cancel()
                try:
                    await attempt
                except (ConnectTimeout, asyncio.CancelledError) as exc:
                    kept.append(exc)
                assert stuck.open_sockets() == 0
        finally:
            await transport.aclose()
    expected = ConnectTimeout if how == "timeout" else asyncio.CancelledError
    assert [type(e) for e in kept] == [expected] * 5


@pytest.mark.e2e
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the proxy's loop is its own thread's
async def test_proxy_closes_the_socket_of_a_connect_that_never_got_through(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the whole proxy: three requests time out connecting to the HTTPS proxy
    (502), three clients go away while it connects. Every socket is closed by the proxy
    itself: none is left open, and none is left to the garbage collector (which says so
    with a ResourceWarning)."""
    with stuck_proxy() as stuck:
        proxy_environment(monkeypatch, HTTPS_PROXY=f"http://127.0.0.1:{stuck.port}")
        app = create_app(Settings(upstream="https://localhost:8443/v1", connect_timeout=1.0),
                         registry=CollectorRegistry())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            with serve_in_thread(app, http="httptools") as server:
                async with httpx.AsyncClient(base_url=server.url, timeout=10,
                                             trust_env=False) as client:
                    for _ in range(3):
                        r = await client.post("/v1/chat/completions", json=CHAT)
                        assert r.status_code == 502
                        assert r.json()["error"]["code"] == "upstream_unreachable"
                        assert stuck.open_sockets() == 0
                    for _ in range(3):
                        request = asyncio.ensure_future(
                            client.post("/v1/chat/completions", json=CHAT))
                        await until(lambda: stuck.open_sockets() == 1)  # the proxy connects
                        request.cancel()  # and its client goes away
                        with contextlib.suppress(asyncio.CancelledError):
                            await request
                        await until(lambda: stuck.open_sockets() == 0)
            gc.collect()  # anything left to the collector would warn now at the latest
        unclosed = [str(w.message) for w in caught
                    if issubclass(w.category, ResourceWarning) and "socket" in str(w.message)]
        assert unclosed == []
        assert stuck.open_sockets() == 0


# ---------------------------------------------------------------------------
# The start-up line


@pytest.mark.parametrize(("upstream", "env", "expected"), [
    ("http://upstream.internal:8000/v1", {"HTTP_PROXY": "http://u:s3cret@proxy.internal:3128"},
     "upstream upstream.internal:8000 is reached through the HTTP proxy proxy.internal:3128 "
     "(HTTP_PROXY), with absolute-form requests"),
    ("https://api.example.com/v1", {"HTTPS_PROXY": "http://proxy.internal:3128"},
     "upstream api.example.com:443 is reached through the HTTP proxy proxy.internal:3128 "
     "(HTTPS_PROXY), with a CONNECT tunnel"),
    ("https://api.example.com/v1", {"HTTP_PROXY": "http://proxy.internal:3128"}, None),
    ("http://upstream.internal:8000/v1",
     {"HTTP_PROXY": "http://proxy.internal:3128", "NO_PROXY": "upstream.internal"}, None),
    ("http://upstream.internal:8000/v1", {}, None),
    ("http://10.1.2.3:8000/v1", {"HTTP_PROXY": "http://proxy.internal:3128",
                                 "NO_PROXY": "localhost,10.0.0.0/8"}, None),
    ("http://[fd00::5]:8000/v1", {"HTTP_PROXY": "http://proxy.internal:3128",
                                  "NO_PROXY": "fd00::/8"}, None),
    ("http://[::1]:8000/v1", {"HTTP_PROXY": "http://proxy.internal:3128",
                              "NO_PROXY": "[::1]"}, None),
    ("http://up.trial.test:8000/v1", {"HTTP_PROXY": "http://proxy.internal:3128",
                                      "NO_PROXY": "*.trial.test"}, None),
    ("http://10.1.2.3:8000/v1", {"HTTP_PROXY": "http://proxy.internal:3128",
                                 "NO_PROXY": "192.168.0.0/16,.svc"},
     "upstream 10.1.2.3:8000 is reached through the HTTP proxy proxy.internal:3128 "
     "(HTTP_PROXY), with absolute-form requests"),
], ids=["http-proxy", "https-proxy", "other-scheme-only", "no-proxy-for-host", "none",
        "no-proxy-cidr", "no-proxy-ipv6-cidr", "no-proxy-ipv6-bracketed", "no-proxy-wildcard",
        "no-proxy-other-range"])
def test_upstream_logs_one_line_when_a_proxy_applies(
        upstream: str, env: dict[str, str], expected: str | None,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    proxy_environment(monkeypatch, **env)
    with caplog.at_level(logging.DEBUG, logger="proxy"):
        up = UpstreamClient(single_spec(Settings(upstream=upstream)))
    lines = [record.getMessage() for record in caplog.records]
    assert lines == ([expected] if expected else [])
    assert all(record.levelno == logging.INFO for record in caplog.records)
    assert (up.endpoint.via is not None) == (expected is not None and "https" in upstream)


async def test_connect_to_an_ipv6_upstream_brackets_its_address() -> None:
    async with fake_proxy("close") as (fake, port):
        transport = WireTransport(max_connections=1, connect_timeout=1.0, read_timeout=1.0)
        endpoint = Endpoint("https", "::1", 8443, ProxyEndpoint("127.0.0.1", port))
        try:
            with pytest.raises(ConnectError):
                await transport.exchange("GET", endpoint, b"GET / HTTP/1.1\r\n\r\n")
        finally:
            await transport.aclose()
    assert fake.connects == [b"CONNECT [::1]:8443 HTTP/1.1\r\nHost: [::1]:8443\r\n\r\n"]


@pytest.mark.parametrize("variable", ["HTTPS_PROXY", "https_proxy"])
def test_an_unsupported_proxy_url_fails_at_start_up_without_its_credentials(
        variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The error reaches the terminal at start-up: it must not print the password."""
    proxy_environment(monkeypatch, **{variable: "socks5h://relay:hunter2@proxy.internal:1080"})
    with pytest.raises(ValueError, match="only http:// proxies") as caught:
        UpstreamClient(single_spec(Settings(upstream="https://api.example.com/v1")))
    assert "proxy.internal:1080" in str(caught.value)
    assert "hunter2" not in str(caught.value)


def _serve_until_ready(env: dict[str, str], *args: str) -> tuple[int, str]:
    """``python -m proxy serve ARGS`` with ``env``: its exit code and output, once it
    listened (then stopped with SIGTERM) or exited by itself."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--port", "0", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**{k: v for k, v in os.environ.items() if k.upper() not in PROXY_VARIABLES},
             "PYTHONUNBUFFERED": "1", **env})
    out: list[str] = []
    assert proc.stdout is not None
    with proc, proc.stdout:
        try:
            for line in proc.stdout:  # until it listens, or exits
                out.append(line)
                if "Uvicorn running on" in line:
                    proc.send_signal(signal.SIGTERM)
            return proc.wait(30), "".join(out)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_the_proxy_line_is_logged_by_serve_in_one_process() -> None:
    """``serve`` (one process): the start-up line naming the HTTP proxy reaches the log.
    It was made before any handler was set up, and lost (the unit test's caplog gave
    it one); only workers printed it."""
    code, out = _serve_until_ready({"HTTPS_PROXY": "http://127.0.0.1:9"},
                                   "--upstream", "https://api.example.com/v1")
    assert code == 0, out
    assert ("upstream api.example.com:443 is reached through the HTTP proxy 127.0.0.1:9 "
            "(HTTPS_PROXY), with a CONNECT tunnel") in out


def test_an_unsupported_proxy_url_stops_serve_with_one_line() -> None:
    """An https:// or socks5:// proxy in the environment (set for other tools): one line,
    exit 2, no traceback and no password; it was a 43-line traceback and exit 1."""
    code, out = _serve_until_ready({"HTTPS_PROXY": "socks5://relay:hunter2@127.0.0.1:9"},
                                   "--upstream", "https://api.example.com/v1")
    assert code == 2, out
    assert "Traceback" not in out and "hunter2" not in out
    assert "HTTPS_PROXY for upstream api.example.com:443: only http:// proxies" in out
