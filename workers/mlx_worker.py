"""The mlx backend: Apple Silicon's GPU through Metal (or the CPU; `mlx[cpu]` runs it on Linux).

The task supplies ``make_mlx_model(cfg, vocab_size)`` -> an ``mlx.nn.Module`` whose
``__call__(x, y)`` returns the mean loss, with the same parameter names and shapes as the torch
model. The inner optimizer is AdamW written out here so that it matches torch.optim.AdamW
exactly (bias correction, decoupled decay on 2+-dim tensors only, global-norm gradient clipping);
mlx.optimizers.AdamW differs on each of these points.

Threads: since mlx 0.31.2 Metal streams are thread-local ("There is no Stream(gpu, N) in current
thread" when arrays made on one thread are evaluated on another), while drift calls train_step
from an executor thread. So the worker owns one thread and runs every mlx operation on it,
whichever thread calls it.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, Callable, TypeVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .base import BackendError, check_params, check_task, eval_samples, initial_params, optim_config

T = TypeVar("T")


def available_devices() -> list[str]:
    """Devices mlx can use here, best first: "metal" (the Apple GPU) when present, then "cpu"."""
    return (["metal"] if mx.metal.is_available() else []) + ["cpu"]


def resolve_device(device: str = "auto") -> str:
    available = available_devices()
    if device == "auto":
        return available[0]
    if device not in available:
        raise BackendError(f"device {device!r} is not available to the mlx backend here; "
                           f"available: {', '.join(available)}")
    return device


class MlxWorker:
    """Worker backed by mlx."""

    backend = "mlx"

    def __init__(self, task_module: ModuleType, task_cfg: dict[str, Any], optim_cfg: dict[str, Any],
                 device: str = "auto", seed: int = 0, threads: int | None = None) -> None:
        check_task(task_module, "mlx")
        self.device: str = resolve_device(device)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drift-mlx")
        self._thread_id: int = self._executor.submit(threading.get_ident).result()
        self._on_mlx_thread(self._setup, task_module, task_cfg, optim_cfg, seed)

    def _on_mlx_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on this worker's own thread (directly when already there)."""
        if threading.get_ident() == self._thread_id:
            return fn(*args)
        return self._executor.submit(fn, *args).result()

    def _setup(self, task_module: ModuleType, task_cfg: dict[str, Any], optim_cfg: dict[str, Any],
               seed: int) -> None:
        mx.set_default_device(mx.gpu if self.device == "metal" else mx.cpu)
        opt = optim_config(optim_cfg)
        self._lr, self._wd, self._eps, self._clip = opt["lr"], opt["weight_decay"], opt["eps"], opt["grad_clip"]
        self._b1, self._b2 = opt["betas"]

        self.dataset = task_module.make_dataset(task_cfg)
        self.n_train: int = int(self.dataset.n_train)
        self.n_val: int = int(self.dataset.n_val)
        mx.random.seed(seed)
        self.model: nn.Module = task_module.make_mlx_model(task_cfg, self.dataset.vocab_size)
        self.model.train()
        self._shapes = {name: tuple(a.shape) for name, a in sorted(tree_flatten(self.model.parameters()))}
        init = initial_params(task_module, task_cfg, self.dataset.vocab_size, seed)
        if init is not None:
            self._set_params(init)
        self._decay = {name: a.ndim >= 2 and self._wd > 0 for name, a in self._flat().items()}
        self._reset_optimizer()
        self._loss_and_grad = nn.value_and_grad(self.model, self.model.__call__)

    def _flat(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.model.parameters()))

    def param_names(self) -> list[str]:
        return list(self._shapes)

    def get_params(self) -> dict[str, np.ndarray]:
        return self._on_mlx_thread(self._get_params)

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        self._on_mlx_thread(self._set_params, params)

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments and step count."""
        self._on_mlx_thread(self._reset_optimizer)

    def _reset_optimizer(self) -> None:
        params = self._flat()
        self._m = {name: mx.zeros_like(a) for name, a in params.items()}
        self._v = {name: mx.zeros_like(a) for name, a in params.items()}
        mx.eval(self._m, self._v)
        self.step: int = 0

    def train_step(self, indices: np.ndarray) -> float:
        """One AdamW step on the given training samples; returns the loss."""
        if len(indices) == 0:
            raise ValueError("train_step needs at least one sample index")
        return self._on_mlx_thread(self._train_step, indices)

    def evaluate(self, max_batches: int, batch_size: int) -> float:
        """Sample-weighted mean val loss over the first max_batches*batch_size val samples."""
        eval_samples(self.n_val, max_batches, batch_size)  # bad arguments fail on the caller's thread
        return self._on_mlx_thread(self._evaluate, max_batches, batch_size)

    def _get_params(self) -> dict[str, np.ndarray]:
        flat = self._flat()
        return {name: np.array(flat[name], dtype=np.float32, copy=True, order="C") for name in self._shapes}

    def _set_params(self, params: dict[str, np.ndarray]) -> None:
        check_params(self._shapes, params)
        new = [(name, mx.array(np.ascontiguousarray(params[name], dtype=np.float32))) for name in self._shapes]
        self.model.update(tree_unflatten(new))
        mx.eval(self.model.parameters())

    def _train_step(self, indices: np.ndarray) -> float:
        x, y = self.dataset.batch("train", indices)
        loss, grads = self._loss_and_grad(mx.array(x), mx.array(y))
        grads = dict(tree_flatten(grads))
        if self._clip > 0:
            total = mx.sqrt(sum(mx.sum(g * g) for g in grads.values()))
            coef = mx.minimum(self._clip / (total + 1e-6), 1.0)
            grads = {name: g * coef for name, g in grads.items()}
        self.step += 1
        b1, b2 = self._b1, self._b2
        step_size = self._lr / (1 - b1 ** self.step)
        bc2_sqrt = math.sqrt(1 - b2 ** self.step)
        new = []
        for name, p in self._flat().items():
            g = grads[name]
            if self._decay[name]:
                p = p * (1 - self._lr * self._wd)
            m = self._m[name] = b1 * self._m[name] + (1 - b1) * g
            v = self._v[name] = b2 * self._v[name] + (1 - b2) * g * g
            new.append((name, p - step_size * m / (mx.sqrt(v) / bc2_sqrt + self._eps)))
        self.model.update(tree_unflatten(new))
        mx.eval(loss, self.model.parameters(), self._m, self._v)
        return float(loss.item())

    def _evaluate(self, max_batches: int, batch_size: int) -> float:
        n = eval_samples(self.n_val, max_batches, batch_size)
        self.model.eval()
        total = 0.0
        try:
            for start in range(0, n, batch_size):
                idx = np.arange(start, min(start + batch_size, n))
                x, y = self.dataset.batch("val", idx)
                total += float(self.model(mx.array(x), mx.array(y)).item()) * len(idx)
        finally:
            self.model.train()
        return total / n
