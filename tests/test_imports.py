"""No import circle in ``proxy/``: a module never imports one that imports it back.

Data flows one way through the proxy (request in -> checks -> admission -> upstream
exchange -> relay -> one finish), and its modules are layered the same way: a lower
module must not know a higher one. An import inside a function or under
``if TYPE_CHECKING:`` still makes the lower module know the higher one, and merely hides
the circle from the interpreter, so the graph here holds every import of a ``proxy``
module wherever it is written. (A package's submodule is not counted as importing its
package, which Python does implicitly, only when it names the package in an import.)

The graph is checked twice: statically, for any circle, named with where each of its
imports is written; and by importing every module alone, in a fresh interpreter, lowest
first, so a module that only imports when something else was imported before it fails
here, and the first failure is the module at fault rather than one above it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Import:
    """One import of one module by another, and where it is written."""

    source: str
    target: str
    path: Path
    line: int
    where: str  # "at module level", "inside a function", "for type checking only"

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path.name}:{self.line}, {self.where})"


def modules(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``package_dir``, by dotted name."""
    found: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (package, *path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


class _Collector(ast.NodeVisitor):
    def __init__(self, name: str, path: Path, known: Mapping[str, Path]) -> None:
        self.name, self.path, self.known = name, path, known
        self.is_package = path.name == "__init__.py"
        self.functions = 0
        self.type_checking = 0
        self.found: list[Import] = []

    def _where(self) -> str:
        if self.type_checking:
            return "for type checking only"
        return "inside a function" if self.functions else "at module level"

    def _add(self, target: str | None, node: ast.stmt) -> None:
        edge = Import(self.name, target or "", self.path, node.lineno, self._where())
        if target is not None and target != self.name and edge not in self.found:
            self.found.append(edge)

    def _module(self, dotted: str) -> str | None:
        """``dotted`` if it is one of the package's modules, else its longest prefix
        that is (``proxy.x.Name`` -> ``proxy.x``), else None (not the package's)."""
        while dotted:
            if dotted in self.known:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(self._module(alias.name), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.name.split(".")
            if not self.is_package:
                anchor = anchor[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.known else self._module(base), node)

    def _function(self, node: ast.AST) -> None:
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        guarded = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
        if not guarded:
            self.generic_visit(node)
            return
        self.type_checking += 1
        for statement in node.body:
            self.visit(statement)
        self.type_checking -= 1
        for statement in node.orelse:
            self.visit(statement)


def import_graph(package_dir: Path, package: str) -> dict[str, list[Import]]:
    """Module -> the package's modules it imports, every import counted."""
    known = modules(package_dir, package)
    graph: dict[str, list[Import]] = {}
    for name, path in known.items():
        collector = _Collector(name, path, known)
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        graph[name] = collector.found
    return graph


@dataclass(frozen=True, slots=True)
class Circle:
    """Modules that import each other: one circle through them, and all their imports
    of each other (what has to change)."""

    modules: tuple[str, ...]
    example: tuple[Import, ...]
    imports: tuple[Import, ...]

    def __str__(self) -> str:
        shown = " -> ".join([self.example[0].source, *(e.target for e in self.example)])
        return "\n".join([f"import circle among {', '.join(self.modules)}: {shown}",
                          *(f"    {edge}" for edge in self.imports)])


def circles(graph: Mapping[str, list[Import]]) -> list[Circle]:
    """Each group of modules that import each other (the strongly connected components
    of the graph, found with Tarjan's algorithm), with its shortest circle through its
    first module by name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for edge in graph[v]:
            w = edge.target
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [Circle(tuple(sorted(group)), _shortest_circle(graph, group),
                   tuple(e for v in sorted(group) for e in graph[v] if e.target in group))
            for group in sorted(groups, key=min)]


def _shortest_circle(graph: Mapping[str, list[Import]], group: set[str]) -> tuple[Import, ...]:
    start = min(group)
    paths: dict[str, tuple[Import, ...]] = {start: ()}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for edge in sorted(graph[v], key=lambda e: e.target):
                if edge.target == start:
                    return (*paths[v], edge)
                if edge.target in group and edge.target not in paths:
                    paths[edge.target] = (*paths[v], edge)
                    following.append(edge.target)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def describe(found: list[Circle]) -> str:
    return "\n".join(str(circle) for circle in found)


def dependency_order(graph: Mapping[str, list[Import]]) -> Iterator[str]:
    """Every module after the modules it imports (the graph has no circle)."""
    done: set[str] = set()

    def visit(v: str) -> Iterator[str]:
        done.add(v)
        for w in sorted({e.target for e in graph[v]}):
            if w not in done:
                yield from visit(w)
        yield v

    for v in sorted(graph):
        if v not in done:
            yield from visit(v)


def test_no_import_circle_in_proxy() -> None:
    graph = import_graph(ROOT / "proxy", "proxy")
    assert len(graph) > 50  # the walk found the package
    found = circles(graph)
    assert not found, describe(found)


def test_a_circle_hidden_inside_a_function_is_named(tmp_path: Path) -> None:
    """The check can fail: a lower module that imports a higher one inside a function
    (the interpreter never notices) is a circle, named with where each import is."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from pkg.high import g\n    return g\n")
    (package / "high.py").write_text("from pkg import low\n\ng = low.f\n")
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.other import X\n")
    (package / "other.py").write_text("import pkg.typed\n")
    (package / "alone.py").write_text("from pkg import low\n")
    found = circles(import_graph(package, "pkg"))
    assert describe(found).splitlines() == [
        "import circle among pkg.high, pkg.low: pkg.high -> pkg.low -> pkg.high",
        "    pkg.high -> pkg.low (high.py:1, at module level)",
        "    pkg.low -> pkg.high (low.py:2, inside a function)",
        "import circle among pkg.other, pkg.typed: pkg.other -> pkg.typed -> pkg.other",
        "    pkg.other -> pkg.typed (other.py:1, at module level)",
        "    pkg.typed -> pkg.other (typed.py:3, for type checking only)",
    ]


def test_each_module_imports_alone_lowest_first() -> None:
    graph = import_graph(ROOT / "proxy", "proxy")
    found = circles(graph)
    if found:
        pytest.fail(describe(found))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def alone(name: str) -> subprocess.CompletedProcess[str]:
        # A package's __main__ runs the program: run it the way users do, harmlessly.
        command = (["-m", name.removesuffix(".__main__"), "--version"]
                   if name.endswith(".__main__") else ["-c", f"import {name}"])
        return subprocess.run([sys.executable, *command], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    # Each interpreter is independent of the others, so they run side by side (one per
    # CPU); the failures are then read lowest first, so the one named is still the
    # module at fault rather than one above it.
    order = list(dependency_order(graph))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(alone, order))
    for name, result in zip(order, results, strict=True):
        assert result.returncode == 0, f"import {name} alone failed:\n{result.stderr}"
