"""Lint and type checks as tests, so CI enforces them: ruff over the tree, mypy strict over
proxy/ and the documentation's generator (pyproject.toml's [tool.mypy] files)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "ruff", "check", "proxy", "tests", "benchmarks", "docs"],
    [sys.executable, "-m", "mypy"],
], ids=["ruff", "mypy"])
def test_static_checks(command: list[str]) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
