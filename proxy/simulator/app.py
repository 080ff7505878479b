"""The simulator's HTTP face: an OpenAI-compatible server driven by :mod:`.model`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming and not),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /healthz``. Errors use the OpenAI
shape ``{"error": {"message", "type", "param", "code"}}``.

Streams are shaped like OpenAI's and vLLM's: response headers at once; a role-only
chunk when the request gets its decode slot (so time to first *byte* and time to first
*token* differ, as they do in production); one chunk per decode step; a chunk with an
empty delta and ``finish_reason``; the usage-only chunk (``"choices": []``) when
``stream_options.include_usage`` is set; then ``data: [DONE]``. Events end in LF
(``data: ...\\n\\n``), like OpenAI's, not in sse-starlette's default CRLF; its
keep-alive ping is off. Chunks are built from pre-encoded byte templates: the
simulator must stay cheap with hundreds of streams on a small CPU.

A simulated mid-stream drop (``--drop-rate``) raises :class:`SimulatedDrop`; a
middleware around the routes swallows it, so uvicorn closes the connection without
ending the chunked body, which is what a crashed upstream looks like to a client
(uvicorn's one error line for it is filtered out, see :func:`quiet_simulated_drops`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.simulator.model import ContextTooLong, LatencyModel, RequestPlan, SimConfig, Ticket

# Short English words, so that about four characters make a token, as estimated.
_WORDS = (
    "the of and to in is it that was for on are as with his they at be this from have "
    "or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get "
    "come made may part"
)
VOCAB: tuple[str, ...] = tuple(" " + w for w in _WORDS.split())
_VOCAB_JSON: tuple[bytes, ...] = tuple(json.dumps(w).encode() for w in VOCAB)

NON_STREAM_SLEEP_S = 0.05  # a non-streamed answer sleeps in slices of at least this much
_DONE = b"data: [DONE]\n\n"


class SimulatedDrop(Exception):
    """Raised mid-stream to make the server drop the connection (``--drop-rate``)."""


class ApiError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status)


_DROP_LOG_MESSAGE = "ASGI callable returned without completing response."


class _QuietSimulatedDrops(logging.Filter):
    """Hide uvicorn's error line for the connections the simulator drops on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _DROP_LOG_MESSAGE


def quiet_simulated_drops() -> None:
    """Install (once) the filter above on uvicorn's error logger."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietSimulatedDrops) for f in logger.filters):
        logger.addFilter(_QuietSimulatedDrops())


class _DropMiddleware:
    """Outermost layer: a simulated drop ends the ASGI call without finishing the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except SimulatedDrop:
            return
        except BaseExceptionGroup as group:
            rest = group.subgroup(lambda e: not isinstance(e, SimulatedDrop | BaseExceptionGroup))
            if rest is not None:
                raise


# ---------------------------------------------------------------------------
# Request parsing


def _int_param(
    body: dict[str, Any], name: str, *, minimum: int, maximum: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ApiError(400, f"'{name}' must be an integer >= {minimum}{upper}", param=name)
    return value


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:  # images, audio, ...: count their JSON as prompt text
                parts.append(json.dumps(part, separators=(",", ":")))
        return "".join(parts)
    if content is None:
        return ""
    return json.dumps(content, separators=(",", ":"))


def render_chat_prompt(body: dict[str, Any]) -> str:
    """The text a server would prefill: tools first, then each message in order.

    The order keeps the property the prefix cache rewards: identical leading messages
    give an identical leading text.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    pieces = []
    tools = body.get("tools")
    if tools:
        pieces.append("<|tools|>\n" + json.dumps(tools, separators=(",", ":")) + "\n")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message must be an object with a 'role'", param="messages")
        text = _content_text(message.get("content"))
        if message.get("tool_calls"):
            text += json.dumps(message["tool_calls"], separators=(",", ":"))
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


# ---------------------------------------------------------------------------
# One request in flight


@dataclass(slots=True)
class _Job:
    chat: bool
    plan: RequestPlan
    n: int
    model: str
    stream: bool
    include_usage: bool
    request_id: str
    created: int
    arrival: float
    ticket: Ticket | None = None
    first_t: float | None = None
    last_t: float | None = None
    emitted: int = 0  # tokens per choice so far
    texts: list[list[str]] = field(default_factory=list)


class _Simulator:
    """Runs requests against the latency model on the event loop's time."""

    def __init__(
        self,
        config: SimConfig,
        model: LatencyModel,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.model = model
        self.clock = clock
        self.wall_clock = wall_clock

    # -- building a job from a request body ----------------------------------------

    def job(self, body: dict[str, Any], *, chat: bool) -> _Job:
        cfg = self.config
        model_name = body.get("model", cfg.models[0])
        if not isinstance(model_name, str) or not model_name:
            raise ApiError(400, "'model' must be a non-empty string", param="model")
        if cfg.strict_models and model_name not in cfg.models:
            raise ApiError(
                404,
                f"The model `{model_name}` does not exist.",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        if chat:
            text, exact = render_chat_prompt(body), None
            max_tokens = _int_param(body, "max_completion_tokens", minimum=1)
            if max_tokens is None:
                max_tokens = _int_param(body, "max_tokens", minimum=1)
        else:
            text, exact = completion_prompt(body)
            max_tokens = _int_param(body, "max_tokens", minimum=1)
        n = _int_param(body, "n", minimum=1, maximum=128) or 1
        stream = bool(body.get("stream"))
        options = body.get("stream_options")
        include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
        try:
            plan = self.model.plan(text, max_tokens=max_tokens, prompt_tokens=exact)
        except ContextTooLong as exc:
            raise ApiError(
                400,
                str(exc),
                code="context_length_exceeded",
                param="messages" if chat else "prompt",
            ) from None
        if plan.error:
            status = cfg.error_status
            raise ApiError(
                status,
                "Simulated upstream failure (--error-rate).",
                "server_error" if status >= 500 else "invalid_request_error",
                "simulated_error",
            )
        prefix = "chatcmpl-" if chat else "cmpl-"
        return _Job(
            chat=chat,
            plan=plan,
            n=n,
            model=model_name,
            stream=stream,
            include_usage=include_usage,
            request_id=f"{prefix}{plan.rng.getrandbits(96):024x}",
            created=int(self.wall_clock()),
            arrival=self.clock(),
            texts=[[] for _ in range(n)],
        )

    # -- the request's life ---------------------------------------------------------

    async def _admit(self) -> Ticket:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake(_: Ticket) -> None:
            if not waiter.done():
                waiter.set_result(None)

        ticket = self.model.arrive(self.clock(), wake)
        if not ticket.admitted:
            try:
                await waiter
            except BaseException:
                self.model.release(ticket, self.clock())
                raise
        return ticket

    async def lifecycle(self, job: _Job, *, min_sleep: float) -> AsyncGenerator[int, None]:
        """Yield 0 once admitted, then the token count of each decode step when it is due.

        Sleeps shorter than ``min_sleep`` are deferred to the next step (never past
        the last), which keeps non-streamed requests from waking up per token.
        """
        plan, cfg, clock, model = job.plan, self.config, self.clock, self.model
        job.ticket = ticket = await self._admit()
        try:
            yield 0
            target = model.start_prefill(plan, clock())
            total, per_step = plan.output_tokens, cfg.tokens_per_chunk
            stall, drop = plan.stall_before_token, plan.drop_after_tokens
            step_s = cfg.itl
            emitted = 0
            while emitted < total:
                count = min(per_step, total - emitted)
                if stall is not None and emitted <= stall < emitted + count:
                    target += cfg.stall_seconds
                last = emitted + count >= total
                wait = target - clock()
                if wait > 0 and (wait >= min_sleep or last):
                    await asyncio.sleep(wait)
                elif wait < -step_s:
                    target = clock()  # fell behind (CPU-bound): slow down, do not burst
                if drop is not None and job.stream and emitted >= drop:
                    raise SimulatedDrop(job.request_id)
                emitted += count
                job.emitted = emitted
                now = max(clock(), target)  # a deferred sleep: the model's time, not ours
                if job.first_t is None:
                    job.first_t = now
                job.last_t = now
                yield count
                step_s = model.step_seconds(plan.rng)
                target += step_s
        finally:
            model.release(ticket, clock())

    # -- pieces of output -------------------------------------------------------------

    def words(self, job: _Job, count: int) -> list[bytes]:
        """JSON-encoded text of the next step for each choice (remembered for usage)."""
        rng = job.plan.rng
        out = []
        for texts in job.texts:
            if count == 1:
                i = rng.randrange(len(VOCAB))
                texts.append(VOCAB[i])
                out.append(_VOCAB_JSON[i])
            else:
                piece = "".join(VOCAB[rng.randrange(len(VOCAB))] for _ in range(count))
                texts.append(piece)
                out.append(json.dumps(piece).encode())
        return out

    def usage(self, job: _Job, end: float) -> dict[str, Any]:
        plan = job.plan
        completion = job.emitted * job.n
        usage: dict[str, Any] = {
            "prompt_tokens": plan.prompt_tokens,
            "total_tokens": plan.prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": plan.cached_tokens},
        }
        if self.config.vllm_metrics and job.ticket is not None:
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

    # -- streaming ----------------------------------------------------------------------

    async def stream(self, job: _Job) -> AsyncIterator[bytes]:
        dumps = json.dumps
        head = (
            b'data: {"id":'
            + dumps(job.request_id).encode()
            + (b',"object":"chat.completion.chunk"' if job.chat else b',"object":"text_completion"')
            + b',"created":'
            + str(job.created).encode()
            + b',"model":'
            + dumps(job.model).encode()
            + b',"choices":['
        )
        if job.chat:
            role = (
                head
                + b'{"index":%d,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
            )
            token = (
                head
                + b'{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":null}]}\n\n'
            )
            finish = head + b'{"index":%d,"delta":{},"logprobs":null,"finish_reason":"%s"}]}\n\n'
        else:
            role = b""
            token = head + b'{"index":%d,"text":%s,"logprobs":null,"finish_reason":null}]}\n\n'
            finish = head + b'{"index":%d,"text":"","logprobs":null,"finish_reason":"%s"}]}\n\n'
        steps = self.lifecycle(job, min_sleep=0.0)
        try:
            async for count in steps:
                if count == 0:
                    if role:
                        yield b"".join(role % i for i in range(job.n))
                    continue
                words = self.words(job, count)
                if job.n == 1:
                    yield token % (0, words[0])
                else:
                    yield b"".join(token % (i, w) for i, w in enumerate(words))
        finally:
            await steps.aclose()
        reason = job.plan.finish_reason.encode()
        yield b"".join(finish % (i, reason) for i in range(job.n))
        if job.include_usage:
            usage = dumps(self.usage(job, self.clock()), separators=(",", ":")).encode()
            yield head + b'],"usage":' + usage + b"}\n\n"
        yield _DONE

    # -- not streaming ------------------------------------------------------------------

    async def complete(self, job: _Job, request: Request) -> dict[str, Any] | None:
        """Run to the end (None if the client went away first, which frees the slot)."""
        finished = False
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            steps = self.lifecycle(job, min_sleep=NON_STREAM_SLEEP_S)
            try:
                async for count in steps:
                    if count:
                        self.words(job, count)
            finally:
                await steps.aclose()
            finished = True
            tg.cancel_scope.cancel()
        if not finished:
            return None
        usage = self.usage(job, self.clock())
        reason = job.plan.finish_reason
        if job.chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "".join(t)},
                    "logprobs": None,
                    "finish_reason": reason,
                }
                for i, t in enumerate(job.texts)
            ]
            obj = "chat.completion"
        else:
            choices = [
                {"index": i, "text": "".join(t), "logprobs": None, "finish_reason": reason}
                for i, t in enumerate(job.texts)
            ]
            obj = "text_completion"
        return {
            "id": job.request_id,
            "object": obj,
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "usage": usage,
        }


# ---------------------------------------------------------------------------
# The app


def create_simulator_app(
    config: SimConfig,
    *,
    model: LatencyModel | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
) -> FastAPI:
    """Build the simulator. ``model`` and ``clock`` are seams for tests.

    ``app.state.model`` is the live :class:`LatencyModel` (tests read its queue).
    """
    model = model if model is not None else LatencyModel(config)
    sim = _Simulator(config, model, clock, wall_clock)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # sse-starlette ends every stream once its process-wide AppStatus.should_exit is
        # set, and nothing resets it (sse-starlette#211): a server that starts is not
        # shutting down, whatever an earlier server in this process did.
        AppStatus.should_exit = False
        yield

    app = FastAPI(
        lifespan=lifespan,
        title="llm-latency-proxy simulator",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.model = model
    app.state.config = config
    if config.drop_rate > 0:
        quiet_simulated_drops()

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        messages = {404: "Not found: no such route.", 405: "Method not allowed on this route."}
        types = {404: "invalid_request_error", 405: "invalid_request_error"}
        error = ApiError(
            exc.status_code,
            messages.get(exc.status_code, str(exc.detail)),
            types.get(exc.status_code, "server_error"),
            {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code),
        )
        response = error.response()
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    def check_key(request: Request) -> None:
        if not config.api_key:
            return
        if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "We could not parse the JSON body of your request.") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        return body

    async def generate(request: Request, *, chat: bool) -> Response:
        check_key(request)
        job = sim.job(await read_body(request), chat=chat)
        if job.stream:
            return EventSourceResponse(sim.stream(job), ping=0, sep="\n")
        result = await sim.complete(job, request)
        if result is None:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(result)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "llm-latency-proxy-simulator",
            "max_model_len": config.max_model_len,
        }

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        check_key(request)
        return {"object": "list", "data": [model_card(m) for m in config.models]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> dict[str, Any]:
        check_key(request)
        if name not in config.models:
            raise ApiError(
                404, f"The model `{name}` does not exist.", code="model_not_found", param="model"
            )
        return model_card(name)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "active": model.active,
            "queued": model.queued,
            "requests": model.requests,
        }

    app.add_middleware(_DropMiddleware)
    return app
