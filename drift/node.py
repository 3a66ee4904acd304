"""`drift join`: one node of the swarm.

The node connects to the coordinator (ALPN ``drift/0``), loads the task from its repo, and then
follows the coordinator round by round: train the units it is given (asking for more when it
runs out), stop at the barrier, all-reduce its weighted pseudo-gradient with its ring neighbours
(ALPN ``drift-ring/0``), apply the outer step and report the checksum of the new parameters.

A node that loses its swarm (the laptop slept, the network dropped, the coordinator dropped it
as silent) comes back by itself: it connects again with the same identity, is verified again,
fetches θ from a peer and trains from the next round. One `Session` is one connection to the
coordinator; the `Node` keeps the model, the endpoint and the ring across sessions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from auth import AuthError, NodeKey, sign_message, verify_peers
from drift import protocol as P
from drift.diloco import DeltaCheck, NesterovOuter, ParamLayout, checksum, weighted_delta
from drift.inner import Calibration, InnerLoop, SimDevice, StopTraining, calibrate
from drift.recipe import Recipe
from drift.repo import RepoCache, RepoError
from drift.ring import Ring, RingError
from drift.state import StateError, StateServer, fetch_state
from drift.transport import (CONTROL_ALPN, MAX_CONTROL_FRAME, RING_ALPN, STATE_ALPN, Channel, Endpoint, TransportError,
                             TransportTimeout, mode_for_ticket, parse_ticket)
from workers import BackendError, choose, load_task, make_worker

log = logging.getLogger("drift.node")

HANDSHAKE_TIMEOUT = 60.0   # TrainConfig after NodeInfo; the coordinator's silence before a recipe names one
REJOIN_PATIENCE_S = 600.0  # how long a node that lost its swarm keeps trying to come back
REJOIN_BACKOFF_S = (1.0, 30.0)


class NodeError(Exception):
    """The node cannot go on; str() is the one line shown to the operator."""


class Lost(Exception):
    """The connection to the coordinator is gone (closed, or silent too long): try to rejoin."""


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
    sim: SimDevice = field(default_factory=SimDevice)  # simulations only
    say: Callable[[str], None] = print  # one line for the operator (run complete, rejoining, ...)


@dataclass
class Trainer:
    """What a node keeps across sessions: the task's worker and the swarm's state as it knows it."""

    worker: object
    recipe: Recipe
    run_id: str
    commit: str
    tree: str | None
    layout: ParamLayout
    theta: object                     # θ_global, flat float32
    outer: NesterovOuter
    calibration: Calibration
    initial_checksum: str             # of θ0: the coordinator checks every node built the same model
    inner: InnerLoop | None = None
    saved: tuple | None = None        # (θ, velocity, θ_local, report_val) at the barrier: a retry starts here
    stepped: bool = True              # θ_local was replaced by θ after the last barrier (outer step done)
    delta_check: DeltaCheck = field(default_factory=DeltaCheck)


class Node:
    def __init__(self, opts: NodeOptions):
        self.opts = opts
        self.endpoint: Endpoint | None = None
        self.ring: Ring | None = None
        self.members: set[str] = set()  # peers this node verified (TrainingReady): the only ones it talks to
        self.coordinator = ""           # the coordinator's id, from the ticket
        self.state = StateServer(allowed=lambda peer: peer in self.members or peer == self.coordinator)
        self.trainer: Trainer | None = None
        self.admitted = False         # this node trained in the swarm (so a refusal may be transient)

    async def run(self) -> int:
        opts = self.opts
        mode = mode_for_ticket(opts.ticket)
        try:
            self.cache = RepoCache(opts.repo, opts.cache_dir)  # fetched once TrainConfig names the commit
        except RepoError as e:
            raise NodeError(str(e)) from None
        self.key = opts.key or NodeKey.generate()
        self.coordinator = str(parse_ticket(opts.ticket).id())
        self.endpoint = await Endpoint.bind(mode, secret_key=self.key.seed)
        self.ring = Ring(self.endpoint, trusted=lambda peer: peer in self.members)
        accept = asyncio.ensure_future(self._accept())
        try:
            return await self._sessions()
        finally:
            accept.cancel()
            self.ring.close()
            await self.endpoint.close()

    async def _sessions(self) -> int:
        """Sessions until the run completes; after a loss, reconnect with backoff."""
        lost_since: float | None = None
        delay = REJOIN_BACKOFF_S[0]
        while True:
            try:
                return await Session(self).run()
            except Lost as e:
                if not self.admitted:  # never got in: nothing to come back to
                    raise NodeError(str(e)) from None
                now = time.monotonic()
                lost_since = lost_since or now
                if now - lost_since > REJOIN_PATIENCE_S:
                    raise NodeError(f"could not rejoin the swarm for {REJOIN_PATIENCE_S:.0f}s (last: {e}); "
                                    f"the run may have ended") from None
                self.opts.say(f"lost the swarm ({e}); rejoining in {delay:.0f}s")
                await asyncio.sleep(delay)
                delay = min(2 * delay, REJOIN_BACKOFF_S[1])
            else:
                lost_since, delay = None, REJOIN_BACKOFF_S[0]

    async def _accept(self) -> None:
        """Serve drift-ring/0 (neighbours) and drift-state/0 (θ for peers); a connection that
        fails, whatever its bytes, is closed with one log line."""
        await self.endpoint.serve({RING_ALPN: self.ring.handle_incoming, STATE_ALPN: self.state.handle})


class Session:
    """One connection to the coordinator: handshake, verification, then rounds until it ends."""

    def __init__(self, node: Node):
        self.node = node
        self.opts = node.opts
        self.inbox: asyncio.Queue[P.Message | None] = asyncio.Queue()
        self.ctl: Channel | None = None
        self.silence_s = HANDSHAKE_TIMEOUT   # the coordinator pings; this much silence means it is gone
        self.round = -1
        self._stash: deque[P.Message | None] = deque()  # messages read early, handled next
        self._tasks: list[asyncio.Task] = []

    # --- plumbing ------------------------------------------------------------------------------

    async def send(self, msg: P._Msg) -> None:
        try:
            await self.ctl.send_frame(P.encode(msg))
        except TransportError as e:
            raise Lost(f"cannot reach the coordinator: {e}") from None

    async def _read_control(self) -> None:
        """Coordinator frames -> inbox; None marks the end of the connection (or its silence)."""
        try:
            while True:
                frame = await self.ctl.recv_frame(MAX_CONTROL_FRAME, timeout=self.silence_s)
                msg = P.decode(frame)
                if isinstance(msg, P.TrainingReady):
                    # Membership changes are taken here, as they arrive, not when the main loop
                    # gets to them: a newcomer may ask us for θ a moment later.
                    self._check_members(msg)
                if not isinstance(msg, P.Ping):
                    self.inbox.put_nowait(msg)
        except P.ProtocolError as e:  # the coordinator sent garbage: say so, and end the connection
            log.warning("dropping the coordinator's connection: %s", e)
            self.lost_reason = f"the coordinator sent an invalid message ({e})"
            self.ctl.close(str(e))
            self.inbox.put_nowait(None)
        except Exception as e:  # noqa: BLE001 - closed or silent: the session ends (and may rejoin)
            log.debug("control stream ended: %s", e)
            self.lost_reason = "coordinator silent" if isinstance(e, TransportTimeout) else \
                "coordinator closed the connection"
            self.inbox.put_nowait(None)

    async def expect(self, *types: type, timeout: float | None = None) -> P.Message:
        """Next control message of one of `types`; TrainingCancel ends the run, a lost connection
        raises Lost, messages of an earlier round (replies that crossed ours) are skipped."""
        while True:
            try:
                msg = self._stash.popleft() if self._stash else await asyncio.wait_for(self.inbox.get(), timeout)
            except asyncio.TimeoutError:
                names = "/".join(t.__name__ for t in types)
                raise Lost(f"coordinator sent no {names} within {timeout:g}s") from None
            if msg is None:
                self._stash.appendleft(None)  # every later expect() sees the end too
                raise Lost(getattr(self, "lost_reason", "coordinator closed the connection"))
            if isinstance(msg, P.TrainingCancel):
                if msg.retry and self.node.admitted:
                    raise Lost(f"the coordinator still holds our old connection ({msg.reason})")
                raise NodeError(f"training cancelled by coordinator: {msg.reason}")
            if isinstance(msg, types):
                return msg
            if getattr(msg, "round", self.round) < self.round:
                continue
            raise NodeError(f"unexpected {msg.type} from coordinator (expected {'/'.join(t.__name__ for t in types)})")

    # --- the session ---------------------------------------------------------------------------

    async def run(self) -> int:
        node = self.node
        try:
            self.ctl = await node.endpoint.connect(self.opts.ticket, CONTROL_ALPN)
        except TransportError as e:
            raise Lost(str(e)) from None
        self._tasks.append(asyncio.ensure_future(self._read_control()))
        try:
            try:
                return await self._run()
            except StopTraining as e:
                raise (Lost(str(e)) if e.lost else NodeError(str(e))) from None
        except Lost:
            final = self._final_word()  # the coordinator's last word may have come before the loss
            if isinstance(final, P.TrainComplete):
                return self._complete(final)
            if isinstance(final, P.TrainingCancel) and not final.retry:
                raise NodeError(f"training cancelled by coordinator: {final.reason}") from None
            raise
        finally:
            for t in self._tasks:
                t.cancel()
            await self.ctl.finish()
            self.ctl.close("node leaving")

    async def _run(self) -> int:
        t = await self._join()
        self._tasks.append(asyncio.ensure_future(self._heartbeat(t.recipe.heartbeat_s)))
        ready = await self.expect(P.TrainingReady, P.TrainComplete)
        if isinstance(ready, P.TrainComplete):
            return self._complete(ready)
        await self._verify_ready(ready)
        self.node.admitted = True
        t.inner = InnerLoop(t.worker, t.recipe, self.inbox, self.send, self.opts.sim)
        while True:
            msg = await self.expect(P.ShardAssignment, P.TrainComplete, P.BarrierReady, P.TrainingReady)
            if isinstance(msg, P.TrainComplete):
                return self._complete(msg)
            if isinstance(msg, P.TrainingReady):  # new members (taken by the reader already)
                await self._verify_ready(msg)
                continue
            if isinstance(msg, P.BarrierReady):  # the last all-reduce is retried (a member was lost)
                if t.saved is not None and msg.round == self.round:
                    await self._sync(msg)
                continue
            await self._round(msg)

    def _final_word(self) -> P.Message | None:
        """A TrainComplete or TrainingCancel still unread (stashed or queued), if any."""
        pending = list(self._stash)
        while not self.inbox.empty():
            pending.append(self.inbox.get_nowait())
        return next((m for m in pending if isinstance(m, (P.TrainComplete, P.TrainingCancel))), None)

    def _complete(self, msg: P.TrainComplete) -> int:
        loss = f", final val loss {msg.final_val_loss:.4f}" if msg.final_val_loss is not None else ""
        self.opts.say(f"run complete: {msg.rounds} rounds{loss}")
        return 0

    async def _join(self) -> Trainer:
        """NodeInfo -> TrainConfig -> (first time: checkout, model, calibration) -> signed RepoCommit."""
        node, opts = self.node, self.opts
        try:  # the backend and device this machine would use; the task may narrow it below
            choice = choose(opts.backend, opts.device)
        except BackendError as e:
            raise NodeError(str(e)) from None
        await self.send(P.NodeInfo(node_id=node.endpoint.node_id, name=opts.name, backend=choice.backend,
                                   device=choice.device, device_name=choice.device_name,
                                   ring_ticket=node.endpoint.ticket()))
        cfg = await self.expect(P.TrainConfig, timeout=HANDSHAKE_TIMEOUT)
        t = node.trainer
        if t is not None and cfg.run_id != t.run_id:
            raise NodeError(f"the coordinator now runs another run ({cfg.run_id}, not {t.run_id}); "
                            f"join it with a fresh `drift join`")
        if t is None:
            alive = asyncio.ensure_future(self._heartbeat(2.0))  # the coordinator hears us while we load
            try:
                t = node.trainer = await self._load(cfg)
            finally:
                alive.cancel()
        else:  # rejoining: same model, fresh inner state, θ comes from a peer at the next round
            t.worker.reset_optimizer()
            t.saved, t.stepped = None, False
        self.silence_s = t.recipe.stale_after_s
        await self.send(self._repo_commit(t))
        return t

    async def _load(self, cfg: P.TrainConfig) -> Trainer:
        """Check out the commit the coordinator names, build the worker, calibrate."""
        opts, node = self.opts, self.node
        try:
            recipe = Recipe.model_validate(cfg.recipe)
        except ValueError as e:
            raise await self._refuse(f"the coordinator sent a recipe this drift cannot use: {e}") from None
        loop = asyncio.get_running_loop()
        try:
            work = await loop.run_in_executor(None, node.cache.checkout, cfg.commit or "")
            tree = node.cache.tree(work)
            task_path = node.cache.task_path(work, recipe.task)
        except RepoError as e:
            raise await self._refuse(str(e)) from None
        io = recipe.inner_optimizer

        def build():
            task = load_task(task_path)  # only from the checkout of cfg.commit
            return make_worker(task, recipe.task_config,
                               dict(lr=io.lr, weight_decay=io.weight_decay, betas=(io.beta1, io.beta2),
                                    grad_clip=io.grad_clip),
                               backend=opts.backend, device=opts.device, seed=recipe.seed,
                               threads=opts.threads, task_name=f"task {recipe.task}")
        try:
            worker = await loop.run_in_executor(None, build)
        except BackendError as e:
            raise await self._refuse(str(e)) from None
        layout = ParamLayout.of(worker.get_params())
        theta = layout.flatten(worker.get_params())
        oo = recipe.outer_optimizer
        outer = NesterovOuter(layout.size, oo.lr, oo.momentum, oo.nesterov)
        log.info("loaded %s: %d parameters, %s on %s", recipe.task, layout.size, worker.backend, worker.device)
        cal = await calibrate(InnerLoop(worker, recipe, self.inbox, self.send, opts.sim))
        worker.set_params(layout.unflatten(theta))  # calibration trained a few steps: back to θ0
        worker.reset_optimizer()                    # ... and to a fresh AdamW, as every node starts
        node.state.layout = layout
        node.state.publish(-1, theta, outer.velocity)
        return Trainer(worker, recipe, cfg.run_id, cfg.commit, tree, layout, theta, outer, cal,
                       checksum(theta, outer.velocity))

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

    def _repo_commit(self, t: Trainer) -> P.RepoCommit:
        """This node's RepoCommit, signed with its key (a fresh nonce every session)."""
        node = self.node
        rc = P.RepoCommit(repo=node.cache.source, commit=t.commit, tree=t.tree, node_id=node.endpoint.node_id,
                          timestamp=time.time(), nonce=secrets.token_hex(16),
                          param_checksum=t.initial_checksum, n_train=t.worker.n_train, n_params=t.layout.size,
                          run_id=t.run_id,
                          samples_per_s=t.calibration.samples_per_s)
        return P.RepoCommit.model_validate(sign_message(node.key, rc.model_dump(mode="json")))

    def _check_members(self, ready: P.TrainingReady) -> str | None:
        """Verify every peer's signed RepoCommit in a TrainingReady; on success they become the
        peers this node trains with (ring, state transfer). Returns what is wrong, or None."""
        t = self.node.trainer
        if t is None:
            return "TrainingReady before this node loaded the task"
        recipe = t.recipe
        try:
            verify_peers(ready.signatures, ready.nodes, commit=t.commit, run_id=t.run_id,
                         threshold=recipe.auth_threshold or 1,
                         allowlist=None if recipe.allowlist is None else frozenset(recipe.allowlist))
        except AuthError as e:
            return f"peer check failed: {e}"
        if self.node.endpoint.node_id not in ready.nodes:
            return "TrainingReady does not list this node"
        self.node.members = set(ready.nodes) - {self.node.endpoint.node_id}
        return None

    async def _verify_ready(self, ready: P.TrainingReady) -> None:
        """Refuse to go on with peers this node cannot verify."""
        problem = self._check_members(ready)
        if problem:
            raise await self._refuse(problem)

    # --- rounds --------------------------------------------------------------------------------

    async def _round(self, a: P.ShardAssignment) -> None:
        node, t = self.node, self.node.trainer
        self.round = a.round
        if not t.stepped:  # the last round's outer step never landed here: start again from θ
            t.worker.set_params(t.layout.unflatten(t.theta))
            t.stepped = True
        t.saved = None
        if a.state is not None:  # a late joiner, an evaluator or a node that sat out: take the swarm's θ first
            try:
                snap = await fetch_state(node.endpoint, a.state.tickets, a.state.round, a.state.checksum, t.layout.size)
            except StateError as e:
                raise Lost(str(e)) from None  # come back and ask again, rather than train on a stale θ
            t.theta[:], t.outer.velocity[:] = snap.theta, snap.velocity
            t.worker.set_params(t.layout.unflatten(t.theta))
            node.state.publish(snap.round, t.theta, t.outer.velocity)
            log.info("took θ after round %d from a peer", snap.round)
        if a.role == "evaluate":
            val, batch_s = await t.inner.evaluate(a.round)
            n = min(t.worker.n_val, t.recipe.eval_batches * t.recipe.batch_size)
            # Evaluators do not train, so their speed is re-measured here: a node that recovers
            # (a laptop that cooled down) trains again once it is fast enough.
            sps = t.recipe.batch_size / (batch_s * t.calibration.eval_ratio)
            await self.send(P.EvalResult(after_round=node.state.snapshot.round, val_loss=val, val_samples=n,
                                         samples_per_s=sps))
            return
        report = await t.inner.run_round(a)
        t.stepped = False
        local = t.layout.flatten(t.worker.get_params())
        problem = t.delta_check.problem(t.theta, local, report.steps) if report.steps else None
        if problem:
            log.warning("round %d: %s; reporting it instead of sending it", a.round, problem)
            t.worker.reset_optimizer()  # its moments are likely as broken as its Δ
        await self.send(report.barrier_sync(a.round).model_copy(update={"delta_error": problem}))
        # A StopRound sent before the coordinator saw our BarrierSync may still arrive: moot. A
        # ShardAssignment (or TrainComplete) instead of BarrierReady means the swarm went on without
        # us (we missed the deadline): this round's work is redone by others, θ comes next round.
        while True:
            msg = await self.expect(P.BarrierReady, P.StopRound, P.ShardAssignment, P.TrainComplete)
            if isinstance(msg, P.BarrierReady) and msg.round == a.round:
                break
            if isinstance(msg, (P.ShardAssignment, P.TrainComplete)):
                log.warning("round %d went on without this node (it missed the deadline)", a.round)
                self._stash.appendleft(msg)
                return
        # Kept until the next round: a retried all-reduce starts again from exactly these.
        t.saved = (t.theta.copy(), t.outer.velocity.copy(), local, a.report_val)
        await self._sync(msg)

    async def _sync(self, ready: P.BarrierReady) -> None:
        """All-reduce the weighted pseudo-gradient, apply the outer step, report the checksum.

        A newer BarrierReady for the same round (the coordinator lost a ring member) aborts the
        reduce in flight; so does a ring failure here (then we report it and wait for the retry).
        Either way θ and the outer state roll back to the round's start first."""
        node, t = self.node, self.node.trainer
        theta_prev, velocity_prev, local, report_val = t.saved
        theta, outer, worker, layout, recipe = t.theta, t.outer, t.worker, t.layout, t.recipe
        theta[:], outer.velocity[:] = theta_prev, velocity_prev
        me = next((m for m in ready.ring if m.node_id == node.endpoint.node_id), None)
        if me is None:
            return  # not in this ring (we sit the round out): θ comes next round
        delta = weighted_delta(theta_prev, local, me.weight)
        reduce = asyncio.ensure_future(node.ring.allreduce_sum(
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
                    await self.expect()  # raises the matching Lost / NodeError
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
            await self.send(P.RingFailed(round=ready.round, ring_epoch=ready.ring_epoch, reason=str(e)[:500],
                                         suspect=e.suspect))
            return
        outer.step(theta, delta)
        worker.set_params(layout.unflatten(theta))
        t.stepped = True
        node.state.publish(ready.round, theta, outer.velocity)
        val = None
        if report_val:
            val, _ = await t.inner.evaluate()
        await self.send(P.RoundDone(round=ready.round, ring_epoch=ready.ring_epoch,
                                    checksum=checksum(theta, outer.velocity),
                                    val_loss=val, bytes_sent=stats.bytes_sent, reduce_s=stats.seconds))

    async def _heartbeat(self, every_s: float) -> None:
        """Tell the coordinator we are alive, also while a long inner step runs; a --local node
        also leaves when the coordinator that started it is gone."""
        parent = int(os.environ.get("DRIFT_PARENT_PID", "0") or 0)
        while True:
            await asyncio.sleep(every_s)
            if parent and os.getppid() != parent:
                print("drift: the coordinator that started this node is gone; leaving", file=sys.stderr)
                os._exit(1)
            try:
                await self.ctl.send_frame(P.encode(P.Heartbeat(round=self.round)))
            except Exception:
                return


async def run_node(opts: NodeOptions) -> int:
    return await Node(opts).run()
