"""The workload capture's old names (``--trace-file`` and its family, their
``LLM_PROXY_TRACE_*`` variables and config keys, ``bench --trace``, ``demo --trace-file``,
the ``trace`` command) still work for one release, each use with one warning line on
standard error, and stay out of ``--help``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from proxy.cli import build_parser, main
from proxy.config import OPTIONS, from_sources
from tests.fake_upstream import RawUpstream
from tests.servers import proxy_process

WARNING = "is deprecated and goes in the next release: use "


def warned(err: str) -> list[str]:
    return [line for line in err.splitlines() if WARNING in line]


def test_every_old_serve_flag_sets_the_new_setting_with_one_warning_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "w.jsonl")
    old = ["--trace-file", path, "--trace-block-size", "64", "--trace-rotate-bytes", "100",
           "--trace-rotate-seconds", "5", "--trace-client", "--client-label-from", "header:x"]  # fmt: skip
    new = ["--workload-file", path, "--workload-block-size", "64", "--workload-rotate-bytes",
           "100", "--workload-rotate-seconds", "5", "--workload-client", "--client-label-from",
           "header:x"]  # fmt: skip
    settings = from_sources(build_parser().parse_args(["serve", *old]), environ={})
    lines = warned(capsys.readouterr().err)
    assert settings == from_sources(build_parser().parse_args(["serve", *new]), environ={})
    assert settings.workload_file == path and settings.workload_client
    assert (settings.workload_block_size, settings.workload_rotate_bytes) == (64, 100)
    assert [line.split(" is ")[0].split()[-1] for line in lines] == [
        "--trace-file", "--trace-block-size", "--trace-rotate-bytes", "--trace-rotate-seconds",
        "--trace-client"]  # fmt: skip
    assert lines[0].endswith("use --workload-file")
    assert not warned(capsys.readouterr().err)  # the new names say nothing
    args = build_parser().parse_args(["serve", "--no-trace-client"])
    assert args.workload_client is False
    assert warned(capsys.readouterr().err)[0].endswith("use --no-workload-client")


def test_old_variables_and_config_keys_are_read_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "w.jsonl")
    settings = from_sources(environ={"LLM_PROXY_TRACE_FILE": path,
                                     "LLM_PROXY_TRACE_BLOCK_SIZE": "32"})  # fmt: skip
    assert (settings.workload_file, settings.workload_block_size) == (path, 32)
    lines = warned(capsys.readouterr().err)
    assert len(lines) == 2 and "LLM_PROXY_TRACE_FILE" in lines[0]
    assert lines[0].endswith("use LLM_PROXY_WORKLOAD_FILE")
    # the new variable wins, and then the old one is not read at all
    both = from_sources(environ={"LLM_PROXY_WORKLOAD_FILE": path, "LLM_PROXY_TRACE_FILE": "x"})
    assert both.workload_file == path and not warned(capsys.readouterr().err)
    config = tmp_path / "proxy.toml"
    config.write_text(
        f'trace_file = "{path}"\ntrace_rotate_seconds = 7\n\n[[upstream]]\n'
        'name = "a"\nurl = "http://127.0.0.1:9/v1"\nmodels = ["*"]\n'
    )
    from_file = from_sources(build_parser().parse_args(["serve", "--config", str(config)]),
                             environ={})  # fmt: skip
    assert (from_file.workload_file, from_file.workload_rotate_seconds) == (path, 7.0)
    lines = warned(capsys.readouterr().err)
    assert len(lines) == 2 and f"config {config}: trace_file" in lines[0]
    assert lines[0].endswith("use workload_file")


def test_old_names_stay_out_of_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("serve", "bench", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        shown = capsys.readouterr().out
        assert "--trace-" not in shown and "--trace " not in shown, command
        assert "--workload-file" in shown, command
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ")}
    assert "workload" in listed and "trace" not in listed and "(trace)" not in out, listed
    assert {o.old for o in OPTIONS if o.old} == {
        "trace_file", "trace_block_size", "trace_rotate_bytes", "trace_rotate_seconds",
        "trace_client"}  # fmt: skip


def test_bench_and_demo_take_their_old_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["bench", "--trace", "a.jsonl", "b.jsonl", "--trace", "c"])
    assert args.workload_file == ["a.jsonl", "b.jsonl", "c"]
    args = build_parser().parse_args(["demo", "--trace-file", "d.jsonl", "--trace-block-size",
                                      "16"])  # fmt: skip
    assert (args.workload_file, args.workload_block_size) == ("d.jsonl", 16)
    lines = warned(capsys.readouterr().err)
    assert [line.rsplit("use ", 1)[1] for line in lines] == [
        "--workload-file",
        "--workload-file",
        "--workload-file",
        "--workload-block-size",
    ]


def test_the_trace_command_is_the_workload_command_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n')
    assert main(["workload", "info", str(path)]) == 0
    new_out, new_err = capsys.readouterr()
    assert main(["trace", "info", str(path)]) == 0
    old_out, old_err = capsys.readouterr()
    assert new_out == old_out and "requests   1" in new_out
    assert not warned(new_err)
    assert warned(old_err) == [
        "llm-latency-proxy: warning: llm-latency-proxy trace is deprecated and goes in the "
        "next release: use llm-latency-proxy workload"
    ]


@pytest.mark.anyio
async def test_a_proxy_started_with_the_old_flag_captures_its_workload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve --trace-file`` in a real process, one old variable beside it: the file is
    written as ``--workload-file`` would write it, and the start-up output warns once per
    old name."""
    path = tmp_path / "w.jsonl"
    monkeypatch.setenv("LLM_PROXY_TRACE_BLOCK_SIZE", "16")
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    with RawUpstream().running() as upstream:
        async with proxy_process(upstream.url, "--trace-file", str(path)) as (proc, port, out):
            async with httpx.AsyncClient(timeout=30.0) as client:
                r = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
                assert r.status_code == 200
            proc.terminate()
            proc.wait(30)
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["input_length"] == 3 and line["block_size"] == 16
    lines = warned("".join(out))
    assert len(lines) == 2, out
    assert "--trace-file" in lines[0] or "--trace-file" in lines[1]
    assert any("LLM_PROXY_TRACE_BLOCK_SIZE" in x for x in lines)


def test_a_setting_given_by_both_names_with_two_values_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Both names of a renamed flag on one command line: an error naming both, in
    either order, rather than the last one winning silently; the same value twice is
    one setting."""
    for command, first, second in (
        ("serve", "--trace-file", "--workload-file"),
        ("serve", "--workload-file", "--trace-file"),
        ("demo", "--workload-file", "--trace-file"),
        ("demo", "--trace-block-size", "--workload-block-size"),
    ):
        with pytest.raises(SystemExit) as stopped:
            build_parser().parse_args([command, first, "7", second, "8"])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert f"{first} 7 and {second} 8 are one setting given twice" in err, err
    args = build_parser().parse_args(["serve", "--trace-file", "a", "--workload-file", "a"])
    assert args.workload_file == "a"
