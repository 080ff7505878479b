"""The simulator's HTTP face: the OpenAI and Anthropic APIs over :mod:`.engine`.

Design: ``docs/design/simulator.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.logs import quiet_unfinished_responses
from proxy.simulator.chat import ChatCompletions, Completions
from proxy.simulator.engine import VOCAB, ApiError, Dialect, Engine, SimulatedDrop, Sleep
from proxy.simulator.messages import Messages
from proxy.simulator.model import LatencyModel, SimConfig
from proxy.simulator.responses import Responses

__all__ = ["VOCAB", "ApiError", "SimulatedDrop", "create_simulator_app"]


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


# -- the app ---------------------------------------------------------------------------


def create_simulator_app(
    config: SimConfig,
    *,
    model: LatencyModel | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    sleep: Sleep = asyncio.sleep,
) -> FastAPI:
    """Build the simulator. ``model``, ``clock`` and ``sleep`` are seams for tests (a
    clock that ``sleep`` moves forward runs a stream's schedule in virtual time).

    ``app.state.model`` is the live :class:`LatencyModel` (tests read its queue).
    """
    model = model if model is not None else LatencyModel(config)
    engine = Engine(config, model, clock, wall_clock, sleep)

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
        quiet_unfinished_responses()  # its drops are on purpose

    @app.exception_handler(ApiError)
    async def error_response(request: Request, error: ApiError) -> Response:
        anthropic = request.url.path.startswith(Messages.route)
        body = error.anthropic_body() if anthropic else error.openai_body()
        return JSONResponse(body, status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        known = {
            404: ("Not found: no such route.", "not_found"),
            405: ("Method not allowed on this route.", "method_not_allowed"),
        }
        message, code = known.get(exc.status_code, (str(exc.detail), None))
        kind = "server_error" if code is None else "invalid_request_error"
        error = ApiError(exc.status_code, message, kind, code)
        response = await error_response(request, error)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    def check_key(request: Request) -> None:
        if not config.api_key:
            return
        headers = request.headers
        if (
            headers.get("authorization", "") != f"Bearer {config.api_key}"
            and headers.get("x-api-key", "") != config.api_key
        ):
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

    async def generate(request: Request, dialect: Dialect) -> Response:
        check_key(request)
        job = engine.job(await read_body(request), dialect)
        if job.stream:
            return EventSourceResponse(dialect.stream(job, engine), ping=0, sep="\n")
        if not await engine.complete(job, request):
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(dialect.body(job, engine))

    def route(dialect: Dialect) -> None:
        async def endpoint(request: Request) -> Response:
            return await generate(request, dialect)

        app.add_api_route(dialect.route, endpoint, methods=["POST"], name=dialect.route)

    for dialect in (ChatCompletions(), Completions(), Responses(), Messages()):
        route(dialect)

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
