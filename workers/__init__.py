"""Local compute: device detection, the Worker interface and its backends.

Nothing here knows about networking, and nothing here imports drift. Importing this package
does not import torch; `from workers.torch_worker import TorchWorker` does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .base import Worker

__all__ = ["Worker", "load_task"]


def load_task(path: str | Path) -> ModuleType:
    """Import a task file (e.g. recipes/shakespeare_char.py) by path, as a fresh module.

    The module gets a name unique to the file's resolved path, so two tasks with the same file
    name do not collide. FileNotFoundError if there is no such file; ImportError (naming the
    path, chained to the original error) if executing it fails.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"task file not found: {p}")
    resolved = p.resolve()
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
