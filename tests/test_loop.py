"""Nothing big on the event loop: ``/metrics`` renders and large request bodies.

Every stall of the event loop is added to the inter-token latency of every stream the
proxy relays at that moment, which is the figure it measures. These tests prove, with
events rather than time:

* ``/metrics`` is rendered in a worker thread: while a render is held inside the
  registry (a collector that waits for the test), the same loop answers ``/healthz``
  and relays; scrapes arriving together share one render, scrapes arriving during a
  render share the next one (never older figures than their own arrival), formats
  apart.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tests.upstream_fakes import RawResult, ScriptedClock, call_raw, make_app

pytestmark = pytest.mark.anyio

WAIT_S = 30.0  # generous bound on every wait for an event: a loaded 2-core machine
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


class HeldRender(Collector):
    """A collector that holds each render until the test releases it, and counts the
    renders: ``test_held_render_renders`` is the number of the render that read it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.renders = 0
        self.held_too_long = False  # the release never came: the loop was blocked

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.renders += 1
        self.started.set()
        if not self.release.wait(WAIT_S):
            self.held_too_long = True
        yield GaugeMetricFamily("test_held_render_renders", "renders so far", self.renders)


def renders_seen(result: RawResult) -> int:
    assert result.status == 200, result.body[:200]
    for line in result.body.decode().splitlines():
        if line.startswith("test_held_render_renders "):
            return int(float(line.split()[1]))
    raise AssertionError("the held collector was not rendered")


def scrape(app: Any, accept: str = "") -> asyncio.Task[RawResult]:
    headers = [(b"accept", accept.encode())] if accept else []
    return asyncio.ensure_future(call_raw(app, "GET", "/metrics", headers=headers))


async def test_metrics_render_off_the_loop_shares_renders_and_never_answers_stale() -> None:
    app, registry = make_app(_unused, ScriptedClock())
    held = HeldRender()
    registry.register(held)
    async with app:
        first = scrape(app)
        assert await asyncio.to_thread(held.started.wait, WAIT_S)
        # The render is held inside the registry: the loop still serves.
        health = await call_raw(app, "GET", "/healthz")
        assert (health.status, health.body) == (200, b"ok\n")
        # Two scrapes arrive during the render: they wait for it and share the next.
        late = [scrape(app), scrape(app)]
        for _ in range(50):  # loop passes, not time: both are waiting, none rendered
            await asyncio.sleep(0)
        assert held.renders == 1 and not any(t.done() for t in late)
        held.release.set()
        assert renders_seen(await first) == 1
        a, b = await asyncio.gather(*late)
        assert renders_seen(a) == renders_seen(b) == 2
        assert a.body == b.body
        assert not held.held_too_long
        assert app.scrapes.renders == 2


async def test_scrapes_arriving_together_share_one_render_formats_apart() -> None:
    app, registry = make_app(_unused, ScriptedClock())
    held = HeldRender()
    held.release.set()
    registry.register(held)
    async with app:
        texts = [scrape(app) for _ in range(3)]
        om = [scrape(app, OPENMETRICS) for _ in range(2)]
        text_results = await asyncio.gather(*texts)
        om_results = await asyncio.gather(*om)
    assert len({r.body for r in text_results}) == 1
    assert len({r.body for r in om_results}) == 1
    assert held.renders == 2  # one per format
    for r in text_results:
        assert dict(r.headers)[b"content-type"].startswith(b"text/plain")
        assert b"# EOF" not in r.body
    for r in om_results:
        assert dict(r.headers)[b"content-type"].startswith(b"application/openmetrics-text")
        assert r.body.rstrip().endswith(b"# EOF")


async def test_a_failed_render_fails_its_scrapes_and_the_next_one_renders() -> None:
    class FailsOnce(Collector):
        def __init__(self) -> None:
            self.calls = 0

        def collect(self) -> Iterator[GaugeMetricFamily]:
            self.calls += 1
            if self.calls == 1:
                raise OSError("a worker's metrics file is unreadable")
            yield GaugeMetricFamily("test_fails_once", "calls", self.calls)

    app, registry = make_app(_unused, ScriptedClock())
    registry.register(FailsOnce())
    async with app:
        with pytest.raises(OSError, match="unreadable"):
            await call_raw(app, "GET", "/metrics")
        again = await call_raw(app, "GET", "/metrics")
    assert again.status == 200
    assert b"test_fails_once 2.0" in again.body


async def _unused(request: Any) -> Any:
    raise AssertionError("no upstream request expected")
