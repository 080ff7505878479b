"""The upstream client's own exceptions, split as httpcore's are (pool, connection,
protocol); ``proxy.upstream.error_response`` maps them once to the OpenAI error shape."""

from __future__ import annotations


class UpstreamError(Exception):
    """The exchange with the upstream failed. Subclasses say where."""


class ConnectError(UpstreamError):
    """No connection: refused, unreachable, DNS, TLS, or a proxy that refused CONNECT."""


class ConnectTimeout(ConnectError):
    """Connecting (and, through a proxy, tunnelling) took longer than the connect timeout."""


class PoolTimeout(UpstreamError):
    """Every connection slot stayed busy for longer than the connect timeout."""


class UpstreamTimeout(UpstreamError):
    """The upstream went silent (a read) or would not take the request (a write)."""


class ReadTimeout(UpstreamTimeout):
    pass


class WriteTimeout(UpstreamTimeout):
    pass


class ReadError(UpstreamError):
    """The connection closed or was reset before the response was complete."""


class ResetBeforeAnswer(ReadError):
    """The upstream reset a connection it had taken from the pool before any byte of its
    answer: it closed the socket with the request unread, so the request may be sent
    again (``docs/design/upstream-client.md``, "The one resend")."""


class RemoteProtocolError(UpstreamError):
    """The upstream sent something that is not HTTP/1.1."""


class ResponseHeadTooLarge(RemoteProtocolError):
    """The upstream's response head passed ``http11.MAX_HEAD_BYTES`` (a header flood)."""


class SinkStopped(Exception):
    """The sink said STOP: whoever the body was going to takes no more of it (the
    client is gone, or :meth:`~proxy.wire.response.WireBody.read` has its limit)."""
