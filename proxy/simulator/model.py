"""The simulator's latency model: when each token of each request comes out.

Design: ``docs/design/simulator.md``.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.errors import CliError

OUTPUT_DISTS: tuple[str, ...] = ("fixed", "uniform", "exponential")


class ConfigError(CliError, ValueError):
    """A simulator setting is out of range; the message names the flag."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Every knob of the simulator; each field is one ``simulate`` flag of the same name."""

    slots: int = 64
    prefill_rate: float = 10_000.0
    prefill_overhead: float = 0.02
    itl: float = 0.02
    itl_growth: float = 0.01
    jitter: float = 0.1
    tokens_per_chunk: int = 1
    chars_per_token: float = 4.0
    cache_block_tokens: int = 16
    cache_blocks: int = 65_536
    cached_tokens_factor: float = 1.0
    report_cached_tokens: bool = True
    output_tokens: int = 128
    output_dist: str = "uniform"
    stop_early: bool = False
    reasoning_tokens: int = 16
    max_model_len: int = 131_072
    error_rate: float = 0.0
    error_status: int = 500
    drop_rate: float = 0.0
    stream_error_rate: float = 0.0
    stall_rate: float = 0.0
    stall_seconds: float = 2.0
    vllm_metrics: bool = False
    llamacpp_timings: bool = False
    prefill_attention: float = 0.0
    models: tuple[str, ...] = ("sim-llm",)
    strict_models: bool = False
    api_key: str = ""
    seed: int | None = 0

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ConfigError:
            return ConfigError(f"--{name.replace('_', '-')} {rule} (got {getattr(self, name)!r})")

        for name in (
            "slots",
            "tokens_per_chunk",
            "cache_block_tokens",
            "output_tokens",
            "max_model_len",
        ):
            if getattr(self, name) < 1:
                raise bad(name, "must be an integer >= 1")
        if self.reasoning_tokens < 0:
            raise bad("reasoning_tokens", "must be an integer >= 0 (0: no reasoning output)")
        if self.cache_blocks < 0:
            raise bad("cache_blocks", "must be >= 0 (0 turns the prefix cache off)")
        for name in ("prefill_rate", "chars_per_token"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise bad(name, "must be a number > 0")
        for name in ("prefill_overhead", "itl", "itl_growth", "stall_seconds", "prefill_attention"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise bad(name, "must be a number >= 0")
        for name in (
            "jitter",
            "error_rate",
            "drop_rate",
            "stream_error_rate",
            "stall_rate",
            "cached_tokens_factor",
        ):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise bad(name, "must be between 0 and 1")
        if self.output_dist not in OUTPUT_DISTS:
            raise bad("output_dist", f"must be one of {', '.join(OUTPUT_DISTS)}")
        if not 400 <= self.error_status <= 599:
            raise bad("error_status", "must be an HTTP error status 400..599")
        if not self.models or any(not m for m in self.models):
            raise bad("models", "needs at least one non-empty model name")

    @property
    def block_chars(self) -> int:
        return max(1, round(self.cache_block_tokens * self.chars_per_token))


class PrefixCache:
    """LRU of chained prompt-block hashes: how much of a prompt was computed before.

    Block hashes chain (each covers its own text and its parent's hash), so a block
    only hits when the whole prefix up to it is identical; the chain starts from the
    request's scope (model and cache key), so prompts under different scopes never
    share a block, as on a server that keeps one cache per model or salt. A prompt's
    blocks are looked up when it arrives and stored once its prefill is done (its first
    token), as a server's KV cache holds only blocks it computed: the same prompt sent
    while the first is still in prefill finds nothing. Parents are touched after their
    children, so eviction removes the tails of old prompts first.
    """

    def __init__(self, block_chars: int, capacity_blocks: int) -> None:
        self.block_chars = block_chars
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, text: str, scope: str = "") -> tuple[int, tuple[int, ...]]:
        """(leading full blocks that are cached, every full block's hash) of ``text``
        under ``scope``; :meth:`insert` stores the hashes once the prefill is done. Those
        past the hits are what this prompt writes to the cache (Anthropic's
        ``cache_creation_input_tokens``)."""
        if self.capacity == 0:
            return 0, ()
        size = self.block_chars
        hashes: list[int] = []
        parent = hash(("scope", scope)) if scope else 0
        for start in range(0, len(text) - size + 1, size):
            parent = hash((parent, text[start : start + size]))
            hashes.append(parent)
        blocks = self._blocks
        hits = 0
        for h in hashes:
            if h not in blocks:
                break
            hits += 1
        return hits, tuple(hashes)

    def insert(self, hashes: tuple[int, ...]) -> None:
        """Store (or touch) a prompt's blocks, computed: the least recently used go."""
        blocks = self._blocks
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What the model decided for one request when it arrived."""

    index: int
    rng: random.Random = field(repr=False, compare=False)
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int  # per choice, reasoning included
    finish_reason: str
    prefill_compute_s: float
    reasoning_tokens: int = 0  # the first output tokens of each choice are reasoning
    cache_write_tokens: int = 0  # uncached full blocks this prompt stored in the cache
    # cached tokens as the usage reports them (cached_tokens_factor); None: not reported
    reported_cached_tokens: int | None = 0
    error: bool = False
    drop_after_tokens: int | None = None  # the connection dies after this many tokens
    error_after_tokens: int | None = None  # a stream error event after this many tokens
    stall_before_token: int | None = None  # a stall of stall_seconds before this token
    # the prompt's block hashes, stored in the prefix cache when its prefill is done
    block_hashes: tuple[int, ...] = field(default=(), repr=False, compare=False)


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's place in the scheduler."""

    arrival: float
    admitted_at: float | None = None
    released: bool = False
    on_admit: Callable[[Ticket], None] | None = None

    @property
    def admitted(self) -> bool:
        return self.admitted_at is not None


class ContextTooLong(ValueError):
    """The prompt plus the requested output does not fit ``max_model_len``."""


class LatencyModel:
    """Slots, queue, prefix cache, prefill lane and step times for one simulated server."""

    def __init__(
        self,
        config: SimConfig,
        *,
        seed: int | None = None,
        rng_factory: Callable[[int], random.Random] | None = None,
    ) -> None:
        self.config = config
        chosen = config.seed if seed is None else seed
        self._base_seed = chosen if chosen is not None else random.SystemRandom().getrandbits(63)
        self._rng_factory = rng_factory or self._default_rng
        self.cache = PrefixCache(config.block_chars, config.cache_blocks)
        self._queue: deque[Ticket] = deque()
        self.active = 0
        self._prefill_free_at = -math.inf
        self.requests = 0
        self.cached_tokens_total = 0

    def _default_rng(self, index: int) -> random.Random:
        # Distinct, repeatable stream per (seed, arrival number).
        return random.Random(self._base_seed * 1_000_003 + index)

    # -- arrival: sizes, cache, length, faults ------------------------------------

    def count_tokens(self, text: str) -> int:
        return max(1, math.ceil(len(text) / self.config.chars_per_token))

    def plan(
        self,
        text: str,
        *,
        max_tokens: int | None = None,
        prompt_tokens: int | None = None,
        reasoning: bool = False,
        cache_scope: str = "",
    ) -> RequestPlan:
        """Decide everything about a request that does not depend on other requests.

        ``text`` is the prompt as the server would tokenize it (chat messages already
        rendered); ``prompt_tokens`` overrides the estimate (a prompt sent as token ids);
        ``reasoning``: the request asked for reasoning (see the module docstring);
        ``cache_scope``: what keeps prompts apart in the prefix cache (model, cache key).
        Raises :class:`ContextTooLong` before touching the cache.
        """
        cfg = self.config
        tokens = prompt_tokens if prompt_tokens is not None else self.count_tokens(text)
        if tokens + (max_tokens or 0) > cfg.max_model_len or tokens >= cfg.max_model_len:
            raise ContextTooLong(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
                f"requested {tokens + (max_tokens or 0)} tokens ({tokens} in the messages, "
                f"{max_tokens or 0} in the completion)."
            )
        index = self.requests
        self.requests += 1
        rng = self._rng_factory(index)
        hit_blocks, hashes = self.cache.lookup(text, cache_scope)
        stored_blocks = len(hashes)
        # Like vLLM, the last prompt token is always computed: cap below the prompt size.
        cached = min(
            hit_blocks * cfg.cache_block_tokens,
            ((tokens - 1) // cfg.cache_block_tokens) * cfg.cache_block_tokens,
        )
        written = min((stored_blocks - hit_blocks) * cfg.cache_block_tokens, tokens - cached)
        reported = (
            math.floor(cached * cfg.cached_tokens_factor) if cfg.report_cached_tokens else None
        )
        self.cached_tokens_total += cached

        thinking = cfg.reasoning_tokens if reasoning else 0
        natural = thinking + self._sample_length(rng)
        room = cfg.max_model_len - tokens
        if max_tokens is not None and not (cfg.stop_early and natural < max_tokens):
            output, finish = max_tokens, "length"
        else:
            output, finish = natural, "stop"
        if output >= room:
            output, finish = room, "length"
        thinking = min(thinking, output - 1)

        error = rng.random() < cfg.error_rate
        drop = rng.randrange(output) if rng.random() < cfg.drop_rate else None
        stall = rng.randrange(output) if rng.random() < cfg.stall_rate else None
        # Drawn only when enabled, so older seeds keep their words and schedules.
        stream_error = None
        if cfg.stream_error_rate and rng.random() < cfg.stream_error_rate:
            stream_error = rng.randrange(output)
        return RequestPlan(
            index=index,
            rng=rng,
            prompt_tokens=tokens,
            cached_tokens=cached,
            output_tokens=output,
            finish_reason=finish,
            prefill_compute_s=(
                (tokens - cached) / cfg.prefill_rate
                + cfg.prefill_attention * ((tokens / 1000) ** 2 - (cached / 1000) ** 2)
            ),
            reasoning_tokens=thinking,
            cache_write_tokens=written,
            reported_cached_tokens=reported,
            error=error,
            drop_after_tokens=drop,
            error_after_tokens=stream_error,
            stall_before_token=stall,
            block_hashes=hashes,
        )

    def _sample_length(self, rng: random.Random) -> int:
        mean = self.config.output_tokens
        dist = self.config.output_dist
        if dist == "fixed":
            return mean
        if dist == "uniform":
            return rng.randint(max(1, mean - mean // 2), mean + mean // 2)
        return max(1, round(rng.expovariate(1.0 / mean)))

    # -- scheduling: slots and the FIFO queue --------------------------------------

    @property
    def queued(self) -> int:
        return len(self._queue)

    def arrive(self, now: float, on_admit: Callable[[Ticket], None] | None = None) -> Ticket:
        """Take a slot if one is free and nobody waits; otherwise join the queue.

        ``on_admit`` is called (synchronously, from :meth:`release`) when a queued
        ticket gets its slot; it is not called for an immediate admission.
        """
        ticket = Ticket(arrival=now, on_admit=on_admit)
        if self.active < self.config.slots and not self._queue:
            self.active += 1
            ticket.admitted_at = now
        else:
            self._queue.append(ticket)
        return ticket

    def release(self, ticket: Ticket, now: float) -> None:
        """Give back the ticket's slot (or its queue place); idempotent."""
        if ticket.released:
            return
        ticket.released = True
        if not ticket.admitted:
            with contextlib.suppress(ValueError):
                self._queue.remove(ticket)
            return
        self.active -= 1
        while self._queue and self.active < self.config.slots:
            nxt = self._queue.popleft()
            nxt.admitted_at = now
            self.active += 1
            if nxt.on_admit is not None:
                nxt.on_admit(nxt)

    # -- time: prefill lane and decode steps ---------------------------------------

    def prefilled(self, plan: RequestPlan) -> None:
        """The prompt of ``plan`` was computed (its first token is out): its blocks are in
        the prefix cache from now on, for the requests that arrive later."""
        self.cache.insert(plan.block_hashes)

    def start_prefill(self, plan: RequestPlan, now: float) -> float:
        """Reserve the shared prefill lane; return when the first token comes out."""
        start = max(now, self._prefill_free_at)
        end = start + plan.prefill_compute_s
        self._prefill_free_at = end
        return end + self.config.prefill_overhead

    def step_seconds(self, rng: random.Random) -> float:
        """Time of one decode step at the current batch size, with jitter."""
        cfg = self.config
        base = cfg.itl * (1.0 + cfg.itl_growth * max(0, self.active - 1))
        if cfg.jitter:
            base *= 1.0 + cfg.jitter * (2.0 * rng.random() - 1.0)
        return base
