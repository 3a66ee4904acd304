"""How close each codec's averaged pseudo-gradient is to the exact mean, on real pseudo-gradients
from the default task (recipes/shakespeare.yaml), through drift's real ring (3 nodes, iroh on
loopback, all in this process).

    flock /tmp/drift-bench.lock python benchmarks/ring_quality.py [--rounds 4] [--nodes 3]

Each round, every node trains `inner_steps` AdamW steps from the shared θ on its own batches;
Δ_i = θ - θ_i, weights equal. The exact mean (float64) drives θ forward, so every codec sees the
same sequence of pseudo-gradients. Printed per codec:
  rel err / round     ||avg_codec - avg_exact|| / ||avg_exact||, mean over rounds (and round 0)
  rel err of sum      the same for the sum over all rounds: what error feedback is for
  bytes/node/round    what a node sends per all-reduce, and the ratio to fp32
  replicas            whether every node got the same bytes
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from drift.compress import TopK, make_codec, relative_error  # noqa: E402
from drift.diloco import NesterovOuter, ParamLayout, epoch_order  # noqa: E402
from drift.protocol import RingMember  # noqa: E402
from drift.recipe import load_recipe  # noqa: E402
from drift.ring import Ring  # noqa: E402
from drift.transport import RING_ALPN, Endpoint  # noqa: E402


def pseudo_gradients(recipe_path: Path, nodes: int, rounds: int, threads: int) -> list[list[np.ndarray]]:
    """rounds x nodes weighted pseudo-gradients w_i * Δ_i from real training (exact averaging)."""
    from drift.workers import load_task
    from drift.workers.torch_worker import TorchWorker

    r = load_recipe(recipe_path)
    task = load_task(ROOT / r.task)
    io = r.inner_optimizer
    workers = [
        TorchWorker(
            task,
            r.task_config,
            dict(lr=io.lr, weight_decay=io.weight_decay, betas=(io.beta1, io.beta2), grad_clip=io.grad_clip),
            device="cpu",
            seed=r.seed,
            threads=threads,
        )
        for _ in range(nodes)
    ]
    layout = ParamLayout.of(workers[0].get_params())
    theta = layout.flatten(workers[0].get_params())
    outer = NesterovOuter(layout.size, r.outer_optimizer.lr, r.outer_optimizer.momentum)
    order = epoch_order(workers[0].n_train, r.seed, 0)
    out, b = [], 0
    for rnd in range(rounds):
        deltas = []
        for w in workers:
            w.set_params(layout.unflatten(theta))
            for _ in range(r.inner_steps):
                w.train_step(order[b * r.batch_size : (b + 1) * r.batch_size])
                b += 1
            d = theta - layout.flatten(w.get_params())
            deltas.append((d * np.float32(1 / nodes)).astype(np.float32))
        avg = np.sum(np.stack(deltas).astype(np.float64), axis=0).astype(np.float32)
        outer.step(theta, avg)
        out.append(deltas)
        print(
            f"  round {rnd}: trained {nodes} x {r.inner_steps} steps, |avg Δ| = {np.linalg.norm(avg):.4g}", flush=True
        )
    print(f"  {layout.size} parameters")
    return out


async def reduce_all(grads: list[list[np.ndarray]], codec) -> tuple[list[np.ndarray], int, bool]:
    """All-reduce every round's inputs through one persistent ring; (results, bytes/node/round, identical)."""
    n = len(grads[0])
    eps = [await Endpoint.bind("local") for _ in range(n)]
    rings = [Ring(e, codec=codec) for e in eps]

    tasks = [asyncio.ensure_future(e.serve({RING_ALPN: r.handle_incoming})) for e, r in zip(eps, rings)]
    members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=1 / n) for e in eps]
    results, sent, same = [], 0, True
    try:
        for rnd, xs in enumerate(grads):
            bufs = [x.copy() for x in xs]
            stats = await asyncio.gather(*(r.allreduce_sum(b, members, rnd) for r, b in zip(rings, bufs)))
            same &= len({b.tobytes() for b in bufs}) == 1
            sent += sum(s.bytes_sent for s in stats) // n
            results.append(bufs[0])
    finally:
        for t in tasks:
            t.cancel()
        for r in rings:
            r.close()
        for e in eps:
            await e.close()
    return results, sent // len(grads), same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "shakespeare.yaml"))
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--topk-fraction", type=float, nargs="+", default=[0.01, 0.05])
    args = ap.parse_args()
    print(
        f"ring_quality: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {args.nodes} nodes, {args.rounds} rounds, "
        f"{Path(args.recipe).name}"
    )
    grads = pseudo_gradients(Path(args.recipe), args.nodes, args.rounds, args.threads)
    exact = [np.sum(np.stack(xs).astype(np.float64), axis=0) for xs in grads]
    exact_sum = np.sum(np.stack(exact), axis=0)

    codecs: list[tuple[str, object]] = [(c, make_codec(c)) for c in ("fp32", "fp16", "bf16", "int8")]
    for f in args.topk_fraction:
        codecs.append((f"topk {f:g}", TopK(f)))
        no_ef = TopK(f)
        no_ef.error_feedback = False  # the same codec, residual dropped: what error feedback buys
        codecs.append((f"topk {f:g} no EF", no_ef))
    print(
        f"\n  {'codec':<18}{'rel err/round':>14}{'round 0':>10}{'rel err of sum':>16}"
        f"{'bytes/node/round':>18}{'vs fp32':>9}{'replicas':>10}"
    )
    fp32_bytes = None
    for name, codec in codecs:
        res, sent, same = asyncio.run(reduce_all(grads, codec))
        errs = [relative_error(r, e) for r, e in zip(res, exact)]
        err_sum = relative_error(np.sum(np.stack(res).astype(np.float64), axis=0), exact_sum)
        fp32_bytes = fp32_bytes or sent
        print(
            f"  {name:<18}{np.mean(errs):>14.3g}{errs[0]:>10.3g}{err_sum:>16.3g}{sent:>18,}"
            f"{fp32_bytes / sent:>8.1f}x{'identical' if same else 'DIFFER':>10}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
