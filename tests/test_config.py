"""Settings: flag over environment over default, one-line errors naming the setting,
and the ``serve`` command refusing a bad value before it listens."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import config, options
from proxy.config import Settings, from_sources
from proxy.config_values import SettingsError
from proxy.options import OPTIONS

ROOT = Path(__file__).resolve().parent.parent


def parse(argv: list[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return from_sources(parser.parse_args(argv), environ or {})


def test_defaults_without_flags_or_env() -> None:
    assert parse([]) == Settings()


def test_flag_beats_env_beats_default() -> None:
    env = {"LLM_PROXY_PORT": "9001", "LLM_PROXY_MAX_CONCURRENCY": "4",
           "LLM_PROXY_UPSTREAM": "http://env-host:1/v1"}
    s = parse(["--port", "9002"], env)
    assert s.port == 9002  # flag
    assert s.max_concurrency == 4  # env
    assert s.upstream == "http://env-host:1/v1"
    assert s.max_queue == Settings().max_queue  # default


def test_boolean_switches_from_flags_and_env() -> None:
    assert parse([]).inject_usage is True
    assert parse(["--no-inject-usage"]).inject_usage is False
    assert parse([], {"LLM_PROXY_INJECT_USAGE": "false"}).inject_usage is False
    assert parse(["--inject-usage"], {"LLM_PROXY_INJECT_USAGE": "0"}).inject_usage is True
    assert parse(["--no-measure"], {"LLM_PROXY_MEASURE": "yes"}).measure is False


def test_lists_and_buckets_parse() -> None:
    s = parse(["--model-allowlist", "a, b,,c", "--ttft-buckets", "0.1,0.5,2"])
    assert s.model_allowlist == ("a", "b", "c")
    assert s.ttft_buckets == (0.1, 0.5, 2.0)


def test_upstream_trailing_slash_and_label() -> None:
    s = parse(["--upstream", "https://api.example.com:8443/v1/"])
    assert s.upstream == "https://api.example.com:8443/v1"
    assert s.upstream_label == "api.example.com:8443"
    # (credentials in it stop start-up: tests/test_keys.py)
    assert parse(["--upstream-name", "openai"]).upstream_label == "openai"


def test_every_option_has_a_distinct_flag_and_env() -> None:
    assert len({o.flag for o in OPTIONS}) == len(OPTIONS)
    assert all(o.env == "LLM_PROXY_" + o.name.upper() for o in OPTIONS)


BAD_VALUES = [
    ("upstream", "not a url"),
    ("upstream", "ftp://host/v1"),
    ("upstream", "http:///v1"),
    ("upstream", "http://[::1/v1"),
    ("upstream", "http://host:99999/v1"),
    ("upstream", "http://host:port/v1"),
    ("upstream", "http://host/v1?x=1"),
    ("port", "-1"),
    ("port", "65536"),
    ("port", "eighty"),
    ("max_concurrency", "-1"),
    ("max_queue", "-5"),
    ("max_body_bytes", "0"),
    ("max_models", "0"),
    ("workers", "0"),
    ("connect_timeout", "0"),
    ("read_timeout", "-1"),
    ("read_timeout", "nan"),
    ("read_timeout", "inf"),
    ("body_timeout", "soon"),
    ("ttft_buckets", "1,0.5"),
    ("ttft_buckets", "0.1,0.1"),
    ("ttft_buckets", "a,b"),
    ("itl_buckets", ""),
    ("token_buckets", "-1,2"),
    ("duration_buckets", "1,inf"),
    ("upstream_keepalive_expiry", "0"),
    ("upstream_keepalive_expiry", "-4"),
    ("upstream_keepalive_expiry", "nan"),
    ("upstream_auth", "basic"),
    ("inject_usage", "maybe"),
]


@pytest.mark.parametrize(("name", "raw"), BAD_VALUES)
def test_bad_value_from_env_is_one_line_naming_the_variable_and_flag(name: str, raw: str) -> None:
    opt = next(o for o in OPTIONS if o.name == name)
    with pytest.raises(SettingsError) as info:
        parse([], {opt.env: raw})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"invalid setting {opt.env}={raw!r} ({opt.flag}): "), message


@pytest.mark.parametrize(("name", "raw"), [(n, r) for n, r in BAD_VALUES if n != "inject_usage"])
def test_bad_value_from_flag_names_only_the_flag(name: str, raw: str) -> None:
    """The variable is not named when the flag was used: the operator has a flag to fix,
    and naming a variable they never set would send them looking for it."""
    opt = next(o for o in OPTIONS if o.name == name)
    with pytest.raises(SettingsError) as info:
        parse([f"{opt.flag}={raw}"], {opt.env: "ignored, the flag wins"})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"invalid setting {opt.flag}={raw!r}: "), message
    assert opt.env not in message


def test_a_value_with_a_newline_stays_on_one_line() -> None:
    with pytest.raises(SettingsError) as info:
        parse([], {"LLM_PROXY_PORT": "80\n81"})
    assert "\n" not in str(info.value) and "'80\\n81'" in str(info.value)


def test_new_upstream_settings() -> None:
    assert Settings().upstream_keepalive_expiry == 4.0  # below uvicorn's 5 s keep-alive
    assert parse(["--upstream-keepalive-expiry", "2.5"]).upstream_keepalive_expiry == 2.5
    assert parse([], {"LLM_PROXY_UPSTREAM_KEEPALIVE_EXPIRY": "1"}).upstream_keepalive_expiry == 1.0
    assert Settings().upstream_auth == "bearer"
    assert not hasattr(Settings(), "http_client")  # one upstream client, nothing to choose


@pytest.mark.parametrize("mode", ["bearer", "x-api-key", "api-key", "X-API-KEY"])
def test_upstream_auth_modes(mode: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("0" * 64 + "\n")
    s = parse(["--upstream-auth", mode, "--upstream-api-key-env", "TEST_CONFIG_UPSTREAM_KEY",
               "--client-keys-file", str(keys)], {"TEST_CONFIG_UPSTREAM_KEY": "srv"})
    assert s.upstream_auth == mode.lower()


def test_upstream_auth_without_a_server_held_key_is_refused() -> None:
    """Without --upstream-api-key-env the client's headers pass through unchanged, so a
    non-default --upstream-auth would silently do nothing."""
    assert parse(["--upstream-auth", "bearer"]).upstream_auth == "bearer"
    with pytest.raises(SettingsError, match=r"^invalid setting --upstream-auth: only used with "
                                            r"--upstream-api-key-env"):
        parse(["--upstream-auth", "x-api-key"])
    with pytest.raises(SettingsError, match=r"^invalid setting LLM_PROXY_UPSTREAM_AUTH: "):
        parse([], {"LLM_PROXY_UPSTREAM_AUTH": "api-key"})


def test_combination_errors_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"^invalid setting --metrics-port: must differ from --port$"):
        parse(["--port", "9000", "--metrics-port", "9000"])
    with pytest.raises(SettingsError, match=r"^invalid setting LLM_PROXY_METRICS_PORT: must differ "
                                            r"from LLM_PROXY_PORT$"):
        parse([], {"LLM_PROXY_PORT": "9000", "LLM_PROXY_METRICS_PORT": "9000"})
    unset = "LLM_PROXY_TEST_SURELY_UNSET_VARIABLE"
    with pytest.raises(SettingsError, match=f"^invalid setting --upstream-api-key-env: .*{unset}"):
        parse(["--upstream-api-key-env", unset])
    with pytest.raises(SettingsError, match=f"^invalid setting LLM_PROXY_UPSTREAM_API_KEY_ENV: .*{unset}"):
        parse([], {"LLM_PROXY_UPSTREAM_API_KEY_ENV": unset})


@pytest.mark.parametrize("header", ["Authorization", "x-api-key", "api-key", "Cookie",
                                    "X-Secret-Thing"])
def test_a_client_label_is_never_read_from_a_secret_header(header: str) -> None:
    argv = ["--upstream", "http://u/v1", "--client-label-from", f"header:{header}",
            "--secret-headers", "X-Secret-Thing"]
    with pytest.raises(SettingsError, match=r"^invalid setting --client-label-from="
                       f"header:{header.lower()}: that header carries a secret"):
        parse(argv)
    assert parse([*argv[:3], "header:X-Team"]).client_label_from == "header:x-team"


def test_keys_file_combinations_name_the_setting() -> None:
    key = {"TEST_CONFIG_UPSTREAM_KEY": "srv"}
    with pytest.raises(SettingsError, match=r"^invalid setting --client-keys-file: required with "
                                            r"--upstream-api-key-env$"):
        parse(["--upstream-api-key-env", "TEST_CONFIG_UPSTREAM_KEY"], key)
    with pytest.raises(SettingsError, match=r"^invalid setting LLM_PROXY_CLIENT_KEYS_FILE: no such file"):
        parse(["--upstream-api-key-env", "TEST_CONFIG_UPSTREAM_KEY"],
              {"LLM_PROXY_CLIENT_KEYS_FILE": "/nonexistent/keys", **key})


def test_the_upstream_key_is_read_from_the_given_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key's variable is looked up where every other setting is: in ``environ``, not in
    the process's environment."""
    monkeypatch.setenv("TEST_CONFIG_UPSTREAM_KEY", "srv")
    with pytest.raises(SettingsError, match=r"TEST_CONFIG_UPSTREAM_KEY is empty or unset$"):
        parse(["--upstream-api-key-env", "TEST_CONFIG_UPSTREAM_KEY"])


def test_every_help_text_says_what_its_default_is() -> None:
    """An empty default is shown as what its absence means, never as nothing."""
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    for action in parser._actions:
        if action.dest == "help" or action.help == argparse.SUPPRESS:  # an old name, hidden
            continue
        assert action.help is not None
        shown = action.help.rsplit("; default: ", 1)[1]
        assert shown.endswith("]") and shown[:-1].strip(), (action.dest, action.help)
        assert "(default:" not in action.help, action.help  # one default, in one place


def test_secret_headers_help_says_what_the_code_does() -> None:
    opt = next(o for o in OPTIONS if o.name == "secret_headers")
    assert "removed from the upstream request" in opt.help
    assert "--upstream-api-key-env" in opt.help and "pass through unchanged" in opt.help


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LLM_PROXY_")}
    environ["COLUMNS"] = "200"
    environ.update(env or {})
    return subprocess.run([sys.executable, "-m", "proxy", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=environ, check=False)


def test_serve_bad_port_exits_2_before_listening() -> None:
    done = run_cli("serve", "--port", "-1", "--upstream", "http://127.0.0.1:9/v1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0] == "llm-latency-proxy: error: invalid setting --port='-1': must be an integer >= 0 and <= 65535"
    assert "relaying" not in done.stderr  # the start-up banner never printed
    assert done.stdout == ""


@pytest.mark.parametrize(("key", "hint"), [
    ("max_concurency", "(did you mean max_concurrency?)"),  # a typo
    ("max-concurrency", "(did you mean max_concurrency?)"),  # the flag's spelling
    ("LLM_PROXY_GRACEFUL_TIMEOUT", "(did you mean graceful_timeout?)"),  # the variable's
    ("upstreams", "(declare upstreams as [[upstream]] tables)"),
    ("colour", "(a key is a flag's name without -- and with _ for -, e.g. max_concurrency)"),
])
def test_an_unknown_config_key_gets_the_closest_setting(
        tmp_path: Path, key: str, hint: str) -> None:
    path = tmp_path / "proxy.toml"
    path.write_text(f'"{key}" = 4\n\n[[upstream]]\nname = "a"\nurl = "http://a:1/v1"\n'
                    "default = true\n")
    done = run_cli("serve", "--config", str(path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"llm-latency-proxy: error: config {path}: {key}: unknown setting {hint}"]


def test_serve_bad_env_exits_2() -> None:
    done = run_cli("serve", env={"LLM_PROXY_UPSTREAM": "nonsense"})
    assert done.returncode == 2
    assert "--upstream" in done.stderr and "LLM_PROXY_UPSTREAM" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_serve_help_lists_every_option_with_its_env_var() -> None:
    done = run_cli("serve", "--help")
    assert done.returncode == 0
    out = done.stdout
    for opt in OPTIONS:
        assert opt.flag in out, opt.flag
        assert opt.env in out, opt.env
        if opt.flag_only_true:
            assert "--no-" + opt.flag[2:] in out
    # defaults are shown once, from the settings, not argparse's placeholder, never empty
    assert "(default: None)" not in out
    assert "default: ]" not in out and "default ]" not in out
    assert "--http-client" not in out


@pytest.fixture(scope="module")
def serve_help() -> str:
    """``serve --help`` as a terminal 100 columns wide gets it."""
    done = run_cli("serve", "--help", env={"COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def help_sections(text: str) -> list[tuple[str, list[str]]]:
    """``--help``'s sections after the description: (title, lines), in order."""
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if re.fullmatch(r"\S.*:", line):
            sections.append((line[:-1], []))
        elif sections:
            sections[-1][1].append(line)
    return sections


def test_serve_help_lists_the_options_by_group_then_the_examples(serve_help: str) -> None:
    titles = [title for title, _ in help_sections(serve_help)]
    assert titles == ["options", *(group.value for group in options.Group), "examples"]
    listed: dict[str, list[str]] = {}
    for title, lines in help_sections(serve_help):
        for line in lines:
            flag = re.match(r"  (?:-[a-z], )?(--[a-z0-9-]+)", line)
            if flag and not flag[1].startswith("--no-"):
                listed.setdefault(flag[1], []).append(title)
    assert listed.pop("--help") == ["options"]
    assert listed == {o.flag: [o.group.value] for o in OPTIONS}  # each once, in its group
    for group, members in options.grouped():
        assert members, f"group {group.value!r} has no option"


def test_every_option_must_name_its_group() -> None:
    with pytest.raises(TypeError, match="group"):
        options.Option("new_setting", str, "A new setting.", "X")  # type: ignore[call-arg]


def test_serve_help_fits_the_terminal(serve_help: str) -> None:
    wide = [line for line in serve_help.splitlines() if len(line) > 100]
    assert not wide, wide
    broken = [line for line in serve_help.splitlines() if line.endswith("-")]
    assert not broken, broken  # a flag named in a help text is never cut at a hyphen
    examples = serve_help.split("\nexamples:\n", 1)[1]
    assert max(len(line) for line in examples.splitlines()) <= 80  # as typed, not wrapped


def help_examples(text: str) -> list[list[str]]:
    """The examples at the end of ``--help``: each a list of shell commands (the lines
    indented by four, a line ending in a backslash continued on the next)."""
    examples: list[list[str]] = []
    block: list[str] = []
    for line in (text.split("\nexamples:\n", 1)[1] + "\n").splitlines():
        if line.startswith("    "):
            if block and block[-1].endswith("\\"):
                block[-1] = block[-1][:-1] + line.strip()
            else:
                block.append(line.strip())
        elif block:
            examples.append(block)
            block = []
    return examples


def serve_settings(command: str, environ: dict[str, str]) -> Settings:
    """The settings ``command`` (an ``llm-latency-proxy serve`` line) starts with, parsed
    by the program's own parser."""
    from proxy import cli, serve

    argv = shlex.split(command)
    assert argv[:2] == ["llm-latency-proxy", "serve"], command
    args = cli.build_parser().parse_args(argv[1:])
    assert args.func is serve.run
    return from_sources(args, environ)


def test_serve_help_examples_start_the_proxy_they_describe(
        serve_help: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each example's command line gives settings that pass every start-up check; the
    config-file example runs its own shell lines first (the key variables it exports,
    the client keys file it writes) and its client key is then accepted."""
    from proxy.auth import load_key_check
    from proxy.serve import upstream_warning

    in_front_of_openai, several_upstreams = help_examples(serve_help)
    assert serve_help.rstrip().endswith(several_upstreams[-1].split()[-1])  # at the very end

    (command,) = in_front_of_openai
    settings = serve_settings(command, {})
    assert settings.upstream == "https://api.openai.com/v1" and settings.metrics_port == 9100
    assert upstream_warning(settings.upstream) is None
    # the apps' own keys go to OpenAI
    assert load_key_check(settings.checked_keys_file, upstream_key_env="", env={}) is None

    *shell, command = several_upstreams
    exports = [line for line in shell if line.startswith("export ")]
    keys = {name: f"test-key-{name}" for line in exports
            for name in re.findall(r"(\w+)=\.\.\.", line)}
    assert keys, exports
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    subprocess.run(["bash", "-e", "-o", "pipefail", "-c", "\n".join(shell)], cwd=tmp_path,
                   env={"PATH": os.environ["PATH"], "CLIENT_KEY": "a client's key"},
                   check=True, timeout=60)
    settings = serve_settings(command, keys)
    assert [u.name for u in settings.upstreams] == ["openai", "anthropic", "vllm"]
    assert not settings.upstream_api_key_env  # the file's upstreams hold the keys
    check = load_key_check(settings.checked_keys_file, upstream_key_env="", env=keys)
    assert check is not None and len(check) == 1 and check.accepts(b"a client's key")


def test_settings_page_documents_every_setting() -> None:
    """The settings reference (docs/reference/settings.md, generated from OPTIONS) names
    every flag and its environment variable."""
    from pathlib import Path


    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "reference" / "settings.md").read_text()
    missing = [o.flag for o in OPTIONS if f"`{o.flag}" not in page or f"`{o.env}`" not in page]
    assert not missing, f"docs/reference/settings.md lacks {missing}"
