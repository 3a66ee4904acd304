"""The torch backend: CUDA / ROCm (which torch also calls "cuda"), Apple MPS, or CPU.

Any torch model (see workers.base for the task interface). Mixed precision: bf16 and fp16 run
the forward pass under torch.autocast, while the parameters, their gradients and AdamW's state stay
float32 (master weights); fp16 also scales the loss (torch.amp.GradScaler) so that small gradients
do not underflow, and is offered on CUDA/ROCm only.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch.optim.adamw import adamw

from .base import (
    OPTIM_DEFAULTS,
    BackendError,
    TaskError,
    check_lr,
    check_params,
    check_precision,
    check_task,
    eval_samples,
    initial_params,
    micro_splits,
    model_factory,
    optim_config,
    task_label,
    vocab_size,
)
from .torch_codec import codec_kernels

__all__ = ["OPTIM_DEFAULTS", "TorchWorker", "available_devices", "resolve_device"]

METRIC_NAME = re.compile(r"[A-Za-z0-9_./-]{1,32}")  # a metric's name: plain and short (shown, plotted)
MAX_METRICS = 16
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class AdamW:
    """torch.optim.AdamW's step (its own functional kernel, torch.optim.adamw.adamw: the same
    single-tensor, foreach or fused code) over parameter groups, without torch.optim.Optimizer:
    whose step imports torch._dynamo, a second of CPU at every node's first step. `state` and
    `param_groups` are laid out as torch's (torch.amp.GradScaler reads param_groups)."""

    def __init__(
        self, groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float, fused: bool
    ) -> None:
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.fused = fused

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step of every parameter that has a gradient."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.state.get(p) or self._new_state(p) for p in params]
            beta1, beta2 = group["betas"]
            adamw(
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                [s["step"] for s in states],
                fused=self.fused or None,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )

    def _new_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        # (as torch keeps it: the step count on the CPU unless fused)
        step = torch.zeros((), dtype=torch.float32, device=p.device if self.fused else "cpu")
        self.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        return self.state[p]


def available_devices() -> list[str]:
    """Devices torch can use here, best first: cuda:N... (NVIDIA, or AMD on a ROCm build), mps, cpu."""
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if torch.backends.mps.is_available():
        devices.append("mps")
    return [*devices, "cpu"]


def resolve_device(device: str = "auto") -> str:
    """ "auto" -> the best available device; an explicit one is checked. ValueError if unavailable.

    "cuda" means cuda:0; "rocm" / "rocm:N" are accepted on a ROCm build of torch (which calls AMD
    GPUs "cuda" too).
    """
    available = available_devices()
    if device == "auto":
        return available[0]
    name = device
    if device.startswith("rocm") and getattr(torch.version, "hip", None):
        name = "cuda" + device[4:]
    name = "cuda:0" if name == "cuda" else name
    if name not in available:
        raise ValueError(f"device {device!r} is not available here; available: {', '.join(available)}")
    return name


def check_torch_precision(precision: str, device: str) -> None:
    """BackendError unless torch can train at this precision on this device."""
    check_precision(precision, "torch", device)
    if precision == "fp32":
        return
    kind = torch.device(device).type
    if precision == "fp16" and kind != "cuda":
        raise BackendError(
            f"precision fp16 is not supported on {device}: it needs loss scaling, which drift runs on "
            "CUDA/ROCm GPUs only; use bf16 or fp32"
        )
    # Where autocast lacks the dtype (older MPS, for one) it warns and computes in float32.
    dtype = AUTOCAST_DTYPES[precision]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autocast(kind, dtype=dtype):
                a = torch.ones(2, 2, device=device)
                out_dtype = (a @ a).dtype
    except RuntimeError as e:
        raise BackendError(f"precision {precision} is not supported on {device}: {e}".splitlines()[0]) from None
    if out_dtype != dtype:
        raise BackendError(f"precision {precision} is not supported on {device} by this torch build; use fp32")


class TorchWorker:
    """Worker backed by torch: the task's model, trained with AdamW on the task's dataset."""

    backend = "torch"

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
        check_task(task_module, "torch")
        self.task_name = task_name or task_label(task_module)
        self.device: str = resolve_device(device)
        check_torch_precision(precision, self.device)
        self.precision: str = precision
        self._device_type = torch.device(self.device).type
        self.codec_kernels = codec_kernels(self.device)  # on a GPU the ring encodes there
        if threads is not None:
            torch.set_num_threads(threads)
        opt = optim_config(optim_cfg)
        self._grad_clip: float = opt["grad_clip"]

        self.dataset = task_module.make_dataset(task_cfg)
        self.n_train: int = int(self.dataset.n_train)
        self.n_val: int = int(self.dataset.n_val)

        torch.manual_seed(seed)  # same seed -> identical initial parameters on every node
        factory = model_factory(task_module, "torch")
        if factory == "make_model":
            model = task_module.make_model(task_cfg)
        else:
            model = task_module.make_torch_model(task_cfg, vocab_size(self.dataset, factory, self.task_name))
        if not isinstance(model, torch.nn.Module):
            raise TaskError(f"{self.task_name}: {factory}() returned {type(model).__name__}, not a torch.nn.Module")
        self.model: torch.nn.Module = model.to(self.device, torch.float32)  # float32 master weights
        loss_fn = getattr(task_module, "loss", None)
        self._loss_fn: Callable[[torch.nn.Module, Any], Any] | None = loss_fn if callable(loss_fn) else None
        metrics_fn = getattr(task_module, "metrics", None)
        self._metrics_fn: Callable[[torch.nn.Module, Any], Any] | None = metrics_fn if callable(metrics_fn) else None
        self.metrics: dict[str, float] = {}  # the task's metrics of the last evaluate()
        self._eval_fn: Callable[[torch.nn.Module], float] | None = None
        self._own_lr = True  # the recipe's inner learning rate schedule drives this optimizer
        self._bind()
        init = initial_params(task_module, task_cfg, self.dataset, seed, self.task_name)
        if init is not None:  # the task's backend-neutral θ: mlx and numpy nodes start from it too
            self.set_params(init)

        # As in nanoGPT: decay matrices, embeddings and convolutions, not biases or norm gains.
        params = list(self._params.values())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": opt["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.optimizer: AdamW | torch.optim.Optimizer = AdamW(
            groups, lr=opt["lr"], betas=opt["betas"], eps=opt["eps"], fused=self._device_type == "cuda"
        )
        self._scaler = self._new_scaler()

    @classmethod
    def around(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        n_train: int,
        evaluate: Callable[[torch.nn.Module], float] | None = None,
    ) -> TorchWorker:
        """A worker over a user's own model and optimizer (drift.DiLoCo): the user's loop trains,
        so train_step is not used and set_lr leaves the optimizer's own schedule alone;
        evaluate(model) is the user's function (None: this node reports no validation loss)."""
        self = cls.__new__(cls)
        first = next(iter(model.parameters()), None)
        self.device = str(first.device) if first is not None else "cpu"
        self.task_name, self.precision = "your training script", "fp32"
        self._device_type = torch.device(self.device).type
        self.codec_kernels = codec_kernels(self.device)
        self.dataset, self.n_train, self.n_val = None, int(n_train), 1
        self.model, self.optimizer, self._scaler = model, optimizer, None
        self._loss_fn, self._eval_fn, self._grad_clip = None, evaluate, 0.0
        self._metrics_fn, self.metrics = None, {}
        self._own_lr = False
        self._bind()
        return self

    def _bind(self) -> None:
        """The parameters and buffers of self.model that make θ, in θ's order. θ is the trainable
        state: a frozen base (LoRA's) stays in the model and nowhere else."""
        named = sorted(self.model.named_parameters())
        self._params: dict[str, torch.nn.Parameter] = {n: p for n, p in named if p.requires_grad}
        self._frozen: dict[str, torch.nn.Parameter] = {n: p for n, p in named if not p.requires_grad}
        self._shapes = {name: tuple(p.shape) for name, p in self._params.items()}
        persistent = self.model.state_dict(keep_vars=True).keys()  # not caches such as attention masks
        self._buffers: dict[str, torch.Tensor] = {
            name: b for name, b in sorted(self.model.named_buffers()) if b.is_floating_point() and name in persistent
        }
        self._buffer_shapes = {name: tuple(b.shape) for name, b in self._buffers.items()}

    def _new_scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self._device_type) if self.precision == "fp16" else None

    def param_names(self) -> list[str]:
        """Parameter names, sorted."""
        return list(self._params)

    def frozen_checksum(self) -> str:
        """A digest of the frozen parameters' names, shapes and float32 bytes ("" when every
        parameter trains): nodes must share the same frozen base, checked once at join."""
        return frozen_digest(
            (n, p.detach().to("cpu", torch.float32).contiguous().numpy()) for n, p in self._frozen.items()
        )

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        """The frozen parameters' shapes by name."""
        return {n: tuple(p.shape) for n, p in self._frozen.items()}

    def set_frozen(self, tensors: dict[str, np.ndarray]) -> None:
        """Copy these frozen parameters (a pretrained base, by name) into the model, in place."""
        shapes = self.frozen_shapes()
        check_params({n: shapes.get(n, ()) for n in tensors}, tensors, "frozen parameter")
        _copy_into({n: self._frozen[n] for n in tensors}, tensors)

    def get_params(self) -> dict[str, np.ndarray]:
        """A float32 C-contiguous copy of every trainable parameter."""
        return _copies(self._params)

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        """Copy params into the existing tensors in place, keeping the optimizer state."""
        check_params(self._shapes, params)
        _copy_into(self._params, params)

    def get_buffers(self) -> dict[str, np.ndarray]:
        """A float32 C-contiguous copy of every floating-point buffer kept in the state_dict."""
        return _copies(self._buffers)

    def set_buffers(self, buffers: dict[str, np.ndarray]) -> None:
        """Copy buffers into the model's buffers in place."""
        check_params(self._buffer_shapes, buffers, "buffer")
        _copy_into(self._buffers, buffers)

    def iter_state(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every parameter, then every float buffer (each sorted), as float32 copies, one at a time."""
        with torch.no_grad():
            for name, t in (*self._params.items(), *self._buffers.items()):
                yield name, t.detach().to("cpu", torch.float32, copy=True).contiguous().numpy()

    def add_to_state(self, deltas: dict[str, np.ndarray]) -> None:
        """Add to the named parameters and buffers in place, keeping the optimizer state."""
        with torch.no_grad():
            for name, d in deltas.items():
                t = self._params.get(name)
                t = self._buffers[name] if t is None else t
                t.add_(torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32)).reshape(t.shape).to(t.device))

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments and step count (and fp16's loss scale)."""
        self.optimizer.state.clear()
        self._scaler = self._new_scaler()

    def set_lr(self, lr: float) -> None:
        """AdamW's learning rate from the next train_step on."""
        value = check_lr(lr)
        if not self._own_lr:  # a user's optimizer keeps its own learning rate
            return
        for group in self.optimizer.param_groups:
            group["lr"] = value

    def train_step(self, indices: np.ndarray, micro_batches: int = 1) -> float:
        """One AdamW step on the given training samples, in micro_batches parts; their mean loss."""
        parts = micro_splits(indices, micro_batches)
        self.begin_step()
        total = self.backward(parts, len(indices))
        self.finish_step()
        return total

    def begin_step(self) -> None:
        """Train mode, gradients cleared: what every inner step starts with."""
        if not self.model.training:  # model.train() walks every module: ~60 us a step, so only when needed
            self.model.train()
        self.optimizer.zero_grad(set_to_none=True)

    def backward(
        self,
        parts: list[np.ndarray],
        n: int,
        model: Any = None,
        weight: float = 1.0,
        no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> float:
        """Accumulate the gradient of these parts' loss, each part's mean weighted by its share of
        n samples (times `weight`); the weighted loss. `model`: what the loss calls instead of
        self.model (a DistributedDataParallel wrapper); `no_sync`: the context that holds its
        all-reduce back for every part but the last (workers/ddp.py)."""
        total = None
        for i, part in enumerate(parts):
            share = len(part) / n
            with no_sync() if no_sync is not None and i < len(parts) - 1 else contextlib.nullcontext():
                batch = self._batch("train", part)
                with self._autocast():
                    loss = self._loss(batch, model)
                scaled = loss * (share * weight) if share * weight != 1.0 else loss
                (self._scaler.scale(scaled) if self._scaler else scaled).backward()
            mean = loss.detach() if share == 1.0 else loss.detach() * share
            total = mean if total is None else total + mean
        return float(total.item())

    def finish_step(self) -> None:
        """Clip the accumulated gradient and take the optimizer step."""
        if self._scaler:
            self._scaler.unscale_(self.optimizer)
        if self._grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self._params.values(), self._grad_clip)
        if self._scaler:
            self._scaler.step(self.optimizer)  # skipped when the scaled gradients overflowed
            self._scaler.update()
        else:
            self.optimizer.step()

    def evaluate(self, max_batches: int, batch_size: int) -> float:
        """Sample-weighted mean val loss over the first max_batches*batch_size val samples."""
        if self._eval_fn is not None or self.dataset is None:
            return self._user_evaluate()
        n = eval_samples(self.n_val, max_batches, batch_size)
        self.model.eval()
        total, sums = 0.0, {}
        try:
            with torch.no_grad():
                for start in range(0, n, batch_size):
                    idx = np.arange(start, min(start + batch_size, n))
                    batch = self._batch("val", idx)
                    with self._autocast():
                        total += float(self._loss(batch)) * len(idx)
                        for k, v in self._task_metrics(batch).items():
                            sums[k] = sums.get(k, 0.0) + v * len(idx)
        finally:
            self.model.train()
        self.metrics = {k: v / n for k, v in sums.items() if math.isfinite(v)}
        return total / n

    def _task_metrics(self, batch: dict[str, Any] | tuple[Any, ...]) -> dict[str, float]:
        """The task's metrics(model, batch) as {name: float} ({} when it defines none)."""
        if self._metrics_fn is None:
            return {}
        out = self._metrics_fn(self.model, batch)
        if not isinstance(out, dict) or not all(isinstance(k, str) and METRIC_NAME.fullmatch(k) for k in out):
            raise TaskError(
                f"{self.task_name}: metrics(model, batch) must return a dict of name: number, names of "
                "letters, digits and _./- (at most 32)"
            )
        if len(out) > MAX_METRICS:
            raise TaskError(
                f"{self.task_name}: metrics(model, batch) returned {len(out)} values; at most {MAX_METRICS}"
            )
        try:
            return {k: float(v) for k, v in out.items()}
        except (TypeError, ValueError):
            raise TaskError(f"{self.task_name}: metrics(model, batch) has a value that is not a number") from None

    def _user_evaluate(self) -> float | None:
        if self._eval_fn is None:
            return None
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return float(self._eval_fn(self.model))
        finally:
            self.model.train(was_training)

    def close(self) -> None:
        """Nothing to release: torch needs no shutdown."""

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=AUTOCAST_DTYPES[self.precision])

    def _batch(self, split: str, indices: np.ndarray) -> dict[str, Any] | tuple[Any, ...]:
        """dataset.batch() with its arrays moved to this worker's device."""
        batch = self.dataset.batch(split, indices)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            return tuple(self._to_device(v) for v in batch)
        raise TaskError(
            f"{self.task_name}: dataset.batch() returned {type(batch).__name__}; expected a dict or a tuple of arrays"
        )

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor):
            return value.to(self.device, non_blocking=True)
        return value

    def _loss(self, batch: dict[str, Any] | tuple[Any, ...], model: Any = None) -> torch.Tensor:
        """The task's loss(model, batch), or the model's output (or its .loss); a scalar tensor."""
        model = self.model if model is None else model
        if self._loss_fn is not None:
            out, source = self._loss_fn(model, batch), "loss(model, batch)"
        elif isinstance(batch, dict):
            out, source = model(**batch), "model(**batch)"
        else:
            out, source = model(*batch), "model(*batch)"
        if isinstance(out, torch.Tensor) and out.dim() == 0:
            return out
        loss = getattr(out, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            return loss
        shape = f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else ""
        raise TaskError(
            f"{self.task_name}: {source} returned {type(out).__name__}{shape}, not a scalar loss tensor "
            "(nor an output with a scalar .loss); return the loss, or define loss(model, batch) in the task"
        )


def frozen_digest(tensors: Iterator[tuple[str, np.ndarray]]) -> str:
    """blake2b over each (name, shape, float32 bytes), one tensor at a time; "" for none."""
    h, n = hashlib.blake2b(digest_size=12), 0
    for name, a in tensors:
        h.update(f"{name}{list(a.shape)}".encode())
        h.update(np.ascontiguousarray(a, np.float32).view(np.uint8))
        n += 1
    return h.hexdigest() if n else ""


def _copies(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    with torch.no_grad():
        return {
            name: t.detach().to("cpu", torch.float32, copy=True).contiguous().numpy() for name, t in tensors.items()
        }


def _copy_into(tensors: dict[str, torch.Tensor], arrays: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for name, t in tensors.items():
            t.copy_(torch.from_numpy(np.ascontiguousarray(arrays[name], dtype=np.float32)))
