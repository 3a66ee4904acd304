"""`drift join --devices cuda:0,cuda:1` / `--nproc N`: one node that trains on several devices.

The node stays one drift identity (one key, one NodeInfo, one ring member, one θ_global and
outer state, in this process); only its inner steps run across ranks with torch.distributed
(workers/ddp.py: DDP over NCCL on GPUs, gloo on CPUs). Rank 0 is this process; every other rank
is a local process (`python -m drift.ranks FD`) started here, told over a socket pair what to
build (the same task, from the same checkout, on its device), and rendezvousing with rank 0
through a TCP store on 127.0.0.1. A rank that dies ends the node with one line naming it.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from drift.recipe import Recipe
from drift.workers import BackendError, make_worker

RANK_BACKENDS = ("auto", "torch")


class RanksError(ValueError):
    """--devices / --nproc asked for something this machine or backend cannot do; one line."""


def rank_devices(
    devices: str | None, nproc: int | None, backend: str = "auto", device: str = "auto"
) -> list[str] | None:
    """The device of each rank (rank 0 first) that `--devices` / `--nproc` ask for; None when
    neither is given. RanksError naming the mistake."""
    if devices is None and nproc is None:
        return None
    if devices is not None and nproc is not None:
        raise RanksError("--devices and --nproc: give one of them (--devices for GPUs, --nproc N for CPU processes)")
    flag = f"--devices {devices}" if devices is not None else f"--nproc {nproc}"
    if backend not in RANK_BACKENDS:
        raise RanksError(
            f"{flag}: one node on several devices trains with torch (DDP); the {backend} backend trains "
            f"in one process (drop --backend {backend}, or start one node per device)"
        )
    if nproc is not None:
        if nproc < 1:
            raise RanksError(f"--nproc {nproc}: a node needs at least 1 process")
        if device not in ("auto", "cpu"):
            raise RanksError(
                f"--nproc {nproc} with --device {device}: --nproc runs CPU processes; for GPUs use --devices"
            )
        return ["cpu"] * nproc
    if device != "auto":
        raise RanksError(f"{flag} with --device {device}: give one of them")
    names = [d.strip().lower() for d in devices.split(",")]
    if not all(names):
        raise RanksError(f"{flag}: an empty device name (list them as cuda:0,cuda:1)")
    seen: set[str] = set()
    for name in names:
        if name == "cpu":
            raise RanksError(f"{flag}: cpu is no device to list; use --nproc N for N CPU processes")
        if not name.startswith(("cuda", "rocm")):
            raise RanksError(
                f"{flag}: {name} cannot be a rank (torch.distributed trains on CUDA/ROCm GPUs, or on CPUs with --nproc)"
            )
        same = "cuda:0" if name in ("cuda", "rocm") else name.replace("rocm", "cuda")
        if same in seen:
            raise RanksError(f"{flag}: {name} is named twice")
        seen.add(same)
    try:
        from drift.workers.torch_worker import resolve_device
    except ImportError:
        raise RanksError(f"{flag}: needs torch, which is not installed here (pip install torch)") from None
    resolved: list[str] = []
    for name in names:
        try:
            resolved.append(resolve_device(name))
        except ValueError as e:
            raise RanksError(f"{flag}: {e}") from None
    return resolved


def task_worker(work: Path, task_path: Path, recipe: Recipe, backend: str, device: str, threads: int | None, data=None):
    """The worker of recipe's task from the checkout `work` (for `drift join` and each rank).
    `data`: the task -> the task as this node trains it (drift.data.served_task), or None."""
    from drift.imports import isolate
    from drift.workers import load_task

    isolate(work, task_path.parent, work)  # its own `workers`, `auth`, ... are its, not drift's
    task = load_task(task_path, root=work)  # only from the checkout of the coordinator's commit
    if data is not None:
        task = data(task)
    io = recipe.inner_optimizer
    return make_worker(
        task,
        recipe.task_config,
        dict(lr=io.lr, weight_decay=io.weight_decay, betas=(io.beta1, io.beta2), grad_clip=io.grad_clip),
        backend=backend,
        device=device,
        seed=recipe.seed,
        threads=threads,
        task_name=f"task {recipe.task}",
        precision=recipe.precision,
    )


def leave(line: str) -> None:
    """A rank died: the node cannot go on (its steps need every rank). One line, exit 1."""
    print(f"drift: error: {line}", file=sys.stderr, flush=True)
    os._exit(1)


def start_group(
    work: Path,
    task_path: Path,
    recipe: Recipe,
    devices: list[str],
    threads: int | None = None,
    on_failure=leave,
):
    """Rank 0's worker (built here) and one process per further device, joined into one DDP
    group: the RankGroup the node trains with. RankError / BackendError / TaskError if any
    rank cannot start (the others are stopped)."""

    from drift.workers.ddp import Rank, RankGroup, listen_store

    if threads is None and devices[0] == "cpu":  # the ranks share this machine's cores
        threads = max(1, (os.cpu_count() or 1) // len(devices))
    store = listen_store(len(devices))
    ranks: list[Rank] = []
    try:
        for i, device in enumerate(devices[1:], start=1):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen(
                [sys.executable, "-m", "drift.ranks", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                # A terminal's Ctrl-C is the node's to handle (it leaves the swarm, then stops
                # its ranks); a rank outlives its node by at most a second (_watch_parent).
                start_new_session=True,
            )
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(
                {
                    "work": str(work),
                    "task": str(task_path),
                    "recipe": recipe.model_dump(mode="json"),
                    "device": device,
                    "threads": threads,
                    "rank": i,
                    "world": len(devices),
                    "port": store.port,
                    "parent": os.getpid(),
                }
            )
            ranks.append(Rank(i, device, proc, conn))
        try:
            worker = task_worker(work, task_path, recipe, "torch", devices[0], threads)
        except BackendError as e:
            raise BackendError(f"a node on several devices trains with torch: {e}") from None
        group = RankGroup(worker, ranks, store, on_failure)
    except BaseException:
        for r in ranks:
            r.proc.kill()
            r.proc.wait()
        raise
    atexit.register(group.close)
    return group


# --- a rank > 0: `python -m drift.ranks FD` -------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """A rank whose node is gone leaves (even from inside a wedged collective)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def main(fd: int) -> int:
    from drift.workers.ddp import follow

    conn = Connection(fd)
    spec: dict[str, Any] = conn.recv()
    rank = spec["rank"]
    threading.Thread(target=_watch_parent, args=(spec["parent"],), daemon=True).start()
    try:
        recipe = Recipe.model_validate(spec["recipe"])
        worker = task_worker(Path(spec["work"]), Path(spec["task"]), recipe, "torch", spec["device"], spec["threads"])
        conn.send("ready")
        follow(worker, conn, rank, spec["world"], spec["port"])
    except Exception as e:
        if os.environ.get("DRIFT_DEBUG"):
            traceback.print_exc()
        print(f"{type(e).__name__}: {e}".splitlines()[0], file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.path[:] = [
        p for p in sys.path if p not in ("", os.getcwd())
    ]  # as `drift join`: task code imports from its checkout
    sys.exit(main(int(sys.argv[1])))
