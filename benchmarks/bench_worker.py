"""Worker overhead: inner-loop samples/s through drift's TorchWorker vs the same model in a plain
torch loop (target: the worker keeps >= 97 % of the plain loop's throughput).

Both loops train the default task's model (recipes/shakespeare.yaml: char GPT, block 64, 2 layers,
128 wide, batch 32) with the same AdamW (decay groups, fused on CUDA), gradient clipping and the
same sample indices. The plain loop is nanoGPT-style: the token array lives on the device as one
tensor, windows are gathered there, and the loss is read back only at the end of a timed stretch.
The worker does what drift does per inner step: Dataset.batch in numpy, copy to the device,
forward/backward/clip/step, and return the loss as a float (a device sync every step).

Timed stretches come in pairs on the same batches, who goes first alternating, so background load
hits both alike; the figure is the median over pairs of worker/plain. With --backends it also prints the mlx and
numpy workers' samples/s on the same model (information only: different frameworks).

    flock /tmp/drift-bench.lock python benchmarks/bench_worker.py [--device cuda] [--steps 40]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]

from drift.workers import load_task, make_worker  # noqa: E402
from drift.workers.torch_worker import TorchWorker, resolve_device  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


class PlainLoop:
    """The same model and optimizer in the loop one would write by hand."""

    def __init__(self, task, cfg: dict, ds, opt: dict, device: str, seed: int) -> None:
        torch.manual_seed(seed)
        self.device, self.block = device, ds.block_size
        self.model = task.make_torch_model(cfg, ds.vocab_size).to(device)
        params = [p for _, p in sorted(self.model.named_parameters())]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": opt["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.params = params
        self.opt = torch.optim.AdamW(groups, lr=opt["lr"], betas=(0.9, 0.95), fused=device.startswith("cuda"))
        self.tokens = torch.from_numpy(ds.tokens("train").astype(np.int64)).to(device)
        self.offsets = torch.arange(self.block + 1, device=device)
        self.grad_clip = opt["grad_clip"]

    def run(self, batches: list[np.ndarray]) -> float:
        loss = None
        for idx in batches:
            starts = torch.from_numpy(idx * self.block).to(self.device, non_blocking=True)
            w = self.tokens[starts[:, None] + self.offsets]
            loss = self.model(w[:, :-1], w[:, 1:])
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
            self.opt.step()
        return float(loss.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "shakespeare.yaml"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=40, help="inner steps per timed stretch")
    ap.add_argument("--pairs", type=int, default=7, help="timed (worker, plain) pairs")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--backends", action="store_true", help="also time the mlx and numpy workers")
    args = ap.parse_args()

    recipe = yaml.safe_load(Path(args.recipe).read_text())
    cfg, bs = recipe.get("task_config", {}), args.batch_size or recipe["batch_size"]
    opt = {"lr": 3e-3, "weight_decay": 0.1, "grad_clip": 1.0}
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    task = load_task(ROOT / recipe["task"])
    ds = task.make_dataset(cfg)

    class Cached:  # the task, with its dataset built once for every loop here
        make_dataset = staticmethod(lambda c: ds)
        make_torch_model = staticmethod(task.make_torch_model)
        make_mlx_model = staticmethod(task.make_mlx_model)
        make_numpy_model = staticmethod(task.make_numpy_model)
        init_params = staticmethod(task.init_params)

    worker = TorchWorker(Cached, cfg, opt, device=device, seed=0)
    plain = PlainLoop(task, cfg, ds, opt, device, seed=0)
    rng = np.random.default_rng(0)
    draw = lambda n: [rng.integers(0, ds.n_train, bs) for _ in range(n)]  # noqa: E731

    cpu_rates: dict[str, list[float]] = {"worker": [], "plain": []}

    def timed(fn, batches: list[np.ndarray], key: str | None) -> float:
        """samples/s of wall time; also records samples per CPU-second of this process (on the
        CPU that is the figure other jobs on a shared machine do not disturb much)."""
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        fn(batches)
        sync(device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if key:
            cpu_rates[key].append(len(batches) * bs / cpu)
        return len(batches) * bs / wall

    def run_worker(batches: list[np.ndarray], w=worker) -> None:
        for idx in batches:
            w.train_step(idx)

    timed_worker = lambda b, key="worker": timed(run_worker, b, key)  # noqa: E731
    timed_plain = lambda b, key="plain": timed(plain.run, b, key)  # noqa: E731

    warm = draw(args.warmup)
    timed_worker(warm, None)
    timed_plain(warm, None)
    w_rates, p_rates = [], []
    for i in range(args.pairs):  # same batches for both; who goes first alternates
        batches = draw(args.steps)
        if i % 2:
            p_rates.append(timed_plain(batches))
            w_rates.append(timed_worker(batches))
        else:
            w_rates.append(timed_worker(batches))
            p_rates.append(timed_plain(batches))
    ratios = [w / p for w, p in zip(w_rates, p_rates)]

    n_params = sum(p.numel() for p in worker.model.parameters())
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or platform.machine()
    print(f"model: {recipe['task']} {cfg}, {n_params / 1e6:.2f}M params, batch {bs}")
    print(f"device: {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{args.pairs} pairs x {args.steps} steps, medians:")
    print(f"  plain torch loop : {statistics.median(p_rates):9.1f} samples/s")
    print(f"  drift TorchWorker: {statistics.median(w_rates):9.1f} samples/s")
    print(
        f"  worker / plain   : {statistics.median(ratios) * 100:6.1f} %  "
        f"(pairs: {', '.join(f'{r * 100:.1f}' for r in ratios)})"
    )
    if device == "cpu":
        cpu_ratios = [w / p for w, p in zip(cpu_rates["worker"], cpu_rates["plain"])]
        print(
            f"  per CPU-second   : plain {statistics.median(cpu_rates['plain']):.1f}, worker "
            f"{statistics.median(cpu_rates['worker']):.1f} samples/s; worker / plain "
            f"{statistics.median(cpu_ratios) * 100:.1f} %  (pairs: {', '.join(f'{r * 100:.1f}' for r in cpu_ratios)})"
        )
    if args.backends:
        for backend in ("mlx", "numpy"):
            try:
                w = make_worker(Cached, cfg, opt, backend=backend, seed=0)
            except Exception as e:
                print(f"  {backend:5s} worker     : unavailable ({e})")
                continue
            run_it = lambda b, w=w: run_worker(b, w)  # noqa: E731
            timed(run_it, draw(args.warmup), None)
            rates = [timed(run_it, draw(args.steps), None) for _ in range(max(1, args.pairs // 2))]
            print(f"  {backend:5s} worker ({w.device}): {statistics.median(rates):9.1f} samples/s")


if __name__ == "__main__":
    main()
