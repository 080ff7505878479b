"""The relay: upstream bytes out to the client as they arrive, events observed on the side.

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from proxy.asgi import Receive, Send
from proxy.measure import Meter, Outcome
from proxy.strip import UsageStripper
from proxy.uvicorn_writer import client_connection, direct_writer
from proxy.wire.errors import SinkStopped, UpstreamError, UpstreamTimeout
from proxy.wire.http11 import GO, PAUSE, STOP, Verdict
from proxy.wire.response import WireBody

log = logging.getLogger("proxy.relay")

Clock = Callable[[], float]


class _Stalled(Exception):
    """The client took nothing for the client write timeout."""


class RelayResult(NamedTuple):
    """How the relay ended, made once at its end."""

    outcome: Outcome
    complete: bool  # the upstream body ended normally
    t_end: float
    t_first_byte: float | None = None  # when the first body bytes were handed on
    body: bytes | None = None  # the collected body of a non-stream answer (for usage)


class _Forwarder:
    """What to forward and what to observe, one per response.

    ``take(chunk)`` returns the bytes to hand on now; after handing them on, the caller
    reads the clock once and calls ``observe(t)``. Without the stripper ``take`` does no
    work at all, so parsing never delays the bytes it parses.
    """

    __slots__ = ("_chunk", "collect_limit", "collected", "collected_size", "meter", "stripper",
                 "t_first")

    def __init__(self, meter: Meter | None, strip: bool, collect_limit: int) -> None:
        self.meter = meter
        self.stripper = UsageStripper(meter) if strip and meter is not None else None
        self.collect_limit = collect_limit
        self.collected: list[bytes] | None = [] if collect_limit > 0 else None
        self.collected_size = 0
        self.t_first: float | None = None
        self._chunk = b""

    def take(self, chunk: bytes) -> bytes:
        stripper = self.stripper
        if stripper is not None:
            self._chunk = out = stripper.take(chunk)  # b"": all of it held back, for now
            return out
        self._chunk = chunk
        collected = self.collected
        if collected is not None:
            self.collected_size += len(chunk)
            if self.collected_size <= self.collect_limit:
                collected.append(chunk)
            else:
                self.collected = None
        return chunk

    def observe(self, t: float) -> None:
        if self.t_first is None and self._chunk:  # the first bytes handed on, not held back
            self.first_bytes(t)
        meter = self.meter
        if meter is None:
            return
        try:
            if self.stripper is not None:
                self.stripper.observe(t)
            else:
                meter.chunk(self._chunk, t)
        except Exception:  # pragma: no cover - the observer does not raise
            log.exception("measurement failed; stream continues unmeasured")
            self.meter = None
            self.stripper = None

    def first_bytes(self, t: float) -> None:
        """The first body bytes were handed on at ``t``."""
        self.t_first = t
        if self.meter is not None:  # kept where a relay cut short by the client leaves it
            self.meter.timer.first_byte_t = t

    def tail(self) -> bytes:
        """What the stripper still holds when the body ends, however it ended."""
        return self.stripper.tail() if self.stripper is not None else b""

    def body(self) -> bytes | None:
        return b"".join(self.collected) if self.collected else None


async def relay(body: WireBody, send: Send, clock: Clock, *, meter: Meter | None = None,
                strip_usage: bool = False, collect_limit: int = 0,
                write_timeout: float = 60.0) -> RelayResult:
    """Forward ``body`` to the client; return how it ended.

    ``meter`` given: an event stream to observe. ``strip_usage``: remove the usage event
    the proxy asked for (:mod:`proxy.strip`). ``collect_limit`` > 0: keep up to that
    many bytes of a non-stream body so usage can be read at the end. A client that goes
    away ends the relay (outcome ``client_disconnected``); when the disconnect arrives
    as cancellation it propagates to the caller. A client that takes no byte for
    ``write_timeout`` seconds ends it too (``client_stalled``), its connection dropped
    where the server allows it (``docs/design/request-path.md``).
    """
    fwd = _Forwarder(meter, strip_usage, collect_limit)
    take, observe = fwd.take, fwd.observe
    direct = direct_writer(send)
    client = direct if direct is not None else client_connection(send)
    queue: deque[bytes] = deque()

    if direct is not None:
        write = direct.write
        writable = direct.writable

        def sink(chunk: bytes) -> Verdict:
            out = take(chunk)
            verdict = write(out) if out else PAUSE if direct.flow.write_paused else GO
            if verdict != STOP:
                observe(clock())
            return verdict

        async def drain() -> None:
            if not await writable(write_timeout):
                raise _Stalled

        async def flush(data: bytes) -> None:
            if data:
                write(data)
            await drain()
    else:
        if client is not None:  # uvicorn's send waits unbounded: wait here first, bounded
            waitable = client.writable

            async def put(data: bytes) -> None:
                if not await waitable(write_timeout):
                    raise _Stalled
                await send({"type": "http.response.body", "body": data, "more_body": True})
        else:

            async def put(data: bytes) -> None:
                try:
                    async with asyncio.timeout(write_timeout):
                        await send({"type": "http.response.body", "body": data,
                                    "more_body": True})
                except TimeoutError:
                    raise _Stalled from None

        def sink(chunk: bytes) -> Verdict:
            queue.append(chunk)
            return PAUSE

        async def drain() -> None:
            while queue:
                out = take(queue.popleft())
                if out:
                    await put(out)
                observe(clock())

        async def flush(data: bytes) -> None:
            if data:
                await put(data)
            if client is not None and not await client.writable(write_timeout):
                raise _Stalled  # the end must not wait unbounded in uvicorn's send either

    outcome, complete = Outcome.COMPLETED, True
    try:
        try:
            while not await body.pipe(sink):
                await drain()
            await drain()
        except UpstreamError as exc:
            outcome = (Outcome.UPSTREAM_TIMEOUT if isinstance(exc, UpstreamTimeout)
                       else Outcome.UPSTREAM_INTERRUPTED)
            complete = False
            await drain()  # what arrived before the failure still reaches the client
        tail = fwd.tail()
        await flush(tail)
        if tail and fwd.t_first is None:  # every byte was held back until the end
            fwd.first_bytes(clock())
    except SinkStopped:
        return RelayResult(Outcome.CLIENT_DISCONNECTED, False, clock(), fwd.t_first)
    except _Stalled:
        if client is not None:
            client.abort()
        return RelayResult(Outcome.CLIENT_STALLED, False, clock(), fwd.t_first)
    return RelayResult(outcome, complete, clock(), fwd.t_first, fwd.body() if complete else None)


@dataclass(slots=True)
class Watch:
    """Shared between a request and its disconnect watcher (:func:`watch_disconnect`)."""

    disconnected: bool = False
    done: bool = False


async def watch_disconnect(receive: Receive, task: asyncio.Task[Any], watch: Watch) -> None:
    """Cancel the request's task when its client goes away (uvicorn's send won't say)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not watch.done:
                watch.disconnected = True
                task.cancel()
            return
