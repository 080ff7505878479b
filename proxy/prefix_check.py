"""The prompt-cache doctor on the request path: when it looks, where it runs, and what
it hands the one finish.

The doctor itself (:mod:`proxy.diagnosis.prefix`) is pure: prompt parts in, a report
out, with an index of recent prompts' block keys as its one piece of state. This module
owns that state for the process (:class:`PrefixCheck`: the index, the hasher's random
per-process secret, the window) and runs one :class:`PrefixJob` per measured request.

* **Which requests.** Those the upstream accepted (a 2xx answer). A request refused (a
  429, a 400) or never delivered (connect refused, no free connection) left nothing in
  the upstream's cache; recording it would make the client's retry look like a missed
  cache.
* **When.** The job is created once the response headers are in, so hashing never runs
  before the request is on its way, and it runs once the upstream's **prefill of the
  prompt was done**: a sighting can serve another request only from then (two
  identical prompts in flight at once share nothing a cache could serve), so the index
  stamps this request's blocks at that time and reads others' at its arrival
  (:mod:`proxy.diagnosis.prefix_index`). That time is the stream's first output event
  (:attr:`proxy.measure.StreamTimer.first_t`, whose one-shot ``on_first`` hook calls
  :meth:`PrefixJob.ready`, so the per-event path gains nothing), a non-stream answer's
  response headers (a server sends them once it has the whole answer), and for a stream
  that ends without any output, its headers, at the finish; a stream the proxy does not
  meter (``--no-measure``) stands in its first body bytes, at the finish. The first
  token never waits for the job: it runs after it. Jobs run in **batches**, in the
  order they became ready: the first job of a batch schedules
  the batch :data:`BATCH_S` (200 ms) later, or at the loop's next turn once
  :data:`BATCH_JOBS` jobs, or :data:`BATCH_BLOCKS` of their estimated blocks, wait. The
  reason is the CPU's caches. At the 64-stream benchmark the proxy is busy about a
  fifth of the time, and code that runs once between waits runs cold: timed inside the
  running proxy (``benchmarks/timing_shim``), one small prompt's look took about 160
  us alone, against about 13 us in a tight loop, and about 50 us in batches of a dozen
  (``benchmarks/RESULTS.md``, "the doctor in batches"). A batch holds the loop for at
  most :data:`BATCH_JOBS` small prompts (a fraction of a millisecond) or about
  :data:`BATCH_BLOCKS` of work plus one prompt, like one inline prompt of that size.
  Nothing waits for a batch but the record: a request that finishes before its batch
  ran runs the batch at its finish (:meth:`PrefixJob.settle`), so the order stays the
  order of readiness. Only jobs that run on the loop are batched: one for a thread (a
  large prompt, or a shared index) is handed over at the request's next wait, as it
  comes. A batch of large prompts would keep the hashing thread on the interpreter
  lock for tens of milliseconds in a row, and the loop waits for it up to the switch
  interval each time: with 32 KB prompts at 64 streams, added ITL p99 went from 3.3 to
  6.0 ms in the run that found it.
* **Where.** The cost of a look follows the prompt's parts and blocks, not its bytes:
  each part is built, hashed and looked up on its own (an empty message costs more
  than a block of text), and building the parts is itself a loop over the body's
  items. So the place is decided before any part is built, from an estimate that reads
  no item (:meth:`PrefixCheck.estimate`: the arrays' lengths, one part each, plus the
  body's bytes over the block size; never fewer blocks than the prompt will have). A
  prompt of up to :data:`INLINE_MAX_BLOCKS` is examined on the event loop (tens of
  microseconds); a larger one in one worker thread, so that a 400 KB prompt, or
  thousands of empty messages in a few kilobytes, does not hold every other stream's
  next event for the whole time. A prompt whose keys would pass the per-request cap
  (:attr:`PrefixCheck.max_keys`: the shared index's :data:`~proxy.prefix_store.MAX_KEYS`,
  and in process at most an eighth of the index, :data:`INDEX_SHARE`) is not examined
  at all (``too_large``): it would cost seconds of hashing and push out of the index
  the prompts every other request repeats. The hashing is Python around a C hash of
  256-byte pieces, too small for hashlib to release the GIL, so the thread still
  shares the interpreter with the loop: the loop gets it back at least every
  switch interval, ``sys.getswitchinterval()``. At most
  :data:`MAX_PENDING` prompts wait for the thread; a request beyond that is not
  examined (a rate-limited warning says so), so a burst of huge prompts never queues
  work or memory without bound. ``benchmarks/prefix_offload.py`` prices both ways per
  prompt size, which is where the threshold comes from, and the loop's cost of hostile
  bodies (many empty messages, tools or content parts).
* **The finish.** :meth:`PrefixJob.settle` runs when the answer was relayed, before the
  record: it examines a prompt whose job never got its turn (an answer relayed without
  a single wait), and waits, at most :data:`SETTLE_S`, for a thread still hashing (an
  answer faster than its prompt's hashing: an immediate error, a one-token answer to a
  huge prompt); past that the record has no prefix fields. Only the stream's final
  empty chunk can wait for it, never a byte of the answer. :meth:`PrefixJob.record`
  combines the report with the usage: tokens at the request's own ratio, the cached
  tokens the upstream reported (None when its usage does not carry the field: unknown,
  never 0), and the upstream's minimum cacheable length and caching step.
* **Failures** never reach the request: a doctor that raises gives no report and one
  warning with its traceback, then at most one line a minute.

One index per process, shared by every upstream: the upstream's name is in the scope of
every key (two upstreams never share a prefix), so one memory bound
(``--prefix-index-bytes``) serves them all, the least recently touched blocks go first
whichever upstream they came from, and a reload that adds or removes an upstream changes
nothing here. With ``--workers N`` each worker has its own index and sees only the
requests it serves; behind a load balancer, each replica likewise.

* **A shared index.** With the config file's ``[cache-index]`` table every process
  exchanges with one Redis or Valkey instead (:class:`~proxy.prefix_store.RedisPrefixIndex`),
  hashing with the secret every replica shares (:func:`proxy.cache_index.prefix_secret`).
  An exchange is a network round trip, so every job then runs in a thread: a large
  prompt in the hashing thread as above, any other in one of :data:`STORE_THREADS`
  threads (at most :data:`MAX_PENDING_SHARED` waiting), which only wait for the store,
  so that concurrent requests' round trips overlap and a slow store never holds the
  hashing of large prompts. The job still starts once the headers are in, so the round
  trip overlaps the upstream's answer; the finish waits for it at most :data:`SETTLE_S`,
  and a store that does not answer within its timeout fails the exchange sooner.
* **Requests not examined** are recorded as such, with the reason
  (:attr:`proxy.measure.PrefixRecord.unchecked`: the shared index was down, slow or
  failing, the prompt too large for it, the backlog full, the finish came first, the
  doctor failed), so that ``llm_proxy_prompt_prefix_unchecked_total`` says how much of
  the traffic the doctor's numbers leave out.

Time: the index takes integer milliseconds of the proxy's monotonic clock; a request's
arrival is when the proxy received it (``t0``), and its prefill was done at a time the
relay already read, so the doctor never reads the clock itself. A shared index answers
in that clock too, though it keeps the store's, and so reads the clock once per
exchange (:mod:`proxy.prefix_store` says why).

The order of the exchanges does not matter for what counts, the times do; but a
sighting counts only once it was written. A job becomes ready when its request's prefill
was done (save the two stand-ins at the finish), and this request's own first output
comes after its arrival, so its job is queued after every job whose prefill was done
before it arrived, and the batches keep that order. What can still be missing: a large
prompt still in the hashing thread (or a shared index's exchange still on its way) when
a small prompt that arrived after it was done is examined on the loop, which takes at
least that small request's first token; and a stream with no output, or one not
metered, which becomes ready only at its finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from proxy.cache_index import prefix_secret
from proxy.config import Settings
from proxy.diagnosis.prefix import (
    BYTES_PER_CACHED_KEY,
    PART_CACHE_KEYS,
    HashedPrompt,
    PrefixDoctor,
    PrefixPolicy,
    PrefixReport,
    PromptHasher,
    cache_granularity_tokens,
    cache_tokens,
    minimum_cacheable_tokens,
)
from proxy.diagnosis.prefix_index import (
    BYTES_PER_ENTRY,
    DEFAULT_HORIZON_MS,
    LruPrefixIndex,
    PrefixIndex,
)
from proxy.dialects import Dialect, cache_scope, part_bound
from proxy.measure import PrefixRecord
from proxy.prefix_store import (
    MAX_KEYS,
    STORE_DOWN,
    STORE_ERROR,
    STORE_TIMEOUT,
    TOO_LARGE,
    IndexUnavailable,
    RedisPrefixIndex,
)
from proxy.upstream_spec import UpstreamSpec

log = logging.getLogger("proxy")

# Estimated blocks (parts + body bytes / block) examined on the loop: about 40 KB of text
# in a few parts. The hashing thread's hand-offs cost more CPU than a look at such a
# prompt, its repeated parts taken from the hasher's cache (benchmarks/RESULTS.md,
# 2026-12-03); past BATCH_BLOCKS a job runs alone, at the loop's next turn.
INLINE_MAX_BLOCKS = 160
MAX_PENDING = 16  # large prompts waiting for, or in, the worker thread
STORE_THREADS = 4  # with a shared index: threads that exchange the other prompts
MAX_PENDING_SHARED = 256  # with a shared index: other prompts waiting for, or in, those
SETTLE_S = 0.5  # how long the finish waits for a thread still hashing
BATCH_S = 0.2  # how long the first job of a batch waits for others
BATCH_JOBS = 16  # jobs that run a batch at the loop's next turn
BATCH_BLOCKS = 80  # ... or estimated blocks
INDEX_SHARE = 8  # a prompt may hold at most 1/INDEX_SHARE of the in-process index
WARN_EVERY_S = 60.0

# Why a request answered 2xx was not examined (PrefixRecord.unchecked); the shared
# index's own reasons are proxy.prefix_store's.
BUSY = "busy"  # the backlog of the doctor's threads was full
LATE = "late"  # the finish came before the examination ended, and waited no longer
FAILED = "failed"  # the doctor raised (logged with its traceback)
UNCHECKED_REASONS = (STORE_DOWN, STORE_TIMEOUT, STORE_ERROR, TOO_LARGE, BUSY, LATE, FAILED)


class Place(enum.Enum):
    """Where a prompt is examined, decided from its estimated size before any part is
    built (:meth:`PrefixCheck.place`)."""

    INLINE = "inline"  # on the event loop, with its batch
    THREAD = "thread"  # in the hashing thread
    TOO_LARGE = "too_large"  # not at all: more keys than a request may hold


class Examination(NamedTuple):
    """One examination's result: the report (None: nothing to examine, or not examined),
    why it was not examined ("" when it was, or there was nothing to examine), and the
    shared index's round trip (None: in process, or nothing was sent), and the prompt's keys
    for the trace capture (:mod:`proxy.capture`), kept when the shared index failed: a
    trace written while the store is down still shares prefixes."""

    report: PrefixReport | None
    unchecked: str = ""
    index_s: float | None = None
    hashed: HashedPrompt | None = None  # the prompt's keys (digests, no text), for the trace


class PrefixCheck:
    """The process's doctor: its index, its policy, its worker threads.

    ``doctor`` replaces the default: with ``settings.cache_index``, a
    :class:`~proxy.prefix_store.RedisPrefixIndex` and the shared secret; else an
    :class:`LruPrefixIndex` bounded by ``--prefix-index-bytes``. Either forgets entries
    untouched for an hour or two windows, whichever is longer, so that an *expired*
    prefix can still be told from a new one.
    :attr:`max_keys` caps the keys one request may hold (beyond: ``too_large``).
    ``secret`` keys the hasher when the index is in process (random per process by
    default): worker processes that capture one trace share one, so equal prompts get
    equal keys in every worker. The shared index's secret (``LLM_PROXY_PREFIX_SECRET``)
    takes its place when the index is shared: it is the same on every replica.
    ``clock`` is the request path's monotonic clock (seconds), which every time given to
    :meth:`begin` and :meth:`PrefixJob.ready` reads; a shared index reads it once per
    exchange to send those times as ages.
    """

    def __init__(self, settings: Settings, doctor: PrefixDoctor | None = None, *,
                 secret: bytes | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        window_ms = round(settings.prefix_window * 1000)
        horizon_ms = max(DEFAULT_HORIZON_MS, 2 * window_ms)
        self.shared: RedisPrefixIndex | None = None
        if doctor is None:
            index: PrefixIndex
            if settings.cache_index is not None:
                index = self.shared = RedisPrefixIndex(settings.cache_index,
                                                       horizon_ms=horizon_ms,
                                                       window_ms=window_ms,
                                                       caller_clock=clock)
                hasher = PromptHasher(prefix_secret())
            else:
                # the hasher's cache of recent parts' keys (PART_CACHE_KEYS) comes out of
                # the same memory bound: a sixteenth of the index's entries, as keys
                bound = settings.prefix_index_bytes
                cached = min(PART_CACHE_KEYS, bound // BYTES_PER_ENTRY // 16)
                index = LruPrefixIndex(bound - cached * BYTES_PER_CACHED_KEY,
                                       horizon_ms=horizon_ms, window_ms=window_ms)
                hasher = PromptHasher(secret, part_cache_keys=cached)
            doctor = PrefixDoctor(index, hasher, policy=PrefixPolicy(window_ms=window_ms))
        elif isinstance(doctor.index, RedisPrefixIndex):
            self.shared = doctor.index
        self.doctor = doctor
        capacity = getattr(doctor.index, "capacity", None)
        self.max_keys = (min(MAX_KEYS, capacity // INDEX_SHARE)
                         if isinstance(capacity, int) and self.shared is None else MAX_KEYS)
        self._executor: ThreadPoolExecutor | None = None  # started by the first large prompt
        self._slots = threading.BoundedSemaphore(MAX_PENDING)
        self._store_executor: ThreadPoolExecutor | None = None  # with a shared index
        self._store_slots = threading.BoundedSemaphore(MAX_PENDING_SHARED)
        self._batch: list[PrefixJob] = []  # jobs created and not started, in order
        self._batch_blocks = 0
        self._batch_timer: asyncio.Handle | None = None
        self._lock = threading.Lock()
        self._warned_at = -math.inf
        self._held_back = 0
        self._traced = False

    def begin(self, dialect: Dialect | None, payload: Mapping[str, Any] | None,
              upstream: UpstreamSpec, t0: float, status: int, body_bytes: int, *,
              t_headers: float | None = None, stream: bool = False) -> PrefixJob | None:
        """A job for a request that arrived at ``t0`` and whose response headers arrived
        at ``t_headers`` (``t0`` when not given); None when there is nothing to examine
        (not a measured route, a body that is not a JSON object, an answer that is not
        2xx). A non-stream answer's job is ready at once, a ``stream``'s once its first
        output event calls :meth:`PrefixJob.ready` (see "When" above)."""
        if dialect is None or payload is None or not 200 <= status < 300:
            return None
        blocks = self.estimate(payload, body_bytes)
        place = self.place(blocks)
        headers_ms = round((t0 if t_headers is None else t_headers) * 1000)
        job = PrefixJob(self, dialect, payload, upstream, round(t0 * 1000), headers_ms,
                        blocks, offload=place is Place.THREAD)
        if place is Place.TOO_LARGE:
            job.skip(TOO_LARGE)
            return job
        if not stream:
            job.ready()
        return job

    def enqueue(self, job: PrefixJob, blocks: int) -> None:
        """Add a job that became ready (of ``blocks`` estimated blocks) to the batch, or
        hand it to a thread at the loop's next turn (see "When" above)."""
        loop = asyncio.get_running_loop()
        if job.offload or self.shared is not None:  # for a thread: handed over at once
            loop.call_soon(job.start)
            return
        batch = self._batch
        batch.append(job)
        self._batch_blocks += blocks
        if self._batch_blocks >= BATCH_BLOCKS or len(batch) >= BATCH_JOBS:
            if self._batch_timer is not None:
                self._batch_timer.cancel()
            self._batch_timer = loop.call_soon(self.run_batch)
        elif self._batch_timer is None:
            self._batch_timer = loop.call_later(BATCH_S, self.run_batch)

    def estimate(self, payload: Mapping[str, Any], body_bytes: int) -> int:
        """At least the blocks the prompt of ``payload`` (a body of ``body_bytes``) will
        be cut into, from the arrays' lengths and the body's size: each part is one block
        and one more per :attr:`PromptHasher.block_bytes` of its text, and a part's text
        is at most as long as its JSON (opaque parts are shorter). A body of few parts
        also counts the pieces they are built from one by one (content arrays, token ids:
        :func:`proxy.dialects.prompt.part_bound`), so that thousands of those in a few
        kilobytes go to the thread too."""
        return (part_bound(payload, walk_below=INLINE_MAX_BLOCKS)
                + body_bytes // self.doctor.hasher.block_bytes)

    def place(self, blocks: int) -> Place:
        """Where a prompt of ``blocks`` estimated blocks is examined: too large when its
        keys could pass :attr:`max_keys`, in the thread past :data:`INLINE_MAX_BLOCKS`,
        else on the loop. The keys are one a block, the chunks and three for the scope;
        a part has at most two chunks more than blocks and counts at least one block in
        the estimate, so ``4 * blocks + 3`` bounds them."""
        if 4 * blocks + 3 > self.max_keys:
            return Place.TOO_LARGE
        return Place.THREAD if blocks > INLINE_MAX_BLOCKS else Place.INLINE

    def run_batch(self) -> None:
        """Examine every job of the batch, in order."""
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
        batch, self._batch, self._batch_blocks = self._batch, [], 0
        for job in batch:
            job.start()

    def examine(self, dialect: Dialect, payload: Mapping[str, Any], upstream: str,
                model: str, cache_key: str, now_ms: int, held_ms: int | None = None
                ) -> PrefixReport | None:
        """The doctor's report (None: no prompt parts, or not examined); never raises."""
        return self.look(dialect, payload, upstream, model, cache_key, now_ms, held_ms).report

    def look(self, dialect: Dialect, payload: Mapping[str, Any], upstream: str,
             model: str, cache_key: str, now_ms: int, held_ms: int | None = None
             ) -> Examination:
        """The doctor's report for a request that arrived at ``now_ms`` and whose prefill
        was done at ``held_ms`` (``now_ms`` when not given), or why there is none; never
        raises."""
        shared = self.shared
        try:
            looked = self.doctor.look(dialect.prompt_parts(payload), upstream=upstream,
                                      model=model, cache_key=cache_key, now_ms=now_ms,
                                      held_ms=held_ms)
        except Exception as exc:
            if isinstance(exc, IndexUnavailable):  # the keys stay, for the trace
                hashed = exc.hashed if isinstance(exc.hashed, HashedPrompt) else None
                return Examination(None, exc.reason, exc.round_trip_s, hashed)
            self._warn("prompt-cache doctor failed; the request is not examined", trace=True)
            return Examination(None, FAILED)
        index_s = shared.round_trip_s() if shared is not None else None
        if looked is None:  # no prompt parts: nothing to examine
            return Examination(None, "", index_s)
        return Examination(looked[1], "", index_s, looked[0])

    def submit(self, work: Callable[[], Examination], *, large: bool = True
               ) -> Future[Examination] | None:
        """Run ``work`` in a worker thread: the hashing thread for a large prompt, else
        (with a shared index) one of the store's threads; None when that backlog is full
        (:data:`MAX_PENDING`, :data:`MAX_PENDING_SHARED`) or the check was closed."""
        slots = self._slots if large else self._store_slots
        if not slots.acquire(blocking=False):
            self._warn(f"prompt-cache doctor: {MAX_PENDING} large prompts already wait for "
                       "its thread; this request is not examined" if large else
                       f"prompt-cache doctor: {MAX_PENDING_SHARED} prompts already wait for "
                       "the shared index; this request is not examined")
            return None
        try:
            if large:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="prefix-doctor")
                executor = self._executor
            else:
                if self._store_executor is None:
                    self._store_executor = ThreadPoolExecutor(
                        STORE_THREADS, thread_name_prefix="prefix-store")
                executor = self._store_executor
            future = executor.submit(work)
        except RuntimeError:  # closed: shutting down
            slots.release()
            return None
        future.add_done_callback(lambda _: slots.release())
        return future

    def close(self) -> None:
        """Stop the worker threads; jobs still waiting for them, or for their batch,
        are dropped."""
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
        self._batch, self._batch_blocks = [], 0
        for executor in (self._executor, self._store_executor):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
        if self.shared is not None:
            self.shared.close()

    def _warn(self, message: str, *, trace: bool = False) -> None:
        """One line, the first failure with its traceback, then at most one a minute."""
        with self._lock:
            now = time.monotonic()
            if now - self._warned_at < WARN_EVERY_S:
                self._held_back += 1
                return
            held, self._held_back, self._warned_at = self._held_back, 0, now
            with_trace = trace and not self._traced
            self._traced = self._traced or with_trace
        also = f" ({held} more such lines held back)" if held else ""
        log.warning("%s%s", message, also, exc_info=with_trace)


class PrefixJob:
    """One request's examination: ready once (when its prefill was done), started once
    (with its batch, or at the finish), read once by the record (and by the trace
    capture: :attr:`hashed`)."""

    __slots__ = ("_blocks", "_check", "_dialect", "_future", "_headers_ms", "_held_ms",
                 "_minimum", "_now_ms", "_payload", "_result", "_started", "_step",
                 "_unchecked", "_upstream", "offload")

    def __init__(self, check: PrefixCheck, dialect: Dialect, payload: Mapping[str, Any],
                 upstream: UpstreamSpec, now_ms: int, headers_ms: int | None = None,
                 blocks: int = 0, *, offload: bool) -> None:
        self._check = check
        self._dialect = dialect
        self._payload = payload
        self._upstream = upstream
        self._minimum = 0  # the upstream's minimum cacheable tokens and caching step,
        self._step = 1  # for this model (set by the examination)
        self._now_ms = now_ms  # when the request arrived
        self._headers_ms = now_ms if headers_ms is None else headers_ms  # its headers' time
        self._held_ms: int | None = None  # when its prefill was done: ready from then
        self._blocks = blocks  # estimated (PrefixCheck.estimate): its weight in a batch
        self.offload = offload  # for the hashing thread (a large prompt)
        self._started = False
        self._future: Future[Examination] | None = None
        self._result: Examination | None = None
        self._unchecked = LATE  # what the record says when no examination came back

    def ready(self, t: float | None = None) -> None:
        """The upstream's prefill of this prompt was done at ``t`` (the request path's
        clock, seconds; None: at the response headers): from then its blocks count for
        requests that arrive later, and the job joins the batch (or goes to its thread).
        Only the first call counts. Called by the stream's timer on its first output
        event, inside the relay: it never raises."""
        if self._held_ms is not None:
            return
        self._held_ms = self._headers_ms if t is None else round(t * 1000)
        try:
            self._check.enqueue(self, self._blocks)
        except Exception:  # no running loop (closing); the finish starts it, if it comes
            self._check._warn("prompt-cache doctor: a job could not be queued", trace=True)

    def skip(self, reason: str) -> None:
        """Never examine this prompt; the record says why (``reason``)."""
        self._started = True
        self._unchecked = reason
        self._held_ms = self._headers_ms  # never queued: ready() has nothing to do

    def start(self) -> None:
        """Examine now on this thread, or hand the prompt to a worker thread (a large
        prompt, or any prompt when the index is shared: its exchange waits for the
        network)."""
        if self._started:
            return
        self._started = True
        if self.offload or self._check.shared is not None:
            self._future = self._check.submit(self._examine, large=self.offload)
            if self._future is None:
                self._unchecked = BUSY
        else:
            self._result = self._examine()

    def _examine(self) -> Examination:
        model, key = cache_scope(self._payload)
        spec, api = self._upstream, self._dialect.name
        # the upstream's caching rules, for the record (worked out here, in the batch)
        minimum, step = spec.min_cacheable_tokens, spec.cache_granularity_tokens
        self._minimum = minimum if minimum is not None else minimum_cacheable_tokens(api, model)
        self._step = step if step is not None else cache_granularity_tokens(api, model)
        return self._check.look(self._dialect, self._payload, spec.name, model, key,
                                self._now_ms, self._held_ms)

    async def settle(self) -> None:
        """Before the record: make ready a stream's job that saw no output event (its
        prefill counted as done at its headers); run the batch of a job that never got
        its turn (the jobs before it first); wait (at most :data:`SETTLE_S`) for one a
        worker thread is still on."""
        if self._held_ms is None and not self._started:
            self.ready()
        if not self._started:
            self._check.run_batch()
            self.start()  # not in the batch: a job for a thread, or the check was closed
        future = self._future
        if future is None or future.done():
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object) -> None:  # on the worker thread
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_resolve, waiter)

        future.add_done_callback(wake)
        await asyncio.wait({waiter}, timeout=SETTLE_S)

    @property
    def examination(self) -> Examination | None:
        """What came back (None: nothing yet, or nothing will)."""
        future = self._future
        if future is None:
            return self._result
        return future.result() if future.done() and not future.cancelled() else None

    @property
    def report(self) -> PrefixReport | None:
        examination = self.examination
        return examination.report if examination is not None else None

    @property
    def hashed(self) -> HashedPrompt | None:
        """The prompt's keys (digests, no text), once examined; None before, or when it
        was not."""
        examination = self.examination
        return examination.hashed if examination is not None else None

    def record(self, prompt_tokens: int | None, cached_tokens: int | None
               ) -> PrefixRecord | None:
        """The report in the record's terms, with the usage: ``prompt_tokens`` from the
        upstream (None when it did not say them, or they were estimated) and
        ``cached_tokens`` as it reported them (None: not reported). A request that was
        not examined gets a record that says why; one with nothing to examine, None."""
        examination = self.examination
        if examination is None:
            return PrefixRecord.not_examined(self._unchecked)
        if examination.unchecked:
            return PrefixRecord.not_examined(examination.unchecked, examination.index_s)
        report = examination.report
        if report is None:
            return None
        tokens = cache_tokens(report, prompt_tokens, cached_tokens,
                              minimum_tokens=self._minimum, granularity_tokens=self._step)
        return PrefixRecord(
            prompt_bytes=report.prompt_bytes, repeated_bytes=report.repeated_bytes,
            repeated_tokens=tokens.repeated, missed_tokens=tokens.missed,
            break_reason=report.reason or "", break_part=report.part or "",
            break_index=report.index, break_offset=report.offset,
            break_role=report.role or "", break_part_bytes=report.part_bytes,
            changed_bytes=report.changed_bytes, stable_bytes=report.stable_bytes,
            index_s=examination.index_s)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def prefix_check_from(settings: Settings, *, wanted: bool, secret: bytes | None = None,
                      clock: Callable[[], float] = time.perf_counter) -> PrefixCheck | None:
    """The doctor when it is on and someone reads what it finds (metrics, the request
    log or the trace: ``wanted``); else None, and the request path skips it."""
    if not (settings.prefix_doctor and wanted):
        return None
    return PrefixCheck(settings, secret=secret, clock=clock)
