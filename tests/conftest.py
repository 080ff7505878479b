"""Shared fixtures: every async test here runs on asyncio (anyio's pytest plugin).

The suite runs on two pytest-xdist workers (``-n 2 --dist loadfile`` in pyproject's
addopts: each test file on one worker, in its own order, two files at a time). A test
marked ``serial`` runs with no other test at the same time: it holds a lock that every
other test holds shared (one lock file per run, ``flock``), for a test whose bounds are
asserted only when the machine has room (``tests/test_workload_replay.py``), which the
other worker's test would otherwise take. A serial test first takes a turnstile that
every test passes through, so the other worker's stream of short tests cannot keep it
waiting. The lock files live in a directory the controller makes for the run. Outside xdist (``-n 0``) there is nothing to share and no lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


LOCK_DIR = "TESTS_SERIAL_LOCK_DIR"  # set by the xdist controller, read by its workers
_created = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """On the controller of an xdist run (before it starts its workers, which inherit
    its environment): a directory for the run's lock files, removed at the end."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.getoption("numprocesses", None):
        return
    path = Path(tempfile.mkdtemp(prefix="llm-proxy-tests-"))
    config.stash[_created] = path
    os.environ[LOCK_DIR] = str(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_created, None)
    if path is not None:
        os.environ.pop(LOCK_DIR, None)
        shutil.rmtree(path, ignore_errors=True)


def _lock_files() -> tuple[Path, Path] | None:
    where = os.environ.get(LOCK_DIR)
    if not os.environ.get("PYTEST_XDIST_WORKER") or not where:
        return None
    return Path(where) / "turnstile", Path(where) / "lock"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    files = _lock_files()
    if files is None:
        return (yield)
    serial = item.get_closest_marker("serial") is not None
    gate: IO[str]
    with files[0].open("a") as gate, files[1].open("a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        finally:
            if not serial:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if serial:
                fcntl.flock(gate, fcntl.LOCK_UN)
