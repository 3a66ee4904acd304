"""What the poisoning check costs an honest node per round: one L2 norm over the all-reduced Δ
(diloco.reduced_problem; the norm of its own Δ was computed already, by DeltaCheck), next to the
outer step it guards, for θ of a few sizes. Prints one row per size.

    python3 benchmarks/bench_checks.py [--sizes 10.8e6 124e6]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drift import protocol as P
from drift.diloco import NesterovOuter, reduced_problem


def best(fn, repeat: int = 5) -> float:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def row(n: int) -> str:
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(n, dtype=np.float32)
    reduced = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    scratch = reduced.copy()  # the outer step uses the sum as scratch
    ring = [P.RingMember(node_id=f"{k:064x}", ticket="t", weight=0.25, norm=1.0) for k in range(4)]
    check = best(lambda: reduced_problem(reduced, ring))
    outer = NesterovOuter(n)
    step = best(lambda: outer.step(theta, scratch))
    return f"{n:>12,} {check * 1e3:>9.1f} {step * 1e3:>14.1f} {check / step:>13.0%}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[10.8e6, 124e6])
    args = ap.parse_args()
    print(f"{'θ values':>12} {'check ms':>9} {'outer step ms':>14} {'check / outer':>14}")
    for n in map(int, args.sizes):
        print(row(n))


if __name__ == "__main__":
    main()
