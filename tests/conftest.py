"""Shared fixtures: the repo root, a tiny task repo made with real git, a helper to run asyncio."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# Small enough that a 3-node swarm finishes a few rounds in seconds on 2 cores.
TINY_RECIPE = {
    "name": "tiny",
    "task": "recipes/shakespeare_char.py",
    "task_config": {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
    "min_nodes": 3,
    "rounds": 4,
    "inner_steps": 10,
    "batch_size": 16,
    "unit_steps": 2,
    "inner_optimizer": {"lr": 0.01},
    "eval_batches": 4,
    "seed": 7,
}


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def run_async(coro, timeout: float = 120.0):
    """Run a coroutine on a fresh event loop with an overall timeout."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def make_task_repo(path: Path, **recipe_overrides) -> Path:
    """A real git repo holding the default task file and recipes/tiny.yaml; returns the recipe path."""
    (path / "recipes").mkdir(parents=True)
    shutil.copy(ROOT / "recipes" / "shakespeare_char.py", path / "recipes" / "shakespeare_char.py")
    recipe = path / "recipes" / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({**TINY_RECIPE, **recipe_overrides}, sort_keys=False))
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "task")
    return recipe


@pytest.fixture
def tiny_recipe(tmp_path: Path) -> Path:
    return make_task_repo(tmp_path / "repo")


def drift_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "drift", *args]
