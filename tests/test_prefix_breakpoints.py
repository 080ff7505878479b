"""Cache breakpoints and the doctor's missed tokens, through the whole proxy: uvicorn with
httptools on loopback, the production upstream client, the suite's scripted upstream
reporting the prompt and cached tokens of each answer exactly.

Where the provider caches only the prefixes a breakpoint marks (Anthropic's Messages API
without the request-level ``cache_control``; OpenAI's explicit mode), the missed tokens
past the last breakpoint are said apart as ``cache_missed_unmarked_tokens``: no cache
was asked to serve them. Where any repeated prefix may be cached, nothing changes. The
request forwarded upstream is the client's, byte for byte.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.dialects import DIALECTS
from proxy.evidence import evidence
from tests.fake_upstream import ScriptedUpstream
from tests.test_evidence import read_scrape
from tests.test_keys import served
from tests.test_prefix_proxy import CHAT, MESSAGES, RESPONSES, Answers, text
from tests.test_upstream_report import metric, wait_logged

SYSTEM = text(8192, "breakpoint-system")  # the stable part
TAIL = text(2048, "breakpoint-tail")  # repeated, after the stable part
QUESTION = "What does section 4 say?"
MARK = {"type": "ephemeral"}
OPENAI_MARK = {"mode": "explicit"}
PROMPT = 3000  # the upstream's prompt tokens, every answer
UNMARKED = "llm_proxy_prompt_cache_missed_unmarked_tokens_total"
MISSED = "llm_proxy_prompt_cache_missed_tokens_total"


@contextlib.contextmanager
def proxy(tmp_path: Path, answers: Answers) -> Iterator[tuple[str, Path, ScriptedUpstream]]:
    log = tmp_path / "requests.jsonl"
    upstream = ScriptedUpstream(answers)
    with (
        upstream.running(),
        served(upstream.url, upstream_name="up", log_requests=str(log), prefix_doctor=True) as (
            server,
            _,
        ),
    ):
        yield server.url, log, upstream


def send(base: str, log: Path, route: str, bodies: list[bytes]) -> list[dict[str, Any]]:
    """Each body in turn, the next once the last one's line is in the log (its prompt is
    then in the doctor's index)."""
    with httpx.Client(timeout=30) as client:
        for n, body in enumerate(bodies, 1):
            r = client.post(
                base + route, content=body, headers={"content-type": "application/json"}
            )
            assert r.status_code == 200
            wait_logged(log, n)
    return wait_logged(log, len(bodies))


def encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def tokens_of(route: str, body: dict[str, Any], upto: int) -> int:
    """The tokens of the prompt's first ``upto`` bytes at the request's own ratio."""
    total = sum(len(p.data) for p in DIALECTS[route].prompt_parts(body))
    return round(upto * PROMPT / total)


def messages(*, system_mark: bool, automatic: bool = False) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": SYSTEM}
    if system_mark:
        block["cache_control"] = MARK
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 16,
        "system": [block],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": TAIL}, {"type": "text", "text": QUESTION}],
            },
        ],
    }
    if automatic:
        body["cache_control"] = MARK
    return body


scraped: list[str] = []  # the last run's /metrics text


def run(
    tmp_path: Path, route: str, body: dict[str, Any], cached: list[int]
) -> tuple[list[dict[str, Any]], float, float, list[bytes]]:
    """``body`` sent once and then again once per ``cached`` (the cached tokens the
    upstream reports for that repeat); the log lines, the unmarked and missed counters,
    and the bodies the upstream received."""
    answers = Answers()
    for reported in [0, *cached]:
        answers.queue(PROMPT, reported)
    sent = [encoded(body)] * (1 + len(cached))
    with proxy(tmp_path, answers) as (base, log, upstream):
        lines = send(base, log, route, sent)
        unmarked, missed = metric(base, UNMARKED), metric(base, MISSED)
        seen = [s.body for s in upstream.requests]
        scraped.append(httpx.get(base + "/metrics", timeout=10).text)
    assert seen == sent, "the request forwarded upstream is the client's, byte for byte"
    return lines, unmarked, missed, seen


def test_anthropic_tokens_past_the_breakpoint_are_unmarked_not_missed(tmp_path: Path) -> None:
    """A repeated 8 KB system prompt marked with cache_control, then a repeated tail that
    no breakpoint covers. The upstream serves the system prompt: every missed token is
    past the breakpoint (unmarked). The upstream serves nothing: the tail is unmarked,
    the system prompt's tokens were asked for and not served."""
    body = messages(system_mark=True)
    asked = tokens_of(MESSAGES, body, len(SYSTEM))
    lines, unmarked, missed, _ = run(tmp_path, MESSAGES, body, [asked, 0])
    first, served_system, served_none = lines
    assert first["cache_missed_unmarked_tokens"] == 0  # nothing repeated yet
    cacheable = PROMPT - 1  # the whole prompt repeats; its last token is always computed
    assert served_system["cache_missed_tokens"] == cacheable - asked
    assert served_system["cache_missed_unmarked_tokens"] == cacheable - asked
    assert served_none["cache_missed_tokens"] == cacheable
    assert served_none["cache_missed_unmarked_tokens"] == cacheable - asked  # asked: not served
    assert unmarked == 2 * (cacheable - asked)
    assert missed == 2 * (cacheable - asked) + asked
    # diagnose reads both, per examined request, for the prompt_cache lever's words
    (found,) = evidence(read_scrape(scraped[-1]))
    assert found.unmarked_cache_tokens == pytest.approx(unmarked / 3)
    assert found.missed_cache_tokens == pytest.approx(missed / 3)


def test_anthropic_without_any_breakpoint_every_missed_token_is_unmarked(tmp_path: Path) -> None:
    lines, unmarked, _, _ = run(tmp_path, MESSAGES, messages(system_mark=False), [0])
    repeat = lines[1]
    assert repeat["cache_missed_tokens"] == PROMPT - 1
    assert repeat["cache_missed_unmarked_tokens"] == PROMPT - 1
    assert unmarked == PROMPT - 1


def test_anthropic_automatic_caching_leaves_nothing_unmarked(tmp_path: Path) -> None:
    """The request-level cache_control asks for everything up to the last block."""
    lines, unmarked, _, _ = run(
        tmp_path, MESSAGES, messages(system_mark=False, automatic=True), [0]
    )
    assert lines[1]["cache_missed_tokens"] == PROMPT - 1
    assert lines[1]["cache_missed_unmarked_tokens"] == 0
    assert unmarked == 0


def openai(route: str, *, explicit: bool, model: str = "gpt-5.6") -> dict[str, Any]:
    kind = "text" if route == CHAT else "input_text"
    stable: dict[str, Any] = {"type": kind, "text": SYSTEM, "prompt_cache_breakpoint": OPENAI_MARK}
    turns = [
        {"role": "developer", "content": [stable]},
        {
            "role": "user",
            "content": [{"type": kind, "text": TAIL}, {"type": kind, "text": QUESTION}],
        },
    ]
    body: dict[str, Any] = {"model": model}
    body["messages" if route == CHAT else "input"] = turns
    if explicit:
        body["prompt_cache_options"] = {"mode": "explicit"}
    return body


@pytest.mark.parametrize("route", [CHAT, RESPONSES])
def test_openai_explicit_mode_splits_at_the_last_breakpoint(tmp_path: Path, route: str) -> None:
    """GPT-5.6's explicit mode caches only up to a prompt_cache_breakpoint (on a content
    part of a chat message or a Responses input item): the tail after it is unmarked."""
    body = openai(route, explicit=True)
    asked = tokens_of(route, body, len(SYSTEM))
    lines, unmarked, _, _ = run(tmp_path, route, body, [asked])
    assert lines[1]["cache_missed_tokens"] == PROMPT - 1 - asked
    assert lines[1]["cache_missed_unmarked_tokens"] == PROMPT - 1 - asked
    assert unmarked == PROMPT - 1 - asked


def test_openai_default_mode_and_a_chat_without_markers_are_unchanged(tmp_path: Path) -> None:
    """Implicit caching (the default, or a marker without explicit mode): the figures are
    what they always were, and nothing is said unmarked or counted."""
    marked = openai(CHAT, explicit=False)
    plain = {
        "model": "gpt-5.6",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": TAIL + QUESTION},
        ],
    }
    for n, body in enumerate((marked, plain)):
        (tmp_path / str(n)).mkdir()
        lines, unmarked, missed, _ = run(tmp_path / str(n), CHAT, body, [1024])
        assert lines[1]["cache_missed_tokens"] == PROMPT - 1 - 1024
        assert lines[1]["cache_missed_unmarked_tokens"] is None
        assert (unmarked, missed) == (0, PROMPT - 1 - 1024)


def test_the_last_breakpoint_ends_where_the_parts_put_it() -> None:
    """The offset is in the parts' bytes joined in order (settings, tools, system,
    messages): the end of the last marked tool, system block or content block, a tool
    result's included; a marker is never hashed, so adding one changes no part."""
    from proxy.dialects import MESSAGES as DIALECT
    from proxy.dialects import RESPONSES as OPENAI
    from proxy.dialects import Caching

    tool = {"name": "look", "input_schema": {"type": "object"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "R"}],
    }
    body: dict[str, Any] = {
        "tool_choice": {"type": "auto"},
        "tools": [{**tool, "cache_control": MARK}],
        "system": "S" * 10,
        "messages": [
            {
                "role": "user",
                "content": [{**result, "cache_control": MARK}, {"type": "text", "text": "after"}],
            }
        ],
    }
    prompt = DIALECT.prompt(body)
    settings, tools, system, message = (len(p.data) for p in prompt.parts)
    assert prompt.caching is Caching.MARKED
    assert prompt.marked_bytes == settings + tools + system + message - len("after")
    body["tools"] = [tool]
    body["messages"][0]["content"][0] = result
    assert DIALECT.prompt(body) == (prompt.parts, Caching.MARKED, None)  # same bytes, no mark
    assert DIALECT.prompt({**body, "cache_control": MARK}).caching is Caching.AUTOMATIC

    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    items = [{"role": "user", "content": [{"type": "input_text", "text": "x" * 5}, image]}]
    plain = OPENAI.prompt({"input": items})
    items[0]["content"][1] = {**image, "prompt_cache_breakpoint": OPENAI_MARK}
    explicit = OPENAI.prompt({"input": items, "prompt_cache_options": {"mode": "explicit"}})
    assert explicit.parts == plain.parts and plain.caching is Caching.IMPLICIT
    assert explicit.marked_bytes == len(plain.parts[0].data)  # the image is the last block
