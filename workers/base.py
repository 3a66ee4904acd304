"""The backend-neutral Worker interface: what drift's node needs from local compute.

A worker owns one copy of the model, its inner optimizer (AdamW) and the task's data. Parameters
cross this boundary only as float32 numpy arrays keyed by name, so drift never touches a
framework tensor. Inner-optimizer state lives inside the worker and survives set_params: DiLoCo
keeps each node's AdamW state across outer rounds.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

BACKENDS: tuple[str, ...] = ("torch", "mlx", "numpy")
MODEL_FACTORIES: dict[str, str] = {"torch": "make_torch_model", "mlx": "make_mlx_model",
                                   "numpy": "make_numpy_model"}
OPTIM_DEFAULTS: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "grad_clip": 1.0,
                                  "eps": 1e-8}


class BackendError(ValueError):
    """A backend or device that cannot be used here (or for this task); str() is one line for the user."""


@runtime_checkable
class Worker(Protocol):
    """One node's local trainer: TorchWorker, MlxWorker or NumpyWorker."""

    backend: str  # "torch", "mlx", "numpy"
    device: str   # "cpu", "cuda:0", "mps" (torch), "metal" (mlx), ...
    n_train: int  # training samples available (valid indices: 0 .. n_train-1)
    n_val: int    # validation samples available

    def param_names(self) -> list[str]:
        """Parameter names, sorted: the order every node uses to lay out θ."""
        ...

    def get_params(self) -> dict[str, np.ndarray]:
        """A copy of every parameter as a float32, C-contiguous array (the caller may keep them)."""
        ...

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        """Overwrite the parameters in place (optimizer state is kept).

        Names and shapes must match exactly; otherwise ValueError naming the offender, and
        nothing is changed.
        """
        ...

    def reset_optimizer(self) -> None:
        """Forget the inner optimizer's state (moments, step count), as if no step had run."""
        ...

    def train_step(self, indices: np.ndarray) -> float:
        """One inner optimizer step on the training samples with these indices; the loss."""
        ...

    def evaluate(self, max_batches: int, batch_size: int) -> float:
        """Mean val loss over the first max_batches*batch_size val samples.

        Deterministic, no gradients, parameters and optimizer state untouched.
        """
        ...


def check_params(expected: dict[str, tuple[int, ...]], params: dict[str, np.ndarray]) -> None:
    """ValueError naming the first missing, unexpected or mis-shaped parameter, if any."""
    missing = sorted(set(expected) - set(params))
    if missing:
        raise ValueError(f"missing parameter(s): {', '.join(missing)}")
    unexpected = sorted(set(params) - set(expected))
    if unexpected:
        raise ValueError(f"unexpected parameter(s): {', '.join(unexpected)}")
    for name in sorted(expected):
        shape = tuple(np.shape(params[name]))
        if shape != expected[name]:
            raise ValueError(f"parameter {name}: shape {shape}, expected {expected[name]}")


def eval_samples(n_val: int, max_batches: int, batch_size: int) -> int:
    """How many validation samples evaluate(max_batches, batch_size) covers (checked)."""
    if max_batches < 1 or batch_size < 1:
        raise ValueError(f"max_batches and batch_size must be >= 1, got {max_batches}, {batch_size}")
    n = min(n_val, max_batches * batch_size)
    if n == 0:
        raise ValueError("the task has no validation samples")
    return n


def task_backends(task: Any) -> list[str]:
    """The backends a task module implements (it has make_torch_model / make_mlx_model / make_numpy_model)."""
    return [b for b in BACKENDS if callable(getattr(task, MODEL_FACTORIES[b], None))]


def optim_config(optim_cfg: dict[str, Any]) -> dict[str, Any]:
    """optim_cfg over OPTIM_DEFAULTS. Betas may be given as betas=(b1, b2) or as beta1/beta2
    (the recipe's spelling); an unknown key is a ValueError."""
    cfg = dict(optim_cfg)
    if "beta1" in cfg or "beta2" in cfg:
        if "betas" in cfg:
            raise ValueError("optim_cfg: give either betas or beta1/beta2, not both")
        b1, b2 = OPTIM_DEFAULTS["betas"]
        cfg["betas"] = (cfg.pop("beta1", b1), cfg.pop("beta2", b2))
    unknown = sorted(set(cfg) - set(OPTIM_DEFAULTS))
    if unknown:
        raise ValueError(f"optim_cfg: unknown key(s) {unknown}; known: {sorted(OPTIM_DEFAULTS)} or beta1/beta2")
    cfg = {**OPTIM_DEFAULTS, **cfg}
    b1, b2 = cfg["betas"]
    return {"lr": float(cfg["lr"]), "weight_decay": float(cfg["weight_decay"]),
            "betas": (float(b1), float(b2)), "grad_clip": float(cfg["grad_clip"]), "eps": float(cfg["eps"])}


def check_task(task: Any, backend: str) -> None:
    """TypeError unless the task has make_dataset() and this backend's model factory."""
    for attr in ("make_dataset", MODEL_FACTORIES[backend]):
        if not callable(getattr(task, attr, None)):
            raise TypeError(f"task {getattr(task, '__file__', task)!r} has no {attr}()")


def initial_params(task: Any, task_cfg: dict[str, Any], vocab_size: int, seed: int) -> dict[str, np.ndarray] | None:
    """The task's backend-neutral initial θ (task.init_params), or None when it has none."""
    fn = getattr(task, "init_params", None)
    return fn(task_cfg, vocab_size, seed) if callable(fn) else None
