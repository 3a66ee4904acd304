"""`drift sample RUN_DIR`: text from the newest checkpoint of a run, for tasks that define

    sample(model, prompt, n) -> str     # the prompt continued by n tokens (the task's own decoding)

The model is built again from the task as the checkpoint's manifest names it (task, task_config,
seed: the frozen base, if any, comes out the same, and its digest is checked), then θ is loaded.
"""

from __future__ import annotations

from pathlib import Path

from drift.checkpoint import latest_checkpoint
from drift.diloco import ParamLayout


class SampleError(Exception):
    """Why no text can be drawn; one line for the user."""


def load_model(run_dir: Path, repo: Path):
    """The task's model with θ of the newest checkpoint that verifies in run_dir, and that checkpoint."""
    from drift.workers import load_task
    from drift.workers.torch_worker import TorchWorker

    ck, _ = latest_checkpoint(Path(run_dir) / "checkpoints")
    if ck is None:
        raise SampleError(f"{run_dir}: no checkpoint that verifies in {Path(run_dir) / 'checkpoints'}")
    m = ck.manifest
    if not isinstance(m.get("task"), str):
        raise SampleError(f"{ck.path}: the manifest does not name its task (a checkpoint from an older drift)")
    path = Path(repo) / m["task"]
    if not path.is_file():
        raise SampleError(f"{path}: task file not found (give the task's repo with --repo)")
    try:
        task = load_task(path, root=repo)
        worker = TorchWorker(task, m.get("task_config") or {}, {}, device="cpu", seed=int(m.get("seed", 0)))
        layout = ParamLayout(ck.names, ck.shapes, int(m.get("buffers", 0)))
        params, buffers = layout.split(layout.unflatten(ck.theta_flat))
        worker.set_params(params)
        if buffers:
            worker.set_buffers(buffers)
    except (ValueError, TypeError, ImportError, KeyError) as e:
        raise SampleError(f"{ck.path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if worker.frozen_checksum() != m.get("frozen_base", ""):
        raise SampleError(f"{ck.path}: the task builds another frozen base than this checkpoint was trained on")
    worker.model.eval()
    return task, worker.model, ck


def sample_text(run_dir: Path, prompt: str, n: int, repo: Path) -> str:
    """The task's sample(model, prompt, n) on the newest checkpoint that verifies in run_dir."""
    import torch

    task, model, ck = load_model(run_dir, repo)
    name = ck.manifest["task"]
    fn = getattr(task, "sample", None)
    if not callable(fn):
        raise SampleError(f"task {name} defines no sample(model, prompt, n)")
    try:
        with torch.no_grad():
            text = fn(model, prompt, n)
    except (ValueError, TypeError, KeyError) as e:
        raise SampleError(f"{ck.path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(text, str):
        raise SampleError(f"task {name}: sample() returned {type(text).__name__}, not text")
    return text


def repo_of(run_dir: Path) -> Path:
    """The git repo a run's task comes from: the one holding the run directory, else the current one."""
    from drift.recipe import repo_root

    root = repo_root(Path(run_dir).resolve() / "metrics.jsonl")
    return root if (root / ".git").exists() else repo_root(Path.cwd() / "metrics.jsonl")
