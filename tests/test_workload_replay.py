"""``bench --workload-file``: a trace recorded by a real run, replayed against the simulator.

The trace: 200 requests of a chat service, sent by bench's own client at planned
times to the simulator (in a process of its own, as any upstream): conversations
behind three system prompts whose prompts grow turn by turn, and one-off requests
with long unique contexts. Written with the format module's writer the way a capture
will: timestamps from the send times, lengths and cached tokens from the usage, hash
ids from 256-byte chained digests of the prompt text (the prompt-cache doctor's block)
mapped to token blocks of 64 (:func:`proxy.workload_file.token_block_keys`).

Then ``llm-latency-proxy bench --workload-file`` replays it against a fresh simulator with the
same settings, and the checks of a faithful replay:

* arrivals: each request's arrival at the upstream (stamped there, on the upstream's
  clock, the whole replay shifted by its median offset) against the trace's
  timestamp; at speedup 10 (the trace stretched tenfold with ``workload scale``, so the
  same schedule) against the timestamp divided by 10;
* prompt lengths within one block of ``input_length``, output lengths exact (the
  simulator honours ``max_tokens``);
* the simulator's prefix-cache hit share within 3 points of the recorded one;
* the what-if: the same trace against the simulator with one decode slot
  (``--simulate``) queues, and TTFT shows it.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.bench.client import RunPlan, run
from proxy.bench.workload import PlannedRequest, request_body, words
from proxy.cli import main
from proxy.workload_file import WorkloadWriter, load, token_block_keys
from tests.arrival_upstream import arrival_upstream, arrivals, pacing_control
from tests.browser import browser_missing, chrome, console_errors, requested_urls, wait_for

# serial: the replay's punctuality is asserted only when the machine has room
pytestmark = [pytest.mark.e2e, pytest.mark.serial]

BLOCK = 64  # trace block size in tokens; the simulator's cache blocks are 16
SIM = ("--slots", "16", "--prefill-rate", "50000", "--itl", "0.01", "--tokens-per-chunk", "4",
       "--seed", "1")  # fmt: skip
REQUESTS = 200
START_WALL = 1_796_119_200.0  # 2026-12-01 10:00 UTC


def conversations(seed: int) -> list[tuple[float, str, int]]:
    """(send offset in seconds, prompt text, max_tokens), by offset: sessions behind
    three system prompts, each turn's prompt its previous one plus the answer and a new
    question, and one-off requests with long unique contexts."""
    rng = random.Random(seed)
    systems = [words(rng, n) for n in (900, 420, 1500)]
    out: list[tuple[float, str, int]] = []
    for _ in range(60):
        t = rng.uniform(0.0, 6.0)
        history = rng.choice(systems)
        for _turn in range(rng.choice((1, 2, 3, 3, 4, 5))):
            history += " " + words(rng, rng.randint(20, 160))
            answer = rng.randint(8, 40)
            out.append((t, history, answer))
            history += " " + words(rng, answer)
            t += rng.uniform(0.4, 1.2)
    for _ in range(30):
        out.append((rng.uniform(0.0, 7.0), words(rng, rng.randint(300, 2400)), rng.randint(8, 40)))
    out.sort(key=lambda x: x[0])
    out = out[:REQUESTS]
    first = out[0][0]
    return [(t - first, text, n) for t, text, n in out]


def chain(text: bytes, size: int = 256) -> tuple[list[bytes], list[int]]:
    """Chained digests of ``size``-byte blocks (the doctor's shape, unkeyed)."""
    keys, ends, parent = [], [], b""
    for start in range(0, len(text), size):
        parent = hashlib.blake2b(parent + text[start : start + size], digest_size=8).digest()
        keys.append(parent)
        ends.append(min(start + size, len(text)))
    return keys, ends


@dataclass(frozen=True)
class Recorded:
    path: Path
    cache_share: float
    span_s: float


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    import anyio

    plan_items = conversations(seed=7)
    path = tmp_path_factory.mktemp("trace") / "recorded.jsonl"
    with arrival_upstream(*SIM) as url:
        planned = [
            PlannedRequest(i, "rec", request_body("chat", "sim-llm", text, n), "chat")
            for i, (_, text, n) in enumerate(plan_items)
        ]
        plan = RunPlan(url=url + "/chat/completions", requests=len(planned), concurrency=None,
                       scheduled=True)  # fmt: skip
        outcome = anyio.run(lambda: run(plan, planned, arrivals=[t for t, _, _ in plan_items]))
    results = outcome.results
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    writer = WorkloadWriter(path, block_size=BLOCK, start=(0.0, START_WALL))
    for r, (_, text, _) in zip(results, plan_items, strict=True):
        assert r.prompt_tokens is not None and r.completion_tokens is not None
        data = text.encode()
        keys, ends = chain(data)
        writer.write(
            writer.record(
                started=r.start_s,
                input_length=r.prompt_tokens,
                output_length=r.completion_tokens,
                block_keys=token_block_keys(keys, ends, len(data), r.prompt_tokens, BLOCK),
                model="sim-llm",
                route="/v1/chat/completions",
                cached_tokens=r.cached_prompt_tokens,
                ttft_ms=(r.ttft_s or 0.0) * 1000,
                itl_ms_mean=statistics.fmean(r.itl_s) * 1000 if r.itl_s else None,
                outcome="completed",
            ),
            flush=False,
        )
    writer.close()
    share = sum(r.cached_prompt_tokens or 0 for r in results) / sum(
        r.prompt_tokens or 0 for r in results
    )
    yield Recorded(path, share, max(r.start_s for r in results))


def replay(
    trace: Path, out: Path, *extra: str, knobs: tuple[str, ...] = SIM, speedup: float = 1.0
) -> tuple[dict[str, Any], list[float], list[float]]:
    """``bench --workload-file`` against a fresh simulator, with the pacing control running at
    the same time; (bench's JSON, the upstream's arrival stamps, the control's lateness)."""
    records = load([str(trace)]).records
    offsets = [(r.timestamp - records[0].timestamp) / 1000 / speedup for r in records]
    with arrival_upstream(*knobs) as url, pacing_control(offsets, out.parent) as control:
        argv = ["bench", "--workload-file", str(trace), "--base-url", url, "--json", str(out)]
        assert main([*argv, "--no-progress", "--no-compare", *extra]) == 0
        stamps = arrivals(url)
    return json.loads(out.read_text()), stamps, control


def arrival_errors(stamps: list[float], planned: list[float]) -> list[float]:
    """Each arrival minus its planned offset, the whole replay shifted by the median
    (the two clocks share no origin). Arrivals are matched in order: requests planned
    at the same millisecond may arrive either way round."""
    assert len(stamps) == len(planned)
    diffs = [a - p for a, p in zip(sorted(stamps), sorted(planned), strict=True)]
    shift = statistics.median(diffs)
    return [d - shift for d in diffs]


def summary(errors: list[float]) -> str:
    ms = sorted(abs(e) * 1000 for e in errors)
    return f"p50 {ms[len(ms) // 2]:.2f} ms, p90 {ms[int(len(ms) * 0.9)]:.2f}, max {ms[-1]:.2f}"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(abs(v) for v in values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)]


QUIET_CONTROL_P90_S = 0.005  # the control wakes this punctually on a machine with room


def check_schedule(
    errors: list[float],
    planned: list[float],
    floor: list[float],
    what: str,
    *,
    median: float,
    tail: bool = True,
) -> bool:
    """Print the errors beside the pacing control's lateness at the same time (what the
    machine's scheduler costs a process that only sleeps); on a machine with room (the
    control's 90th percentile under 5 ms) assert the median at most ``median``, the
    90th percentile at most four times that (with ``tail``), and no drift: the last quarter of the
    replay as punctual as the first (a wrong speedup, a unit slip or lateness that
    accumulates would fail it). Returns whether it asserted.

    On the shared 2-core machine at a load average of 7 to 13 the control itself wakes
    10 to 20 ms late one time in ten and a process that also works waits longer: the
    bounds are not asserted there, the figures are printed (docs/workload.md has them).
    """
    base50, base90 = pct(floor, 0.5), pct(floor, 0.9)
    quiet = base90 <= QUIET_CONTROL_P90_S
    print(f"{what}: {summary(errors)}; control p50 {base50 * 1000:.2f} ms, p90 "
          f"{base90 * 1000:.2f}" + ("" if quiet else " (busy machine: printed, not asserted)"))  # fmt: skip
    if not quiet:
        return False
    order = sorted(range(len(planned)), key=lambda i: planned[i])
    quarter = len(order) // 4
    drift = statistics.median(errors[i] for i in order[-quarter:]) - statistics.median(
        errors[i] for i in order[:quarter]
    )
    assert pct(errors, 0.5) <= median, summary(errors)
    if tail:
        assert pct(errors, 0.9) <= 4 * median, summary(errors)
    assert abs(drift) <= median, drift
    return True


def check_replay_schedule(
    data: dict[str, Any], stamps: list[float], control: list[float], speedup: str
) -> None:
    """Always: no request sent before its time, none gone astray (a median within
    250 ms). With room on the machine: the client's sends within 5 ms at the median and
    20 ms nine times in ten (its own clock against the planned offsets), the arrivals at
    the upstream within 10 ms at the median (stamped there, the replay shifted by its
    median offset; their tail is the upstream's own process, which the control does
    not speak for)."""
    planned = data["replay"]["scheduled_s"]
    assert len(control) == len(planned) == len(stamps)
    by_index = sorted(data["requests"], key=lambda r: r["index"])
    sends = [r["start_s"] - p for r, p in zip(by_index, planned, strict=True)]
    assert min(sends) >= -1e-6, min(sends)
    assert pct(sends, 0.5) <= 0.250, summary(sends)
    check_schedule(sends, planned, control, f"client sends at speedup {speedup}", median=0.005)
    arrived = arrival_errors(stamps, planned)
    check_schedule(arrived, sorted(planned), control, f"arrivals at speedup {speedup}",
                   median=0.010, tail=False)  # fmt: skip


def test_replay_at_speedup_1_keeps_times_lengths_and_the_prefix_sharing(
    recorded: Recorded, tmp_path: Path
) -> None:
    trace = load([str(recorded.path)])
    assert len(trace.records) == REQUESTS and trace.block_size == BLOCK
    data, stamps, control = replay(recorded.path, tmp_path / "r1.json")
    planned = data["replay"]["scheduled_s"]
    first = trace.records[0].timestamp
    assert planned == pytest.approx([(r.timestamp - first) / 1000 for r in trace.records])
    check_replay_schedule(data, stamps, control, "1")
    requests = sorted(data["requests"], key=lambda r: r["index"])
    assert all(r["outcome"] == "completed" for r in requests)
    for r, rec in zip(requests, trace.records, strict=True):
        # the recorded length already holds the chat template's few tokens; the replay
        # adds them again: well within one block
        assert 0 <= r["prompt_tokens"] - rec.input_length < BLOCK
        assert r["completion_tokens"] == rec.output_length
    cmp = data["replay"]
    replayed = cmp["all"]["replayed"]["cache_share"]
    assert cmp["all"]["recorded"]["cache_share"] == pytest.approx(recorded.cache_share)
    print(f"prefix cache hit share: recorded {recorded.cache_share:.3f}, replayed {replayed:.3f}")
    assert recorded.cache_share > 0.3  # the workload shares a good part of its prompts
    assert abs(replayed - recorded.cache_share) < 0.03
    assert cmp["lengths"]["outputs_exact"] == REQUESTS
    assert cmp["headline"].startswith("your traffic on http://127.0.0.1:")


def test_replay_at_speedup_10(recorded: Recorded, tmp_path: Path) -> None:
    stretched = tmp_path / "slow.jsonl"
    assert main(["workload", "scale", str(recorded.path), "--rate", "0.1", "-o", str(stretched)]) == 0
    data, stamps, control = replay(stretched, tmp_path / "r10.json", "--speedup", "10", speedup=10)
    planned = data["replay"]["scheduled_s"]
    trace = load([str(stretched)])
    first = trace.records[0].timestamp
    assert planned == pytest.approx([(r.timestamp - first) / 10_000 for r in trace.records])
    check_replay_schedule(data, stamps, control, "10")


def test_what_if_fewer_slots_queue(recorded: Recorded, tmp_path: Path) -> None:
    """The first 60 requests at twice the speed, against the simulator with 16 decode
    slots and with one: the same traffic queues behind one slot (about three seconds of
    work arrive in one and a half), and TTFT says so."""
    outcomes = {}
    for slots in ("16", "1"):
        out = tmp_path / f"slots{slots}.json"
        knobs = f"--slots {slots} --prefill-rate 50000 --itl 0.005 --tokens-per-chunk 4 --seed 1"
        argv = ["bench", "--workload-file", str(recorded.path), "--simulate", knobs, "--speedup", "2"]
        assert main([*argv, "--requests", "60", "--json", str(out), "--no-progress"]) == 0
        outcomes[slots] = json.loads(out.read_text())["replay"]["all"]["replayed"]
    wide, narrow = outcomes["16"]["ttft"]["p90"], outcomes["1"]["ttft"]["p90"]
    print(f"TTFT p90: 16 slots {wide * 1000:.0f} ms, 1 slot {narrow * 1000:.0f} ms")
    assert outcomes["1"]["completed"] == 60
    assert narrow > 3 * wide and narrow - wide > 0.5, (wide, narrow)


def test_bad_replay_flags_are_refused(
    recorded: Recorded, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(recorded.path)
    for argv, message in (
        (["--simulate", "--slots 0"], "--simulate: argument --slots: must be >= 1"),
        (["--simulate", "--slots two"], "--simulate: argument --slots"),
        (["--simulate", "--port 9"], "--port is chosen by bench"),
        (["--simulate", "", "--base-url", "http://x/v1"], "leave out --base-url"),
        (["--rate", "3"], "a workload file brings its own arrival times"),
        (["--speedup", "0"], "--speedup must be a number > 0"),
        (["--block-size", "512"], "block size 512 given, but the file says"),
    ):
        assert main(["bench", "--workload-file", trace, *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert main(["bench", "--simulate", ""]) == 2
    assert "give --workload-file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["bench", "--workload-file", str(bad)]) == 2
    assert "bad.jsonl:1: no input_length" in capsys.readouterr().err


@pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))
def test_the_report_shows_the_replay_beside_the_trace(
    recorded: Recorded, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy.bench.replay import comparison_rows

    page, out = tmp_path / "replay.html", tmp_path / "replay.json"
    argv = ["bench", "--workload-file", str(recorded.path), "--simulate", " ".join(SIM), "--requests", "40"]
    assert main([*argv, "--report", str(page), "--json", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    cmp = json.loads(out.read_text())["replay"]
    assert cmp["headline"] in printed and "prefix cache hit share" in printed
    with chrome() as driver:
        driver.get(page.as_uri())
        wait_for(driver, "document.body.dataset.ready === '1'")
        assert not driver.execute_script("return document.getElementById('replay-card').hidden")
        shown = driver.execute_script(
            "return [...document.querySelectorAll('#replay table tr')]"
            ".map(tr => [...tr.children].map(td => td.textContent))"
        )
        assert shown == [list(r) for r in comparison_rows(cmp)]
        headline = driver.execute_script("return document.querySelector('#replay p').textContent")
        assert headline == cmp["headline"]
        assert console_errors(driver) == []
        assert set(requested_urls(driver)) == {page.as_uri()}


def test_a_trace_of_every_api_through_the_proxy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each line on its recorded route's API, through the proxy in front of the
    simulator: every request completes with the recorded output length; a trace of one
    route is compared with the proxy's own histograms as any bench run is, one that
    mixes routes says why it is not."""
    from prometheus_client import CollectorRegistry

    from proxy.app import create_app
    from proxy.config import Settings
    from proxy.simulator.app import create_simulator_app
    from proxy.simulator.model import SimConfig
    from tests.servers import serve_in_thread

    routes = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]
    mixed, chat = tmp_path / "mixed.jsonl", tmp_path / "chat.jsonl"
    for path, pick in ((mixed, routes), (chat, routes[:1])):
        w = WorkloadWriter(path, block_size=16, start=(0.0, START_WALL))
        for i in range(12):
            w.write(w.record(started=i * 0.02, input_length=40 + i, output_length=5 + i % 3,
                             block_keys=[b"system", (b"own", i)], model="m",
                             route=pick[i % len(pick)]))  # fmt: skip
        w.close()
    config = SimConfig(slots=8, itl=0.002, jitter=0.0, seed=3)
    with serve_in_thread(create_simulator_app(config)) as sim:
        app = create_app(Settings(upstream=sim.url + "/v1"), registry=CollectorRegistry())
        with serve_in_thread(app) as proxy:
            for path in (mixed, chat):
                out = tmp_path / (path.stem + ".json")
                argv = ["bench", "--workload-file", str(path), "--base-url", proxy.url + "/v1"]
                assert main([*argv, "--json", str(out), "--no-progress"]) == 0
                data = json.loads(out.read_text())
                records = load([str(path)]).records
                requests = sorted(data["requests"], key=lambda r: r["index"])
                assert [r["outcome"] for r in requests] == ["completed"] * 12
                assert [r["api"] for r in requests] == [
                    (rec.route or "").split("/v1/")[1].replace("chat/completions", "chat")
                    for rec in records
                ]
                assert [r["completion_tokens"] for r in requests] == [
                    rec.output_length for rec in records
                ]
                printed = capsys.readouterr().out
                if path == mixed:
                    assert len(data["replay"]["groups"]) == 4
                    assert "not compared (the workload mixes APIs" in printed
                else:
                    view = printed.split("proxy's view")[1]
                    assert re.search(r"^requests\s+12\s+12\s+\+0$", view, re.MULTILINE), view
