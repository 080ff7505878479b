"""A failure after a label set's first request reaches the rules through a real
Prometheus: the proxy makes a label set's failure series at 0 with its first request
(``docs/dashboards.md``, "Series from zero"), because ``rate()`` and ``increase()``
count nothing of what a series held at its first scrape.

The stack: the simulator, ``serve`` in front of it, Debian's ``prometheus`` with the
shipped rules at 1 s. One stream is answered; once Prometheus has scraped it, the
simulator stops and the next stream is answered 502 (``upstream_unreachable``), which a
series born at that failure would hide from ``increase()`` and the error-ratio rule.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest

from tests.test_diagnose_e2e import (
    MODEL,
    prom_value,
    prometheus_scraping,
    proxy_in_front_of,
    wait_for,
)
from tests.test_observability import require_tool
from tests.test_prefill_truth import simulator_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SIMULATE = ["--itl", "0.002", "--jitter", "0", "--output-tokens", "3", "--output-dist",
            "fixed", "--seed", "1"]


def stream(proxy: str) -> int:
    body = {"model": MODEL, "stream": True, "max_tokens": 3,
            "messages": [{"role": "user", "content": "hello"}]}
    with httpx.stream("POST", proxy + "/v1/chat/completions", json=body, timeout=30) as r:
        r.read()
        return r.status_code


def test_a_failure_after_the_first_request_is_counted_by_increase(tmp_path: Path) -> None:
    require_tool("prometheus")
    with contextlib.ExitStack() as stack:
        simulator = contextlib.ExitStack()
        url = simulator.enter_context(simulator_process(*SIMULATE))
        proxy = stack.enter_context(proxy_in_front_of(url, tmp_path))
        prom = stack.enter_context(prometheus_scraping(proxy, tmp_path))
        assert stream(proxy) == 200
        on = f'model="{MODEL}", route="/v1/chat/completions"'
        wait_for("Prometheus to scrape the answered stream",
                 lambda: prom_value(prom, f'llm_proxy_requests_total{{{on}, code="200"}}') == 1)
        wait_for("the 502 series scraped at 0",
                 lambda: prom_value(prom, f'llm_proxy_requests_total{{{on}, code="502"}}') == 0)
        simulator.close()  # the upstream is gone: the next stream is the proxy's 502
        assert stream(proxy) == 502
        wait_for("Prometheus to scrape the failure",
                 lambda: prom_value(prom, f'llm_proxy_requests_total{{{on}, code="502"}}') == 1)
        failed = f'llm_proxy_requests_total{{{on}, code="502"}}'
        gained = prom_value(prom, f"sum(increase({failed}[1m]))")
        assert gained is not None and gained > 0.5
        outcome = (f'sum(increase(llm_proxy_stream_outcomes_total{{{on}, '
                   'outcome="upstream_unreachable"}[1m]))')
        assert (prom_value(prom, outcome) or 0.0) > 0.5
        ratio = f"upstream_model_route:llm_proxy_requests_errors:ratio_rate5m{{{on}}}"
        wait_for("the error-ratio rule to see the failure",
                 lambda: (prom_value(prom, ratio) or 0.0) > 0)
