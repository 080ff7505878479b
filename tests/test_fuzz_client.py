"""The client side under a fuzzer: any request, sent at any pace, gets a clear answer.

Hypothesis builds a request (:class:`Ask`): method, target (safe, unsafe and invalid),
the HTTP version, header fields of any count and size with any byte in their values, a
client key in each form the proxy accepts (``Authorization: Bearer``, ``x-api-key``,
``api-key``) or a wrong, empty or Basic one, a body (valid JSON, invalid JSON, a huge
array, deep nesting, non-UTF-8 bytes, one over ``--max-body-bytes``), framed by
``Content-Length`` or chunked, sent in random pieces, sometimes slowly, sometimes
stalled part-way through its body. The proxy runs as ``serve`` runs it (uvicorn with
httptools, client keys checked, a server-held upstream key) in front of the suite's raw
upstream, each on a thread of its own; the request goes over a raw socket.

For every case:

* the answer is the one :func:`expect` predicts, in order of the proxy's checks:
  uvicorn's plain 400 for what is not HTTP, else the proxy's own refusal (400
  ``invalid_path``, 431, 413, 401, 408) in the OpenAI error shape, else the upstream's
  200; never a 500, never silence;
* a stalled sender is answered 408 after ``--body-timeout``, and while it stalls another
  client's stream goes through; after every case the next client's stream does too.

``FUZZ_EXAMPLES`` and the ``fuzz_campaign`` marker work as in
``tests/test_fuzz_upstream.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httptools
import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings
from tests.fake_upstream import RawUpstream, stream_events
from tests.servers import RunningServer, serve_in_thread
from tests.test_fuzz_upstream import FUZZ as UPSTREAM_FUZZ
from tests.test_fuzz_upstream import run_campaign

pytestmark = pytest.mark.e2e

# the upstream fuzzer's settings; this one's rig is a function-scoped fixture too
FUZZ = settings(
    UPSTREAM_FUZZ,
    suppress_health_check=[
        *UPSTREAM_FUZZ.suppress_health_check,
        HealthCheck.function_scoped_fixture,
    ],
)
KEY = "cli-fuzz-key-0123456789"
MAX_BODY = 256 * 1024
MAX_HEADERS = 8 * 1024
BODY_TIMEOUT = 0.4  # a stalled sender costs this much per example
ANSWER_WITHIN = 10.0  # every answer comes within this (a stall's included), else a failure

CHAT = b"/v1/chat/completions"
SAFE = [CHAT, b"/v1/completions", b"/v1/models", b"/v1/anything/else?x=1", b"/v1/embeddings"]
UNSAFE = [b"/v1/../metrics", b"/v1/%2e%2e/x", b"/v1/a%2Fb", b"/v1/a%5cb", b"/v1/a\\b", b"/v1/a%00"]
INVALID_TARGETS = [b"/v1/a b", b"/v1/\x01", b""]


@dataclass(frozen=True)
class Ask:
    method: bytes
    target: bytes
    version: bytes
    fields: tuple[tuple[bytes, bytes], ...]  # besides host, the key and the framing
    key: str  # none | bearer | bearer-lower | x-api-key | api-key | wrong | empty | basic
    body: bytes
    framing: str  # length | chunked | none
    splits: tuple[int, ...]
    stall: bool  # stop half-way through the body and never send the rest
    pace: float = 0.0  # seconds between two writes: a slow sender (well within the timeout)

    def __repr__(self) -> str:  # a failing example's line: bodies run to megabytes
        body = (
            self.body
            if len(self.body) <= 80
            else (self.body[:40] + b"...(%d bytes)..." % len(self.body) + self.body[-20:])
        )
        fields = tuple(
            (k, v if len(v) <= 40 else v[:20] + b"...(%d bytes)" % len(v)) for k, v in self.fields
        )
        return (
            f"Ask({self.method!r}, {self.target!r}, {self.version!r}, {fields!r}, "
            f"key={self.key!r}, body={body!r}, framing={self.framing!r}, "
            f"splits={self.splits!r}, stall={self.stall!r}, pace={self.pace!r})"
        )

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis prints with this
        p.text(repr(self))

    def key_fields(self) -> list[tuple[bytes, bytes]]:
        key = KEY.encode()
        return {
            "none": [],
            "bearer": [(b"Authorization", b"Bearer " + key)],
            "bearer-lower": [(b"authorization", b"bearer " + key)],
            "x-api-key": [(b"x-api-key", key)],
            "api-key": [(b"api-key", key)],
            "wrong": [(b"Authorization", b"Bearer sk-wrong")],
            "empty": [(b"x-api-key", b"")],
            "basic": [(b"Authorization", b"Basic dXNlcjo=")],
        }[self.key]

    def all_fields(self) -> list[tuple[bytes, bytes]]:
        out = [(b"Host", b"proxy.test"), *self.key_fields(), *self.fields]
        if self.framing == "length":
            out.append((b"Content-Length", b"%d" % len(self.body)))
        elif self.framing == "chunked":
            out.append((b"Transfer-Encoding", b"chunked"))
        return out

    @property
    def head(self) -> bytes:
        line = self.method + b" " + self.target + b" " + self.version + b"\r\n"
        return line + b"".join(k + b": " + v + b"\r\n" for k, v in self.all_fields()) + b"\r\n"

    @property
    def wire_body(self) -> bytes:
        if self.framing == "chunked":
            return (b"%x\r\n%s\r\n" % (len(self.body), self.body) if self.body else b"") + (
                b"0\r\n\r\n"
            )
        return self.body if self.framing == "length" else b""

    def pieces(self) -> tuple[list[bytes], bool]:
        """The bytes in writes, and whether a stall cut them short."""
        data = self.head + self.wire_body
        stop = len(data)
        if self.stall and self.wire_body:
            stop = len(self.head) + len(self.wire_body) // 2
        data = data[:stop]
        edges = [0, *sorted(p for p in set(self.splits) if 0 < p < len(data)), len(data)]
        return [data[a:b] for a, b in itertools.pairwise(edges) if b > a], (
            stop < len(self.head) + len(self.wire_body)
        )


def _valid_field_value(value: bytes) -> bool:
    return not re.search(rb"[\x00-\x08\x0a-\x1f\x7f]", value)


BODIES = st.one_of(
    st.builds(
        lambda s, m: json.dumps(
            {
                "model": m,
                "stream": s,
                "messages": [{"role": "user", "content": "hi"}],
                "stream_options": {"include_usage": True},
            }
        ).encode(),
        st.booleans(),
        st.sampled_from(["m", "é", "x" * 300]),
    ),
    st.binary(max_size=200),  # invalid JSON, non-UTF-8
    st.sampled_from(
        [
            b"",
            b"{",
            b"[1,2",
            b'{"model": "m"',
            b"\xff\xfe{}",
            b'{"model": "\xff"}',
            b"null",
            b"[]",
            b'"s"',
        ]
    ),
    st.integers(1, 60_000).map(lambda n: b"[" + b"0," * n + b"0]"),  # a huge array
    st.integers(1, 120_000).map(lambda n: b"[" * n + b"]" * n),  # deep nesting
    st.integers(1, 30_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.just(b'{"model":"m","x":"' + b"y" * (MAX_BODY + 10) + b'"}'),  # over the limit
)


VALUE_BYTES = st.binary(max_size=30).map(lambda v: re.sub(rb"[\x00-\x1f\x7f]", b"", v))


@st.composite
def asks(draw: st.DrawFn) -> Ask:
    # at most one thing that is not HTTP, in one case out of three: the proxy's own
    # checks are the subject of the others
    broken = draw(st.sampled_from(["method", "version", "target", "name", "value"] + ["none"] * 10))
    method = draw(
        st.sampled_from(
            [b"PO ST", b"P\x00ST", b"post"]
            if broken == "method"
            else [b"POST", b"POST", b"POST", b"GET", b"PUT", b"DELETE"]
        )
    )
    target = draw(st.sampled_from(INVALID_TARGETS if broken == "target" else SAFE * 4 + UNSAFE))
    version = draw(
        st.sampled_from(
            [b"HTTP/9.9", b"HTTX/1.1", b"HTTP/1"]
            if broken == "version"
            else [b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]
        )
    )
    count = draw(st.integers(0, 6))
    fields = []
    for i in range(count):
        name = draw(st.sampled_from([b"x-h%d" % i, b"X-Team", b"user-agent"]))
        value = draw(VALUE_BYTES | st.sampled_from([b"\xe9t\xe9", b"v" * 3000, b"\x80\xff"]))
        fields.append((name, value.strip(b" \t")))
    if broken == "name":
        fields.append((draw(st.sampled_from([b"bad name", b"x-\xff", b"(x)", b""])), b"1"))
    if broken == "value":
        fields.append((b"x-bad", draw(st.sampled_from([b"a\x00b", b"a\x7f", b"a\x01"]))))
    key = draw(
        st.sampled_from(
            ["bearer", "bearer-lower", "x-api-key", "api-key"] * 3
            + ["none", "wrong", "empty", "basic"]
        )
    )
    body = draw(BODIES)
    framing = draw(st.sampled_from(["length", "length", "chunked", "none"]))
    if framing == "none":
        body = b""
    stall = draw(st.integers(0, 14)) == 0
    splits = tuple(draw(st.lists(st.integers(1, 4096), max_size=8)))
    pace = draw(st.sampled_from([0.0, 0.0, 0.0, 0.002]))
    return Ask(method, target, version, tuple(fields), key, body, framing, splits, stall, pace)


@dataclass(frozen=True)
class Expected:
    statuses: frozenset[int]
    by_uvicorn: bool = False  # not HTTP: uvicorn's plain 400, not the proxy's JSON
    code: str = ""  # the proxy's error code, when it refuses


def expect(a: Ask) -> Expected:
    """The answer, in the order the checks run (uvicorn's parser, then
    ``proxy.routes.V1Handler._check`` and ``_read``)."""
    names_ok = all(re.fullmatch(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+", k) for k, _ in a.all_fields())
    values_ok = all(_valid_field_value(v) for _, v in a.all_fields())
    if (
        not re.fullmatch(rb"[A-Z]+", a.method)
        or a.version not in (b"HTTP/1.1", b"HTTP/1.0")
        or not a.target
        or re.search(rb"[\x00-\x20\x7f]", a.target)
        or not names_ok
        or not values_ok
    ):
        return Expected(frozenset({400}), by_uvicorn=True)
    if a.target in UNSAFE:
        return Expected(frozenset({400}), code="invalid_path")
    size = sum(len(k) + len(v) for k, v in a.all_fields())
    if size > MAX_HEADERS:
        return Expected(frozenset({431}), code="headers_too_large")
    if a.framing == "length" and len(a.body) > MAX_BODY:
        return Expected(frozenset({413}), code="request_too_large")
    if a.key not in ("bearer", "bearer-lower", "x-api-key", "api-key"):
        return Expected(frozenset({401}), code="invalid_api_key")
    pieces, stalled = a.pieces()
    sent_body = sum(map(len, pieces)) - len(a.head)  # chunk framing included: a little over
    if a.framing == "chunked" and len(a.body) > MAX_BODY and sent_body > MAX_BODY + 16:
        return Expected(frozenset({413}), code="request_too_large")  # read up to the limit
    if stalled:
        return Expected(frozenset({408}), code="body_timeout")
    return Expected(frozenset({200}))


class Answer:
    """httptools callbacks: one response."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


def read_answer(sock: socket.socket) -> tuple[int, Answer]:
    answer = Answer()
    deadline = time.monotonic() + ANSWER_WITHIN
    while not answer.done:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            data = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            data = b""
        if not data:
            break
        answer.parser.feed_data(data)
    assert answer.done, "no whole answer"
    return answer.parser.get_status_code(), answer


@dataclass
class Rig:
    proxy: RunningServer
    other: httpx.Client
    upstream: RawUpstream

    def others_are_served(self) -> None:
        body = {
            "model": "m",
            "stream": True,
            "messages": [],
            "stream_options": {"include_usage": True},
        }
        r = self.other.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
        assert (r.status_code, r.content) == (200, b"".join(stream_events(3, usage=True)))


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    keys = Path(tmp_path_factory.mktemp("keys")) / "keys"
    keys.write_text(hashlib.sha256(KEY.encode()).hexdigest() + "\n")
    os.environ["TEST_FUZZ_UPSTREAM_KEY"] = "srv-fuzz-key"
    upstream = RawUpstream()
    try:
        with upstream.running():
            settings_ = Settings(
                upstream=upstream.url + "/v1",
                upstream_api_key_env="TEST_FUZZ_UPSTREAM_KEY",
                client_keys_file=str(keys),
                max_body_bytes=MAX_BODY,
                max_header_bytes=MAX_HEADERS,
                body_timeout=BODY_TIMEOUT,
            )
            app = create_app(settings_, registry=CollectorRegistry())
            with (
                serve_in_thread(app, http="httptools", timeout_graceful_shutdown=2) as proxy,
                httpx.Client(base_url=proxy.url, timeout=ANSWER_WITHIN) as other,
            ):
                yield Rig(proxy, other, upstream)
    finally:
        del os.environ["TEST_FUZZ_UPSTREAM_KEY"]


def check(rig: Rig, a: Ask) -> None:
    e = expect(a)
    pieces, stalled = a.pieces()
    with contextlib.closing(
        socket.create_connection(("127.0.0.1", rig.proxy.port), timeout=ANSWER_WITHIN)
    ) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for i, piece in enumerate(pieces):
                if i and a.pace:
                    time.sleep(a.pace)  # the sender's pace, the subject here
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the whole request was sent: its answer is waiting
        if stalled:
            rig.others_are_served()  # while this one stalls
        status, answer = read_answer(sock)
    with contextlib.suppress(InvalidArgument):  # outside a given test: no statistics
        event(
            f"answered {status}"
            + (" by uvicorn" if e.by_uvicorn else "")
            + (" after a stall" if stalled else "")
        )  # --hypothesis-show-statistics
    assert status in e.statuses, (status, bytes(answer.body[:300]), e)
    if e.by_uvicorn:
        assert answer.headers.get(b"content-type", b"").startswith(b"text/plain")
    elif status != 200:
        error = json.loads(answer.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == e.code
    rig.others_are_served()


@FUZZ
@given(asks())
@example(
    Ask(
        b"POST",
        CHAT,
        b"HTTP/1.1",
        (),
        "bearer",
        b"[" * 100_000 + b"]" * 100_000,
        "length",
        (),
        False,
    )
)
@example(Ask(b"POST", CHAT, b"HTTP/1.1", (), "x-api-key", b'{"model":"m"}', "chunked", (), True))
@example(
    Ask(
        b"POST",
        CHAT,
        b"HTTP/1.1",
        ((b"x-big", b"v" * 9000),),
        "api-key",
        b"{}",
        "length",
        (),
        False,
    )
)
def test_any_client_request_gets_a_clear_answer(rig: Rig, a: Ask) -> None:
    check(rig, a)


@pytest.mark.fuzz_campaign
@pytest.mark.timeout(0)
def test_campaign(rig: Rig) -> None:
    """The long run of the property above (``tests/test_fuzz_upstream.py``'s
    :func:`run_campaign`)."""
    run_campaign("client", asks(), lambda a: check(rig, a))
