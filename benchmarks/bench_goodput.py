"""Goodput of drift's rounds under failures, in virtual time (benchmarks/harness/rounds.py: the
real round logic, simulated nodes and clock): samples that reach θ over the samples the swarm's
compute could have trained in the same time, per swarm size, without failures and with the
failure model (each round, each node lost with probability --lost, slowed --slowdown× with
probability --slowed).

    python benchmarks/bench_goodput.py --nodes 64 256 --rounds 20

Speeds are spread log-normally (σ 0.3) around --sps; a round is H inner steps of --batch per
node at that speed; the all-reduce takes --sync-s. Goodput and s/round are over every round
but the last (never cut: it trains the rest of the budget). Deterministic for a seed (the
script runs itself again under PYTHONHASHSEED=0: the rounds iterate sets of node ids).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import random
import sys
import time

from drift.recipe import Recipe
from harness.rounds import Failures, VirtualSwarm


def run(n: int, args, failures: Failures, **recipe) -> tuple:
    rng = random.Random(args.seed)
    speeds = [args.sps * rng.lognormvariate(0, 0.3) for _ in range(n)]
    r = Recipe(
        name="goodput",
        task="x.py",
        rounds=args.rounds,
        min_nodes=n,
        inner_steps=args.H,
        batch_size=args.batch,
        unit_steps=args.unit_steps,
        **recipe,
    )
    sw = VirtualSwarm(r, speeds, failures, seed=args.seed, latency_s=args.latency_s, sync_s=args.sync_s)
    t = time.perf_counter()
    st = sw.run(args.rounds)
    return st, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--H", type=int, default=100, help="inner steps per node and round")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--unit-steps", type=int, default=5)
    ap.add_argument("--sps", type=float, default=16.0, help="median samples/s of a node (0.5 s a step)")
    ap.add_argument("--sync-s", type=float, default=5.0, help="the all-reduce's seconds")
    ap.add_argument("--latency-s", type=float, default=0.02, help="one way, node <-> coordinator")
    ap.add_argument("--lost", type=float, default=0.01)
    ap.add_argument("--slowed", type=float, default=0.05)
    ap.add_argument("--slowdown", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quorum", type=float, nargs="+", default=[1.0, 0.5], help="recipe quorum (1: no early cut)")
    args = ap.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    logging.getLogger("drift").setLevel(logging.ERROR)  # (each joiner's speed is set after its entry)
    print("nodes  quorum  failures      goodput  s/round  lost  slowed  cut  merged  abandoned  (cpu s)")
    for n, q in itertools.product(args.nodes, args.quorum):
        for label, f in (("none", Failures()), ("lost+slowed", Failures(args.lost, args.slowed, args.slowdown))):
            st, cpu = run(n, args, f, quorum=q)
            print(
                f"{n:5d}  {q:6.2f}  {label:12s}  {st.goodput:6.1%}  {st.seconds / st.rounds:7.1f}  {st.lost:4d}  "
                f"{st.slowed:6d}  {st.cut:3d}  {st.merged / st.samples:6.1%}  {st.abandoned:9d}  ({cpu:.1f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
