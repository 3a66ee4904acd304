"""`drift join`: one node of the swarm.

The node connects to the coordinator (ALPN ``drift/0``), loads the task from its repo, and then
follows the coordinator round by round: train the units it is given (asking for more when it
runs out), stop at the barrier, all-reduce its weighted pseudo-gradient with its ring neighbours
(ALPN ``drift-ring/0``), apply the outer step and report the checksum of the new parameters.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from drift import protocol as P
from drift.diloco import NesterovOuter, ParamLayout, checksum, epoch_order, unit_indices, weighted_delta
from drift.recipe import Recipe
from drift.ring import Ring
from drift.transport import CONTROL_ALPN, MAX_CONTROL_FRAME, RING_ALPN, Channel, Endpoint, mode_for_ticket
from workers import load_task
from workers.torch_worker import TorchWorker, resolve_device

log = logging.getLogger("drift.node")


class NodeError(Exception):
    """The node cannot go on; str() is the one line shown to the operator."""


@dataclass
class NodeOptions:
    ticket: str
    repo: Path
    name: str = field(default_factory=socket.gethostname)
    device: str = "auto"
    threads: int | None = None
    speed: float = 1.0   # simulations only: <1 stretches every inner step by 1/speed


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


class Node:
    def __init__(self, opts: NodeOptions):
        self.opts = opts
        self.inbox: asyncio.Queue[P.Message | None] = asyncio.Queue()
        self.ctl: Channel | None = None
        self.endpoint: Endpoint | None = None
        self.ring: Ring | None = None
        self._tasks: list[asyncio.Task] = []

    # --- plumbing ------------------------------------------------------------------------------

    async def send(self, msg: P._Msg) -> None:
        assert self.ctl is not None
        await self.ctl.send_frame(P.encode(msg))

    async def _read_control(self) -> None:
        """Coordinator frames -> inbox; None marks the end of the connection."""
        assert self.ctl is not None
        try:
            while True:
                frame = await self.ctl.recv_frame(MAX_CONTROL_FRAME, timeout=None)
                self.inbox.put_nowait(P.decode(frame))
        except Exception as e:  # connection closed, or the coordinator sent garbage
            log.debug("control stream ended: %s", e)
            self.inbox.put_nowait(None)

    async def _accept_ring(self) -> None:
        assert self.endpoint is not None and self.ring is not None
        while True:
            try:
                alpn, conn = await self.endpoint.accept()
            except Exception:
                return
            if alpn == RING_ALPN:
                self._tasks.append(asyncio.ensure_future(self.ring.handle_incoming(conn)))
            else:
                conn.close(2, b"nodes serve drift-ring/0 only")

    async def expect(self, *types: type, timeout: float | None = None) -> P.Message:
        """Next control message, which must be one of `types` (TrainingCancel always ends us)."""
        try:
            msg = await asyncio.wait_for(self.inbox.get(), timeout)
        except asyncio.TimeoutError:
            names = "/".join(t.__name__ for t in types)
            raise NodeError(f"coordinator sent no {names} within {timeout:g}s") from None
        if msg is None:
            raise NodeError("coordinator closed the connection")
        if isinstance(msg, P.TrainingCancel):
            raise NodeError(f"training cancelled by coordinator: {msg.reason}")
        if not isinstance(msg, types):
            raise NodeError(f"unexpected {msg.type} from coordinator "
                            f"(expected {'/'.join(t.__name__ for t in types)})")
        return msg

    # --- the run -------------------------------------------------------------------------------

    async def run(self) -> int:
        opts = self.opts
        if not (opts.repo / ".git").exists() and not opts.repo.is_dir():
            raise NodeError(f"--repo {opts.repo}: not a directory")
        self.endpoint = await Endpoint.bind(mode_for_ticket(opts.ticket))
        self.ring = Ring(self.endpoint)
        self._tasks.append(asyncio.ensure_future(self._accept_ring()))
        try:
            self.ctl = await self.endpoint.connect(opts.ticket, CONTROL_ALPN)
            self._tasks.append(asyncio.ensure_future(self._read_control()))
            return await self._train()
        finally:
            for t in self._tasks:
                t.cancel()
            if self.ring:
                self.ring.close()
            if self.ctl:
                await self.ctl.finish()
            await self.endpoint.close()

    async def _train(self) -> int:
        opts = self.opts
        try:
            device = resolve_device(opts.device)
        except ValueError as e:
            raise NodeError(f"--device {opts.device}: {e}") from None
        await self.send(P.NodeInfo(node_id=self.endpoint.node_id, name=opts.name, backend="torch",
                                   device=device, ring_ticket=self.endpoint.ticket()))
        cfg = await self.expect(P.TrainConfig, timeout=60)
        recipe = Recipe.model_validate(cfg.recipe)
        task_path = opts.repo / recipe.task
        if not task_path.is_file():
            raise NodeError(f"task file {recipe.task} not found in --repo {opts.repo}")
        task = load_task(task_path)
        io = recipe.inner_optimizer
        worker = TorchWorker(task, recipe.task_config,
                             dict(lr=io.lr, weight_decay=io.weight_decay, betas=(io.beta1, io.beta2),
                                  grad_clip=io.grad_clip),
                             device=device, seed=recipe.seed, threads=opts.threads)
        layout = ParamLayout.of(worker.get_params())
        theta = layout.flatten(worker.get_params())
        oo = recipe.outer_optimizer
        outer = NesterovOuter(layout.size, oo.lr, oo.momentum, oo.nesterov)
        log.info("loaded %s: %d parameters on %s", recipe.task, layout.size, device)
        await self.send(P.RepoCommit(repo=str(opts.repo), commit=_git(opts.repo, "rev-parse", "HEAD"),
                                     tree=_git(opts.repo, "rev-parse", "HEAD^{tree}"),
                                     node_id=self.endpoint.node_id, timestamp=time.time(),
                                     nonce=secrets.token_hex(16), param_checksum=checksum(theta),
                                     n_train=worker.n_train))
        await self.expect(P.TrainingReady, timeout=None)

        orders: dict[int, np.ndarray] = {}
        loop = asyncio.get_running_loop()
        while True:
            msg = await self.expect(P.ShardAssignment, P.TrainComplete, timeout=None)
            if isinstance(msg, P.TrainComplete):
                log.info("training complete after %d rounds", msg.rounds)
                return 0
            rnd = msg.round
            if msg.epoch not in orders:
                orders = {msg.epoch: epoch_order(worker.n_train, recipe.seed, msg.epoch)}
            order = orders[msg.epoch]
            queue = list(msg.units)
            val_start = None
            if msg.evaluate and rnd == 0:
                val_start = await loop.run_in_executor(None, worker.evaluate, recipe.eval_batches,
                                                       recipe.batch_size)
            samples = steps = 0
            losses: list[float] = []
            while True:
                for unit in queue:
                    idx = unit_indices(order, unit, recipe.unit_samples)
                    t0 = time.perf_counter()
                    u_losses = []
                    for a in range(0, len(idx), recipe.batch_size):
                        u_losses.append(await loop.run_in_executor(None, worker.train_step,
                                                                   idx[a:a + recipe.batch_size]))
                        if opts.speed < 1.0:
                            await asyncio.sleep((time.perf_counter() - t0) / len(u_losses) * (1 / opts.speed - 1))
                    dt = time.perf_counter() - t0
                    samples += len(idx)
                    steps += len(u_losses)
                    losses += u_losses
                    await self.send(P.TrainProgress(round=rnd, unit=unit, samples=len(idx), steps=len(u_losses),
                                                    loss=float(np.mean(u_losses)), samples_per_s=len(idx) / dt))
                await self.send(P.AskForMoreWork(round=rnd))
                more = await self.expect(P.AssignNext, P.NoMoreWork, timeout=None)
                if isinstance(more, P.NoMoreWork):
                    break
                queue = [more.unit]
            await self.send(P.BarrierSync(round=rnd, samples=samples, steps=steps,
                                          loss=float(np.mean(losses)) if losses else None,
                                          val_loss_start=val_start))
            ready = await self.expect(P.BarrierReady, timeout=None)
            me = next(m for m in ready.ring if m.node_id == self.endpoint.node_id)
            local = layout.flatten(worker.get_params())
            delta = weighted_delta(theta, local, me.weight)
            stats = await self.ring.allreduce_sum(delta, ready.ring, rnd)
            outer.step(theta, delta)
            worker.set_params(layout.unflatten(theta))
            val = await loop.run_in_executor(None, worker.evaluate, recipe.eval_batches, recipe.batch_size) \
                if msg.evaluate else None
            await self.send(P.RoundDone(round=rnd, checksum=checksum(theta), val_loss=val,
                                        bytes_sent=stats.bytes_sent, reduce_s=stats.seconds))


async def run_node(opts: NodeOptions) -> int:
    return await Node(opts).run()
