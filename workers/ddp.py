"""One node, several devices: a TorchWorker per rank, kept identical by DistributedDataParallel.

Rank 0 lives in the node's process and is the worker the node sees (`RankGroup`): its model is
the node's local θ, and everything but an inner step (state in and out, evaluation) is rank 0's
alone. The other ranks are local processes (started by drift/ranks.py) that hold a replica and
follow rank 0's commands over a local socket (`follow`): an inner step splits its samples between
the ranks, each accumulates the gradient of its share, DDP all-reduces the gradients (gloo on
CPUs, NCCL on CUDA/ROCm GPUs: chosen by the device type), and every rank takes the same optimizer
step, so the replicas stay equal. State rank 0 is given (the outer step, a catch-up) reaches the
others as a broadcast before the next step.

Each rank's loss is weighted by its share of the batch (times the world size, which DDP's mean
divides out), so the step is the one a single worker computes on the whole batch, up to float
summation order. A rank that dies is reported in one line (`on_failure`), never waited for.
"""

from __future__ import annotations

import contextlib
import datetime
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .base import BackendError, micro_splits
from .torch_worker import TorchWorker

HOST = "127.0.0.1"
START_TIMEOUT_S = 600.0  # a rank builds its worker (the task's dataset and model) in this time
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # a wedged collective ends the rank's process
GRACE_S = 10.0  # how long a failed step waits for the watchdog to name the rank that died


def listen_store(world: int) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on 127.0.0.1 only: torch's own TCPStore server binds
    every interface, where anyone who can reach this machine could read and overwrite the group's
    keys (rank 0's address among them). A socket bound here is handed to it instead."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, 0))
        sock.listen(max(16, world))
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return dist.TCPStore(
        HOST,
        port,
        world,
        is_master=True,
        timeout=COLLECTIVE_TIMEOUT,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),  # the store's server owns the socket from here on
    )


class RankError(BackendError):
    """A rank of this node failed (it died, or could not start); str() names it and why."""


def dist_backend(device: str) -> str:
    """The torch.distributed backend for a device: NCCL on CUDA/ROCm GPUs, gloo on CPUs."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class _Through:
    """What the task's loss calls while a rank trains: calls go through DDP (so its hooks see
    the step), attributes come from the task's own model."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        self._ddp = ddp

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ddp(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ddp.module, name)


class Replica:
    """One rank's side of the group: its worker wrapped in DDP, and the collectives every rank
    takes part in (an inner step's share, a broadcast of rank 0's state)."""

    def __init__(self, worker: TorchWorker, rank: int, world: int, store: dist.Store) -> None:
        self.worker, self.world = worker, world
        if worker.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(worker.device))
        dist.init_process_group(
            dist_backend(worker.device), store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
        )
        # DDP's constructor broadcasts rank 0's parameters and buffers: the replicas start equal.
        ids = [torch.device(worker.device).index] if worker.device.startswith("cuda") else None
        self.ddp = torch.nn.parallel.DistributedDataParallel(worker.model, device_ids=ids)
        self._through = _Through(self.ddp)
        self._gpu = torch.device(worker.device) if ids else None

    def _here(self) -> None:
        """The CUDA device of this rank is the calling thread's (the node steps from its own)."""
        if self._gpu is not None:
            torch.cuda.set_device(self._gpu)

    def step(self, share: np.ndarray, count: int, parts: int, n: int) -> float:
        """This rank's part of one inner step on n samples: the gradient of `share` (count of
        them: 0 for a rank left without samples, which steps on one with weight 0 so that DDP's
        all-reduce still sees every rank), all-reduced, then the optimizer step. Its share of
        the batch's mean loss."""
        self._here()
        w = self.worker
        w.begin_step()
        splits = micro_splits(share, min(parts, len(share)))
        weight = self.world if count else 0.0
        total = w.backward(splits, n if count else len(share), self._through, weight, self.ddp.no_sync)
        w.finish_step()
        return total if count else 0.0

    def sync(self) -> None:
        """Every rank's parameters and buffers <- rank 0's."""
        self._here()
        w = self.worker
        with torch.no_grad():
            for t in (*w._params.values(), *w._buffers.values()):
                dist.broadcast(t.data, src=0)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def follow(worker: TorchWorker, conn: Connection, rank: int, world: int, port: int) -> None:
    """A rank > 0: join the group, then do what rank 0 says until it says close (or is gone)."""
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    replica = Replica(worker, rank, world, store)
    try:
        while True:
            try:
                op, *args = conn.recv()
            except (EOFError, OSError):  # rank 0 is gone: so is its node
                return
            if op == "step":
                conn.send(replica.step(*args))
            elif op == "sync":
                replica.sync()
            elif op == "lr":
                worker.set_lr(*args)
            elif op == "reset":
                worker.reset_optimizer()
            elif op == "close":
                return
    finally:
        replica.close()


@dataclass
class Rank:
    """A rank > 0 as rank 0 sees it: its process, its command socket, its last words."""

    index: int
    device: str
    proc: subprocess.Popen
    conn: Connection
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=5))

    def exit_line(self, world: int) -> str:
        code = self.proc.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        last = self.tail[-1] if self.tail else "no output"
        return f"rank {self.index} of {world} ({self.device}) {how}: {last}"


class RankGroup:
    """The node's worker when it trains on several devices: rank 0 (in this process) plus the
    ranks given. Everything but train_step, set_lr, reset_optimizer and close is rank 0's worker's
    own; state written to rank 0 reaches the others before the next step."""

    def __init__(
        self,
        worker: TorchWorker,
        ranks: list[Rank],
        store: dist.TCPStore,
        on_failure: Callable[[str], None],
    ) -> None:
        self._worker, self._ranks = worker, ranks
        self.world = len(ranks) + 1
        self.on_failure = on_failure
        self.failure: str | None = None
        self._closing = False
        self._dirty = False
        for r in ranks:
            threading.Thread(target=self._read_output, args=(r,), name=f"drift-rank-{r.index}", daemon=True).start()
        self._await_ready()
        self._replica = Replica(worker, 0, self.world, store)
        threading.Thread(target=self._watch, name="drift-rank-watch", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)

    # --- starting, watching, stopping the ranks ---------------------------------------------------

    def _read_output(self, r: Rank) -> None:
        """A rank's stderr and stdout: kept (its last lines say why it died) and passed on."""
        for raw in r.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                r.tail.append(line)
                print(f"rank {r.index}: {line}", file=sys.stderr, flush=True)

    def _await_ready(self) -> None:
        """Until every rank built its worker (it says "ready"); RankError naming one that died."""
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(self._ranks)
        while waiting:
            for r in list(waiting):
                if r.conn.poll(0.1):
                    try:
                        msg = r.conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg == "ready":
                        waiting.remove(r)
                        continue
                if r.proc.poll() is not None:
                    r.proc.wait()
                    time.sleep(0.2)  # its last line, still in the pipe
                    self._stop()
                    raise RankError(r.exit_line(self.world))
            if time.monotonic() > deadline:
                self._stop()
                raise RankError(
                    f"rank {waiting[0].index} ({waiting[0].device}) did not start in {START_TIMEOUT_S:.0f}s"
                )

    def _watch(self) -> None:
        """A rank that dies while the node runs: say which, and why (on_failure), at once."""
        while not self._closing:
            for r in self._ranks:
                if r.proc.poll() is not None and not self._closing:
                    time.sleep(0.2)  # its last line, still in the pipe
                    if self._closing:
                        return
                    self.failure = r.exit_line(self.world)
                    self.on_failure(self.failure)
                    return
            time.sleep(0.2)

    def _stop(self) -> None:
        """Every rank's process ends: asked first, then killed."""
        self._closing = True
        for r in self._ranks:
            with contextlib.suppress(Exception):
                r.conn.send(("close",))
        deadline = time.monotonic() + 5.0
        for r in self._ranks:
            try:
                r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
            r.conn.close()

    def close(self) -> None:
        """Stop the ranks and leave the process group (idempotent)."""
        if not self._closing:
            self._stop()
            self._replica.close()
        self._worker.close()

    # --- what the node calls -------------------------------------------------------------------

    def _send(self, *cmd: Any) -> None:
        for r in self._ranks:
            try:
                r.conn.send(cmd)
            except OSError as e:
                self._failed(e)

    def _failed(self, e: BaseException) -> None:
        """A step that failed because a rank did: RankError naming it (the watchdog knows)."""
        deadline = time.monotonic() + GRACE_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        raise RankError(self.failure or f"the ranks of this node failed: {e}") from None

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        self._worker.set_params(params)
        self._dirty = True

    def set_buffers(self, buffers: dict[str, np.ndarray]) -> None:
        self._worker.set_buffers(buffers)
        self._dirty = True

    def add_to_state(self, deltas: dict[str, np.ndarray]) -> None:
        self._worker.add_to_state(deltas)
        self._dirty = True

    def set_lr(self, lr: float) -> None:
        self._worker.set_lr(lr)
        self._send("lr", lr)

    def reset_optimizer(self) -> None:
        self._worker.reset_optimizer()
        self._send("reset")

    def train_step(self, indices: np.ndarray, micro_batches: int = 1) -> float:
        """One inner step of the group: the samples split in near-equal consecutive shares, one
        per rank (rank 0 first); the mean loss over all of them."""
        if self.failure is not None:
            raise RankError(self.failure)
        indices = np.asarray(indices)
        n = len(indices)
        micro_splits(indices, micro_batches)  # checked here, as a single worker does
        shares = np.array_split(indices, self.world)
        try:
            if self._dirty:
                self._send("sync")
                self._replica.sync()
                self._dirty = False
            for r, share in zip(self._ranks, shares[1:]):
                r.conn.send(("step", *self._share(share, indices), micro_batches, n))
            total = self._replica.step(*self._share(shares[0], indices), micro_batches, n)
            for r in self._ranks:
                total += r.conn.recv()
        except (RuntimeError, OSError, EOFError) as e:  # a collective, or a socket, that lost a rank
            if self.failure is None and not self._a_rank_ended(1.0):  # (an error of its own: at once)
                raise
            self._failed(e)
        return total

    def _a_rank_ended(self, timeout: float) -> bool:
        """Whether a rank's process ended within `timeout` s. (A killed rank's sockets reset
        before its exit can be waited for: a collective fails first, then the process is gone.)"""
        deadline = time.monotonic() + timeout
        while all(r.proc.poll() is None for r in self._ranks):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    @staticmethod
    def _share(share: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, int]:
        """(the samples a rank steps on, how many count): a rank left without any steps on the
        batch's first with weight 0."""
        return (share, len(share)) if len(share) else (indices[:1], 0)
