"""The prompt-cache doctor's Prometheus metrics (:class:`PrefixMetrics`), observed a batch
of findings at a time.

Design: ``docs/design/doctor.md``.
"""

from __future__ import annotations

import asyncio
from collections import Counter as _Counter
from collections import deque
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

from proxy.buckets import observe_many
from proxy.config import OVERHEAD_BUCKETS
from proxy.measure import PrefixRecord
from proxy.metric_help import PREFIX_HELP

# Findings wait and are observed together: once this many wait, this long after the
# first of them, and before any collection of these metrics.
FLUSH_EVERY = 64
FLUSH_AFTER_S = 1.0

SHARE_BUCKETS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95,
                                    0.99, 1.0)

Key = tuple[str, str, str]  # (route, model, upstream)


def add(child: Counter, amount: float) -> None:
    """``child.inc(amount)`` for a labelled child and an ``amount`` known not negative,
    without the checks of either. The same internals as
    :func:`proxy.buckets.observe_many`."""
    try:
        value = child._value
    except AttributeError:  # pragma: no cover - a future prometheus_client
        child.inc(amount)
        return
    value.inc(amount)


class PrefixMetrics:
    """The doctor's metrics in ``registry``, labelled ``labels`` (route, model, upstream)
    and a reason where they have one. A finding (:meth:`hold`) waits for :meth:`flush`,
    which observes every waiting one: at :data:`FLUSH_EVERY` of them,
    :data:`FLUSH_AFTER_S` after the first (so a worker's files get them), before any
    collection of these metrics (one collector in the registry, for all of them), and at
    once without a running event loop, or not ``held`` (worker processes: a scrape reads
    their files, and cannot flush them). One finding alone, at its request's finish,
    costs several times its work: the code and the children it touches are cold
    (``docs/design/doctor.md``)."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, ...],
                 token_buckets: Sequence[float], *, held: bool = True) -> None:
        self._every = FLUSH_EVERY if held else 1
        self._due: deque[tuple[Key, PrefixRecord, int | None, int | None]] = deque()
        self._timer = False  # a flush is due FLUSH_AFTER_S after the first finding held
        self.repeated_tokens = Counter(
            "llm_proxy_prompt_repeated_tokens", PREFIX_HELP["repeated"], labels, registry=None)
        self.missed_tokens = Counter(
            "llm_proxy_prompt_cache_missed_tokens", PREFIX_HELP["missed"], labels, registry=None)
        self.unmarked_tokens = Counter(
            "llm_proxy_prompt_cache_missed_unmarked_tokens", PREFIX_HELP["unmarked"], labels,
            registry=None)
        self.breaks = Counter(
            "llm_proxy_prompt_prefix_breaks", PREFIX_HELP["breaks"], (*labels, "reason", "part"),
            registry=None)
        self.repeated_ratio = Histogram(
            "llm_proxy_prompt_repeated_prefix_ratio", PREFIX_HELP["ratio"], labels,
            buckets=SHARE_BUCKETS, registry=None)
        self.missed_per_request = Histogram(
            "llm_proxy_prompt_cache_missed_tokens_per_request", PREFIX_HELP["missed_hist"],
            labels, buckets=token_buckets, registry=None)
        self.unchecked = Counter(
            "llm_proxy_prompt_prefix_unchecked", PREFIX_HELP["unchecked"], (*labels, "reason"),
            registry=None)
        self.index_seconds = Histogram(
            "llm_proxy_prompt_prefix_index_seconds", PREFIX_HELP["index_seconds"], ("result",),
            buckets=OVERHEAD_BUCKETS, registry=None)
        # per label set: the ratio's child, then the tokens' children, each made when a
        # finding first has its figure (a series of unknowns is absent, never 0)
        self._children: dict[Key, list[Any]] = {}
        self._break_children: dict[tuple[str, ...], Counter] = {}
        self._unmarked_children: dict[Key, Counter] = {}  # breakpoint routes
        self._unchecked_children: dict[tuple[str, ...], Counter] = {}
        self._index_children: dict[str, Histogram] = {}  # made on first use: no samples
                                                         # while nothing is sent to a store
        # each metric in no registry: this collector collects them (collect, describe)
        self.metrics = (
            self.repeated_tokens, self.missed_tokens, self.unmarked_tokens, self.breaks,
            self.repeated_ratio, self.missed_per_request, self.unchecked, self.index_seconds)
        registry.register(self)

    def describe(self) -> list[Metric]:
        """The metrics' descriptions: the names the registry knows them by."""
        return [family for metric in self.metrics for family in metric.describe()]

    def collect(self) -> list[Metric]:
        """Every finding held observed, then the metrics."""
        self.flush()
        return [family for metric in self.metrics for family in metric.collect()]

    def hold(self, key: Key, finding: PrefixRecord, prompt_tokens: int | None,
             cached_tokens: int | None) -> None:
        """One request's finding, under its labels, with its usage (as
        :meth:`PrefixRecord.tokens` takes it), to observe at the next :meth:`flush`."""
        due = self._due
        due.append((key, finding, prompt_tokens, cached_tokens))
        if len(due) >= self._every:
            self.flush()
        elif not self._timer:
            try:
                asyncio.get_running_loop().call_later(FLUSH_AFTER_S, self._timed)
            except RuntimeError:  # no running loop: a caller outside the server
                self.flush()
            else:
                self._timer = True

    def _timed(self) -> None:
        self._timer = False
        self.flush()

    def flush(self) -> None:
        """Observe the waiting findings, oldest first, each label set's together: one
        increment a bucket, sum and counter touched (each takes a lock), not one each a
        finding. Any thread: the loop's, a scrape's (each finding is taken by one)."""
        due = self._due
        groups: dict[Key, _Group] = {}
        while due:
            try:
                key, p, prompt_tokens, cached_tokens = due.popleft()
            except IndexError:  # another thread took the last one
                break
            if p.index_s is not None or p.unchecked:
                self._observe_apart(key, p)
                if p.unchecked:
                    continue
            group = groups.get(key)
            if group is None:
                group = groups[key] = ([], [], [], [], [])
            ratios, repeated, missed, unmarked, breaks = group
            if p.prompt_bytes:
                ratios.append(p.repeated_bytes / p.prompt_bytes)  # p.repeated_share
            repeated_tokens, missed_tokens, unmarked_tokens = p.tokens(
                prompt_tokens, cached_tokens)
            if repeated_tokens is not None:
                repeated.append(repeated_tokens)
            if missed_tokens is not None:
                missed.append(missed_tokens)
            if unmarked_tokens is not None:
                unmarked.append(unmarked_tokens)
            if p.break_reason:
                breaks.append((p.break_reason, p.break_part or "none"))
        for key, group in groups.items():
            self._observe(key, *group)

    def _observe_apart(self, key: Key, p: PrefixRecord) -> None:
        """A finding's round trip to the shared index, or why it was not examined: one
        at a time (only with a shared index, or when the doctor could not look)."""
        if p.index_s is not None:
            result = ("timeout" if p.unchecked == "store_timeout"
                      else "error" if p.unchecked else "ok")
            hist = self._index_children.get(result)
            if hist is None:
                hist = self._index_children[result] = self.index_seconds.labels(result)
            hist.observe(p.index_s)
        if p.unchecked:
            why = (*key, p.unchecked)
            counter = self._unchecked_children.get(why)
            if counter is None:
                counter = self._unchecked_children[why] = self.unchecked.labels(*why)
            counter.inc()

    def _observe(self, key: Key, ratios: list[float], repeated: list[int],
                 missed: list[int], unmarked: list[int], breaks: list[tuple[str, str]]) -> None:
        """One label set's findings of a flush, gathered by :meth:`flush`."""
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = [self.repeated_ratio.labels(*key), None, None, None]
        ratio, repeated_child, missed_child, missed_hist = c
        observe_many(ratio, ratios)
        if repeated:
            if repeated_child is None:
                repeated_child = c[1] = self.repeated_tokens.labels(*key)
            if total := sum(repeated):
                add(repeated_child, total)
        if missed:
            if missed_child is None:
                missed_child = c[2] = self.missed_tokens.labels(*key)
                missed_hist = c[3] = self.missed_per_request.labels(*key)
            if total := sum(missed):
                add(missed_child, total)
            observe_many(missed_hist, missed)
        if unmarked:
            child = self._unmarked_children.get(key)
            if child is None:
                child = self._unmarked_children[key] = self.unmarked_tokens.labels(*key)
            child.inc(sum(unmarked))
        for labels, count in _Counter(breaks).items():
            reason = (*key, *labels)
            counter = self._break_children.get(reason)
            if counter is None:
                counter = self._break_children[reason] = self.breaks.labels(*reason)
            counter.inc(count)


# One label set's findings in a flush: repeated shares, repeated tokens, missed tokens,
# unmarked tokens, (break reason, part)
_Group = tuple[list[float], list[int], list[int], list[int], list[tuple[str, str]]]
