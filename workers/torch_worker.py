"""The torch backend: CUDA / ROCm (which torch also calls "cuda"), Apple MPS, or CPU."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import torch

from .base import OPTIM_DEFAULTS, check_params, check_task, eval_samples, initial_params, optim_config

__all__ = ["OPTIM_DEFAULTS", "TorchWorker", "available_devices", "resolve_device"]


def available_devices() -> list[str]:
    """Devices torch can use here, best first: cuda:N... (NVIDIA, or AMD on a ROCm build), mps, cpu."""
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices + ["cpu"]


def resolve_device(device: str = "auto") -> str:
    """"auto" -> the best available device; an explicit one is checked. ValueError if unavailable.

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


_optim_config = optim_config  # the old private name


class TorchWorker:
    """Worker backed by torch: the task's model, trained with AdamW on the task's dataset."""

    backend = "torch"

    def __init__(self, task_module: ModuleType, task_cfg: dict[str, Any], optim_cfg: dict[str, Any],
                 device: str = "auto", seed: int = 0, threads: int | None = None) -> None:
        check_task(task_module, "torch")
        self.device: str = resolve_device(device)
        if threads is not None:
            torch.set_num_threads(threads)
        opt = optim_config(optim_cfg)
        self._grad_clip: float = opt["grad_clip"]

        self.dataset = task_module.make_dataset(task_cfg)
        self.n_train: int = int(self.dataset.n_train)
        self.n_val: int = int(self.dataset.n_val)

        torch.manual_seed(seed)  # same seed -> identical initial parameters on every node
        self.model: torch.nn.Module = task_module.make_torch_model(task_cfg, self.dataset.vocab_size)
        self.model.to(self.device)
        self._params: dict[str, torch.nn.Parameter] = dict(sorted(self.model.named_parameters()))
        self._shapes = {name: tuple(p.shape) for name, p in self._params.items()}
        init = initial_params(task_module, task_cfg, self.dataset.vocab_size, seed)
        if init is not None:  # the task's backend-neutral θ: mlx and numpy nodes start from it too
            self.set_params(init)

        # As in nanoGPT: decay matrices and embeddings, not biases or LayerNorm gains.
        params = list(self._params.values())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": opt["weight_decay"]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=opt["lr"], betas=opt["betas"], eps=opt["eps"],
                                           fused=self.device.startswith("cuda"))

    def param_names(self) -> list[str]:
        """Parameter names, sorted."""
        return list(self._params)

    def get_params(self) -> dict[str, np.ndarray]:
        """A float32 C-contiguous copy of every parameter."""
        with torch.no_grad():
            return {name: p.detach().to("cpu", torch.float32, copy=True).contiguous().numpy()
                    for name, p in self._params.items()}

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        """Copy params into the existing tensors in place, keeping the optimizer state."""
        check_params(self._shapes, params)
        with torch.no_grad():
            for name, p in self._params.items():
                src = torch.from_numpy(np.ascontiguousarray(params[name], dtype=np.float32))
                p.copy_(src)

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments and step count."""
        self.optimizer.state.clear()

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def train_step(self, indices: np.ndarray) -> float:
        """One AdamW step on the given training samples; returns the loss."""
        if len(indices) == 0:
            raise ValueError("train_step needs at least one sample index")
        x, y = self.dataset.batch("train", indices)
        if not self.model.training:  # model.train() walks every module: ~60 us a step, so only when needed
            self.model.train()
        loss = self.model(self._to_device(x), self._to_device(y))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self._grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self._params.values(), self._grad_clip)
        self.optimizer.step()
        return float(loss.item())

    def evaluate(self, max_batches: int, batch_size: int) -> float:
        """Sample-weighted mean val loss over the first max_batches*batch_size val samples."""
        n = eval_samples(self.n_val, max_batches, batch_size)
        self.model.eval()
        total = 0.0
        with torch.no_grad():
            for start in range(0, n, batch_size):
                idx = np.arange(start, min(start + batch_size, n))
                x, y = self.dataset.batch("val", idx)
                total += float(self.model(self._to_device(x), self._to_device(y))) * len(idx)
        self.model.train()
        return total / n
