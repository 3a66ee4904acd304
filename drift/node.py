"""`drift join`: one node of the swarm.

The node connects to the coordinator (ALPN ``drift/0``), loads the task from its repo, and then
follows the coordinator round by round: train the units it is given (asking for more when it
runs out), stop at the barrier, all-reduce its weighted pseudo-gradient with its ring neighbours
(ALPN ``drift-ring/0``), apply the outer step and report the checksum of the new parameters.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


from auth import AuthError, NodeKey, sign_message, verify_peers
from drift import protocol as P
from drift.diloco import NesterovOuter, ParamLayout, checksum, weighted_delta
from drift.inner import InnerLoop, SpeedSchedule, StopTraining, calibrate
from drift.recipe import Recipe
from drift.repo import RepoCache, RepoError
from drift.ring import Ring, RingError
from drift.state import StateError, StateServer, fetch_state
from drift.transport import CONTROL_ALPN, MAX_CONTROL_FRAME, RING_ALPN, STATE_ALPN, Channel, Endpoint, mode_for_ticket
from workers import BackendError, choose, load_task, make_worker

log = logging.getLogger("drift.node")


class NodeError(Exception):
    """The node cannot go on; str() is the one line shown to the operator."""


@dataclass
class NodeOptions:
    ticket: str
    repo: str | Path                  # URL or path of the git repo the task code comes from
    key: NodeKey | None = None        # this node's identity; None: a throwaway key (tests)
    cache_dir: Path | None = None     # where --repo is cloned [default: ~/.drift/repos]
    name: str = field(default_factory=socket.gethostname)
    device: str = "auto"
    backend: str = "auto"             # torch, mlx, numpy (auto: the best one here)
    threads: int | None = None
    speed: SpeedSchedule = field(default_factory=SpeedSchedule)  # simulations only


class Node:
    def __init__(self, opts: NodeOptions):
        self.opts = opts
        self.inbox: asyncio.Queue[P.Message | None] = asyncio.Queue()
        self.ctl: Channel | None = None
        self.endpoint: Endpoint | None = None
        self.ring: Ring | None = None
        self._tasks: list[asyncio.Task] = []
        self.round = -1
        self.state = StateServer()
        self._stash: deque[P.Message | None] = deque()  # messages read early, handled next

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
        except P.ProtocolError as e:  # the coordinator sent garbage: say so, and end the connection
            log.warning("dropping the coordinator's connection: %s", e)
            self.ctl.close(str(e))
            self.inbox.put_nowait(None)
        except Exception as e:  # noqa: BLE001 - connection closed (or anything else): the run ends cleanly
            log.debug("control stream ended: %s", e)
            self.inbox.put_nowait(None)

    async def _accept_ring(self) -> None:
        """Serve drift-ring/0 (neighbours) and drift-state/0 (θ for peers); a connection that
        fails, whatever its bytes, is closed with one log line."""
        assert self.endpoint is not None and self.ring is not None
        await self.endpoint.serve({RING_ALPN: self.ring.handle_incoming, STATE_ALPN: self.state.handle})

    async def expect(self, *types: type, timeout: float | None = None) -> P.Message:
        """Next control message, which must be one of `types` (TrainingCancel always ends us)."""
        try:
            msg = self._stash.popleft() if self._stash else await asyncio.wait_for(self.inbox.get(), timeout)
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

    # --- trust: the code we run, and who we run it with ----------------------------------------

    async def _refuse(self, reason: str) -> NodeError:
        """Tell the coordinator why this node will not go on; returns the error to raise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        try:
            await self.send(P.TrainingCancel(reason=reason))
            # Closing at once could drop the frame in flight: wait until the coordinator hangs up.
            while loop.time() < deadline:
                if await asyncio.wait_for(self.inbox.get(), deadline - loop.time()) is None:
                    break
        except Exception:
            pass
        return NodeError(reason)

    async def _checkout(self, cfg: P.TrainConfig, recipe: Recipe) -> Path:
        """Check out the commit the coordinator names from --repo; the task file inside it."""
        loop = asyncio.get_running_loop()
        try:
            work = await loop.run_in_executor(None, self.cache.checkout, cfg.commit or "")
            self.tree = self.cache.tree(work)
            self.commit = cfg.commit
            return self.cache.task_path(work, recipe.task)
        except RepoError as e:
            raise await self._refuse(str(e)) from None

    def _repo_commit(self, cfg: P.TrainConfig, param_checksum: str, n_train: int,
                     samples_per_s: float | None = None) -> P.RepoCommit:
        """This node's RepoCommit, signed with its key."""
        rc = P.RepoCommit(repo=self.cache.source, commit=self.commit, tree=self.tree,
                          node_id=self.endpoint.node_id, timestamp=time.time(), nonce=secrets.token_hex(16),
                          param_checksum=param_checksum, n_train=n_train, run_id=cfg.run_id,
                          samples_per_s=samples_per_s)
        return P.RepoCommit.model_validate(sign_message(self.key, rc.model_dump(mode="json")))

    async def _verify_ready(self, ready: P.TrainingReady, cfg: P.TrainConfig, recipe: Recipe) -> None:
        """Check every peer's signed RepoCommit in TrainingReady before training with them."""
        try:
            verify_peers(ready.signatures, ready.nodes, commit=self.commit, run_id=cfg.run_id,
                         threshold=recipe.auth_threshold or 1,
                         allowlist=None if recipe.allowlist is None else frozenset(recipe.allowlist))
        except AuthError as e:
            raise await self._refuse(f"peer check failed: {e}") from None
        if self.endpoint.node_id not in ready.nodes:
            raise await self._refuse("TrainingReady does not list this node")

    # --- the run -------------------------------------------------------------------------------

    async def run(self) -> int:
        opts = self.opts
        mode = mode_for_ticket(opts.ticket)
        try:
            self.cache = RepoCache(opts.repo, opts.cache_dir)  # fetched once TrainConfig names the commit
        except RepoError as e:
            raise NodeError(str(e)) from None
        self.key = opts.key or NodeKey.generate()
        self.endpoint = await Endpoint.bind(mode, secret_key=self.key.seed)
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
        try:  # the backend and device this machine would use; the task may narrow it below
            choice = choose(opts.backend, opts.device)
        except BackendError as e:
            raise NodeError(str(e)) from None
        await self.send(P.NodeInfo(node_id=self.endpoint.node_id, name=opts.name, backend=choice.backend,
                                   device=choice.device, device_name=choice.device_name,
                                   ring_ticket=self.endpoint.ticket()))
        cfg = await self.expect(P.TrainConfig, timeout=60)
        recipe = Recipe.model_validate(cfg.recipe)
        task = load_task(await self._checkout(cfg, recipe))  # only from the checkout of cfg.commit
        io = recipe.inner_optimizer
        try:  # workers.make_worker: torch / mlx / numpy, among the backends the task implements
            worker = make_worker(task, recipe.task_config,
                                 dict(lr=io.lr, weight_decay=io.weight_decay, betas=(io.beta1, io.beta2),
                                      grad_clip=io.grad_clip),
                                 backend=opts.backend, device=opts.device, seed=recipe.seed,
                                 threads=opts.threads, task_name=f"task {recipe.task}")
        except BackendError as e:
            raise await self._refuse(str(e)) from None
        layout = ParamLayout.of(worker.get_params())
        theta = layout.flatten(worker.get_params())
        oo = recipe.outer_optimizer
        outer = NesterovOuter(layout.size, oo.lr, oo.momentum, oo.nesterov)
        log.info("loaded %s: %d parameters, %s on %s", recipe.task, layout.size, worker.backend, worker.device)
        speed, real_step_s = await calibrate(worker, recipe, self.opts.speed)
        worker.set_params(layout.unflatten(theta))  # calibration trained a few steps: back to θ0
        worker.reset_optimizer()                    # ... and to a fresh AdamW, as every node starts
        await self.send(self._repo_commit(cfg, checksum(theta), worker.n_train, speed))
        await self._verify_ready(await self.expect(P.TrainingReady, timeout=None), cfg, recipe)

        self.worker, self.layout, self.theta, self.outer, self.recipe = worker, layout, theta, outer, recipe
        self.state.layout = layout
        inner = InnerLoop(worker, recipe, self.inbox, self.send, self.opts.speed, real_step_s)
        self.state.publish(-1, theta, outer.velocity)
        self._tasks.append(asyncio.ensure_future(self._heartbeat(recipe.heartbeat_s)))
        while True:
            msg = await self.expect(P.ShardAssignment, P.TrainComplete, P.BarrierReady, timeout=None)
            if isinstance(msg, P.TrainComplete):
                log.info("training complete after %d rounds", msg.rounds)
                return 0
            if isinstance(msg, P.BarrierReady):  # the last all-reduce is retried (a member was lost)
                await self._sync(msg)
                continue
            rnd = self.round = msg.round
            if msg.state is not None:  # a late joiner, or an evaluator: take the swarm's θ first
                try:
                    snap = await fetch_state(self.endpoint, msg.state.tickets, msg.state.round,
                                             msg.state.checksum, layout.size)
                except StateError as e:
                    raise await self._refuse(str(e)) from None
                theta[:], outer.velocity[:] = snap.theta, snap.velocity
                worker.set_params(layout.unflatten(theta))
                self.state.publish(snap.round, theta, outer.velocity)
                log.info("took θ after round %d from a peer", snap.round)
            if msg.role == "evaluate":
                val = await inner.evaluate(msg.round)
                n = min(worker.n_val, recipe.eval_batches * recipe.batch_size)
                await self.send(P.EvalResult(after_round=self.state.snapshot.round, val_loss=val, val_samples=n))
                continue
            try:
                report = await inner.run_round(msg)
            except StopTraining as e:
                raise NodeError(str(e)) from None
            await self.send(report.barrier_sync(rnd))
            # A StopRound sent before the coordinator saw our BarrierSync may still arrive: moot.
            ready = await self.expect(P.BarrierReady, P.StopRound, timeout=None)
            while isinstance(ready, P.StopRound):
                ready = await self.expect(P.BarrierReady, P.StopRound, timeout=None)
            # Kept until the next round: a retried all-reduce starts again from exactly these.
            self._saved = (theta.copy(), outer.velocity.copy(), layout.flatten(worker.get_params()),
                           msg.report_val)
            await self._sync(ready)

    async def _sync(self, ready: P.BarrierReady) -> None:
        """All-reduce the weighted pseudo-gradient, apply the outer step, report the checksum.

        A newer BarrierReady for the same round (the coordinator lost a ring member) aborts the
        reduce in flight; so does a ring failure here (then we report it and wait for the retry).
        Either way θ and the outer state roll back to the round's start first."""
        theta_prev, velocity_prev, local, report_val = self._saved
        theta, outer, worker, layout, recipe = self.theta, self.outer, self.worker, self.layout, self.recipe
        theta[:], outer.velocity[:] = theta_prev, velocity_prev
        me = next(m for m in ready.ring if m.node_id == self.endpoint.node_id)
        delta = weighted_delta(theta_prev, local, me.weight)
        reduce = asyncio.ensure_future(self.ring.allreduce_sum(
            delta, ready.ring, ready.round, codec=ready.codec, topk_fraction=recipe.topk_fraction,
            generation=ready.ring_epoch))
        while True:
            getter = asyncio.ensure_future(self.inbox.get())
            done, _ = await asyncio.wait({reduce, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                msg = getter.result()
                if isinstance(msg, P.BarrierReady) and msg.round == ready.round and msg.ring_epoch > ready.ring_epoch:
                    reduce.cancel()
                    self._stash.append(msg)  # the main loop picks it up and retries
                    return
                if msg is None or isinstance(msg, P.TrainingCancel):
                    reduce.cancel()
                    self._stash.append(msg)
                    await self.expect()  # raises the matching NodeError
                self._stash.append(msg)
                if reduce not in done:
                    continue
            else:
                getter.cancel()
            break
        try:
            stats = reduce.result()
        except RingError as e:
            log.warning("all-reduce of round %d failed: %s; waiting for the coordinator's retry", ready.round, e)
            await self.send(P.RingFailed(round=ready.round, ring_epoch=ready.ring_epoch, reason=str(e)[:500]))
            return
        outer.step(theta, delta)
        worker.set_params(layout.unflatten(theta))
        self.state.publish(ready.round, theta, outer.velocity)
        val = await asyncio.get_running_loop().run_in_executor(
            None, worker.evaluate, recipe.eval_batches, recipe.batch_size) if report_val else None
        await self.send(P.RoundDone(round=ready.round, ring_epoch=ready.ring_epoch, checksum=checksum(theta),
                                    val_loss=val, bytes_sent=stats.bytes_sent, reduce_s=stats.seconds))

    async def _heartbeat(self, every_s: float) -> None:
        """Tell the coordinator we are alive, also while a long inner step runs."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.send(P.Heartbeat(round=self.round))
            except Exception:
                return


async def run_node(opts: NodeOptions) -> int:
    return await Node(opts).run()
