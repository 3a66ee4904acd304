"""Lightweight nodes: many of drift's own `Node`s in one process, for swarms of hundreds or a
thousand on one machine (tests/test_thousand.py, benchmarks/bench_light_swarm.py; not shipped).

Each node is drift.node.Node, unmodified: its own real iroh endpoint and Ed25519 key, the real
handshake, signed RepoCommit, units, stealing, barrier, ring all-reduce and outer step. Only two
things stand in, both through the interfaces a node already takes:

* the task (LightSource, a TaskSource): a tiny worker (LightWorker) whose inner steps cost
  microseconds and move θ by a deterministic function of the samples trained, so a round's
  averaged Δ depends only on which samples the swarm trained in it (light_theta recomputes θ);
* the thread that trains (InlineSteps, a drift.inner.Steps): every call on the worker, and every
  unit of steps, runs at once on the caller's thread, so a thousand nodes need no thousand
  threads handing work back and forth.

    python -m harness.light --ticket T --repo R --nodes 250 --first 0 --out DIR

starts nodes light-0 .. light-249 against the coordinator of ticket T (repo R: the git repo of its
recipe, for the commit's tree), and writes DIR/light-<first>.json when they are done: each node's
exit code and final θ checksum, and the θ of the first node. `make_light_repo` makes such a repo.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from drift import protocol as P
from drift.auth import NodeKey
from drift.diloco import epoch_order, unit_indices
from drift.inner import Steps, UnitSteps
from drift.node import Node, NodeError, NodeOptions
from drift.recipe import Recipe
from drift.repo import tree_of
from drift.workers import Choice
from drift.workers.base import ParamsOnly, check_params

from .simulate import ENV, ROOT, git, run_events

LIGHT_SIZE = 64  # θ's values in the stand-in model
SCALE = 2.0**-8  # f(s)'s unit: small, exact in float32

# The stand-in task file: it only has to be a task file in a committed repo (the coordinator
# checks commit and tree); the nodes never import it, LightSource builds the worker instead.
TASK = '''"""A stand-in task for lightweight nodes (benchmarks/harness/light.py builds its worker)."""


def make_dataset(cfg):
    raise RuntimeError("lightweight nodes only: see benchmarks/harness/light.py")


def make_numpy_model(cfg, vocab_size):
    raise RuntimeError("lightweight nodes only: see benchmarks/harness/light.py")
'''


def light_recipe(nodes: int, **overrides) -> dict:
    """A recipe for a swarm of `nodes` lightweight nodes: every node a unit of 2 steps a round,
    θ moved by exactly the averaged Δ (fp32 ring, outer SGD with lr 1, no momentum)."""
    return {
        "name": "light",
        "task": "light_task.py",
        "task_config": {"size": LIGHT_SIZE, "n_train": max(4096, 64 * nodes)},
        "min_nodes": nodes,
        "rounds": 2,
        "inner_steps": 2,
        "batch_size": 4,
        "unit_steps": 2,
        "eval_batches": 1,
        "codec": "fp32",
        "outer_optimizer": {"lr": 1.0, "momentum": 0.0, "nesterov": False},
        # On one machine every node checks every member's signed RepoCommit (N² in all) as the
        # first round starts: deadlines get that much slack (2 heartbeats), and silence more.
        "heartbeat_s": max(5.0, nodes / 20),
        "stale_after_s": max(120.0, nodes / 4),
        "checkpoint_every": 1000,
        # Stand-in steps take microseconds, so a round's expected length is a fraction of a
        # millisecond and the coordinator's clock under load made 998 of 1,000 evaluators: only
        # a node 100x slower than the others evaluates here.
        "slow_node_fraction": 0.01,
        "network": "local",
        "seed": 0,
        **overrides,
    }


def make_light_repo(path: Path, recipe: dict) -> Path:
    """A real git repo with the stand-in task and recipe.yaml, committed; returns the recipe path."""
    import yaml

    path.mkdir(parents=True, exist_ok=True)
    (path / "light_task.py").write_text(TASK)
    out = path / "recipe.yaml"
    out.write_text(yaml.safe_dump(recipe, sort_keys=False))
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "light task")
    return out


def f_of(indices: np.ndarray, size: int) -> np.ndarray:
    """Σ f(s) over these samples: f(s) adds (1 + s % 3) · SCALE to value s % size (exact in float32)."""
    w = (1 + indices % 3).astype(np.float64) * SCALE
    return np.bincount(indices % size, weights=w, minlength=size).astype(np.float32)


def theta0(size: int) -> np.ndarray:
    return (np.arange(size, dtype=np.float32) - size / 2) * np.float32(SCALE)


class LightWorker(ParamsOnly):
    """A worker whose local θ is θ_global minus the mean f(s) of the samples trained since θ was
    last set: a node's Δ = (1/n) Σ f(s), so Σ_i w_i Δ_i = (1/N) Σ f(s) over the round's samples."""

    backend, device, precision = "numpy", "cpu", "fp32"

    def __init__(self, size: int, n_train: int, n_val: int = 64) -> None:
        self.size, self.n_train, self.n_val = size, n_train, n_val
        self._base = theta0(size)
        self._acc = np.zeros(size, np.float64)
        self._n = 0

    def param_names(self) -> list[str]:
        return ["w"]

    def get_params(self) -> dict[str, np.ndarray]:
        local = self._base - (self._acc / self._n if self._n else 0)
        return {"w": local.astype(np.float32)}

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        check_params({"w": (self.size,)}, params)
        self._base = np.array(params["w"], np.float32)
        self._acc[...] = 0
        self._n = 0

    def add_to_state(self, deltas: dict[str, np.ndarray]) -> None:
        check_params({"w": (self.size,)}, deltas)
        self._base = self._base + np.asarray(deltas["w"], np.float32)  # (the samples since stay)

    def reset_optimizer(self) -> None:
        pass

    def set_lr(self, lr: float) -> None:
        pass

    def train_step(self, indices: np.ndarray, micro_batches: int = 1) -> float:
        self._acc += f_of(np.asarray(indices), self.size)
        self._n += len(indices)
        return float(self._n)

    def evaluate(self, max_batches: int, batch_size: int) -> float:
        return float(np.abs(self._base).mean())

    def close(self) -> None:
        pass


class InlineSteps(Steps):
    """The thread that trains, run inline: every call and every unit of steps runs at once, on
    the thread that asks (the worker's steps take microseconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.worker: LightWorker | None = None

    def call(self, fn, *args):
        return fn(*args)

    def submit(self, job: UnitSteps) -> None:
        job.run(self.worker.train_step)

    def serve(self) -> Iterator[np.ndarray]:
        raise RuntimeError("InlineSteps runs its steps itself")


class LightSource:
    """A TaskSource that builds a LightWorker for the commit the coordinator names."""

    def __init__(self, repo: Path, steps: InlineSteps) -> None:
        self.repo, self.steps = repo, steps
        self.name = str(repo)

    def open(self) -> None:
        pass

    def choice(self) -> Choice:
        return Choice("numpy", "cpu")

    async def load(self, cfg: P.TrainConfig, recipe: Recipe, data=None) -> tuple[object, str | None]:
        c = recipe.task_config
        self.steps.worker = LightWorker(int(c.get("size", LIGHT_SIZE)), int(c["n_train"]))
        return self.steps.worker, tree(self.repo, cfg.commit or "")


_TREES: dict[tuple[Path, str], str] = {}


def tree(repo: Path, commit: str) -> str:
    """The commit's tree id (git, once per process)."""
    if (repo, commit) not in _TREES:
        _TREES[repo, commit] = tree_of(repo, commit)
    return _TREES[repo, commit]


def light_theta(events: list[dict], size: int, n_train: int, unit_samples: int, seed: int) -> np.ndarray:
    """θ after every round of a light swarm, recomputed from its round events (with every row:
    read_events(whole=True)): each settled round moves θ by the mean f(s) over the samples of the
    units its counted members trained."""
    theta = theta0(size).astype(np.float64)
    orders: dict[int, np.ndarray] = {}
    for e in sorted((e for e in events if e["event"] == "round" and not e.get("abandoned")), key=lambda e: e["round"]):
        total, n = np.zeros(size, np.float64), 0
        for row in e["nodes"].values():
            for epoch, uid, lo, hi in row["trained"] if row["weight"] > 0 else []:
                if epoch not in orders:
                    orders[epoch] = epoch_order(n_train, seed, epoch)
                idx = unit_indices(orders[epoch], P.WorkUnit(epoch=epoch, id=uid, lo=lo, hi=hi), unit_samples)
                total += f_of(idx, size)
                n += len(idx)
        theta -= total / n
    return theta


async def _run(ticket: str, repo: Path, count: int, first: int, start_s: float) -> dict:
    nodes: list[Node] = []
    for i in range(first, first + count):
        steps = InlineSteps()
        opts = NodeOptions(
            ticket=ticket,
            source=LightSource(repo, steps),
            steps=steps,
            key=NodeKey.generate(),
            name=f"light-{i}",
            say=lambda line: None,
            connect_timeout=60.0,
        )
        nodes.append(Node(opts))

    async def one(k: int, node: Node) -> int | str:
        await asyncio.sleep(start_s * k / max(1, count))  # (a process's nodes start spread over start_s)
        try:
            return await node.run()
        except NodeError as e:
            print(f"light: {node.opts.name}: {e}", file=sys.stderr, flush=True)
            return str(e)

    codes = await asyncio.gather(*(one(k, n) for k, n in enumerate(nodes)), return_exceptions=True)
    out = {"nodes": {}, "theta": None}
    for node, code in zip(nodes, codes):
        t = node.trainer
        out["nodes"][node.opts.name] = {
            "code": code if isinstance(code, (int, str)) else repr(code),
            "checksum": t.held_checksum if t is not None else None,
            "held": t.held if t is not None else None,
        }
        if out["theta"] is None and t is not None:
            out["theta"] = [float(x) for x in t.theta]
    return out


class LightSwarm:
    """A real `drift coord` process on a light recipe, and `processes` processes of lightweight
    nodes (python -m harness.light) that make `nodes` in all."""

    def __init__(self, work: Path, nodes: int, processes: int, start_s: float = 0.0, **recipe) -> None:
        self.work, self.n = work, nodes
        self.recipe = light_recipe(nodes, **recipe)
        path = make_light_repo(work / "repo", self.recipe)
        self.run_dir, self.out = work / "run", work / "out"
        self.coord_log = work / "coord.log"
        env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), ENV.get("PYTHONPATH", "")])}
        self.started = time.monotonic()
        with open(self.coord_log, "w") as fh:
            cmd = [sys.executable, "-m", "drift", "coord", str(path), "--run-dir", str(self.run_dir)]
            self.coord = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        self.ticket = self._ticket()
        self.procs: list[subprocess.Popen] = []
        per = -(-nodes // processes)
        for first in range(0, nodes, per):
            cmd = [sys.executable, "-m", "harness.light", "--ticket", self.ticket, "--repo", str(work / "repo")]
            cmd += ["--nodes", str(min(per, nodes - first)), "--first", str(first), "--out", str(self.out)]
            cmd += ["--start-s", str(start_s)]
            with open(work / f"light-{first}.log", "w") as fh:
                self.procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env))

    def _ticket(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := re.search(r"--ticket (\S+)", self.coord_log.read_text()):
                return m.group(1)
            if self.coord.poll() is not None:
                raise AssertionError("coordinator exited early:\n" + self.coord_log.read_text())
            time.sleep(0.05)
        raise AssertionError("coordinator printed no ticket")

    def events(self) -> list[dict]:
        return run_events(self.run_dir)

    def finish(self, timeout: float) -> tuple[int | None, list[int | None]]:
        """(the coordinator's exit code, each light process's; None: still running, after
        `timeout` s and a minute more for the nodes); whatever is left then is killed."""

        def wait(p: subprocess.Popen, t: float) -> int | None:
            try:
                return p.wait(t)
            except subprocess.TimeoutExpired:
                return None

        try:
            rc = wait(self.coord, timeout)
            return rc, [wait(p, 60 if rc is not None else 0.1) for p in self.procs]
        finally:
            for p in [self.coord, *self.procs]:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def nodes(self) -> dict[str, dict]:
        """Every light node's exit code, final checksum and round held (the processes' files)."""
        out: dict[str, dict] = {}
        for f in sorted(self.out.glob("light-*.json")):
            out.update(json.loads(f.read_text())["nodes"])
        return out

    def theta(self) -> np.ndarray:
        """The final θ of the first node of the first process."""
        return np.array(json.loads((self.out / "light-0.json").read_text())["theta"], np.float32)

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.work.glob("*.log")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.light", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ticket", required=True)
    ap.add_argument("--repo", required=True, type=Path)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--first", type=int, default=0, help="the number of this process's first node (names)")
    ap.add_argument("--start-s", type=float, default=0.0, help="start the nodes spread over this many seconds")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    out = asyncio.run(_run(a.ticket, a.repo.resolve(), a.nodes, a.first, a.start_s))
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = a.out / f".light-{a.first}.json.tmp"
    tmp.write_text(json.dumps(out))
    tmp.rename(a.out / f"light-{a.first}.json")
    bad = {k: v["code"] for k, v in out["nodes"].items() if v["code"] != 0}
    print(f"light: {a.nodes} nodes, {a.nodes - len(bad)} completed", file=sys.stderr)
    for k, v in list(bad.items())[:5]:
        print(f"light: {k}: {v}", file=sys.stderr)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
