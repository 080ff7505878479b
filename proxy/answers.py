"""The answers the proxy gives itself, in the OpenAI error shape: a request it refuses
(:class:`Refused`), an upstream exchange that failed before its headers
(:class:`UpstreamFailed`), and a request the server cancelled at shutdown
(:func:`cancelled`).

Design: ``docs/design/request-path.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from proxy.asgi import Send
from proxy.measure import Outcome
from proxy.upstream import error_body
from proxy.uvicorn_writer import client_connection

JSON_HEADERS = [(b"content-type", b"application/json")]
# A refusal that leaves the request body unread (too large, too slow) closes the
# connection, as nginx does: the rest of the body is not waited for
CLOSE = [(b"connection", b"close")]


class Refused(Exception):
    """The proxy refuses the request and answers it itself, in the OpenAI error shape
    (outcome ``rejected``)."""

    outcome = Outcome.REJECTED
    reason = ""  # not an upstream failure: no warning line

    def __init__(self, status: int, message: str, type_: str, code: str, *,
                 extra: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.extra = extra or []

    @property
    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code)


class UpstreamFailed(Exception):
    """The upstream exchange failed before the response headers: the client gets the
    status and body :func:`proxy.upstream.error_response` made of the failure, and the
    request the outcome :func:`proxy.stages.failure_outcome` names; ``reason`` is for
    the warning."""

    extra: tuple[tuple[bytes, bytes], ...] = ()

    def __init__(self, status: int, body: bytes, outcome: Outcome, reason: str = "") -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.outcome = outcome
        self.reason = reason


async def send_error(send: Send, answer: Refused | UpstreamFailed, request_id: str) -> None:
    body = answer.body
    headers = [*JSON_HEADERS, (b"content-length", b"%d" % len(body)),
               (b"x-request-id", request_id.encode()), *answer.extra]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def cancelled(send: Send, started: bool) -> None:
    """A request the server cancelled (uvicorn, at --graceful-timeout) ends here, not
    with the cancellation: a 503 in the OpenAI shape when nothing was sent yet, else the
    client's connection dropped, the stream cut. Left to propagate, the cancellation made
    uvicorn log a traceback per request and answer one not yet begun with a plain-text
    500."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    if not started:
        with contextlib.suppress(Exception):  # the client or the server already gone
            await send_error(send, Refused(503, "the proxy is shutting down", "server_error",
                                            "proxy_shutting_down"), uuid.uuid4().hex)
    elif (connection := client_connection(send)) is not None:
        connection.abort()
