"""Shared fixtures: the repo root, a tiny task repo made with real git, a helper to run asyncio;
the tiers (`swarm`) and what a test needs beyond the test extra (`root`, `chromium`). The harness
(swarms of real processes, hostile peers) is benchmarks/harness, on pytest's pythonpath."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import sys
from pathlib import Path

import pytest

from harness import simulate
from harness.simulate import SIM, SIM_BATCH, TINY_RECIPE, git  # noqa: F401 - re-exported for tests

ROOT = Path(__file__).resolve().parents[1]
WRAPPERS = ROOT / "tests" / "wrappers"  # `drift join` with one injected fault, or held back

# Tiers: `pytest -m "not swarm"` (the fast tier) runs every test that starts no `drift` process.
# A module that starts drift processes or trains a real swarm says `pytestmark = pytest.mark.swarm`
# (a mixed module marks its tests one by one); a fast test that starts one fails (_audit below).
# `root` and `chromium`: what a test needs beyond the test extra. Without it the test is skipped
# with a reason that says how to enable it, except under CI (CI=true), where it fails.
NEEDS = {
    "root": (lambda: os.geteuid() == 0, "needs root (network and mount namespaces): run pytest as root"),
    "chromium": (lambda: shutil.which("chromium") is not None, "needs chromium: apt-get install chromium"),
}

_swarm_test = [False]  # the running test is marked swarm


def _audit(event: str, args: tuple) -> None:
    if event != "subprocess.Popen" or _swarm_test[0]:
        return
    argv = [str(a) for a in args[1]] if isinstance(args[1], (list, tuple)) else [str(args[1])]
    module = [b for a, b in itertools.pairwise(argv) if a == "-m"]
    if (
        Path(argv[0]).name == "drift"
        or any(m.split(".")[0] == "drift" for m in module)
        or str(WRAPPERS) in " ".join(argv)
    ):
        raise RuntimeError(f"a test that starts a drift process must be marked swarm (tests/conftest.py): {argv[:4]}")


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(_audit)  # (here, not at import: a test module importing tests.conftest adds none)
    # The suite starts hundreds of processes that import drift. Where the machine sets
    # PYTHONDONTWRITEBYTECODE (this project's machines do), each one compiled drift's modules from
    # source, ~0.2 s of CPU a process, and each pytest worker rewrote every test module: both are
    # now written once, to the project's (git-ignored) __pycache__ folders. (benchmarks/harness's
    # processes: harness.simulate.ENV.)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _swarm_test[0] = item.get_closest_marker("swarm") is not None
    try:
        yield
    finally:
        _swarm_test[0] = False


# The slow tier's longest tests (CONTRIBUTING.md, Suite time), started first: collected in file
# order they came last, and the suite then waited on one worker running one of them alone.
LONGEST_FIRST = ("test_readme.py", "test_thousand.py", "test_base_swarm.py", "test_simulation.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # (stable: else in file order)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for name, (ok, why) in NEEDS.items():
        if item.get_closest_marker(name) is not None and not ok():
            if os.environ.get("CI"):
                pytest.fail(f"{why} (CI=true: CI must run this test)", pytrace=False)
            pytest.skip(why)


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


def dropped(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Why the coordinator dropped connections, from its log: one line each."""
    lines = (r.getMessage() for r in caplog.records if r.name == "drift.coord")
    return [m.split(": ", 1)[1] for m in lines if m.startswith("dropping connection from ")]


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
