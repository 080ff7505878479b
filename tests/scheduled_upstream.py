"""A fake OpenAI-compatible upstream with an exact, known schedule (for e2e tests).

``ScheduledUpstream(ttft=0.2, itl=0.02, tokens=10)`` is an ASGI app: a streaming chat
completion sends the role-only chunk at once, the first content token ``ttft`` seconds
after the request arrived, then one token every ``itl`` seconds, a finish chunk, the
usage chunk when asked for, and ``[DONE]``. It records every request it received and
sets ``closed`` when a client goes away before the end, so tests can wait on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

Message = MutableMapping[str, Any]


def chunk(delta: dict[str, Any] | None = None, *, finish: str | None = None,
          usage: dict[str, Any] | None = None, choices: bool = True) -> bytes:
    body: dict[str, Any] = {"id": "chatcmpl-test", "object": "chat.completion.chunk",
                            "created": 0, "model": "sched-model"}
    body["choices"] = ([{"index": 0, "delta": delta or {}, "finish_reason": finish}]
                       if choices else [])
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


@dataclass
class ScheduledUpstream:
    ttft: float = 0.1
    itl: float = 0.02
    tokens: int = 10
    prompt_tokens: int = 7
    cached_tokens: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    closed: threading.Event = field(default_factory=threading.Event)
    closed_at: list[float] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, scope: Message, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        t0 = time.perf_counter()
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        payload = json.loads(body) if body else {}
        self.requests.append({"path": scope["path"], "body": payload,
                              "headers": dict(scope["headers"])})
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                 "total_tokens": self.prompt_tokens + self.tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if not payload.get("stream"):
            await asyncio.sleep(self.ttft + self.itl * (self.tokens - 1))
            answer = {"id": "chatcmpl-test", "object": "chat.completion", "created": 0,
                      "model": "sched-model", "usage": usage,
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": "x" * self.tokens}}]}
            data = json.dumps(answer).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": data})
            return

        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"),
                                    (b"x-request-id", b"req-sched-1")]})
            await send({"type": "http.response.body", "more_body": True,
                        "body": chunk({"role": "assistant", "content": ""})})
            for i in range(self.tokens):
                due = t0 + self.ttft + i * self.itl
                delay = due - time.perf_counter()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(disconnected.wait(), delay)
                if disconnected.is_set():
                    self.closed_at.append(time.perf_counter())
                    self.closed.set()
                    return
                await send({"type": "http.response.body", "more_body": True,
                            "body": chunk({"content": f"t{i} "})})
            tail = chunk({}, finish="stop")
            options = payload.get("stream_options") or {}
            if options.get("include_usage"):
                tail += chunk(usage=usage, choices=False)
            await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})
            self.finished.set()
        finally:
            watcher.cancel()
