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

from .base import (
    BackendError,
    ParamsOnly,
    TaskError,
    check_lr,
    check_params,
    check_precision,
    check_task,
    eval_samples,
    initial_params,
    micro_splits,
    optim_config,
    task_label,
    vocab_size,
)


class NumpyWorker(ParamsOnly):
    """Worker backed by plain numpy (CPU only, fp32; tasks with make_numpy_model and (x, y) batches)."""

    backend = "numpy"
    precision = "fp32"

    def __init__(
        self,
        task_module: ModuleType,
        task_cfg: dict[str, Any],
        optim_cfg: dict[str, Any],
        device: str = "auto",
        seed: int = 0,
        threads: int | None = None,
        precision: str = "fp32",
        task_name: str | None = None,
    ) -> None:
        check_task(task_module, "numpy")
        self.task_name = task_name or task_label(task_module)
        if device not in ("auto", "cpu"):
            raise BackendError(f"device {device!r} is not available to the numpy backend; it runs on: cpu")
        self.device: str = "cpu"
        check_precision(precision, "numpy", self.device)
        opt = optim_config(optim_cfg)
        self._lr, self._wd, self._eps, self._clip = opt["lr"], opt["weight_decay"], opt["eps"], opt["grad_clip"]
        self._b1, self._b2 = opt["betas"]

        self.dataset = task_module.make_dataset(task_cfg)
        self.n_train: int = int(self.dataset.n_train)
        self.n_val: int = int(self.dataset.n_val)
        self.model = task_module.make_numpy_model(
            task_cfg, vocab_size(self.dataset, "make_numpy_model", self.task_name)
        )
        init = initial_params(task_module, task_cfg, self.dataset, seed, self.task_name)
        if init is None:
            init = self.model.init_params(seed)
        self._params: dict[str, np.ndarray] = {
            name: np.array(init[name], dtype=np.float32, order="C", copy=True) for name in sorted(init)
        }
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

    def set_lr(self, lr: float) -> None:
        """AdamW's learning rate from the next train_step on."""
        self._lr = check_lr(lr)

    def train_step(self, indices: np.ndarray, micro_batches: int = 1) -> float:
        """One AdamW step on the given training samples, in micro_batches parts; their mean loss."""
        parts = micro_splits(indices, micro_batches)
        if len(parts) == 1:
            loss, grads = self.model.loss_and_grads(self._params, *self._batch("train", parts[0]))
            check_params(self._shapes, grads)
        else:
            loss, grads = 0.0, {name: np.zeros_like(a) for name, a in self._params.items()}
            for part in parts:
                w = len(part) / len(indices)  # each part's mean weighted by its share of the samples
                part_loss, part_grads = self.model.loss_and_grads(self._params, *self._batch("train", part))
                check_params(self._shapes, part_grads)
                for name, g in grads.items():
                    g += np.float32(w) * part_grads[name]
                loss += float(part_loss) * w
        self._adamw(grads)
        return float(loss)

    def close(self) -> None:
        """Nothing to release."""

    def _batch(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        batch = self.dataset.batch(split, indices)
        if not isinstance(batch, (tuple, list)):
            raise TaskError(
                f"{self.task_name}: the numpy backend needs dataset.batch() to return (x, y), "
                f"got {type(batch).__name__}"
            )
        return tuple(batch)

    def _adamw(self, grads: dict[str, np.ndarray]) -> None:
        """torch.optim.AdamW (decoupled weight decay on tensors of 2+ dims) after clip_grad_norm_."""
        if self._clip > 0:
            total = math.sqrt(sum(float(np.dot(g.ravel(), g.ravel())) for g in grads.values()))
            coef = self._clip / (total + 1e-6)
            if coef < 1.0:
                grads = {name: g * np.float32(coef) for name, g in grads.items()}
        self.step += 1
        b1, b2, f32 = self._b1, self._b2, np.float32
        step_size = f32(self._lr / (1 - b1**self.step))
        bc2_sqrt = f32(math.sqrt(1 - b2**self.step))
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
            total += float(self.model.loss(self._params, *self._batch("val", idx))) * len(idx)
        return total / n
