"""Swarm efficiency of heterogeneous swarms: drift's work stealing versus lockstep DiLoCo.

    python benchmarks/bench_swarm.py [--rounds 4] [--inner-steps 40]

Every node is a real `drift join` process (real iroh on loopback, real training of a small char
GPT). Device speeds are simulated: a node with relative speed s runs with `--speed base*s`, which
stretches each inner step to 1/(base*s) of its real length by sleeping. With base 0.03 the
stretched part is ~97% of even the fastest node's step, so the figures measure scheduling, not
the fight of 4 processes for 2 cores. (The [1, .002] mix uses base 0.1: two processes fight less,
and its slow node's step is already ~50 s.)

Swarm efficiency = swarm samples/s / sum of each node's solo samples/s. A node's solo samples/s
is measured by running that node alone (a one-node swarm, same recipe) just before the mixes, as
the mean speed of its finished work units (training only: no barrier, eval or sync counted);
for the 500x-slow node (one inner step ~25 s) it is derived instead: 0.002 x the solo speed of a
speed-1 node, exact to within the real compute in its step (0.02% of it).
Swarm samples/s = samples trained in rounds 1.. / their wall-clock (round 0 is warm-up); that
time includes barriers, the ring all-reduce, evaluation and scheduling. Idle = mean time a node
waited at the barrier per round.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from drift.simulate import Swarm, make_task_repo

TASK = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}
BATCH, UNIT_STEPS = 8, 2
MIXES = {"[1, .5, .25, .1]": ([1, 0.5, 0.25, 0.1], 0.03), "[1, 1, 1, 1]": ([1, 1, 1, 1], 0.03),
         "[1, .002]": ([1, 0.002], 0.1)}


def recipe(n: int, schedule: str, inner_steps: int, rounds: int) -> dict:
    return {"name": f"bench-{schedule}", "task_config": TASK, "min_nodes": n, "rounds": rounds,
            "inner_steps": inner_steps, "batch_size": BATCH, "unit_steps": UNIT_STEPS, "eval_batches": 1,
            "schedule": schedule, "seed": 1, "stale_after_s": 120.0, "heartbeat_s": 1.0}


def run(work: Path, speeds: list[float], schedule: str, inner_steps: int, rounds: int) -> dict:
    work.mkdir(parents=True)
    swarm = Swarm(make_task_repo(work / "repo", recipe(len(speeds), schedule, inner_steps, rounds)), work)
    for s in speeds:
        swarm.join(f"{s:.6g}")
    rc = swarm.finish(timeout=3600)
    if rc != 0:
        raise SystemExit(f"swarm failed:\n{swarm.log()}")
    ev = [e for e in swarm.events() if e["event"] == "round"]
    timed = ev[1:] if len(ev) > 1 else ev
    names = sorted(timed[0]["nodes"])
    progress = [e for e in swarm.events() if e["event"] == "progress"]
    by_node: dict[str, list[float]] = {}
    for e in progress:
        by_node.setdefault(e["node_id"], []).append(e["samples_per_s"])
    return {
        "train_sps": sum(e["samples_per_s"] for e in progress) / len(progress),
        # each node's speed while it trains, in this very run (immune to calibration noise)
        "node_sps": {k: sum(v) / len(v) for k, v in by_node.items()},
        "sps": sum(e["samples"] for e in timed) / sum(e["seconds"] for e in timed),
        "round_s": sum(e["seconds"] for e in timed) / len(timed),
        "idle": {n: sum(e["nodes"][n]["idle_s"] for e in timed if n in e["nodes"]) / len(timed) for n in names},
        "evaluators": timed[-1]["evaluators"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=40)
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="drift-bench-swarm-"))
    solo: dict[tuple[float, float], float] = {}
    for s, base in sorted({(s, b) for m, b in MIXES.values() for s in m}, reverse=True):
        if s < 0.01:
            solo[s, base] = s * solo[1, base]
            print(f"solo speed {s:<6g} (--speed {base * s:.6g}): {solo[s, base]:8.2f} samples/s (derived)", flush=True)
            continue
        solo[s, base] = run(tmp / f"solo-{s}-{base}", [base * s], "steal", 5, 3)["train_sps"]
        print(f"solo speed {s:<6g} (--speed {base * s:.6g}): {solo[s, base]:8.1f} samples/s", flush=True)
    rows = []
    for label, (mix, base) in MIXES.items():
        for schedule in ("steal", "lockstep"):
            # Lockstep waits for the slowest node's inner_steps; its efficiency does not depend on
            # how many, so keep that wait finite.
            steps = a.inner_steps if schedule == "steal" else (10 if min(mix) > 0.01 else 1)
            rounds = a.rounds if schedule == "steal" else 2
            res = run(tmp / f"{schedule}-{label.strip('[]').replace(', ', '_')}", [base * s for s in mix],
                      schedule, steps, rounds)
            eff = res["sps"] / sum(solo[s, base] for s in mix)
            # The same, against each node's own training speed in this run (an evaluator, which
            # never trains, counts at its solo speed): only the scheduling and sync losses remain.
            in_run = res["sps"] / (sum(res["node_sps"].values()) +
                                   sum(solo[s, base] for s in mix[len(res["node_sps"]):]))
            idle = ", ".join(f"{v:.2f}" for v in res["idle"].values())
            roles = f"evaluators {res['evaluators']}" if res["evaluators"] else "all train"
            rows.append({"mix": label, "schedule": schedule, "efficiency": eff, "efficiency_in_run": in_run, **res})
            print(f"{label:<18}{schedule:<10} efficiency {eff:6.1%} (vs in-run speeds {in_run:6.1%})  swarm {res['sps']:7.1f} samples/s  "
                  f"round {res['round_s']:5.1f}s  barrier idle/round [{idle}] s  {roles}", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"solo": {f"{s}@{b}": v for (s, b), v in solo.items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
