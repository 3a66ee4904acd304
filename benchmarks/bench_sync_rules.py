"""Sync rules side by side in real swarms: val loss and bytes each node sent over the whole run.

The default task (recipes/shakespeare.yaml: its model, batch, AdamW), a real `drift coord` and
--nodes `drift join` processes on loopback, the same samples for every run (--samples, the first
of the recipe's epoch order) and one lr schedule (5 % warmup, cosine to lr/10, as
bench_vs_ddp.py). A run is RULE:H[:MIN], e.g. `int8:25` (the dense rule, int8 ring, outer lr 1.3,
momentum 0: the recipe's) or `sparse:10:1` (sync: sparse, its defaults but outer lr --sparse-lr,
error-feedback decay --ef-decay and top --k of each --chunk: a sign bit a value, --clip), trained for
samples / (H x nodes x batch) rounds; MIN is where the inner lr's cosine ends, x the lr (0.1;
1: no decay after the warmup). Bytes are what the nodes counted sending (payload and framing of the collective), summed
over the run and averaged over the nodes; the ratio is against the first run. "max w·N": per
round, the largest node's weight (its share of the round's samples) times N, averaged over the
rounds: 1 when the steal schedule split the work evenly. `--schedule lockstep`: every node trains
H steps a round (the simulation's split; a real run then matches it round by round).

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_sync_rules.py [--nodes 4] [--samples 32000] int8:25 sparse:10
    flock /tmp/drift-cpu.lock python3 benchmarks/bench_sync_rules.py --nodes 2 --samples 128000 --sparse-lr 3 --ef-decay 0.9 int8:25 sparse:25
    flock /tmp/drift-cpu.lock python3 benchmarks/bench_sync_rules.py --nodes 4 --samples 128000 --sparse-lr 5 --ef-decay 0.9 --k 64 --chunk 16384 int8:25:0.5 sparse:10:1
    flock /tmp/drift-cpu.lock python3 benchmarks/bench_sync_rules.py --nodes 4 --samples 128000 --sparse-lr 5 --ef-decay 0.9 --k 64 --chunk 16384 int8:25:0.5 sparse:10:1 int8:25:0.5 sparse:10:1

A run named more than once is run again (a real swarm's schedule is not deterministic: the
same run ends a few tenths of a percent apart): the last lines give each one's mean and spread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from drift.report import load_run
from harness.simulate import Swarm, make_task_repo

ROOT = Path(__file__).resolve().parents[1]


def recipe(rule: str, h: int, min_lr: float, nodes: int, samples: int, sparse: dict, schedule: str = "steal") -> dict:
    r = yaml.safe_load((ROOT / "recipes" / "shakespeare.yaml").read_text())
    r.pop("task")  # make_task_repo sets it
    rounds = samples // (h * nodes * r["batch_size"])
    r.update(
        name=f"rules-{rule}-h{h}",
        min_nodes=nodes,
        rounds=rounds,
        inner_steps=h,
        unit_steps=min(h, r["unit_steps"]),
        checkpoint_every=rounds,
        schedule=schedule,
        lr_schedule={"warmup_samples": samples // 20, "min_lr": r["inner_optimizer"]["lr"] * min_lr},
    )
    if rule == "sparse":
        r.update(sync="sparse", sync_params=sparse)
    elif rule != "int8":
        raise SystemExit(f"unknown rule {rule!r} (int8 or sparse)")
    return r


def run(
    spec: str, nodes: int, samples: int, sparse: dict, schedule: str, work: Path
) -> tuple[str, int, int, float, float, float, float]:
    rule, h, *rest = spec.split(":")
    rec = recipe(rule, int(h), float(rest[0]) if rest else 0.1, nodes, samples, sparse, schedule)
    t0 = time.monotonic()
    swarm = Swarm(make_task_repo(work / "repo", rec), work)
    for i in range(nodes):
        swarm.join(name=f"n{i}")
    if swarm.finish(timeout=3600) != 0:
        raise SystemExit(f"{spec} failed:\n{swarm.log()[-3000:]}")
    events = swarm.events()
    final = next(e for e in events if e["event"] == "complete")["final_val_loss"]
    # how uneven the work was: per round, the largest node weight over 1/N (1: equal shares)
    rounds = [e for e in events if e["event"] == "round"]
    uneven = sum(max(n["weight"] for n in r["nodes"].values()) * nodes for r in rounds) / len(rounds)
    mib = load_run(swarm.run_dir).mib_per_node()
    return spec, int(h), rec["rounds"], final, mib, uneven, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "runs", nargs="+", help="RULE:H[:MIN], e.g. int8:25 sparse:10:1 (MIN: the inner lr's end, x the lr)"
    )
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--samples", type=int, default=32000)
    ap.add_argument("--sparse-lr", type=float, default=2.0, help="sync: sparse's outer lr")
    ap.add_argument("--ef-decay", type=float, default=0.95, help="sync: sparse's error-feedback decay")
    ap.add_argument("--k", type=int, default=64, help="sync: sparse's values kept per chunk")
    ap.add_argument("--chunk", type=int, default=4096, help="sync: sparse's chunk")
    ap.add_argument("--clip", type=float, default=1.0, help="sync: sparse's clip (x the median norm)")
    ap.add_argument("--schedule", choices=["steal", "lockstep"], default="steal", help="the recipe's schedule")
    a = ap.parse_args()
    sparse = {"lr": a.sparse_lr, "ef_decay": a.ef_decay, "k": a.k, "chunk": a.chunk, "clip": a.clip}
    print(f"{a.nodes} nodes, {a.samples} samples, loopback, schedule {a.schedule}; sparse: {sparse}")
    print(
        f"{'run':>12} {'H':>3} {'rounds':>6} {'val loss':>9} {'vs first':>9} {'MiB sent/node':>14} {'fewer':>7} {'max w·N':>8} {'wall s':>7}"
    )
    first, finals = None, {}
    for spec in a.runs:
        with tempfile.TemporaryDirectory(prefix="drift-rules-") as tmp:
            rule, h, rounds, val, mib, uneven, wall = run(spec, a.nodes, a.samples, sparse, a.schedule, Path(tmp))
        first = first or (val, mib)
        print(
            f"{rule:>12} {h:>3} {rounds:>6} {val:>9.3f} {val / first[0] - 1:>+9.1%} {mib:>14.3f}"
            f" {first[1] / mib if mib else float('nan'):>6.1f}x {uneven:>8.2f} {wall:>7.0f}",  # (one node sends nothing)
            flush=True,
        )
        finals.setdefault(spec, []).append(val)
    if any(len(v) > 1 for v in finals.values()):  # repeats: each run's mean and spread, against the first's
        base = statistics.mean(finals[a.runs[0]])
        for spec, vals in finals.items():
            sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
            print(
                f"{spec:>12} x{len(vals)}: mean {statistics.mean(vals):.4f} sd {sd:.4f} ({statistics.mean(vals) / base - 1:+.1%})"
            )


if __name__ == "__main__":
    main()
