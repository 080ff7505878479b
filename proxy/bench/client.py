"""The async streaming client: sends planned requests and times every received event.

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import httpx

from proxy.dialects.messages import MESSAGES_OUTPUT
from proxy.dialects.responses import RESPONSES_OUTPUT
from proxy.sse import BOM

from .workload import PlannedRequest

Clock = Callable[[], float]

COMPLETED = "completed"  # HTTP 200 and the stream ended the way its API ends an answer
HTTP_ERROR = "http_error"  # a non-200 answer
INTERRUPTED = "interrupted"  # the stream ended or broke before its end event
STREAM_ERROR = "stream_error"  # an error event inside the stream
TRANSPORT_ERROR = "transport_error"  # could not connect, timed out, ...

_ENDINGS = {
    "chat": "data: [DONE]",
    "completions": "data: [DONE]",
    "responses": "response.completed",
    "messages": "message_stop",
}


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
    api: str = "chat"
    ttfb_s: float | None = None
    first_answer_s: float | None = None
    reasoning_tokens: int | None = None

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


# -- reading a stream: SSE framing, then what each API's events mean -------------------

_LINE_END = re.compile(rb"\r\n|\r|\n")


class EventStream:
    """Incremental Server-Sent Events parser: bytes in, ``(event, data)`` pairs out.

    Only what the SSE specification needs for these APIs: lines end in CRLF, LF or CR
    (a CR at the end of one chunk and an LF at the start of the next are one line
    end); ``event:`` names the event, ``data:`` lines are joined with LF, a line
    starting with ``:`` is a comment, a blank line dispatches. An event without
    ``event:`` is named ``message``. One byte order mark opening the stream is ignored.
    """

    __slots__ = ("_data", "_event", "_first", "_skip_lf", "_tail")

    def __init__(self) -> None:
        self._first = True  # no line ended yet: the first may open with a BOM
        self._tail = b""
        self._event = b""
        self._data: list[bytes] = []
        self._skip_lf = False

    def feed(self, chunk: bytes) -> list[tuple[str, bytes]]:
        if not chunk:
            return []
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        buf = self._tail + chunk
        self._skip_lf = buf[-1:] == b"\r"
        lines = _LINE_END.split(buf)
        self._tail = lines.pop()
        if self._first and lines:
            self._first = False
            lines[0] = lines[0].removeprefix(BOM)
        out: list[tuple[str, bytes]] = []
        for line in lines:
            if not line:
                if self._data:
                    kind = (self._event or b"message").decode("utf-8", "replace")
                    out.append((kind, b"\n".join(self._data)))
                self._event, self._data = b"", []
            elif line[:1] != b":":
                field, _, value = line.partition(b":")
                if value[:1] == b" ":
                    value = value[1:]
                if field == b"data":
                    self._data.append(value)
                elif field == b"event":
                    self._event = value
        return out


REASONING = "reasoning"
ANSWER = "answer"


class Reading(NamedTuple):
    """What one event says, as far as timing and counting care."""

    output: str | None = None  # REASONING, ANSWER or None
    usage: dict[str, int] | None = None  # prompt, cached, completion, reasoning (those given)
    done: bool = False
    error: str | None = None


NOTHING = Reading()


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _dig(obj: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _usage(**counts: Any) -> dict[str, int] | None:
    out = {k: v for k, value in counts.items() if (v := _int(value)) is not None}
    return out or None


def _openai_usage(usage: Any, prompt: str, completion: str) -> dict[str, int] | None:
    """OpenAI's usage (chat: ``prompt_tokens``; Responses: ``input_tokens``), its cached and
    reasoning counts under ``<prompt>_details`` and ``<completion>_details``."""
    if not isinstance(usage, dict):
        return None
    return _usage(
        prompt=usage.get(prompt),
        cached=_dig(usage, f"{prompt}_details", "cached_tokens"),
        completion=usage.get(completion),
        reasoning=_dig(usage, f"{completion}_details", "reasoning_tokens"),
    )


def _nonempty(value: Any) -> bool:
    return bool(value) and (isinstance(value, str | list | dict))


def _error_text(data: bytes) -> str:
    return data[:200].decode("utf-8", "replace")


def _chat(obj: dict[str, Any], data: bytes, text_api: bool) -> Reading:
    if obj.get("error"):
        return Reading(error=_error_text(data))
    output = None
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        if text_api:
            if _nonempty(choice.get("text")):
                output = ANSWER
            continue
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        if any(
            _nonempty(delta.get(k)) for k in ("content", "refusal", "tool_calls", "function_call")
        ):
            output = ANSWER
        elif output is None and any(
            _nonempty(delta.get(k)) for k in ("reasoning_content", "reasoning")
        ):
            output = REASONING
    return Reading(output, _openai_usage(obj.get("usage"), "prompt_tokens", "completion_tokens"))


# The output-bearing events are the proxy's own (its dialects'): one definition, so that
# bench and the proxy count the same events as tokens.
_RESPONSES_OUTPUT = {
    name: ANSWER if info.answer else REASONING for name, info in RESPONSES_OUTPUT.items()
}


def _responses(obj: dict[str, Any], data: bytes) -> Reading:
    kind = obj.get("type")
    if kind in _RESPONSES_OUTPUT:
        return Reading(_RESPONSES_OUTPUT[kind]) if _nonempty(obj.get("delta")) else NOTHING
    if kind in ("response.completed", "response.incomplete"):
        usage = _dig(obj, "response", "usage")
        return Reading(usage=_openai_usage(usage, "input_tokens", "output_tokens"), done=True)
    if kind in ("error", "response.failed"):
        return Reading(error=_error_text(data))
    return NOTHING


_MESSAGES_OUTPUT = {
    kind: (key, ANSWER if info.answer else REASONING)
    for kind, (key, info) in MESSAGES_OUTPUT.items()
}


def _messages(obj: dict[str, Any], data: bytes) -> Reading:
    kind = obj.get("type")
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict) and delta.get("type") in _MESSAGES_OUTPUT:
            key, output = _MESSAGES_OUTPUT[delta["type"]]
            return Reading(output) if _nonempty(delta.get(key)) else NOTHING
        return NOTHING
    if kind in ("message_start", "message_delta"):
        usage = _dig(obj, "message", "usage") if kind == "message_start" else obj.get("usage")
        if not isinstance(usage, dict):
            return NOTHING
        # Anthropic's input_tokens excludes cache reads and writes: the prompt is the sum.
        parts = [
            _int(usage.get(k))
            for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        ]
        prompt = sum(p for p in parts if p is not None) if parts[0] is not None else None
        return Reading(
            usage=_usage(
                prompt=prompt,
                cached=usage.get("cache_read_input_tokens"),
                completion=usage.get("output_tokens") if kind == "message_delta" else None,
                reasoning=_dig(usage, "output_tokens_details", "thinking_tokens"),
            )
        )
    if kind == "message_stop":
        return Reading(done=True)
    if kind == "error":
        return Reading(error=_error_text(data))
    return NOTHING


def classify(api: str, event: str, data: bytes) -> Reading:
    """What one SSE event of ``api`` means; never raises (a malformed event means nothing)."""
    if api in ("chat", "completions"):
        if data.strip() == b"[DONE]":
            return Reading(done=True)
    elif api == "messages" and event == "error":
        return Reading(error=_error_text(data))
    try:
        obj = json.loads(data)
    except ValueError:
        return NOTHING
    if not isinstance(obj, dict):
        return NOTHING
    if api == "responses":
        return _responses(obj, data)
    if api == "messages":
        return _messages(obj, data)
    return _chat(obj, data, api == "completions")


@dataclass(slots=True)
class _Timing:
    """Accumulates one stream's event times; knows nothing of HTTP."""

    api: str
    first: float | None = None
    first_answer: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)
    outputs: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    done: bool = False
    error: str | None = None

    def event(self, name: str, data: bytes, t: float) -> None:
        reading = classify(self.api, name, data)
        if reading.output is not None:
            if self.last is None:
                self.first = t
            else:
                self.gaps.append(t - self.last)
            if reading.output == ANSWER and self.first_answer is None:
                self.first_answer = t
            self.last = t
            self.outputs += 1
        if reading.usage:
            self.usage.update(reading.usage)
        if reading.done:
            self.done = True
        if reading.error is not None and self.error is None:
            self.error = reading.error


async def send(
    client: httpx.AsyncClient,
    url: str,
    planned: PlannedRequest,
    *,
    headers: dict[str, str] | None = None,
    origin: float = 0.0,
    clock: Clock = time.perf_counter,
) -> RequestResult:
    """Send one streaming request of ``planned.api`` to ``url`` and time it; never raises
    for HTTP or transport errors."""
    parser = EventStream()
    timing = _Timing(planned.api)
    status: int | None = None
    request_id: str | None = None
    outcome = INTERRUPTED
    error: str | None = None
    first_byte: float | None = None
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
                    if first_byte is None:
                        first_byte = t
                    for name, data in parser.feed(chunk):
                        timing.event(name, data, t)
                if timing.error is not None:
                    outcome, error = STREAM_ERROR, timing.error
                elif timing.done:
                    outcome = COMPLETED
                else:
                    error = f"stream ended before {_ENDINGS.get(planned.api, 'its end')}"
    except httpx.HTTPError as exc:
        outcome = INTERRUPTED if status == 200 else TRANSPORT_ERROR
        error = f"{type(exc).__name__}: {exc}"[:300]
    t_end = clock()
    usage = timing.usage
    completion = usage.get("completion")
    tpot = None
    if (
        timing.first is not None
        and timing.last is not None
        and completion is not None
        and completion >= 2
    ):
        tpot = (timing.last - timing.first) / (completion - 1)

    def since(t: float | None) -> float | None:
        return None if t is None else t - t0

    return RequestResult(
        index=planned.index,
        profile=planned.profile,
        start_s=t0 - origin,
        outcome=outcome,
        status=status,
        total_s=t_end - t0,
        ttft_s=since(timing.first),
        itl_s=tuple(timing.gaps),
        tpot_s=tpot,
        output_events=timing.outputs,
        prompt_tokens=usage.get("prompt"),
        cached_prompt_tokens=usage.get("cached"),
        completion_tokens=completion,
        error=error,
        request_id=request_id,
        api=planned.api,
        ttfb_s=since(first_byte),
        first_answer_s=since(timing.first_answer),
        reasoning_tokens=usage.get("reasoning"),
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
    scheduled: bool = False  # open loop at given arrival times (a workload file), no rate
    # (api, url, headers) for requests of other APIs than ``url``'s (a workload file mixes them)
    routes: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.requests is None and self.duration is None:
            raise ValueError("give a number of requests or a duration (or both)")
        if self.rate is None and not self.concurrency and not self.scheduled:
            raise ValueError("give a concurrency, a rate or a schedule")

    @property
    def open_loop(self) -> bool:
        return self.rate is not None or self.scheduled


LEAD_S = 0.2  # a request's task is started (its body built) this long before its send time


async def _until(when: float, clock: Clock) -> None:
    """Return at ``when`` on ``clock`` (pacing the workload, not waiting on a result).

    A plain timer: yielding to the loop for the last millisecond or two instead made
    the median send punctual but the 99th percentile later (docs/performance.md): a
    process that spins loses the scheduler's favour for waking sleepers, and the tail is
    what a workload file's bursts meet.
    """
    # Waiting on the clock itself, which no event can stand for; again when a timer
    # fired early (uvloop's round to the millisecond).
    while (delay := when - clock()) > 0:  # noqa: ASYNC110
        await asyncio.sleep(delay)


@dataclass(frozen=True, slots=True)
class RunResult:
    results: tuple[RequestResult, ...]
    wall_s: float  # first send to last answer


def make_client(concurrency: int | None, timeout: float = 600.0) -> httpx.AsyncClient:
    """One pooled client for a run; the pool is as large as the run's concurrency.

    The connection backends httpcore loads at a client's first connection (anyio's, and
    anyio's asyncio one: imports, on the loop) are loaded here, before the run's clock
    starts: they held every request of an opening burst back but the first
    (``benchmarks/RESULTS.md``, "bench's opening burst")."""
    for module in ("httpcore._backends.anyio", "anyio._backends._asyncio"):
        with contextlib.suppress(ImportError):  # their own layouts; without them, as before
            importlib.import_module(module)
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

    ``arrivals`` (send offsets in seconds) is required in an open loop (``plan.rate``
    or ``plan.scheduled``). Each request's body is taken from ``planned`` before the
    wait for its send time, so building it (a long prompt) does not delay the send.
    Requests already sent when the duration runs out are awaited, not cancelled.
    """
    http = client if client is not None else make_client(plan.concurrency)
    headers = dict(plan.headers)
    per_api = {api: (url, dict(hdrs)) for api, url, hdrs in plan.routes}
    source: Iterator[PlannedRequest] = iter(planned)
    if plan.open_loop:  # the first body is built before the clock starts: it is due at 0
        source = itertools.chain(list(itertools.islice(source, 1)), source)
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
        url, hdrs = per_api.get(item.api, (plan.url, headers))
        result = await send(http, url, item, headers=hdrs, origin=origin, clock=clock)
        last_end = max(last_end, clock())
        results.append(result)
        if on_result is not None:
            on_result(result)

    async with nullcontext() if client is not None else http:  # a client of our own is closed
        if not plan.open_loop:

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
            cap = asyncio.Semaphore(plan.concurrency) if plan.concurrency else nullcontext()

            async def capped(item: PlannedRequest, due: float) -> None:
                async with cap:
                    await _until(due, clock)
                    await one(item)

            tasks: list[asyncio.Task[None]] = []
            for offset in arrivals:
                if plan.duration is not None and offset >= plan.duration:
                    break
                if not more():
                    break
                item = next(source, None)
                if item is None:
                    break
                # The task starts early and waits for its own send time: it then sends
                # in the callback its timer wakes, not one loop turn later, and a burst's
                # bodies are built before the burst is due.
                await _until(origin + offset - LEAD_S, clock)
                sent += 1
                tasks.append(asyncio.create_task(capped(item, origin + offset)))
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
    results.sort(key=lambda r: r.index)
    return RunResult(tuple(results), last_end - origin)
