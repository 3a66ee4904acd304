"""`drift coord`: admits nodes, hands out work, runs the barrier and checks every round.

The coordinator never touches tensors: it only sees control messages (ALPN ``drift/0``). Each
node connection is served by its own task; a connection that sends a malformed, oversized or
unexpected frame is closed with a log line, and the coordinator keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from auth import Admission, AuthError
from drift import protocol as P
from drift.monitor import Monitor, NodeView
from drift.recipe import Recipe
from drift.checkpoint import Checkpoint, recipe_hash, save_checkpoint
from drift.diloco import ParamLayout, checksum
from drift.inner import finite_positive
from drift.state import StateError, StateServer, fetch_state
from drift.scheduler import Ledger, RoundPlan, UnitQueue, check_accounting
from drift.transport import CONTROL_ALPN, MAX_CONTROL_FRAME, STATE_ALPN, Channel, Endpoint, NetworkMode, TransportError
from drift.transport import parse_ticket, peer_of

log = logging.getLogger("drift.coord")

HANDSHAKE_TIMEOUT = 30.0
MAX_RING_RETRIES = 5
LOAD_TIMEOUT = 600.0  # a node may have to import torch and build the model first
MAX_JOINING = 64      # connections not yet admitted (handshake, loading the task) at once; more are dropped
MAX_REJECTED = 100    # recent drop reasons kept in Coordinator.rejected (all are logged)


class CoordinatorError(Exception):
    """The run cannot go on; str() is the one line shown to the user."""


def _why(e: Exception) -> str:
    """A dropped connection's reason: the message of our own errors, else the exception's name too."""
    if isinstance(e, (P.ProtocolError, TransportError, AuthError)):
        return str(e)
    return f"{e.__class__.__name__}: {e}"


@dataclass
class Peer:
    info: P.NodeInfo
    ch: Channel
    commit: P.RepoCommit | None = None

    @property
    def id(self) -> str:
        return self.info.node_id


@dataclass
class RoundResult:
    round: int
    val_loss: float | None
    train_loss: float | None
    checksum: str
    samples: int
    seconds: float


@dataclass
class Coordinator:
    recipe: Recipe
    run_dir: Path
    mode: NetworkMode = "local"
    commit: str | None = None
    monitor: Monitor | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    key: bytes | None = None            # Ed25519 seed (auth.NodeKey.seed): the coordinator's node id
    tree: str | None = None             # tree id of `commit`, when the coordinator's repo has it
    extra_allowed: tuple[str, ...] = ()  # ids admitted on top of the recipe's allowlist (--local nodes)
    resume: Checkpoint | None = None     # continue from this checkpoint (nodes fetch its θ from us)

    def __post_init__(self) -> None:
        r = self.recipe
        if r.allowlist is not None and self.extra_allowed:  # nodes check peers against the same list
            r.allowlist = sorted({*r.allowlist, *self.extra_allowed})
        allow = None if r.allowlist is None else frozenset(r.allowlist)
        self.admission = Admission(commit=self.commit, run_id=self.run_id, allowlist=allow,
                                   threshold=r.auth_threshold or r.min_nodes, tree=self.tree)
        self._auth_abort: str | None = None  # why the whole swarm is cancelled (auth_threshold)
        self.endpoint: Endpoint | None = None
        self.ready: dict[str, Peer] = {}
        self.events: asyncio.Queue[tuple[Peer, P.Message | None]] = asyncio.Queue()
        self._joined = asyncio.Condition()
        self._started = False
        self._finished = False
        self._tasks: set[asyncio.Task] = set()
        self.results: list[RoundResult] = []
        self.initial_val_loss: float | None = None
        self.members: dict[str, Peer] = {}       # nodes in the run now
        self.speed: dict[str, float] = {}        # samples/s: calibrated at join, then measured
        self.last_seen: dict[str, float] = {}    # monotonic time of each node's last message
        self.ledger = Ledger()
        self.joining: list[Peer] = []           # admitted after the start: enter at the next round
        self.state_round: dict[str, int] = {}   # the round whose θ each node holds (-1: initial θ)
        self.checksums: dict[int, str] = {}     # the agreed checksum of θ after each round
        self.evaluating: set[str] = set()       # evaluators with an evaluation in flight
        self.ring_epoch = 0                     # +1 per retried all-reduce (ring connections renew)
        self.state = StateServer()              # serves a resumed checkpoint's θ to the nodes
        self.last_checkpoint: int | None = None
        self.last_checkpoint_path: Path | None = None
        self._saving: asyncio.Future | None = None  # the checkpoint write in flight, if any
        # Set by Ctrl-C. Cancelling run() is not enough: a cancel that lands inside an iroh call can
        # come back as an ordinary error (a failed state fetch, say) and the rounds would go on.
        self.stopping = False
        self.samples_seen = 0
        self.rejected: deque[str] = deque(maxlen=MAX_REJECTED)  # why recent connections were dropped (all logged)
        self._joining_conns = 0  # connections in the handshake, not yet admitted (MAX_JOINING)

    # --- serving connections -------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and start accepting; returns the join ticket."""
        if (why := self.admission.unreachable()) is not None:  # e.g. fewer allowlisted nodes than needed
            raise CoordinatorError(why)
        self.endpoint = await Endpoint.bind(self.mode, secret_key=self.key, alpns=(CONTROL_ALPN, STATE_ALPN))
        self._spawn(self._accept_loop())
        return self.endpoint.ticket()

    def _spawn(self, coro) -> None:  # noqa: ANN001
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        """Serve drift/0 (nodes) and drift-state/0 (θ of a resumed checkpoint) until the endpoint
        closes. A connection that fails, whatever its bytes, ends in one connection_dropped line."""
        assert self.endpoint is not None
        await self.endpoint.serve({CONTROL_ALPN: self._serve,
                                   STATE_ALPN: lambda conn: self.state.handle(conn, on_drop=self._dropped)},
                                  on_drop=self._dropped)

    def _dropped(self, peer: str, why: str) -> None:
        """One line (and one connection_dropped event) per dropped connection; `why` as plain text."""
        peer = peer[:10] if len(peer) == 64 else P.printable(peer, 64)  # a node id, else an address
        why = P.printable(why, 300)
        log.warning("dropping connection from %s: %s", peer, why)
        self.rejected.append(why)
        if self.monitor:
            self.monitor.event("connection_dropped", peer=peer, reason=why)

    def _drop(self, ch: Channel | None, conn, why: str) -> None:  # noqa: ANN001
        self._dropped(peer_of(conn), why)
        try:
            (ch.close(why) if ch else conn.close(1, why.encode()[:100]))
        except Exception:  # noqa: BLE001, S110 - already closed
            pass

    async def _refuse(self, ch: Channel, conn, why: str) -> None:  # noqa: ANN001
        """Tell a node why it is refused (TrainingCancel), let it read that, then drop it."""
        try:
            await ch.send_frame(P.encode(P.TrainingCancel(reason=why)), timeout=5.0)
            await ch.finish()
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:  # ends when the node hangs up, having read it
                await ch.recv_frame(MAX_CONTROL_FRAME, timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            pass
        self._drop(ch, conn, why)

    async def _auth_failed(self, ch: Channel, conn, node_id: str, why: str, tell: bool = True) -> None:  # noqa: ANN001
        """A node failed a trust check: refuse it, and cancel the swarm if auth_threshold is now out of reach."""
        self.admission.refuse(node_id, why)
        if self.monitor:
            self.monitor.event("node_refused", node_id=node_id, reason=why)
        if tell:
            await self._refuse(ch, conn, why)
        else:
            self._drop(ch, conn, why)
        abort = self.admission.unreachable()
        if abort and not self._started:
            async with self._joined:
                self._auth_abort = abort
                self._joined.notify_all()

    async def _serve(self, conn) -> None:  # noqa: ANN001 - iroh.Connection
        """One node's connection: the handshake, then every frame feeds the round loop. Whatever
        the peer sends ends, at worst, its own connection with one connection_dropped line."""
        ch: Channel | None = None
        if self._joining_conns >= MAX_JOINING:
            self._drop(None, conn, f"refused: {MAX_JOINING} connections are already joining")
            return
        self._joining_conns += 1
        try:
            ch = await Endpoint.accept_channel(conn, timeout=HANDSHAKE_TIMEOUT)
            try:
                self.admission.check_allowed(ch.peer_id)
            except AuthError as e:
                await self._auth_failed(ch, conn, ch.peer_id, str(e))
                return
            info = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=HANDSHAKE_TIMEOUT))
            if not isinstance(info, P.NodeInfo):
                raise P.ProtocolError(f"expected NodeInfo first, got {info.type}")
            if info.node_id != ch.peer_id:
                raise P.ProtocolError("NodeInfo.node_id is not the id of the connecting endpoint")
            if str(parse_ticket(info.ring_ticket).id()) != ch.peer_id:  # neighbours dial it: it must be this node
                raise P.ProtocolError("NodeInfo.ring_ticket names another endpoint")
            peer = Peer(info, ch)
            await ch.send_frame(P.encode(P.TrainConfig(run_id=self.run_id, recipe=self.recipe.model_dump(mode="json"),
                                                       commit=self.commit)))
            rc = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=LOAD_TIMEOUT))
            if isinstance(rc, P.TrainingCancel):  # the node refused the code it was asked to run
                await self._auth_failed(ch, conn, peer.id, f"node {info.name} ({peer.id[:10]}) refused to run: "
                                        f"{rc.reason}", tell=False)
                return
            if not isinstance(rc, P.RepoCommit):
                raise P.ProtocolError(f"expected RepoCommit, got {rc.type}")
            try:
                self.admission.verify(rc.model_dump(mode="json"), ch.peer_id)
            except AuthError as e:
                await self._auth_failed(ch, conn, peer.id, f"RepoCommit refused: {e}")
                return
            peer.commit = rc
            if self.monitor:
                self.monitor.nodes[peer.id] = NodeView(info.name, info.device)
                self.monitor.event("node_joined", node_id=peer.id, name=info.name, device=info.device,
                                   backend=info.backend, commit=rc.commit)
            async with self._joined:  # last: nothing below can fail once the round loop may count on it
                self.ready[peer.id] = peer
                if self._started:  # a late joiner: it enters at the next round, fetching θ first
                    self.joining.append(peer)
                self._joined.notify_all()
        except Exception as e:  # a peer's bytes end its connection, never the coordinator
            log.debug("handshake with %s failed", peer_of(conn)[:10], exc_info=True)
            self._drop(ch, conn, _why(e))
            return
        finally:
            self._joining_conns -= 1
        # From here on every frame of this node feeds the round loop.
        try:
            while True:
                msg = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=None))
                self.events.put_nowait((peer, msg))
        except Exception as e:  # noqa: BLE001 - as above: the round loop sees the node leave, nothing more
            if not self._finished:
                self._drop(ch, conn, _why(e))
            self.events.put_nowait((peer, None))

    # --- the run -------------------------------------------------------------------------------

    async def _broadcast(self, peers: list[Peer], msg: P._Msg) -> None:
        await asyncio.gather(*(p.ch.send_frame(P.encode(msg)) for p in peers))

    async def wait_for_nodes(self) -> list[Peer]:
        n = max(self.recipe.min_nodes, self.admission.threshold)
        async with self._joined:
            await self._joined.wait_for(lambda: len(self.ready) >= n or self._auth_abort is not None)
            self._started = True
        if self._auth_abort is not None:
            peers = list(self.ready.values())
            await self._broadcast(peers, P.TrainingCancel(reason=self._auth_abort))
            left: set[str] = set()
            try:  # give every node the time to read why before the endpoint closes
                while len(left) < len(peers):
                    peer, msg = await asyncio.wait_for(self.events.get(), 5.0)
                    if msg is None:
                        left.add(peer.id)
            except asyncio.TimeoutError:
                pass
            raise CoordinatorError(self._auth_abort)
        return list(self.ready.values())

    async def run(self) -> list[RoundResult]:
        """Wait for min_nodes, then run every round; returns one result per round."""
        peers = await self.wait_for_nodes()
        for what in ("param_checksum", "n_train"):
            seen = {getattr(p.commit, what) for p in peers}
            if len(seen) != 1:
                await self._broadcast(peers, P.TrainingCancel(reason=f"nodes loaded different tasks ({what})"))
                raise CoordinatorError(f"nodes loaded different tasks: {what} differs {sorted(map(str, seen))}")
        await self._broadcast(peers, P.TrainingReady(nodes=[p.id for p in peers],
                                                     signatures=self.admission.signatures(p.id for p in peers)))
        self._note("training_started", nodes=len(peers))
        r = self.recipe
        self.checksums[-1] = peers[0].commit.param_checksum
        self.n_train = peers[0].commit.n_train
        for p in peers:
            self._enter(p, -1)
        queue = UnitQueue(self.n_train, r.unit_samples)
        first = 0
        if self.resume is not None:
            first = self._load_resume(queue)
        self.queue = queue
        for rnd in range(first, r.rounds):
            if self.stopping:
                return self.results
            if self.monitor:
                self.monitor.round, self.monitor.rounds = rnd + 1, r.rounds
            await self._admit_late_joiners(rnd)
            if not self.members:
                raise CoordinatorError(f"every node has left (round {rnd})")
            self.results.append(await self._round(rnd, queue))
            self.samples_seen += self.results[-1].samples
            if self.stopping:
                return self.results
            if (rnd + 1) % r.checkpoint_every == 0 or rnd == r.rounds - 1:
                await self.checkpoint(rnd)
        if self.stopping:
            return self.results
        await self._finish_evaluations(timeout=max(30.0, 3 * r.stale_after_s))
        final = self.results[-1].val_loss if self.results else None
        self._finished = True
        await self._last_word(list(self.members.values()), P.TrainComplete(rounds=r.rounds, final_val_loss=final))
        if self.monitor:
            self.monitor.event("complete", rounds=r.rounds, final_val_loss=final, **queue.position())
        return self.results

    # --- checkpoints -----------------------------------------------------------------------------

    def _model_fields(self) -> dict:
        """What a checkpoint's θ depends on: resuming with other values is refused."""
        r = self.recipe
        return {"task": r.task, "task_config": r.task_config, "seed": r.seed}

    def _load_resume(self, queue: UnitQueue) -> int:
        """Take over a checkpoint: serve its θ, restore the data position; returns the next round."""
        ck = self.resume
        assert ck is not None
        if ck.manifest.get("recipe_hash") != recipe_hash(self._model_fields()):
            raise CoordinatorError(f"{ck.path}: checkpoint was made with another task, task_config or seed")
        layout = ParamLayout.of(ck.theta)
        theta, velocity = layout.flatten(ck.theta), layout.flatten(ck.velocity)
        if checksum(theta) != ck.manifest.get("checksum"):
            raise CoordinatorError(f"{ck.path}: θ does not match the checksum in its manifest")
        self.state.layout = layout
        self.state.publish(ck.round, theta, velocity)
        self.checksums[ck.round] = self.state.snapshot.checksum
        queue.restore(ck.manifest["queue"])
        self.samples_seen = ck.manifest.get("samples_seen", 0)
        self.last_checkpoint, self.last_checkpoint_path = ck.round, ck.path
        self._note("resumed", round=ck.round, path=str(ck.path), samples_seen=self.samples_seen)
        return ck.round + 1

    async def checkpoint(self, rnd: int) -> Path | None:
        """Fetch θ after round `rnd` from a node (checksum-verified) and write it atomically."""
        if self.last_checkpoint == rnd:
            return self.last_checkpoint_path
        if rnd not in self.checksums or self.endpoint is None:
            return None
        donors = [self.members[i].info.ring_ticket for i in self.members if self.state_round.get(i) == rnd]
        if self.state.snapshot is not None and self.state.snapshot.round == rnd:
            snap = self.state.snapshot
        else:
            try:
                snap = await fetch_state(self.endpoint, donors, rnd, self.checksums[rnd])
            except StateError as e:
                log.warning("no checkpoint for round %d: %s", rnd, e)
                return None
        if snap.layout is None:
            return None
        meta = {"checksum": snap.checksum, "samples_seen": self.samples_seen, "commit": self.commit,
                "recipe_hash": recipe_hash(self._model_fields()), "run_id": self.run_id,
                "queue": self.queue.position()}
        named = snap.layout.unflatten
        self._saving = asyncio.get_running_loop().run_in_executor(
            None, lambda: save_checkpoint(self.run_dir / "checkpoints", rnd, named(snap.theta),
                                          named(snap.velocity), meta, keep=self.recipe.keep_checkpoints))
        # Shielded: cancelling the run (Ctrl-C) cannot stop the writer thread, so the save stays
        # awaitable and interrupt() waits for it instead of racing a second writer on the same files.
        path = await asyncio.shield(self._saving)
        self.last_checkpoint, self.last_checkpoint_path = rnd, path
        self._note("checkpoint", round=rnd, path=str(path))
        return path

    async def interrupt(self, reason: str) -> Path | None:
        """A clean stop (Ctrl-C): checkpoint the last finished round, tell every node why."""
        self.stopping = True
        path = None
        if self._saving is not None:
            await asyncio.wait({self._saving})  # a save the cancelled run left in flight ends first
        if self.checksums:
            path = await self.checkpoint(max(self.checksums))
        self._finished = True
        await self._last_word(list(self.members.values()) or list(self.ready.values()),
                              P.TrainingCancel(reason=reason))
        return path

    async def _last_word(self, peers: list[Peer], msg: P._Msg, timeout: float = 10.0) -> None:
        """Send a final message, then wait (briefly) for each node to hang up: closing at once
        could discard the message while it is still in flight."""
        await asyncio.gather(*(self._send(p, msg) for p in peers))
        left: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(left) < len(peers) and time.monotonic() < deadline:
            try:
                peer, m = await asyncio.wait_for(self.events.get(), max(0.05, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
            if m is None:
                left.add(peer.id)

    async def _finish_evaluations(self, timeout: float) -> None:
        """Give evaluations still in flight a chance to land before the run ends."""
        deadline = time.monotonic() + timeout
        while self.evaluating and time.monotonic() < deadline:
            try:
                peer, msg = await asyncio.wait_for(self.events.get(), 0.5)
            except asyncio.TimeoutError:
                continue
            if msg is None or peer.id not in self.members:
                self.evaluating.discard(peer.id)
            elif isinstance(msg, P.EvalResult):
                self._on_eval(peer.id, msg)
        if self.evaluating:
            log.warning("ending without %d evaluation(s) still running", len(self.evaluating))

    def _on_eval(self, i: str, msg: P.EvalResult) -> None:
        self.evaluating.discard(i)
        self.state_round[i] = msg.after_round
        if msg.after_round < 0:
            self.initial_val_loss = msg.val_loss
            self._note("initial", val_loss=msg.val_loss, val_samples=msg.val_samples)
        else:
            self._note("val", after_round=msg.after_round, val_loss=msg.val_loss, val_samples=msg.val_samples)

    # --- membership ----------------------------------------------------------------------------

    def _enter(self, p: Peer, state_round: int) -> None:
        self.members[p.id] = p
        self.speed[p.id] = self._checked_speed(p, p.commit.samples_per_s)
        self.last_seen[p.id] = time.monotonic()
        self.state_round[p.id] = state_round

    async def _admit_late_joiners(self, rnd: int) -> None:
        """Nodes admitted during the last round join now; they fetch θ from a peer first."""
        async with self._joined:
            joining, self.joining = self.joining, []
        for p in joining:
            if (p.commit.param_checksum, p.commit.n_train) != (self.checksums[-1], self.n_train):
                why = "this node loaded a different task (initial θ or dataset differs)"
                await self._send(p, P.TrainingCancel(reason=why))
                self._note("node_refused", node_id=p.id, reason=why)
                continue
            ids = [*self.members, p.id]
            await self._send(p, P.TrainingReady(nodes=ids, signatures=self.admission.signatures(ids)))
            self._enter(p, -1)
            self._note("node_entered", node_id=p.id, name=p.info.name, round=rnd)

    def _state_source(self, node: str) -> P.StateSource | None:
        """Where `node` gets the swarm's current θ, or None when it already holds it."""
        last = max(self.checksums)
        if self.state_round.get(node) == last:
            return None
        donors = sorted((i for i in self.members if self.state_round.get(i) == last and i != node),
                        key=lambda i: -self.speed[i])
        tickets = [self.members[i].info.ring_ticket for i in donors]
        if self.state.snapshot is not None and self.state.snapshot.round == last:
            tickets.append(self.endpoint.ticket())  # a resumed checkpoint, served by us
        return P.StateSource(round=last, checksum=self.checksums[last], tickets=tickets)

    # --- one round -----------------------------------------------------------------------------

    def _checked_speed(self, peer: Peer, sps: float | None) -> float:
        """A node's claimed speed, unless it is absurd (then: the slowest speed we trust)."""
        if finite_positive(sps):
            return float(sps)
        trusted = [v for k, v in self.speed.items() if k != peer.id]
        fallback = min(trusted) if trusted else 1.0
        log.warning("node %s reported an absurd speed (%r); planning with %.3g samples/s until measured",
                    peer.info.name, sps, fallback)
        self._note("absurd_speed", node_id=peer.id, name=peer.info.name, reported=str(sps), used=fallback)
        return fallback

    def _note(self, kind: str, **fields) -> None:  # noqa: ANN003
        if self.monitor:
            self.monitor.event(kind, **fields)

    def _evaluators(self, budget: int) -> set[str]:
        """Nodes so slow that one inner step would hold the swarm back: they evaluate instead.

        A node evaluates when it is more than 1/slow_node_fraction times slower than the fastest
        node AND a single inner step of it takes longer than slow_node_fraction of the round's
        expected length (the round budget over the trainers' summed speed). The fastest trains."""
        r = self.recipe
        speeds = {i: self.speed[i] for i in self.members}
        fastest = max(speeds, key=speeds.get)
        evaluators: set[str] = set()
        for i in sorted(speeds, key=speeds.get):  # slowest first
            if i == fastest:
                break
            trainers = sum(v for k, v in speeds.items() if k not in evaluators)
            round_s = budget / trainers
            if speeds[i] < r.slow_node_fraction * speeds[fastest] and \
                    r.batch_size / speeds[i] > r.slow_node_fraction * round_s:
                evaluators.add(i)
        return evaluators

    async def _assign_evaluation(self, peer: Peer, rnd: int, epoch: int) -> None:
        """Send an evaluator its next job: the val loss of the newest agreed θ."""
        self.evaluating.add(peer.id)
        await self._send(peer, P.ShardAssignment(round=rnd, epoch=epoch, units=[], role="evaluate",
                                                 state=self._state_source(peer.id)))

    async def _send(self, peer: Peer, msg: P._Msg) -> None:
        try:
            await peer.ch.send_frame(P.encode(msg))
        except TransportError as e:
            log.warning("could not send %s to %s: %s", msg.type, peer.info.name, e)

    async def _round(self, rnd: int, queue: UnitQueue) -> RoundResult:
        r = self.recipe
        t0 = time.monotonic()
        steal = r.schedule == "steal"
        budget = r.round_samples if steal else len(self.members) * r.inner_steps * r.batch_size
        evaluators = self._evaluators(budget) if steal else set()
        trainers = {i: self.speed[i] for i in self.members if i not in evaluators}
        epoch, units = queue.take(budget)
        # Lockstep (for comparison) gives every node the same share, whatever its speed.
        plan = RoundPlan.make(units, trainers if steal else dict.fromkeys(trainers, 1.0), steal)
        fastest = max(trainers, key=trainers.get)
        for i, peer in list(self.members.items()):
            if i in evaluators:  # evaluators work at their own pace: a new job once the last is done
                if i not in self.evaluating:
                    await self._assign_evaluation(peer, rnd, epoch)
                continue
            await self._send(peer, P.ShardAssignment(
                round=rnd, epoch=epoch, units=plan.grant_first(i), planned=len(plan.planned[i]),
                report_val=i == fastest and (not evaluators or rnd == r.rounds - 1), state=self._state_source(i)))

        async def send_ring() -> list[P.RingMember]:
            """BarrierReady to every node in the barrier: the ring order and each node's weight."""
            total = sum(sum(u.hi - u.lo for u in synced[i].trained) for i in part() if i not in excluded)

            def weight(i: str) -> float:
                if i in excluded or total == 0:
                    return 0.0
                return sum(u.hi - u.lo for u in synced[i].trained) / total

            members = [P.RingMember(node_id=i, ticket=self.members[i].info.ring_ticket, weight=weight(i))
                       for i in part()]
            self._note("barrier", round=rnd, ring_epoch=self.ring_epoch, nodes=len(members))
            await self._broadcast([self.members[i] for i in part()],
                                  P.BarrierReady(round=rnd, ring=members, codec=r.codec, ring_epoch=self.ring_epoch))
            return members

        def part() -> list[str]:
            """The nodes in this round's barrier and ring (evaluators are not)."""
            return [i for i in self.members if i not in evaluators]

        last_progress = {i: time.monotonic() for i in self.members}
        trained_so_far = dict.fromkeys(self.members, 0)   # from TrainProgress, this round
        synced: dict[str, P.BarrierSync] = {}
        t_sync: dict[str, float] = {}
        done: dict[str, P.RoundDone] = {}
        excluded: set[str] = set()
        give_back: list[P.WorkUnit] = []
        stop_sent, t_stop = False, 0.0
        early: set[str] = set()               # stopped ahead of the others (see the round's tail)
        ring: list[P.RingMember] | None = None
        retry_reason: str | None = None       # why the all-reduce in flight must be redone
        ring_failed_at: float | None = None
        epoch0 = self.ring_epoch

        async def stop_all(reason: str) -> None:
            nonlocal stop_sent, t_stop
            if not stop_sent:
                stop_sent, t_stop = True, time.monotonic()
                log.info("round %d: %s; stopping at the next inner step", rnd, reason)
                await asyncio.gather(*(self._send(self.members[i], P.StopRound(round=rnd))
                                       for i in part() if i not in synced))

        def drop(i: str, why: str) -> None:
            """Remove a node from the swarm mid-round; its work this round is redone."""
            peer = self.members.pop(i)
            log.warning("node %s (%s) dropped: %s", peer.info.name, i[:10], why)
            self._note("node_left", node_id=i, name=peer.info.name, reason=why, round=rnd)
            if i in synced and i not in excluded:
                give_back.extend(synced[i].trained)
            synced.pop(i, None)
            plan.drop(i)
            self.evaluating.discard(i)
            peer.ch.close(why)
            if self.monitor:
                self.monitor.nodes.pop(i, None)

        while ring is None or len(done) < len(part()):
            try:
                peer, msg = await asyncio.wait_for(self.events.get(), 0.5)
            except asyncio.TimeoutError:
                peer, msg = None, None
            now = time.monotonic()
            if peer is not None:
                if peer.id not in self.members:
                    continue  # a message from a node already dropped
                self.last_seen[peer.id] = now
                i = peer.id
                if msg is None:
                    drop(i, "connection closed")
                    if ring is not None:
                        retry_reason = f"{peer.info.name} left during the all-reduce"
                elif isinstance(msg, P.TrainProgress):
                    last_progress[i] = now
                    trained_so_far[i] += msg.unit.hi - msg.unit.lo
                    if finite_positive(msg.samples_per_s):
                        self.speed[i] = 0.5 * self.speed[i] + 0.5 * msg.samples_per_s
                    if self.monitor and i in self.monitor.nodes:
                        v = self.monitor.nodes[i]
                        n = msg.unit.hi - msg.unit.lo
                        v.samples_per_s, v.loss, v.samples = msg.samples_per_s, msg.loss, v.samples + n
                        self.monitor.event("progress", node_id=i, round=rnd, unit=[msg.unit.id, msg.unit.lo, msg.unit.hi],
                                           loss=msg.loss, samples_per_s=msg.samples_per_s)
                elif isinstance(msg, P.AskForMoreWork):
                    nxt = plan.next_for(i) if i not in excluded | early and msg.round == rnd else None
                    if nxt is not None:
                        last_progress[i] = now
                        await self._send(peer, P.AssignNext(round=rnd, unit=nxt))
                    else:
                        await self._send(peer, P.NoMoreWork(round=msg.round))
                        if steal and plan.remaining() == 0:
                            await stop_all("the round's budget is handed out")
                elif isinstance(msg, P.BarrierSync):
                    synced[i], t_sync[i] = msg, now
                    if i not in excluded and i not in evaluators:
                        wrong = check_accounting(plan.granted.get(i, []), msg.trained, msg.returned)
                        if wrong:
                            log.warning("node %s: bad work report (%s); its work this round is redone",
                                        peer.info.name, wrong)
                            self._note("bad_report", node_id=i, reason=wrong, round=rnd)
                            excluded.add(i)
                            plan.drop(i)
                        else:  # accounted for: what it trained is in synced, the rest goes back
                            give_back.extend(msg.returned)
                            plan.granted[i] = []
                    if msg.val_loss is not None:
                        if rnd == 0:
                            self.initial_val_loss = msg.val_loss
                            self._note("initial", val_loss=msg.val_loss, val_samples=msg.val_samples)
                        else:
                            self._note("val", after_round=rnd - 1, val_loss=msg.val_loss, val_samples=msg.val_samples)
                elif isinstance(msg, P.RoundDone):
                    if msg.ring_epoch == self.ring_epoch:
                        done[i] = msg
                elif isinstance(msg, P.RingFailed):
                    if ring is not None and msg.ring_epoch == self.ring_epoch and ring_failed_at is None:
                        log.warning("round %d: %s reports the all-reduce failed: %s", rnd, peer.info.name, msg.reason)
                        ring_failed_at = now
                elif isinstance(msg, P.EvalResult):
                    self._on_eval(i, msg)
                    if i in evaluators and msg.after_round < max(self.checksums):
                        # A newer θ is already agreed: evaluate it now rather than at the next round.
                        await self._assign_evaluation(peer, rnd, epoch)
                elif isinstance(msg, (P.Heartbeat, P.Pong)):
                    pass
                else:
                    log.warning("ignoring unexpected %s from %s in round %d", msg.type, peer.info.name, rnd)

            # The round's tail: a node whose next inner step would end after everyone else ran out
            # of work stops now, so nobody waits at the barrier for most of a slow step.
            if steal and ring is None and not stop_sent:
                active = [i for i in part() if i not in synced and i not in excluded and i not in early]
                in_hand = {i: sum(u.hi - u.lo for u in plan.granted.get(i, [])) - trained_so_far[i] for i in active}
                for i in sorted(active, key=lambda i: self.speed[i]):  # slowest first
                    others = [j for j in active if j != i]
                    if not others:
                        break
                    left_s = (plan.remaining() + sum(in_hand[j] for j in others)) / sum(self.speed[j] for j in others)
                    if r.batch_size / self.speed[i] > left_s:
                        early.add(i)
                        active.remove(i)
                        await self._send(self.members[i], P.StopRound(round=rnd))

            # Liveness, deadlines and the barrier (checked on every event and twice a second).
            for i in list(self.members):
                silent = now - self.last_seen.get(i, now)
                if silent > r.stale_after_s:
                    name = self.members[i].info.name
                    drop(i, f"silent for {silent:.0f}s")
                    if ring is not None:
                        retry_reason = f"{name} went silent during the all-reduce"
                    continue
                if ring is not None or i in synced or i in excluded or i in evaluators:
                    continue
                # Deadlines: a unit should take unit_samples/speed, and after StopRound a node
                # should reach the barrier within one inner step. Past unit_deadline_factor times
                # that (plus heartbeat slack), its work is reassigned and it sits this round out.
                if stop_sent:
                    since, expected = max(t_stop, last_progress[i]), r.batch_size / self.speed[i]
                elif i in trainers and plan.granted.get(i):
                    since, expected = last_progress[i], r.unit_samples / self.speed[i]
                else:
                    continue
                if rnd == 0 and i == fastest and not stop_sent:  # it evaluates θ0 before training
                    expected += r.eval_batches * r.batch_size / self.speed[i]
                waited = now - since
                others = [j for j in part() if j != i and j not in excluded]
                if others and waited > r.unit_deadline_factor * expected + 2 * r.heartbeat_s:
                    name = self.members[i].info.name
                    log.warning("node %s has not finished its work in %.1fs (expected %.2fs): its units are "
                                "reassigned and it sits out this round", name, waited, expected)
                    self._note("deadline", node_id=i, name=name, round=rnd, waited_s=waited, expected_s=expected)
                    excluded.add(i)
                    plan.drop(i)
                    # What we know now: it is at least this slow. Plans (and the choice of
                    # evaluators) from the next round on use that.
                    self.speed[i] = min(self.speed[i], r.batch_size / waited)
                    await self._send(self.members[i], P.StopRound(round=rnd))
            if ring is not None:
                # A ring that lost a member (or that a member says broke) is rebuilt from the
                # survivors, weights renormalised; every node rolls back and reduces again.
                if retry_reason is None and ring_failed_at is not None and now - ring_failed_at > 2 * r.heartbeat_s + 1:
                    retry_reason = "a node reported a broken all-reduce and nobody left"
                if retry_reason is None:
                    continue
                if not part():
                    raise CoordinatorError(f"every training node has left (round {rnd})")
                if self.ring_epoch - epoch0 >= MAX_RING_RETRIES:
                    raise CoordinatorError(f"the all-reduce of round {rnd} failed {MAX_RING_RETRIES} times "
                                           f"(last: {retry_reason})")
                log.warning("round %d: %s; retrying the all-reduce with %d node(s)", rnd, retry_reason, len(part()))
                self._note("ring_retry", round=rnd, reason=retry_reason, nodes=len(part()))
                retry_reason, ring_failed_at = None, None
                done.clear()
                self.ring_epoch += 1
                ring = await send_ring()
                continue
            if not part():
                raise CoordinatorError(f"every training node has left (round {rnd})")
            unsynced = [i for i in part() if i not in synced]
            if unsynced and not all(i in excluded for i in unsynced):
                continue
            if not any(i in synced and i not in excluded for i in part()):
                continue  # nobody useful yet (e.g. everyone excluded): keep waiting for stragglers
            for i in unsynced:  # only stragglers past their deadline are left: go on without them
                drop(i, "did not reach the barrier in time after its work was reassigned")
            t_ready = now
            ring = await send_ring()

        checksums = {d.checksum for d in done.values()}
        if len(checksums) != 1:
            detail = ", ".join(f"{self.members[i].info.name}={d.checksum[:12]}" for i, d in done.items())
            await self._broadcast(list(self.members.values()), P.TrainingCancel(reason=f"replicas diverged in round {rnd}"))
            raise CoordinatorError(f"replicas diverged after round {rnd}: {detail}")
        weights = {m.node_id: m.weight for m in ring}
        self.checksums[rnd] = next(iter(checksums))
        for i in done:
            self.state_round[i] = rnd
        for i, s in synced.items():
            if weights.get(i, 0) > 0:
                self.ledger.add(epoch, s.trained)
        queue.give_back(give_back + plan.leftover())
        losses = [(s.loss, s.samples) for i, s in synced.items() if s.loss is not None and weights.get(i, 0) > 0]
        train_loss = sum(l * n for l, n in losses) / sum(n for _, n in losses) if losses else None
        val = next((d.val_loss for d in done.values() if d.val_loss is not None), None)
        samples = sum(sum(u.hi - u.lo for u in s.trained) for i, s in synced.items() if weights.get(i, 0) > 0)
        res = RoundResult(rnd, val, train_loss, checksums.pop(), samples, time.monotonic() - t0)
        if self.monitor:
            self.monitor.val_loss = val if val is not None else self.monitor.val_loss
            for i, d in done.items():
                if i in self.monitor.nodes:
                    self.monitor.nodes[i].bytes_sent += d.bytes_sent
            self.monitor.event("round", round=rnd, epoch=epoch, val_loss=val, train_loss=train_loss, samples=samples,
                               seconds=res.seconds, checksum=res.checksum,
                               bytes_sent=sum(d.bytes_sent for d in done.values()),
                               evaluators=sorted(self.members[i].info.name for i in evaluators if i in self.members),
                               reduce_s=max(d.reduce_s for d in done.values()),
                               nodes={self.members[i].info.name: {
                                   "node_id": i, "samples": sum(u.hi - u.lo for u in s.trained), "steps": s.steps,
                                   "weight": weights.get(i, 0.0), "busy_s": t_sync[i] - t0,
                                   "idle_s": t_ready - t_sync[i],
                                   "sync_s": done[i].reduce_s if i in done else 0.0,
                                   "bytes_sent": done[i].bytes_sent if i in done else 0,
                                   "role": "evaluate" if i in evaluators else "train",
                                   "trained": [[u.id, u.lo, u.hi] for u in s.trained]}
                                   for i, s in synced.items()})
        return res

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for p in self.ready.values():
            await p.ch.finish()
        if self.endpoint:
            await self.endpoint.close()
