"""OpenAI chat completions and legacy completions, shaped like OpenAI's and vLLM's.

Design: ``docs/design/simulator.md``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace
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
    tools_text,
)

DONE = b"data: [DONE]\n\n"
_ERROR_EVENT = (
    b"data: "
    + dumps(ApiError(500, STREAM_ERROR_MESSAGE, "server_error", "simulated_error").openai_body())
    + b"\n\n"
)


def render_chat_prompt(body: dict[str, Any]) -> str:
    """The text a server would prefill: tools first (and the legacy ``functions``), then
    each message in order: the order of the proxy's prompt parts
    (:meth:`proxy.dialects.chat.ChatDialect.prompt_parts`), so the cache breaks where the
    proxy's prompt-cache doctor says the prefix broke.

    The order keeps the property the prefix cache rewards: identical leading messages
    give an identical leading text.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    pieces = [tools_text(body.get("tools")), tools_text(body.get("functions"))]
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message must be an object with a 'role'", param="messages")
        text = content_text(message.get("content"))
        if message.get("tool_calls"):
            text += dumps(message["tool_calls"]).decode()
        pieces.append(f"<|{message['role']}|>\n{text}\n")
    pieces.append("<|assistant|>\n")
    return "".join(pieces)


def completion_prompt(body: dict[str, Any]) -> tuple[str, int | None]:
    """(text, exact token count if the prompt was sent as token ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", param="prompt")
        return prompt, None
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return " ".join(map(str, prompt)), len(prompt)
    raise ApiError(
        400,
        "'prompt' must be a string, a list of one string or a list of token ids "
        "(batched prompts are not simulated)",
        param="prompt",
    )


class _OpenAIStream:
    """What chat completions and completions share: usage, the stream, the body."""

    route = ""
    id_prefix = ""
    chat = True

    def usage(self, job: Job, engine: Engine, end: float) -> dict[str, Any]:
        plan = job.plan
        completion = job.emitted * job.ask.n
        usage: dict[str, Any] = {
            "prompt_tokens": plan.prompt_tokens,
            "total_tokens": plan.prompt_tokens + completion,
            "completion_tokens": completion,
        }
        if plan.reported_cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": plan.reported_cached_tokens}
        if plan.reasoning_tokens:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": job.reasoning_emitted * job.ask.n
            }
        if engine.config.vllm_metrics and job.ticket is not None:
            admitted = job.ticket.admitted_at if job.ticket.admitted_at is not None else job.arrival
            first = job.first_t if job.first_t is not None else end
            last = job.last_t if job.last_t is not None else end

            def ms(seconds: float) -> float:
                return round(max(0.0, seconds) * 1000.0, 3)

            usage["metrics"] = {
                "queue_time_ms": ms(admitted - job.ticket.arrival),
                "prefill_time_ms": ms(first - admitted),
                "time_to_first_token_ms": ms(first - job.arrival),
                "decode_time_ms": ms(last - first),
                "e2e_time_ms": ms(end - job.arrival),
            }
        return usage

    def timings(self, job: Job, engine: Engine, end: float) -> dict[str, Any]:
        """llama.cpp's server's ``timings`` (tools/server/server-task.cpp,
        ``result_timings::to_json``): the reused prompt tokens, the computed ones and
        the time they took, then the output's."""
        plan = job.plan
        computed = plan.prompt_tokens - plan.cached_tokens
        prompt_ms = plan.prefill_compute_s * 1000.0
        first = job.first_t if job.first_t is not None else end
        last = job.last_t if job.last_t is not None else end
        predicted = job.emitted
        predicted_ms = max(0.0, last - first) * 1000.0
        return {
            "cache_n": plan.cached_tokens,
            "prompt_n": computed,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": round(prompt_ms / computed, 6) if computed else None,
            "prompt_per_second": round(1000.0 * computed / prompt_ms, 3) if prompt_ms else None,
            "predicted_n": predicted,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(predicted_ms / predicted, 6) if predicted else None,
            "predicted_per_second": (
                round(1000.0 * predicted / predicted_ms, 3) if predicted_ms else None
            ),
        }

    async def stream(self, job: Job, engine: Engine) -> AsyncGenerator[bytes, None]:
        n = job.ask.n
        head = (
            b'data: {"id":'
            + dumps(job.request_id)
            + (
                b',"object":"chat.completion.chunk"'
                if self.chat
                else b',"object":"text_completion"'
            )
            + b',"created":'
            + str(job.created).encode()
            + b',"model":'
            + dumps(job.ask.model)
            + b',"choices":['
        )
        choice = head + b'{"index":%d,'
        unfinished = b',"logprobs":null,"finish_reason":null}]}\n\n'
        if self.chat:
            role = choice + b'"delta":{"role":"assistant","content":""}' + unfinished
            token = choice + b'"delta":{"content":%s}' + unfinished
            thought = choice + b'"delta":{"reasoning_content":%s}' + unfinished
            finish = choice + b'"delta":{},"logprobs":null,"finish_reason":"%s"}]}\n\n'
        else:
            role = b""
            token = thought = choice + b'"text":%s' + unfinished
            finish = choice + b'"text":"","logprobs":null,"finish_reason":"%s"}]}\n\n'
        async with aclosing(engine.steps(job, min_sleep=0.0)) as steps:
            async for count in steps:
                if count == 0:
                    if role:
                        yield b"".join(role % i for i in range(n))
                    continue
                words = engine.words(job, count)
                template = thought if job.in_reasoning else token
                if n == 1:
                    yield template % (0, words[0])
                else:
                    yield b"".join(template % (i, w) for i, w in enumerate(words))
        if job.failed:
            yield _ERROR_EVENT + DONE
            return
        reason = job.plan.finish_reason.encode()
        # llama.cpp puts its timings on the last chunk: the usage chunk when asked for
        timings = b""
        if engine.config.llamacpp_timings:
            timings = b',"timings":' + dumps(self.timings(job, engine, engine.clock()))
        usage_chunk = bool(job.ask.options.get("include_usage"))
        last = finish % (n - 1, reason)
        if timings and not usage_chunk:
            last = last[: -len(b"}\n\n")] + timings + b"}\n\n"
        yield b"".join(finish % (i, reason) for i in range(n - 1)) + last
        if usage_chunk:
            usage = dumps(self.usage(job, engine, engine.clock()))
            yield head + b'],"usage":' + usage + timings + b"}\n\n"
        yield DONE

    def body(self, job: Job, engine: Engine) -> dict[str, Any]:
        usage = self.usage(job, engine, engine.clock())
        reason = job.plan.finish_reason
        choices: list[dict[str, Any]]
        if self.chat:
            choices = []
            for i, (texts, thoughts) in enumerate(zip(job.texts, job.thoughts, strict=True)):
                message = {"role": "assistant", "content": "".join(texts)}
                if thoughts:
                    message["reasoning_content"] = "".join(thoughts)
                choices.append(
                    {"index": i, "message": message, "logprobs": None, "finish_reason": reason}
                )
            obj = "chat.completion"
        else:
            choices = [
                {"index": i, "text": "".join(t), "logprobs": None, "finish_reason": reason}
                for i, t in enumerate(job.texts)
            ]
            obj = "text_completion"
        out = {
            "id": job.request_id,
            "object": obj,
            "created": job.created,
            "model": job.ask.model,
            "choices": choices,
            "usage": usage,
        }
        if engine.config.llamacpp_timings:
            out["timings"] = self.timings(job, engine, engine.clock())
        return out


class ChatCompletions(_OpenAIStream):
    route = "/v1/chat/completions"
    id_prefix = "chatcmpl-"
    chat = True

    def ask(self, body: dict[str, Any], model: str) -> Ask:
        text = render_chat_prompt(body)
        max_tokens = int_param(body, "max_completion_tokens", minimum=1)
        if max_tokens is None:
            max_tokens = int_param(body, "max_tokens", minimum=1)
        effort = body.get("reasoning_effort")
        ask = Ask(model, text, max_tokens=max_tokens, reasoning=effort not in (None, "none"))
        return _streamed(body, ask)


class Completions(_OpenAIStream):
    """``POST /v1/completions`` (legacy; no reasoning parameter exists for it)."""

    route = "/v1/completions"
    id_prefix = "cmpl-"
    chat = False

    def ask(self, body: dict[str, Any], model: str) -> Ask:
        text, exact = completion_prompt(body)
        max_tokens = int_param(body, "max_tokens", minimum=1)
        ask = Ask(model, text, prompt_tokens=exact, max_tokens=max_tokens, prompt_param="prompt")
        return _streamed(body, ask)


def _streamed(body: dict[str, Any], ask: Ask) -> Ask:
    """What chat and completions requests share: ``n`` and the stream's options."""
    n = int_param(body, "n", minimum=1, maximum=128) or 1
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    return replace(ask, n=n, options={"include_usage": include_usage})
