"""Many nodes on one machine (issue 40, item 1): what a node costs beyond its own training.

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_local_swarm.py                 # 8 and 32 nodes, 1 vs 2
    flock /tmp/drift-cpu.lock python3 benchmarks/bench_local_swarm.py --tree /tmp/base --tree .   # A/B, interleaved
    python3 benchmarks/bench_local_swarm.py --nodes 2 --steps-only --reps 1           # smoke run, ~1 min

Every run is a real `drift coord RECIPE --local N` (the coordinator and N `drift join` processes,
real iroh on loopback) training a tiny task: shakespeare_char.py as a 1-layer char GPT (block 32,
2 heads, 32 wide), batch 8, units of 2 steps, 4 rounds. Two figures:

  rounds  --local N for each N of --nodes (default 8 and 32), 10 inner steps a node a round, torch
          threads as --local gives them (usable cores / N, at least 1). Per round: the coordinator's own
          round time (`seconds` of metrics.jsonl's round events, from the round's start to θ
          agreed), the wall time between two round events (rounds 1-3), and the samples a round
          trained (rounds 0-2; the last round trains whatever is left); median over the run.
  steps   one node alone against two nodes at once (--threads 1 each, so two fit two cores),
          200 inner steps a node a round: seconds per inner step of each node, by the
          coordinator's clock (from the round's start to the node's BarrierSync, over its steps;
          rounds 1-3). The ratio 2 nodes / 1 node is what contention between the nodes' own threads
          costs (1.0: nothing beyond their compute). Beside it, in the same reps: one and two
          plain loops of the same worker (`drift.ranks.task_worker`, no node around it), the
          compute's own contention on these cores.

Each configuration runs --reps times (A/B interleaved when several --tree are given: each tree's
drift runs with TREE first on PYTHONPATH, its own recipes/shakespeare_char.py as the task); min and median
of the reps are printed. The machines these run on are shared: compare trees within one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
TASK = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}


def make_repo(path: Path, tree: Path, n: int, inner_steps: int) -> Path:
    """A committed task repo: the tree's shakespeare_char.py and the tiny recipe for n nodes."""
    (path / "recipes").mkdir(parents=True)
    shutil.copy(tree / "recipes" / "shakespeare_char.py", path / "recipes" / "shakespeare_char.py")
    recipe = {
        "name": "tiny",
        "task": "recipes/shakespeare_char.py",
        "task_config": TASK,
        "min_nodes": n,
        "rounds": 4,
        "inner_steps": inner_steps,
        "batch_size": 8,
        "unit_steps": 2,
        "eval_batches": 2,
        "inner_optimizer": {"lr": 0.01},
        "seed": 7,
        "network": "local",
    }
    out = path / "recipes" / "tiny.yaml"
    out.write_text(yaml.safe_dump(recipe, sort_keys=False))
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@l", "GIT_COMMITTER_NAME": "b"}
    env["GIT_COMMITTER_EMAIL"] = "b@l"
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "task"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, env=env, capture_output=True)
    return out


def run_swarm(tree: Path, n: int, inner_steps: int, threads: int | None, timeout: float) -> list[dict]:
    """One `drift coord --local n` run of drift from `tree`; its metrics.jsonl events."""
    with tempfile.TemporaryDirectory(prefix="bench-local-") as tmp:
        work = Path(tmp)
        recipe = make_repo(work / "repo", tree, n, inner_steps)
        cmd = [sys.executable, "-m", "drift", "coord", str(recipe), "--local", str(n), "--run-dir", str(work / "run")]
        # Threads as --local gives them on this machine: the cores this process may use, over n
        # (drift's own default counts all the machine's cores, also under taskset).
        cmd += ["--threads", str(threads or max(1, len(os.sched_getaffinity(0)) // n))]
        path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "DRIFT_HOME": str(work / "home"), "PYTHONUNBUFFERED": "1"}
        with open(work / "coord.log", "w") as log:
            p = subprocess.run(cmd, cwd=work, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        if p.returncode != 0:
            tail = (work / "coord.log").read_text().splitlines()[-5:]
            raise SystemExit(f"bench_local_swarm: drift coord --local {n} ({tree}) exited {p.returncode}: {tail}")
        return [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]


def round_figures(events: list[dict]) -> dict:
    rounds = [e for e in events if e["event"] == "round"]
    joined = [e["t"] for e in events if e["event"] == "node_joined"]
    walls = [b["t"] - a["t"] for a, b in itertools.pairwise(rounds)]
    return {
        "round_s": statistics.median(e["seconds"] for e in rounds),
        "wall_s": statistics.median(walls),
        "joined_s": max(joined) if joined else float("nan"),
        # (a round cut short is quicker: its samples say whether it trained its budget)
        "samples": statistics.median(e["samples"] for e in rounds[:-1]) if len(rounds) > 1 else float("nan"),
    }


def step_figure(events: list[dict]) -> float:
    """Seconds per inner step by the coordinator's clock, the mean over nodes (rounds 1..)."""
    per_node: dict[str, list[float]] = {}
    for r in (e for e in events if e["event"] == "round" and e["round"] >= 1):
        for name, n in r["nodes"].items():
            if n["steps"]:
                per_node.setdefault(name, []).append(n["busy_s"] / n["steps"])
    return statistics.mean(statistics.median(v) for v in per_node.values())


# One plain loop of the task's worker, as `drift join` builds it (drift.ranks.task_worker), without
# a node around it: no coordinator, no event loop, no iroh. Prints seconds per inner step.
PLAIN = """
import sys, time
from pathlib import Path
import numpy as np
from drift.ranks import task_worker
from drift.recipe import load_recipe
path, steps = Path(sys.argv[1]), int(sys.argv[2])
r, repo = load_recipe(path), path.parent.parent
w = task_worker(repo, repo / r.task, r, "torch", "cpu", 1)
rng = np.random.default_rng(0)
for _ in range(20):
    w.train_step(rng.integers(0, w.n_train, r.batch_size))
t = time.perf_counter()
for _ in range(steps):
    w.train_step(rng.integers(0, w.n_train, r.batch_size))
print((time.perf_counter() - t) / steps)
"""


def plain_step(tree: Path, n: int, steps: int) -> float:
    """Seconds per inner step of n plain loops of the task's worker at once (one torch thread
    each), the mean over them: what the cores alone do to two trainings side by side."""
    with tempfile.TemporaryDirectory(prefix="bench-plain-") as tmp:
        recipe = make_repo(Path(tmp) / "repo", tree, n, steps)
        path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        cmd = [sys.executable, "-c", PLAIN, str(recipe), str(steps)]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"bench_local_swarm: a plain loop ({tree}) failed")
        return statistics.mean(float(o.split()[-1]) for o in outs)


def tree_name(tree: Path) -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "drift"], capture_output=True)
        return head + ("+dirty" if dirty.stdout.strip() else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return str(tree)


def spread(xs: list[float], unit: str = "s") -> str:
    return f"min {min(xs):.3f} {unit}, median {statistics.median(xs):.3f} {unit} (n={len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, action="append", help="a drift checkout to run [default: this one]")
    ap.add_argument("--nodes", default="8,32", help="--local sizes of the round figure [default: 8,32]")
    ap.add_argument("--reps", type=int, default=3, help="runs of each configuration [default: 3]")
    ap.add_argument("--steps-only", action="store_true", help="only the 1-vs-2-node step figure")
    ap.add_argument("--rounds-only", action="store_true", help="only the round figure")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take [default: 900]")
    a = ap.parse_args()
    trees = [t.resolve() for t in (a.tree or [HERE.parent])]
    names = {t: tree_name(t) for t in trees}
    sizes = [int(x) for x in a.nodes.split(",") if x]
    cores = len(os.sched_getaffinity(0))
    print(f"bench_local_swarm {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cores} cores")
    for t in trees:
        print(f"  tree {t}: {names[t]}")

    if not a.steps_only:
        for n in sizes:
            got: dict[Path, list[dict]] = {t: [] for t in trees}
            for _ in range(a.reps):
                for t in trees:
                    got[t].append(round_figures(run_swarm(t, n, 10, None, a.timeout)))
            for t in trees:
                f = got[t]
                print(f"{n} nodes, {names[t]}: round {spread([x['round_s'] for x in f])}")
                print(
                    f"{' ' * len(str(n))}        {' ' * len(names[t])}  wall between rounds {spread([x['wall_s'] for x in f])}"
                )
                print(
                    f"{' ' * len(str(n))}        {' ' * len(names[t])}  all joined at {spread([x['joined_s'] for x in f])}"
                )
                print(
                    f"{' ' * len(str(n))}        {' ' * len(names[t])}  samples a round (rounds 0-2, budget {n * 10 * 8}) "
                    f"{spread([x['samples'] for x in f], '')}"
                )

    if not a.rounds_only:
        got1: dict[Path, list[float]] = {t: [] for t in trees}
        got2: dict[Path, list[float]] = {t: [] for t in trees}
        plain1: list[float] = []
        plain2: list[float] = []
        for _ in range(a.reps):
            for t in trees:
                got1[t].append(step_figure(run_swarm(t, 1, 200, 1, a.timeout)))
                got2[t].append(step_figure(run_swarm(t, 2, 200, 1, a.timeout)))
            plain1.append(plain_step(trees[-1], 1, 800))
            plain2.append(plain_step(trees[-1], 2, 800))
        print(f"step, 1 plain loop,     {names[trees[-1]]}: {spread([x * 1e3 for x in plain1], 'ms')}")
        print(f"step, 2 plain loops,    {names[trees[-1]]}: {spread([x * 1e3 for x in plain2], 'ms')}")
        print(f"  2 plain loops / 1 (medians): {statistics.median(plain2) / statistics.median(plain1):.2f}")
        for t in trees:
            one, two = got1[t], got2[t]
            print(f"step, 1 node,  {names[t]}: {spread([x * 1e3 for x in one], 'ms')}")
            print(f"step, 2 nodes, {names[t]}: {spread([x * 1e3 for x in two], 'ms')}")
            print(f"  2 nodes / 1 node (medians): {statistics.median(two) / statistics.median(one):.2f}")


if __name__ == "__main__":
    main()
