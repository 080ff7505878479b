"""A headless browser and a live stack (simulator, proxy, workload) for the page tests,
and the code that takes the README's screenshot.

The browser is Debian's ``chromium`` driven through its ``chromium-driver`` by Selenium,
always with the system driver (``Service(CHROMEDRIVER)``): Selenium Manager never runs,
so nothing is downloaded. Performance logging (``goog:loggingPrefs``) records every
request the page makes, which is how a test proves that it made none off the machine.

The workload is the official ``openai`` SDK in a few threads, two models (short and long
prompts, so their TTFTs differ) over chat completions (some reasoning first) and legacy
completions, with no retries so that every attempt is one request the proxy counts.
With ``cloud`` given, the large model has an upstream of its own, ``cloud``, slower to
its first token than ``local``, which serves the small one: two upstreams behind one
proxy, routed by model as a config file with two ``[[upstream]]`` tables does.
:meth:`Workload.pause` stops it and waits until the proxy has recorded every request
sent, so a test can compare the page with ``/metrics`` at one moment.

The README screenshot (``docs/ui.png``) is the page of ``llm-latency-proxy demo`` (two
upstreams, four APIs, bursts), taken by the same browser code:

    python -m tests.browser --screenshot docs/ui.png --seconds 75 --panels docs/ui-fix.png

75 s, so that the page shows a whole last minute beside since start; ``--panels`` also
takes the "What to fix" card and the "Prompt caching" panel with the demo's support app
selected (``--model sim-support``), whose finding the demo was built to have.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.bench import promscrape
from proxy.config import Settings
from proxy.simulator.app import create_simulator_app
from proxy.simulator.model import SimConfig
from proxy.upstream_spec import UpstreamSpec
from tests.servers import RunningServer, serve_in_thread

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MODELS = ("sim-small", "sim-large")
CHARTS = 7  # on the live page: three over time, two histograms, time split, throughput

SIM = SimConfig(
    slots=6,
    prefill_rate=40_000.0,
    prefill_overhead=0.01,
    itl=0.012,
    itl_growth=0.05,
    jitter=0.3,
    output_tokens=24,
    reasoning_tokens=8,
    error_rate=0.02,
    stall_rate=0.05,
    stall_seconds=0.3,
    vllm_metrics=True,
    seed=7,
)
CLOUD = replace(SIM, prefill_overhead=0.35, itl=0.03, seed=8)  # the slower upstream


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        return f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER})"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium (pip install selenium)"
    return None


@contextlib.contextmanager
def chrome(width: int = 1360, height: int = 1000) -> Iterator[Any]:
    """Headless chromium with performance and console logging."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--hide-scrollbars",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--disable-lcd-text",  # grey antialiasing: a smaller PNG for the README
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


class LoginPrompt:
    """Answers the browser's HTTP authentication prompt as its user would: with
    ``credentials`` (user name, password), or by cancelling it (None). Through DevTools'
    ``Fetch`` domain on a connection of its own (headless chromium shows no dialog, and
    Selenium's BiDi auth handler times out here); ``asked`` counts the prompts, so a
    test sees that the user is asked once and the page's own requests then carry what
    was typed."""

    def __init__(self, driver: Any, credentials: tuple[str, str] | None) -> None:
        import websocket  # websocket-client, a dependency of selenium

        address = driver.capabilities["goog:chromeOptions"]["debuggerAddress"]
        targets = httpx.get(f"http://{address}/json", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = websocket.create_connection(page["webSocketDebuggerUrl"], suppress_origin=True)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.credentials = credentials
        self.asked = 0
        self._send("Fetch.enable", handleAuthRequests=True, patterns=[{"urlPattern": "*"}])
        self._thread = threading.Thread(target=self._answer, name="login-prompt", daemon=True)
        self._thread.start()

    def _send(self, method: str, **params: Any) -> None:
        with self._lock:
            self._ws.send(json.dumps({"id": next(self._ids), "method": method, "params": params}))

    def _answer(self) -> None:
        while True:
            try:
                message = json.loads(self._ws.recv())
            except Exception:  # closed: the test is over
                return
            method, params = message.get("method"), message.get("params", {})
            if method == "Fetch.requestPaused":
                self._send("Fetch.continueRequest", requestId=params["requestId"])
            elif method == "Fetch.authRequired":
                self.asked += 1
                answer: dict[str, str] = {"response": "CancelAuth"}
                if self.credentials is not None:
                    user, password = self.credentials
                    answer = {"response": "ProvideCredentials", "username": user,
                              "password": password}
                self._send("Fetch.continueWithAuth", requestId=params["requestId"],
                           authChallengeResponse=answer)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._send("Fetch.disable")
        self._ws.close()
        self._thread.join(5)


def requested_urls(driver: Any) -> list[str]:
    """Every URL the browser asked for since the last call (performance log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message.get("method") == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def console_errors(driver: Any) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def wait_for(driver: Any, script: str, timeout: float = 20.0) -> Any:
    """Wait until ``script`` (a JavaScript expression) is truthy; return its value."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: d.execute_script(f"return ({script});")
    )


def full_screenshot(
    driver: Any, path: Path, scale: float = 1.0, only: tuple[str, ...] = ()
) -> None:
    """The whole page, not just the window (DevTools ``Page.captureScreenshot``), at
    ``scale`` (the README's whole page is smaller, to stay near 300 KB); with ``only`` (CSS
    selectors), the box around those elements."""
    metrics = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})
    size = metrics["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"]}
    if only:
        boxes = driver.execute_script(
            "return arguments[0].map(s => document.querySelector(s).getBoundingClientRect())"
            ".map(r => [r.left + scrollX, r.top + scrollY, r.right + scrollX, r.bottom + scrollY])",
            list(only),
        )
        left, top = min(b[0] for b in boxes) - 8, min(b[1] for b in boxes) - 8
        right, bottom = max(b[2] for b in boxes) + 8, max(b[3] for b in boxes) + 8
        clip = {"x": left, "y": top, "width": right - left, "height": bottom - top}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {"format": "png", "captureBeyondViewport": True, "clip": {**clip, "scale": scale}},
    )
    path.write_bytes(base64.b64decode(shot["data"]))


@dataclass
class Workload:
    """Streams through the proxy from ``threads`` threads until stopped."""

    base_url: str
    threads: int = 4
    sent: int = 0  # attempts, every one a request the proxy records
    stop: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    _busy: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.go.set()
        for i in range(self.threads):
            worker = threading.Thread(target=self._run, args=(i,), daemon=True)
            worker.start()
            self._workers.append(worker)

    def _run(self, index: int) -> None:
        from openai import OpenAI, OpenAIError

        client = OpenAI(base_url=self.base_url + "/v1", api_key="sk-sim", max_retries=0, timeout=30)
        rng = random.Random(index)
        for n in itertools.count():
            self.go.wait()
            if self.stop.is_set():
                return
            with self._cond:
                if not self.go.is_set():
                    continue
                self._busy += 1
                self.sent += 1
            try:
                one(client, rng, index, n)
            except OpenAIError:
                pass  # injected faults: the proxy counts them too
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def pause(self, metrics_url: str, timeout: float = 20.0) -> dict[Any, float]:
        """Stop sending, let every request finish, wait until the proxy has recorded
        them all; return the ``/metrics`` snapshot of that moment."""
        with self._cond:
            self.go.clear()
            assert self._cond.wait_for(lambda: self._busy == 0, timeout)
        deadline = time.monotonic() + timeout
        while True:
            snap = promscrape.parse(httpx.get(metrics_url).text)
            if promscrape.total(snap, promscrape.REQUESTS) >= self.sent:
                return snap
            assert time.monotonic() < deadline, "the proxy did not record every request"
            self.stop.wait(0.01)  # polling the proxy's record, not timing anything

    def resume(self) -> None:
        self.go.set()

    def close(self) -> None:
        self.stop.set()
        self.go.set()
        for worker in self._workers:
            worker.join(30)


SYSTEM = "You answer questions about the proxy's documentation. " * 40  # shared: cached


def one(client: Any, rng: random.Random, index: int, n: int) -> None:
    """One streamed request: the large model gets long unique prompts (slower TTFT), the
    small one short questions behind a shared system prompt (the prefix cache serves it
    to the completions route); its chat requests put a time first in that system prompt,
    so the prompt-cache doctor finds the break (``variable_before_stable``)."""
    model = MODELS[(index + n) % 2]
    words = 6000 if model == "sim-large" else 60
    unique = f"[{index}:{n}] " + " ".join(
        rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(words)
    )
    prompt = unique if model == "sim-large" else SYSTEM + unique
    if n % 4 == 1:
        stream: Any = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    else:
        extra = {"reasoning_effort": "low"} if n % 3 == 0 else {}
        messages = [{"role": "user", "content": prompt}]
        if model == "sim-small":
            stamp = f"Current time is 12:00:{n % 60:02d}.\n\n"
            messages = [{"role": "system", "content": stamp + SYSTEM},
                        {"role": "user", "content": unique}]
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            stream=True,
            max_tokens=rng.choice((12, 24, 48)),
            stream_options={"include_usage": True},
            **extra,
        )
    for _ in stream:
        pass


@dataclass
class Stack:
    sim: RunningServer
    proxy: RunningServer
    workload: Workload
    cloud: RunningServer | None = None

    @property
    def page_url(self) -> str:
        return self.proxy.url + "/ui"

    @property
    def metrics_url(self) -> str:
        return self.proxy.url + "/metrics"


@contextlib.contextmanager
def live_stack(
    threads: int = 4, sim: SimConfig = SIM, cloud: SimConfig | None = None
) -> Iterator[Stack]:
    """Simulator and proxy in real uvicorn servers on loopback, and a workload (not
    started: the caller decides when traffic begins). With ``cloud``, a second
    simulator serves ``sim-large`` as upstream ``cloud``; ``local`` serves the rest."""
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(serve_in_thread(create_simulator_app(sim)))
        if cloud is None:
            second = None
            settings = Settings(upstream=upstream.url + "/v1", upstream_name="simulator",
                                prefix_doctor=True)
        else:
            second = stack.enter_context(serve_in_thread(create_simulator_app(cloud)))
            settings = Settings(
                upstreams=(
                    UpstreamSpec("local", upstream.url + "/v1", models=(MODELS[0],), default=True),
                    UpstreamSpec("cloud", second.url + "/v1", models=(MODELS[1],)),
                ),
                prefix_doctor=True,
            )
        app = create_app(settings, registry=CollectorRegistry())
        proxy = stack.enter_context(serve_in_thread(app))
        workload = Workload(proxy.url, threads)
        try:
            yield Stack(upstream, proxy, workload, second)
        finally:
            workload.close()


@contextlib.contextmanager
def demo() -> Iterator[str]:
    """``llm-latency-proxy demo`` in a process of its own; the URL of its live page."""
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "demo", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    try:
        first = process.stdout.readline()  # "demo: live page at http://...:PORT/ui"
        url = first.rpartition(" ")[2].strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"the demo did not start: {first!r}")
        # Its one line per refresh, read so that the pipe never fills.
        threading.Thread(target=process.stdout.read, daemon=True).start()
        yield url
    finally:
        process.send_signal(signal.SIGINT)  # the demo's own clean stop
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def screenshot(
    path: Path, seconds: float, scale: float = 0.66, shots: tuple[tuple[Path, str], ...] = ()
) -> None:
    """The README's picture: the demo's page after ``seconds`` of its traffic; then each
    of ``shots``, (path, model), the "What to fix" card and the "Prompt caching" panel
    with that model selected."""
    with demo() as url, chrome(1360, 1000) as driver:
        driver.get(url)
        time.sleep(seconds)  # not a test: the picture needs that much history
        wait_for(driver, f"document.querySelectorAll('[data-drawn=chart]').length == {CHARTS}")
        refreshed = int(driver.execute_script("return document.body.dataset.refreshes"))
        wait_for(driver, f"+document.body.dataset.refreshes > {refreshed}")
        tmp = path.with_suffix(".tmp.png")
        full_screenshot(driver, tmp, scale)
        shutil.move(tmp, path)
        for shot, model in shots:
            driver.get(f"{url}?model={model}")
            wait_for(driver, "+document.body.dataset.refreshes >= 2")
            tmp = shot.with_suffix(".tmp.png")
            full_screenshot(driver, tmp, max(scale, 0.8), only=("#fix-card", "#pc-card"))
            shutil.move(tmp, shot)


def main() -> None:
    parser = argparse.ArgumentParser(description="Take the README's screenshot of /ui.")
    parser.add_argument("--screenshot", type=Path, default=Path("docs/ui.png"))
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--scale", type=float, default=0.66)
    parser.add_argument(
        "--panels", type=Path, default=None, metavar="PNG",
        help="also the What to fix card and the Prompt caching panel, for --model")
    parser.add_argument("--model", default="sim-support")
    args = parser.parse_args()
    shots = ((args.panels, args.model),) if args.panels else ()
    screenshot(args.screenshot, args.seconds, args.scale, shots)
    for path in (args.screenshot, *(p for p, _ in shots)):
        print(f"{path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
