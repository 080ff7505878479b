"""``llm-latency-proxy trace``: info, cut, scale, anonymise and merge, through the command.

A capture-like trace is written with the format module's writer (one request a
minute from Monday 2026-11-30 09:00 UTC for two days, prefixes shared within each
hour), then each action is run as a user would, its output read back with the
format's reader.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.workload_file import WorkloadWriter, load

START = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)  # a Monday


@pytest.fixture
def captured(tmp_path: Path) -> Path:
    path = tmp_path / "cap.jsonl"
    writer = WorkloadWriter(path, block_size=4, start=(0.0, START.timestamp()))
    for minute in range(48 * 60):
        hour = minute // 60
        record = writer.record(
            started=minute * 60.0,
            input_length=10,
            output_length=2,
            block_keys=[(b"hour", hour), (b"req", minute), (b"tail", minute)],
            model=f"secret-model-{minute % 2}",
            route="/v1/chat/completions",
            upstream="https://llm.internal.example",
            client="team-a",
            ttft_ms=100.0 + minute % 7,
            itl_ms_mean=20.0,
            cached_tokens=4,
            outcome="completed",
        )
        writer.write(record, flush=False)
    writer.close()
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["workload", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cut_a_window_by_weekday_and_time_of_day(
    captured: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tue10.jsonl"
    code, _, err = run(capsys, "cut", str(captured), "--from", "Tue 10:00", "--to", "Tue 11:00",
                       "--tz", "UTC", "-o", str(out))  # fmt: skip
    assert code == 0, err
    assert "60 requests written" in err
    trace = load([str(out)])
    assert trace.start == datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    assert [r.timestamp for r in trace.records][:3] == [0, 60000, 120000]
    assert trace.records[-1].timestamp == 59 * 60000
    assert trace.records[0].hash_ids == (0, 1, 2)  # renumbered from 0
    assert trace.records[1].hash_ids[0] == 0  # the hour's shared block stays shared
    # the same window as an ISO time with an offset, and in another time zone
    for begin, end, tz in (
        ("2026-12-01T10:00:00Z", "2026-12-01T11:00:00Z", "UTC"),
        ("11:00", "12:00", "Europe/Berlin"),  # the first day is Monday: 10:00 UTC is Monday
        ("+25h", "+26h", "UTC"),
    ):
        code, text, err = run(capsys, "cut", str(captured), "--from", begin, "--to", end, "--tz", tz)
        assert code == 0, err
        lines = [json.loads(x) for x in text.splitlines()]
        assert len(lines) == 60, (begin, end, tz)
        if tz == "Europe/Berlin":  # Monday 11:00 in Berlin (UTC+1): Monday 10:00 UTC
            assert lines[0]["trace_start"] == "2026-11-30T10:00:00.000Z"
        else:
            assert lines[0]["trace_start"] == "2026-12-01T10:00:00.000Z"


def test_cut_says_what_it_cannot_do(
    captured: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "cut", str(captured), "--from", "Tue 11:00", "--to", "Tue 10:00x")
    assert code == 2 and "give an ISO time" in err
    code, _, err = run(capsys, "cut", str(captured), "--from", "+2h", "--to", "+1h")
    assert code == 2 and "the window is empty" in err
    code, _, err = run(capsys, "cut", str(captured), "--from", "10:00", "--tz", "Mars/Olympus")
    assert code == 2 and "unknown time zone" in err
    code, _, err = run(capsys, "cut", str(captured), "--from", "+100h")
    assert code == 1 and "no request left" in err
    public = tmp_path / "public.jsonl"
    public.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n')
    code, _, err = run(capsys, "cut", str(public), "--from", "10:00")
    assert code == 2 and "no trace_start" in err and "+30m" in err
    code, text, _ = run(capsys, "cut", str(public), "--to", "+1s")
    assert code == 0 and json.loads(text)["input_length"] == 5
    code, _, err = run(capsys, "info", str(tmp_path / "nothing.jsonl"))
    assert code == 2 and "nothing.jsonl" in err


def test_cut_across_midnight_by_time_of_day(
    captured: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text, err = run(capsys, "cut", str(captured), "--from", "23:30", "--to", "00:30", "--tz", "UTC")
    assert code == 0, err
    lines = [json.loads(x) for x in text.splitlines()]
    assert len(lines) == 60 and lines[0]["trace_start"] == "2026-11-30T23:30:00.000Z"


def test_scale_multiplies_the_rate(captured: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text, err = run(capsys, "scale", str(captured), "--rate", "4")
    assert code == 0, err
    lines = [json.loads(x) for x in text.splitlines()]
    assert [x["timestamp"] for x in lines[:3]] == [0, 15000, 30000]
    assert lines[0]["trace_start"] == "2026-11-30T09:00:00.000Z"
    code, text, err = run(capsys, "scale", str(captured), "--rate", "7")
    stamps = [json.loads(x)["timestamp"] for x in text.splitlines()]
    assert stamps[:3] == [0, 8571, 17143]  # whole milliseconds, as the format says
    assert all(type(ts) is int for ts in stamps) and stamps == sorted(stamps)
    code, _, err = run(capsys, "scale", str(captured), "--rate", "0")
    assert code == 2 and "--rate must be > 0" in err


def test_anonymise_numbers_names_and_drops_the_rest(
    captured: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text, err = run(capsys, "anonymise", str(captured))
    assert code == 0, err
    assert "secret-model" not in text and "internal.example" not in text and "team-a" not in text
    lines = [json.loads(x) for x in text.splitlines()]
    assert {x["model"] for x in lines} == {"model-1", "model-2"}
    assert {x["upstream"] for x in lines} == {"upstream-1"}
    assert lines[0]["model"] == "model-1" and lines[1]["model"] == "model-2"
    assert "client" not in lines[0] and lines[0]["ttft_ms"] == 100.0
    assert lines[0]["route"] == "/v1/chat/completions" and "trace_start" in lines[0]
    code, text, _ = run(capsys, "anonymize", str(captured), "--drop-models", "--drop-timings",
                        "--drop-start")  # fmt: skip
    first = json.loads(text.splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids", "route",
                          "block_size", "trace_id"}  # fmt: skip
    code, text, _ = run(capsys, "anonymise", str(captured), "--mooncake-only")
    first = json.loads(text.splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids", "block_size"}


def test_merge_workers_files_into_one_standard_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for worker, wall in ((0, START.timestamp()), (1, START.timestamp() + 0.5)):
        w = WorkloadWriter(tmp_path / f"cap.jsonl.{worker}", block_size=2, start=(0.0, wall))
        for t in range(3):
            w.write(w.record(started=float(t), input_length=4, output_length=1,
                             block_keys=[b"system", (b"w", worker, t)]))  # fmt: skip
        w.close()
    out = tmp_path / "merged.jsonl"
    code, _, err = run(capsys, "merge", str(tmp_path / "cap.jsonl.*"), "-o", str(out))
    assert code == 0 and "6 requests written" in err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["timestamp"] for x in lines] == [0, 500, 1000, 1500, 2000, 2500]
    # each worker's ids were its own: its "system" block is another block (0 and 2)
    assert [x["hash_ids"] for x in lines[:3]] == [[0, 1], [2, 3], [0, 4]]
    assert "trace_start" in lines[0] and all("trace_start" not in x for x in lines[1:])


def test_info_describes_the_trace(captured: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text, _ = run(capsys, "info", str(captured))
    assert code == 0
    assert "requests   2880" in text
    assert "block size 4 tokens" in text and "(1 day, 23:59:00)" in text
    assert "1 requests in the busiest minute" in text
    # 10 tokens in 3 blocks; the first (4 tokens) repeats 59 times an hour
    assert "prefixes   39.3% of prompt tokens" in text
    assert "cached     40.0% of prompt tokens" in text
    assert "secret-model-0 1440" in text and "TTFT       p50 103 ms" in text


def test_info_on_one_request_says_no_rate(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """One request spans no time: no rate to give ("nan requests/s on average" before)."""
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2,
                               "hash_ids": [0]}) + "\n")
    code, text, _ = run(capsys, "info", str(one))
    assert code == 0 and "nan" not in text
    assert "span       0.0 s (0:00:00); one instant, 1 requests in the busiest minute" in text


def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path: Path) -> None:
    """``workload anonymise big.jsonl | head -1``: the reader closes the pipe after what it
    wanted; the command stops there, with no error line and no traceback."""
    big = tmp_path / "big.jsonl"
    big.write_text("".join(
        json.dumps({"timestamp": 10 * i, "input_length": 512, "output_length": 10,
                    "hash_ids": [i]}) + "\n" for i in range(20_000)))  # past a pipe's buffer
    run_it = subprocess.Popen([sys.executable, "-m", "proxy", "workload", "anonymise", str(big)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert run_it.stdout is not None and run_it.stderr is not None
    assert json.loads(run_it.stdout.readline())["timestamp"] == 0
    run_it.stdout.close()  # as head does
    with run_it.stderr:
        assert run_it.wait(60) == 0
        assert run_it.stderr.read() == b""
