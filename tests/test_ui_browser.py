"""The live page in a real browser: headless chromium against the proxy in front of two
simulated upstreams of different speed, under a running workload (:mod:`tests.browser`).

One test, one browser, to stay within a few seconds of traffic: the charts draw; with
the workload paused and every request recorded, the figures the page shows since start
equal the ones computed from ``/metrics`` at that moment, and so does each row of the
table by upstream and model; choosing a model, then a route, changes them to that
model's and route's figures, and clicking a row of the table selects its upstream,
model and route (in the selectors and the URL) and shows that selection's figures; the
page asked for nothing but its own origin (the browser's network log) and logged no
error; and a screenshot of it is saved in the test's temporary directory, taken by the
same code that takes the README's. A link naming a model the proxy does not know falls
back to every model.

Which span the page shows, with the page's clock scripted (the proxy's own page, given
a clock): opened on a proxy that has served requests for minutes, it shows the
since-start figures at once and says so everywhere; once its ring holds a minute, every
title, column and tile says "last minute", and the requests tile counts that minute.

With client keys on, the page on the main port takes one: the browser asks its user
once (HTTP Basic, the key as the password), then the page's own data requests carry it;
a user who cancels the prompt gets the refusal, never the page.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from selenium.common.exceptions import StaleElementReferenceException

from proxy.app import create_app
from proxy.bench import promscrape
from proxy.config import Settings
from proxy.ui import LivePage
from tests.browser import (
    CHARTS,
    CLOUD,
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
from tests.test_ui import Clock, record

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
    """Wait for a refresh whose figures were read from the registry after this call.

    The one in flight may have begun before; the next began after, but the server may
    answer it from a collection up to ``MIN_COLLECT_S`` older, which can even have been
    read while the last request was being recorded (a collect is not atomic across
    metric families). The page refreshes every ``FINE_S``, more than ``MIN_COLLECT_S``,
    so the one after that was answered from a collection taken after this call."""
    from proxy.ui.collect import FINE_S
    from proxy.ui.data import MIN_COLLECT_S

    assert FINE_S > MIN_COLLECT_S
    now = int(driver.execute_script("return +document.body.dataset.refreshes"))
    wait_for(driver, f"+document.body.dataset.refreshes >= {now + 3}")


def assert_ms(text: str, seconds: float) -> None:
    """``text`` is ``seconds`` in milliseconds, as rounded for display."""
    decimals = len(text.partition(".")[2])
    assert abs(float(text) - seconds * 1000) <= 0.5 * 10**-decimals + 1e-9, (text, seconds)


def assert_page_equals_metrics(
    figures: dict[str, str], snap: promscrape.Snapshot, **labels: str
) -> None:
    """The since-start figures (the page opened before any traffic) equal ``/metrics``'s
    for ``labels``; and so do the last minute's while the whole run is within it."""
    where = promscrape.label_filter(**labels)
    requests = promscrape.total(snap, promscrape.REQUESTS, where)
    assert requests > 0
    spans = ["total"]
    if "window.ttft.n" in figures and float(figures["window.ttft.n"]) == float(
        figures["total.ttft.n"]
    ):
        spans.append("window")
    for span in spans:
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


def drawn_texts(driver: Any, selector: str) -> list[str]:
    """The texts as drawn (``innerText``, as Selenium's ``.text``) of the elements
    ``selector`` finds, read in one script: the page redraws its tables each refresh, so
    elements found in one call can be gone by the next."""
    found: list[str] = driver.execute_script(
        f"return [...document.querySelectorAll({selector!r})].map(e => e.innerText.trim())")
    return found


def text(driver: Any, element_id: str) -> str:
    """An element's text as written (``.text`` is as drawn: the titles are upper case)."""
    found: str = driver.execute_script(f"return document.getElementById({element_id!r}).textContent")
    return found


def assert_spans_named_alike(driver: Any) -> None:
    """The percentiles' title names the spans its columns show, and the tiles and the
    table say the span they lead with."""
    title = text(driver, "window-label")
    columns = driver.execute_script(
        "return [...document.querySelectorAll('#pct tr:first-child th[colspan]')]"
        ".map(e => e.textContent)"
    )
    assert columns and all(c in title for c in columns), (title, columns)
    lead = columns[0]
    labels = driver.execute_script(
        "return [...document.querySelectorAll('.tile span:nth-child(2)')].map(e => e.textContent)"
    )
    assert len(labels) == 6
    in_flight = "in flight · now, every route and model"  # the gauge has only the upstream
    assert all(text.endswith(f" · {lead}") or text == in_flight for text in labels), labels
    assert text(driver, "by-span") == f"({lead})"


def table(driver: Any) -> list[dict[str, str]]:
    """The rows of the table by upstream and model, by column name, as displayed."""
    rows: list[dict[str, str]] = driver.execute_script(
        "const t = document.querySelector('#by');"
        "const head = [...t.rows[0].cells].map(c => c.textContent);"
        "return [...t.querySelectorAll('tr.pick')]"
        ".map(tr => Object.fromEntries([...tr.cells].map((c, i) => [head[i], c.textContent])))"
    )
    return rows


def assert_row_equals_metrics(row: dict[str, str], snap: promscrape.Snapshot) -> None:
    labels = {"upstream": row["upstream"], "model": row["model"]}
    if "route" in row:
        labels["route"] = row["route"]
    where = promscrape.label_filter(**labels)
    assert float(row["requests"]) == promscrape.total(snap, promscrape.REQUESTS, where) > 0
    ttft = promscrape.histogram(snap, promscrape.TTFT, where)
    assert_ms(row["TTFT p50 ms"], ttft.quantile(0.5))
    assert_ms(row["TTFT p95 ms"], ttft.quantile(0.95))
    first_answer = promscrape.histogram(snap, FIRST_ANSWER, where)
    assert_ms(row["first answer p50 ms"], first_answer.quantile(0.5))
    assert_ms(row["ITL p50 ms"], promscrape.histogram(snap, promscrape.ITL, where).quantile(0.5))
    decode = 1 / promscrape.histogram(snap, promscrape.TPOT, where).quantile(0.5)
    assert abs(float(row["decode tok/s"]) - decode) <= 0.5, (row, decode)
    outcomes = promscrape.by_label(snap, promscrape.OUTCOMES, "outcome", where)
    left = ("completed", "client_disconnected", "client_stalled")
    errors = sum(v for k, v in outcomes.items() if k not in left)
    assert float(row["errors"].partition(" ")[0]) == errors
    # The prompt-cache doctor's missed tokens over the prompt tokens, as the page rounds.
    missed = promscrape.total(snap, "llm_proxy_prompt_cache_missed_tokens_total", where)
    prompt = promscrape.histogram(snap, "llm_proxy_prompt_tokens", where).sum
    assert prompt > 0 and row["missed cache"].endswith("%"), row
    assert abs(float(row["missed cache"].rstrip("%")) - 100 * missed / prompt) <= 0.5


BREAKS = "llm_proxy_prompt_prefix_breaks_total"


def assert_prompt_cache_equals_metrics(
    figures: dict[str, str], snap: promscrape.Snapshot, **labels: str
) -> None:
    """The "Prompt caching" panel since start (the page opened before any traffic, and
    shows no minute yet) equals ``/metrics`` for ``labels``: each kind of token as a
    share of the prompt tokens, as the page rounds it, and each break reason listed with
    the count of ``llm_proxy_prompt_prefix_breaks_total``, the most frequent first (the
    reasons are of the span the page leads with: checked while that holds the whole run)."""
    where = promscrape.label_filter(**labels)
    prompt = promscrape.histogram(snap, "llm_proxy_prompt_tokens", where).sum
    assert prompt > 0
    for key, value in (
        ("repeated", promscrape.total(snap, "llm_proxy_prompt_repeated_tokens_total", where)),
        ("cached", promscrape.histogram(snap, "llm_proxy_cached_prompt_tokens", where).sum),
        ("missed", promscrape.total(snap, "llm_proxy_prompt_cache_missed_tokens_total", where)),
    ):
        shown_share = figures[f"pc.total.{key}.share"]
        assert abs(float(shown_share.rstrip("%")) - 100 * value / prompt) <= 0.5, (key, shown_share)
    if "pc.window.prompt.share" in figures and figures["window.ttft.n"] != figures["total.ttft.n"]:
        return
    counts = promscrape.by_label(snap, BREAKS, "reason", where)
    listed = [(figures[f"pc.break.{i}"], float(figures[f"pc.break.{i}.count"]))
              for i in range(4) if f"pc.break.{i}" in figures]
    assert listed and [c for _, c in listed] == sorted((c for _, c in listed), reverse=True)
    assert all(counts[reason] == count for reason, count in listed), (listed, counts)
    assert len(listed) == min(4, sum(1 for v in counts.values() if v > 0))


def assert_card_equals_diagnose(figures: dict[str, str], text: str, **labels: str) -> None:
    """The "What to fix" card: for each selection it lists, the levers worth acting on,
    in order, with the milliseconds each saves, are ``diagnose``'s from ``/metrics``
    (its text, read as the command reads it) for the same labels."""
    from proxy import evidence
    from proxy.diagnosis import levers

    found = {
        (d.route, d.model, d.upstream): d
        for d in map(levers.diagnose, evidence.evidence(evidence.read_snapshot(promscrape.parse(text)), **labels))
    }
    shown_keys = [figures[k] for k in sorted(figures) if k.startswith("fix.") and k.endswith(".key")]
    decided = 0
    assert shown_keys and len(shown_keys) == min(4, len(found))
    for n, key in enumerate(figures[f"fix.{i}.key"] for i in range(len(shown_keys))):
        route, model, upstream = key.split(" (")[0].strip().split(" · ")
        expected = [lv for lv in found[(route, model, upstream)].levers if lv.status == "lever"]
        listed = [figures[f"fix.{n}.lever.{i}"] for i in range(len(expected) + 1)
                  if f"fix.{n}.lever.{i}" in figures]
        assert listed == [lv.name for lv in expected], (key, listed)
        decided += len(found[(route, model, upstream)].levers) - sum(
            lv.status == "too_little_data" for lv in found[(route, model, upstream)].levers)
        for i, lever in enumerate(expected):
            # The page draws diagnose --json's figure (to 0.1 ms) in whole milliseconds.
            saved = figures[f"fix.{n}.lever.{i}.saves_ms"].split()[1]
            assert abs(float(saved) - lever.as_json()["saves_ms"]) <= 0.5, (key, lever.name, saved)
    assert decided > 0  # some lever had the data to be judged


def choose(driver: Any, name: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, name)).select_by_value(value)
    wait_for(driver, f"JSON.parse(document.body.dataset.selection || '{{}}').{name} === {value!r}")
    next_refresh(driver)


def test_live_page_draws_the_proxys_figures_in_a_real_browser(tmp_path: Path) -> None:
    with live_stack(cloud=CLOUD) as stack, chrome() as driver:
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
        # The card's busiest selection with the streams a lever needs (levers.MIN_REQUESTS).
        wait_for(driver, "+((document.querySelector('[data-k=\"fix.0.key\"]') || {}).textContent"
                 " || '(0 requests)').match(/\\((\\d+) requests/)[1] >= 25", timeout=90)

        snap = stack.workload.pause(stack.metrics_url)
        next_refresh(driver)
        everything = shown(driver)
        assert_page_equals_metrics(everything, snap)
        assert_spans_named_alike(driver)
        rows = table(driver)
        # Two upstreams, one model each, two routes: a row per upstream, model and route.
        assert {(r["upstream"], r["model"], r["route"]) for r in rows} == {
            (upstream, model, route)
            for upstream, model in (("local", "sim-small"), ("cloud", "sim-large"))
            for route in ("/v1/chat/completions", "/v1/completions")
        }
        requests = [float(r["requests"]) for r in rows]
        assert requests == sorted(requests, reverse=True)
        for row in rows:
            assert_row_equals_metrics(row, snap)
        assert_prompt_cache_equals_metrics(everything, snap)
        metrics_text = httpx.get(stack.metrics_url).text
        assert_card_equals_diagnose(everything, metrics_text)
        by_upstream = {r["upstream"]: r for r in rows if r["route"] == "/v1/chat/completions"}
        ttft = {k: float(r["TTFT p50 ms"]) for k, r in by_upstream.items()}
        assert ttft["cloud"] > ttft["local"]

        choose(driver, "model", "sim-large")
        large = shown(driver)
        assert_page_equals_metrics(large, snap, model="sim-large")
        assert float(large["total.requests"]) < float(everything["total.requests"])
        assert large["total.ttft.mean"] != everything["total.ttft.mean"]
        slowest = drawn_texts(driver, "#slow td:nth-child(3)")
        assert slowest and set(slowest) == {"sim-large"}

        choose(driver, "route", "/v1/completions")
        assert_page_equals_metrics(shown(driver), snap, model="sim-large", route="/v1/completions")
        assert "route=%2Fv1%2Fcompletions" in driver.current_url

        # A row of the table: its upstream, model and route become the selection.
        pick = {"route": "/v1/chat/completions", "model": "sim-small", "upstream": "local"}
        for _ in range(10):  # the page redraws its table each refresh: find the row again
            try:
                row = next(
                    tr
                    for tr in driver.find_elements("css selector", "#by tr.pick")
                    if [td.text for td in tr.find_elements("css selector", "td")][:3]
                    == [pick["upstream"], pick["model"], pick["route"]]
                )
                row.click()
                break
            except StaleElementReferenceException:
                continue
        else:
            pytest.fail("the table's row went stale ten times in a row")
        wanted = json.dumps(json.dumps(pick, separators=(",", ":")))
        wait_for(driver, f"document.body.dataset.selection === {wanted}")
        next_refresh(driver)
        assert {s: driver.find_element("id", s).get_attribute("value") for s in pick} == pick
        assert driver.current_url.endswith(
            "/ui?route=%2Fv1%2Fchat%2Fcompletions&model=sim-small&upstream=local"
        )
        picked = shown(driver)
        assert_page_equals_metrics(picked, snap, **pick)
        assert_prompt_cache_equals_metrics(picked, snap, **pick)
        assert_card_equals_diagnose(picked, metrics_text, **pick)
        # Its chat requests put a time first in the system prompt: the doctor's break,
        # with its position, as the latest example of this process says it.
        reasons = [picked[f"pc.break.{i}"] for i in range(4) if f"pc.break.{i}" in picked]
        i = reasons.index("variable_before_stable")
        assert picked[f"pc.break.{i}.sentence"].startswith("Message 0 (system) changes in bytes 0-")
        chosen = drawn_texts(driver, "#by tr.on td")
        assert chosen[:3] == ["local", "sim-small", "/v1/chat/completions"]

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


def test_the_page_says_which_span_it_shows(tmp_path: Path) -> None:
    """Since start at once on a busy proxy, then the last minute once there is one,
    every label agreeing with the figures under it."""
    clock = Clock(700.0)
    app = create_app(Settings(upstream_name="up"), registry=CollectorRegistry())
    assert app.metrics is not None and app.ui is not None
    app.ui = LivePage(app.ui.data.registry, clock=clock)  # the proxy's page, its clock scripted
    for i in range(5):  # served before the page was first opened
        app.metrics.observe(record(i), measured=True)
    clock.now = 1000.0  # five minutes later
    with serve_in_thread(app, http="httptools") as server, chrome() as driver:
        driver.get(server.url + "/ui")
        wait_for(driver, "+document.body.dataset.refreshes >= 1")
        first = shown(driver)
        # The first answer already has figures: since start, and says so.
        assert first["total.requests"] == "5" and first["total.requests_per_s"] == "0.02"
        assert first["total.cache_hit_ratio"] == "25%"
        assert not [k for k in first if k.startswith("window.")]
        assert text(driver, "window-label") == "(since start; the last minute in 58 s)"
        assert_spans_named_alike(driver)

        clock.now += 1.0  # a second later the page polls again: the ring's second reading
        next_refresh(driver)
        for i in range(3):
            app.metrics.observe(record(10 + i), measured=True)
        clock.now += 60.0
        next_refresh(driver)
        minute = shown(driver)
        assert text(driver, "window-label") == "(last minute and since start)"
        assert_spans_named_alike(driver)
        # The requests tile, labelled with the last minute, counts the last minute.
        tile = driver.find_element("css selector", "[data-k='window.requests']")
        labels = [e.text for e in tile.find_elements("xpath", "following-sibling::span")]
        assert (tile.text, labels) == ("3", ["requests · last minute", "since start 8"])
        assert (minute["window.ttft.n"], minute["total.ttft.n"]) == ("3", "8")
        assert table(driver)[0]["requests"] == "3"
        legends = driver.execute_script(
            "return [...document.querySelectorAll('[data-chart=ttft-hist] text.legend')]"
            ".map(e => e.textContent)"
        )
        assert legends == ["last minute", "since start"]
        assert console_errors(driver) == []


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
