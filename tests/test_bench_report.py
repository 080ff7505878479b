"""``bench --report`` and ``--compare``: the HTML report of a run.

* The report's arithmetic by hand: CDF points, the proxy's bucket shares, where the two
  differ most, the prefill slope, decode-rate bins.
* The page is self-contained: its policy allows only its own inlined script and style,
  it names no URL to load, and data cannot break out of its JSON element.
* A real run: a short bench through the proxy in front of the simulator, then a second
  one compared with the first, opened in headless chromium from the file: no console
  error, no request anywhere, every chart drawn, and the table's cells equal to the
  table the bench printed.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from proxy.bench import report
from proxy.bench.workload import Profile, iter_requests
from tests.browser import browser_missing, chrome, console_errors, requested_urls, wait_for


def request(i: int, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": i,
        "outcome": "completed",
        "ttft_s": 0.05 + 0.01 * i,
        "itl_s": [0.01, 0.02],
        "prompt_tokens": 100 * (i + 1),
        "cached_prompt_tokens": 0,
        "decode_rate_tok_s": 30.0,
    }
    out.update(kw)
    return out


def payload(requests: list[dict[str, Any]], **config: Any) -> dict[str, Any]:
    from proxy.bench.client import RequestResult
    from proxy.bench.stats import summarize

    results = [
        RequestResult(r["index"], "p", 0.0, r["outcome"], 200, 1.0, ttft_s=r["ttft_s"])
        for r in requests
    ]
    return {
        "config": {"model": "m", **config},
        "summary": summarize(results, 1.0).as_json(),
        "requests": requests,
    }


def test_cdf_points_are_every_value_or_evenly_spaced_ranks() -> None:
    assert report.cdf_points([3.0, 1.0, 2.0]) == [(1.0, 1 / 3), (2.0, 2 / 3), (3.0, 1.0)]
    many = report.cdf_points(float(i) for i in range(10_000))
    assert len(many) == report.MAX_POINTS
    assert many[0] == (0.0, 1 / 10_000) and many[-1] == (9999.0, 1.0)
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in itertools.pairwise(many))


def test_proxy_cdf_keeps_the_edges_around_the_observations() -> None:
    hist = {"count": 4, "buckets": [[0.01, 0], [0.05, 0], [0.1, 1], [0.2, 3], [0.5, 4], [1.0, 4]]}
    assert report.proxy_cdf(hist) == [(0.05, 0.0), (0.1, 0.25), (0.2, 0.75), (0.5, 1.0)]
    assert report.proxy_cdf(None) == [] and report.proxy_cdf({"count": 0, "buckets": []}) == []


def test_agreement_names_the_edge_where_client_and_proxy_differ_most() -> None:
    proxy = [(0.1, 0.5), (0.2, 1.0)]
    client = [0.05, 0.15, 0.15, 0.15]  # 1/4 at or below 0.1 (proxy: 1/2), all at 0.2
    assert report.agreement(client, proxy) == {
        "gap": -0.25,
        "at": 0.1,
        "client": 0.25,
        "proxy": 0.5,
    }
    assert report.agreement([0.05, 0.15], [(0.1, 0.5), (0.2, 1.0)])["gap"] == 0.0
    assert report.agreement([], proxy) is None and report.agreement(client, []) is None


def test_prefill_slope_by_cache_share() -> None:
    requests = [request(i, ttft_s=0.02 + 0.0001 * 100 * (i + 1)) for i in range(5)]
    requests += [
        request(
            10 + i, prompt_tokens=1000 * (i + 1), cached_prompt_tokens=900 * (i + 1), ttft_s=0.03
        )
        for i in range(3)
    ]
    requests += [request(20, outcome="http_error"), request(21, prompt_tokens=None)]
    out = report.prefill(requests)
    assert len(out["uncached"]["points"]) == 5 and len(out["cached"]["points"]) == 3
    assert out["uncached"]["fit"]["slope"] == pytest.approx(0.0001)  # 0.1 ms a token
    assert out["uncached"]["fit"]["intercept"] == pytest.approx(0.02)
    assert out["cached"]["fit"]["slope"] == pytest.approx(0.0)  # the cache flattens it
    assert report.fit([(1.0, 2.0), (1.0, 3.0)]) is None


def test_decode_rates_fall_in_bins_around_reading_pace() -> None:
    rates = [0.5, 4.9, 5.0, 19.0, 20.0, 21.0, 1000.0]
    counts = report.decode_rates(
        [request(i, decode_rate_tok_s=r) for i, r in enumerate(rates)]
        + [request(99, decode_rate_tok_s=None)]
    )
    edges = report.DECODE_BINS
    assert sum(counts) == len(rates)
    assert counts[0] == 1  # <= 1 tok/s
    assert counts[edges.index(5.0)] == 2  # 2-5, the upper edge included
    assert counts[edges.index(20.0)] == 2  # 10-20
    assert counts[edges.index(50.0)] == 1 and counts[-1] == 1


def test_the_report_is_self_contained_and_data_cannot_escape_its_element() -> None:
    hostile = "</script><script>alert(1)</script>{{js}}"
    html = report.build(
        payload([request(i) for i in range(3)], model=hostile),
        payload([request(i) for i in range(2)]),
        "before.json",
    )
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html)
    assert policy is not None
    assert "default-src 'none'" in policy[1] and "connect-src 'none'" in policy[1]
    assert "unsafe-inline" not in policy[1]
    assert html.count("<script") == 2 and "alert(1)</script>" not in html
    assert " src=" not in html and html.count("href=") == 1
    assert set(re.findall(r"https?://[^\s\"'`)]+", html)) == {"http://www.w3.org/2000/svg"}
    blob = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', html, re.S)
    assert blob is not None
    data = json.loads(blob[1])
    assert [r["name"] for r in data["runs"]] == ["this run", "before.json"]
    assert data["runs"][0]["settings"]["model"] == hostile
    assert data["runs"][0]["table"][0] == ["", "count", "mean ms", "p50 ms", "p90 ms", "p99 ms"]


def test_gaps_of_one_read_are_counted_for_the_note_under_the_itl_chart() -> None:
    assert report.same_read_share([0.0, 0.0, 0.01, 0.02]) == 0.5
    assert report.same_read_share([]) == 0.0
    view = report.run_view(payload([request(0, itl_s=[0.0, 0.01, 0.02, 0.03])]), "this run")
    assert view["cdf"]["itl"]["same_read"] == 0.25


@pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))
def test_errors_are_kinds_out_of_the_requests_sent_and_the_itl_chart_says_what_its_zeros_are(
    tmp_path: Path,
) -> None:
    runs = [request(i, itl_s=[0.0, 0.01, 0.02, 0.04]) for i in range(3)]
    runs.append(request(3, outcome="http_error", ttft_s=None, itl_s=[]))
    page = tmp_path / "report.html"
    page.write_text(report.build(payload(runs)))
    with chrome() as driver:
        driver.get(page.as_uri())
        wait_for(driver, "document.body.dataset.ready === '1'")
        rows = driver.execute_script(
            "return [...document.querySelectorAll('#errors tr')]"
            ".map(tr => [...tr.children].map(td => td.textContent))"
        )
        assert rows == [["", "kind", "requests"], ["this run", "client: http_error", "1"]]
        text = driver.execute_script(
            "return ['errors-note', 'itl-same-read']"
            ".map(id => document.getElementById(id).textContent)"
        )
        assert text[0] == "this run: 4 requests sent, 1 failed on the client side."
        assert text[1].startswith("this run: 25% of the client's gaps are 0: events that "
                                  "arrived in one read")
        ticks = driver.execute_script(
            "return [...document.querySelectorAll('[data-chart=itl-cdf] text')]"
            ".map(t => t.textContent)"
        )
        assert "10 ms" in ticks and "0.001 ms" not in ticks  # from the smallest gap above 0
        assert console_errors(driver) == []


def test_prompt_lengths_vary_within_the_range_and_fixed_ones_do_not_move() -> None:
    def lengths(profile: Profile) -> list[int]:
        it = iter_requests([profile], model="m", seed=5)
        return [len(next(it).body["messages"][0]["content"]) for _ in range(40)]

    varied = lengths(Profile("p", 50, 0, 8, prompt_tokens_max=2000))
    assert min(varied) < 500 * 4 and max(varied) > 1500 * 4 and max(varied) < 2100 * 4
    fixed = iter_requests([Profile("p", 300, 0, 8)], model="m", seed=5)
    again = iter_requests([Profile("p", 300, 0, 8, prompt_tokens_max=0)], model="m", seed=5)
    assert [next(fixed) for _ in range(5)] == [next(again) for _ in range(5)]
    with pytest.raises(ValueError):
        Profile("p", 300, 0, 8, prompt_tokens_max=100)


def test_bad_report_flags_are_refused_before_anything_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.cli import main

    nowhere = ["--base-url", "http://127.0.0.1:9/v1", "--requests", "1"]
    assert main(["bench", *nowhere, "--compare", "x.json"]) == 2
    assert "--compare needs --report" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"summary": 1}')
    assert (
        main(["bench", *nowhere, "--report", str(tmp_path / "r.html"), "--compare", str(bad)]) == 2
    )
    assert "not a bench --json file" in capsys.readouterr().err
    assert main(["bench", *nowhere, "--report", "r.html", "--compare", str(tmp_path / "no")]) == 2
    assert main(["bench", *nowhere, "--prompt-tokens", "100", "--prompt-tokens-max", "10"]) == 2
    assert not (tmp_path / "r.html").exists()


def printed_table(out: str) -> list[list[str]]:
    """The bench's table rows from its output: a name (maybe two words), five numbers."""
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[0] in ("TTFB", "TTFT", "first", "ITL", "TPOT", "total"):
            rows.append([" ".join(parts[:-5]), *parts[-5:]])
        if line.startswith("requests "):
            break
    return rows


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))
def test_report_of_a_real_run_opens_in_a_browser(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.cli import main
    from tests.browser import live_stack

    first, second = tmp_path / "first.json", tmp_path / "report.html"
    with live_stack() as stack:
        common = [
            "bench",
            "--base-url",
            stack.proxy.url + "/v1",
            "--model",
            "sim-small",
            "--requests",
            "24",
            "--concurrency",
            "4",
            "--max-tokens",
            "8",
            "--prompt-tokens",
            "50",
            "--prompt-tokens-max",
            "3000",
            "--no-progress",
        ]
        main([*common, "--json", str(first)])
        capsys.readouterr()
        main(
            [
                *common,
                "--seed",
                "1",
                "--reasoning",
                "--report",
                str(second),
                "--compare",
                str(first),
            ]
        )
        out = capsys.readouterr()
    table = printed_table(out.out)
    assert len(table) >= 6 and table[2][0] == "first answer"  # reasoning: the extra row
    assert f"report written to {second}" in out.err

    with chrome() as driver:
        driver.get(second.as_uri())
        wait_for(driver, "document.body.dataset.ready === '1'")
        charts = driver.execute_script(
            "return [...document.querySelectorAll('[data-chart]')].map(e => [e.dataset.chart, e.dataset.drawn])"
        )
        assert dict(charts) == {
            "ttft-cdf": "chart",
            "itl-cdf": "chart",
            "prefill": "chart",
            "decode": "chart",
        }
        # Both runs in the CDFs: two client curves and two sets of proxy bucket points.
        assert len(driver.find_elements("css selector", "[data-chart=ttft-cdf] g.series")) == 4
        assert driver.find_elements("css selector", "[data-chart=prefill] circle")
        shown = driver.execute_script(
            "return [...document.querySelectorAll('table[data-run=\"0\"] tr')].slice(1)"
            ".map(tr => [...tr.children].map(td => td.textContent))"
        )
        assert shown == table
        lines = driver.execute_script(
            "return document.querySelector('pre[data-run=\"0\"]').textContent"
        )
        assert lines.splitlines()[0] in out.out
        assert "largest difference" in driver.execute_script(
            "return document.getElementById('ttft-agreement').textContent"
        )
        assert console_errors(driver) == []
        assert set(requested_urls(driver)) == {second.as_uri()}
    data = json.loads(first.read_text())
    ttft = data["proxy"]["ttft"]
    assert ttft["buckets"] and ttft["buckets"][-1][1] == ttft["count"] == 24
    assert not math.isinf(ttft["buckets"][-1][0])
