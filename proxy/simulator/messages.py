"""The Anthropic Messages API, ``POST /v1/messages``, streamed or not.

Design: ``docs/design/simulator.md``.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from proxy.simulator.engine import ApiError, Ask, Engine, Job, content_text, int_param, tools_text
from proxy.simulator.engine import named_event as _event

_PING = b'event: ping\ndata: {"type":"ping"}\n\n'
_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
_OVERLOADED = (
    b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
    b'"message":"Overloaded"}}\n\n'
)


def render_messages_prompt(body: dict[str, Any]) -> str:
    """Tools, then ``system``, then the messages in order."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: must be a non-empty array", param="messages")
    pieces = [tools_text(body.get("tools"))]
    system = body.get("system")
    if system:
        pieces.append(f"<|system|>\n{content_text(system)}\n")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "messages: each must be an object with a 'role'", param="messages")
        pieces.append(f"<|{message['role']}|>\n{content_text(message.get('content'))}\n")
    pieces.append("<|assistant|>\n")
    return "".join(pieces)


class Messages:
    route = "/v1/messages"
    id_prefix = "msg_01"

    def ask(self, body: dict[str, Any], model: str) -> Ask:
        text = render_messages_prompt(body)
        if body.get("max_tokens") is None:
            raise ApiError(400, "max_tokens: Field required", param="max_tokens")
        max_tokens = int_param(body, "max_tokens", minimum=1)
        thinking = body.get("thinking")
        reasoning = isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")
        return Ask(model, text, max_tokens=max_tokens, reasoning=reasoning)

    # -- objects -----------------------------------------------------------------------

    @staticmethod
    def _signature(job: Job) -> str:
        # Opaque to clients, like Anthropic's; derived from the id, so no extra randomness.
        return base64.b64encode(("sim:" + job.request_id).encode() * 2).decode()

    def usage(self, job: Job, output_tokens: int) -> dict[str, Any]:
        plan = job.plan
        read, written = plan.reported_cached_tokens, plan.cache_write_tokens
        if read is None:  # an upstream that reports no cache: every prompt token is input
            return {
                "input_tokens": plan.prompt_tokens,
                "output_tokens": output_tokens,
                "service_tier": "standard",
            }
        return {
            "input_tokens": plan.prompt_tokens - read - written,
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": written,
                "ephemeral_1h_input_tokens": 0,
            },
            "output_tokens": output_tokens,
            "service_tier": "standard",
        }

    def _final_usage(self, job: Job) -> dict[str, Any]:
        usage = self.usage(job, job.emitted)
        if job.plan.reasoning_tokens:
            usage["output_tokens_details"] = {"thinking_tokens": job.reasoning_emitted}
        return usage

    def _stop_reason(self, job: Job) -> str:
        return "max_tokens" if job.plan.finish_reason == "length" else "end_turn"

    def message(self, job: Job, content: list[Any], stop: str | None, usage: Any) -> dict[str, Any]:
        return {
            "id": job.request_id,
            "type": "message",
            "role": "assistant",
            "model": job.ask.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }

    # -- the stream --------------------------------------------------------------------

    async def stream(self, job: Job, engine: Engine) -> AsyncGenerator[bytes, None]:
        thinks = job.plan.reasoning_tokens > 0
        text_index = 1 if thinks else 0
        thought = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"thinking_delta","thinking":%s}}\n\n'
        )
        token = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
            + str(text_index).encode()
            + b',"delta":{"type":"text_delta","text":%s}}\n\n'
        )
        text_open = not thinks
        async with aclosing(engine.steps(job, min_sleep=0.0)) as steps:
            async for count in steps:
                if count == 0:
                    first = (
                        {"type": "thinking", "thinking": "", "signature": ""}
                        if thinks
                        else {"type": "text", "text": ""}
                    )
                    start = self.message(job, [], None, self.usage(job, 1))
                    yield (
                        _event("message_start", message=start)
                        + _event("content_block_start", index=0, content_block=first)
                        + _PING
                    )
                    continue
                (word,) = engine.words(job, count)
                if job.in_reasoning:
                    yield thought % word
                    continue
                opening = b""
                if not text_open:
                    text_open = True
                    opening = (
                        _event(
                            "content_block_delta",
                            index=0,
                            delta={"type": "signature_delta", "signature": self._signature(job)},
                        )
                        + _event("content_block_stop", index=0)
                        + _event(
                            "content_block_start",
                            index=text_index,
                            content_block={"type": "text", "text": ""},
                        )
                    )
                yield opening + token % word
        if job.failed:
            yield _OVERLOADED
            return
        usage = self._final_usage(job)
        usage.pop("cache_creation", None)
        usage.pop("service_tier")
        yield (
            _event("content_block_stop", index=text_index)
            + _event(
                "message_delta",
                delta={"stop_reason": self._stop_reason(job), "stop_sequence": None},
                usage=usage,
            )
            + _STOP
        )

    def body(self, job: Job, engine: Engine) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if job.plan.reasoning_tokens:
            content.append(
                {
                    "type": "thinking",
                    "thinking": "".join(job.thoughts[0]),
                    "signature": self._signature(job),
                }
            )
        content.append({"type": "text", "text": "".join(job.texts[0])})
        return self.message(job, content, self._stop_reason(job), self._final_usage(job))
