"""What to send and when: prompts, request bodies and arrival times, all seeded.

Design: ``docs/design/bench.md``.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
_LETTERS = string.ascii_lowercase

# API name -> path under the base URL (which ends in /v1).
API_PATHS: dict[str, str] = {
    "chat": "/chat/completions",
    "completions": "/completions",
    "responses": "/responses",
    "messages": "/messages",
}
ANTHROPIC_THINKING_BUDGET = 1024  # Anthropic's minimum budget_tokens


def route_of(api: str) -> str:
    """The proxy's ``route`` label for an API: its path under ``/v1``."""
    return "/v1" + API_PATHS[api]


@dataclass(frozen=True, slots=True)
class Profile:
    """One kind of request in a workload.

    Profiles with the same ``name`` share one prefix (give them the same
    ``shared_prefix_tokens``): a system prompt used by several kinds of request.
    """

    name: str = "default"
    prompt_tokens: int = 256
    shared_prefix_tokens: int = 0
    max_tokens: int = 128
    weight: float = 1.0
    api: str = "chat"  # a key of API_PATHS
    reasoning: bool = False  # ask for reasoning (chat, Responses and Messages only)
    prompt_tokens_max: int = 0  # above prompt_tokens: each prompt's length drawn between

    def __post_init__(self) -> None:
        if self.api not in API_PATHS:
            raise ValueError(f"api must be one of {', '.join(API_PATHS)}")
        if self.reasoning and self.api == "completions":
            raise ValueError("the completions API has no way to ask for reasoning")
        if self.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        if not 0 <= self.shared_prefix_tokens <= self.prompt_tokens:
            raise ValueError("shared_prefix_tokens must be between 0 and prompt_tokens")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.prompt_tokens_max and self.prompt_tokens_max < self.prompt_tokens:
            raise ValueError("prompt_tokens_max must be >= prompt_tokens")
        if self.weight <= 0:
            raise ValueError("weight must be > 0")


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request to send: its position in the workload, profile and JSON body."""

    index: int
    profile: str
    body: dict[str, Any]
    api: str = "chat"


def words(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of text: random three-letter words, space-separated."""
    return " ".join("".join(rng.choices(_LETTERS, k=3)) for _ in range(tokens))


def shared_prefix(seed: int, profile: str, tokens: int) -> str:
    """The byte-identical prefix every request of ``profile`` starts with."""
    if tokens <= 0:
        return ""
    rng = random.Random(f"prefix:{seed}:{profile}")
    return "System: " + words(rng, max(tokens - 2, 1))


def request_body(
    api: str, model: str, content: str, max_tokens: int, *, reasoning: bool = False
) -> dict[str, Any]:
    """A streaming request of ``api`` carrying ``content`` as its one user message (chat
    and completions also ask for token usage at the end)."""
    body: dict[str, Any]
    if api == "chat":
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if reasoning:
            body["reasoning_effort"] = "low"
    elif api == "completions":
        body = {
            "model": model,
            "prompt": content,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    elif api == "responses":
        body = {"model": model, "input": content, "max_output_tokens": max_tokens, "stream": True}
        if reasoning:
            body["reasoning"] = {"effort": "low"}
    elif api == "messages":
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
            "stream": True,
        }
        if reasoning:
            body["thinking"] = {"type": "enabled", "budget_tokens": ANTHROPIC_THINKING_BUDGET}
    else:
        raise ValueError(f"unknown api {api!r}")
    return body


def iter_requests(
    profiles: Sequence[Profile], *, model: str, seed: int = 0
) -> Iterator[PlannedRequest]:
    """An endless, deterministic stream of requests drawn from ``profiles`` by weight."""
    if not profiles:
        raise ValueError("a workload needs at least one profile")
    prompt_rng = random.Random(f"prompts:{seed}")
    pick_rng = random.Random(f"mix:{seed}")
    length_rng = random.Random(f"lengths:{seed}")  # drawn from only for varying lengths
    prefixes = {p.name: shared_prefix(seed, p.name, p.shared_prefix_tokens) for p in profiles}
    weights = [p.weight for p in profiles]
    index = 0
    while True:
        profile = profiles[0] if len(profiles) == 1 else pick_rng.choices(profiles, weights)[0]
        prefix = prefixes[profile.name]
        prefix_tokens = len(prefix) // CHARS_PER_TOKEN if prefix else 0
        length = profile.prompt_tokens
        if profile.prompt_tokens_max > length:
            length = length_rng.randint(length, profile.prompt_tokens_max)
        tail_tokens = max(length - prefix_tokens, 1)
        # The request number goes into the variable tail so no two prompts are equal.
        tail = f"[{index}] " + words(prompt_rng, max(tail_tokens - 2, 1))
        content = f"{prefix}\n\n{tail}" if prefix else tail
        body = request_body(
            profile.api, model, content, profile.max_tokens, reasoning=profile.reasoning
        )
        yield PlannedRequest(index, profile.name, body, profile.api)
        index += 1


def poisson_arrivals(rate: float, *, seed: int = 0) -> Iterator[float]:
    """Send times in seconds from the start for a Poisson process of ``rate`` per second.

    The first request goes at 0; the gaps after it are exponential with mean ``1/rate``.
    """
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(f"arrivals:{seed}")
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)
