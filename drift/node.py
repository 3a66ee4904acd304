"""`drift join`: one node of the swarm.

The node connects to the coordinator (ALPN ``drift/0``), loads the task from its repo, and then
follows the coordinator round by round: train the units it is given (asking for more when it
runs out), stop at the barrier, sync its pseudo-gradient as the sync rule says (drift/sync/: an
all-reduce with its ring neighbours, ALPN ``drift-ring/0``, or an all-gather of payloads,
``drift-gather/0``), apply the outer step and report the checksum of the new state.

With `overlap` on, the node trains the next round while that sync runs; the outer step lands
during it, and the node's local copy catches up between two inner steps.

A node that loses its swarm (the laptop slept, the network dropped, the coordinator dropped it
as silent) comes back by itself: it connects again with the same identity, is verified again,
fetches θ from a peer and trains from the next round. One `Session` is one connection to the
coordinator; the `Node` keeps the model, the endpoint and the ring across sessions.

The coordinator's messages go through one router, `Session._read_control`: a `match` that says
which phase each message type feeds. Each phase then handles its own in one `match`: the round
loop in `Session._run` (its skips and ends in `Session.expect`), the sync in `Session._sync_loop`,
and the inner loop of a round in `inner.InnerLoop._apply`.

The node runs in a thread of its own (drift/loop.py); the model is trained by the loop thread
(a user's script with drift.DiLoCo, or `drift join`'s loop over a task's worker), and every call
the node makes on the worker runs there, between two inner steps (inner.Steps, inner.OnLoop).

Memory: besides the framework's own model and optimizer, a node holds θ_global, the outer
optimizer's velocity and one all-reduce buffer (three copies of θ; two without outer momentum,
whose velocity stays untouched zeros), plus the local snapshot with `overlap`; with sync: sparse
its error-feedback buffer and the next one instead of the velocity. Nothing else is a copy of θ:
transfers stream from and into these, θ's layout comes from shapes, and what moving θ in and out
of the worker frees goes back to the OS (workers.trim_heap) instead of staying in the C heap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from drift import protocol as P
from drift import rules
from drift.auth import AuthError, NodeKey, PeerCheck, drift_home, sign_message, verify_peers
from drift.base import BaseCache, BaseError, take
from drift.data import DataClient, DataError, DataServer, served_task
from drift.diloco import DeltaCheck, ParamLayout, checksum
from drift.gather import Gather
from drift.inner import (
    Calibration,
    InnerLoop,
    ModelLock,
    OnLoop,
    Steps,
    StopTraining,
    SwarmClosed,
    calibrate,
    mean_loss,
    merged,
)
from drift.peers import Peers
from drift.progress import Progress
from drift.recipe import Data, Recipe
from drift.repo import RepoError
from drift.ring import ReduceStats, Ring, RingError
from drift.state import StateError, StateServer, fetch_state, into_arrays, lied_to
from drift.sync import Combined, SyncRule, catch_up, collective, make_rule
from drift.transport import (
    CONTROL_ALPN,
    DATA_ALPN,
    GATHER_ALPN,
    MAX_CONTROL_FRAME,
    REFUSED,
    RING_ALPN,
    STATE_ALPN,
    Channel,
    Endpoint,
    Throttle,
    TransportError,
    TransportTimeout,
    close_conn,
    mode_for_ticket,
    parse_ticket,
    run_finished,
    ticket_run,
    within,
)
from drift.workers import BackendError, Choice, TaskError, trim_heap

log = logging.getLogger("drift.node")


HANDSHAKE_TIMEOUT = 60.0  # TrainConfig after NodeInfo; the coordinator's silence before a recipe names one
REJOIN_PATIENCE_S = 600.0  # how long a node that lost its swarm keeps trying to come back
REJOIN_BACKOFF_S = (1.0, 30.0)
JOIN_TRIES = 3  # handshakes a new node tries when the coordinator, reached, hangs up without a word


def join_again(reasons: list[str], reached: bool, waited_s: float) -> bool:
    """Whether a node that never got in tries its handshake again, after failed ones (`reasons`,
    the latest last) over `waited_s` seconds. A coordinator whose joining slots are full says so
    (P.JOIN_BUSY, as many nodes of one machine or network start at once), or refuses the
    connection itself while its QUIC handshakes are (transport.REFUSED): again until
    REJOIN_PATIENCE_S. One that was reached but hung up without a word (a refusal always comes
    with TrainingCancel) met a transient fault, such as a frame garbled on the way: JOIN_TRIES
    such hang-ups in all (a busy coordinator's answers do not count: 1,000 nodes that started at
    once met it busy twice, then once with no word, and one gave up). One never reached is a
    mistake to report now."""

    def busy(reason: str) -> bool:
        return P.JOIN_BUSY in reason or REFUSED in reason

    if busy(reasons[-1]):
        return waited_s < REJOIN_PATIENCE_S
    return reached and sum(not busy(r) for r in reasons) < JOIN_TRIES


class NodeError(Exception):
    """The node cannot go on; str() is the one line shown to the operator."""


class Lost(Exception):
    """The connection to the coordinator is gone (closed, or silent too long): try to rejoin."""


class TaskSource(Protocol):
    """Where a node's model comes from, checked against the commit the coordinator names:
    drift.loop.RepoSource (`drift join --repo`: a task file from a clean checkout) or
    drift.loop.ScriptSource (a user's own loop: its script's repo must be clean at that commit)."""

    name: str  # the repo, as RepoCommit names it

    def open(self) -> None:
        """Check what can be checked before connecting; RepoError if unusable."""

    def choice(self) -> Choice:
        """The backend and device this node trains on; BackendError if none fits."""

    async def load(self, cfg: P.TrainConfig, recipe: Recipe, data=None) -> tuple[object, str | None]:
        """(the worker at θ0, the commit's tree id); RepoError, BackendError, TaskError or
        ImportError (one line each) when this node cannot train cfg.commit's task. `data` (served
        data): wraps the loaded task module so its dataset comes from a data holder."""


@dataclass
class NodeOptions:
    ticket: str
    source: TaskSource
    steps: Steps  # the thread that trains (drift.loop.NodeThread serves it)
    key: NodeKey  # this node's identity
    name: str = field(default_factory=socket.gethostname)
    say: Callable[[str], None] = print  # one line for the operator (run complete, rejoining, ...)
    connect_timeout: float = 15.0  # each try to reach the coordinator
    live: bool = False  # round lines as a live line that redraws (a terminal), not one line each


@dataclass
class Pending:
    """A round this node synced at the barrier (or must catch up on) whose θ_global it does not
    hold yet. It is settled when the node applied the outer step itself, or when the coordinator
    said what θ became (Agreed)."""

    round: int
    report_val: bool = False
    steps: int = 0  # the inner steps in our Δ of the round, if it is one to send (a late node may keep it: Agreed.keep)
    applied: bool = False  # our own all-reduce succeeded: θ_global is (provisionally) the round's
    superseded: bool = False  # ... but the coordinator redid it without us: wait for Agreed
    announced: Announced | None = None  # a ring of two: the step waits for the coordinator's Commit
    settled: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Ready:
    """A BarrierReady and its ring spelled out (the order it names, or the last one it named)."""

    msg: P.BarrierReady
    ring: list[P.RingMember]


@dataclass
class Announced:
    """An all-reduce whose outer step this node announced (BarrierReady.confirm) but has not
    applied: what the step needs once the coordinator commits it."""

    ready: Ready
    stats: ReduceStats
    combined: Combined
    checksum: str  # the θ it announced
    check_s: float  # what the checks took (the preview among them)


@dataclass
class Trainer:
    """What a node keeps across sessions: the task's worker and the swarm's state as it knows it."""

    worker: object
    recipe: Recipe
    run_id: str
    commit: str
    tree: str | None
    layout: ParamLayout
    rule: SyncRule
    theta: np.ndarray  # θ_global: parameters, then buffers (flat float32)
    delta: np.ndarray  # the all-reduce buffer: Δ, then the reduced sum
    snap: np.ndarray | None  # overlap: the local copy at the barrier (then: what to add)
    calibration: Calibration
    initial_checksum: str  # of θ0: the coordinator checks every node built the same model
    frozen_checksum: str = ""  # of the frozen base (not in θ), checked once at join
    held: int = -1  # the round whose state θ_global is
    held_checksum: str = ""
    lock: ModelLock = field(default_factory=ModelLock)  # the worker's model, between inner steps
    inner: InnerLoop | None = None
    pending: Pending | None = None
    delta_check: DeltaCheck = field(default_factory=DeltaCheck)
    kept_steps: int = 0  # the local copy holds this many steps of a round that went on without us (Agreed.keep)
    barrier_s: float | None = None  # the last round's time from its last step to its BarrierSync (Δ worked out)

    # --- moving state between the worker and the flat vectors ----------------------------------

    def read_local(self, out: np.ndarray) -> None:
        """out <- the worker's parameters and buffers, one tensor at a time."""
        for (name, sl, _), (got, a) in zip(self.layout.slices(), self.worker.iter_state()):
            if got != name:
                raise RuntimeError(f"the worker lists {got} where the layout has {name}")
            out[sl] = a.reshape(-1)

    def pseudo_gradient(self, local: np.ndarray | None = None) -> None:
        """delta <- θ_global - θ_local (from `local` if given, else from the worker)."""
        if local is None:
            self.read_local(self.delta)
        else:
            self.delta[...] = local
        np.subtract(self.theta, self.delta, out=self.delta)

    def keep_late(self, keep: float, steps: int) -> None:
        """A round went on without this node (Agreed.keep): the local copy, just set to θ_global,
        takes back `keep` of the node's own Δ of that round (local = θ_global − keep·Δ), so the
        next Δ holds it and its `steps` beside the new ones."""
        self.worker.add_to_state(self.layout.unflatten(self.delta * -keep))
        self.kept_steps = steps

    def load_worker(self) -> None:
        """The worker's model <- θ_global (views: no copy on this side)."""
        params, buffers = self.layout.split(self.layout.unflatten(self.theta))
        self.worker.set_params(params)
        if buffers:
            self.worker.set_buffers(buffers)

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        """The swarm's state as this node holds it: θ_global, then the rule's shared state arrays."""
        return (self.theta, *self.rule.state.values())

    def holds(self, src: P.StateSource) -> bool:
        """Whether θ_global is already the state `src` names (its round and checksum)."""
        return (self.held, self.held_checksum) == (src.round, src.checksum)

    def publish(self, server: StateServer, rnd: int, known: str = "") -> None:
        """Serve the state of round rnd; `known`: its checksum, when computed already (a preview)."""
        self.held, self.held_checksum = rnd, known or checksum(*self.arrays)
        server.publish(rnd, self.arrays, self.held_checksum, self.layout)


class Node:
    def __init__(self, opts: NodeOptions):
        self.opts = opts
        self.endpoint: Endpoint | None = None
        self.ring: Ring | None = None
        # The members (TrainingReady), the only peers this node talks to, each once it verified the
        # peer's own signed RepoCommit on that connection (drift/peers.py); and the coordinator's id.
        self.peers = Peers()
        self.tickets: dict[str, str] = {}  # member -> its ticket, as the coordinator told (P.Tickets)
        self.state = StateServer(allowed=lambda peer: peer in self.peers.members or peer == self.peers.coordinator)
        self.trainer: Trainer | None = None
        self.session: Session | None = None  # the connection in hand (drift.DiLoCo's log sends on it)
        self.data: DataClient | None = None  # recipe data: the samples come from a holder
        self.data_server: DataServer | None = None  # ... or this node holds a copy and serves it too
        self.admitted = False  # this node trained in the swarm (so a refusal may be transient)

    async def run(self) -> int:
        opts = self.opts
        mode = mode_for_ticket(opts.ticket)
        try:
            opts.source.open()  # fetched once TrainConfig names the commit
        except RepoError as e:
            raise NodeError(str(e)) from None
        self.key = opts.key
        self.peers.coordinator = str(parse_ticket(opts.ticket).id())
        self.endpoint = await Endpoint.bind(mode, secret_key=self.key.seed)
        self.endpoint.vet = self.peers.present  # every connection this node opens to a peer
        member = lambda peer: peer in self.peers.members  # noqa: E731
        self.ring = Ring(self.endpoint, trusted=member, ticket_of=self.tickets.get)
        self.gather = Gather(self.endpoint, trusted=member, ticket_of=self.tickets.get)
        accept = asyncio.ensure_future(self._accept())
        try:
            return await self._sessions()
        finally:
            accept.cancel()
            self.ring.close()
            await self.endpoint.close()
            if self.data is not None:
                self.data.close()
            if self.data_server is not None:
                self.data_server.close()
            if self.trainer is not None:
                with contextlib.suppress(SwarmClosed):
                    self.trainer.worker.close()

    async def _sessions(self) -> int:
        """Sessions until the run completes; after a loss, reconnect with backoff."""
        lost_since: float | None = None
        first_try: float | None = None
        delay = join_delay = REJOIN_BACKOFF_S[0]
        failed: list[str] = []  # why each handshake so far failed
        while True:
            session = self.session = Session(self)
            try:
                return await session.run()
            except Lost as e:
                if not self.admitted:
                    failed.append(str(e))
                    first_try = first_try or time.monotonic()
                    if not join_again(failed, session.reached, time.monotonic() - first_try):
                        raise NodeError(str(e)) from None
                    wait = join_delay * random.uniform(0.5, 1.5)  # (nodes that started together spread out)
                    self.opts.say(f"the coordinator hung up during the handshake ({e}); trying again in {wait:.1f}s")
                    await asyncio.sleep(wait)
                    join_delay = min(2 * join_delay, REJOIN_BACKOFF_S[1])
                    continue
                now = time.monotonic()
                lost_since = lost_since or now
                if now - lost_since > REJOIN_PATIENCE_S:
                    raise NodeError(
                        f"could not rejoin the swarm for {REJOIN_PATIENCE_S:.0f}s (last: {e}); the run may have ended"
                    ) from None
                self.opts.say(f"lost the swarm ({e}); rejoining in {delay:.0f}s")
                await asyncio.sleep(delay)
                delay = min(2 * delay, REJOIN_BACKOFF_S[1])
            else:
                lost_since, delay = None, REJOIN_BACKOFF_S[0]

    async def _accept(self) -> None:
        """Serve drift-ring/0 (neighbours), drift-gather/0 (payloads), drift-state/1 (θ for peers)
        and drift-data/0 (samples), each to members that present a RepoCommit this node verifies
        (Peers.gate); a connection that fails, whatever its bytes, is closed with one log line."""
        refusals = Throttle(lambda peer, why: log.warning("refusing %s: %s", peer[:10], why))  # strangers
        gate = self.peers.gate
        await self.endpoint.serve(
            {
                RING_ALPN: gate(self.ring.handle_incoming, refusals),
                GATHER_ALPN: gate(self.gather.handle_incoming, refusals),
                STATE_ALPN: gate(lambda conn: self.state.handle(conn, on_stranger=refusals), refusals),
                DATA_ALPN: gate(lambda conn: self._serve_data(conn, refusals), refusals),
            }
        )

    async def _serve_data(self, conn, strangers: Throttle) -> None:
        """drift-data/0: the samples of this node's own copy, once it matched the manifest."""
        if self.data_server is None:
            close_conn(conn, "this node serves no data")
            return
        await self.data_server.handle(conn, on_stranger=strangers)

    def _hold_data(self) -> None:
        """Our copy of the data matched the holder's manifest: serve it to members, as they may."""
        if self.data is not None and self.data.local is not None and self.data_server is None:
            self.data_server = DataServer(
                self.data.local, self.data.manifest, allowed=lambda peer: peer in self.peers.members
            )


class Session:
    """One connection to the coordinator: handshake, verification, then rounds until it ends.
    `_read_control` routes its messages: to `inbox` (the round loop, and the inner loop while a
    round trains) or `sync_q` (the sync loop)."""

    def __init__(self, node: Node):
        self.node = node
        self.opts = node.opts
        self.inbox: asyncio.Queue[P.Message | None] = asyncio.Queue()  # the round loop's messages
        self.sync_q: asyncio.Queue[P.Message | Ready | None] = asyncio.Queue()  # Ready, Agreed, Commit (and the end)
        self.ring_order: list[str] | None = None  # the ring's order as the last BarrierReady that named it
        self._held_told: int | None = None  # the θ round our last Heartbeat said we hold
        self.ctl: Channel | None = None
        self.reached = False  # the coordinator's endpoint answered (QUIC handshake done)
        self.silence_s = HANDSHAKE_TIMEOUT  # the coordinator pings; this much silence means it is gone
        self.members = 0  # how many members the coordinator last told us the swarm has
        self._slower = asyncio.Event()  # our beats may come more seldom now: beat once at once
        self.round = -1
        self._stash: deque[P.Message | None] = deque()  # messages read early, handled next
        self._tasks: list[asyncio.Task] = []
        self.lost_reason = "coordinator closed the connection"
        self.ended = asyncio.Event()  # the connection, the run or the sync ended: stop waiting for rounds
        self.failure: Exception | None = None  # an error of the sync, raised in the round loop
        self._early_agreed: dict[int, P.Agreed] = {}  # Agreed for a round this node has not synced yet
        # A membership message -> its check, made on arrival
        self._checked: dict[int, tuple[P.TrainingReady | P.MembersChanged, str | None]] = {}
        self.progress = Progress(self.opts.say, self.opts.live)

    # --- plumbing ------------------------------------------------------------------------------

    async def send(self, msg: P._Msg) -> None:
        try:
            await self.ctl.send_frame(P.encode(msg))
        except TransportError as e:
            why = self.ctl.close_reason()
            raise Lost(
                f"cannot reach the coordinator: {e}" + (f" ({why})" if why and why not in str(e) else "")
            ) from None

    async def _read_control(self) -> None:
        """The router: coordinator frames -> the round loop's inbox, or the sync's queue; the end
        of the connection (or its silence, or TrainComplete/TrainingCancel) goes to both."""
        try:
            while True:
                frame = await self.ctl.recv_frame(MAX_CONTROL_FRAME, timeout=self.silence_s)
                match msg := P.decode(frame):
                    case P.Ping():
                        pass
                    case P.DataHolders():
                        if self.node.data is not None:
                            self.node.data.set_holders(msg.tickets)
                    case P.Tickets():  # (before the BarrierReady that names these members by id)
                        self.node.tickets.update(msg.tickets)
                    case P.BarrierReady():  # the sync's
                        self.sync_q.put_nowait(Ready(msg, msg.members(self.ring_order)))
                        self.ring_order = msg.order or self.ring_order
                    case P.Agreed() | P.Commit():  # the sync's
                        self.sync_q.put_nowait(msg)
                    case P.TrainComplete() | P.TrainingCancel():  # the end: the sync's and the round loop's
                        self.sync_q.put_nowait(msg)
                        self.ended.set()
                        self.inbox.put_nowait(msg)
                    case P.TrainingReady() | P.MembersChanged():
                        # Membership changes are taken here, as they arrive, not when the main loop
                        # gets to them: a newcomer may ask us for θ a moment later.
                        self._checked[id(msg)] = (msg, self._check_members(msg))
                        self.inbox.put_nowait(msg)
                    case _:  # the round loop's and, while a round trains, the inner loop's
                        self.inbox.put_nowait(msg)
        except P.ProtocolError as e:  # the coordinator sent garbage: say so, and end the connection
            log.warning("dropping the coordinator's connection: %s", e)
            self.lost_reason = f"the coordinator sent an invalid message ({e})"
            self.ctl.close(str(e))
        except Exception as e:
            log.debug("control stream ended: %s", e)
            self.lost_reason = (
                "coordinator silent" if isinstance(e, TransportTimeout) else "coordinator closed the connection"
            )
            # (a read can fail before it sees why the coordinator closed: the connection says why)
            if P.JOIN_BUSY in f"{e} {self.ctl.close_reason()}":  # its joining slots were full: join_again tries again
                self.lost_reason += f" ({P.JOIN_BUSY})"
        self.inbox.put_nowait(None)
        self.sync_q.put_nowait(None)
        self.ended.set()

    async def expect(self, *types: type, timeout: float | None = None) -> P.Message:
        """Next control message of one of `types`; TrainingCancel ends the run, a lost connection
        raises Lost, messages of an earlier round (replies that crossed ours) are skipped."""
        while True:
            try:
                msg = self._stash.popleft() if self._stash else await within(self.inbox.get(), timeout)
            except asyncio.TimeoutError:
                names = "/".join(t.__name__ for t in types)
                raise Lost(f"coordinator sent no {names} within {timeout:g}s") from None
            match msg:
                case None:  # the connection ended (or the sync failed)
                    self._stash.appendleft(None)  # every later expect() sees the end too
                    if self.failure is not None:
                        raise self.failure
                    raise Lost(self.lost_reason)
                case P.TrainingCancel(retry=True) if self.node.admitted:
                    raise Lost(f"the coordinator refused us for now ({msg.reason})")
                case P.TrainingCancel():
                    raise NodeError(f"training cancelled by coordinator: {msg.reason}")
                case _ if isinstance(msg, types):
                    return msg
                case P.StopRound() | P.NoMoreWork() | P.MoreWork():
                    pass  # a reply that crossed the end of the inner loop ("stop", "no more work", "ask again")
                case _ if getattr(msg, "round", self.round) < self.round:
                    pass  # an earlier round's
                case _:
                    names = "/".join(t.__name__ for t in types)
                    raise NodeError(f"unexpected {msg.type} from coordinator (expected {names})")

    # --- the session ---------------------------------------------------------------------------

    async def run(self) -> int:
        node = self.node
        try:
            conn = await node.endpoint.dial(self.opts.ticket, CONTROL_ALPN, self.opts.connect_timeout)
            self.reached = True  # (a coordinator that closes the connection before a stream opens was reached)
            self.ctl = await Endpoint.open_channel(conn, self.opts.connect_timeout)
        except TransportError as e:
            if (run := ticket_run(self.opts.ticket)) is not None and run_finished(run):
                raise NodeError(
                    f"this run has finished (run {run}); ask its owner for the current join command"
                ) from None
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
            self.progress.close()
            for t in self._tasks:
                t.cancel()
            await self.ctl.finish()
            self.ctl.close("node leaving")

    async def _run(self) -> int:
        t = await self._join()
        r = t.recipe
        self._tasks.append(
            asyncio.ensure_future(
                self._heartbeat(r.heartbeat_s, lambda: rules.quiet_limit(r.heartbeat_s, r.stale_after_s, self.members))
            )
        )
        ready = await self.expect(P.TrainingReady, P.TrainComplete)
        if isinstance(ready, P.TrainComplete):
            return self._complete(ready)
        await self._verify_ready(ready)
        self.node.admitted = True
        self.progress.rounds = t.recipe.rounds
        self.progress.joined(self.ctl.peer_id, t.run_id, len(ready.nodes))
        t.inner = InnerLoop(t.worker, t.recipe, self.inbox, self.send, t.lock, self._stash.append)
        if self.node.data is not None:
            t.inner.data = self.node.data if self.node.data.in_use else None  # (else it has the data itself)
            self.node.data.attach(self._data_report)
            if self.node.data_server is not None:
                self._data_report(P.DataReport(kind="holds", round=-1, reason="this node's copy matches the manifest"))
        self._tasks.append(asyncio.ensure_future(self._sync_loop(t)))
        while True:
            match msg := await self.expect(P.ShardAssignment, P.TrainComplete, P.TrainingReady, P.MembersChanged):
                case P.ShardAssignment():
                    await self._round(msg)
                case P.TrainingReady() | P.MembersChanged():  # new members (taken by the reader already)
                    await self._verify_ready(msg)
                case P.TrainComplete():
                    return self._complete(msg)

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
            choice = opts.source.choice()
        except BackendError as e:
            raise NodeError(str(e)) from None
        await self.send(
            P.NodeInfo(
                node_id=node.endpoint.node_id,
                name=opts.name,
                backend=choice.backend,
                device=choice.device,
                device_name=choice.device_name,
                ring_ticket=node.endpoint.ticket(),
                run=ticket_run(opts.ticket),
            )
        )
        cfg = await self.expect(P.TrainConfig, timeout=HANDSHAKE_TIMEOUT)
        t = node.trainer
        if t is not None and cfg.run_id != t.run_id:
            raise NodeError(
                f"the coordinator now runs another run ({cfg.run_id}, not {t.run_id}); "
                f"join it with a fresh `drift join`"
            )
        if t is None:
            alive = asyncio.ensure_future(self._heartbeat(2.0, lambda: 1.0))  # the coordinator hears us while we load
            try:
                t = node.trainer = await self._load(cfg)
            finally:
                alive.cancel()
        else:  # rejoining: same model, fresh inner state; θ comes from a peer at the next round
            t.worker.reset_optimizer()
            t.pending, t.kept_steps = None, 0
            t.load_worker()  # what it trained since the last agreed θ was redone by the others
        self.silence_s = t.recipe.stale_after_s
        rc = self._repo_commit(t)
        allowlist = None if t.recipe.allowlist is None else frozenset(t.recipe.allowlist)
        node.peers.arm(PeerCheck(t.commit, t.run_id, allowlist), rc)  # what peers see of us, and check
        await self.send(rc)
        return t

    async def _load(self, cfg: P.TrainConfig) -> Trainer:
        """Check out the commit the coordinator names, build the worker, calibrate."""
        opts, node = self.opts, self.node
        try:
            recipe = Recipe.model_validate(cfg.recipe)
        except ValueError as e:
            reason = str(e).splitlines()[0] if str(e) else "invalid"
            raise await self._refuse(f"the coordinator sent a recipe this drift cannot use ({reason})") from None
        data = None
        if cfg.data is not None:
            data = await self._open_data(cfg.data, recipe)
        try:
            raw, tree = await opts.source.load(cfg, recipe, data)
        except RepoError as e:
            raise await self._refuse(str(e)) from None
        except (BackendError, TaskError, ImportError) as e:
            raise await self._refuse(str(e).splitlines()[0]) from None
        trim_heap()  # what building the model freed (a task's init_params: all of θ, and more)
        worker = OnLoop(raw, opts.steps)  # every call on the loop thread, between its steps
        try:
            # Shapes one tensor at a time: a copy of every parameter at once would stay behind in
            # the allocator's heap (freed, still resident) for the rest of the run.
            buffers = set(worker.get_buffers())
            shapes = {name: a.shape for name, a in worker.iter_state()}
            layout = ParamLayout.of_shapes(
                {n: s for n, s in shapes.items() if n not in buffers}, {n: s for n, s in shapes.items() if n in buffers}
            )
            theta = np.empty(layout.size, np.float32)
            rule = make_rule(layout, recipe)
            t = Trainer(
                worker,
                recipe,
                cfg.run_id,
                cfg.commit,
                tree,
                layout,
                rule,
                theta,
                np.empty(layout.size, np.float32),
                np.empty(layout.size, np.float32) if recipe.overlap else None,
                None,
                "",
            )
            t.read_local(theta)
            if cfg.base is not None:
                await self._init_weights(t, cfg.base)
            log.info(
                "loaded %s: %d values (%d in buffers), %s on %s",
                recipe.task,
                layout.size,
                layout.size - layout.params_size,
                worker.backend,
                worker.device,
            )
            probe = InnerLoop(worker, recipe, self.inbox, self.send)
            probe.data = node.data if node.data is not None and node.data.in_use else None
            t.calibration = await calibrate(probe)
        except (
            BackendError,
            TaskError,
            ImportError,
        ) as e:  # a task that breaks the interface says so at its first step
            raise await self._refuse(str(e).splitlines()[0]) from None
        node._hold_data()
        t.load_worker()  # calibration trained a few steps: back to θ0 (buffers too)
        worker.reset_optimizer()  # ... and to a fresh AdamW, as every node starts
        trim_heap()
        t.publish(node.state, -1)
        t.initial_checksum = t.held_checksum
        t.frozen_checksum = worker.frozen_checksum()
        return t

    async def _open_data(self, src: P.DataSource, recipe: Recipe):
        """recipe data: the holder's manifest; returns the task wrapper that serves its samples."""
        node = self.node
        if node.data is None:
            root = drift_home() / "data" / node.endpoint.node_id[:16]
            limit = int((recipe.data or Data()).cache_mb * (1 << 20))
            try:
                node.data = await DataClient.open(node.endpoint, src, root, limit)
            except DataError as e:
                raise await self._refuse(f"data: {e}") from None
        client = node.data
        return lambda task: served_task(task, client, self.opts.say)

    def _data_report(self, msg: P.DataReport) -> None:
        """What the data client has to say, to the coordinator (in the background)."""

        async def say() -> None:
            with contextlib.suppress(Lost):
                await self.send(msg)

        self._tasks.append(asyncio.ensure_future(say()))

    async def _init_weights(self, t: Trainer, src: P.BaseSource) -> None:
        """recipe init_weights from the coordinator (drift/base.py): the frozen base into the model,
        θ₀ into t.theta; cached under $DRIFT_HOME/base, so a second run fetches nothing."""
        try:
            got = await take(self.node.endpoint, src, t.worker, t.layout, t.theta, BaseCache(drift_home() / "base"))
        except BaseError as e:
            raise await self._refuse(str(e)) from None
        self.opts.say(
            f"init_weights: {len(got.manifest.tensors)} tensors (manifest {src.root[:12]}): "
            f"{got.fetched} fetched ({got.bytes} bytes), {got.cached} already here"
        )

    # --- trust: the code we run, and who we run it with ----------------------------------------

    async def _refuse(self, reason: str) -> NodeError:
        """Tell the coordinator why this node will not go on; returns the error to raise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        try:
            await self.send(P.TrainingCancel(reason=reason))
            # Closing at once could drop the frame in flight: wait until the coordinator hangs up.
            while loop.time() < deadline:
                if await within(self.inbox.get(), deadline - loop.time()) is None:
                    break
        except Exception:
            pass
        return NodeError(reason)

    def _repo_commit(self, t: Trainer) -> P.RepoCommit:
        """This node's RepoCommit, signed with its key (a fresh nonce every session)."""
        node = self.node
        rc = P.RepoCommit(
            repo=self.opts.source.name,
            commit=t.commit,
            tree=t.tree,
            node_id=node.endpoint.node_id,
            timestamp=time.time(),
            nonce=secrets.token_hex(16),
            param_checksum=t.initial_checksum,
            frozen_checksum=t.frozen_checksum,
            n_train=t.worker.n_train,
            n_params=t.layout.size,
            layout=t.layout.digest(),
            run_id=t.run_id,
            samples_per_s=t.calibration.samples_per_s,
        )
        return P.RepoCommit.model_validate(sign_message(node.key, rc.model_dump(mode="json")))

    def _check_members(self, ready: P.TrainingReady | P.MembersChanged) -> str | None:
        """Check a TrainingReady (verify_peers: its few RepoCommits, the allowlist, auth_threshold)
        or a MembersChanged (the allowlist); on success the members this node trains with (ring,
        gather, state, data) are its nodes, or those changed by it, each verified as this node
        first talks to it. Returns what is wrong, or None."""
        t, peers, me = self.node.trainer, self.node.peers, self.node.endpoint.node_id
        if t is None or peers.check is None:
            return f"{ready.type} before this node loaded the task"
        if isinstance(ready, P.MembersChanged):
            allow = peers.check.allowlist
            if allow is not None and (outside := [i for i in ready.joined if i not in allow]):
                return f"the coordinator added node {outside[0][:10]}, which is not on the allowlist"
            ids = (peers.members | set(ready.joined)) - set(ready.left)
        else:
            try:
                verify_peers(
                    ready.signatures, ready.nodes, check=peers.check, me=me, threshold=t.recipe.auth_threshold or 1
                )
            except AuthError as e:
                return f"peer check failed: {e}"
            if me not in ready.nodes:
                return "TrainingReady does not list this node"
            ids = set(ready.nodes)
        self._told(len(ids), t.recipe)
        peers.set_members(ids - {me})
        self.node.gather.retain(peers.members)
        for gone in [i for i in self.node.tickets if i not in ids]:
            del self.node.tickets[gone]
        return None

    def _told(self, members: int, r: Recipe) -> None:
        """The coordinator told us the swarm has this many members: how seldom we beat and how
        long its silence may last follow (rules.quiet_limit, rules.patience). When our beats may
        slow down we beat once at once: its patience grew before it told us, and that beat ends
        any wait of its that began before."""
        before = rules.quiet_limit(r.heartbeat_s, r.stale_after_s, self.members)
        self.members = members
        self.silence_s = rules.patience(r.heartbeat_s, r.stale_after_s, members)
        if rules.quiet_limit(r.heartbeat_s, r.stale_after_s, members) > before:
            self._slower.set()

    async def _verify_ready(self, ready: P.TrainingReady | P.MembersChanged) -> None:
        """Refuse to go on with a membership this node cannot accept (checked once, as it arrived)."""
        msg, problem = self._checked.pop(id(ready), (None, None))
        if msg is not ready:
            problem = self._check_members(ready)
        if problem:
            raise await self._refuse(problem)

    # --- rounds --------------------------------------------------------------------------------

    async def _round(self, a: P.ShardAssignment) -> None:
        t = self.node.trainer
        self.round = a.round
        in_flight = t.pending is not None and not t.pending.settled.is_set()
        if a.state is not None and not in_flight and not t.holds(a.state):
            # A late joiner, an evaluator or a node that sat out: take the swarm's θ first. (While
            # a round of ours is being reduced, θ is the sync's: an Agreed brings what we lack,
            # and a θ that is not the swarm's shows in that round's checksums.) Under the model's
            # lock, as an Agreed's rebase: one writer of θ at a time.
            if t.kept_steps:  # our late work rides on θ (its Agreed's fetch failed): move both
                await self._rebase(t, a.state)
            async with t.lock:
                if not t.holds(a.state):
                    try:
                        await self._fetch(t, a.state)
                    except Lost:
                        if a.role != "evaluate":
                            raise
                    else:
                        t.pending = None
                        t.load_worker()
                        t.kept_steps = 0
        if a.catch_up is not None and (t.pending is None or t.pending.settled.is_set()):
            # overlapped: that round lands while we train (Agreed brings it)
            t.snap[...] = t.theta
            self._pend(t, Pending(a.catch_up))
        if a.role == "wait":  # overlapped: θ comes with the Agreed of the round in flight
            return
        if a.role == "evaluate":
            if t.kept_steps:  # our late work will not be merged: what we evaluate is θ
                async with t.lock:
                    t.load_worker()
                    t.kept_steps = 0
            if a.state is not None and not t.holds(a.state):  # no donor had it, or a round is in flight
                await asyncio.sleep(1.0)
                await self.send(P.AskForMoreWork(round=a.round))
                return
            val, batch_s = await t.inner.evaluate(a.round)
            if val is None:  # a loop without an evaluation: nothing to report, ask again later
                await asyncio.sleep(1.0)
                await self.send(P.AskForMoreWork(round=a.round))
                return
            n = min(t.worker.n_val, t.recipe.eval_batches * t.recipe.batch_size)
            # Evaluators do not train, so their speed is re-measured here: a node that recovers
            # (a laptop that cooled down) trains again once it is fast enough.
            sps = t.recipe.batch_size / (batch_s * t.calibration.eval_ratio)
            await self.send(
                P.EvalResult(
                    after_round=t.held, val_loss=val, val_samples=n, samples_per_s=sps, metrics=t.inner.metrics()
                )
            )
            self.progress.evaluated(a.round, val)
            return
        if self.node.data is not None:
            self.node.data.round = a.round
        report = await t.inner.run_round(a)
        self.progress.trained(a.round, report.samples, mean_loss(report.losses))
        if self.node.data is not None:
            await self.send(self.node.data.fetched())
        waits = t.pending is not None and not t.pending.settled.is_set()
        if report.unsent and not rules.reports_ride(t.barrier_s, report.unreported_s, waits):
            await self.send(merged(report.unsent))
        if t.pending is not None:  # overlapped: the last round's outer step must land before this barrier
            await self._settled(t.pending)
        started = time.perf_counter()  # (Δ's time, rules.reports_ride: not the wait above)
        async with t.lock:
            if t.snap is not None:
                t.read_local(t.snap)  # the local copy at this barrier, for the catch-up
            t.pseudo_gradient(t.snap)
        steps, t.kept_steps = report.steps + t.kept_steps, 0  # (Δ holds a late round's steps too)
        problem = t.delta_check.problem(t.delta, steps) if steps else None
        if problem:
            log.warning("round %d: %s; reporting it instead of sending it", a.round, problem)
            t.worker.reset_optimizer()  # its moments are likely as broken as its Δ
        self._pend(t, Pending(a.round, a.report_val, steps=steps if not problem else 0))
        norm = t.delta_check.norm if steps and not problem else 0.0  # bounds the ring's sum
        t.barrier_s = time.perf_counter() - started
        await self.send(report.barrier_sync(a.round).model_copy(update={"delta_error": problem, "delta_norm": norm}))
        if not t.recipe.overlap:
            await self._settled(t.pending)

    def _pend(self, t: Trainer, p: Pending) -> None:
        """This round's θ is now awaited; an Agreed for it that came early is handled now."""
        t.pending = p
        self._early_agreed = {r: m for r, m in self._early_agreed.items() if r >= p.round}
        if p.round in self._early_agreed:
            self.sync_q.put_nowait(self._early_agreed.pop(p.round))

    async def _settled(self, p: Pending) -> None:
        """Until the outer step of round p.round has landed here, or the session ends (then the
        round loop's next message says how: TrainComplete, TrainingCancel, a lost connection)."""
        waiters = [asyncio.ensure_future(p.settled.wait()), asyncio.ensure_future(self.ended.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    # --- the sync of each round: all-reduce, outer step, catch-up -------------------------------

    async def _sync_loop(self, t: Trainer) -> None:
        """Runs beside the rounds for the whole session: BarrierReady starts (or restarts) the
        all-reduce of the pending round; Agreed says what θ became for a node that did not reduce
        it. A failure here ends the session like any other (the round loop sees the end)."""
        reduce: asyncio.Task | None = None
        # One getter lives until its message is handled: it may take a message from the queue
        # while _reduced awaits, and a getter cancelled then would drop that message (seen in CI:
        # a retry's BarrierReady lost, the ring stalled for its timeout).
        getter: asyncio.Task | None = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(self.sync_q.get())
                waiting = {getter} | ({reduce} if reduce is not None else set())
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if reduce is not None and reduce in done:
                    finished, reduce = reduce, None
                    await self._reduced(t, finished)
                    continue  # (the getter, done or not, is looked at next time round)
                msg, getter = getter.result(), None
                p = t.pending
                match msg:
                    case None | P.TrainComplete() | P.TrainingCancel():
                        return
                    case Ready(msg=ready) if p is None or ready.round != p.round:
                        pass  # a retry of a round already settled here (we answered it before)
                    case Ready(msg=ready):
                        if reduce is not None:  # a newer ring for the same round: the attempt in flight is moot
                            reduce.cancel()
                            reduce = None
                        p.announced = None  # (a redo: the step it announced was never applied)
                        if p.applied or p.superseded:  # never a second step on a θ that already moved
                            p.applied, p.superseded = False, True
                            p.settled.clear()
                            await self.send(
                                P.RingFailed(
                                    round=ready.round,
                                    ring_epoch=ready.ring_epoch,
                                    sit_out=True,
                                    reason="this node already applied the round's outer step",
                                )
                            )
                            continue
                        reduce = asyncio.ensure_future(self._allreduce(t, msg))
                        reduce.pending = p  # the round it is for (the round loop may have moved on)
                    case P.Agreed() if p is not None and msg.round < p.round:
                        # A round we applied ourselves (an attempt the coordinator then redid
                        # without us) settled otherwise, and we synced the next one meanwhile.
                        if msg.round == t.held:
                            await self._rebase(t, msg.state)
                            await self._beat()
                    case P.Agreed() if p is None or msg.round != p.round:
                        # A node still in a long step learns the round went on without it before
                        # it reaches the barrier: kept for when it does (see _pend).
                        self._early_agreed[msg.round] = msg
                    case P.Agreed():
                        if reduce is not None:
                            reduce.cancel()
                            reduce = None
                        p.announced = None
                        await self._agreed(t, p, msg)
                    case P.Commit():
                        a = p.announced if p is not None and msg.round == p.round else None
                        if a is not None and a.ready.msg.ring_epoch == msg.ring_epoch:
                            p.announced = None
                            await self._apply(t, p, a.ready, a.stats, a.combined, a.check_s, a.checksum)
        except Exception as e:
            if not isinstance(e, Lost):
                log.exception("the sync of round %s failed", t.pending.round if t.pending else "?")
                self.failure = e
            self.lost_reason = str(e)
            self.inbox.put_nowait(None)
            self.ended.set()
        finally:
            for task in (reduce, getter):
                if task is not None:
                    task.cancel()

    async def _allreduce(self, t: Trainer, r: Ready):
        """One attempt at the round's sync: the rule's contribution from Δ (recomputed: an earlier
        attempt left the buffer garbled) and this node's weight, through the rule's collective:
        summed around the ring, or all-gathered (level by level above the rule's fanout: the
        top level's payloads and children, drift/hierarchy.py). (ready, result, the members the
        result is of, outliers its merges named, stats or None, error)."""
        ready, ring = r.msg, r.ring
        me = next((m for m in ring if m.node_id == self.node.endpoint.node_id), None)
        if me is None:
            return r, None, ring, [], None, None  # not in this ring: θ comes with Agreed
        async with t.lock:
            t.pseudo_gradient(t.snap)
        mine = t.rule.contribute(t.delta, me.weight, ready.round)
        try:
            if collective(t.recipe, ready.round) == "ring":
                stats = await self.node.ring.allreduce_sum(
                    mine,
                    ring,
                    ready.round,
                    codec=ready.codec,
                    topk_fraction=t.recipe.topk_fraction,
                    kernels=t.worker.codec_kernels,
                    generation=ready.ring_epoch,
                    flat=ready.flat,
                )
                return r, mine, ring, [], stats, None
            result, members, stats, named = await self.node.gather.tree(
                mine,
                ring,
                ready.round,
                t.rule.payload_nbytes,
                ready.ring_epoch,
                ready.slack_s,
                t.rule.params.fanout,
                t.rule.merge,
            )
            return r, result, members, named, stats, None
        except RingError as e:
            return r, None, ring, [], None, e

    async def _reduced(self, t: Trainer, task: asyncio.Task) -> None:
        """An all-reduce attempt ended: apply the outer step and report the checksum, or report
        the failure and wait for the coordinator's retry."""
        p = task.pending
        if task.cancelled() or p is not t.pending or p.settled.is_set():
            return
        ready, result, members, named, stats, error = task.result()
        if error is not None:
            log.warning("all-reduce of round %d failed: %s; waiting for the coordinator's retry", p.round, error)
            await self.send(
                P.RingFailed(
                    round=p.round,
                    ring_epoch=ready.msg.ring_epoch,
                    reason=str(error)[:500],
                    suspect=error.suspect,
                    proof=error.proof,
                    level=error.level,
                )
            )
            return
        if stats is None:
            return
        combined = t.rule.combine(result, members, ready.msg.bound)
        combined.outliers = named + combined.outliers
        if (bad := combined.problem) is not None:
            # Someone sent more than it reported: θ must not move. The coordinator redoes the
            # round without the culprit (it recomputes Δ from the snapshot for the retry).
            log.warning("all-reduce of round %d: %s; not applying it", p.round, bad)
            await self.send(
                P.RingFailed(round=p.round, ring_epoch=ready.msg.ring_epoch, reason=bad[:500], poisoned=True)
            )
            return
        check_s = stats.check_seconds + combined.check_s
        if ready.msg.confirm:
            # A ring of two: nobody could outvote a bad θ, so the step lands only once the
            # coordinator has seen both members announce the same one (Commit); a redo finds θ as it was.
            t0 = time.perf_counter()
            before = checksum(*t.arrays) if ready.msg.recheck else ""
            preview = t.rule.preview(t.theta)
            check_s += time.perf_counter() - t0  # (it replaces the checksum taken after the step)
            p.announced = Announced(ready, stats, combined, preview, check_s)
            await self.send(
                P.RoundDone(
                    round=p.round,
                    ring_epoch=ready.msg.ring_epoch,
                    checksum=p.announced.checksum,
                    announced=True,
                    before=before,
                    bytes_sent=stats.bytes_sent,
                    reduce_s=stats.seconds,
                    check_s=check_s,
                    outliers=combined.outliers[: P.MAX_NODES],
                    heard=stats.heard[: P.MAX_NODES],
                )
            )
            return
        await self._apply(t, p, ready, stats, combined, check_s)

    async def _apply(
        self,
        t: Trainer,
        p: Pending,
        ready: Ready,
        stats: ReduceStats,
        combined: Combined,
        check_s: float,
        announced: str = "",
    ) -> None:
        """The outer step of an all-reduce that passed its checks (and, in a ring of two, was
        committed: the checksum is the one announced, not hashed again; a step that lands another
        θ is caught at the next round, whose step starts from a state that is not the agreed one):
        θ moves, and the coordinator gets its checksum."""
        async with self.node.state.updating():
            t.rule.apply(t.theta)
            t.publish(self.node.state, p.round, announced)
        p.applied = True
        await self._catch_up(t)
        val = await self._evaluate_global(t) if p.report_val else None
        await self.send(
            P.RoundDone(
                round=p.round,
                ring_epoch=ready.msg.ring_epoch,
                checksum=t.held_checksum,
                val_loss=val,
                metrics=t.inner.metrics() if val is not None else {},
                bytes_sent=stats.bytes_sent,
                reduce_s=stats.seconds,
                check_s=check_s,
                outliers=combined.outliers[: P.MAX_NODES],
                heard=stats.heard[: P.MAX_NODES],
            )
        )
        # No Heartbeat for this θ: the coordinator counts us among its holders once the round
        # agrees on the checksum just sent (and, if it does not, tells us what θ became).
        self._held_told = p.round
        me = next((m for m in ready.ring if m.node_id == self.node.endpoint.node_id), None)
        self.progress.settled(p.round, stats.bytes_sent, val, me.weight if me is not None else None)
        p.settled.set()

    async def _agreed(self, t: Trainer, p: Pending, msg: P.Agreed) -> None:
        """The coordinator settled round p.round without (or despite) our own reduce: make θ the
        agreed state, fetching it if ours differs, and move the local copy along (a round given
        up leaves θ as it was: the catch-up then takes back what the round trained locally).

        A node that reads this late (it was stuck in a long step) may find no donor with that θ
        any more (_take)."""
        if p.applied or p.superseded:  # our own attempt, which the coordinator redid without us
            await self._rebase(t, msg.state)
        else:
            if t.held_checksum != msg.state.checksum:
                await self._take(t, msg.state)
            t.rule.abandon()  # our contribution's bookkeeping (error feedback) stays as it was
            await self._catch_up(t)
            if msg.keep > 0 and p.steps and t.snap is None:
                # The round went on without us: our work of it rides on the new θ, scaled for its
                # staleness, and reaches the swarm in our next round's Δ (the coordinator counts
                # its samples there).
                async with t.lock:
                    t.keep_late(msg.keep, p.steps)
        p.applied = p.superseded = False
        kept = msg.keep if t.kept_steps else 0.0
        self.progress.settled(p.round, 0, None, abandoned=msg.abandoned, kept=kept)
        p.settled.set()
        await self._beat()  # the coordinator learns what we hold now, before it plans the next round

    async def _rebase(self, t: Trainer, src: P.StateSource) -> None:
        """θ_global <- the agreed state of round src.round in place of the one this node applied
        itself. The local copy (and the snapshot of a round synced since) move by the same
        difference, so the work since and its Δ stay as they are. Under the model's lock, as the
        round loop's own fetch: its barrier reads θ and the snapshot together. If no holder hands
        the state over, every array is as it was."""
        async with t.lock:
            if t.holds(src):
                return
            before = [a.copy() for a in t.arrays]
            if not await self._take(t, src):
                for a, b in zip(t.arrays, before):
                    a[...] = b  # (the pieces that came were written in place)
                return
            moved = before[0]
            np.subtract(t.theta, moved, out=moved)
            t.worker.add_to_state(t.layout.unflatten(moved))
            if t.snap is not None:
                t.snap += moved
        trim_heap()

    async def _take(self, t: Trainer, src: P.StateSource) -> bool:
        """_fetch, or False with a warning when no holder handed the state over: the node keeps
        what it holds, and the coordinator, told so, hands it the newest at its next assignment."""
        try:
            await self._fetch(t, src)
        except Lost as e:
            log.warning("could not take θ of round %d (%s); the next assignment brings the newest", src.round, e)
            return False
        return True

    async def _fetch(self, t: Trainer, src: P.StateSource) -> None:
        """θ_global and the outer state <- the agreed state of round src.round, from its holders.
        A holder that sent a piece that is not the swarm's is reported to the coordinator."""
        liars = lied_to(self.node.endpoint.node_id)
        try:
            async with self.node.state.updating(fetching=True):
                await fetch_state(
                    self.node.endpoint,
                    src.tickets,
                    src.round,
                    src.checksum,
                    into_arrays(*t.arrays),
                    size=t.layout.size,
                    layout=t.layout,
                    arrays=len(t.arrays),
                )
                t.publish(self.node.state, src.round)
        except StateError as e:
            raise Lost(str(e)) from None  # come back and ask again, rather than train on a stale θ
        finally:
            for holder in sorted(lied_to(self.node.endpoint.node_id) - liars):
                reason = f"a piece of round {src.round} that is not the swarm's"
                await self.send(P.HolderReport(round=src.round, holder=holder, reason=reason))
        log.info("took θ after round %d from a peer", src.round)

    async def _catch_up(self, t: Trainer) -> None:
        """The local copy follows θ_global: blocking, it becomes θ_global; overlapped, it moves by
        what θ_global moved relative to the snapshot, keeping the progress made since."""
        async with t.lock:
            if t.snap is None:
                t.load_worker()
            else:
                catch_up(t.theta, t.snap)
                t.worker.add_to_state(t.layout.unflatten(t.snap))
                t.snap[...] = t.theta  # from now on the local copy is relative to this θ_global
        trim_heap()  # the per-tensor copies that moved θ

    async def _evaluate_global(self, t: Trainer) -> float:
        """The val loss of θ_global (overlapped: the local copy is set aside meanwhile)."""
        if t.snap is None:
            val, _ = await t.inner.evaluate()
            return val
        async with t.lock:
            t.read_local(t.snap)
            t.load_worker()
        try:
            val, _ = await t.inner.evaluate()
        finally:
            async with t.lock:
                t.worker.set_params(t.layout.split(t.layout.unflatten(t.snap))[0])
                if t.layout.n_buffers:
                    t.worker.set_buffers(t.layout.split(t.layout.unflatten(t.snap))[1])
                t.snap[...] = t.theta
        return val

    async def _heartbeat(self, every_s: float, quiet_s: Callable[[], float]) -> None:
        """Tell the coordinator we are alive, also while a long inner step runs (every_s, when
        we sent it nothing for quiet_s(), and at least every fourth beat or quiet_s(), whichever
        is longer); a --local node also leaves when the coordinator that started it is gone."""
        parent = int(os.environ.get("DRIFT_PARENT_PID", "0") or 0)
        skipped = 0
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._slower.wait(), every_s)
            if parent and os.getppid() != parent:
                print("drift: the coordinator that started this node is gone; leaving", file=sys.stderr)
                os._exit(1)
            t, quiet, slower = self.node.trainer, quiet_s(), self._slower.is_set()
            self._slower.clear()
            lately = skipped < max(3, quiet / every_s - 1)
            if not slower and self.ctl.quiet_s() < quiet and (t.held if t else None) == self._held_told and lately:
                skipped += 1  # it heard from us meanwhile, and what we hold is what we told it (lately)
                continue
            skipped = 0
            try:
                await self._beat()
            except Exception:
                return

    async def _beat(self) -> None:
        t = self.node.trainer
        held = t.held if t else None
        await self.ctl.send_frame(P.encode(P.Heartbeat(round=max(self.round, -1), held=held)))
        self._held_told = held


async def run_node(opts: NodeOptions) -> int:
    return await Node(opts).run()
