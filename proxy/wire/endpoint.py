"""Where a connection goes (:class:`Endpoint`, the pool's key) and, through an HTTP proxy,
how it gets there: a ``CONNECT`` tunnel (:func:`tunnel`), TLS added by the caller."""

from __future__ import annotations

import asyncio
import base64
import socket
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from proxy.wire.http11 import MAX_HEAD_BYTES


def authority(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class ProxyEndpoint:
    """An HTTP proxy to tunnel through (``HTTPS_PROXY`` for an https upstream)."""

    host: str
    port: int
    authorization: bytes = b""  # the Proxy-Authorization value, from the proxy URL's user info

    @classmethod
    def from_url(cls, url: str) -> ProxyEndpoint:
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme != "http" or not parts.hostname:
            shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
            raise ValueError(f"only http:// proxies are supported, not {shown!r}")  # no password
        auth = b""
        if parts.username is not None:
            user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            auth = b"Basic " + base64.b64encode(user.encode())
        return cls(parts.hostname, parts.port or 80, auth)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a connection goes: a pool key."""

    scheme: str
    host: str
    port: int
    via: ProxyEndpoint | None = None  # CONNECT tunnel through this proxy (https only)

    def __str__(self) -> str:
        return authority(self.host, self.port)


async def tunnel(
    loop: asyncio.AbstractEventLoop, via: ProxyEndpoint, host: str, port: int
) -> socket.socket:
    """A socket connected to ``host:port`` through ``via`` with ``CONNECT``. Failures are
    :class:`OSError`, as a direct connection's are; the caller bounds the time."""
    infos = await loop.getaddrinfo(via.host, via.port, type=socket.SOCK_STREAM)
    last: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            break
        except OSError as exc:
            sock.close()
            last = exc
        except BaseException:  # cancelled or timed out while connecting: close it now,
            sock.close()  # not whenever the last reference to the error goes
            raise
    else:
        raise last or OSError(f"no address for {via.host}")
    try:
        target = authority(host, port).encode("idna")
        request = b"CONNECT %b HTTP/1.1\r\nHost: %b\r\n" % (target, target)
        if via.authorization:
            request += b"Proxy-Authorization: " + via.authorization + b"\r\n"
        await loop.sock_sendall(sock, request + b"\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            part = await loop.sock_recv(sock, 4096)
            if not part or len(head) > MAX_HEAD_BYTES:  # bounded as a response head is
                raise OSError("the proxy closed the connection during CONNECT")
            head += part
        status_line = head.split(b"\r\n", 1)[0]
        fields = status_line.split(b" ", 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or fields[1] != b"200":
            raise OSError(f"the proxy refused CONNECT: {status_line.decode('latin-1')[:200]}")
        if not head.endswith(b"\r\n\r\n"):
            raise OSError("the proxy sent bytes after its CONNECT answer")
    except BaseException:
        sock.close()
        raise
    return sock
