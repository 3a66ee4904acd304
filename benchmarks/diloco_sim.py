"""DiLoCo in one process, no network: how the outer optimizer and H change the loss at equal samples.

    python benchmarks/diloco_sim.py diloco --H 50 --outer-lr 1.3 --momentum 0
    python benchmarks/diloco_sim.py ddp         # one worker, batch nodes x 32: what DDP computes
    python benchmarks/diloco_sim.py single      # one worker, batch 32, nodes x the steps

The default recipe's task, AdamW and θ0 (drift's own TorchWorker), the recipe's epoch-0 sample
order; `--nodes` replicas train H steps each from the same θ, then the outer step (drift's
NesterovOuter) applies their mean pseudo-gradient. It isolates the algorithm from the transport:
bench_vs_ddp.py runs the same comparison with real processes over real links. Prints the val
loss after every H steps per replica.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drift.diloco import NesterovOuter, ParamLayout, epoch_order  # noqa: E402
from drift.recipe import load_recipe  # noqa: E402
from workers import load_task  # noqa: E402
from workers.torch_worker import TorchWorker  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["diloco", "ddp", "single"])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300, help="inner steps per replica (ddp: steps)")
    ap.add_argument("--H", type=int, default=50)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    r = load_recipe(ROOT / "recipes" / "shakespeare.yaml")
    task = load_task(ROOT / r.task)

    def worker() -> TorchWorker:
        return TorchWorker(
            task, r.task_config, r.inner_optimizer.model_dump(), device="cpu", seed=r.seed, threads=a.threads
        )

    w0 = worker()
    order, B, N, H = epoch_order(w0.n_train, r.seed, 0), r.batch_size, a.nodes, a.H
    if a.mode != "diloco":  # one worker: ddp = batch N*B for `steps`; single = batch B for N*steps
        batch, steps = (N * B, a.steps) if a.mode == "ddp" else (B, N * a.steps)
        every = H if a.mode == "ddp" else N * H
        for k in range(steps):
            w0.train_step(order[k * batch : (k + 1) * batch])
            if (k + 1) % every == 0:
                print(f"{(k + 1) * batch:>7} samples  val {w0.evaluate(r.eval_batches, B):.4f}", flush=True)
        return
    replicas = [w0] + [worker() for _ in range(N - 1)]
    layout = ParamLayout.of(w0.get_params())
    theta = layout.flatten(w0.get_params())
    outer = NesterovOuter(theta.size, a.outer_lr, a.momentum)
    pos = 0
    for rnd in range(a.steps // H):
        deltas = []
        for w in replicas:
            w.set_params(layout.unflatten(theta))
            for _ in range(H):
                w.train_step(order[pos : pos + B])
                pos += B
            deltas.append(theta - layout.flatten(w.get_params()))
        outer.step(theta, np.mean(deltas, axis=0))
        w0.set_params(layout.unflatten(theta))
        print(f"{pos:>7} samples  round {rnd}  val {w0.evaluate(r.eval_batches, B):.4f}", flush=True)


if __name__ == "__main__":
    main()
