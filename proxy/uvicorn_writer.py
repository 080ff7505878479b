"""Writing a relayed body straight to uvicorn's transport, and bounding a client that stops
reading.

Design: ``docs/design/relay-and-export.md``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

try:  # the kernel's send queue of a socket (Linux): what the client has yet to take
    from fcntl import ioctl
    from termios import TIOCOUTQ
except ImportError:  # pragma: no cover - not Unix
    ioctl = None  # type: ignore[assignment]

from proxy.asgi import Receive, Send
from proxy.wire.http11 import GO, PAUSE, STOP, Verdict

# How often a paused client's write buffer is looked at (at most; a quarter of the
# timeout when that is shorter): a stall is detected within timeout + this.
PROGRESS_CHECK_S = 1.0


class ClientConnection:
    """uvicorn's connection to one client, as far as a client that stops reading goes.

    Works with both of uvicorn's HTTP/1.1 protocols (httptools and h11): their
    ``RequestResponseCycle`` has the same ``transport``, ``flow`` (``FlowControl``:
    ``write_paused``, ``drain()``) and ``disconnected``.
    """

    __slots__ = ("cycle", "flow", "transport")

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle  # uvicorn's RequestResponseCycle: .disconnected
        self.flow: Any = cycle.flow  # uvicorn's FlowControl: write_paused, drain()
        self.transport: Any = cycle.transport

    async def writable(self, stall_s: float) -> bool:
        """Wait while uvicorn's flow control holds writes back; True once the client
        may be written to again (or is gone: the next write says so), False when the
        client took no byte for ``stall_s`` seconds."""
        flow = self.flow
        if not flow.write_paused:
            return True
        loop = asyncio.get_running_loop()
        step = min(PROGRESS_CHECK_S, stall_s / 4)
        left = self.unsent()
        progress_at = loop.time()  # the write that filled the buffer
        while flow.write_paused:
            try:
                async with asyncio.timeout(step):
                    await flow.drain()
            except TimeoutError:
                now = loop.time()
                still = self.unsent()
                if still < left:  # the client took bytes since the last look
                    progress_at = now
                left = still
                if now - progress_at >= stall_s:
                    return False
        return True

    def unsent(self) -> int:
        """Bytes written for the client that it has not taken: the transport's buffer,
        and the kernel's send queue where it says (Linux). The kernel's counts: with a
        send buffer of megabytes, the socket is writable again only once about a third
        of it drained, so the transport's buffer alone stays put while a slow client
        reads all along."""
        transport = self.transport
        buffered: int = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if ioctl is None or sock is None:
            return buffered
        try:
            queued = ioctl(sock.fileno(), TIOCOUTQ, b"\0\0\0\0")
        except (OSError, ValueError):  # closed meanwhile, or not a TCP socket
            return buffered
        return buffered + int.from_bytes(queued, sys.byteorder, signed=True)

    def abort(self) -> None:
        """Drop the connection now. A stalled client will not take the bytes still
        buffered for it, so a plain close would wait for them and keep the socket open
        until the kernel gives up. Marked disconnected at once, as uvicorn marks it when
        the transport reports the loss a moment later, so that uvicorn does not log the
        unfinished response as an application error."""
        self.cycle.disconnected = True
        self.transport.abort()


class DirectWriter(ClientConnection):
    """Writes body chunks straight to uvicorn's transport, as uvicorn's own ``send`` would
    (``docs/design/relay-and-export.md``, ``proxy/uvicorn_writer.py``).
    """

    __slots__ = ("transport_write",)

    def __init__(self, cycle: Any) -> None:
        super().__init__(cycle)
        self.transport_write: Callable[[bytes], None] = cycle.transport.write

    def write(self, chunk: bytes) -> Verdict:
        """Write one body chunk; STOP if the client is gone (nothing written), PAUSE if
        the client's transport asked the writer to wait, else GO."""
        if self.cycle.disconnected:
            return STOP
        self.transport_write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return PAUSE if self.flow.write_paused else GO



_UVICORN_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"
_UVICORN_CYCLES = frozenset({_UVICORN_HTTPTOOLS, "uvicorn.protocols.http.h11_impl"})


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


def client_connection(send: Send) -> ClientConnection | None:
    """The client's connection when ``send`` is one of uvicorn's HTTP/1.1 cycles; None
    under any other server (the relay then bounds each ``send`` instead)."""
    cycle = getattr(send, "__self__", None)
    if cycle is None or type(cycle).__module__ not in _UVICORN_CYCLES:
        return None
    try:
        ready = (cycle.flow is not None and cycle.transport is not None
                 and isinstance(cycle.disconnected, bool)
                 and hasattr(cycle.flow, "write_paused")
                 and hasattr(cycle.transport, "get_write_buffer_size"))
    except AttributeError:
        return None
    return ClientConnection(cycle) if ready else None


def body_in_hand(receive: Receive) -> bool:
    """True when ``receive`` is uvicorn's httptools cycle already holding the request's
    whole body: the next ``receive()`` returns it without waiting, so there is no wait
    for the caller to bound (``asyncio.timeout`` costs a timer per request). Any other
    server or state: False, and the caller bounds the read as usual."""
    cycle = getattr(receive, "__self__", None)
    if cycle is None or type(cycle).__module__ != _UVICORN_HTTPTOOLS:
        return False
    try:
        return (cycle.more_body is False and cycle.message_event.is_set()
                and not cycle.waiting_for_100_continue)
    except AttributeError:
        return False
