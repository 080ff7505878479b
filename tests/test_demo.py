"""Tests for ``llm-latency-proxy demo``.

* A subprocess test: ``python -m proxy demo`` starts, serves its metrics, sends traffic
  and exits 0 within a few seconds of SIGINT. We wait on its output lines, never on a
  fixed sleep.
* The live view in-process on a pretend TTY (ANSI redraw) with ``--duration``.
* The pure parts: the port fallback and the view's arithmetic over hand-built
  exposition text.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from proxy import demo, demo_view
from proxy.bench import promscrape
from proxy.simulator.cli import listen

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[1]


class Lines:
    """Reads a pipe in a thread so the test can wait for a line with a deadline."""

    def __init__(self, pipe: io.TextIOBase) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe: io.TextIOBase) -> None:
        for line in pipe:
            self.queue.put(line.rstrip("\n"))
        self.queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no line matching {pattern!r} in: {self.seen}")
            try:
                line = self.queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"output ended before {pattern!r}: {self.seen}")
            self.seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match


@pytest.mark.e2e
def test_demo_serves_metrics_and_exits_cleanly_on_sigint() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "proxy",
        "demo",
        "--port",
        "0",
        "--rate",
        "4",
        "--burst-every",
        "2",
        "--burst-size",
        "4",
    ]
    with subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out = Lines(proc.stdout)  # type: ignore[arg-type]
            metrics_url = out.wait_for(r"demo: metrics at (\S+)").group(1)
            out.wait_for(re.escape(demo.READY_LINE))
            # The view prints a line per second from the proxy's own metrics; wait until
            # they show finished requests, then check the proxy's /metrics ourselves.
            out.wait_for(r"^demo t=\d+s requests=[1-9]")
            snapshot = promscrape.parse(httpx.get(metrics_url, timeout=10).text)
            assert promscrape.histogram(snapshot, promscrape.TTFT).count >= 1
            assert promscrape.histogram(snapshot, promscrape.ITL).count >= 1
            assert promscrape.total(snapshot, promscrape.REQUESTS) >= 1

            proc.send_signal(signal.SIGINT)
            t0 = time.monotonic()
            code = proc.wait(timeout=30)
            elapsed = time.monotonic() - t0
            out.wait_for(r"^demo: stopped after \d+ completed requests", timeout=5)
            out.thread.join(5)
            stderr = proc.stderr.read() if proc.stderr else ""
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == 0, stderr
    assert elapsed < 10.0, elapsed  # promptly, on a loaded 2-core machine too (no --duration)
    assert "Traceback" not in stderr, stderr
    with pytest.raises(httpx.ConnectError):  # and nothing is left listening
        httpx.get(metrics_url, timeout=2)


def support_break(size: int, block: int = 256) -> tuple[int, int]:
    """(changed, stable) bytes the doctor reports for the support app's system prompt of
    ``size`` bytes whose first line (``Current time is HH:MM:SS.``) changes: that line is
    the prompt's first chunk, and the stable run starts after it, rounded up to a block."""
    stable_start = block
    return stable_start, size - stable_start


@pytest.mark.e2e
def test_demo_shows_the_support_apps_break_and_its_top_lever() -> None:
    """The demo's support app puts the time first in its system prompt: the live page
    (``/ui/data``, as the page reads it) shows the doctor's break at message 0 (system),
    bytes 0 to the first stable cut, the rest of the 9.6 KB repeating, and the "What to
    fix" card for its model has prefill as its top lever, worth acting on; ``/metrics``
    counts the same break with its bounded labels."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    # --rate 6 (the support app at 1.8 requests/s): the card's fit has its samples in
    # half the time it takes at the default 3
    cmd = [sys.executable, "-m", "proxy", "demo", "--port", "0", "--rate", "6",
           "--burst-every", "0"]
    size = len(f"Current time is 00:00:00.\n\n{demo.support_instructions(0)}")
    changed, stable = support_break(size)
    with subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out = Lines(proc.stdout)  # type: ignore[arg-type]
            page = out.wait_for(r"demo: live page at (\S+)").group(1)
            data_url = page + f"/data?model={demo.SUPPORT[1]}"
            deadline = time.monotonic() + 180
            while True:  # polling the page's data as the page does, once a second
                answer = httpx.get(data_url, timeout=10)
                if answer.status_code == 400:  # the model has not been seen yet
                    assert answer.json()["error"]["code"] == "unknown_selector"
                    card, breaks = [], []
                else:
                    card = answer.json()["fix"]["selections"]
                    breaks = answer.json()["prompt_cache"]["total"]["breaks"]
                if card and card[0]["fit"]["total"]["usable"] and breaks:
                    break
                assert time.monotonic() < deadline, (card, breaks)
                time.sleep(1.0)  # the page polls once a second; this is that poll
            metrics = promscrape.parse(httpx.get(page.removesuffix("/ui") + "/metrics").text)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    (selection,) = card
    assert (selection["route"], selection["model"], selection["upstream"]) == (
        "/v1/chat/completions", demo.SUPPORT[1], demo.SUPPORT[0])
    top = selection["levers"][0]
    assert (top["name"], top["status"]) == ("prefill", "lever"), selection["levers"]
    first = breaks[0]
    assert first["reason"] == "variable_before_stable", breaks
    example = first["example"]
    assert {k: example[k] for k in ("part", "index", "role", "offset", "part_bytes",
                                    "changed_bytes", "stable_bytes")} == {
        "part": "system", "index": 0, "role": "system", "offset": 0, "part_bytes": size,
        "changed_bytes": changed, "stable_bytes": stable}
    assert first["sentence"].startswith(
        f"Message 0 (system) changes in bytes 0-{changed} of {size:,}; the {stable:,} bytes "
        "after them repeat: move the changing part after them (about ")
    where = promscrape.label_filter(model=demo.SUPPORT[1], reason="variable_before_stable",
                                    part="system")
    assert promscrape.total(metrics, "llm_proxy_prompt_prefix_breaks_total", where) >= 1


async def test_demo_live_view_on_a_tty_until_duration() -> None:
    args = argparse.Namespace(
        host="127.0.0.1",
        port=0,
        duration=2.5,
        rate=8.0,
        burst_every=0.5,
        burst_size=3,
        slots=2,
        window=1.0,
        refresh=0.25,
        seed=1,
    )
    out = io.StringIO()
    started = time.monotonic()
    code = await demo.Demo(args, out, tty=True).main()
    assert code == 0
    assert time.monotonic() - started < 15
    text = out.getvalue()
    assert "\x1b[H" in text and "\x1b[J" in text  # in-place redraw
    frames = [f for f in text.split("\x1b[H") if "TTFT ms" in f]
    assert len(frames) >= 3
    assert "since start" in frames[-1] and "queue ms (upstream)" in frames[-1]
    # The live page's URL, printed first, stays in every frame: the first one clears it.
    page = re.search(r"^demo: live page at (http://\S+/ui)$", text, re.MULTILINE)
    assert page is not None
    assert all(f"live page (charts) {page[1]}" in frame for frame in frames)
    assert re.search(r"TTFT ms\s+\d+", frames[-1])
    # Per route: what the demo sent to each (its mix covers all four), what the proxy saw.
    rows = {
        m.group(1): (int(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"^(/v1/\S+)\s+(\d+)\s+(\d+)\s", frames[-1], re.MULTILINE)
    }
    assert set(rows) == set(demo_view.ROUTES)
    assert rows["/v1/chat/completions"][0] > 0 and rows["/v1/chat/completions"][1] > 0
    assert sum(sent for sent, _ in rows.values()) > rows["/v1/chat/completions"][0]
    # Per upstream: every simulated upstream got traffic, and the slow one is slower.
    ups = {
        m.group(1): (int(m.group(2)), int(m.group(3)), m.group(4))
        for m in re.finditer(r"^(local|cloud|support)\s+(\d+)\s+(\d+)\s+(\S+)", frames[-1],
                             re.MULTILINE)
    }
    assert set(ups) == set(demo.UPSTREAMS) == {"local", "cloud", "support"}
    assert ups["local"][0] > ups["cloud"][0] > 0 and ups["support"][0] > 0
    if ups["cloud"][1] and ups["local"][1]:  # TTFT p50 in ms, once each has finished one
        assert int(ups["cloud"][2]) > int(ups["local"][2]) + 300
    assert "demo: stopped after" in text


def test_bind_falls_back_to_a_free_port_when_taken() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        sock = listen("127.0.0.1", port, or_free=True)
        try:
            assert sock.getsockname()[1] not in (port, 0)
        finally:
            sock.close()
    finally:
        taken.close()
    free = listen("127.0.0.1", port, or_free=True)  # free again: it is used as asked
    try:
        assert free.getsockname()[1] == port
    finally:
        free.close()


def _exposition(
    ttft: dict[str, float],
    count: float,
    total: float,
    completed: float,
    prompt: float,
    cached: float,
) -> str:
    labels = 'model="m",route="/v1/chat/completions",upstream="u"'
    lines = [
        f'llm_proxy_time_to_first_token_seconds_bucket{{le="{le}",{labels}}} {v}'
        for le, v in ttft.items()
    ]
    lines += [
        f"llm_proxy_time_to_first_token_seconds_sum{{{labels}}} {total}",
        f"llm_proxy_time_to_first_token_seconds_count{{{labels}}} {count}",
        f'llm_proxy_stream_outcomes_total{{{labels},outcome="completed"}} {completed}',
        f'llm_proxy_requests_total{{{labels},code="200",stream="true"}} {count}',
        f"llm_proxy_prompt_tokens_sum{{{labels}}} {prompt}",
        f"llm_proxy_cached_prompt_tokens_sum{{{labels}}} {cached}",
        'llm_proxy_in_flight_requests{upstream="u"} 4',
    ]
    return "\n".join(lines) + "\n"


def test_view_arithmetic_over_scrapes() -> None:
    a = promscrape.parse(_exposition({"0.1": 1, "0.5": 2, "+Inf": 2}, 2, 0.3, 2, 100, 50))
    b = promscrape.parse(_exposition({"0.1": 1, "0.5": 6, "+Inf": 7}, 7, 3.3, 7, 1100, 650))
    w = demo_view.window(a, b, 2.0)
    assert w.requests == 5 and w.ttft.count == 5 and w.ttft.mean == pytest.approx(0.6)
    assert w.ttft.quantile(0.5) == pytest.approx(0.1 + 0.4 * 2.5 / 4)  # rank 2.5 of (0.1,0.5]
    assert w.prompt_tokens == 1000 and w.cached_tokens == 600
    assert w.outcomes == {"completed": 5.0}
    lines = demo_view.render(["head"], w, demo_view.window({}, b, 10.0), 4.0)
    text = "\n".join(lines)
    assert "cache hits 60%" in text and "cache hits 59%" in text  # 650 / 1100 since start
    assert "in flight now: 4" in text
    assert re.search(r"TTFT ms\s+5\s+350\s", text)  # n and p50 of the last window
    line = demo_view.one_line(12.0, w, w)
    assert "requests=5" in line and "ttft_p50=350ms" in line and "completed=5" in line
    empty = demo_view.window(b, b, 1.0)
    assert empty.ttft.count == 0 and math.isnan(empty.ttft.quantile(0.5))
    assert "TTFT ms" in "\n".join(demo_view.render(["head"], empty, empty, 0.0))


def _route_exposition(route: str, ttft: list[float], completed: int, failed: int) -> list[str]:
    labels = f'model="m",route="{route}",upstream="u"'
    edges = ("0.1", "0.5", "+Inf")
    lines = [
        f'llm_proxy_time_to_first_token_seconds_bucket{{le="{le}",{labels}}} '
        f"{sum(v <= float(le) for v in ttft)}"
        for le in edges
    ]
    lines += [
        f"llm_proxy_time_to_first_token_seconds_sum{{{labels}}} {sum(ttft)}",
        f"llm_proxy_time_to_first_token_seconds_count{{{labels}}} {len(ttft)}",
        f'llm_proxy_requests_total{{{labels},code="200",stream="true"}} {completed + failed}',
    ]
    if completed or failed:
        lines += [
            f'llm_proxy_stream_outcomes_total{{{labels},outcome="completed"}} {completed}',
            f'llm_proxy_stream_outcomes_total{{{labels},outcome="upstream_error"}} {failed}',
        ]
    return lines


def test_view_per_route() -> None:
    chat = _route_exposition("/v1/chat/completions", [0.05, 0.2, 0.3], 2, 1)
    # /v1/responses: counted by the proxy, not timed (a proxy that does not measure it).
    responses = [
        'llm_proxy_requests_total{model="m",route="/v1/responses",upstream="u",code="200",stream="true"} 4'
    ]
    after = promscrape.parse("\n".join(chat + responses) + "\n")
    routes = demo_view.by_route({}, after)
    assert [r.route for r in routes] == list(demo_view.ROUTES)
    by = {r.route: r for r in routes}
    assert by["/v1/chat/completions"].requests == 3 and by["/v1/chat/completions"].ttft.count == 3
    assert by["/v1/chat/completions"].not_completed == 1
    assert by["/v1/chat/completions"].first_answer is None  # the proxy does not export it
    assert by["/v1/responses"].requests == 4 and by["/v1/responses"].ttft.count == 0
    assert by["/v1/responses"].not_completed is None
    sent = {"/v1/chat/completions": 3, "/v1/responses": 5, "/v1/messages": 2}
    w = demo_view.window({}, after, 1.0)
    text = "\n".join(demo_view.render(["head"], w, w, 0.0, routes, sent))
    # rank 1.5 of 3 falls in (0.1, 0.5] holding 2: 0.1 + 0.4 * 0.5 / 2 = 200 ms
    assert re.search(r"^/v1/chat/completions\s+3\s+3\s+200\s+\d+\s+-\s+-\s+1$", text, re.MULTILINE)
    assert re.search(r"^/v1/responses\s+5\s+4\s+-\s+-\s+-\s+-\s+-$", text, re.MULTILINE)
    assert re.search(r"^/v1/messages\s+2\s+0\s", text, re.MULTILINE)
    assert re.search(r"^/v1/completions\s+0\s+0\s", text, re.MULTILINE)
    line = demo_view.one_line(3.0, w, w, routes)
    assert "chat=3/200ms" in line and "responses=4/-" in line and "messages=0/-" in line

    # A proxy that exports the first-answer histogram gets its p50 per route.
    answer = [
        'llm_proxy_time_to_first_answer_token_seconds_bucket{le="1.0",model="m",route="/v1/responses",upstream="u"} 2',
        'llm_proxy_time_to_first_answer_token_seconds_bucket{le="+Inf",model="m",route="/v1/responses",upstream="u"} 2',
        'llm_proxy_time_to_first_answer_token_seconds_sum{model="m",route="/v1/responses",upstream="u"} 1.2',
        'llm_proxy_time_to_first_answer_token_seconds_count{model="m",route="/v1/responses",upstream="u"} 2',
    ]
    with_answer = promscrape.parse("\n".join(chat + responses + answer) + "\n")
    by = {r.route: r for r in demo_view.by_route({}, with_answer)}
    assert by["/v1/responses"].first_answer.quantile(0.5) == pytest.approx(0.5)
    assert by["/v1/chat/completions"].first_answer.count == 0
