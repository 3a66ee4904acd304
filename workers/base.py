"""The backend-neutral Worker interface: what drift's node needs from local compute.

A task is a Python file (see workers.load_task) with:

    make_dataset(cfg)      -> an object with n_train, n_val and batch(split, indices), split being
                              "train" or "val": a dict or a tuple of numpy arrays / torch tensors
    make_model(cfg)        -> torch.nn.Module
    loss(model, batch)     -> scalar tensor; optional. Without it a dict batch is model(**batch), a
                              tuple model(*batch), and the output is the loss if it is a scalar
                              tensor, else its .loss (HuggingFace models)

The loss is a mean over the batch's samples (gradient accumulation relies on it). The older,
LM-shaped spelling keeps working, and is the one the mlx and numpy backends know:
make_torch_model / make_mlx_model / make_numpy_model(cfg, vocab_size), called as model(x, y),
batches (x, y), a dataset with vocab_size, and optionally init_params(cfg, vocab_size, seed), the
initial θ every backend starts from.

A worker owns one copy of the model, its inner optimizer (AdamW) and the task's data. Parameters
and floating-point buffers cross this boundary only as float32 numpy arrays keyed by name, so
drift never touches a framework tensor. Inner-optimizer state lives inside the worker and survives
set_params: DiLoCo keeps each node's AdamW state across outer rounds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

BACKENDS: tuple[str, ...] = ("torch", "mlx", "numpy")
MODEL_FACTORIES: dict[str, tuple[str, ...]] = {
    "torch": ("make_model", "make_torch_model"),
    "mlx": ("make_mlx_model",),
    "numpy": ("make_numpy_model",),
}
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
OPTIM_DEFAULTS: dict[str, Any] = {
    "lr": 3e-3,
    "weight_decay": 0.1,
    "betas": (0.9, 0.95),
    "grad_clip": 1.0,
    "eps": 1e-8,
}


class BackendError(ValueError):
    """A backend or device that cannot be used here (or for this task); str() is one line for the user."""


class TaskError(ValueError):
    """A task file that does not follow the task interface; str() is one line naming the task."""


@runtime_checkable
class Worker(Protocol):
    """One node's local trainer: TorchWorker, MlxWorker or NumpyWorker."""

    backend: str  # "torch", "mlx", "numpy"
    device: str  # "cpu", "cuda:0", "mps" (torch), "metal" (mlx), ...
    precision: str  # "fp32", "bf16", "fp16"
    n_train: int  # training samples available (valid indices: 0 .. n_train-1)
    n_val: int  # validation samples available
    codec_kernels: Any  # the ring codecs' arithmetic on this worker's GPU (torch_codec.py), or None

    def param_names(self) -> list[str]:
        """Trainable parameter names, sorted: the order every node uses to lay out θ. Parameters
        without requires_grad (a frozen base) are not part of θ: no method here moves them."""
        ...

    def frozen_checksum(self) -> str:
        """A digest of the frozen parameters ("" when there are none): equal on every node."""
        ...

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        """The frozen parameters' shapes by name (empty when every parameter trains)."""
        ...

    def set_frozen(self, tensors: dict[str, np.ndarray]) -> None:
        """Copy these frozen parameters (a pretrained base, by name) into the model."""
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

    def get_buffers(self) -> dict[str, np.ndarray]:
        """Float32 copies of the model's floating-point state that is not trained by gradients
        (BatchNorm's running mean and variance), sorted by name; {} when there is none."""
        ...

    def set_buffers(self, buffers: dict[str, np.ndarray]) -> None:
        """Overwrite those buffers in place, checked like set_params."""
        ...

    def reset_optimizer(self) -> None:
        """Forget the inner optimizer's state (moments, step count), as if no step had run."""
        ...

    def set_lr(self, lr: float) -> None:
        """The inner optimizer's learning rate from the next train_step on."""
        ...

    def train_step(self, indices: np.ndarray, micro_batches: int = 1) -> float:
        """One inner optimizer step on the training samples with these indices; their mean loss.

        With micro_batches k > 1 the samples are split into k consecutive near-equal parts whose
        gradients are accumulated, weighted by their share of the samples, before the one step:
        the same step as one batch of all of them, in less memory. (Not for BatchNorm statistics,
        which each part computes over its own samples, as in every framework.)
        """
        ...

    def evaluate(self, max_batches: int, batch_size: int) -> float:
        """Mean val loss over the first max_batches*batch_size val samples.

        Deterministic, no gradients, parameters and optimizer state untouched.
        """
        ...

    def iter_state(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every parameter, then every buffer (each group sorted by name), as float32 copies made
        one at a time: a caller that reads a large model tensor by tensor never holds two of it."""
        ...

    def add_to_state(self, deltas: dict[str, np.ndarray]) -> None:
        """Add these arrays to the named parameters and buffers, in place (optimizer state kept)."""
        ...

    def close(self) -> None:
        """Release the worker's threads and framework state; call once, before the process exits.

        Idempotent; the worker must not be used afterwards.
        """
        ...


class ParamsOnly:
    """The state methods of a backend whose models keep nothing besides their parameters (mlx,
    numpy): no buffers, and a model small enough to copy whole."""

    codec_kernels = None  # the ring's codecs run in numpy on the host

    def frozen_checksum(self) -> str:
        """No frozen base here: every parameter trains."""
        return ""

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def set_frozen(self, tensors: dict[str, np.ndarray]) -> None:
        if tensors:
            raise TaskError(f"no frozen parameter here: {next(iter(tensors))}")

    def iter_state(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every parameter (no buffers here), as float32 copies."""
        params = self.get_params()
        for name in sorted(params):
            yield name, params[name]

    def add_to_state(self, deltas: dict[str, np.ndarray]) -> None:
        """Add to the named parameters (read, add, write back)."""
        params = self.get_params()
        for name, d in deltas.items():
            if name not in params:
                raise ValueError(f"no parameter named {name}")
            params[name] += np.asarray(d, np.float32).reshape(params[name].shape)
        self.set_params(params)

    def get_buffers(self) -> dict[str, np.ndarray]:
        """{}: the model keeps no state besides its parameters."""
        return {}

    def set_buffers(self, buffers: dict[str, np.ndarray]) -> None:
        """Accepts only {} (checked like set_params)."""
        check_params({}, buffers, "buffer")


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere).
    Tensors and arrays of a few MiB come from the heap, not from mmap, once glibc has raised its
    mmap threshold, and freed ones stay resident: a task's init_params (all of θ, float64 on the
    way), the per-tensor copies that move θ, the inner optimizer's state after a reset. Called
    after those, so a node's memory is what it holds, not what it once held."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim this way
        return None


_malloc_trim = _find_malloc_trim()


def check_params(expected: dict[str, tuple[int, ...]], params: dict[str, np.ndarray], kind: str = "parameter") -> None:
    """ValueError naming the first missing, unexpected or mis-shaped parameter (or buffer), if any."""
    missing = sorted(set(expected) - set(params))
    if missing:
        raise ValueError(f"missing {kind}(s): {', '.join(missing)}")
    unexpected = sorted(set(params) - set(expected))
    if unexpected:
        raise ValueError(f"unexpected {kind}(s): {', '.join(unexpected)}")
    for name in sorted(expected):
        shape = tuple(np.shape(params[name]))
        if shape != expected[name]:
            raise ValueError(f"{kind} {name}: shape {shape}, expected {expected[name]}")


def micro_splits(indices: np.ndarray, micro_batches: int) -> list[np.ndarray]:
    """indices cut into micro_batches consecutive parts whose sizes differ by at most one."""
    n = len(indices)
    if n == 0:
        raise ValueError("train_step needs at least one sample index")
    if not 1 <= micro_batches <= n:
        raise ValueError(f"micro_batches must be between 1 and the number of samples ({n}), got {micro_batches}")
    return np.array_split(np.asarray(indices), micro_batches)


def check_lr(lr: float) -> float:
    """lr as a float; ValueError unless it is finite and >= 0."""
    value = float(lr)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"learning rate must be a finite number >= 0, got {lr!r}")
    return value


def check_precision(precision: str, backend: str, device: str) -> None:
    """BackendError for an unknown precision, or any but fp32 on the mlx and numpy backends."""
    if precision not in PRECISIONS:
        raise BackendError(f"precision {precision!r} is unknown; choose from {', '.join(PRECISIONS)}")
    if precision != "fp32" and backend != "torch":
        raise BackendError(f"precision {precision} is not supported by the {backend} backend on {device}; use fp32")


def eval_samples(n_val: int, max_batches: int, batch_size: int) -> int:
    """How many validation samples evaluate(max_batches, batch_size) covers (checked)."""
    if max_batches < 1 or batch_size < 1:
        raise ValueError(f"max_batches and batch_size must be >= 1, got {max_batches}, {batch_size}")
    n = min(n_val, max_batches * batch_size)
    if n == 0:
        raise ValueError("the task has no validation samples")
    return n


def task_label(task: Any) -> str:
    """How errors name a task module: "task shakespeare_char.py"."""
    return f"task {Path(getattr(task, '__file__', None) or '?').name}"


def factory_names(backend: str) -> str:
    """The task function(s) that implement a backend, for messages: "make_model or make_torch_model"."""
    return " or ".join(MODEL_FACTORIES[backend])


def model_factory(task: Any, backend: str) -> str | None:
    """The name of the task's function that builds this backend's model (make_model first), or None."""
    return next((f for f in MODEL_FACTORIES[backend] if callable(getattr(task, f, None))), None)


def task_backends(task: Any) -> list[str]:
    """The backends a task module implements (it has make_model/make_torch_model, make_mlx_model, ...)."""
    return [b for b in BACKENDS if model_factory(task, b)]


def check_task(task: Any, backend: str) -> None:
    """TypeError unless the task has make_dataset() and a model factory for this backend."""
    if not callable(getattr(task, "make_dataset", None)):
        raise TypeError(f"task {getattr(task, '__file__', task)!r} has no make_dataset()")
    if model_factory(task, backend) is None:
        raise TypeError(f"task {getattr(task, '__file__', task)!r} has no {factory_names(backend)}()")


def vocab_size(dataset: Any, what: str, task_name: str) -> int:
    """The dataset's vocab_size, which the LM-shaped factories take; TaskError when it has none."""
    size = getattr(dataset, "vocab_size", None)
    if size is None:
        raise TaskError(f"{task_name}: {what}(cfg, vocab_size) needs a dataset with vocab_size")
    return int(size)


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
    return {
        "lr": check_lr(cfg["lr"]),
        "weight_decay": float(cfg["weight_decay"]),
        "betas": (float(b1), float(b2)),
        "grad_clip": float(cfg["grad_clip"]),
        "eps": float(cfg["eps"]),
    }


def initial_params(
    task: Any, task_cfg: dict[str, Any], dataset: Any, seed: int, task_name: str
) -> dict[str, np.ndarray] | None:
    """The task's backend-neutral initial θ (task.init_params), or None when it has none."""
    fn = getattr(task, "init_params", None)
    if not callable(fn):
        return None
    return fn(task_cfg, vocab_size(dataset, "init_params", task_name), seed)
