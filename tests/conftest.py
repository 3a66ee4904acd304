"""Shared fixtures: real iroh endpoints on loopback, the repo root, a tiny recipe."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def run_async(coro, timeout: float = 120.0):
    """Run a coroutine on a fresh event loop with an overall timeout."""
    return asyncio.run(asyncio.wait_for(coro, timeout))
