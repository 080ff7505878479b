"""Reusing an idle upstream connection safely (:mod:`proxy.wire`, "Reusing an idle
connection safely" in its docstring).

The race: a uvicorn upstream closes a keep-alive connection after ``timeout_keep_alive``
of silence; a POST written onto that connection as it closes gets no answer. It may be
sent again only when the upstream provably never read it (a reset before any answer on
a pooled connection); otherwise the proxy answers 502. The unit tests take each defence
alone and make its moment deterministic; the last test is the race itself, with real
uvicorn servers on both sides and idle gaps straddling the upstream's limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings, add_arguments, from_sources
from proxy.wire.connection import ConnectionState
from proxy.wire.endpoint import Endpoint
from proxy.wire.errors import ReadError, ResetBeforeAnswer
from proxy.wire.keepalive import LEARNED_MARGIN, MIN_LEARNED_EXPIRY, RECOVERY_RUN
from proxy.wire.pool import WireTransport
from tests.fake_upstream import Conn, Gate, RawUpstream, normal
from tests.test_wire import (
    PROXY_VARIABLES,
    Scripted,
    answering,
    anyio_backend,  # noqa: F401 (the fixture: every async test on asyncio and on uvloop)
    ok,
    scripted,
    settled,
    until,
    until_eof,
    wire,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


# ---------------------------------------------------------------------------
# The liveness check: a close the event loop has not processed yet


class HandDriven:
    """An upstream driven by the test with plain socket calls: a FIN, an RST or a stray
    byte leaves it exactly when the test says, with no event loop of its own in between."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.endpoint = Endpoint("http", "127.0.0.1", self.listener.getsockname()[1])
        self.requests: list[bytes] = []
        self.socks: list[socket.socket] = []  # the connections accepted, in order

    async def accept(self) -> socket.socket:
        sock, _ = await asyncio.get_running_loop().sock_accept(self.listener)
        return sock

    async def answer_one(self, sock: socket.socket) -> None:
        """Read one request (head and Content-Length body), answer 200 with its path."""
        loop = asyncio.get_running_loop()
        data = b""
        while b"\r\n\r\n" not in data:
            part = await loop.sock_recv(sock, 65536)
            assert part, "the client closed before sending a request"
            data += part
        head, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        while length and len(body) < int(length[1]):
            body += await loop.sock_recv(sock, 65536)
        self.requests.append(head + b"\r\n\r\n" + body)
        await loop.sock_sendall(sock, ok(head.split(b" ", 2)[1]))

    async def serve_one(self) -> None:
        """Accept a connection and answer one request on it."""
        self.socks.append(await self.accept())
        await self.answer_one(self.socks[-1])

    async def pooled(self, w: Any) -> Any:
        """One GET answered through ``w`` (a :func:`tests.test_wire.wire`): its connection,
        now idle in the pool."""
        first = asyncio.create_task(self.serve_one())
        assert await w.fetch("GET", self.endpoint, "/1") == (200, b"/1")
        await first
        [conn] = w.transport.idle[self.endpoint]
        return conn

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.listener.close()


def upstream_lets_go(sock: socket.socket, how: str) -> None:
    """What an upstream does to an idle connection it is done with."""
    if how == "fin":
        sock.close()
    elif how == "rst":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    else:  # some servers say 408 before closing an idle connection
        sock.sendall(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n")


@pytest.mark.parametrize("how", ["fin", "rst", "stray-bytes"])
async def test_liveness_check_drops_a_connection_whose_close_the_loop_has_not_seen(
        how: str) -> None:
    up = HandDriven()
    try:
        async with wire(max_connections=1) as w:
            conn = await up.pooled(w)

            # From here until the POST is written the test does not yield to the loop.
            upstream_lets_go(up.socks[0], how)
            readable, _, _ = select.select([conn.fileno], [], [], 5)  # blocks: no loop turn
            assert readable, "what the upstream did never reached the client's socket"
            assert conn.state is not ConnectionState.CLOSED, (
                "the loop saw the close already: the window is not tested")
            second = asyncio.create_task(up.serve_one())  # runs once the exchange yields
            try:
                response = await w.send("POST", up.endpoint, "/2", b"{}")
                assert (response.status_code, await response.body.read(1000)) == (200, b"/2")
                await response.aclose()
                await second
            finally:
                second.cancel()
            assert conn.state is ConnectionState.CLOSED  # dropped by the check, not reused
            assert len(up.socks) == 2
            assert [r.split(b"\r\n", 1)[0] for r in up.requests] == [
                b"GET /1 HTTP/1.1", b"POST /2 HTTP/1.1"]  # the POST once, on connection 2
            # And the check taught the pool this upstream's idle limit.
            assert w.transport.idle_limits.expiry(up.endpoint) == MIN_LEARNED_EXPIRY
    finally:
        up.close()


# ---------------------------------------------------------------------------
# A reset with the request unread: sent again, whatever the method


@pytest.mark.parametrize("resend", [True, False], ids=["resend-on", "resend-off"])
async def test_a_post_the_upstream_reset_unread_is_sent_again_on_a_new_connection(
        resend: bool) -> None:
    """A busy upstream's idle timer fires late, with the POST already in its socket:
    it closes the socket unread, the kernel answers with a reset. The request never
    reached the server's code, so it goes out once more, on a new connection, and the
    reset teaches the idle limit. With ``resend_on_reset`` off (a load balancer in
    between may have forwarded it), it is a ReadError instead, sent once; a GET is still
    sent again (idempotent)."""
    up = HandDriven()

    async def close_with_the_request_unread(sock: socket.socket) -> None:
        readable = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), readable.set)
        try:
            await readable.wait()  # the POST is in the socket; nothing reads it
        finally:
            loop.remove_reader(sock.fileno())
        sock.close()  # unread bytes: the kernel sends a reset, not a FIN

    try:
        async with wire(max_connections=1, resend_on_reset=resend) as w:
            await up.pooled(w)
            assert w.transport.idle_limits.expiry(up.endpoint) == 4.0  # nothing learned yet
            reset = asyncio.create_task(close_with_the_request_unread(up.socks[0]))
            if not resend:
                with pytest.raises(ReadError):
                    await w.send("POST", up.endpoint, "/2", b'{"model":"m"}')
                await reset
                assert len(up.socks) == 1 and up.requests == [up.requests[0]]  # never read
                third = asyncio.create_task(up.serve_one())
                assert await w.fetch("GET", up.endpoint, "/3") == (200, b"/3")
                await third
                return
            second = asyncio.create_task(up.serve_one())
            response = await w.send("POST", up.endpoint, "/2", b'{"model":"m"}')
            assert (response.status_code, await response.body.read(1000)) == (200, b"/2")
            await response.aclose()
            await reset
            await second
            assert len(up.socks) == 2
            assert [r.split(b"\r\n", 1)[0] for r in up.requests] == [
                b"GET /1 HTTP/1.1", b"POST /2 HTTP/1.1"]  # read once: on connection 2
            assert w.transport.idle_limits.expiry(up.endpoint) == MIN_LEARNED_EXPIRY  # idle ~0 s
    finally:
        up.close()


async def fin_crosses_the_check(w: Any, up: HandDriven, sock: socket.socket,
                                 how: str) -> list[bool]:
    """The upstream lets go of its idle connection (``how``: ``close``, or ``shutdown``
    of its sending side only) and the FIN reaches the proxy's socket just after the
    liveness check, which then finds nothing: the next request is written onto it. What
    it returns fills with one item once a request was started on that connection."""
    [conn] = w.transport.idle[up.endpoint]
    if how == "close":
        sock.close()
    else:
        sock.shutdown(socket.SHUT_WR)
    readable, _, _ = select.select([conn.fileno], [], [], 5)  # blocks: no loop turn
    assert readable, "the FIN never reached the client's socket"
    assert conn.state is not ConnectionState.CLOSED, "the loop saw the FIN: no window"
    conn.readable = lambda: False  # the FIN came a moment after the check
    started: list[bool] = []
    start = conn.start

    def start_here(payload: bytes, head: bool) -> Any:
        started.append(True)
        return start(payload, head)

    conn.start = start_here
    return started


async def the_post_goes_out_again(
    w: Any, up: HandDriven, started: list[bool], *pending: asyncio.Task[None]
) -> None:
    """POST /2 through ``w``, written first onto the pooled connection the upstream
    closed (``started``), is answered on a second connection and read once; ``pending``:
    tasks of the test's that end meanwhile."""
    second = asyncio.create_task(up.serve_one())
    try:
        response = await w.send("POST", up.endpoint, "/2", b'{"model":"m"}')
        assert (response.status_code, await response.body.read(1000)) == (200, b"/2")
        await response.aclose()
        await second
        for task in pending:
            await task
    finally:
        for task in (second, *pending):
            task.cancel()
    assert started == [True]  # written on the closed connection first
    assert len(up.socks) == 2
    assert [r.split(b"\r\n", 1)[0] for r in up.requests] == [
        b"GET /1 HTTP/1.1", b"POST /2 HTTP/1.1"]  # read once: on connection 2


async def test_a_post_written_behind_the_upstream_fin_is_sent_again_when_reset() -> None:
    """The upstream closed its idle connection; its FIN crossed the liveness check, so
    the POST was written onto a socket the upstream no longer had, and its kernel
    answered with a reset. The read of the FIN comes first and hides the reset (a plain
    close, as far as the read says), but the socket's pending error shows it: the
    request was never read, and goes out once more, on a new connection."""
    up = HandDriven()
    try:
        async with wire(max_connections=1) as w:
            await up.pooled(w)
            started = await fin_crosses_the_check(w, up, up.socks[0], "close")
            await the_post_goes_out_again(w, up, started)
    finally:
        up.close()


async def test_a_reset_that_comes_after_the_fin_is_waited_for() -> None:
    """On a network the reset comes a round trip after the FIN was read: the connection
    waits for it (up to RESET_WAIT_S) before it closes, and the POST is sent again. Here
    the upstream shuts its sending side first and closes the socket, the POST unread,
    only once the proxy has read the FIN."""
    up = HandDriven()
    try:
        async with wire(max_connections=1) as w:
            conn = await up.pooled(w)
            started = await fin_crosses_the_check(w, up, up.socks[0], "shutdown")
            fin_read = asyncio.Event()
            eof_received = conn.eof_received

            def eof_seen() -> bool | None:
                keep_open = eof_received()
                fin_read.set()
                return keep_open

            conn.eof_received = eof_seen

            async def reset_once_the_fin_was_read() -> None:
                await fin_read.wait()
                upstream_lets_go(up.socks[0], "fin")  # the POST unread in it: a reset

            reset = asyncio.create_task(reset_once_the_fin_was_read())
            await the_post_goes_out_again(w, up, started, reset)
    finally:
        up.close()


async def test_a_post_behind_a_fin_the_upstream_still_reads_is_not_sent_again() -> None:
    """The same FIN, but the upstream only shut its sending side and still reads: the
    POST reached it, and no reset came within RESET_WAIT_S. A plain close before any
    answer is no proof that the request was not read, so the POST fails and is not
    sent twice."""
    up = HandDriven()

    async def read_one(sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        data = b""
        while b"\r\n\r\n" not in data:
            data += await loop.sock_recv(sock, 65536)
        up.requests.append(data)

    try:
        async with wire(max_connections=1) as w:
            await up.pooled(w)
            started = await fin_crosses_the_check(w, up, up.socks[0], "shutdown")
            reading = asyncio.create_task(read_one(up.socks[0]))
            with pytest.raises(ReadError) as failed:
                await w.send("POST", up.endpoint, "/2", b'{"model":"m"}')
            assert not isinstance(failed.value, ResetBeforeAnswer)
            await reading
            assert started == [True]
            assert len(up.socks) == 1  # not sent again
            assert [r.split(b"\r\n", 1)[0] for r in up.requests] == [
                b"GET /1 HTTP/1.1", b"POST /2 HTTP/1.1"]  # the upstream read it, once
    finally:
        up.close()


@pytest.mark.parametrize("flag", [[], ["--no-upstream-resend-on-reset"]])
def test_the_resend_setting_reaches_the_upstream_client(flag: list[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = from_sources(parser.parse_args(["--upstream", "http://127.0.0.1:9/v1", *flag]), {})
    app = create_app(settings, registry=CollectorRegistry())
    assert app.upstream.transport.resend_on_reset is (not flag)


async def test_a_reset_on_a_new_connection_is_not_sent_again() -> None:
    """Only a connection from the pool: a new one that is reset before any answer says
    nothing about an idle close (the upstream refused or crashed on this request)."""
    up = HandDriven()

    async def reset_unread() -> None:
        up.socks.append(await up.accept())
        readable = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(up.socks[-1].fileno(), readable.set)
        try:
            await readable.wait()
        finally:
            loop.remove_reader(up.socks[-1].fileno())
        up.socks[-1].close()

    try:
        async with wire(max_connections=1) as w:
            task = asyncio.create_task(reset_unread())
            with pytest.raises(ReadError):
                await w.send("POST", up.endpoint, "/1", b"{}")
            await task
            assert len(up.socks) == 1
    finally:
        up.close()


# ---------------------------------------------------------------------------
# The learned idle limit


@pytest.mark.parametrize(("observed", "expected"), [
    (5.0, 5.0 * LEARNED_MARGIN),
    (1.0, 0.75),
    (0.4, 0.3),
    (0.3, MIN_LEARNED_EXPIRY),  # 0.225: below the floor
    (0.0, MIN_LEARNED_EXPIRY),  # a restart of the upstream closes everything at once
    (6.0, 4.0),  # 4.5 is above the configured expiry: nothing learned
])
def test_learn_idle_limit_sets_three_quarters_of_the_observed_lifetime(
        observed: float, expected: float) -> None:
    transport = WireTransport(max_connections=1, connect_timeout=1.0, read_timeout=1.0,
                              keepalive_expiry=4.0)
    here, elsewhere = Endpoint("http", "a", 80), Endpoint("http", "b", 80)
    transport.idle_limits.learn(here, observed)
    assert transport.idle_limits.expiry(here) == pytest.approx(expected)
    assert transport.idle_limits.expiry(elsewhere) == 4.0  # per endpoint


def test_idle_closes_only_ever_lower_the_learned_limit() -> None:
    transport = WireTransport(max_connections=1, connect_timeout=1.0, read_timeout=1.0)
    here = Endpoint("http", "a", 80)
    seen = []
    for observed in [2.0, 3.0, 1.0, 2.0, 0.1, 1.0]:
        transport.idle_limits.learn(here, observed)
        seen.append(transport.idle_limits.expiry(here))
    assert seen == pytest.approx([1.5, 1.5, 0.75, 0.75, 0.25, 0.25])


def test_learned_limit_doubles_after_a_run_of_connections_that_outlived_it() -> None:
    """Back up to keepalive_expiry, where the learned limit is forgotten; an idle close
    in the middle of a run starts the run over."""
    transport = WireTransport(max_connections=1, connect_timeout=1.0, read_timeout=1.0,
                              keepalive_expiry=4.0)
    here, elsewhere = Endpoint("http", "a", 80), Endpoint("http", "b", 80)
    transport.idle_limits.learn(here, 0.0)  # a restart: every idle connection closed at once
    seen = []
    for step in ["outlived"] * RECOVERY_RUN + ["outlived", "close at 5 s"] + [
            "outlived"] * (3 * RECOVERY_RUN):
        if step == "outlived":
            transport.idle_limits.outlived(here)
            transport.idle_limits.outlived(elsewhere)  # nothing learned there: nothing to recover
        else:
            transport.idle_limits.learn(here, 5.0)  # 3.75 s: not lower, but the run restarts
        seen.append(transport.idle_limits.expiry(here))
    assert seen == pytest.approx([0.25, 0.25, 0.5,  # a run of three: doubled
                                  0.5, 0.5,  # one, then a close: the run starts over
                                  0.5, 0.5, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 4.0])
    assert transport.idle_limits.learned == {} and transport.idle_limits.recovery == {}
    assert transport.idle_limits.expiry(elsewhere) == 4.0


def test_a_doubling_the_upstream_undoes_makes_the_next_one_need_twice_the_run() -> None:
    """An upstream whose idle limit really is 2 s: each doubling past it is undone by
    its next idle close, and the attempts thin out (3, 6, 12, ... up to 48)."""
    transport = WireTransport(max_connections=1, connect_timeout=1.0, read_timeout=1.0,
                              keepalive_expiry=4.0)
    here = Endpoint("http", "a", 80)
    transport.idle_limits.learn(here, 2.0)  # 1.5 s
    needed = []
    for _ in range(6):
        runs = 0
        while transport.idle_limits.expiry(here) == pytest.approx(1.5):
            transport.idle_limits.outlived(here)
            runs += 1
        assert transport.idle_limits.expiry(here) == pytest.approx(3.0)  # past the upstream's 2 s
        transport.idle_limits.learn(here, 2.0)  # which it undoes at once
        needed.append(runs)
    assert needed == [3, 6, 12, 24, 48, 48]


@pytest.mark.parametrize("closed_first", [False, True], ids=["still-open", "fin-waiting"])
async def test_only_a_connection_the_upstream_still_had_open_outlived_the_limit(
        closed_first: bool) -> None:
    """Retired past the learned limit, a connection counts towards recovery if its socket
    is quiet, not if the upstream's close is already in it (unprocessed by the loop)."""
    up = HandDriven()
    try:
        async with wire(max_connections=1) as w:
            conn = await up.pooled(w)
            w.transport.idle_limits.learn(up.endpoint, 0.0)  # 0.25 s
            conn.idle_since -= 1.0  # idle for 1 s (without waiting for it): past the limit
            if closed_first:  # from here until the request the test does not yield
                up.socks[0].close()
                assert select.select([conn.fileno], [], [], 5)[0], "the FIN never arrived"
                assert conn.state is not ConnectionState.CLOSED
            second = asyncio.create_task(up.serve_one())
            try:
                assert await w.fetch("GET", up.endpoint, "/2") == (200, b"/2")
                await second
            finally:
                second.cancel()
            assert conn.state is ConnectionState.CLOSED and len(up.socks) == 2
            assert w.transport.idle_limits.recovery[up.endpoint].run == (0 if closed_first else 1)
            assert w.transport.idle_limits.expiry(up.endpoint) == MIN_LEARNED_EXPIRY
    finally:
        up.close()


@pytest.mark.parametrize(("idle_for", "reused"), [(0.7, True), (0.8, False)])
async def test_idle_connection_older_than_the_learned_limit_is_not_reused(
        idle_for: float, reused: bool) -> None:
    async with scripted(answering()) as up, wire() as w:
        assert await w.fetch("GET", up.endpoint, "/1") == (200, b"/1")
        w.transport.idle_limits.learn(up.endpoint, 1.0)  # 0.75 s from now on
        [conn] = w.transport.idle[up.endpoint]
        conn.idle_since -= idle_for  # idle that long, without waiting for it
        assert await w.fetch("POST", up.endpoint, "/2", b"{}") == (200, b"/2")
        assert up.accepted == (1 if reused else 2)
        assert (conn.state is ConnectionState.CLOSED) is not reused
        assert up.paths(up.accepted) == ([b"/1", b"/2"] if reused else [b"/2"])


async def test_expired_connections_at_the_bottom_of_the_pool_are_closed() -> None:
    """LIFO: the warm connection on top is reused, the expired one below is closed."""
    async with scripted(answering()) as up, wire(max_connections=2) as w:
        responses = await asyncio.gather(w.send("GET", up.endpoint, "/a"),
                                         w.send("GET", up.endpoint, "/b"))
        for response in responses:
            await response.body.read(100)
            await response.aclose()
        bottom, top = w.transport.idle[up.endpoint]
        bottom.idle_since -= 5.0  # older than the 4 s expiry
        assert await w.fetch("GET", up.endpoint, "/c") == (200, b"/c")
        closed = ConnectionState.CLOSED
        assert (bottom.state is closed, top.state is closed, up.accepted) == (True, False, 2)
        assert w.transport.idle[up.endpoint] == [top]


async def test_the_most_recently_used_connection_is_reused_first() -> None:
    """LIFO: the warmest connection carries the next request, so the coldest age out."""
    async with scripted(answering()) as up, wire(max_connections=2) as w:
        first, second = await asyncio.gather(w.send("GET", up.endpoint, "/a"),
                                              w.send("GET", up.endpoint, "/b"))
        for response in (first, second):  # released /a, then /b: /b's is on top
            await response.body.read(100)
            await response.aclose()
        assert await w.fetch("GET", up.endpoint, "/c") == (200, b"/c")
        [on_b] = [n for n, raw in up.requests if raw.startswith(b"GET /b ")]
        assert up.paths(on_b) == [b"/b", b"/c"]
        assert up.accepted == 2


async def test_upstream_closing_an_idle_connection_teaches_its_limit() -> None:
    close_now = asyncio.Event()
    closed = asyncio.Event()

    async def handler(up: Scripted, n: int, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        await up.read_request(n, reader)
        writer.write(ok(b"once"))
        await writer.drain()
        if n == 1:
            await close_now.wait()
            writer.close()  # the upstream's keep-alive timeout
        else:
            await until_eof(reader, closed)

    async with scripted(handler) as up, wire() as w:
        assert await w.fetch("GET", up.endpoint, "/1") == (200, b"once")
        [conn] = w.transport.idle[up.endpoint]
        conn.idle_since -= 2.0  # the upstream keeps connections 2 s (and a little more)
        close_now.set()
        await settled(lambda: conn.state is ConnectionState.CLOSED)
        assert conn.state is ConnectionState.CLOSED
        learned = w.transport.idle_limits.expiry(up.endpoint)
        assert 2.0 * LEARNED_MARGIN <= learned < 2.0 * LEARNED_MARGIN + 0.2
        assert await w.fetch("POST", up.endpoint, "/2", b"{}") == (200, b"once")
        assert up.accepted == 2


# ---------------------------------------------------------------------------
# Recovering from an upstream restart, through the whole proxy


@pytest.mark.e2e
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the servers run on their own loops
async def test_reuse_resumes_after_an_upstream_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The upstream restarts, closing every idle connection at once: the proxy learns the
    0.25 s floor. It then keeps connections open again, and requests come 0.6 s apart
    (each pooled connection is aged by hand: the test does not wait). Each connection the
    pool retires past the learned limit outlived it; three in a row double the limit, so
    after 0.5 s and 1 s the proxy reuses its connection again (before: a new connection
    per request, for good)."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    restart = Gate()

    async def restarts(conn: Conn) -> None:
        await normal(conn)
        await restart.wait()
        conn.close()  # the restart: the idle connection closed

    upstream = RawUpstream({"restarts": restarts})
    with upstream.running():
        app = create_app(Settings(upstream=upstream.url + "/v1"), registry=CollectorRegistry())
        transport = app.upstream.transport
        endpoint = Endpoint("http", "127.0.0.1", upstream.port)

        def idle() -> list[Any]:
            return [c for c in transport.idle.get(endpoint, [])
                    if c.state is not ConnectionState.CLOSED]

        with uvicorn_server(app) as proxy_url:
            async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as client:
                r = await client.post("/v1/chat/completions", json={**BODY, "model": "restarts"})
                assert r.status_code == 200
                await until(lambda: len(idle()) == 1)  # pooled
                restart.open()
                await until(lambda: transport.idle_limits.expiry(endpoint) == MIN_LEARNED_EXPIRY)
                connections = []
                for _ in range(12):
                    stale = -1.0
                    for conn in idle():  # (the proxy is idle: nothing else touches them)
                        conn.idle_since -= 0.6
                        stale = max(stale, conn.idle_since)
                    r = await client.post("/v1/chat/completions", json=BODY)
                    assert r.status_code == 200, r.text
                    # Back in the pool (released after the last byte went out).
                    await until(lambda s=stale: any(c.idle_since > s for c in idle()))
                    connections.append(upstream.connections)
    assert transport.idle_limits.expiry(endpoint) == 1.0  # 0.25 s, then 0.5 s, then 1 s
    assert connections[-5:] == [connections[-5]] * 5, connections  # reused again
    assert connections[-5] == 8  # the restarted one, then seven retired past the limit


# ---------------------------------------------------------------------------
# The race itself: uvicorn upstreams with a 1 s keep-alive, requests 0.96-1.04 s apart


@contextlib.contextmanager
def uvicorn_server(app: Any, **config: Any) -> Iterator[str]:
    """``app`` under uvicorn with uvloop and httptools (as ``proxy.serve`` runs the proxy,
    and as vLLM and friends run theirs) in a thread; yields its URL. The socket is bound
    and listening before uvicorn starts, so there is nothing to wait for: connections
    queue in the backlog until uvicorn accepts them."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, loop="uvloop", http="httptools",
                                           lifespan="on", log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="uvicorn-keepalive-test")
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@dataclass
class CountingUpstream:
    """A tiny OpenAI-style upstream: answers each JSON POST with a small JSON object and
    counts what it answered, and on how many connections (client ports) it came."""

    answered: int = 0
    clients: set[Any] = field(default_factory=set)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        model = json.loads(body)["model"]
        self.answered += 1
        self.clients.add(tuple(scope["client"]))
        answer = json.dumps({
            "id": f"c{self.answered}", "object": "chat.completion", "created": 0,
            "model": model, "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})


@dataclass
class RaceResult:
    statuses: list[int]
    failures: list[str]
    upstream_answered: int
    upstream_connections: int
    seconds: float


KEEP_ALIVE = 1  # the upstream's timeout_keep_alive, seconds
GAPS = (0.96, 1.04)  # idle time after each response: straddles the upstream's limit
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def run_race(sequences: int, per_sequence: int, *, seed: int = 0,
                   adjust: Callable[[Any], None] | None = None) -> RaceResult:
    """``sequences`` independent clients, each with its own proxy (the whole app under
    uvicorn) and its own upstream, each sending ``per_sequence`` POSTs with idle gaps
    drawn from ``GAPS``. ``adjust(app)`` may change a proxy before it serves."""
    rng = random.Random(seed)
    gaps = [[rng.uniform(*GAPS) for _ in range(per_sequence - 1)] for _ in range(sequences)]
    upstreams = [CountingUpstream() for _ in range(sequences)]
    statuses: list[int] = []
    failures: list[str] = []

    async def sequence(proxy_url: str, gaps: list[float]) -> None:
        async with httpx.AsyncClient(base_url=proxy_url, timeout=30) as client:
            for gap in [*gaps, None]:
                r = await client.post("/v1/chat/completions", json=BODY)
                statuses.append(r.status_code)
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:200]}")
                if gap is not None:
                    await asyncio.sleep(gap)  # the workload: an idle gap, not a wait for state

    with contextlib.ExitStack() as stack:
        proxy_urls = []
        for upstream in upstreams:
            upstream_url = stack.enter_context(
                uvicorn_server(upstream, timeout_keep_alive=KEEP_ALIVE))
            app = create_app(Settings(upstream=upstream_url + "/v1"),
                             registry=CollectorRegistry())
            if adjust is not None:
                adjust(app)
            proxy_urls.append(stack.enter_context(uvicorn_server(app)))
        t0 = time.perf_counter()
        await asyncio.gather(*(sequence(url, g) for url, g in zip(proxy_urls, gaps, strict=True)))
        seconds = time.perf_counter() - t0
    return RaceResult(statuses, failures, sum(u.answered for u in upstreams),
                      sum(len(u.clients) for u in upstreams), seconds)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the servers run on their own loops
async def test_no_request_fails_when_idle_gaps_straddle_the_upstream_keep_alive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # 192 idle gaps straddling the limit, as 16 clients of 13 requests rather than 8 of
    # 25: the same number of chances for the race, in half the wall time (the gaps are
    # the workload, so the time is their count per client)
    sequences, per_sequence = 16, 13
    result = await run_race(sequences, per_sequence)
    total = sequences * per_sequence
    assert len(result.statuses) == total
    assert result.failures == [], f"{len(result.failures)} of {total} failed"
    assert result.upstream_answered == total  # each request answered by the upstream, once
    print(f"\n{total} requests in {result.seconds:.1f} s, 0 failed; "
          f"{result.upstream_connections} upstream connections")
