"""The async streaming client: sends planned requests and times every received chunk.

Per request it measures, client side, what the proxy measures server side and with the
same code for "what is an output-bearing event": the bytes of each received chunk go
through :class:`proxy.sse.SSEParser`, each event through
:func:`proxy.measure.inspect_event`. The clock (``time.perf_counter`` by default) is read
once per received chunk, right after it arrives, and that time stamps every event the
chunk completes.

Definitions, as in the proxy, but with the clock started just before the request is
sent (so the client's TTFT also holds connection set-up and both network legs):

* TTFT: send -> first output-bearing event received.
* ITL: every gap between consecutive output-bearing events.
* TPOT: (last - first) / (completion_tokens - 1), tokens from the upstream's usage.

Bodies are sent with ``Accept-Encoding: identity`` and read with ``aiter_raw`` so that
what is parsed is exactly what came off the socket.

Two ways to pace a run: a fixed number of workers in a closed loop (``concurrency``),
or an open loop of Poisson arrivals (``rate``, optionally capped by ``concurrency``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from proxy.dialects import CHAT, COMPLETIONS
from proxy.sse import SSEParser

from .workload import PlannedRequest

Clock = Callable[[], float]

COMPLETED = "completed"  # HTTP 200 and the stream ended with ``data: [DONE]``
HTTP_ERROR = "http_error"  # a non-200 answer
INTERRUPTED = "interrupted"  # the stream ended or broke before ``[DONE]``
STREAM_ERROR = "stream_error"  # an ``{"error": ...}`` event inside the stream
TRANSPORT_ERROR = "transport_error"  # could not connect, timed out, ...


@dataclass(frozen=True, slots=True)
class RequestResult:
    """Everything measured about one request, client side; times in seconds."""

    index: int
    profile: str
    start_s: float  # when it was sent, from the start of the run
    outcome: str
    status: int | None
    total_s: float
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    tpot_s: float | None = None
    output_events: int = 0
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    request_id: str | None = None  # the answer's ``x-request-id`` (the proxy's request log key)

    @property
    def ok(self) -> bool:
        return self.outcome == COMPLETED

    @property
    def decode_rate(self) -> float | None:
        """Output tokens per second after the first token (1 / TPOT)."""
        if self.tpot_s is None or self.tpot_s <= 0:
            return None
        return 1.0 / self.tpot_s

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["itl_s"] = list(self.itl_s)
        out["decode_rate_tok_s"] = self.decode_rate
        return out


def _usage_int(usage: dict[str, Any] | None, *keys: str) -> int | None:
    value: Any = usage
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


class _Timing:
    """Accumulates one stream's event times; knows nothing of HTTP."""

    __slots__ = ("done", "error", "first", "gaps", "last", "outputs", "usage")

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.outputs = 0
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.error: str | None = None

    def event(self, data: bytes, t: float, text_route: bool) -> None:
        if data.strip() == b"[DONE]":
            self.done = True
            return
        info = (COMPLETIONS if text_route else CHAT).classify(b"", data)
        if info.outputs:
            if self.last is None:
                self.first = t
            else:
                self.gaps.append(t - self.last)
            self.last = t
            self.outputs += 1
        if info.usage is not None:
            self.usage = dict(info.usage)
        elif not info.outputs and data.startswith(b'{"error"'):
            self.error = data[:200].decode("utf-8", "replace")


async def send(
    client: httpx.AsyncClient,
    url: str,
    planned: PlannedRequest,
    *,
    headers: dict[str, str] | None = None,
    origin: float = 0.0,
    clock: Clock = time.perf_counter,
) -> RequestResult:
    """Send one streaming request and time it; never raises for HTTP or transport errors."""
    text_route = url.rstrip("/").endswith("/completions") and not url.rstrip("/").endswith(
        "/chat/completions"
    )
    parser = SSEParser()
    timing = _Timing()
    status: int | None = None
    request_id: str | None = None
    outcome = INTERRUPTED
    error: str | None = None
    sent_headers = {"Accept-Encoding": "identity", **(headers or {})}
    t0 = clock()
    try:
        async with client.stream("POST", url, json=planned.body, headers=sent_headers) as response:
            status = response.status_code
            request_id = response.headers.get("x-request-id")
            if status != 200:
                body = await response.aread()
                outcome = HTTP_ERROR
                error = body[:300].decode("utf-8", "replace")
            else:
                async for chunk in response.aiter_raw():
                    t = clock()  # once per received chunk
                    for event in parser.feed(chunk):
                        timing.event(event.data, t, text_route)
                if timing.error is not None:
                    outcome, error = STREAM_ERROR, timing.error
                elif timing.done:
                    outcome = COMPLETED
                else:
                    error = "stream ended before data: [DONE]"
    except httpx.HTTPError as exc:
        outcome = INTERRUPTED if status == 200 else TRANSPORT_ERROR
        error = f"{type(exc).__name__}: {exc}"[:300]
    t_end = clock()
    completion = _usage_int(timing.usage, "completion_tokens")
    tpot = None
    if (
        timing.first is not None
        and timing.last is not None
        and completion is not None
        and completion >= 2
    ):
        tpot = (timing.last - timing.first) / (completion - 1)
    return RequestResult(
        index=planned.index,
        profile=planned.profile,
        start_s=t0 - origin,
        outcome=outcome,
        status=status,
        total_s=t_end - t0,
        ttft_s=None if timing.first is None else timing.first - t0,
        itl_s=tuple(timing.gaps),
        tpot_s=tpot,
        output_events=timing.outputs,
        prompt_tokens=_usage_int(timing.usage, "prompt_tokens"),
        cached_prompt_tokens=_usage_int(timing.usage, "prompt_tokens_details", "cached_tokens"),
        completion_tokens=completion,
        error=error,
        request_id=request_id,
    )


@dataclass(frozen=True, slots=True)
class RunPlan:
    """How to pace a run and when to stop."""

    url: str  # the full endpoint, e.g. http://127.0.0.1:8080/v1/chat/completions
    requests: int | None = 100  # stop after sending this many (None: no limit)
    duration: float | None = None  # stop sending after this many seconds
    concurrency: int | None = 8  # closed loop workers, or the cap with ``rate``
    rate: float | None = None  # open loop: Poisson arrivals per second
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.requests is None and self.duration is None:
            raise ValueError("give a number of requests or a duration (or both)")
        if self.rate is None and not self.concurrency:
            raise ValueError("give a concurrency or a rate")


@dataclass(frozen=True, slots=True)
class RunResult:
    results: tuple[RequestResult, ...]
    wall_s: float  # first send to last answer


def make_client(concurrency: int | None, timeout: float = 600.0) -> httpx.AsyncClient:
    """One pooled client for a run; the pool is as large as the run's concurrency."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=10.0, pool=None),
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        headers={"Accept-Encoding": "identity"},
    )


async def run(
    plan: RunPlan,
    planned: Iterable[PlannedRequest],
    *,
    arrivals: Iterable[float] | None = None,
    client: httpx.AsyncClient | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
    clock: Clock = time.perf_counter,
) -> RunResult:
    """Send ``planned`` requests paced by ``plan``; return every result in send order.

    ``arrivals`` (send offsets in seconds) is required when ``plan.rate`` is set.
    Requests already sent when the duration runs out are awaited, not cancelled.
    """
    own_client = client is None
    http = client if client is not None else make_client(plan.concurrency)
    headers = dict(plan.headers)
    source: Iterator[PlannedRequest] = iter(planned)
    results: list[RequestResult] = []
    sent = 0
    origin = clock()
    last_end = origin

    def more() -> bool:
        if plan.requests is not None and sent >= plan.requests:
            return False
        return plan.duration is None or clock() - origin < plan.duration

    async def one(item: PlannedRequest) -> None:
        nonlocal last_end
        result = await send(http, plan.url, item, headers=headers, origin=origin, clock=clock)
        last_end = max(last_end, clock())
        results.append(result)
        if on_result is not None:
            on_result(result)

    try:
        if plan.rate is None:

            async def worker() -> None:
                nonlocal sent
                while more():
                    item = next(source)
                    sent += 1
                    await one(item)

            assert plan.concurrency is not None
            await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
        else:
            if arrivals is None:
                raise ValueError("a rate needs arrival times")
            cap = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None

            async def capped(item: PlannedRequest) -> None:
                if cap is None:
                    await one(item)
                    return
                async with cap:
                    await one(item)

            tasks: list[asyncio.Task[None]] = []
            for offset in arrivals:
                if plan.duration is not None and offset >= plan.duration:
                    break
                if not more():
                    break
                delay = origin + offset - clock()
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing the workload, not waiting on a result
                sent += 1
                tasks.append(asyncio.create_task(capped(next(source))))
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
    finally:
        if own_client:
            await http.aclose()
    results.sort(key=lambda r: r.index)
    return RunResult(tuple(results), last_end - origin)
