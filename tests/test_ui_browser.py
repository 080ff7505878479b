"""The live page in a real browser: headless chromium against the proxy in front of the
simulator, under a running workload (:mod:`tests.browser`).

One test, one browser, to stay within a few seconds of traffic: the charts draw; with
the workload paused and every request recorded, the figures the page shows equal the
ones computed from ``/metrics`` at that moment (the page opened before any traffic and
the test lasts less than a minute, so "last minute" is everything too); choosing a
model, then a route, changes them to that model's and route's figures; the page asked
for nothing but its own origin (the browser's network log) and logged no error; and a
screenshot of it is saved in the test's temporary directory, taken by the same function
that takes the README's. A link naming a model the proxy does not know falls back to
every model.

With client keys on, the page on the main port takes one: the browser asks its user
once (HTTP Basic, the key as the password), then the page's own data requests carry it;
a user who cancels the prompt gets the refusal, never the page.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.bench import promscrape
from proxy.config import Settings
from tests.browser import (
    CHARTS,
    LoginPrompt,
    browser_missing,
    chrome,
    console_errors,
    full_screenshot,
    live_stack,
    requested_urls,
    wait_for,
)
from tests.servers import serve_in_thread

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.integration,
    pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing())),
]

FIRST_ANSWER = "llm_proxy_time_to_first_answer_token_seconds"


def shown(driver: Any) -> dict[str, str]:
    """Every figure on the page by its ``data-k`` key, as displayed."""
    found: dict[str, str] = driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('[data-k]')]"
        ".map(e => [e.dataset.k, e.textContent]))"
    )
    return found


def next_refresh(driver: Any) -> None:
    """Wait for a refresh that began after this call (the one in flight may not have)."""
    now = int(driver.execute_script("return +document.body.dataset.refreshes"))
    wait_for(driver, f"+document.body.dataset.refreshes >= {now + 2}")


def assert_ms(text: str, seconds: float) -> None:
    """``text`` is ``seconds`` in milliseconds, as rounded for display."""
    decimals = len(text.partition(".")[2])
    assert abs(float(text) - seconds * 1000) <= 0.5 * 10**-decimals + 1e-9, (text, seconds)


def assert_page_equals_metrics(
    figures: dict[str, str], snap: promscrape.Snapshot, **labels: str
) -> None:
    where = promscrape.label_filter(**labels)
    requests = promscrape.total(snap, promscrape.REQUESTS, where)
    assert requests > 0
    for span in ("window", "total"):  # the whole run is within the last minute
        for key, name in (
            ("ttft", promscrape.TTFT),
            ("ttfa", FIRST_ANSWER),
            ("itl", promscrape.ITL),
            ("tpot", promscrape.TPOT),
        ):
            hist = promscrape.histogram(snap, name, where)
            assert float(figures[f"{span}.{key}.n"]) == hist.count > 0, (span, key)
            assert_ms(figures[f"{span}.{key}.mean"], hist.mean)
            for q in (0.5, 0.9, 0.99):
                value = hist.quantile(q)
                assert math.isfinite(value)
                assert_ms(figures[f"{span}.{key}.p{round(q * 100)}"], value)
        outcomes = promscrape.by_label(snap, promscrape.OUTCOMES, "outcome", where)
        for outcome, count in outcomes.items():
            if count:
                assert float(figures[f"{span}.outcomes.{outcome}"]) == count
    assert float(figures["total.requests"]) == requests


def choose(driver: Any, name: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, name)).select_by_value(value)
    wait_for(driver, f"JSON.parse(document.body.dataset.selection || '{{}}').{name} === {value!r}")
    next_refresh(driver)


def test_live_page_draws_the_proxys_figures_in_a_real_browser(tmp_path: Path) -> None:
    with live_stack() as stack, chrome() as driver:
        origin = stack.proxy.url
        driver.get(stack.page_url)
        wait_for(driver, "+document.body.dataset.refreshes >= 1")  # before any traffic
        stack.workload.start()
        # Every chart drawn with data, the over-time ones included (a point every 5 s).
        wait_for(
            driver,
            f"document.querySelectorAll('[data-drawn=chart]').length == {CHARTS}",
            timeout=30,
        )
        assert driver.find_elements("css selector", "[data-chart=itl-hist] rect.band")
        wait_for(driver, "document.querySelector('#route option[value=\"/v1/completions\"]')")

        snap = stack.workload.pause(stack.metrics_url)
        next_refresh(driver)
        everything = shown(driver)
        assert_page_equals_metrics(everything, snap)

        choose(driver, "model", "sim-large")
        large = shown(driver)
        assert_page_equals_metrics(large, snap, model="sim-large")
        assert float(large["total.requests"]) < float(everything["total.requests"])
        assert large["total.ttft.mean"] != everything["total.ttft.mean"]
        rows = driver.find_elements("css selector", "#slow td:nth-child(3)")
        assert rows and {row.text for row in rows} == {"sim-large"}

        choose(driver, "route", "/v1/completions")
        assert_page_equals_metrics(shown(driver), snap, model="sim-large", route="/v1/completions")
        assert "route=%2Fv1%2Fcompletions" in driver.current_url

        urls = requested_urls(driver)
        assert any(url.startswith(origin + "/ui/data") for url in urls)
        offsite = [u for u in urls if not (u.startswith(origin + "/") or u.startswith("data:"))]
        assert offsite == []
        assert console_errors(driver) == []

        # A selector the proxy does not know (a stale link, a restarted proxy): the page
        # says so, then falls back to every value.
        driver.get(stack.page_url + "?model=gone")
        wait_for(driver, "JSON.parse(document.body.dataset.selection || '{}').model === ''")
        assert "?" not in driver.current_url
        assert float(shown(driver)["total.requests"]) == float(everything["total.requests"])

        stack.workload.resume()
        wait_for(driver, f"document.querySelectorAll('[data-drawn=chart]').length == {CHARTS}")
        shot = tmp_path / "ui.png"
        full_screenshot(driver, shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_with_client_keys_the_browser_asks_once_and_the_page_draws(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = "cli-" + secrets.token_hex(12)
    keys = tmp_path / "keys"
    keys.write_text(hashlib.sha256(key.encode()).hexdigest() + "\n")
    monkeypatch.setenv("TEST_UI_UPSTREAM_KEY", "srv-" + secrets.token_hex(8))
    settings = Settings(upstream="http://127.0.0.1:9/v1", upstream_api_key_env="TEST_UI_UPSTREAM_KEY",
                        client_keys_file=str(keys))
    app = create_app(settings, registry=CollectorRegistry())
    with serve_in_thread(app, http="httptools") as server, chrome() as driver:
        prompt = LoginPrompt(driver, None)  # the user cancels the prompt
        try:
            driver.get(server.url + "/ui")
            wait_for(driver, "document.body.innerText.includes('invalid_api_key')")
            assert prompt.asked == 1
            assert driver.execute_script("return document.body.dataset.refreshes") is None
        finally:
            prompt.close()
        prompt = LoginPrompt(driver, ("ops", key))  # the user types any name and a key
        try:
            driver.get(server.url + "/ui")
            wait_for(driver, "+document.body.dataset.refreshes >= 3")  # /ui/data, three times
            assert prompt.asked == 1
        finally:
            prompt.close()
        # (the refused /ui of the first visit is logged, and the browser's own favicon
        # request is a 404; the page's data requests never failed)
        assert not [e for e in console_errors(driver) if "/ui/data" in e["message"]]
