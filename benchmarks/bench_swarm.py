"""Swarm efficiency of heterogeneous swarms: drift's work stealing versus lockstep DiLoCo.

    python benchmarks/bench_swarm.py [--repeat 3] [--rounds 5] [--inner-steps 40]

Every node is a real `drift join` process (real iroh on loopback, real training of a small char
GPT). Devices are simulated with an absolute step time: a node of relative speed s runs with
a simulated step of BASE/s (tests/wrappers/sim_node.py), so each of its inner steps takes exactly BASE/s seconds (the real step, a few
milliseconds here, padded by sleeping). A simulated swarm therefore means the same on any machine
fast enough to compute a step within BASE, and a node's solo speed is known exactly:
BATCH * s / BASE samples/s (checked by running each device alone).

Swarm efficiency = swarm samples/s / sum of the nodes' solo samples/s. Swarm samples/s = samples
trained in rounds 1.. / their wall-clock (round 0 is warm-up); that time includes barriers, the
ring all-reduce, evaluation and scheduling. Idle = mean time a node waited at the barrier per round.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from harness.simulate import Swarm, make_task_repo

TASK = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}
BATCH, UNIT_STEPS = 8, 2
BASE = 0.1  # seconds per inner step of a speed-1 device
MIXES = {"[1, .5, .25, .1]": [1, 0.5, 0.25, 0.1], "[1, 1, 1, 1]": [1, 1, 1, 1], "[1, .002]": [1, 0.002]}


def recipe(n: int, schedule: str, inner_steps: int, rounds: int) -> dict:
    return {
        "name": f"bench-{schedule}",
        "task_config": TASK,
        "min_nodes": n,
        "rounds": rounds,
        "inner_steps": inner_steps,
        "batch_size": BATCH,
        "unit_steps": UNIT_STEPS,
        "eval_batches": 1,
        "schedule": schedule,
        "seed": 1,
        "stale_after_s": 120.0,
        "heartbeat_s": 1.0,
    }


def run(work: Path, speeds: list[float], schedule: str, inner_steps: int, rounds: int) -> dict:
    work.mkdir(parents=True)
    swarm = Swarm(make_task_repo(work / "repo", recipe(len(speeds), schedule, inner_steps, rounds)), work)
    for s in speeds:
        swarm.join(f"{BASE / s:.6g}")
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


def solo_sps(s: float) -> float:
    return BATCH * s / BASE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner-steps", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each mix and schedule")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="drift-bench-swarm-"))
    for s in (1, 0.1):  # the simulation holds: a device alone trains at its nominal speed
        measured = run(tmp / f"solo-{s}", [s], "steal", 5, 3)["train_sps"]
        print(
            f"solo speed {s:<5g} (sim step {BASE / s:g}): nominal {solo_sps(s):6.2f}, measured "
            f"{measured:6.2f} samples/s",
            flush=True,
        )
    rows = []
    for label, mix in MIXES.items():
        for schedule in ("steal", "lockstep"):
            # Lockstep waits for the slowest node's inner_steps; its efficiency does not depend on
            # how many, so keep that wait finite.
            steps = a.inner_steps if schedule == "steal" else (10 if min(mix) > 0.01 else 1)
            rounds = a.rounds if schedule == "steal" else 2
            effs = []
            for k in range(a.repeat if schedule == "steal" else 1):
                res = run(tmp / f"{schedule}-{label.strip('[]').replace(', ', '_')}-{k}", mix, schedule, steps, rounds)
                eff = res["sps"] / sum(solo_sps(s) for s in mix)
                effs.append(eff)
                idle = ", ".join(f"{v:.2f}" for v in res["idle"].values())
                roles = f"evaluators {res['evaluators']}" if res["evaluators"] else "all train"
                rows.append({"mix": label, "schedule": schedule, "run": k, "efficiency": eff, **res})
                print(
                    f"{label:<18}{schedule:<10} run {k}  efficiency {eff:6.1%}  swarm {res['sps']:7.1f} samples/s  "
                    f"round {res['round_s']:5.1f}s  barrier idle/round [{idle}] s  {roles}",
                    flush=True,
                )
            if len(effs) > 1:
                print(
                    f"{label:<18}{schedule:<10} efficiency over {len(effs)} runs: mean {sum(effs) / len(effs):.1%}, "
                    f"min {min(effs):.1%}, max {max(effs):.1%}",
                    flush=True,
                )
    if a.json:
        a.json.write_text(json.dumps({"base_step_s": BASE, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
