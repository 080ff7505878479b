"""The writer thread the request log and the trace capture share (proxy/line_writer.py),
for what their own tests (tests/test_reqlog.py, tests/test_workload_capture.py) do not reach: a
batch that fails to write is counted and the next is written, drops are warned about at
most once per ``DROP_WARNING_S`` with the total, and a close whose disk takes nothing
gives up at its deadline, says how many lines are left, and leaves the file to the
thread.

``emit`` here is a function that blocks on an event or raises when told, standing in
for a file that takes nothing or fails; each test waits on events, never on time.
"""

from __future__ import annotations

import logging
import threading

import pytest

from proxy import line_writer
from proxy.line_writer import DROP_WARNING_S, LineWriter

WAIT_S = 30.0  # bound on every wait for an event (a loaded 2-core machine)
LABEL = "test writer"


class Disk:
    """``emit`` for a :class:`LineWriter`: records each batch; :attr:`hold` makes it wait
    (set :attr:`go` to let it write), :attr:`fail` makes the next batch raise."""

    def __init__(self, hold: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.entered = threading.Event()  # emit was called at least once
        self.go = threading.Event()
        if not hold:
            self.go.set()
        self.fail: Exception | None = None
        self.finished = threading.Event()

    def emit(self, batch: list[str]) -> None:
        self.entered.set()
        assert self.go.wait(WAIT_S), "the test never let the disk take the lines"
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        self.batches.append(batch)

    def finish(self) -> None:
        self.finished.set()


def writer(disk: Disk, counted: list[int], *, buffer: int = 100,
           clock: list[float] | None = None,
           finish: bool = True) -> LineWriter[str]:
    now = clock if clock is not None else [0.0]
    return LineWriter(disk.emit, label=LABEL, see="the_dropped_metric", closed="closed",
                      buffer=buffer, dropped=counted.append,
                      finish=disk.finish if finish else None, clock=lambda: now[0])


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(LABEL)]


def test_a_batch_that_fails_is_counted_said_and_the_next_one_written(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="proxy")
    disk = Disk()
    disk.fail = OSError(28, "No space left on device")
    counted: list[int] = []
    lines = writer(disk, counted)
    assert lines.offer("a\n")
    assert disk.entered.wait(WAIT_S)
    assert lines.offer("b\n")
    lines.close()
    assert disk.batches == [["b\n"]] and counted == [1] and lines.dropped == 1
    assert disk.finished.is_set()
    assert messages(caplog) == [
        f"{LABEL}: 1 lines dropped so far (writing failed: OSError: [Errno 28] No space "
        "left on device); see the_dropped_metric"]


def test_a_full_buffer_drops_and_warns_once_per_interval_with_the_total(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="proxy")
    disk = Disk(hold=True)
    counted: list[int] = []
    now = [100.0]
    lines = writer(disk, counted, buffer=2, clock=now)
    assert lines.offer("held\n")
    assert disk.entered.wait(WAIT_S)  # the thread holds the first line: the buffer is empty
    assert lines.offer("1\n") and lines.offer("2\n")
    assert not lines.offer("3\n")
    now[0] += DROP_WARNING_S / 2
    assert not lines.offer("4\n")  # counted, not said: said less than the interval ago
    now[0] += DROP_WARNING_S / 2
    assert not lines.offer("5\n")
    assert counted == [1, 1, 1] and lines.dropped == 3
    disk.go.set()
    lines.close()
    assert [line for batch in disk.batches for line in batch] == ["held\n", "1\n", "2\n"]
    assert not lines.offer("6\n")
    why = "the disk is slower than the requests"
    assert messages(caplog) == [
        f"{LABEL}: 1 lines dropped so far ({why}); see the_dropped_metric",
        f"{LABEL}: 3 lines dropped so far ({why}); see the_dropped_metric",
    ]  # "6" came within the interval of the last warning: counted only
    assert counted == [1, 1, 1, 1] and lines.dropped == 4


def test_a_close_whose_disk_takes_nothing_gives_up_and_leaves_the_file_to_the_thread(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="proxy")
    disk = Disk(hold=True)
    counted: list[int] = []
    lines = writer(disk, counted)
    assert lines.offer("held\n")
    assert disk.entered.wait(WAIT_S)
    assert lines.offer("1\n") and lines.offer("2\n")
    lines.close(timeout=0.05)  # the bound of the wait, not a pause: the disk never moves
    # One line held in the write, two waiting: at least three not written.
    assert messages(caplog) == [f"{LABEL}: gave up after 0.05 s at shutdown: at least 3 "
                                "lines not written (the file took nothing)"]
    assert not disk.finished.is_set()  # the file is not closed under the writer's feet
    disk.go.set()  # the disk takes lines again: the thread writes them, then closes
    assert disk.finished.wait(WAIT_S)
    assert [line for batch in disk.batches for line in batch] == ["held\n", "1\n", "2\n"]
    assert counted == [] and lines.dropped == 0


def test_a_close_that_fails_is_said_and_counts_no_line(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="proxy")
    counted: list[int] = []

    def finish() -> None:
        raise OSError(5, "Input/output error")

    lines = LineWriter[str](Disk().emit, label=LABEL, see="the_dropped_metric",
                            closed="closed", buffer=4, dropped=counted.append, finish=finish)
    lines.close()
    assert counted == [] and lines.dropped == 0
    assert messages(caplog) == [f"{LABEL}: 0 lines dropped so far (closing failed: [Errno 5] "
                                "Input/output error); see the_dropped_metric"]


def test_lines_offered_together_reach_the_disk_in_one_batch() -> None:
    """The thread is signalled by the first line after a batch and then gathers for
    BATCH_S: a burst of lines is one write, not one wake-up (and one hand-over of the
    interpreter lock) per line."""
    disk = Disk()
    counted: list[int] = []
    lines = writer(disk, counted, buffer=1000)
    for i in range(200):
        assert lines.offer(f"{i}\n")
    assert disk.entered.wait(WAIT_S)
    lines.close()
    assert [line for batch in disk.batches for line in batch] == [f"{i}\n" for i in range(200)]
    # 200 offers take well under BATCH_S; a second batch only if this thread was held off
    # the CPU for longer than that in the middle of them
    assert len(disk.batches) <= 2, [len(batch) for batch in disk.batches]


def test_a_half_full_buffer_is_taken_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half the buffer waiting cuts the gathering short, so that a burst fills the
    buffer only when the disk is slower than the requests."""
    monkeypatch.setattr(line_writer, "BATCH_S", 2 * WAIT_S)  # only the hurry can end it
    disk = Disk()
    counted: list[int] = []
    lines = writer(disk, counted, buffer=10)
    for i in range(5):
        assert lines.offer(f"{i}\n")
    assert disk.entered.wait(WAIT_S)  # the fifth offer hurried the thread
    lines.close()
    assert counted == [] and [line for b in disk.batches for line in b] == [
        f"{i}\n" for i in range(5)]
