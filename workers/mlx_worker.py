"""The mlx backend: Apple Silicon's GPU through Metal (or the CPU; `mlx[cpu]` runs it on Linux).

The task supplies ``make_mlx_model(cfg, vocab_size)`` -> an ``mlx.nn.Module`` whose
``__call__(x, y)`` returns the mean loss, with the same parameter names and shapes as the torch
model. The inner optimizer is AdamW written out here so that it matches torch.optim.AdamW
exactly (bias correction, decoupled decay on 2+-dim tensors only, global-norm gradient clipping);
mlx.optimizers.AdamW differs on each of these points.

Threads: since mlx 0.31.2 Metal streams are thread-local ("There is no Stream(gpu, N) in current
thread" when arrays made on one thread are evaluated on another), while drift calls train_step
from an executor thread. So the worker owns one thread and runs every mlx operation on it,
whichever thread calls it, and close() ends that thread cleanly (see there).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

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

T = TypeVar("T")


def available_devices() -> list[str]:
    """Devices mlx can use here, best first: "metal" (the Apple GPU) when present, then "cpu"."""
    return (["metal"] if mx.metal.is_available() else []) + ["cpu"]


def resolve_device(device: str = "auto") -> str:
    available = available_devices()
    if device == "auto":
        return available[0]
    if device not in available:
        raise BackendError(
            f"device {device!r} is not available to the mlx backend here; available: {', '.join(available)}"
        )
    return device


def _close_at_exit(ref: weakref.ref[MlxWorker]) -> None:
    worker = ref()
    if worker is not None:
        worker.close()


class MlxWorker(ParamsOnly):
    """Worker backed by mlx (fp32; tasks with make_mlx_model and (x, y) batches)."""

    backend = "mlx"
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
        check_task(task_module, "mlx")
        self.task_name = task_name or task_label(task_module)
        self.device: str = resolve_device(device)
        check_precision(precision, "mlx", self.device)
        self._closed = False
        self._close_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drift-mlx")
        self._thread_id: int = self._executor.submit(threading.get_ident).result()
        # Before threading joins the executor's thread at interpreter exit (these hooks run last
        # registered first, so before concurrent.futures' own): a worker nobody closed is closed.
        threading._register_atexit(_close_at_exit, weakref.ref(self))
        self._on_mlx_thread(self._setup, task_module, task_cfg, optim_cfg, seed)

    def _on_mlx_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on this worker's own thread (directly when already there)."""
        if threading.get_ident() == self._thread_id:
            return fn(*args)
        if self._closed:
            raise RuntimeError("this mlx worker is closed")
        return self._executor.submit(fn, *args).result()

    def close(self) -> None:
        """Free mlx's state on the worker's thread, then end that thread. Idempotent.

        mlx keeps a Python object (the thread's random key) in C++ thread-local storage. When the
        thread ends during interpreter shutdown, that object's destructor needs the GIL, Python ends
        the thread from inside the destructor instead, and C++ aborts the process ("terminate
        called without an active exception"). mx.clear_streams() frees it while Python still runs.
        """
        with self._close_lock:
            if self._closed:
                return
            if threading.get_ident() == self._thread_id:
                raise RuntimeError("close() called on the mlx worker's own thread")
            if hasattr(mx, "clear_streams"):  # mlx >= 0.31.2, where that state became per-thread
                self._executor.submit(mx.clear_streams).result()
            self._closed = True
            self._executor.shutdown(wait=True)

    def _setup(self, task_module: ModuleType, task_cfg: dict[str, Any], optim_cfg: dict[str, Any], seed: int) -> None:
        mx.set_default_device(mx.gpu if self.device == "metal" else mx.cpu)
        opt = optim_config(optim_cfg)
        self._lr, self._wd, self._eps, self._clip = opt["lr"], opt["weight_decay"], opt["eps"], opt["grad_clip"]
        self._b1, self._b2 = opt["betas"]

        self.dataset = task_module.make_dataset(task_cfg)
        self.n_train: int = int(self.dataset.n_train)
        self.n_val: int = int(self.dataset.n_val)
        mx.random.seed(seed)
        self.model: nn.Module = task_module.make_mlx_model(
            task_cfg, vocab_size(self.dataset, "make_mlx_model", self.task_name)
        )
        self.model.train()
        self._shapes = {name: tuple(a.shape) for name, a in sorted(tree_flatten(self.model.parameters()))}
        init = initial_params(task_module, task_cfg, self.dataset, seed, self.task_name)
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

    def set_lr(self, lr: float) -> None:
        """AdamW's learning rate from the next train_step on."""
        value = check_lr(lr)
        self._on_mlx_thread(setattr, self, "_lr", value)  # between steps, never during one

    def train_step(self, indices: np.ndarray, micro_batches: int = 1) -> float:
        """One AdamW step on the given training samples, in micro_batches parts; their mean loss."""
        parts = micro_splits(indices, micro_batches)
        return self._on_mlx_thread(self._train_step, parts)

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

    def _batch(self, split: str, indices: np.ndarray) -> list[mx.array]:
        batch = self.dataset.batch(split, indices)
        if not isinstance(batch, (tuple, list)):
            raise TaskError(
                f"{self.task_name}: the mlx backend needs dataset.batch() to return a tuple of arrays, "
                f"got {type(batch).__name__}"
            )
        return [mx.array(np.asarray(a)) for a in batch]

    def _train_step(self, parts: list[np.ndarray]) -> float:
        if len(parts) == 1:
            loss, grads = self._loss_and_grad(*self._batch("train", parts[0]))
            grads = dict(tree_flatten(grads))
        else:
            n = sum(len(p) for p in parts)
            loss, grads = 0.0, {}
            for part in parts:
                w = len(part) / n  # each part's mean weighted by its share: the mean over all n samples
                part_loss, part_grads = self._loss_and_grad(*self._batch("train", part))
                grads = {name: grads.get(name, 0.0) + g * w for name, g in tree_flatten(part_grads)}
                loss = loss + part_loss * w
                mx.eval(loss, grads)  # one part's activations at a time
        self._adamw(grads)
        mx.eval(loss, self.model.parameters(), self._m, self._v)
        return float(loss.item())

    def _adamw(self, grads: dict[str, mx.array]) -> None:
        """torch.optim.AdamW (decoupled weight decay on tensors of 2+ dims) after clip_grad_norm_."""
        if self._clip > 0:
            total = mx.sqrt(sum(mx.sum(g * g) for g in grads.values()))
            coef = mx.minimum(self._clip / (total + 1e-6), 1.0)
            grads = {name: g * coef for name, g in grads.items()}
        self.step += 1
        b1, b2 = self._b1, self._b2
        step_size = self._lr / (1 - b1**self.step)
        bc2_sqrt = math.sqrt(1 - b2**self.step)
        new = []
        for name, p in self._flat().items():
            g = grads[name]
            if self._decay[name]:
                p = p * (1 - self._lr * self._wd)
            m = self._m[name] = b1 * self._m[name] + (1 - b1) * g
            v = self._v[name] = b2 * self._v[name] + (1 - b2) * g * g
            new.append((name, p - step_size * m / (mx.sqrt(v) / bc2_sqrt + self._eps)))
        self.model.update(tree_unflatten(new))

    def _evaluate(self, max_batches: int, batch_size: int) -> float:
        n = eval_samples(self.n_val, max_batches, batch_size)
        self.model.eval()
        total = 0.0
        try:
            for start in range(0, n, batch_size):
                idx = np.arange(start, min(start + batch_size, n))
                total += float(self.model(*self._batch("val", idx)).item()) * len(idx)
        finally:
            self.model.train()
        return total / n
