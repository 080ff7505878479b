"""One request's life on the event loop, shared by every API the simulator speaks.

Design: ``docs/design/simulator.md``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from starlette.requests import Request

from proxy import dialects
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
STREAM_ERROR_MESSAGE = "Simulated upstream failure during the stream (--stream-error-rate)."

Sleep = Callable[[float], Awaitable[None]]


class SimulatedDrop(Exception):
    """Raised mid-stream to make the server drop the connection (``--drop-rate``)."""


# Anthropic's error ``type`` for an HTTP status; any other is ``api_error`` from 500 on,
# ``invalid_request_error`` below.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


class ApiError(Exception):
    """An error answered before any byte of the body, in the shape of the route's API."""

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

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        default = "api_error" if self.status >= 500 else "invalid_request_error"
        kind = _ANTHROPIC_TYPES.get(self.status, default)
        return {"type": "error", "error": {"type": kind, "message": self.message}}


# -- request parsing and framing shared by the dialects --------------------------------


def dumps(obj: Any) -> bytes:
    """Compact JSON, as the APIs send it."""
    return json.dumps(obj, separators=(",", ":")).encode()


def named_event(kind: str, **fields: Any) -> bytes:
    """An SSE event named ``kind`` whose JSON starts with ``"type": kind`` (Responses,
    Messages)."""
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **fields}) + b"\n\n"


def int_param(
    body: Mapping[str, Any], name: str, *, minimum: int, maximum: int | None = None
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


def _without_cache_control(value: Any) -> Any:
    """Anthropic's ``cache_control`` marks a breakpoint; it is not prompt text, and an app
    moves it between turns without changing the prompt."""
    if isinstance(value, dict) and "cache_control" in value:
        return {k: v for k, v in value.items() if k != "cache_control"}
    return value


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or the text of each part in order."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:  # images, audio, tool results, ...: count their JSON as prompt text
                parts.append(dumps(_without_cache_control(part)).decode())
        return "".join(parts)
    if content is None:
        return ""
    return dumps(content).decode()


def tools_text(tools: Any) -> str:
    """Tool definitions come first in the prompt (so a fixed tool set is a cached prefix)."""
    if not tools:
        return ""
    if isinstance(tools, list):
        tools = [_without_cache_control(tool) for tool in tools]
    return "<|tools|>\n" + dumps(tools).decode() + "\n"


def cache_scope(body: Mapping[str, Any], model: str) -> str:
    """What keeps two prompts apart in the prefix cache: the model, and the request's
    ``prompt_cache_key`` (OpenAI) or ``cache_salt`` (vLLM), read as the proxy's
    prompt-cache doctor reads them (:func:`proxy.dialects.cache_scope`)."""
    return model + "\x00" + dialects.cache_scope(body)[1]


def model_name(body: Mapping[str, Any], config: SimConfig) -> str:
    name = body.get("model", config.models[0])
    if not isinstance(name, str) or not name:
        raise ApiError(400, "'model' must be a non-empty string", param="model")
    if config.strict_models and name not in config.models:
        message = f"The model `{name}` does not exist."
        raise ApiError(404, message, code="model_not_found", param="model")
    return name


# -- a request in flight ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    """A request in API-neutral terms: what the latency model and the words need."""

    model: str
    prompt: str  # the text a server would prefill, messages rendered in order
    prompt_tokens: int | None = None  # exact when the prompt came as token ids
    max_tokens: int | None = None  # covers reasoning and answer, as in the real APIs
    n: int = 1
    reasoning: bool = False
    prompt_param: str = "messages"  # named by a context-length error
    options: Mapping[str, Any] = field(default_factory=dict)  # the dialect's own fields


@dataclass(slots=True, eq=False)
class Job:
    """One admitted-or-waiting request: its plan, and what it has produced so far."""

    ask: Ask
    plan: RequestPlan
    request_id: str
    created: int  # wall-clock seconds, for the API's ``created`` fields
    arrival: float
    stream: bool = False
    ticket: Ticket | None = None
    first_t: float | None = None
    last_t: float | None = None
    emitted: int = 0  # tokens per choice so far, reasoning included
    failed: bool = False  # ended early by a simulated stream error
    texts: list[list[str]] = field(default_factory=list)  # answer pieces per choice
    thoughts: list[list[str]] = field(default_factory=list)  # reasoning pieces per choice

    @property
    def in_reasoning(self) -> bool:
        """Whether the step just produced was a reasoning step."""
        return 0 < self.emitted <= self.plan.reasoning_tokens

    @property
    def reasoning_emitted(self) -> int:
        return min(self.emitted, self.plan.reasoning_tokens)


class Engine:
    """Runs requests against the latency model on the event loop's time."""

    def __init__(
        self,
        config: SimConfig,
        model: LatencyModel,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.config = config
        self.model = model
        self.clock = clock
        self.wall_clock = wall_clock
        self.sleep = sleep

    def job(self, body: dict[str, Any], dialect: Dialect) -> Job:
        """Read and plan the request; raises :class:`ApiError` for a bad field, a context
        overflow or an injected error (``--error-rate``)."""
        cfg = self.config
        model = model_name(body, cfg)
        ask = dialect.ask(body, model)
        try:
            plan = self.model.plan(
                ask.prompt,
                max_tokens=ask.max_tokens,
                prompt_tokens=ask.prompt_tokens,
                reasoning=ask.reasoning,
                cache_scope=cache_scope(body, model),
            )
        except ContextTooLong as exc:
            raise ApiError(
                400, str(exc), code="context_length_exceeded", param=ask.prompt_param
            ) from None
        if plan.error:
            status = cfg.error_status
            raise ApiError(
                status,
                "Simulated upstream failure (--error-rate).",
                "server_error" if status >= 500 else "invalid_request_error",
                "simulated_error",
            )
        return Job(
            ask=ask,
            plan=plan,
            request_id=f"{dialect.id_prefix}{plan.rng.getrandbits(96):024x}",
            created=int(self.wall_clock()),
            arrival=self.clock(),
            stream=bool(body.get("stream")),
            texts=[[] for _ in range(ask.n)],
            thoughts=[[] for _ in range(ask.n)],
        )

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

    async def steps(self, job: Job, *, min_sleep: float) -> AsyncGenerator[int, None]:
        """Yield 0 once admitted, then the token count of each decode step when it is due.

        Sleeps shorter than ``min_sleep`` are deferred to the next step (never past
        the last), which keeps non-streamed requests from waking up per token. A
        simulated stream error ends the steps early with ``job.failed`` set.
        """
        plan, cfg, clock, model, sleep = job.plan, self.config, self.clock, self.model, self.sleep
        job.ticket = ticket = await self._admit()
        try:
            yield 0
            target = model.start_prefill(plan, clock())
            total, per_step = plan.output_tokens, cfg.tokens_per_chunk
            reasoning = plan.reasoning_tokens
            stall, drop = plan.stall_before_token, plan.drop_after_tokens
            fail = plan.error_after_tokens if job.stream else None
            step_s = cfg.itl
            emitted = 0
            while emitted < total:
                phase_end = reasoning if emitted < reasoning else total
                count = min(per_step, phase_end - emitted)
                if stall is not None and emitted <= stall < emitted + count:
                    target += cfg.stall_seconds
                last = emitted + count >= total
                wait = target - clock()
                if wait > 0 and (wait >= min_sleep or last):
                    await sleep(wait)
                elif wait < -step_s:
                    target = clock()  # fell behind (CPU-bound): slow down, do not burst
                if drop is not None and job.stream and emitted >= drop:
                    raise SimulatedDrop(job.request_id)
                if fail is not None and emitted >= fail:
                    job.failed = True
                    return
                emitted += count
                job.emitted = emitted
                now = max(clock(), target)  # a deferred sleep: the model's time, not ours
                if job.first_t is None:
                    job.first_t = now
                    model.prefilled(plan)  # its blocks count for later arrivals from now
                job.last_t = now
                yield count
                step_s = model.step_seconds(plan.rng)
                target += step_s
        finally:
            model.release(ticket, clock())

    def words(self, job: Job, count: int) -> list[bytes]:
        """JSON-encoded text of the step just produced, per choice (remembered for the
        final texts and usage), as reasoning or answer by the step's phase."""
        rng = job.plan.rng
        out = []
        pieces = job.thoughts if job.in_reasoning else job.texts
        for texts in pieces:
            if count == 1:
                i = rng.randrange(len(VOCAB))
                texts.append(VOCAB[i])
                out.append(_VOCAB_JSON[i])
            else:
                piece = "".join(VOCAB[rng.randrange(len(VOCAB))] for _ in range(count))
                texts.append(piece)
                out.append(json.dumps(piece).encode())
        return out

    async def complete(self, job: Job, request: Request) -> bool:
        """Run a non-streamed request to its end (False if the client went away first,
        which frees the slot)."""
        finished = False
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            async with aclosing(self.steps(job, min_sleep=NON_STREAM_SLEEP_S)) as steps:
                async for count in steps:
                    if count:
                        self.words(job, count)
            finished = True
            tg.cancel_scope.cancel()
        return finished


class Dialect(Protocol):
    """One API's face: its request fields in, its bytes and bodies out."""

    route: str
    id_prefix: str

    def ask(self, body: dict[str, Any], model: str) -> Ask: ...

    def stream(self, job: Job, engine: Engine) -> AsyncGenerator[bytes, None]: ...

    def body(self, job: Job, engine: Engine) -> dict[str, Any]: ...
