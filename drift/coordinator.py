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
from drift.checkpoint import Checkpoint, CheckpointWriter, recipe_hash
from drift.diloco import ParamLayout, checksum
from drift.inner import finite_positive
from drift.monitor import Monitor, NodeView
from drift.recipe import Recipe
from drift.round import Round, RoundError, RoundResult
from drift.scheduler import Ledger, UnitQueue
from drift.state import StateError, StateServer, fetch_state
from drift.transport import (
    CONTROL_ALPN,
    MAX_CONTROL_FRAME,
    STATE_ALPN,
    Channel,
    Endpoint,
    NetworkMode,
    TransportError,
    TransportTimeout,
    parse_ticket,
    peer_of,
)
from drift.weights import WeightsError, load_weights

log = logging.getLogger("drift.coord")

HANDSHAKE_TIMEOUT = 30.0
MAX_STRIKES = 2  # a node made to sit out for misbehaving (θ that disagrees, a ring it breaks) this often is dropped
LOAD_TIMEOUT = 600.0  # a node may have to import torch and build the model first
INTERRUPT_FETCH_S = 5.0  # Ctrl-C: how long one node may take to hand over θ for the last checkpoint
MAX_JOINING = 64  # connections not yet admitted (handshake, loading the task) at once; more are dropped
MAX_REJECTED = 100  # recent drop reasons kept in Coordinator.rejected (all are logged)


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
    gone: str = "connection closed"  # why its connection ended (for the log), once it has

    @property
    def id(self) -> str:
        return self.info.node_id


@dataclass
class Coordinator:
    recipe: Recipe
    run_dir: Path
    mode: NetworkMode = "local"
    commit: str | None = None
    monitor: Monitor | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    key: bytes | None = None  # Ed25519 seed (auth.NodeKey.seed): the coordinator's node id
    tree: str | None = None  # tree id of `commit`, when the coordinator's repo has it
    extra_allowed: tuple[str, ...] = ()  # ids admitted on top of the recipe's allowlist (--local nodes)
    resume: Checkpoint | None = None  # continue from this checkpoint (nodes fetch its θ from us)

    def __post_init__(self) -> None:
        r = self.recipe
        if r.allowlist is not None and self.extra_allowed:  # nodes check peers against the same list
            r.allowlist = sorted({*r.allowlist, *self.extra_allowed})
        allow = None if r.allowlist is None else frozenset(r.allowlist)
        self.admission = Admission(
            commit=self.commit,
            run_id=self.run_id,
            allowlist=allow,
            threshold=r.auth_threshold or r.min_nodes,
            tree=self.tree,
        )
        self._auth_abort: str | None = None  # why the whole swarm is cancelled (auth_threshold)
        self.endpoint: Endpoint | None = None
        self.ready: dict[str, Peer] = {}  # admitted and connected (members, joiners, evaluators)
        self._handshaking: dict[str, Channel] = {}  # connected, not yet admitted (they load the task)
        self.events: asyncio.Queue[tuple[Peer, P.Message | None]] = asyncio.Queue()
        self._joined = asyncio.Condition()
        self._started = False
        self._finished = False
        self._tasks: set[asyncio.Task] = set()
        self.results: list[RoundResult] = []
        self.initial_val_loss: float | None = None
        self.members: dict[str, Peer] = {}  # nodes in the run now
        self.speed: dict[str, float] = {}  # samples/s: calibrated at join, then measured
        self.last_seen: dict[str, float] = {}  # monotonic time of each node's last message
        self.ledger = Ledger()
        self.joining: list[Peer] = []  # admitted after the start: enter at the next round
        self.state_round: dict[str, int] = {}  # the round whose θ each node holds (-1: initial θ)
        self.checksums: dict[int, str] = {}  # the agreed checksum of θ after each round
        self.evaluating: set[str] = set()  # evaluators with an evaluation in flight
        self.ring_epoch = 0  # +1 per retried all-reduce (ring connections renew)
        # A resumed checkpoint's θ, to members; initial weights also to nodes in the handshake.
        self.state = StateServer(allowed=lambda peer: peer in self.ready or peer in self._handshaking)
        self.init: P.StateSource | None = None  # where nodes fetch θ₀ of recipe.init_weights (from us)
        self.last_checkpoint: int | None = None
        self.last_checkpoint_path: Path | None = None
        self.checkpoint_error = ""  # why the last checkpoint could not be fetched
        # Set by Ctrl-C. Cancelling run() is not enough: a cancel that lands inside an iroh call can
        # come back as an ordinary error (a failed state fetch, say) and the rounds would go on.
        self.stopping = False
        self.samples_seen = 0
        self.current: Round | None = None  # the round in progress (or the last one)
        self.live: list[Round] = []  # rounds not settled yet (two with the overlapped sync)
        self._saver: asyncio.Task | None = None  # the checkpoint being fetched and written, if any
        self.positions: dict[int, dict] = {}  # the data position after each settled round
        self.samples_at: dict[int, int] = {}  # samples trained after each settled round
        self.rejected: deque[str] = deque(maxlen=MAX_REJECTED)  # why recent connections were dropped (all logged)
        self._joining_conns = 0  # connections in the handshake, not yet admitted (MAX_JOINING)
        self.strikes: dict[str, int] = {}  # misbehaviours per node (Coordinator.strike)
        self.frozen = ""  # digest of the frozen base every node loaded (set at the start)

    # --- serving connections -------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and start accepting; returns the join ticket."""
        if (why := self.admission.unreachable()) is not None:  # e.g. fewer allowlisted nodes than needed
            raise CoordinatorError(why)
        if self.recipe.init_weights is not None and self.resume is None:
            try:
                layout, theta, velocity, digest = load_weights(Path(self.recipe.init_weights))
            except WeightsError as e:
                raise CoordinatorError(f"init_weights: {e}") from None
            self.state.publish(-1, theta, velocity, digest, layout)
        self.endpoint = await Endpoint.bind(self.mode, secret_key=self.key, alpns=(CONTROL_ALPN, STATE_ALPN))
        if (cur := self.state.current) is not None and cur.round == -1:
            self.init = P.StateSource(round=-1, checksum=cur.checksum, tickets=[self.endpoint.ticket()])
        self._spawn(self._accept_loop())
        self._spawn(self._ping())
        return self.endpoint.ticket()

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        """Serve drift/0 (nodes) and drift-state/0 (θ of a resumed checkpoint) until the endpoint
        closes. A connection that fails, whatever its bytes, ends in one connection_dropped line."""
        assert self.endpoint is not None
        await self.endpoint.serve(
            {CONTROL_ALPN: self._serve, STATE_ALPN: lambda conn: self.state.handle(conn, on_drop=self._dropped)},
            on_drop=self._dropped,
        )

    def _dropped(self, peer: str, why: str) -> None:
        """One line (and one connection_dropped event) per dropped connection; `why` as plain text."""
        peer = peer[:10] if len(peer) == 64 else P.printable(peer, 64)  # a node id, else an address
        why = P.printable(why, 300)
        log.warning("dropping connection from %s: %s", peer, why)
        self.rejected.append(why)
        if self.monitor:
            self.monitor.event("connection_dropped", peer=peer, reason=why)

    def _drop(self, ch: Channel | None, conn, why: str) -> None:
        self._dropped(peer_of(conn), why)
        try:
            (ch.close(why) if ch else conn.close(1, why.encode()[:100]))
        except Exception:
            pass

    async def _refuse(self, ch: Channel, conn, why: str, retry: bool = False) -> None:
        """Tell a node why it is refused (TrainingCancel), let it read that, then drop it."""
        try:
            await ch.send_frame(P.encode(P.TrainingCancel(reason=why, retry=retry)), timeout=5.0)
            await ch.finish()
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:  # ends when the node hangs up, having read it
                await ch.recv_frame(MAX_CONTROL_FRAME, timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            pass
        self._drop(ch, conn, why)

    async def _auth_failed(self, ch: Channel, conn, node_id: str, why: str, tell: bool = True) -> None:
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

    async def _serve(self, conn) -> None:
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
            if self._finished:  # (a --local node started just before a Ctrl-C need not wait to be killed)
                await self._refuse(ch, conn, "the run has ended")
                return
            if ch.peer_id in self.ready or ch.peer_id in self._handshaking:
                # One identity, one node. A node that rejoins before we noticed its old connection
                # died gets retry=True and comes back once that one is gone.
                await self._refuse(
                    ch,
                    conn,
                    f"a node with this id ({ch.peer_id[:10]}) is already in this swarm; "
                    "every node needs its own key: to run several nodes on one machine, start "
                    "each with its own --device (cuda:0, cuda:1, ...: each device gets its own "
                    "key) or its own --key FILE",
                    retry=True,
                )
                return
            self._handshaking[ch.peer_id] = ch
            info = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=HANDSHAKE_TIMEOUT))
            if not isinstance(info, P.NodeInfo):
                raise P.ProtocolError(f"expected NodeInfo first, got {info.type}")
            if info.node_id != ch.peer_id:
                raise P.ProtocolError("NodeInfo.node_id is not the id of the connecting endpoint")
            if str(parse_ticket(info.ring_ticket).id()) != ch.peer_id:  # neighbours dial it: it must be this node
                raise P.ProtocolError("NodeInfo.ring_ticket names another endpoint")
            peer = Peer(info, ch)
            await ch.send_frame(
                P.encode(
                    P.TrainConfig(
                        run_id=self.run_id,
                        recipe=self.recipe.model_dump(mode="json"),
                        commit=self.commit,
                        init=self.init,
                    )
                )
            )
            rc = await self._next_message(ch, LOAD_TIMEOUT)  # the node loads the task first: it heartbeats
            if isinstance(rc, P.TrainingCancel):  # the node refused the code it was asked to run
                await self._auth_failed(
                    ch, conn, peer.id, f"node {info.name} ({peer.id[:10]}) refused to run: {rc.reason}", tell=False
                )
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
                self.monitor.event(
                    "node_joined",
                    node_id=peer.id,
                    name=info.name,
                    device=info.device,
                    backend=info.backend,
                    commit=rc.commit,
                )
            self.last_seen[peer.id] = time.monotonic()
            async with self._joined:  # last: nothing below can fail once the round loop may count on it
                self._handshaking.pop(peer.id, None)
                self.ready[peer.id] = peer
                if self._started:  # a late joiner: it enters at the next round, fetching θ first
                    self.joining.append(peer)
                self._joined.notify_all()
        except Exception as e:
            if not self._finished:  # after the end, a node that read our last word just hangs up
                log.debug("handshake with %s failed", peer_of(conn)[:10], exc_info=True)
                self._drop(ch, conn, _why(e))
            return
        finally:
            self._joining_conns -= 1
            if ch is not None and self._handshaking.get(ch.peer_id) is ch:
                del self._handshaking[ch.peer_id]
        # From here on every frame of this node feeds the round loop. Liveness is stamped here, as
        # frames arrive, not when the round loop gets to them: a round that starts after a long
        # checkpoint must not take a backlog of heartbeats for silence.
        try:
            while True:
                msg = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=self.recipe.stale_after_s))
                self.last_seen[peer.id] = time.monotonic()
                self.events.put_nowait((peer, msg))
        except Exception as e:
            silent = isinstance(e, TransportTimeout)
            peer.gone = f"silent for {self.recipe.stale_after_s:g}s" if silent else f"connection closed ({_why(e)})"
            if not self._finished:
                self._drop(ch, conn, _why(e))
            if self.ready.get(peer.id) is peer:
                del self.ready[peer.id]
            self.events.put_nowait((peer, None))

    async def _next_message(self, ch: Channel, timeout: float) -> P.Message:
        """The next message that is not a Heartbeat, within `timeout` overall."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"timed out after {timeout:g}s waiting for the node to load the task")
            msg = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=min(left, self.recipe.stale_after_s)))
            if not isinstance(msg, P.Heartbeat):
                return msg

    async def _ping(self) -> None:
        """Every heartbeat_s, a Ping to every connected node: a node that hears nothing from us for
        stale_after_s knows the coordinator is gone (and tries to rejoin)."""
        while True:
            await asyncio.sleep(self.recipe.heartbeat_s)
            for p in list(self.ready.values()):
                try:
                    await p.ch.send_frame(P.encode(P.Ping()), timeout=self.recipe.heartbeat_s)
                except TransportError:
                    pass

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
        for what in ("param_checksum", "frozen_checksum", "n_train", "n_params"):
            seen = {getattr(p.commit, what) for p in peers}
            if len(seen) != 1:
                await self._broadcast(peers, P.TrainingCancel(reason=f"nodes loaded different tasks ({what})"))
                raise CoordinatorError(f"nodes loaded different tasks: {what} differs {sorted(map(str, seen))}")
        await self._broadcast(
            peers,
            P.TrainingReady(nodes=[p.id for p in peers], signatures=self.admission.signatures(p.id for p in peers)),
        )
        r = self.recipe
        self.checksums[-1] = peers[0].commit.param_checksum
        self.n_train, self.n_params = peers[0].commit.n_train, peers[0].commit.n_params
        self.frozen = peers[0].commit.frozen_checksum  # the base every node must share (not in θ)
        self._note(
            "training_started",
            nodes=len(peers),
            n_train=self.n_train,
            unit_samples=r.unit_samples,
            checksum=self.checksums[-1],
            n_params=self.n_params,
        )
        for p in peers:
            self._enter(p, -1)
        queue = UnitQueue(self.n_train, r.unit_samples)
        first = 0
        if self.resume is not None:
            first = self._load_resume(queue)
        self.queue = queue
        try:
            await self._rounds(first, queue)
        except RoundError as e:
            await self._last_word(list(self.ready.values()), P.TrainingCancel(reason=str(e)))
            raise CoordinatorError(str(e)) from None
        if self.stopping:
            return self.results
        await self._wait_checkpoint()
        await self._finish_evaluations(timeout=max(30.0, 3 * r.stale_after_s))
        final = self.results[-1].val_loss if self.results else None
        self._finished = True
        await self._last_word(list(self.ready.values()), P.TrainComplete(rounds=r.rounds, final_val_loss=final))
        if self.monitor:
            self.monitor.event("complete", rounds=r.rounds, final_val_loss=final, **queue.position())
        return self.results

    async def _rounds(self, first: int, queue: UnitQueue) -> None:
        """Every round. Blocking sync: one at a time. Overlapped: round r+1 starts as soon as the
        ring of round r is out, and r is settled while r+1 trains (its ring waits for that)."""
        r = self.recipe
        overlapped = r.sync == "overlapped"
        prev: Round | None = None
        for rnd in range(first, r.rounds):
            if self.stopping:
                return
            if self.monitor:
                self.monitor.round, self.monitor.rounds = rnd + 1, r.rounds
            await self._admit_late_joiners(rnd)
            if not self.members:
                raise CoordinatorError(f"every node has left (round {rnd})")
            cur = self.current = Round(self, rnd, queue, prev)
            self.live = [x for x in (prev, cur) if x is not None]
            await cur.start()
            while True:
                if await self._step(prev, cur):
                    break
                if prev is not None and prev.settled:
                    prev = None
                if overlapped and cur.ring is not None and rnd < r.rounds - 1:
                    break
            if cur.settled:
                prev = None
            else:  # overlapped: it settles during the next round
                prev = cur
        while prev is not None and not self.stopping:  # the last round of an overlapped run
            self.live = [prev]
            if await self._step(prev, None):
                return

    async def _step(self, prev: Round | None, cur: Round | None) -> bool:
        """Handle one event (or half a second of none), run the clocks; True once `cur` (or, with
        no cur, prev) settled. A round that settles is recorded and checkpointed as due."""
        try:
            peer, msg = await asyncio.wait_for(self.events.get(), 0.5)
        except asyncio.TimeoutError:
            peer, msg = None, None
        if self.stopping:
            # Ctrl-C: interrupt() owns the rounds and the events now. This task was cancelled, but
            # before Python 3.12 wait_for returns an event that arrived with the cancel instead of
            # raising it; settling a round here would race interrupt()'s choice of checkpoint.
            if peer is not None:
                self.events.put_nowait((peer, msg))
            raise asyncio.CancelledError
        if peer is not None and peer.id in self.members:  # else: a node already dropped
            if msg is None:
                self.drop(peer.id, peer.gone, (cur or prev).rnd)
            elif isinstance(msg, P.Heartbeat):
                if msg.held is not None and msg.held in self.checksums:
                    self.state_round[peer.id] = msg.held
            else:
                rnd = getattr(msg, "round", None)
                target = (
                    prev
                    if prev is not None
                    and rnd == prev.rnd
                    and isinstance(msg, (P.RoundDone, P.RingFailed, P.BarrierSync))
                    else (cur or prev)
                )
                await target.on_message(peer, msg)
        now = time.monotonic()
        self._check_silence(now, (cur or prev).rnd)
        for rd in (prev, cur):
            if rd is None or rd.settled:
                continue
            if await rd.tick(now, may_reduce=rd is prev or prev is None or prev.settled):
                await self._settle(rd)
        return (cur or prev).settled

    async def _settle(self, rd: Round, checkpoint: bool = True) -> None:
        self._record(await rd.finish())
        rd.settled = True
        # The data position of θ after this round: a next round may have taken units already.
        nxt = self.current if self.current is not None and self.current.rnd > rd.rnd else None
        self.positions[rd.rnd] = (
            self.queue.position() if nxt is None else UnitQueue.with_pending(nxt.queue_before, rd.given_back)
        )
        r = self.recipe
        if checkpoint and not self.stopping and ((rd.rnd + 1) % r.checkpoint_every == 0 or rd.rnd == r.rounds - 1):
            self._start_checkpoint(rd.rnd)

    def _check_silence(self, now: float, rnd: int) -> None:
        """Drop every node silent for stale_after_s (its connection may look open: a sleeping
        laptop does not say goodbye)."""
        for i in list(self.members):
            silent = now - self.last_seen.get(i, now)
            if silent > self.recipe.stale_after_s:
                self.drop(i, f"silent for {silent:.0f}s", rnd)

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
        theta, velocity = ck.theta_flat, ck.velocity_flat  # mapped from the files, not read
        if (got := checksum(theta, velocity)) != ck.manifest.get("checksum"):
            raise CoordinatorError(f"{ck.path}: θ and outer state do not match the checksum in its manifest")
        if theta.size != self.n_params:
            raise CoordinatorError(f"{ck.path}: θ has {theta.size} values, the nodes' model {self.n_params}")
        if ck.manifest.get("frozen_base", "") != self.frozen:
            raise CoordinatorError(f"{ck.path}: checkpoint needs another frozen base than the nodes loaded")
        layout = ParamLayout(ck.names, ck.shapes, int(ck.manifest.get("buffers", 0)))
        self.state.publish(ck.round, theta, velocity, got, layout)
        self.checksums[ck.round] = got
        queue.restore(ck.manifest["queue"])
        self.samples_seen = self.samples_at[ck.round] = ck.manifest.get("samples_seen", 0)
        self.positions[ck.round] = ck.manifest["queue"]
        self.last_checkpoint, self.last_checkpoint_path = ck.round, ck.path
        self._note("resumed", round=ck.round, path=str(ck.path), samples_seen=self.samples_seen)
        return ck.round + 1

    def _start_checkpoint(self, rnd: int) -> None:
        """Write the checkpoint of round `rnd` in the background: the rounds go on meanwhile (the
        nodes keep serving that θ until their next outer step, which waits for the transfer)."""
        if self._saver is not None and not self._saver.done():
            log.warning("the checkpoint of an earlier round is still being written: none for round %d", rnd)
            return
        meta = {
            "checksum": self.checksums[rnd],
            "samples_seen": self.samples_at[rnd],
            "commit": self.commit,
            "recipe_hash": recipe_hash(self._model_fields()),
            "frozen_base": self.frozen,  # the digest of the frozen parameters this θ needs ("" none)
            **self._model_fields(),  # what builds the model again (drift sample)
            "run_id": self.run_id,
            "queue": self.positions[rnd],
        }
        self._saver = asyncio.ensure_future(self.checkpoint(rnd, meta))

    async def _wait_checkpoint(self) -> None:
        if self._saver is not None:
            await asyncio.wait({self._saver})

    async def checkpoint(self, rnd: int, meta: dict, timeout: float = 120.0) -> Path | None:
        """Stream θ and the outer state after round `rnd` from a node straight into a checkpoint
        (checksum-verified before it is committed; never all in memory). None (and
        `checkpoint_error` says why) when no node could hand it over."""
        if self.last_checkpoint == rnd:
            return self.last_checkpoint_path
        if rnd not in self.checksums or self.endpoint is None:
            return None
        donors = [p.info.ring_ticket for i, p in self.ready.items() if self.state_round.get(i) == rnd]
        if self.state.current is not None and self.state.current.round == rnd:
            donors.append(self.endpoint.ticket())  # a resumed checkpoint we serve ourselves
        writers: list[CheckpointWriter] = []

        def sink(layout: ParamLayout):
            for w in writers:
                w.abort()
            writers.append(CheckpointWriter(self.run_dir / "checkpoints", rnd, layout.names, layout.shapes))
            meta["buffers"] = layout.n_buffers
            return writers[-1].write

        try:
            if not donors:
                raise StateError("no connected node holds it")
            await fetch_state(
                self.endpoint, donors, rnd, self.checksums[rnd], sink, size=self.n_params, timeout=timeout
            )
            writer = writers[-1]
            # Shielded: a cancelled run (Ctrl-C) cannot stop the thread, so the commit stays
            # awaitable and interrupt() waits for it instead of racing a second writer.
            path = await asyncio.shield(
                asyncio.get_running_loop().run_in_executor(
                    None, lambda: writer.commit(meta, keep=self.recipe.keep_checkpoints)
                )
            )
        except (StateError, OSError, ValueError) as e:
            for w in writers:
                w.abort()
            self.checkpoint_error = str(e)
            log.warning("no checkpoint for round %d: %s", rnd, e)
            return None
        self.last_checkpoint, self.last_checkpoint_path = rnd, path
        self._note("checkpoint", round=rnd, path=str(path))
        return path

    async def interrupt(self, reason: str) -> str:
        """A clean stop (Ctrl-C): keep the newest finished round we can get, tell every node why.
        Returns one line saying what --resume will continue from."""
        self.stopping = True
        await self._wait_checkpoint()  # a save in flight ends first
        await self._finish_reduce()
        newest = max((r for r in self.checksums if r >= 0), default=None)
        path = None
        if newest is not None:
            self._start_checkpoint(newest)
            try:  # bounded: the nodes may have died with us (a terminal's Ctrl-C reaches them too)
                path = await asyncio.wait_for(asyncio.shield(self._saver), 2 * INTERRUPT_FETCH_S)
            except asyncio.TimeoutError:
                self.checkpoint_error = f"timed out after {2 * INTERRUPT_FETCH_S:g}s"
        self._finished = True
        await self._last_word(list(self.ready.values()), P.TrainingCancel(reason=reason), timeout=5.0)
        if newest is None:
            return "no round had finished, so there is no checkpoint"
        if path is not None:
            return f"checkpoint of round {newest}: {path}"
        why = f"could not fetch θ of round {newest} ({self.checkpoint_error})"
        if self.last_checkpoint is None:
            return f"{why}, and no checkpoint was written before"
        lost = newest - self.last_checkpoint
        return (
            f"{why}; --resume continues from round {self.last_checkpoint} ({self.last_checkpoint_path}), "
            f"{lost} round(s) earlier"
        )

    async def _finish_reduce(self) -> None:
        """Ctrl-C during an all-reduce: the nodes may already hold the next θ (and serve only
        that one). Take the RoundDone reports that arrive within a moment; if every ring member
        agrees, the round counts and its θ can be checkpointed."""
        for cur in [rd for rd in self.live if rd.ring is not None and not rd.settled]:
            deadline = time.monotonic() + INTERRUPT_FETCH_S
            while not cur.agreed() and time.monotonic() < deadline:
                try:
                    peer, msg = await asyncio.wait_for(self.events.get(), deadline - time.monotonic())
                except asyncio.TimeoutError:
                    break
                if peer.id in self.members and isinstance(msg, P.RoundDone) and msg.round == cur.rnd:
                    await cur.on_message(peer, msg)
            if cur.agreed():
                await self._settle(cur, checkpoint=False)

    def _record(self, result: RoundResult) -> None:
        self.results.append(result)
        self.samples_seen += result.samples
        self.samples_at[result.round] = self.samples_seen

    async def _last_word(self, peers: list[Peer], msg: P._Msg, timeout: float = 10.0) -> None:
        """Send a final message, then wait (briefly) for each node to hang up: closing at once
        could discard the message while it is still in flight. Nodes still loading the task get
        it too (a node that joins as the run ends learns that it ended)."""
        self._finished = True
        loading = list(self._handshaking.values())
        await asyncio.gather(
            *(self._send(p, msg) for p in peers),
            *(ch.send_frame(P.encode(msg), timeout=5.0) for ch in loading),
            return_exceptions=True,
        )
        left: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(left) < len(peers) and time.monotonic() < deadline:
            try:
                peer, m = await asyncio.wait_for(self.events.get(), max(0.05, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
            if m is None:
                left.add(peer.id)
        while any(ch in self._handshaking.values() for ch in loading) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

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
            elif isinstance(msg, P.AskForMoreWork) and peer.id in self.evaluating:
                # its job named a θ no donor holds any more: the final one, then
                last = self.results[-1].round if self.results else 0
                await self._assign_evaluation(peer, last, self.queue.epoch)
        if self.evaluating:
            log.warning("ending without %d evaluation(s) still running", len(self.evaluating))

    def _on_eval(self, i: str, msg: P.EvalResult) -> bool:
        """Record an evaluator's result; False if it is not the answer to a job we gave."""
        if i not in self.evaluating or msg.after_round not in self.checksums:
            return False  # not a job we gave (or for a θ that never was): counts for nothing
        self.evaluating.discard(i)
        if i in self.members:
            self._measured_speed(i, msg.samples_per_s)
        if msg.after_round < 0:
            self.initial_val_loss = msg.val_loss
            self._note("initial", val_loss=msg.val_loss, val_samples=msg.val_samples, metrics=msg.metrics)
        else:
            self._note(
                "val",
                after_round=msg.after_round,
                val_loss=msg.val_loss,
                val_samples=msg.val_samples,
                metrics=msg.metrics,
            )
        return True

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
            if (p.commit.param_checksum, p.commit.frozen_checksum, p.commit.n_train, p.commit.n_params) != (
                self.checksums[-1],
                self.frozen,
                self.n_train,
                self.n_params,
            ):
                why = "this node loaded a different task (initial θ or dataset differs)"
                await self._send(p, P.TrainingCancel(reason=why))
                self._note("node_refused", node_id=p.id, reason=why)
                continue
            self._enter(p, -1)
            self._note("node_entered", node_id=p.id, name=p.info.name, round=rnd)
        if joining:
            # Everyone learns the new membership, with every member's signed RepoCommit: the nodes
            # already training check the newcomers themselves before any ring or state connection.
            ids = list(self.members)
            await self._broadcast(
                list(self.members.values()), P.TrainingReady(nodes=ids, signatures=self.admission.signatures(ids))
            )

    def _state_source(self, node: str, force: bool = False) -> P.StateSource | None:
        """Where `node` gets the swarm's newest agreed θ, or None when it already holds it."""
        last = max(self.checksums)
        if self.state_round.get(node) == last and not force:
            return None
        donors = sorted(
            (i for i in self.members if self.state_round.get(i) == last and i != node), key=lambda i: -self.speed[i]
        )
        tickets = [self.members[i].info.ring_ticket for i in donors]
        if self.state.current is not None and self.state.current.round == last:
            tickets.append(self.endpoint.ticket())  # a resumed checkpoint, served by us
        return P.StateSource(round=last, checksum=self.checksums[last], tickets=tickets[: P.MAX_NODES])

    # --- one round -----------------------------------------------------------------------------

    def _checked_speed(self, peer: Peer, sps: float | None) -> float:
        """A node's claimed speed, unless it is absurd (then: the slowest speed we trust)."""
        if finite_positive(sps):
            return float(sps)
        trusted = [v for k, v in self.speed.items() if k != peer.id]
        fallback = min(trusted) if trusted else 1.0
        log.warning(
            "node %s reported an absurd speed (%r); planning with %.3g samples/s until measured",
            peer.info.name,
            sps,
            fallback,
        )
        self._note("absurd_speed", node_id=peer.id, name=peer.info.name, reported=str(sps), used=fallback)
        return fallback

    def _measured_speed(self, i: str, sps: float | None) -> None:
        """A node's speed as measured on a finished unit (or an evaluation), averaged in: one unit
        of a fast device is a few milliseconds, and one hiccup must not make it look 20x slower.
        A node that really became far slower is caught by its deadline instead (Round), which
        sets its speed from the wait it caused."""
        if finite_positive(sps):
            self.speed[i] = 0.5 * self.speed[i] + 0.5 * sps

    def drop(self, i: str, why: str, rnd: int) -> None:
        """Remove a node from the swarm; every live round redoes its work (and its ring)."""
        if i not in self.members:
            return
        for rd in self.live:
            rd.forget(i, self.members[i].info.name)
        peer = self.members.pop(i)
        log.warning("node %s (%s) dropped: %s", peer.info.name, i[:10], why)
        self._note("node_left", node_id=i, name=peer.info.name, reason=why, round=rnd)
        self.evaluating.discard(i)
        peer.ch.close(why)
        if self.monitor:
            self.monitor.nodes.pop(i, None)

    def strike(self, i: str) -> bool:
        """Count one misbehaviour of node i (θ that disagrees, a ring it keeps breaking); True once
        it has had MAX_STRIKES and should be dropped."""
        self.strikes[i] = self.strikes.get(i, 0) + 1
        return self.strikes[i] >= MAX_STRIKES

    def _note(self, kind: str, **fields) -> None:
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
            if (
                speeds[i] < r.slow_node_fraction * speeds[fastest]
                and r.batch_size / speeds[i] > r.slow_node_fraction * round_s
            ):
                evaluators.add(i)
        return evaluators

    async def _assign_evaluation(self, peer: Peer, rnd: int, epoch: int) -> None:
        """Send an evaluator its next job: the val loss of the newest agreed θ."""
        self.evaluating.add(peer.id)
        await self._send(
            peer,
            P.ShardAssignment(round=rnd, epoch=epoch, units=[], role="evaluate", state=self._state_source(peer.id)),
        )

    async def _send(self, peer: Peer, msg: P._Msg) -> None:
        try:
            await peer.ch.send_frame(P.encode(msg))
        except TransportError as e:
            log.warning("could not send %s to %s: %s", msg.type, peer.info.name, e)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for p in self.ready.values():
            await p.ch.finish()
        if self.endpoint:
            await self.endpoint.close()
