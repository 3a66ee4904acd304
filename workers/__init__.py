"""Local compute: device detection, the Worker interface and its backends.

Nothing here knows about networking, and nothing here imports drift. Importing this package
imports neither torch nor mlx; `from drift.workers.torch_worker import TorchWorker` does, and so does
asking which devices torch can use. `make_worker(...)` picks the backend and device (or checks the
ones forced with --backend/--device) and builds the worker.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .base import (
    BACKENDS,
    PRECISIONS,
    BackendError,
    TaskError,
    Worker,
    factory_names,
    task_backends,
    task_label,
    trim_heap,
)

if TYPE_CHECKING:
    from .detect import BackendInfo

__all__ = [
    "BACKENDS",
    "PRECISIONS",
    "BackendError",
    "Choice",
    "TaskError",
    "Worker",
    "choose",
    "load_task",
    "make_worker",
    "task_backends",
    "trim_heap",
]

INSTALL_HINT = {
    "torch": "pip install torch",
    "mlx": 'pip install mlx (on Linux: pip install "mlx[cpu]")',
    "numpy": "pip install numpy",
}


@dataclass(frozen=True)
class Choice:
    backend: str  # "torch", "mlx", "numpy"
    device: str  # as the backend names it: "cuda:0", "mps", "metal", "cpu"

    @property
    def device_name(self) -> str:
        from .detect import device_name

        return device_name(self.backend, self.device)


def _rank(backend: str, device: str) -> tuple[int, int]:
    """Auto preference: discrete GPUs (torch CUDA/ROCm), Apple GPU via mlx, then torch MPS,
    then the CPU with torch, mlx, numpy in that order."""
    if device.startswith("cuda"):
        return 0, int(device.partition(":")[2] or 0)
    order = {("mlx", "metal"): 1, ("torch", "mps"): 2, ("torch", "cpu"): 3, ("mlx", "cpu"): 4, ("numpy", "cpu"): 5}
    return order.get((backend, device), 9), 0


def _listing(pairs: list[tuple[str, str]]) -> str:
    by_device: dict[str, list[str]] = {}
    for b, d in pairs:
        by_device.setdefault(d, []).append(b)
    return ", ".join(f"{d} ({', '.join(bs)})" for d, bs in by_device.items()) or "nothing"


def choose(
    backend: str = "auto",
    device: str = "auto",
    supported: list[str] | None = None,
    task_name: str = "the task",
    infos: dict[str, BackendInfo] | None = None,
) -> Choice:
    """The backend and device this node trains on; BackendError (one line, for the user) if none fits.

    backend: "auto" or one of BACKENDS; device: "auto", cpu, cuda, cuda:N, rocm, rocm:N (a ROCm
    build of torch), mps (torch on Apple) or metal (mlx on Apple).
    supported: the backends the task implements (None: not known yet, e.g. before joining).
    Only the backends that could be picked are probed, so `--backend numpy` never imports torch.
    """
    from .detect import backend_info

    if backend != "auto" and backend not in BACKENDS:
        raise BackendError(f"--backend {backend}: unknown backend; choose from auto, {', '.join(BACKENDS)}")
    if supported is not None and backend != "auto" and backend not in supported:
        raise BackendError(
            f"{task_name} has no {backend} implementation ({factory_names(backend)}); "
            f"it supports: {', '.join(supported) or 'no backend drift knows'}"
        )
    wanted = list(BACKENDS) if backend == "auto" else [backend]
    if supported is not None:
        wanted = [b for b in wanted if b in supported]
    infos = dict(infos or {})
    for b in wanted:
        if b not in infos:
            infos[b] = backend_info(b)
    installed = [b for b in wanted if infos[b].installed]
    if not installed:
        if backend != "auto":
            raise BackendError(f"--backend {backend}: {backend} is not installed here ({INSTALL_HINT[backend]})")
        raise BackendError(
            f"{task_name} supports {', '.join(supported or [])}, and none of these is "
            f"installed here ({'; '.join(INSTALL_HINT[b] for b in wanted) or 'nothing to install'})"
        )
    pairs = sorted(((b, d) for b in installed for d in infos[b].devices), key=lambda p: _rank(*p))
    if device == "auto":
        return Choice(*pairs[0])

    hip = infos["torch"].detail.startswith("ROCm") if "torch" in infos else False
    want = device.strip().lower()
    if want.startswith("rocm"):
        want = ("cuda" + want[4:]) if hip else want  # "rocm" on a non-ROCm machine matches nothing
    if want == "cuda":
        matches = [p for p in pairs if p[1].startswith("cuda:")]
    else:
        matches = [p for p in pairs if p[1] == want]
    if matches:
        return Choice(*matches[0])
    if backend != "auto":
        others = [b for b in BACKENDS if b != backend]
        for b in others:
            if b not in infos:
                infos[b] = backend_info(b)
        everything = sorted(
            ((b, d) for b in BACKENDS if infos[b].installed for d in infos[b].devices), key=lambda p: _rank(*p)
        )
        raise BackendError(
            f"--device {device} is not available to the {backend} backend here; {backend} runs on: "
            f"{', '.join(infos[backend].devices)} (all devices here: {_listing(everything)})"
        )
    raise BackendError(f"--device {device} is not available here; available: {_listing(pairs)}")


def make_worker(
    task: ModuleType,
    task_cfg: dict[str, Any],
    optim_cfg: dict[str, Any],
    backend: str = "auto",
    device: str = "auto",
    seed: int = 0,
    threads: int | None = None,
    task_name: str | None = None,
    precision: str = "fp32",
) -> Worker:
    """Pick the backend and device (among those the task implements) and build its Worker.

    precision: "fp32", "bf16" or "fp16" (torch only: autocast, float32 master weights).
    BackendError when the forced backend/device is unavailable, the task lacks that backend or
    the precision is not supported there; TaskError when the task breaks the task interface.
    """
    name = task_name or task_label(task)
    supported = task_backends(task)
    if backend == "auto" and precision != "fp32":  # only torch trains in mixed precision
        supported = [b for b in supported if b == "torch"]
        if not supported:
            raise BackendError(
                f"precision {precision} needs the torch backend, and {name} has no {factory_names('torch')}"
            )
    c = choose(backend, device, supported=supported, task_name=name)
    kwargs: dict[str, Any] = {
        "device": c.device,
        "seed": seed,
        "threads": threads,
        "precision": precision,
        "task_name": name,
    }
    if c.backend == "torch":
        from .torch_worker import TorchWorker

        return TorchWorker(task, task_cfg, optim_cfg, **kwargs)
    if c.backend == "mlx":
        from .mlx_worker import MlxWorker

        return MlxWorker(task, task_cfg, optim_cfg, **kwargs)
    from .numpy_worker import NumpyWorker

    return NumpyWorker(task, task_cfg, optim_cfg, **kwargs)


def load_task(path: str | Path, root: str | Path | None = None) -> ModuleType:
    """Import a task file (e.g. recipes/shakespeare_char.py) by path, as a fresh module.

    The task file's directory and then root (the checkout it lives in; by default that same
    directory) go first on sys.path and stay there, so the task's own imports, at load time or
    later inside its functions, find its sibling modules (`import helpers`) and the checkout's
    packages before anything else. drift's node also takes the process's working directory off
    sys.path, so nothing there can stand in for them.

    The module gets a name unique to the file's resolved path, so two tasks with the same file
    name do not collide. FileNotFoundError if there is no such file; ValueError if it is not under
    root; ImportError (naming the path, chained to the original error) if executing it fails.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"task file not found: {p}")
    resolved = p.resolve()
    dirs = [resolved.parent]
    if root is not None:
        top = Path(root).resolve()
        if not resolved.is_relative_to(top):
            raise ValueError(f"task file {p} is not under {root}")
        dirs.append(top)
    for d in reversed(dirs):
        entry = str(d)
        while entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    name = f"drift_task_{resolved.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import task file {p}: not a Python module", path=str(p))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered while it runs, as a normal import would (dataclasses need it)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ImportError(f"cannot import task file {p}: {type(e).__name__}: {e}", path=str(p)) from e
    return module
