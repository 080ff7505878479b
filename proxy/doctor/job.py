"""The prompt-cache doctor on the request path: which requests it examines, when, and
where, and what it hands the one finish.

Design: ``docs/design/doctor.md``.
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

from proxy.dialects import Dialect, cache_scope, holds_media, part_bound
from proxy.doctor.examine import PrefixDoctor, PrefixPolicy, PrefixReport
from proxy.doctor.index import (
    BYTES_PER_ENTRY,
    DEFAULT_HORIZON_MS,
    DEFAULT_MAX_BYTES,
    DEFAULT_WINDOW_MS,
    LruPrefixIndex,
    PrefixIndex,
)
from proxy.doctor.keys import BYTES_PER_CACHED_KEY, PART_CACHE_KEYS, HashedPrompt, PromptHasher
from proxy.doctor.report import (
    TokenRules,
    cache_granularity_tokens,
    minimum_cacheable_tokens,
)
from proxy.doctor.shared_index import (
    MAX_KEYS,
    STORE_DOWN,
    STORE_ERROR,
    STORE_TIMEOUT,
    TOO_LARGE,
    CacheIndexSpec,
    IndexUnavailable,
    RedisPrefixIndex,
    prefix_secret,
)
from proxy.measure import PrefixRecord
from proxy.upstream_spec import UpstreamSpec

log = logging.getLogger("proxy")

# Estimated blocks (parts + body bytes / block) examined on the loop. The hashing
# thread's hand-offs cost more CPU than a look at a prompt of this size, its repeated
# parts taken from the hasher's cache (benchmarks/RESULTS.md,
# 2026-12-03); a body past it runs its batch at the loop's next turn, for the thread.
INLINE_MAX_BLOCKS = 160
MAX_PENDING = 16  # large prompts waiting for, or in, the hashing thread
STORE_THREADS = 4  # with a shared index: threads that exchange the other prompts
MAX_PENDING_SHARED = 256  # with a shared index: other prompts waiting for, or in, those
SETTLE_S = 0.5  # how long the finish waits for a thread still examining
BATCH_S = 0.5  # how long the first job of a batch waits for others
BATCH_JOBS = 48  # jobs that run a batch at the loop's next turn
BATCH_BLOCKS = 320  # ... or blocks of their bodies (bytes / block, and one a body),
BATCH_LEAST = 4  # a body counting at most 1/BATCH_LEAST of them (one alone runs cold)
BATCH_TURN_S = 0.0003  # a batch's turn on the loop; the jobs left run at the next turn
INDEX_SHARE = 8  # a prompt may hold at most 1/INDEX_SHARE of the in-process index
WARN_EVERY_S = 60.0

# Why a request answered 2xx was not examined (PrefixRecord.unchecked); the shared
# index's own reasons are proxy.doctor.shared_index's.
BUSY = "busy"  # the backlog of the doctor's threads was full
LATE = "late"  # the finish came before the examination ended, and waited no longer
FAILED = "failed"  # the doctor raised (logged with its traceback)
UNCHECKED_REASONS = (STORE_DOWN, STORE_TIMEOUT, STORE_ERROR, TOO_LARGE, BUSY, LATE, FAILED)

_new = tuple.__new__


class Place(enum.Enum):
    """Where a prompt is examined, decided from its estimated size before any part is
    built (:meth:`PrefixCheck.place`)."""

    INLINE = "inline"  # on the event loop, with its batch
    THREAD = "thread"  # in the hashing thread (a large prompt)
    SHARED = "shared"  # in a shared index's threads, which wait for the network
    TOO_LARGE = "too_large"  # not at all: more keys than a request may hold


class Examination(NamedTuple):
    """One examination's result: the report (None: nothing to examine, or not examined),
    why it was not examined ("" when it was, or nothing to examine), the shared index's
    round trip (None: in process, or nothing sent), the prompt's keys for the workload
    capture (kept when the shared index failed), and the record, with the rules that
    give its token figures from the usage (worked out in the batch, where it runs warm)."""

    report: PrefixReport | None
    unchecked: str = ""
    index_s: float | None = None
    hashed: HashedPrompt | None = None  # the prompt's keys (digests, no text), for the workload
    record: PrefixRecord | None = None


class _Lane:
    """The worker threads of one place, started by its first job, and the bound on the
    jobs waiting for, or in, them."""

    def __init__(self, threads: int, name: str, pending: int, full: str) -> None:
        self.threads, self.name, self.full = threads, name, full
        self.slots = threading.BoundedSemaphore(pending)
        self.executor: ThreadPoolExecutor | None = None

    def submit(self, work: Callable[[], Examination]) -> Future[Examination]:
        """Raises RuntimeError once closed."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
        return self.executor.submit(work)


class PrefixCheck:
    """The process's doctor: its index, its policy, its worker threads.

    Parameters:
        doctor: replaces the default one built from the parameters below.
        window_s: the cache window (``--prefix-window``).
        index_bytes: the in-process index's memory bound (``--prefix-index-bytes``).
        cache_index: the shared :class:`~proxy.doctor.shared_index.RedisPrefixIndex`
            (the config file's ``[cache-index]``), hashing with the secret every replica
            shares; None: an :class:`LruPrefixIndex` in process.
        env: holds that secret and the store's password variable (``cache_index`` only).
        secret: keys the hasher of an in-process index (random per process by default):
            worker processes that capture one workload share one.
        clock: the request path's monotonic clock (seconds), which every time given to
            :meth:`begin` and :meth:`PrefixJob.ready` reads.
        keep_keys: whether a job keeps its prompt's keys (:attr:`PrefixJob.hashed`) for
            the workload capture."""

    def __init__(
        self,
        doctor: PrefixDoctor | None = None,
        *,
        window_s: float = DEFAULT_WINDOW_MS / 1000,
        index_bytes: int = DEFAULT_MAX_BYTES,
        cache_index: CacheIndexSpec | None = None,
        env: Mapping[str, str] | None = None,
        secret: bytes | None = None,
        clock: Callable[[], float] = time.perf_counter,
        keep_keys: bool = True,
    ) -> None:
        self.keep_keys = keep_keys
        window_ms = round(window_s * 1000)
        horizon_ms = max(DEFAULT_HORIZON_MS, 2 * window_ms)
        self.shared: RedisPrefixIndex | None = None
        if doctor is None:
            index: PrefixIndex
            if cache_index is not None:
                index = self.shared = RedisPrefixIndex(
                    cache_index,
                    horizon_ms=horizon_ms,
                    window_ms=window_ms,
                    environ=env,
                    caller_clock=clock,
                )
                hasher = PromptHasher(prefix_secret(env or {}))
            else:
                # the hasher's cache of recent parts' keys (PART_CACHE_KEYS) comes out of
                # the same memory bound: a sixteenth of the index's entries, as keys
                bound = index_bytes
                cached = min(PART_CACHE_KEYS, bound // BYTES_PER_ENTRY // 16)
                index = LruPrefixIndex(
                    bound - cached * BYTES_PER_CACHED_KEY,
                    horizon_ms=horizon_ms,
                    window_ms=window_ms,
                )
                hasher = PromptHasher(secret, part_cache_keys=cached)
            doctor = PrefixDoctor(index, hasher, policy=PrefixPolicy(window_ms=window_ms))
        elif isinstance(doctor.index, RedisPrefixIndex):
            self.shared = doctor.index
        self.doctor = doctor
        capacity = getattr(doctor.index, "capacity", None)
        self.max_keys = (
            min(MAX_KEYS, capacity // INDEX_SHARE)
            if isinstance(capacity, int) and self.shared is None
            else MAX_KEYS
        )
        self._lanes = {
            Place.THREAD: _Lane(
                1,
                "prefix-doctor",
                MAX_PENDING,
                f"prompt-cache doctor: {MAX_PENDING} large prompts already "
                "wait for its thread; this request is not examined",
            ),
            Place.SHARED: _Lane(
                STORE_THREADS,
                "prefix-store",
                MAX_PENDING_SHARED,
                f"prompt-cache doctor: {MAX_PENDING_SHARED} prompts already "
                "wait for the shared index; this request is not examined",
            ),
        }
        self._batch: list[PrefixJob] = []  # jobs ready for the loop and not started, in order
        self._block_bytes = doctor.hasher.block_bytes
        self._batch_blocks = 0
        self._batch_timer: asyncio.Handle | None = None
        self._batch_soon = False  # the timer runs the batch at the loop's next turn
        self._lock = threading.Lock()
        self._warned_at = -math.inf
        self._held_back = 0
        self._traced = False

    def begin(
        self,
        dialect: Dialect | None,
        payload: Mapping[str, Any] | None,
        upstream: UpstreamSpec,
        t0: float,
        status: int,
        body_bytes: int,
        *,
        t_headers: float | None = None,
        stream: bool = False,
    ) -> PrefixJob | None:
        """A job for a request that arrived at ``t0`` and whose response headers arrived
        at ``t_headers`` (``t0`` when not given); None when there is nothing to examine
        (not a measured route, a body that is not a JSON object, an answer that is not
        2xx). A non-stream answer's job is ready at once, a ``stream``'s once its first
        output event calls :meth:`PrefixJob.ready`. Nothing is weighed here, on the way
        to the response's first bytes: the job's place is decided in its batch."""
        if dialect is None or payload is None or not 200 <= status < 300:
            return None
        job = PrefixJob(self, dialect, payload, upstream, t0, t_headers, body_bytes)
        if not stream:
            job.ready()
        return job

    def estimate(self, payload: Mapping[str, Any], body_bytes: int) -> int:
        """At least the blocks the prompt of ``payload`` (a body of ``body_bytes``) will
        be cut into, from the arrays' lengths and the body's size: each part is one block
        and one more per :attr:`PromptHasher.block_bytes` of its text, and a part's text
        is at most as long as its JSON. A body of few parts also counts the pieces they
        are built from (:func:`proxy.dialects.prompt.part_bound`)."""
        return (
            part_bound(payload, walk_below=INLINE_MAX_BLOCKS)
            + body_bytes // self._block_bytes
        )

    def place(self, blocks: int) -> Place:
        """Where a prompt of ``blocks`` estimated blocks is examined: too large when its
        keys could pass :attr:`max_keys`, in the hashing thread past
        :data:`INLINE_MAX_BLOCKS`, else with a shared index in its threads, else on the
        loop. The keys are one a block, the chunks and three for the scope; a part has
        at most two chunks more than blocks and counts at least one block in the
        estimate, so ``4 * blocks + 3`` bounds them."""
        if 4 * blocks + 3 > self.max_keys:
            return Place.TOO_LARGE
        if blocks > INLINE_MAX_BLOCKS:
            return Place.THREAD
        return Place.SHARED if self.shared is not None else Place.INLINE

    def enqueue(self, job: PrefixJob, body_bytes: int) -> None:
        """A job that became ready (of a body of ``body_bytes``): into the batch, which
        runs :data:`BATCH_S` after its first job, or at the loop's next turn once it
        holds :data:`BATCH_JOBS` jobs, :data:`BATCH_BLOCKS` blocks of their bodies
        (bytes over the block size, one more a body; at most a :data:`BATCH_LEAST` th of
        them a body, so that a large prompt does not run alone, cold:
        ``docs/design/doctor.md``) or a body bound for the hashing thread (past
        :data:`INLINE_MAX_BLOCKS`), and weighs its jobs first; one already weighed for
        a thread (with a shared index) is handed over at the loop's next turn."""
        place = job.place
        if place is not None and place is not Place.INLINE:
            asyncio.get_running_loop().call_soon(job.start)
            return
        batch = self._batch
        blocks = body_bytes // self._block_bytes
        counted = self._batch_blocks + _counted(blocks)
        soon = (counted >= BATCH_BLOCKS or len(batch) >= BATCH_JOBS - 1
                or blocks > INLINE_MAX_BLOCKS)
        timer = self._batch_timer
        if soon or timer is None:  # the loop looked up only then (a syscall: getpid)
            loop = asyncio.get_running_loop()  # raises before the job joins, if closed
            if soon:
                if timer is not None:
                    timer.cancel()
                self._batch_timer = loop.call_soon(self.run_batch)
                self._batch_soon = True
            else:
                self._batch_timer = loop.call_later(BATCH_S, self.run_batch)
        batch.append(job)
        self._batch_blocks = counted

    def run_batch(self, upto: PrefixJob | None = None) -> None:
        """Examine the batch's jobs, in order, for :data:`BATCH_TURN_S` of this turn of the
        loop and one job more, so that other streams' events wait no longer; the jobs
        left run at the loop's next turn, ahead of any that join meanwhile. ``upto``: a
        finish that needs that job examined (:meth:`PrefixJob.settle`): the turn also
        ends once it was, and the jobs after it keep their batch and its timer."""
        batch = self._batch
        clock = time.perf_counter
        until = clock() + BATCH_TURN_S
        n = 0
        for n, job in enumerate(batch, 1):
            job.start()
            if job is upto or (n < len(batch) and clock() > until):
                break
        rest = self._batch = batch[n:]
        if rest and upto is not None and upto._started:  # the rest waits as it did
            ran = sum(_counted(job._body_bytes // self._block_bytes) for job in batch[:n])
            self._batch_blocks = max(0, self._batch_blocks - ran)  # 0 once a turn was cut
            return
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
        self._batch_blocks = 0  # the rest runs next: its blocks not counted again
        self._batch_soon = bool(rest)
        if rest:
            try:
                self._batch_timer = asyncio.get_running_loop().call_soon(self.run_batch)
            except RuntimeError:  # no running loop: all of it now
                self._batch, self._batch_soon = [], False
                for job in rest:
                    job.start()

    def submit(
        self, work: Callable[[], Examination], place: Place = Place.THREAD
    ) -> Future[Examination] | None:
        """Run ``work`` on the worker threads of ``place``; None when their backlog is
        full (:data:`MAX_PENDING`, :data:`MAX_PENDING_SHARED`) or the check was closed."""
        lane = self._lanes[place]
        if not lane.slots.acquire(blocking=False):
            self._warn(lane.full)
            return None
        try:
            future = lane.submit(work)
        except RuntimeError:  # closed: shutting down
            lane.slots.release()
            return None
        future.add_done_callback(lambda _: lane.slots.release())
        return future

    def close(self) -> None:
        """Stop the worker threads; jobs still waiting for them, or for their batch,
        are dropped."""
        if self._batch_timer is not None:
            self._batch_timer.cancel()
            self._batch_timer = None
        self._batch_soon = False
        for job in self._batch:  # dropped: a finish that waits for one starts it itself
            if job._waiter is not None:
                _resolve(job._waiter)
        self._batch, self._batch_blocks = [], 0
        for lane in self._lanes.values():
            if lane.executor is not None:
                lane.executor.shutdown(wait=False, cancel_futures=True)
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
    (with its batch, on its place's threads, or at the finish), read once by the record
    (and by the workload capture: :attr:`hashed`)."""

    __slots__ = (
        "_body_bytes",
        "_check",
        "_dialect",
        "_future",
        "_headers",
        "_held",
        "_payload",
        "_result",
        "_started",
        "_t0",
        "_unchecked",
        "_upstream",
        "_waiter",
        "place",
    )

    def __init__(
        self,
        check: PrefixCheck,
        dialect: Dialect,
        payload: Mapping[str, Any],
        upstream: UpstreamSpec,
        t0: float,
        t_headers: float | None = None,
        body_bytes: int = 0,
        *,
        place: Place | None = None,
    ) -> None:
        self._check = check
        self._dialect = dialect
        self._payload = payload
        self._upstream = upstream
        # the request path's clock, in seconds (turned into the index's ms in the batch)
        self._t0 = t0  # when the request arrived
        self._headers = t0 if t_headers is None else t_headers  # its headers' time
        self._held: float | None = None  # when its prefill was done: ready from then
        self._body_bytes = body_bytes
        self.place = place  # None: decided by its estimate (weigh), in its batch
        self._started = False
        self._future: Future[Examination] | None = None
        self._result: Examination | None = None
        self._unchecked = LATE  # what the record says when no examination came back
        self._waiter: asyncio.Future[None] | None = None  # a finish waiting for its turn

    def ready(self, t: float | None = None) -> None:
        """The upstream's prefill of this prompt was done at ``t`` (the request path's
        clock, seconds; None: at the response headers): from then its blocks count for
        requests that arrive later, and the job joins the batch (or goes to its thread).
        Only the first call counts. Called by the stream's timer on its first output
        event, inside the relay: it never raises."""
        if self._held is not None:
            return
        self._held = self._headers if t is None else t
        check = self._check
        if check.shared is not None:  # every prompt goes to a thread: at once
            self.weigh()
        if self._started:  # weighed, too large
            return
        try:
            check.enqueue(self, self._body_bytes)
        except Exception:  # no running loop (closing); the finish starts it, if it comes
            check._warn("prompt-cache doctor: a job could not be queued", trace=True)

    def weigh(self) -> None:
        """Estimate the prompt's work and choose its place, once (in its batch, where the
        code runs warm, or when it is ready, with a shared index); a prompt too large is
        never examined."""
        if self.place is None:
            self.place = self._check.place(self._check.estimate(self._payload, self._body_bytes))
            if self.place is Place.TOO_LARGE:
                self._started = True
                self._unchecked = TOO_LARGE

    def start(self) -> None:
        """Run :meth:`examine` where the place says: now, on this thread, for the loop;
        else handed to the place's worker threads. A finish waiting for this job's turn
        (:meth:`settle`) is woken."""
        self.weigh()
        if self._waiter is not None:  # a finish waits for its turn (settle): it came
            _resolve(self._waiter)
        if self._started:
            return
        self._started = True
        place = self.place
        if place is Place.INLINE:
            self._result = self.examine()
            return
        assert place is not None  # weighed
        self._future = self._check.submit(self.examine, place)
        if self._future is None:
            self._unchecked = BUSY

    def examine(self) -> Examination:
        """Parts, keys, the index's exchange, the report, or why there is none; the one
        examination whatever the place. Never raises."""
        check, spec = self._check, self._upstream
        model, key = cache_scope(self._payload)
        held = self._held
        try:
            prompt = self._dialect.prompt(self._payload)
            looked = check.doctor.look(
                prompt.parts,
                upstream=spec.name,
                model=model,
                cache_key=key,
                now_ms=round(self._t0 * 1000),
                held_ms=None if held is None else round(held * 1000),
            )
        except IndexUnavailable as exc:  # the keys stay, for the workload capture
            keys = exc.hashed if check.keep_keys else None
            hashed = keys if isinstance(keys, HashedPrompt) else None
            return Examination(None, exc.reason, exc.round_trip_s, hashed)
        except Exception:
            check._warn("prompt-cache doctor failed; the request is not examined", trace=True)
            return Examination(None, FAILED)
        index_s = check.shared.round_trip_s() if check.shared is not None else None
        if looked is None:  # no prompt parts: nothing to examine
            return Examination(None, "", index_s)
        hashed, report = looked
        # the upstream's caching rules, for the record (worked out here, off the request)
        api = self._dialect.name
        minimum, step = spec.min_cacheable_tokens, spec.cache_granularity_tokens
        rules = TokenRules.of(
            report,
            minimum if minimum is not None else minimum_cacheable_tokens(api, model),
            step if step is not None else cache_granularity_tokens(api, model),
            prompt.caching,
            prompt.marked_bytes,
            media=holds_media(prompt.parts),
        )
        # every field, in PrefixRecord's order (break_*, then unchecked "", index_s,
        # rules): a C call, not the NamedTuple's frame
        record = _new(PrefixRecord, (
            report.prompt_bytes, report.repeated_bytes, report.reason or "", report.part or "",
            report.index, report.offset, report.role or "", report.part_bytes,
            report.changed_bytes, report.stable_bytes, "", index_s, rules))
        keys = hashed if check.keep_keys else None
        return _new(Examination, (report, "", index_s, keys, record))

    @property
    def settled(self) -> bool:
        """Examined, or handed to a thread that is done: :meth:`settle` has nothing to do
        (the finish asks this first, so that most requests make no coroutine of it)."""
        future = self._future
        return self._started and (future is None or future.done())

    async def settle(self) -> None:
        """Before the record: make ready a stream's job that saw no output event (its
        prefill counted as done at its headers); run the batch of a job that never got
        its turn up to it (the jobs before it first), a turn at a time; wait (at most
        :data:`SETTLE_S`) for one a worker thread is still on."""
        if self._held is None and not self._started:
            self.ready()
        check = self._check
        if not self._started and self in check._batch:
            if not check._batch_soon:  # one turn a loop's turn: another finish's may be due
                check.run_batch(self)
            if not self._started:  # its turn comes next, after the loop's other events
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
        if not self._started:
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
    def hashed(self) -> HashedPrompt | None:
        """The prompt's keys (digests, no text), once examined and if kept; else None."""
        examination = self.examination
        return examination.hashed if examination is not None else None

    @property
    def record(self) -> PrefixRecord | None:
        """The finding in the record's terms (its token figures worked out from the
        request's usage by whoever reads them: :meth:`PrefixRecord.tokens`). A request
        that was not examined gets a record that says why; one with nothing to examine,
        None."""
        examination = self.examination
        if examination is None:
            return PrefixRecord.not_examined(self._unchecked)
        if examination.unchecked:
            return PrefixRecord.not_examined(examination.unchecked, examination.index_s)
        return examination.record


def _counted(blocks: int) -> int:
    """What a body of ``blocks`` whole blocks counts toward :data:`BATCH_BLOCKS`."""
    return min(1 + blocks, BATCH_BLOCKS // BATCH_LEAST)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
