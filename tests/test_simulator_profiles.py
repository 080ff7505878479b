"""Speed profiles: the simulator as upstreams of clearly different speeds.

The figures a profile names (proxy/simulator/__init__.py) are checked exactly on the
simulator's own schedule in virtual time; on loopback, through ``llm-latency-proxy
simulate --profiles fast,slow`` and the official openai SDK, the slow upstream's
time to first token is at least its modelled value (the simulator sleeps that long,
so the bound cannot fail on a slow machine) and the fast upstream's is below it by
hundreds of milliseconds.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from openai import OpenAI

from proxy.simulator import PROFILES, SimConfig, create_profile_app, profile_config
from proxy.simulator import cli as sim_cli
from proxy.simulator.chat import render_chat_prompt
from proxy.simulator.model import ConfigError
from tests.test_simulator import chat_body, parse, timed_writes

ROOT = Path(__file__).resolve().parent.parent
# Deterministic apart from speed: no jitter, fixed lengths, no reasoning.
EXACT = SimConfig(jitter=0.0, output_tokens=5, output_dist="fixed", reasoning_tokens=0, seed=7)


def test_fast_and_slow_name_their_figures() -> None:
    fast, slow = PROFILES["fast"], PROFILES["slow"]
    assert (fast.prefill_overhead, fast.prefill_rate, fast.itl, fast.itl_growth) == (
        0.03, 20_000.0, 0.01, 0.005)  # fmt: skip
    assert (slow.prefill_overhead, slow.prefill_rate, slow.itl, slow.itl_growth) == (
        0.5, 2_500.0, 0.05, 0.02)  # fmt: skip
    # Clearly apart on both measures a dashboard compares.
    assert slow.prefill_overhead >= 10 * fast.prefill_overhead
    assert slow.itl >= 5 * fast.itl
    assert "TTFT 30 ms + prompt tokens / 20000 tok/s, ITL 10 ms" in fast.describe()


def test_a_profile_sets_only_the_speed_fields() -> None:
    base = SimConfig(slots=3, error_rate=0.5, models=("a", "b"), seed=9, itl=0.5)
    slow = profile_config("slow", base)
    assert slow == replace(
        base, prefill_overhead=0.5, prefill_rate=2_500.0, itl=0.05, itl_growth=0.02
    )
    assert profile_config("fast") == replace(SimConfig(), **PROFILES["fast"].fields())
    app = create_profile_app("fast", base)
    assert app.state.config == profile_config("fast", base)
    with pytest.raises(ConfigError, match=r"unknown speed profile 'medium' \(known: fast, slow\)"):
        profile_config("medium")


@pytest.mark.anyio
@pytest.mark.parametrize("name", sorted(PROFILES))
async def test_the_schedule_follows_the_profiles_figures_exactly(name: str) -> None:
    """In virtual time: the first token after overhead + prompt tokens / rate, then one
    token per ITL (a lone stream: no growth, no jitter here)."""
    body = chat_body(stream=True, max_tokens=5)
    writes = await timed_writes(profile_config(name, EXACT), "/v1/chat/completions", body)
    profile = PROFILES[name]
    tokens = math.ceil(len(render_chat_prompt(body)) / EXACT.chars_per_token)
    ttft = profile.prefill_overhead + tokens / profile.prefill_rate
    token_times = [t for t, w in writes if b'"content":"' in w and b'"content":""' not in w]
    assert token_times == pytest.approx([ttft + i * profile.itl for i in range(5)])


def test_cli_profile_under_explicit_speed_flags() -> None:
    args = parse("--profile", "slow", "--itl", "0.03", "--slots", "2")
    config = sim_cli.config_from_args(args)
    assert (config.prefill_overhead, config.prefill_rate, config.itl, config.itl_growth) == (
        0.5, 2_500.0, 0.03, 0.02)  # fmt: skip
    assert config.slots == 2
    # An explicit value equal to the default still wins over the profile.
    args = parse("--profile", "fast", "--itl", str(SimConfig().itl))
    assert sim_cli.config_from_args(args).itl == SimConfig().itl
    assert sim_cli.config_from_args(parse("--profile", "fast")) == profile_config("fast")
    assert sim_cli.profile_names(parse("--profiles", "fast, slow")) == ("fast", "slow")
    assert sim_cli.profile_names(parse("--profile", "slow")) == ("slow",)
    assert sim_cli.profile_names(parse()) == ()
    assert sim_cli.config_from_args(parse()) == SimConfig()


@pytest.mark.parametrize(
    "argv",
    [
        ("--profile", "medium"),
        ("--profiles", "fast,medium"),
        ("--profiles", ","),
        ("--profile", "fast", "--profiles", "fast,slow"),
    ],
)
def test_cli_rejects_unknown_or_conflicting_profiles(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert "--profile" in capsys.readouterr().err


def test_cli_refuses_a_taken_port(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert sim_cli.run(parse("--profiles", "fast,slow", "--port", str(port))) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port} for profile fast" in err


# ---------------------------------------------------------------------------
# The real command on loopback


def two_free_ports() -> int:
    """P with P and P + 1 both free, below the kernel's ephemeral range (so no outgoing
    connection takes one between this check and the command binding it)."""
    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for port in range(max(1024, low - 12_000), low - 1, 7):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two free consecutive ports")


@pytest.fixture
def simulate_profiles() -> Iterator[tuple[subprocess.Popen[str], list[tuple[str, str]]]]:
    """``llm-latency-proxy simulate --profiles fast,slow --port P``; yields the process
    and (profile, URL) from its start-up lines."""
    port = two_free_ports()
    argv = [sys.executable, "-m", "proxy", "simulate", "--profiles", "fast,slow",
            "--port", str(port), "--jitter", "0", "--output-dist", "fixed", "--seed", "1"]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    announced: list[tuple[str, str]] = []
    lines: list[str] = []
    both = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"profile (\w+) at (http://\S+/v1)", line)
            if m:
                announced.append((m[1], m[2]))
                if len(announced) == 2:
                    both.set()
        both.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert both.wait(30), "no start-up lines"
        assert announced == [
            ("fast", f"http://127.0.0.1:{port}/v1"),
            ("slow", f"http://127.0.0.1:{port + 1}/v1"),
        ], "".join(lines)
        yield proc, announced
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        reader.join(5)
        assert proc.stderr is not None
        proc.stderr.close()


def first_token_seconds(base_url: str) -> float:
    """One streamed chat completion through the official SDK; seconds from sending to
    the first content delta, measured by the client."""
    client = OpenAI(base_url=base_url, api_key="sk-sim", max_retries=0, timeout=30)
    started = time.perf_counter()
    stream = client.chat.completions.create(
        model="sim-llm", messages=[{"role": "user", "content": "Hello"}], stream=True,
        max_tokens=3,
    )  # fmt: skip
    first = None
    for chunk in stream:
        if first is None and any(c.delta.content for c in chunk.choices):
            first = time.perf_counter() - started
    client.close()
    assert first is not None
    return first


@pytest.mark.e2e
def test_simulate_profiles_serves_each_profile_on_its_port(
    simulate_profiles: tuple[subprocess.Popen[str], list[tuple[str, str]]],
) -> None:
    proc, announced = simulate_profiles
    urls = dict(announced)
    slow = PROFILES["slow"]
    prompt_tokens = math.ceil(
        len(render_chat_prompt({"messages": [{"role": "user", "content": "Hello"}]})) / 4
    )
    slow_floor = slow.prefill_overhead + prompt_tokens / slow.prefill_rate  # 0.5 s and a bit
    slow_ttft = first_token_seconds(urls["slow"])
    fast_ttft = min(first_token_seconds(urls["fast"]) for _ in range(3))
    # The simulator sleeps until the modelled time: never earlier, however busy the host.
    assert slow_ttft >= slow_floor, (slow_ttft, slow_floor)
    # fast models 30 ms; the best of three stays far below the slow floor of ~0.5 s.
    assert fast_ttft < slow_floor - 0.2, (fast_ttft, slow_floor)
    # One SIGTERM stops both servers, and the command exits cleanly.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
