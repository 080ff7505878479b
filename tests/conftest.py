"""Shared fixtures: every async test here runs on asyncio (anyio's pytest plugin)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
