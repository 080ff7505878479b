"""Which prefill model ``diagnose`` fits, through the whole proxy: uvicorn with httptools
on loopback, the production upstream client, the suite's scripted upstream behind it.

The upstream's first token comes after 0.05 + 2.0 x + 0.8 x^2 seconds, x the prompt in
thousands of tokens (attention: prefill that grows faster than linearly, as llama.cpp's
on a CPU). Time is scripted, not slept: the proxy runs on a clock the upstream moves by
exactly that delay right before it sends the first token, so the proxy's TTFT of each
stream is the delay itself, and the test takes well under a second of real time.

Before the quadratic, the line through these first tokens had its fixed part below
zero, so the card held it through zero: too high at short prompts, too low at long ones.
Now ``diagnose`` (the command users run, reading the proxy's ``/metrics``) says
quadratic, recovers its three terms, and no part of the first token is below zero or
above the whole.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.config import Settings
from tests.fake_upstream import DONE, ScriptedUpstream, chunk_json, sse, usage_json
from tests.servers import serve_in_thread
from tests.test_upstream_report import diagnose_card, diagnose_json

CHAT = "/v1/chat/completions"
FIXED_S, LINEAR_S, SQUARED_S = 0.05, 2.0, 0.8  # a, b (per 1,000 tokens), c (per 1,000^2)
LENGTHS = [500 + 5 * 62 * i for i in range(25)]  # 500 to 7,940 tokens


def first_token_s(tokens: int) -> float:
    x = tokens / 1000
    return FIXED_S + LINEAR_S * x + SQUARED_S * x * x


class SharedClock:
    """The proxy's clock: read on the proxy's thread, moved forward only by the upstream
    (on its own thread) between a request's arrival and its first token."""

    def __init__(self) -> None:
        self.now = 1024.0

    def __call__(self) -> float:
        return self.now


def attention_upstream(clock: SharedClock) -> ScriptedUpstream:
    async def respond(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        tokens = int(body["messages"][0]["content"].split()[0])

        async def stream() -> AsyncIterator[bytes]:
            clock.now += first_token_s(tokens)  # the prefill, as scripted time
            yield sse(chunk_json({"role": "assistant", "content": "ok"}))
            yield sse(chunk_json({}, finish="stop"))
            yield sse(usage_json(tokens, 1))
            yield DONE

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    return ScriptedUpstream(respond)


def wait_fitted(registry: CollectorRegistry, n: int) -> None:
    """The proxy records a stream just after its client saw the end: wait (bounded) for
    the n-th record rather than race it."""
    flag = threading.Event()
    deadline = time.monotonic() + 10.0
    while (
        registry.get_sample_value(
            "llm_proxy_prefill_fit_requests_total",
            {"route": CHAT, "model": "m", "upstream": "attn"},
        )
        != n
    ):
        assert time.monotonic() < deadline, f"the fit never held {n} requests"
        flag.wait(0.005)  # polling the registry, not timing anything


@pytest.mark.e2e
def test_diagnose_fits_a_quadratic_where_prefill_grows_faster_than_linearly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    clock = SharedClock()
    registry = CollectorRegistry()
    lengths = LENGTHS[:]
    random.Random(4).shuffle(lengths)  # no drift lines up with prompt length
    with attention_upstream(clock).running() as up:
        app = create_app(
            Settings(upstream=up.url + "/v1", upstream_name="attn"), registry=registry, clock=clock
        )
        with serve_in_thread(app, http="httptools", timeout_graceful_shutdown=2) as proxy:
            with httpx.Client(base_url=proxy.url, timeout=10) as client:
                for tokens in lengths:  # one at a time: no stream waits behind another
                    r = client.post(
                        CHAT,
                        json={
                            "model": "m",
                            "stream": True,
                            "messages": [{"role": "user", "content": f"{tokens} tokens"}],
                        },
                    )
                    assert r.status_code == 200 and b"[DONE]" in r.content
            wait_fitted(registry, len(lengths))
            s = diagnose_json(proxy.url, capsys)
            card = diagnose_card(proxy.url, capsys)
            page = httpx.get(proxy.url + "/ui/data", timeout=10).json()
    assert s["fit_model"] == "quadratic", s["fit_note"]
    terms = s["fit_terms"]
    assert terms["fixed_ms"] == pytest.approx(FIXED_S * 1000, rel=1e-3)
    assert terms["ms_per_1k_tokens"] == pytest.approx(LINEAR_S * 1000, rel=1e-3)
    assert terms["ms_per_1k_tokens_squared"] == pytest.approx(SQUARED_S * 1000, rel=1e-3)
    assert s["line_fixed_ms"] < 0  # the straight line through them: below zero at no tokens
    split = s["first_token"]
    mean_ms = sum(first_token_s(t) for t in LENGTHS) / len(LENGTHS) * 1000
    assert split["mean_ms"] == pytest.approx(mean_ms, rel=1e-3)
    assert split["prefill_from"] == "fit" and not split["capped"]
    for part in ("prefill_ms", "rest_ms"):
        assert 0 <= split[part] <= split["mean_ms"], (part, split)
    assert split["rest_ms"] == pytest.approx(FIXED_S * 1000, rel=1e-2)  # the fixed part
    assert split["prefill_ms"] == pytest.approx(mean_ms - FIXED_S * 1000, rel=1e-3)
    assert "quadratic fit" in card and "faster than linearly" in card
    assert "held at" not in card  # no term had to be held at zero
    (selection,) = page["fix"]["selections"]  # the live page's What to fix says the same
    live = selection["fit"]["total"]
    assert live["model"] == "quadratic" and "quadratic fit" in live["model_words"]
    assert live["summary"].startswith("prefill 2,000 ms per 1,000 uncached prompt tokens + 800")
    split_line = card[card.index("first token") : card.index("prefill ", card.index("rest"))]
    assert not re.search(r"-\d", split_line), split_line  # no part below zero
