"""The OpenAI Responses API, ``POST /v1/responses``, streamed or not.

Design: ``docs/design/simulator.md``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from proxy.simulator.engine import (
    STREAM_ERROR_MESSAGE,
    ApiError,
    Ask,
    Engine,
    Job,
    content_text,
    dumps,
    int_param,
    named_event,
    tools_text,
)

# Request fields echoed in the response object, with the API's defaults.
_ECHOED: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": None,
    "store": True,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": 1.0,
    "truncation": "disabled",
    "user": None,
}


def render_responses_prompt(body: dict[str, Any]) -> str:
    """``instructions`` as a system message, then tools, then the server-side context the
    request names (``previous_response_id``, ``conversation``: stood in for by its id,
    as the simulator keeps no conversations), then the ``input`` items: the order of
    the proxy's prompt parts (:meth:`proxy.dialects.responses.ResponsesDialect.prompt_parts`), so
    the cache breaks where the proxy's prompt-cache doctor says the prefix broke."""
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise ApiError(400, "'input' must not be empty", param="input")
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty array", param="input")
    pieces = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        pieces.append(f"<|system|>\n{instructions}\n")
    pieces.append(tools_text(body.get("tools")))
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    for context in (body.get("previous_response_id"), conversation):
        if isinstance(context, str) and context:
            pieces.append(f"<|context|>\n{context}\n")
    for item in items:
        if not isinstance(item, dict):
            raise ApiError(400, "each input item must be an object", param="input")
        role = item.get("role")
        if isinstance(role, str):
            pieces.append(f"<|{role}|>\n{content_text(item.get('content'))}\n")
        else:  # function calls, their outputs, earlier reasoning: their JSON is the text
            pieces.append(f"<|{item.get('type', 'item')}|>\n{dumps(item).decode()}\n")
    pieces.append("<|assistant|>\n")
    return "".join(pieces)


class _Events:
    """Numbers events in order and frames them."""

    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return named_event(kind, sequence_number=self.seq - 1, **fields)

    def delta(self, template: bytes, word: bytes) -> bytes:
        out = template % (self.seq, word)
        self.seq += 1
        return out

    def opened(self, index: int, item_id: str, item: Any, part: Any) -> bytes:
        """An output item and its one content part, added."""
        at = {"item_id": item_id, "output_index": index, "content_index": 0}
        added = self("response.output_item.added", output_index=index, item=item)
        return added + self("response.content_part.added", **at, part=part)

    def closed(
        self, index: int, item_id: str, kind: str, text: str, part: Any, item: Any, **extra: Any
    ) -> bytes:
        """An item's text (``kind``: ``output_text``, ``reasoning_text``), its part and the
        item itself, done."""
        at = {"item_id": item_id, "output_index": index, "content_index": 0}
        return (
            self(f"response.{kind}.done", **at, text=text, **extra)
            + self("response.content_part.done", **at, part=part)
            + self("response.output_item.done", output_index=index, item=item)
        )


class Responses:
    route = "/v1/responses"
    id_prefix = "resp_"

    def ask(self, body: dict[str, Any], model: str) -> Ask:
        text = render_responses_prompt(body)
        max_tokens = int_param(body, "max_output_tokens", minimum=1)
        echoed = {k: body.get(k, default) for k, default in _ECHOED.items()}
        asked = body.get("reasoning")
        reasoning = isinstance(asked, dict) and asked.get("effort") != "none"
        return Ask(
            model=model,
            prompt=text,
            max_tokens=max_tokens,
            reasoning=reasoning,
            prompt_param="input",
            options=echoed,
        )

    # -- objects -----------------------------------------------------------------------

    @staticmethod
    def _ids(job: Job) -> tuple[str, str]:
        tail = job.request_id.removeprefix("resp_")
        return "rs_" + tail, "msg_" + tail

    def response(self, job: Job, status: str, output: list[Any], **extra: Any) -> dict[str, Any]:
        return {
            "id": job.request_id,
            "object": "response",
            "created_at": job.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            **job.ask.options,
            "model": job.ask.model,
            "output": output,
            "usage": None,
            **extra,
        }

    def usage(self, job: Job) -> dict[str, Any]:
        plan = job.plan
        usage: dict[str, Any] = {"input_tokens": plan.prompt_tokens}
        if plan.reported_cached_tokens is not None:
            usage["input_tokens_details"] = {
                "cached_tokens": plan.reported_cached_tokens,
                "cache_write_tokens": plan.cache_write_tokens,
            }
        usage["output_tokens"] = job.emitted
        usage["output_tokens_details"] = {"reasoning_tokens": job.reasoning_emitted}
        usage["total_tokens"] = plan.prompt_tokens + job.emitted
        return usage

    def _reasoning_item(self, job: Job, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {
            "id": self._ids(job)[0],
            "type": "reasoning",
            "summary": [],
            "content": content,
            "status": status,
        }

    def _message_item(self, job: Job, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [_output_text(text)]
        return {
            "id": self._ids(job)[1],
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _final(self, job: Job, engine: Engine) -> tuple[str, dict[str, Any]]:
        """(the status of the response and of its message, the final response)."""
        extra: dict[str, Any]
        if job.plan.finish_reason == "length":
            status, extra = "incomplete", {"incomplete_details": {"reason": "max_output_tokens"}}
        else:
            status, extra = "completed", {"completed_at": int(engine.wall_clock())}
        output = []
        if job.plan.reasoning_tokens:
            output.append(self._reasoning_item(job, "completed", "".join(job.thoughts[0])))
        output.append(self._message_item(job, status, "".join(job.texts[0])))
        return status, self.response(job, status, output, usage=self.usage(job), **extra)

    # -- the stream --------------------------------------------------------------------

    async def stream(self, job: Job, engine: Engine) -> AsyncGenerator[bytes, None]:
        event = _Events()
        rs_id, msg_id = self._ids(job)
        thinks = job.plan.reasoning_tokens > 0
        message_index = 1 if thinks else 0
        thought = (
            b'event: response.reasoning_text.delta\ndata: {"type":"response.reasoning_text.delta",'
            b'"sequence_number":%d,"item_id":"' + rs_id.encode() + b'","output_index":0,'
            b'"content_index":0,"delta":%s}\n\n'
        )
        token = (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"sequence_number":%d,"item_id":"'
            + msg_id.encode()
            + b'","output_index":'
            + str(message_index).encode()
            + b',"content_index":0,"delta":%s,"logprobs":[]}\n\n'
        )
        reasoning_open = message_open = False
        async with aclosing(engine.steps(job, min_sleep=0.0)) as steps:
            async for count in steps:
                if count == 0:
                    start = self.response(job, "in_progress", [])
                    yield event("response.created", response=start) + event(
                        "response.in_progress", response=start
                    )
                    continue
                (word,) = engine.words(job, count)
                if job.in_reasoning:
                    opening = b""
                    if not reasoning_open:
                        reasoning_open = True
                        opening = event.opened(
                            0,
                            rs_id,
                            self._reasoning_item(job, "in_progress", None),
                            {"type": "reasoning_text", "text": ""},
                        )
                    yield opening + event.delta(thought, word)
                    continue
                opening = b""
                if not message_open:
                    message_open = True
                    if reasoning_open:
                        thoughts = "".join(job.thoughts[0])
                        opening = event.closed(
                            0,
                            rs_id,
                            "reasoning_text",
                            thoughts,
                            {"type": "reasoning_text", "text": thoughts},
                            self._reasoning_item(job, "completed", thoughts),
                        )
                    opening += event.opened(
                        message_index,
                        msg_id,
                        self._message_item(job, "in_progress", None),
                        _output_text(""),
                    )
                yield opening + event.delta(token, word)
        if job.failed:
            failed = self.response(
                job,
                "failed",
                [],
                error={"code": "server_error", "message": STREAM_ERROR_MESSAGE},
            )
            yield event("response.failed", response=failed)
            return
        status, final = self._final(job, engine)
        text = "".join(job.texts[0])
        yield event.closed(
            message_index,
            msg_id,
            "output_text",
            text,
            _output_text(text),
            self._message_item(job, status, text),
            logprobs=[],
        ) + event(f"response.{status}", response=final)

    def body(self, job: Job, engine: Engine) -> dict[str, Any]:
        return self._final(job, engine)[1]


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
