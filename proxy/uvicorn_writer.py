"""Writing a relayed body straight to uvicorn's transport (the relay's fast path).

uvicorn's ASGI ``send`` costs a message dict, state checks and a coroutine per body
chunk; for an SSE stream that is per event. :class:`DirectWriter` does what ``send``
does for a chunk of a chunked response, from the upstream socket's callback. It relies
on uvicorn's private attributes (``RequestResponseCycle`` of the httptools protocol),
which is why it lives alone here, why ``pyproject.toml`` bounds uvicorn's version, and
why :func:`direct_writer` checks every attribute it uses and returns None (the relay
then uses ``send``) rather than guess.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from proxy.wire import GO, PAUSE, STOP

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class DirectWriter:
    """Writes body chunks straight to uvicorn's transport, as uvicorn's own ``send`` would.

    uvicorn's ``RequestResponseCycle.send`` (httptools protocol), for a body chunk of a
    chunked response: wait while the transport is paused, return if the client
    disconnected, else write ``<hex size>\r\n<chunk>\r\n``. This does the same, minus
    the message dict, the state checks and the coroutine per chunk (about 25 us per SSE
    event on the benchmark machine); the waiting moves to :meth:`drain`, which the relay
    awaits only when :meth:`write` said the transport asked to pause. The response start and the final
    empty chunk still go through ``send``, so uvicorn's state (keep-alive, access log,
    response completion) is exactly what it would be.
    """

    __slots__ = ("cycle", "flow", "transport_write")

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle  # uvicorn's RequestResponseCycle: .disconnected
        self.transport_write: Callable[[bytes], None] = cycle.transport.write
        self.flow: Any = cycle.flow  # uvicorn's FlowControl: write_paused, drain()

    def write(self, chunk: bytes) -> int:
        """Write one body chunk; STOP if the client is gone (nothing written), PAUSE if
        the client's transport asked the writer to wait, else GO."""
        if self.cycle.disconnected:
            return STOP
        self.transport_write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return PAUSE if self.flow.write_paused else GO

    async def drain(self) -> None:
        await self.flow.drain()


_UVICORN_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"


def direct_writer(send: Send) -> DirectWriter | None:
    """A :class:`DirectWriter` when ``send`` is uvicorn's httptools cycle mid-way through a
    chunked response; None for any other server or state (then ``send`` is used).

    Checked per response against the cycle's attributes as uvicorn's source has them;
    ``pyproject.toml`` bounds uvicorn to the releases this was read against, and a test
    fails when the installed uvicorn makes this return None under uvicorn itself, so an
    upgrade that changes them fails CI instead of silently taking the slower path.
    """
    cycle = getattr(send, "__self__", None)
    if cycle is None or type(cycle).__module__ != _UVICORN_HTTPTOOLS:
        return None
    try:
        ready = (cycle.response_started and cycle.chunked_encoding is True
                 and not cycle.response_complete and not cycle.disconnected
                 and cycle.scope["method"] != "HEAD" and cycle.flow is not None
                 and cycle.transport is not None)
    except (AttributeError, KeyError):
        return None
    return DirectWriter(cycle) if ready else None
