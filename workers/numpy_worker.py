"""The numpy backend: the CPU fallback that needs no deep-learning framework at all.

The task supplies the model as plain numpy with a hand-written backward pass
(``make_numpy_model(cfg, vocab_size)`` -> an object with ``loss(params, x, y)`` and
``loss_and_grads(params, x, y)``); this worker owns the parameters and runs AdamW with the same
update, parameter groups and gradient clipping as torch.optim.AdamW in the torch worker.
Nothing here imports torch or mlx.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from .base import BackendError, check_params, check_task, eval_samples, initial_params, optim_config


class NumpyWorker:
    """Worker backed by plain numpy (CPU only)."""

    backend = "numpy"

    def __init__(self, task_module: ModuleType, task_cfg: dict[str, Any], optim_cfg: dict[str, Any],
                 device: str = "auto", seed: int = 0, threads: int | None = None) -> None:
        check_task(task_module, "numpy")
        if device not in ("auto", "cpu"):
            raise BackendError(f"device {device!r} is not available to the numpy backend; it runs on: cpu")
        self.device: str = "cpu"
        opt = optim_config(optim_cfg)
        self._lr, self._wd, self._eps, self._clip = opt["lr"], opt["weight_decay"], opt["eps"], opt["grad_clip"]
        self._b1, self._b2 = opt["betas"]

        self.dataset = task_module.make_dataset(task_cfg)
        self.n_train: int = int(self.dataset.n_train)
        self.n_val: int = int(self.dataset.n_val)
        self.model = task_module.make_numpy_model(task_cfg, self.dataset.vocab_size)
        init = initial_params(task_module, task_cfg, self.dataset.vocab_size, seed)
        if init is None:
            init = self.model.init_params(seed)
        self._params: dict[str, np.ndarray] = {
            name: np.array(init[name], dtype=np.float32, order="C", copy=True) for name in sorted(init)}
        self._shapes = {name: a.shape for name, a in self._params.items()}
        self.reset_optimizer()

    def param_names(self) -> list[str]:
        return list(self._params)

    def get_params(self) -> dict[str, np.ndarray]:
        return {name: a.copy() for name, a in self._params.items()}

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        check_params(self._shapes, params)
        for name, a in self._params.items():
            a[...] = np.asarray(params[name], dtype=np.float32)

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments and step count."""
        # AdamW state, as torch keeps it: first/second moments per parameter and a step count.
        self._m = {name: np.zeros_like(a) for name, a in self._params.items()}
        self._v = {name: np.zeros_like(a) for name, a in self._params.items()}
        self.step: int = 0

    def train_step(self, indices: np.ndarray) -> float:
        """One AdamW step on the given training samples; returns the loss."""
        if len(indices) == 0:
            raise ValueError("train_step needs at least one sample index")
        x, y = self.dataset.batch("train", indices)
        loss, grads = self.model.loss_and_grads(self._params, x, y)
        check_params(self._shapes, grads)
        self._adamw(grads)
        return float(loss)

    def _adamw(self, grads: dict[str, np.ndarray]) -> None:
        """torch.optim.AdamW (decoupled weight decay on tensors of 2+ dims) after clip_grad_norm_."""
        if self._clip > 0:
            total = math.sqrt(sum(float(np.dot(g.ravel(), g.ravel())) for g in grads.values()))
            coef = self._clip / (total + 1e-6)
            if coef < 1.0:
                grads = {name: g * np.float32(coef) for name, g in grads.items()}
        self.step += 1
        b1, b2, f32 = self._b1, self._b2, np.float32
        step_size = f32(self._lr / (1 - b1 ** self.step))
        bc2_sqrt = f32(math.sqrt(1 - b2 ** self.step))
        for name, p in self._params.items():
            g, m, v = grads[name], self._m[name], self._v[name]
            if p.ndim >= 2 and self._wd:
                p *= f32(1 - self._lr * self._wd)
            m *= f32(b1)
            m += f32(1 - b1) * g
            v *= f32(b2)
            v += f32(1 - b2) * g * g
            denom = np.sqrt(v) / bc2_sqrt + f32(self._eps)
            p -= step_size * m / denom

    def evaluate(self, max_batches: int, batch_size: int) -> float:
        """Sample-weighted mean val loss over the first max_batches*batch_size val samples."""
        n = eval_samples(self.n_val, max_batches, batch_size)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = np.arange(start, min(start + batch_size, n))
            x, y = self.dataset.batch("val", idx)
            total += float(self.model.loss(self._params, x, y)) * len(idx)
        return total / n
