"""The baselines drift is measured against: synchronous data-parallel training (torch DDP over
gloo, gradients all-reduced every step) and a single node, on the same task and data as drift.

One process per rank (bench_vs_ddp.py starts them, each pinned to a core of its own, inside
network namespaces when the links are limited):

    python benchmarks/ddp_baseline.py RECIPE --rank R --world W --master HOST:PORT --out RUN_DIR

Same everything as a drift run of RECIPE with W nodes: the task's model and initial θ (built by
drift's own TorchWorker), its AdamW settings and grad clip, batch_size per node, the inner
learning-rate schedule (`Recipe.inner_lr` of the samples the whole world trained before the step:
warmup and cosine decay over the run, as drift's nodes follow the swarm's samples), and the same
samples: the recipe's epoch-0 order, step k of rank r taking the k-th global batch's r-th slice,
so W ranks x rounds*inner_steps steps cover exactly the samples drift trains. World 1 is the
single-node baseline (no process group), with W x the steps to keep the samples equal:
`--world 1 --steps-scale 2`.

Rank 0 writes RUN_DIR/metrics.jsonl in drift's own event format (training_started, initial, one
`round` per inner_steps steps, complete), so `drift report` plots these runs next to drift's.
Per rank and round, as drift's nodes report theirs: `step_s` (seconds computing: each step's
wall-clock less the all-reduce it waited for at its end), `sync_s` (that wait), `idle_s` (the
rest: evaluation and its barrier), `busy_s` = step_s. The all-reduce DDP overlaps with the
backward pass is compute time here; only the wait it leaves is not.

The `complete` event carries the figures of the ideal ratio, all measured in this run:
`step_wall_s` (mean wall-clock of a training step, all-reduce included), `step_compute_s` (mean
step_s per step) and `pure_compute_s` (median of --calib-steps extra steps after training under
DDP's no_sync(): the same computation with no communication at all; they train nothing counted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

T_START = time.time()  # before the heavy imports, like a drift process's clock

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

from drift.diloco import epoch_order  # noqa: E402
from drift.recipe import load_recipe  # noqa: E402
from drift.workers import load_task  # noqa: E402
from drift.workers.torch_worker import TorchWorker  # noqa: E402


class CommStats:
    """What the all-reduce hook saw: bytes handed to gloo, and per step the moment the last bucket
    was handed over (the backward pass is done then) and the moment the last reduce finished."""

    def __init__(self) -> None:
        self.bytes = 0
        self.last_hook = 0.0
        self.last_done = 0.0

    # No annotations here: DDP checks them, and `from __future__ import annotations` makes them strings.
    def hook(self, state, bucket):
        self.last_hook = time.perf_counter()
        buf = bucket.buffer()
        self.bytes += buf.numel() * buf.element_size()
        fut = default_hooks.allreduce_hook(None, bucket)  # the stock DDP all-reduce (mean)

        def done(f: torch.futures.Future) -> torch.Tensor:
            self.last_done = max(self.last_done, time.perf_counter())
            return f.value()

        return fut.then(done)

    def wait_s(self) -> float:
        """Seconds the step waited for communication after its backward pass (the reduces run
        one after another, so the last bucket's reduce ends last)."""
        return max(0.0, self.last_done - self.last_hook)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--master", default="127.0.0.1:29500", help="rank 0's HOST:PORT for gloo's rendezvous")
    ap.add_argument("--steps-scale", type=int, default=1, help="multiply the steps (single node: the swarm size)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--calib-steps",
        type=int,
        default=30,
        help="steps without communication after training, timed: the pure compute per step",
    )
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    r = load_recipe(a.recipe)
    task = load_task(a.recipe.resolve().parents[1] / r.task)
    w = TorchWorker(task, r.task_config, r.inner_optimizer.model_dump(), device="cpu", seed=r.seed, threads=a.threads)
    model, stats = w.model, CommStats()
    if a.world > 1:
        host, port = a.master.rsplit(":", 1)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=a.rank, world_size=a.world)
        model = DistributedDataParallel(w.model)
        model.register_comm_hook(None, stats.hook)

    order = epoch_order(w.n_train, r.seed, 0)
    B, W, H = r.batch_size, a.world, r.inner_steps * a.steps_scale
    steps = r.rounds * H
    if steps * W * B > len(order):
        raise SystemExit(f"{steps * W * B} samples asked for, the epoch has {len(order)}")
    out = None
    if a.rank == 0:
        a.out.mkdir(parents=True, exist_ok=True)
        out = open(a.out / "metrics.jsonl", "w", buffering=1)

    def event(kind: str, **fields: object) -> None:
        if out:
            out.write(json.dumps({"t": round(time.time() - T_START, 3), "event": kind, **fields}) + "\n")

    def evaluate() -> float | None:
        val = w.evaluate(r.eval_batches, B) if a.rank == 0 else None
        if W > 1:
            dist.barrier()  # the others wait while rank 0 evaluates, as drift's nodes do
        return val

    def step(k: int) -> float:
        """Train global step k (this rank's slice of the k-th global batch); its loss."""
        lo = (k * W + a.rank) * B
        x, y = w.dataset.batch("train", order[lo % len(order) :][:B])
        loss = model(torch.from_numpy(x), torch.from_numpy(y))
        w.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        if r.inner_optimizer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(w.model.parameters(), r.inner_optimizer.grad_clip)
        w.optimizer.step()
        return loss.item()

    if W > 1:
        dist.barrier()  # every rank is up: training starts now, for all of them
    event("training_started", nodes=W)
    event("initial", val_loss=evaluate())
    wall_total = compute_total = 0.0
    for rnd in range(r.rounds):
        t_round, compute, wait = time.perf_counter(), 0.0, 0.0
        bytes0 = stats.bytes
        lr = None
        for k in range(rnd * H, (rnd + 1) * H):
            lr = r.inner_lr(k * W * B)  # the samples the world trained before this step
            w.set_lr(lr)
            stats.last_hook = stats.last_done = 0.0
            t = time.perf_counter()
            loss = step(k)
            dt = time.perf_counter() - t
            waited = stats.wait_s()
            wall_total += dt
            compute_total += dt - waited
            compute += dt - waited
            wait += waited
        # A ring all-reduce sends 2(W-1)/W of the buffer from each rank (gloo's ring algorithms);
        # bench_vs_ddp.py checks this against the interface counters on the limited links.
        sent = int((stats.bytes - bytes0) * 2 * (W - 1) / W)
        mine = {
            "samples": H * B,
            "steps": H,
            "step_s": compute,
            "busy_s": compute,
            "sync_s": wait,
            "bytes_sent": sent,
            "loss": loss,
            "lr": lr,
        }
        per_rank = [None] * W
        if W > 1:
            dist.all_gather_object(per_rank, mine)
        else:
            per_rank = [mine]
        val = evaluate()
        seconds = time.perf_counter() - t_round  # the same span on every rank: they meet at the barrier
        for p in per_rank:
            p["idle_s"] = max(0.0, seconds - p["step_s"] - p["sync_s"])
        event(
            "round",
            round=rnd,
            epoch=0,
            val_loss=val,
            samples=H * B * W,
            seconds=seconds,
            bytes_sent=sum(p["bytes_sent"] for p in per_rank),
            train_loss=float(np.mean([p.pop("loss") for p in per_rank])),
            nodes={f"rank{i}": p for i, p in enumerate(per_rank)},
        )
    # The pure compute per step, in this run: the same steps with no communication (DDP's no_sync;
    # the single node has none anyway), on the samples after the run's. Nothing here is recorded
    # as training: the run's metrics are complete.
    t_train_end = time.time() - T_START
    pure = []
    for k in range(steps, steps + a.calib_steps):
        t = time.perf_counter()
        if W > 1:
            with model.no_sync():
                step(k)
        else:
            step(k)
        pure.append(time.perf_counter() - t)
    pure_s = float(np.median(pure[3:] if len(pure) > 6 else pure)) if pure else None
    stat = {"step_wall_s": wall_total / steps, "step_compute_s": compute_total / steps, "pure_compute_s": pure_s}
    per_rank = [None] * W
    if W > 1:
        dist.all_gather_object(per_rank, stat)
    else:
        per_rank = [stat]
    if out:
        out.write(
            json.dumps(
                {
                    "t": t_train_end,
                    "event": "complete",
                    "rounds": r.rounds,
                    "final_val_loss": val,
                    "steps": steps,
                    **{key: float(np.mean([p[key] for p in per_rank])) for key in stat if pure_s is not None},
                    "ranks": {f"rank{i}": p for i, p in enumerate(per_rank)},
                }
            )
            + "\n"
        )
        out.close()
    if W > 1:
        # Not destroy_process_group(): once rank 0 (the rendezvous store) is gone it can block
        # forever (seen once on 4 ranks); every rank has passed the last gather, nothing is pending.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
