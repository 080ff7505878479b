"""A short soak in CI (the report's 30-minute run uses the same script, see RESULTS.md).

``benchmarks/soak.py`` streams through a real proxy subprocess for 40 s with 16 clients,
abandoning 10 % of the streams mid-way, and samples the proxy's RSS, open fds and
upstream connections; it exits non-zero if any of them grows after warm-up, if a
stream errs, or if the proxy does not exit 0 on SIGTERM.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.e2e


def test_short_soak_is_flat(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--duration", "40",
         "--interval", "2", "--json", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["errors"] == 0
    assert data["completed"] > 100
    assert data["aborted_by_client"] > 0
    assert data["proxy_exit_code"] == 0
    assert data["verdict"]["flat"] is True, data["verdict"]
