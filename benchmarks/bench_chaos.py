"""How fast a swarm notices and recovers from losses (real processes, real iroh on loopback).

    python benchmarks/bench_chaos.py [--stale 4 --heartbeat 0.5]

Prints, for a 3-node swarm of a small char GPT:
  * kill -9 of a node mid-round: time until the coordinator drops it, and until the next round
    completes without it;
  * kill -9 of a node during the all-reduce: time until the survivors' retry starts and completes;
  * kill -9 of the coordinator, then `drift coord --resume`: rounds lost, for checkpoint_every 1 and 3.
Times are measured from the kill to the moment the event shows in metrics.jsonl (polled every 20 ms).
Detection is bounded by `stale_after_s` (heartbeats stop; a killed process sends no goodbye).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from harness.simulate import Swarm, make_task_repo

TASK = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}


def recipe(name: str, a: argparse.Namespace, **kw) -> dict:
    return {
        "name": name,
        "task_config": TASK,
        "min_nodes": 3,
        "rounds": 8,
        "inner_steps": 8,
        "batch_size": 8,
        "unit_steps": 2,
        "eval_batches": 1,
        "stale_after_s": a.stale,
        "heartbeat_s": a.heartbeat,
        **kw,
    }


def wait(swarm: Swarm, pred, t0: float) -> float:
    swarm.wait_event(pred, timeout=300)
    return time.monotonic() - t0


def node_loss(work: Path, a: argparse.Namespace, during_reduce: bool) -> tuple[float, float]:
    big = {**TASK, "n_layer": 4, "n_head": 4, "n_embd": 256} if during_reduce else TASK
    swarm = Swarm(make_task_repo(work / "repo", recipe("chaos", a, task_config=big)), work)
    victim = swarm.join("0.02")
    swarm.join("0.02")
    swarm.join("0.02")
    if during_reduce:
        swarm.wait_event(lambda e: e["event"] == "barrier" and e["round"] == 2, timeout=300)
    else:
        swarm.wait_event(lambda e: e["event"] == "round" and e["round"] == 1, timeout=300)
        time.sleep(0.2)
    t0 = time.monotonic()
    swarm.kill(victim)
    kind = "ring_retry" if during_reduce else "node_left"
    detect = wait(swarm, lambda e: e["event"] == kind, t0)
    after = next(e for e in swarm.events() if e["event"] == kind)["round"]
    recover = wait(swarm, lambda e: e["event"] == "round" and e["round"] >= after and len(e["nodes"]) == 2, t0)
    if swarm.finish() != 0:
        raise SystemExit(swarm.log())
    return detect, recover


def coordinator_loss(work: Path, a: argparse.Namespace, every: int) -> tuple[int, int]:
    r = make_task_repo(work / "repo", recipe("resume", a, min_nodes=2, rounds=12, checkpoint_every=every))
    first = Swarm(r, work)
    nodes = [first.join("0.02"), first.join("0.02")]
    first.wait_event(lambda e: e["event"] == "round" and e["round"] == 7, timeout=300)
    first.kill(first.coord)
    for p in nodes:
        first.kill(p)
    done = max(e["round"] for e in first.events() if e["event"] == "round")
    second = Swarm(r, work, "--resume", log_name="coord2.log")
    second.join("0.02")
    second.join("0.02")
    resumed = second.wait_event(lambda e: e["event"] == "resumed", timeout=300)["round"]
    if second.finish() != 0:
        raise SystemExit(second.log())
    return done, resumed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stale", type=float, default=4.0, help="stale_after_s in the recipe")
    ap.add_argument("--heartbeat", type=float, default=0.5, help="heartbeat_s in the recipe")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="drift-bench-chaos-"))
    print(f"stale_after_s {a.stale:g}, heartbeat_s {a.heartbeat:g}")
    d, r = node_loss(tmp / "mid-round", a, during_reduce=False)
    print(f"node killed mid-round:       dropped after {d:5.2f}s, next round done after {r:5.2f}s")
    d, r = node_loss(tmp / "mid-reduce", a, during_reduce=True)
    print(f"node killed in all-reduce:   retry after   {d:5.2f}s, round done after      {r:5.2f}s")
    for every in (1, 3):
        done, resumed = coordinator_loss(tmp / f"coord-{every}", a, every)
        print(
            f"coordinator killed, checkpoint_every {every}: last round done {done}, resumed after "
            f"round {resumed}: {done - resumed} round(s) lost"
        )


if __name__ == "__main__":
    main()
