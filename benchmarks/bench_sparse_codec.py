"""The sparse rule's CPU work (drift/sync/sparse.py) at a given θ size, in one process, each part
timed on its own: `contribute` (e ← decay·e + Δ, encode, e −= decode: one node's round), `encode`
alone, the norms of `--nodes` payloads, and `combine` (norms, clip, the fixed-order sum: every
node's round). Pseudo-gradients are seeded, heavy-tailed (Student t, 3 dof) with a per-512-value
scale spread over orders of magnitude, like a real Δ's layers.

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_sparse_codec.py            # 124M values, 4 nodes
    python3 benchmarks/bench_sparse_codec.py --size 10000000 --digest             # also sha256 of payloads and sum

Printed: seconds per part (best of --reps) and, with --digest, sha256 of the payloads (must not
change when the codec is made faster) and of the combined sum (must not change with a lossless
format change, such as the Elias-Fano indices; it did with the one-bit values).
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np

from drift.diloco import ParamLayout
from drift.protocol import RingMember
from drift.recipe import Recipe
from drift.sync import make_rule


def pseudo_gradient(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty(n, np.float32)
    for a in range(0, n, 1 << 22):  # pieces: no float64 temporary the size of θ
        b = min(n, a + (1 << 22))
        scale = np.repeat(np.exp(rng.normal(-6, 1.5, -(-(b - a) // 512))), 512)[: b - a]
        out[a:b] = rng.standard_t(3, b - a) * scale
    return out


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=124_000_000, help="θ values")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--digest", action="store_true", help="print sha256 of the payloads and the sum")
    a = ap.parse_args()
    layout = ParamLayout(("w",), ((a.size,),))
    recipe = Recipe.model_validate(
        {"name": "x", "task": "t.py", "rounds": 1, "inner_steps": 1, "batch_size": 1, "sync": "sparse"}
    )
    ring = [RingMember(node_id=f"{i:064x}", ticket="t", weight=1 / a.nodes) for i in range(a.nodes)]
    rule = make_rule(layout, recipe)  # each node's payload from a zero error feedback: never applied
    rnd = rule.params.dense_rounds  # the first all-gathered round
    payloads = [rule.contribute(pseudo_gradient(a.size, i), m.weight, rnd) for i, m in enumerate(ring)]
    delta = pseudo_gradient(a.size, 0)
    t_contribute = best(lambda: rule.contribute(delta, ring[0].weight, rnd), a.reps)  # delta garbled: same cost
    delta = pseudo_gradient(a.size, 0)
    t_encode = best(lambda: rule.codec.encode(delta), a.reps)
    t_norms = best(lambda: [rule.codec.norm(p) for p in payloads], a.reps)
    t_combine = best(lambda: rule.combine(payloads, ring), a.reps)
    theta = np.zeros(a.size, np.float32)

    def step() -> None:  # the update is kept by combine and consumed by apply
        rule.combine(payloads, ring)
        rule.apply(theta)

    t_step = best(step, a.reps) - t_combine
    print(f"θ {a.size / 1e6:.0f}M values, {a.nodes} nodes, payload {len(payloads[0]) / 1e6:.2f} MB")
    print(f"  contribute (decay + encode + feedback)  {t_contribute:6.2f} s")
    print(f"    of which encode                        {t_encode:6.2f} s")
    print(f"  norms of {a.nodes} payloads                   {t_norms:6.2f} s")
    print(f"  combine {a.nodes} payloads (norms + clip)     {t_combine:6.2f} s")
    print(f"  apply (decode, sum, outer step)         {t_step:6.2f} s")
    print(f"  a node's round: the three               {t_contribute + t_combine + t_step:6.2f} s")
    if a.digest:  # the payloads' bytes (a format), and the sum they decode to (the same across formats)
        theta[...] = 0
        step()  # outer lr 1 from θ = 0: θ is -sum, and 0 - θ gives the sum's bits back
        print(f"  payloads sha256 {hashlib.sha256(b''.join(payloads)).hexdigest()}")
        print(f"  sum sha256      {hashlib.sha256(np.subtract(np.float32(0), theta).tobytes()).hexdigest()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
