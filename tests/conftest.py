"""Shared fixtures: the repo root, a tiny task repo made with real git, a helper to run asyncio."""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path

import pytest

from harness import simulate
from harness.simulate import git  # noqa: F401 - re-exported for tests

ROOT = Path(__file__).resolve().parents[1]
WRAPPERS = ROOT / "tests" / "wrappers"  # `drift join` with one injected fault, or held back

# The simulated swarms' task: a tiny model, fast liveness, a simulated step time (tests/wrappers/sim_node.py) sets each node's pace.
SIM_BATCH = 8
SIM = dict(
    task_config={"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
    batch_size=SIM_BATCH,
    unit_steps=2,
    eval_batches=2,
    stale_after_s=4.0,
    heartbeat_s=0.5,
)

# Small enough that a 3-node swarm finishes a few rounds in seconds on 2 cores.
TINY_RECIPE = {
    "name": "tiny",
    "task_config": {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
    "min_nodes": 3,
    "rounds": 4,
    "inner_steps": 10,
    "batch_size": 16,
    "unit_steps": 2,
    "inner_optimizer": {"lr": 0.01},
    "eval_batches": 4,
    "seed": 7,
    "network": "local",  # tests stay on loopback; tests/test_netns.py runs the default across namespaces
}


# The fast tier (`pytest -m "not swarm"`, about a minute): modules that run in-process (real iroh
# on loopback, real codecs and rules) and start no `drift` process. Every other module is `swarm`.
FAST_MODULES = {
    "test_compress",
    "test_coordinator",
    "test_data_serve",
    "test_diloco",
    "test_inner",
    "test_protocol",
    "test_ring",
    "test_round",
    "test_rules",
    "test_state",
    "test_strangers",
    "test_transport",
    "test_worker",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module.__name__ not in FAST_MODULES:
            item.add_marker(pytest.mark.swarm)


@pytest.fixture(autouse=True)
def _drift_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys and repo caches of every drift process a test starts stay out of ~/.drift."""
    monkeypatch.setenv("DRIFT_HOME", str(tmp_path_factory.mktemp("drift-home")))


@pytest.fixture
def repo_root() -> Path:
    return ROOT


def run_async(coro, timeout: float = 120.0):
    """Run a coroutine on a fresh event loop with an overall timeout."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def make_task_repo(path: Path, **recipe_overrides) -> Path:
    """A real git repo holding the default task and recipes/tiny.yaml; returns the recipe path."""
    return simulate.make_task_repo(path, {**TINY_RECIPE, **recipe_overrides})


@pytest.fixture
def tiny_recipe(tmp_path: Path) -> Path:
    return make_task_repo(tmp_path / "repo")


def drift_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "drift", *args]


def check_exactly_once(events: list[dict], unit_samples: int) -> int:
    """Every sample of the epochs touched was trained exactly once (or is still pending), per the
    round events (the units of nodes whose Δ counted) and the final position; returns the number
    of samples accounted for."""
    started = next(e for e in events if e["event"] == "training_started")
    assert started["unit_samples"] == unit_samples
    n_train = started["n_train"]
    units_per_epoch = -(-n_train // unit_samples)
    complete = next(e for e in events if e["event"] == "complete")
    pieces: list[tuple[int, int, int, int]] = [tuple(p) for p in complete["pending"]]
    for r in (e for e in events if e["event"] == "round"):
        for n in r["nodes"].values():
            if n["weight"] > 0:
                pieces.extend(map(tuple, n["trained"]))
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for epoch, uid, lo, hi in pieces:
        spans.setdefault((epoch, uid), []).append((lo, hi))
    total = 0
    for (epoch, uid), s in sorted(spans.items()):
        s.sort()
        assert s[0][0] == 0, (epoch, uid, s)
        for (_, b), (c, _) in itertools.pairwise(s):
            assert b == c, f"epoch {epoch} unit {uid}: samples lost or trained twice: {s}"
        size = min(unit_samples, n_train - uid * unit_samples)  # an epoch's last unit may be short
        assert s[-1][1] == size, f"epoch {epoch} unit {uid}: tail lost: {s}"
        total += size
    last = complete["epoch"]
    for epoch in sorted({e for e, _ in spans}):
        ids = sorted(u for e, u in spans if e == epoch)
        want = list(range(complete["next_unit"] if epoch == last else units_per_epoch))
        assert ids == want, (epoch, ids[:5], len(ids), len(want))
    return total
