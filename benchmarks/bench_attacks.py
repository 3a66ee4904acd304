"""Issue 36's "done when", measured: each attack as a real `drift join` whose sends are altered
(tests/wrappers/fault_node.py) against three honest nodes, with the dense rule (int8 ring) and
the sparse one, beside an honest swarm of four: the wall-clock from training's start to
the run's end, the final val loss, who was named (the events that name the attacker) and whether an
honest node was dropped. The base is the median of three honest runs (their spread is shown).
Every node steps at the same simulated pace (tests/wrappers/sim_node.py),
so the wall-clock compares the same work.

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_attacks.py [--rules dense sparse] [--rounds 6] [--inner-steps 6] [--honest-reps 3]

Not here: the rendezvous of local ranks (attack 9, tests/test_ranks.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from harness.simulate import ROOT, SIM, TINY_RECIPE, Swarm, make_task_repo

FAULT_NODE = ROOT / "tests" / "wrappers" / "fault_node.py"
ATTACKS = {  # fault -> the attack
    "sit-out-early:1": "1: 'I already applied', at once",
    "lie-steps:1": "2: norm x1000 over 10^9 steps",
    "withhold-gather:1": "3: no all-gather payload sent (sparse only)",
    "sit-out-late:1": "4: 'I sat out', 0.3 s late",
    "repeat-progress:0": "6: each progress and ask x20",
    "withhold-done:1": "6: never a RoundDone",
    "scale-ring:1": "poison: x1000 Δ",
    "flip-ring:1": "poison: -10x Δ",
    "noise-ring:1": "poison: noise 10x ‖Δ‖",
}
NAMING = ("false_claim", "outlier_delta", "poisoner", "sat_out", "node_left", "strike")


def run(work: Path, rule: str, fault: str | None, rounds: int, inner_steps: int) -> dict:
    recipe = {**TINY_RECIPE, **SIM, "min_nodes": 4, "rounds": rounds, "inner_steps": inner_steps}
    if rule == "sparse":
        recipe.update(sync="sparse", sync_params={"dense_rounds": 0})  # every round all-gathered
    swarm = Swarm(make_task_repo(work / "repo", recipe), work)
    if fault is not None:
        swarm.join("0.02", name="bad", script=FAULT_NODE, env={"DRIFT_TEST_FAULT": fault})
    honest = [swarm.join("0.02", name=f"good{i}") for i in range(3 if fault else 4)]
    code = swarm.finish(timeout=900, leave=honest)
    events = swarm.events()
    complete = next((e for e in events if e["event"] == "complete"), {})
    return {
        "code": code,
        # the coordinator's clock, from training's start (the nodes' start-up is not the attack's)
        "wall": complete.get("t", float("nan")) - next(e["t"] for e in events if e["event"] == "training_started"),
        "val": complete.get("final_val_loss"),
        "named": sorted({e["event"] for e in events if e["event"] in NAMING and e.get("name") == "bad"}),
        "honest_dropped": sorted({e["name"] for e in events if e["event"] == "node_left" and e.get("name") != "bad"}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", nargs="+", default=["dense", "sparse"], choices=["dense", "sparse"])
    ap.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--inner-steps", type=int, default=6, help="inner steps a round (20 ms each)")
    ap.add_argument("--honest-reps", type=int, default=3, help="honest runs per rule; their median is the base")
    args = ap.parse_args()
    print(
        "| rule | attack | exit | wall s | × honest | final val | Δ val vs honest | attacker named by | honest dropped |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rule in args.rules:
        # Honest runs differ by a few percent in val loss on this tiny task: the median of
        # --honest-reps is the base, and every honest run is a row of its own.
        honest = []
        for _ in range(args.honest_reps):
            with tempfile.TemporaryDirectory() as d:
                honest.append(run(Path(d), rule, None, args.rounds, args.inner_steps))
        base = {k: statistics.median(h[k] for h in honest) for k in ("wall", "val")}
        for h in honest:
            print(
                f"| {rule} | none (4 honest) | {h['code']} | {h['wall']:.1f} | {h['wall'] / base['wall']:.2f} "
                f"| {h['val']:.4f} | {100 * (h['val'] / base['val'] - 1):+.1f} % | | |",
                flush=True,
            )
        for fault in args.attacks:
            if fault.startswith("withhold-gather") and rule != "sparse":
                continue  # (the dense rule's ring has no all-gather)
            with tempfile.TemporaryDirectory() as d:
                r = run(Path(d), rule, fault, args.rounds, args.inner_steps)
            val, dv = (
                ("-", "-") if r["val"] is None else (f"{r['val']:.4f}", f"{100 * (r['val'] / base['val'] - 1):+.1f} %")
            )
            print(
                f"| {rule} | {ATTACKS[fault]} (`{fault}`) | {r['code']} | {r['wall']:.1f} | {r['wall'] / base['wall']:.2f} "
                f"| {val} | {dv} | {', '.join(r['named']) or 'nobody'} | {', '.join(r['honest_dropped']) or 'none'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
