"""The coordinator's decisions for a round of N nodes, alone: the CPU of drift.round.Round.step
and of applying its actions to the swarm (drift.round.write_swarm), per round, on the real round
logic in virtual time (benchmarks/harness/rounds.py: no network, no codec cost counted). A swarm
of equal speeds (one kind of machine) and one whose speeds spread (lognormal, sigma 0.3).

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_round_logic.py --nodes 256 1000
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

from drift import round as R
from drift.recipe import Recipe
from harness.rounds import Failures, VirtualSwarm

spent = [0.0]  # CPU seconds inside the round logic since the last reset


def timed(f):
    def run(*args, **kw):
        t = time.process_time()
        try:
            return f(*args, **kw)
        finally:
            spent[0] += time.process_time() - t

    return run


def per_round(n: int, spread: float, rounds: int, seed: int = 0) -> list[float]:
    """CPU seconds of the round logic in each of rounds 1.. (round 0 also plans from claims)."""
    rng = random.Random(seed)
    speeds = [100.0 * (rng.lognormvariate(0, spread) if spread else 1.0) for _ in range(n)]
    r = Recipe(name="t", task="x.py", rounds=rounds + 2, min_nodes=n, inner_steps=25, batch_size=8, unit_steps=5)
    sw = VirtualSwarm(r, speeds, Failures(), seed=seed, sync_s=45.0)
    out = []
    for rnd in range(rounds + 1):
        spent[0] = 0.0
        sw.round(rnd)
        if rnd:
            out.append(spent[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[256, 1000])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # (the stand-in nodes claim no speed: a line each)
    R.Round.step = timed(R.Round.step)
    R.write_swarm = timed(R.write_swarm)
    print("nodes  equal speeds: CPU a round, least / median   spread speeds: least / median   (rounds 1..)")
    for n in args.nodes:
        (e, s) = (per_round(n, spread, args.rounds) for spread in (0.0, 0.3))
        print(
            f"{n:5d}  {min(e):31.3f} / {statistics.median(e):.3f} s  {min(s):24.3f} / {statistics.median(s):.3f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
