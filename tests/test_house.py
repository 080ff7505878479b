"""House rules for ``proxy/`` that a reviewer would otherwise check by eye.

- No measured figure (a number with a unit of time or size, a percentage, "3x") in a
  comment, docstring or help text: such figures drift from the code they sit beside;
  they live in ``benchmarks/RESULTS.md`` and ``docs/performance.md``, dated, with their
  command. A default stated as one ("default 4 s") is not a measurement.
- A module docstring of at most 15 lines: the essays are pages in ``docs/design/``.
- No module over 600 lines.
- ``Settings`` stays at the composition root: a module below it takes the values it uses.
- The process environment is read in one module (``proxy/config.py``), which hands it down.

No import circle is checked in ``tests/test_imports.py``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "proxy"

MAX_DOCSTRING_LINES = 15
MAX_MODULE_LINES = 600

# A number, then a unit of time or size, a percentage or a multiplier. "x" must stand
# alone ("3x", "3 x faster"), so "5xx" and "0x1f" are not figures. Bytes are left out: a
# count of bytes is more often a format's field size than a measurement.
FIGURE = re.compile(
    r"(?<![\w./])(\d+(?:[.,]\d+)?)\s?"
    r"(ns|us|µs|μs|ms|s|sec|secs|seconds?|milliseconds?|microseconds?|min|minutes?|"
    r"%|percent|[kKMG]i?B|x)(?![\w%])"
)
# What looks like a figure but is not a measurement: a default stated as a default, and a
# value the text says it sets ("set to 30 s", "up to 4 KB" as a limit).
NOT_MEASURED = re.compile(
    r"\b(default(s|ed)?|set to|up to|at most|at least|limit|every)\b\W*"
    r"(\w+\W+){0,1}$",
    re.IGNORECASE,
)
DEFAULT_AFTER = re.compile(r"\W{0,3}(by default|default)\b", re.IGNORECASE)

CODE_LITERAL = re.compile(r"``.*?``")

# Today's offenders, being cleaned up: these lists only shrink
# (test_allow_lists_hold_only_offenders fails on an entry that no longer offends).
FIGURES_ALLOWED: frozenset[str] = frozenset()
LONG_DOCSTRING_ALLOWED: frozenset[str] = frozenset()
LONG_MODULE_ALLOWED: frozenset[str] = frozenset()

# Calls whose string arguments are help texts: keyword (``unset`` is what --help shows as an
# empty default), or position for the positional one.
HELP_KEYWORDS = frozenset({"help", "description", "epilog", "documentation", "unset"})
HELP_POSITIONS = {
    "Option": 2,
    "Counter": 1,
    "Gauge": 1,
    "Histogram": 1,
    "Summary": 1,
    "Info": 1,
    "Enum": 1,
}


class Text(NamedTuple):
    module: str  # path under the repository root
    line: int
    kind: str  # "comment", "docstring", "help"
    text: str


def _modules() -> list[Path]:
    return sorted(PROXY.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def _strings(node: ast.AST, constants: dict[str, ast.expr]) -> Iterator[tuple[int, str]]:
    """The literal text in an expression (concatenations and f-strings included), with a
    module-level constant it names followed to its value."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            yield inner.lineno, inner.value
        elif isinstance(inner, ast.Name) and inner.id in constants:
            yield from _strings(constants.pop(inner.id), constants)


def texts(path: Path) -> Iterator[Text]:
    """Every comment, docstring and help text of one module."""
    source = path.read_text(encoding="utf-8")
    module = _name(path)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield Text(module, token.start[0], "comment", token.string)
    tree = ast.parse(source, str(path))
    constants: dict[str, ast.expr] = {}
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
            if isinstance(target, ast.Name):
                constants[target.id] = statement.value
                if target.id.endswith("_HELP"):
                    for line, text in _strings(statement.value, {}):
                        yield Text(module, line, "help", text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                start = body[0].lineno
                for offset, text in enumerate(body[0].value.value.splitlines()):
                    yield Text(module, start + offset, "docstring", text)
        elif isinstance(node, ast.Call):
            func = node.func
            called = (
                func.id
                if isinstance(func, ast.Name)
                else (func.attr if isinstance(func, ast.Attribute) else "")
            )
            helps = [k.value for k in node.keywords if k.arg in HELP_KEYWORDS]
            position = HELP_POSITIONS.get(called)
            if position is not None and len(node.args) > position:
                helps.append(node.args[position])
            for expr in helps:
                for line, text in _strings(expr, dict(constants)):
                    yield Text(module, line, "help", text)


def figures(text: str) -> list[str]:
    """The measured figures in one text: each match not preceded by a word that makes it
    a setting's value rather than a measurement, nor inside a ``literal`` (a format's
    example, ``+45s``)."""
    found = []
    text = CODE_LITERAL.sub("``", text)
    for match in FIGURE.finditer(text):
        before, after = text[: match.start()], text[match.end() :]
        if NOT_MEASURED.search(before[-40:]) or DEFAULT_AFTER.match(after):
            continue
        found.append(match.group(0))
    return found


def figures_in(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        seen: set[tuple[int, str]] = set()
        for text in texts(path):
            for figure in figures(text.text):
                if (text.line, figure) not in seen:
                    seen.add((text.line, figure))
                    found.append(
                        f"{text.module}:{text.line}: {figure!r} in a {text.kind}: "
                        f"{text.text.strip()[:90]}"
                    )
    return found


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("adds 12 us per event", ["12 us"]),
        ("about 0.3 ms at 64 streams", ["0.3 ms"]),
        ("took 1.5 s", ["1.5 s"]),
        ("5 % of requests", ["5 %"]),
        ("a 25 MB file", ["25 MB"]),
        ("3x faster", ["3x"]),
        ("cut CPU by 40%", ["40%"]),
        ("default 4 s", []),
        ("(default: 30 s, the upstream's own limit)", []),
        ("defaults to 64 KiB", []),
        ("``retry_ms`` (1 s by default); it took 2 s", ["2 s"]),
        ("every 5xx answer", []),
        ("RFC 9112 section 7.1", []),
        ("Python 3.11", []),
        ("timeout_s and 0x1f", []),
        ("as HTTP/1.1 bytes, 8 bytes a key", []),
        ("a time such as ``+45s``", []),
    ],
)
def test_figure_pattern(text: str, expected: list[str]) -> None:
    assert figures(text) == expected


def test_help_texts_are_found(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        'X_HELP = "adds 1 ms"\n'
        'parser.add_argument("--a", help="took 2 s")\n'
        'Option("a", int, "a " f"{n} 3 ms", "N")\n'
        'Counter("c", X_HELP)\n'
        "# saves 4 %\n"
        'def f():\n    """Costs 5 us."""\n',
        encoding="utf-8",
    )
    found = sorted((t.kind, f) for t in texts(module) for f in figures(t.text))
    assert found == [
        ("comment", "4 %"),
        ("docstring", "5 us"),
        ("help", "1 ms"),
        ("help", "1 ms"),
        ("help", "2 s"),
        ("help", "3 ms"),
    ]


def test_no_measured_figures() -> None:
    checked = [p for p in _modules() if _name(p) not in FIGURES_ALLOWED]
    found = figures_in(checked)
    assert not found, (
        "measured figures belong in benchmarks/RESULTS.md or "
        "docs/performance.md:\n" + "\n".join(found)
    )


def _module_docstring_lines(path: Path) -> int:
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        return (body[0].end_lineno or body[0].lineno) - body[0].lineno + 1
    return 0


def test_module_docstrings_are_short() -> None:
    long = [
        f"{_name(p)}: {n} lines"
        for p in _modules()
        if (n := _module_docstring_lines(p)) > MAX_DOCSTRING_LINES
        and _name(p) not in LONG_DOCSTRING_ALLOWED
    ]
    assert not long, "move the essay to docs/design/:\n" + "\n".join(long)


def test_modules_are_short() -> None:
    long = [
        f"{_name(p)}: {n} lines"
        for p in _modules()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
        and _name(p) not in LONG_MODULE_ALLOWED
    ]
    assert not long, "split along a seam:\n" + "\n".join(long)


def test_allow_lists_hold_only_offenders() -> None:
    """An allow-list entry for a module that meets the rule is stale: remove it."""
    by_name = {_name(p): p for p in _modules()}
    stale = sorted(
        [m for m in FIGURES_ALLOWED if m not in by_name or not figures_in([by_name[m]])]
        + [
            m
            for m in LONG_DOCSTRING_ALLOWED
            if m not in by_name or _module_docstring_lines(by_name[m]) <= MAX_DOCSTRING_LINES
        ]
        + [
            m
            for m in LONG_MODULE_ALLOWED
            if m not in by_name
            or len(by_name[m].read_text(encoding="utf-8").splitlines()) <= MAX_MODULE_LINES
        ]
    )
    assert not stale, "no longer offending, remove from the allow-list: " + ", ".join(stale)


def test_the_module_map_names_every_module_and_only_modules_that_exist() -> None:
    """``docs/development.md``'s architecture table names each module of ``proxy/`` (or
    its package folder) and nothing that is gone: a move or a split updates the map."""
    doc = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(proxy/[\w/]+(?:\.py|/))`", doc))
    folders = {n for n in named if n.endswith("/")}
    modules = {_name(p) for p in _modules()} - {"proxy/__init__.py", "proxy/__main__.py"}
    unnamed = sorted(m for m in modules
                     if m not in named and not any(m.startswith(f) for f in folders))
    assert not unnamed, "add to docs/development.md's module map: " + ", ".join(unnamed)
    gone = sorted(n for n in named if not (ROOT / n).exists())
    assert not gone, "docs/development.md names what no longer exists: " + ", ".join(gone)


# The composition root: the modules that may hold the whole ``Settings``. Every other
# module takes the values it uses, as keyword arguments or a small options record of its
# own that the root fills in.
SETTINGS_READERS = {
    "proxy/config.py": "defines it: flags, environment and config file into one object",
    "proxy/app.py": "builds the proxy: hands each part its values",
    "proxy/serve.py": "the serve command: listening, workers, the start-up line",
    "proxy/demo.py": "builds a proxy of its own in front of the simulator",
}
# The one reader of the process environment (config.process_env): entry points take it
# from there and hand the mapping or the values down.
ENVIRONMENT_READERS = {"proxy/config.py": "process_env(), and the defaults of its readers"}
OS_ENVIRONMENT = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})


def _uses(path: Path) -> tuple[list[int], list[int]]:
    """Lines of ``path`` that name ``Settings`` from proxy.config, and that touch the
    process environment through ``os``."""
    settings, environment = [], []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            names = {a.name for a in node.names}
            if node.module == "proxy.config" and "Settings" in names:
                settings.append(node.lineno)
            if node.module == "os" and names & OS_ENVIRONMENT:
                environment.append(node.lineno)
        elif isinstance(node, ast.Attribute):
            if node.attr == "Settings":
                settings.append(node.lineno)
            if (node.attr in OS_ENVIRONMENT and isinstance(node.value, ast.Name)
                    and node.value.id == "os"):
                environment.append(node.lineno)
    return settings, environment


def test_settings_stay_at_the_composition_root() -> None:
    found = [f"{_name(p)}:{line}" for p in _modules() if _name(p) not in SETTINGS_READERS
             for line in _uses(p)[0]]
    assert not found, ("take the values the module uses, not Settings (the composition "
                       "root, proxy/app.py, hands them out):\n" + "\n".join(found))
    by_name = {_name(p): p for p in _modules()}
    stale = [m for m in SETTINGS_READERS if m != "proxy/config.py" and not _uses(by_name[m])[0]]
    assert not stale, "no longer reads Settings, remove from SETTINGS_READERS: " + ", ".join(stale)


def test_the_environment_is_read_in_one_place() -> None:
    found = [f"{_name(p)}:{line}" for p in _modules() if _name(p) not in ENVIRONMENT_READERS
             for line in _uses(p)[1]]
    assert not found, ("take the environment from proxy.config.process_env() at the entry "
                       "point and hand values down:\n" + "\n".join(found))
    assert all(_uses(PROXY.parent / m)[1] for m in ENVIRONMENT_READERS)


def test_the_checks_see_what_they_forbid(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import os\nfrom os import getenv\nfrom proxy.config import Settings\n"
        "from proxy import config\n"
        "def f(s: config.Settings) -> str:\n    return os.environ.get('X') or os.getenv('Y')\n",
        encoding="utf-8",
    )
    assert _uses(module) == ([3, 5], [2, 6, 6])


def test_the_defaults_a_part_keeps_are_the_settings_defaults() -> None:
    """Metrics and the doctor can be built without the composition root (tests, embedding):
    their own defaults are the settings' defaults."""
    import inspect

    from proxy.app import metrics_options
    from proxy.config import Settings
    from proxy.doctor.job import PrefixCheck
    from proxy.metrics import MetricsOptions

    defaults = Settings()
    assert metrics_options(defaults, {}) == MetricsOptions()
    given = inspect.signature(PrefixCheck).parameters
    assert given["window_s"].default == defaults.prefix_window
    assert given["index_bytes"].default == defaults.prefix_index_bytes
    assert given["cache_index"].default is defaults.cache_index
