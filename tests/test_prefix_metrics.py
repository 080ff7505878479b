"""The prompt-cache doctor's metrics observe its findings a batch at a time: held at each
request's finish, observed before any collection (a scrape, the live page's restricted
reading), at a batch's size, a moment after the first, and at once where no event loop
runs (at shutdown: ``test_prefix_proxy.py``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.config import TOKEN_BUCKETS
from proxy.doctor import metrics as doctor_metrics
from proxy.doctor.metrics import FLUSH_EVERY, PrefixMetrics
from proxy.doctor.report import TokenRules
from proxy.measure import PrefixRecord
from proxy.metrics import Metrics, MetricsOptions

pytestmark = pytest.mark.anyio

KEY = ("/v1/chat/completions", "m", "up")
REPEATED = "llm_proxy_prompt_repeated_tokens_total"


def finding(tokens: int = 100) -> tuple[PrefixRecord, int, None]:
    """A finding whose usage (no cached field) gives ``tokens`` repeated, half the
    prompt: the arguments of :meth:`PrefixMetrics.hold` after the key."""
    rules = TokenRules(4000, 2000, False, 0, 1)
    found = PrefixRecord(4000, 2000, "system_changed", "system", 0, 0, rules=rules)
    return found, 2 * tokens, None


def observed(metrics: PrefixMetrics) -> float:
    """The counter's value as it stands, without a collection (which would flush)."""
    return float(metrics.repeated_tokens.labels(*KEY)._value.get())


async def test_findings_wait_for_a_collection_which_sees_them_all() -> None:
    registry = CollectorRegistry()
    metrics = PrefixMetrics(registry, ("route", "model", "upstream"), TOKEN_BUCKETS)
    for _ in range(3):
        metrics.hold(KEY, *finding())
    assert observed(metrics) == 0  # held
    assert registry.get_sample_value(REPEATED, dict(zip(("route", "model", "upstream"), KEY,
                                                        strict=True))) == 300
    restricted = registry.restricted_registry([REPEATED])  # as the live page reads
    metrics.hold(KEY, *finding(5))
    (family,) = [f for f in restricted.collect() if f.name == REPEATED.removesuffix("_total")]
    assert [s.value for s in family.samples if s.name == REPEATED] == [305]


async def test_a_full_batch_is_observed_at_once_and_the_rest_a_moment_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(doctor_metrics, "FLUSH_AFTER_S", 0.0)  # at the loop's next turn
    metrics = PrefixMetrics(CollectorRegistry(), ("route", "model", "upstream"), TOKEN_BUCKETS)
    for _ in range(FLUSH_EVERY):  # the first starts the timer; the count comes first
        metrics.hold(KEY, *finding(1))
    assert observed(metrics) == FLUSH_EVERY
    metrics.hold(KEY, *finding(1))  # waits for the timer
    assert observed(metrics) == FLUSH_EVERY
    for _ in range(100):  # the timer's turn of the loop
        if observed(metrics) == FLUSH_EVERY + 1:
            break
        await asyncio.sleep(0)
    assert observed(metrics) == FLUSH_EVERY + 1


async def test_worker_processes_observe_each_finding_at_once(tmp_path: Path) -> None:
    """With workers, a scrape reads their files and cannot flush what one holds: so
    nothing is held, and a request counted has its finding in the files too."""
    metrics = Metrics(CollectorRegistry(), MetricsOptions(multiprocess_dir=str(tmp_path)))
    metrics.prefix.hold(KEY, *finding())
    assert observed(metrics.prefix) == 100


def test_without_an_event_loop_a_finding_is_observed_at_once() -> None:
    metrics = PrefixMetrics(CollectorRegistry(), ("route", "model", "upstream"), TOKEN_BUCKETS)
    metrics.hold(KEY, *finding())
    assert observed(metrics) == 100


def test_a_scrape_reads_the_request_count_before_the_doctors_findings() -> None:
    """A collection reads llm_proxy_requests_total before the doctor's metrics, whose
    collection observes what is held: every request a scrape counts has its findings in
    the same scrape."""
    metrics = Metrics(CollectorRegistry())
    names = [family.name for family in metrics.registry.collect()]
    assert names.index("llm_proxy_requests") < names.index("llm_proxy_prompt_repeated_tokens")


def test_a_batch_of_findings_observes_what_each_alone_would() -> None:
    """A flush gathers each label set's findings into one increment a bucket and counter:
    the samples are those of prometheus_client's own ``inc`` and ``observe`` per finding,
    whatever mix of label sets, breaks, usage, cache modes and findings not examined a
    batch holds."""
    from proxy.dialects import Caching

    other = ("/v1/completions", "m2", "up2")
    marked = TokenRules(3000, 2400, False, 1024, 128, Caching.MARKED, 1200)
    held = [
        (KEY, *finding(100)),
        (other, *finding(7)),
        (KEY, PrefixRecord(4000, 4000, rules=TokenRules(4000, 4000, False, 1024, 128)), 3000, 0),
        (KEY, PrefixRecord(4000, 1000, "first_seen", rules=TokenRules(4000, 1000, False, 0, 1)),
         900, 800),
        (other, PrefixRecord(3000, 2400, "message_changed", "message", 2, 512, "user",
                             rules=marked), 3000, 256),
        (other, PrefixRecord(3000, 0, "first_seen", rules=marked), 750, 0),
        (KEY, PrefixRecord.not_examined("busy"), 900, None),
        (KEY, PrefixRecord.not_examined("store_timeout", 0.25), 900, None),
        (KEY, PrefixRecord(0, 0, rules=TokenRules(0, 0, False, 0, 1)), 0, None),
        (KEY, PrefixRecord(4000, 2000, "system_changed", "system", 0, 0, index_s=0.002,
                           rules=TokenRules(4000, 2000, False, 0, 1)), 1000, 500),
    ]
    labels = ("route", "model", "upstream")
    together = PrefixMetrics(CollectorRegistry(), labels, TOKEN_BUCKETS)
    alone = PrefixMetrics(CollectorRegistry(), labels, TOKEN_BUCKETS, held=False)
    for key, p, prompt_tokens, cached_tokens in held:
        together.hold(key, p, prompt_tokens, cached_tokens)
        observe_alone(alone, key, p, prompt_tokens, cached_tokens)
    together.flush()

    def samples(metrics: PrefixMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in metrics.collect() for s in family.samples
                if not s.name.endswith("_created")}

    batched, each = samples(together), samples(alone)
    assert batched.keys() == each.keys()
    assert len(batched) > 40  # every metric has samples, both label sets
    for name, value in each.items():
        assert batched[name] == pytest.approx(value, abs=1e-9), name


def observe_alone(m: PrefixMetrics, key: tuple[str, str, str], p: PrefixRecord,
                  prompt_tokens: int | None, cached_tokens: int | None) -> None:
    """One finding through the metrics' public ``inc`` and ``observe``, as the HELP texts
    define them: the reference a flush must match."""
    if p.index_s is not None:
        result = ("timeout" if p.unchecked == "store_timeout"
                  else "error" if p.unchecked else "ok")
        m.index_seconds.labels(result).observe(p.index_s)
    if p.unchecked:
        m.unchecked.labels(*key, p.unchecked).inc()
        return
    repeated, missed, unmarked = p.tokens(prompt_tokens, cached_tokens)
    m.repeated_tokens.labels(*key).inc(repeated or 0)
    m.missed_tokens.labels(*key).inc(missed or 0)
    if p.prompt_bytes:
        m.repeated_ratio.labels(*key).observe(p.repeated_bytes / p.prompt_bytes)
    else:
        m.repeated_ratio.labels(*key)
    if missed is None:
        m.missed_per_request.labels(*key)
    else:
        m.missed_per_request.labels(*key).observe(missed)
    if unmarked is not None:
        m.unmarked_tokens.labels(*key).inc(unmarked)
    if p.break_reason:
        m.breaks.labels(*key, p.break_reason, p.break_part or "none").inc()
