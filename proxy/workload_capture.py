"""The workload capture (``--workload-file``): the shape of the traffic, as it is served.

Design: ``docs/design/workload.md``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.line_writer import CLOSE_TIMEOUT_S, LineWriter
from proxy.measure import CHARS_PER_TOKEN, Outcome
from proxy.workload_file import DEFAULT_BLOCK_SIZE, WorkloadWriter, digest_id, token_block_keys

if TYPE_CHECKING:
    from proxy.doctor.job import PrefixJob
    from proxy.doctor.keys import HashedPrompt
    from proxy.measure import RequestRecord

log = logging.getLogger("proxy.workload")

DEFAULT_BUFFER = 10_000  # requests waiting for the writer thread
GATHER_S = 1.0  # how long the writer thread gathers a batch
MAX_PENDING_KEYS = 1 << 19  # prompt keys waiting with them (bounds the memory they hold)
PREFIX_CAPACITY = 65_536  # prefixes PrefixKeys remembers
MODEL_MAX = 256  # characters of a model name written
SHARED_ENV = "LLM_PROXY_WORKER_WORKLOAD"  # set by serve's supervisor for its workers
SKIP_REASONS = ("no_usage", "incomplete", "dropped")
_EPS = 1e-6  # bytes: a token block's end computed at the ratio, against an integer end


@dataclass(frozen=True, slots=True)
class Shared:
    """What every worker of one ``serve --workers`` capture shares: the workload's start
    (wall clock, seconds), its id namespace and the doctor's secret."""

    workload_id: str
    start_wall: float
    secret: bytes

    def encode(self) -> str:
        return json.dumps(
            {"workload_id": self.workload_id, "start": self.start_wall, "secret": self.secret.hex()}
        )

    @classmethod
    def decode(cls, text: str) -> Shared:
        data = json.loads(text)
        return cls(str(data["workload_id"]), float(data["start"]), bytes.fromhex(data["secret"]))

    @classmethod
    def new(cls, wall_clock: Callable[[], float] = time.time) -> Shared:
        return cls(secrets.token_hex(8), wall_clock(), secrets.token_bytes(32))


class PrefixKeys:
    """Token-block keys that stay shared as far as two prompts are equal
    (``docs/design/workload.md``, "Capture"). Remembers the keys of the last
    :data:`PREFIX_CAPACITY` prefixes (least recently used first out); one thread owns it."""

    def __init__(
        self, block_size: int = DEFAULT_BLOCK_SIZE, capacity: int = PREFIX_CAPACITY
    ) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError("block_size and capacity must be >= 1")
        self.block_size = block_size
        self.capacity = capacity
        # chain key -> (the keys of the request that left it, how many of its token
        # blocks end within that prefix, its input length)
        self._held: OrderedDict[bytes, tuple[tuple[Hashable, ...], int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def __call__(self, hashed: HashedPrompt, input_tokens: int,
                 bytes_per_token: float | None = None) -> tuple[Hashable, ...]:
        """The keys of a prompt of ``input_tokens``; ``bytes_per_token``: the ratio its
        text is placed with, where its tokens follow no bytes in proportion (media)."""
        chain = hashed.chain
        ends = hashed.block_ends()
        prompt_bytes = ends[-1] if ends else 0
        size = self.block_size
        keys = token_block_keys(chain, ends, prompt_bytes, input_tokens, size, bytes_per_token)
        if not keys:
            return ()
        count = len(keys)
        ratio = bytes_per_token or prompt_bytes / input_tokens
        token_ends = [(i + 1) * size * ratio for i in range(count - 1)]
        token_ends.append(float(prompt_bytes))  # the last block ends with the prompt
        held = self._held
        for j in range(len(chain) - 1, -1, -1):  # the longest prefix some request left
            found = held.get(chain[j])
            if found is None:
                continue
            held.move_to_end(chain[j])
            theirs, their_count, their_length = found
            shared = min(bisect_right(token_ends, ends[j] + _EPS), their_count)
            if (
                shared
                and input_tokens != their_length
                and shared * size > min(input_tokens, their_length)
            ):
                shared -= 1  # a partial last block equals only the same partial block
            keys[:shared] = theirs[:shared]
            break
        result = tuple(keys)
        last = len(chain) - 1
        marks = {min(bisect_left(ends, end - 1e-9), last) for end in token_ends}
        marks.update(first - 1 for first in hashed.first_block[1:])  # where parts end
        marks.add(last)
        for j in marks:
            held[chain[j]] = (result, bisect_right(token_ends, ends[j] + _EPS), input_tokens)
            held.move_to_end(chain[j])
        while len(held) > self.capacity:
            held.popitem(last=False)
        return result


def _keys_held(hashed: HashedPrompt | None) -> int:
    """The prompt keys a waiting line holds (the probe's: chain, chunks, scope), for
    MAX_PENDING_KEYS."""
    return len(hashed.keys) if hashed is not None else 0


# What the finish hands the writer: the record, its arrival, the model as sent, the keys.
_Item = tuple["RequestRecord", float, str, "HashedPrompt | None"]


class WorkloadCapture:
    """The workload capture of one process: :meth:`add` at each request's finish (never
    blocks), a writer thread, :meth:`close` at shutdown.

    ``path``: the workload file (``FILE.<pid>`` with ``per_process``, in one of several
    worker processes); ``skipped``: called with (reason, count) for requests that got no
    line (the metric); ``clock``: the request clock (``started`` times are read from it);
    ``shared``: a worker's workload start, id namespace and secret (:class:`Shared`;
    None: this process's own).
    """

    def __init__(
        self,
        path: str,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        rotate_bytes: int = 0,
        rotate_seconds: float = 0.0,
        client: bool = False,
        buffer: int = DEFAULT_BUFFER,
        per_process: bool = False,
        shared: Shared | None = None,
        skipped: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shared = shared
        self.base = f"{path}.{os.getpid()}" if per_process or shared is not None else path
        self._number = 0  # the last rotated file's number
        first = self.base
        if os.path.isfile(first) and os.path.getsize(first):
            # an earlier capture's lines: left as they are, this one starts in the first
            # free FILE.N, so that a file holds one id space and one timeline (as the
            # Mooncake readers take a file)
            first = self._free_name()
            log.warning("workload capture: %s holds an earlier capture; this one is "
                        "written to %s", self.base, first)
        start = (clock(), wall_clock())
        if shared is not None:  # the supervisor's start, placed on this process's clock
            start = (start[0] - (start[1] - shared.start_wall), shared.start_wall)
        self._writer = WorkloadWriter(
            first,
            block_size=block_size,
            workload_id=shared.workload_id if shared is not None else None,
            start=start,
            ids=digest_id if shared is not None else None,
        )
        # Opened here, before the server listens: a path that cannot be written fails
        # start-up rather than the first request.
        self._writer.open()
        self._keys = PrefixKeys(block_size)
        self.block_size = block_size
        self.rotate_bytes = rotate_bytes
        self.rotate_seconds = rotate_seconds
        self.client = client
        self._monotonic = monotonic
        self._opened_at: float | None = None  # when the current file got its first line
        self._on_skip = skipped
        # Prompt keys handed to the thread and written by it: each counter has one writer
        # (the loop, the thread), so neither needs a lock; their difference is what waits.
        self._keys_in = 0
        self._keys_out = 0
        self.lines = 0
        self._out = LineWriter[_Item](
            self._emit,
            label="workload capture",
            buffer=buffer,
            clock=monotonic,
            dropped=functools.partial(skipped, "dropped") if skipped is not None else None,
            closed="the capture was already closed",
            finish=self._finish,
            see='llm_proxy_trace_skipped_requests_total{reason="dropped"}',
            gather_s=GATHER_S,
        )

    @property
    def secret(self) -> bytes | None:
        """The doctor's secret when the workers share one, else None (its own)."""
        return self.shared.secret if self.shared is not None else None

    # -- on the event loop ----------------------------------------------------------------

    def add(
        self, record: RequestRecord, started: float, model: str, prefix: PrefixJob | None
    ) -> None:
        """A measured request's finish: hand its line to the writer, or count why not."""
        if not 200 <= record.status < 300:
            return
        if record.prompt_tokens is None or record.tokens_estimated:
            if self._on_skip is not None:  # a stream cut short before its usage: its own
                self._on_skip("incomplete" if record.outcome is not Outcome.COMPLETED
                              else "no_usage", 1)
            return
        hashed = prefix.hashed if prefix is not None else None
        keys = _keys_held(hashed)
        # (once closed, offer() counts it as that, whatever the keys)
        if (
            keys
            and self._keys_in - self._keys_out + keys > MAX_PENDING_KEYS
            and not self._out.closed
        ):
            self._out.drop(1, "the disk is slower than the requests")
        else:
            self._keys_in += keys  # before the thread can count them out
            if not self._out.offer((record, started, model, hashed)):
                self._keys_in -= keys

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write every buffered line, then close the file. Blocks until done or
        ``timeout`` seconds: call it off the event loop."""
        self._out.close(timeout)

    # -- the writer thread ------------------------------------------------------------------

    def _finish(self) -> None:
        self._writer.close()

    def _emit(self, batch: list[_Item]) -> None:
        self._keys_out += sum(_keys_held(hashed) for _, _, _, hashed in batch)
        written = 0
        try:
            for item in batch:  # rotation is checked per line: a batch may be large
                if self._rotation_due():
                    self._rotate()
                self._writer.write(self._line(*item), flush=False)
                written += 1
            self._writer.flush()
            if self._opened_at is None:
                self._opened_at = self._monotonic()
            self.lines += written
        except Exception as exc:  # a full disk, a file removed: say so, go on
            self._out.drop(len(batch) - written, f"writing failed: {type(exc).__name__}: {exc}")
            with contextlib.suppress(OSError):
                self._writer.close()  # reopened at the next line

    def _line(
        self, record: RequestRecord, started: float, model: str, hashed: HashedPrompt | None
    ) -> Any:
        input_length = record.prompt_tokens or 0
        # an image, audio or file (or context the proxy cannot see): its tokens follow no
        # bytes, so the text is placed at the proxy's estimate, not the prompt's ratio
        rules = record.prefix.rules if record.prefix is not None else None
        per_token = CHARS_PER_TOKEN if rules is not None and rules.unknown else None
        keys = self._keys(hashed, input_length, per_token) if hashed is not None else ()
        itl = record.itl_s
        return self._writer.record(
            started=started,
            input_length=input_length,
            output_length=record.completion_tokens,
            block_keys=keys,
            model=(model or record.model)[:MODEL_MAX],
            route=record.route,
            upstream=record.upstream,
            client=(record.client or None) if self.client else None,
            cached_tokens=record.cached_prompt_tokens,
            ttft_ms=record.ttft_s * 1000.0 if record.ttft_s is not None else None,
            itl_ms_mean=sum(itl) / len(itl) * 1000.0 if itl else None,
            outcome=record.outcome.value,
        )

    def _rotation_due(self) -> bool:
        if (
            self.rotate_seconds
            and self._opened_at is not None
            and (self._monotonic() - self._opened_at >= self.rotate_seconds)
        ):
            return True
        return bool(self.rotate_bytes) and self._writer.size >= self.rotate_bytes

    def _rotate(self) -> None:
        self._writer.rotate(self._free_name())
        self._opened_at = None

    def _free_name(self) -> str:
        """The next rotated file's name: the first free ``FILE.N`` past the last one."""
        number = self._number + 1
        while os.path.exists(f"{self.base}.{number}"):
            number += 1
        self._number = number
        return f"{self.base}.{number}"


def capture_from(
    path: str,
    *,
    block_size: int,
    rotate_bytes: int,
    rotate_seconds: float,
    client: bool,
    workers: int,
    shared: str,
    clock: Callable[[], float] = time.perf_counter,
    skipped: Callable[[str, int], None] | None = None,
) -> WorkloadCapture | None:
    """The capture on ``path`` (``--workload-file``; empty: None), with the settings of the
    same names as :class:`WorkloadCapture` takes them. ``workers``: ``--workers``;
    ``shared``: the supervisor's :data:`SHARED_ENV` text (:class:`Shared`), read by a
    worker of ``serve --workers`` only. A file that cannot be opened is a ``SettingsError``."""
    if not path:
        return None
    from proxy.config_values import SettingsError

    try:
        return WorkloadCapture(
            path,
            block_size=block_size,
            rotate_bytes=rotate_bytes,
            rotate_seconds=rotate_seconds,
            client=client,
            per_process=workers > 1,
            shared=Shared.decode(shared) if workers > 1 and shared else None,
            skipped=skipped,
            clock=clock,
        )
    except OSError as exc:  # before the server listens: one line, not a traceback
        where = exc.filename or path
        raise SettingsError(
            f"invalid setting --workload-file: cannot write {where!r}: {exc.strerror or exc}"
        ) from None
