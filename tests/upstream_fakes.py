"""Helpers for in-process proxy tests: the proxy app in front of the suite's scripted
upstream (:mod:`tests.fake_upstream`, a real loopback server, so the production client
runs), driven through ASGI.

Time is scripted, never measured: the upstream's body generator sets the clock right
before it yields each chunk, and the upstream writes the next chunk only after the
relay has read the clock for this one, so every expected metric can be computed from
the script. The SSE builders are :mod:`tests.fake_upstream`'s, re-exported here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from proxy.app import ProxyApp, create_app
from proxy.config import Settings
from tests.fake_upstream import (
    Behaviour,
    Handler,
    ScriptedClock,
    ScriptedUpstream,
    Seen,
    chunk_json,
    sse,
    text_json,
    usage_json,
)

__all__ = ["ScriptedClock", "Seen", "chunk_json", "sse", "text_json", "usage_json"]

UPSTREAM_LABEL = "upstream.test:8000"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8"}

Message = MutableMapping[str, Any]


@dataclass
class FakeUpstream:
    """Records every request; answers with whatever ``respond`` returns."""

    respond: Handler
    seen: list[Seen] = field(default_factory=list)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request.extensions["seen"])  # exactly as the upstream received it
        return await self.respond(request)


def sse_upstream(clock: ScriptedClock, script: Sequence[tuple[float, bytes]], *,
                 headers_at: float, end: float | None,
                 headers: dict[str, str] | None = None, **kwargs: Any) -> FakeUpstream:
    """An event stream answered at ``headers_at`` and played by :func:`timed_body`."""
    async def respond(request: httpx.Request) -> httpx.Response:
        clock.now = headers_at  # upstream answers with headers
        return httpx.Response(200, headers={**SSE_HEADERS, **(headers or {})},
                              content=timed_body(clock, script, end, **kwargs))

    return FakeUpstream(respond)


async def lazy(body: bytes) -> AsyncIterator[bytes]:
    """A body read from the network (httpx reads a bytes body eagerly, no transport does)."""
    if body:
        yield body


def json_upstream(status: int, body: bytes, headers: dict[str, str] | None = None
                  ) -> FakeUpstream:
    async def respond(request: httpx.Request) -> httpx.Response:
        sent = {"content-type": "application/json", **(headers or {}),
                "content-length": str(len(body))}
        return httpx.Response(status, headers=sent, content=lazy(body))

    return FakeUpstream(respond)


async def timed_body(clock: ScriptedClock, script: Sequence[tuple[float, bytes]],
                     end: float | None = None,
                     fail: BaseException | None = None,
                     closed: asyncio.Event | None = None,
                     hold: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    """Yield each chunk at its scripted time; then set the end time, or raise ``fail``.

    ``hold``: after the script, wait for it (an upstream that goes quiet).
    ``closed`` is set however the generator ends (normally, failing or closed early).
    """
    try:
        for t, chunk in script:
            clock.now = t
            yield chunk
        if hold is not None:
            await hold.wait()
        if fail is not None:
            raise fail
        if end is not None:
            clock.now = end
    finally:
        if closed is not None:
            closed.set()


class InProcess:
    """The proxy app and its scripted upstream, as one ASGI app for a test.

    ``async with app:`` starts the upstream and closes both at the end, however the
    block ends. The upstream's socket is bound at once (so its URL goes into the
    settings); it also starts on the first request. Attributes not found here are the
    proxy app's (``app.metrics``, ``app.upstream``, ...).
    """

    def __init__(self, app: ProxyApp, upstream: ScriptedUpstream) -> None:
        self.app = app
        self.scripted = upstream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.scripted.start()
        await self.app(scope, receive, send)

    async def __aenter__(self) -> InProcess:
        await self.scripted.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        try:
            await self.app.aclose()
        finally:
            await self.scripted.aclose()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)


def make_app(handler: Handler | None, clock: ScriptedClock, *, base_path: str = "/v1",
             behaviour: Behaviour | None = None,
             **overrides: Any) -> tuple[InProcess, CollectorRegistry]:
    """The proxy in front of ``handler`` (or a raw ``behaviour``) served on loopback;
    ``base_path`` is the upstream base URL's path
    (``--upstream http://127.0.0.1:PORT<base_path>``). Use the app as ``async with app:``."""
    upstream = ScriptedUpstream(handler, clock, behaviour=behaviour)
    try:
        settings = Settings(**{"upstream": upstream.url + base_path,
                               "upstream_name": UPSTREAM_LABEL, **overrides})
        registry = CollectorRegistry()
        app = create_app(settings, registry=registry, clock=clock)
    except BaseException:
        upstream.sock.close()  # bound, never served: nothing else to close
        raise
    return InProcess(app, upstream), registry


def labels(route: str = CHAT, model: str = "m", **extra: str) -> dict[str, str]:
    return {"route": route, "model": model, "upstream": UPSTREAM_LABEL, **extra}


@dataclass
class Histo:
    count: float
    sum: float
    buckets: dict[float, float]


def histogram(registry: CollectorRegistry, name: str, lbl: dict[str, str]) -> Histo:
    """Count, sum and cumulative buckets of one histogram child (zeros if absent)."""
    count = registry.get_sample_value(name + "_count", lbl) or 0.0
    total = registry.get_sample_value(name + "_sum", lbl) or 0.0
    buckets: dict[float, float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name != name + "_bucket":
                continue
            rest = {k: v for k, v in sample.labels.items() if k != "le"}
            if rest == lbl:
                buckets[float(sample.labels["le"])] = sample.value
    return Histo(count, total, buckets)


def expected_buckets(edges: Sequence[float], values: Sequence[float]) -> dict[float, float]:
    out = {float(le): float(sum(1 for v in values if v <= le)) for le in edges}
    out[float("inf")] = float(len(values))
    return out


@dataclass
class RawResult:
    messages: list[Message]

    @property
    def start(self) -> Message:
        return next(m for m in self.messages if m["type"] == "http.response.start")

    @property
    def status(self) -> int:
        return int(self.start["status"])

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return list(self.start["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages
                        if m["type"] == "http.response.body")

    @property
    def completed(self) -> bool:
        """The app sent a final body message (``more_body`` false)."""
        return any(m["type"] == "http.response.body" and not m.get("more_body", False)
                   for m in self.messages)


async def call_raw(app: Any, method: str, path: str, *, body: bytes = b"",
                   headers: Sequence[tuple[bytes, bytes]] = (),
                   query: bytes = b"",
                   disconnect_after_body_messages: int | None = None,
                   record: list[Message] | None = None) -> RawResult:
    """Drive the ASGI app directly and record every message it sends (into ``record``
    as they are sent, if given).

    The client never disconnects unless ``disconnect_after_body_messages`` is given:
    then ``http.disconnect`` is delivered once the app has sent that many body messages.
    """
    messages: list[Message] = record if record is not None else []
    delivered = False
    gone = asyncio.Event()

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.append(message)
        if disconnect_after_body_messages is not None:
            count = sum(1 for m in messages if m["type"] == "http.response.body")
            if count >= disconnect_after_body_messages:
                gone.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
        "root_path": "", "headers": [(k.lower(), v) for k, v in headers],
        "client": ("127.0.0.1", 50000), "server": ("proxy.test", 80),
    }
    await app(scope, receive, send)
    return RawResult(messages)
