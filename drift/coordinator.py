"""`drift coord`: admits nodes, hands out work, runs the barrier and checks every round.

The coordinator never touches tensors: it only sees control messages (ALPN ``drift/0``). Each
node connection is served by its own task; a connection that sends a malformed, oversized or
unexpected frame is closed with a log line, and the coordinator keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Set
from dataclasses import dataclass, field, replace
from pathlib import Path

from drift import protocol as P
from drift import round as R
from drift import rules
from drift.auth import Admission, AuthError
from drift.base import MIN_RATE as BASE_MIN_RATE
from drift.base import BaseError, BaseServer, task_state
from drift.checkpoint import Checkpoint, CheckpointWriter, recipe_hash
from drift.data import DataError, DataServer, open_holder
from drift.diloco import ParamLayout, checksum, stream_checksum
from drift.monitor import Monitor, NodeView
from drift.recipe import Recipe
from drift.round import Round, RoundError, RoundResult
from drift.scheduler import UnitQueue
from drift.state import MIN_RATE as STATE_MIN_RATE
from drift.state import StateError, StateServer, fetch_state
from drift.swarm import DONOR_TRIES, Peer, Swarm
from drift.sync import rule_class
from drift.transport import (
    BASE_ALPN,
    CONTROL_ALPN,
    DATA_ALPN,
    HANDSHAKES_FULL,
    MAX_CONTROL_FRAME,
    STATE_ALPN,
    Channel,
    Endpoint,
    NetworkMode,
    Throttle,
    TransportError,
    TransportTimeout,
    close_conn,
    join_ticket,
    parse_ticket,
    peer_of,
    source_of,
    within,
)

log = logging.getLogger("drift.coord")

HANDSHAKE_TIMEOUT = 30.0
LOAD_TIMEOUT = 600.0  # a node may have to import torch and build the model first
INTERRUPT_FETCH_S = 5.0  # Ctrl-C: how long one node may take to hand over θ for the last checkpoint
CHECKPOINT_FETCH_S = 120.0  # a checkpoint due while the run goes on: the same, per node asked
MAX_JOINING = 64  # connections not yet admitted (handshake, loading the task) at once; more are dropped
MAX_JOINING_PER_PEER = 4  # of those, from one node id (a node that rejoins may overlap its old try)
MAX_JOINING_PER_SOURCE = 16  # of those, from one IP address (ids are free: one machine cannot fill them all)
MAX_TELLING = 8  # strangers being told why they are refused at once; the rest are just closed
TELL_TIMEOUT = 5.0  # for a stranger's first stream (an honest node sends NodeInfo at once)
# A node's DataReports become log lines and metrics events: at most this many per node a window
# (an honest node sends one "fetched" a round and a few others); the rest are counted, not kept.
MAX_DATA_REPORTS = 20
DATA_REPORT_WINDOW_S = 60.0
MAX_EVENT_BATCH = 4096  # nodes' messages handled between two runs of the round's clocks


class CoordinatorError(Exception):
    """The run cannot go on; str() is the one line shown to the user."""


async def _tell(ch: Channel, why: str, retry: bool = False) -> None:
    """Send a refused node why (TrainingCancel) and give it a moment to read it; never raises."""
    try:
        await ch.send_frame(P.encode(P.TrainingCancel(reason=why, retry=retry)), timeout=5.0)
        await ch.finish()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # ends when the node hangs up, having read it
            await ch.recv_frame(MAX_CONTROL_FRAME, timeout=max(0.1, deadline - time.monotonic()))
    except Exception:
        pass


def _why(e: Exception) -> str:
    """A dropped connection's reason: the message of our own errors, else the exception's name too."""
    if isinstance(e, (P.ProtocolError, TransportError, AuthError)):
        return str(e)
    return f"{e.__class__.__name__}: {e}"


# What a node's RepoCommit says of the task it loaded (_task_of), as a user reads it.
_TASK_PARTS = ("initial θ", "frozen base", "dataset size", "model size", "parameter layout")


def _task_of(p: Peer) -> tuple:
    """The task node p loaded, part by part as _TASK_PARTS names them: every node of a run agrees."""
    c = p.commit
    return (c.param_checksum, c.frozen_checksum, c.n_train, c.n_params, c.layout)


def ready_message(admission: Admission, ids: list[str], auth_threshold: int | None) -> P.TrainingReady:
    """TrainingReady for the members `ids`: the ids, and the signed RepoCommits of as many as a
    node's auth_threshold check counts (at least one). Every node verifies each peer's own
    RepoCommit as they first talk (drift/peers.py): forwarding all N to each of N nodes was N²
    bytes from this uplink (770 MB at 1,000 nodes)."""
    return P.TrainingReady(nodes=ids, signatures=admission.signatures(ids, auth_threshold or 1))


def members_changed(told: Set[str], ids: list[str]) -> P.MembersChanged:
    """What changed for members last told the membership `told`, now `ids`: who joined, who left."""
    return P.MembersChanged(joined=[i for i in ids if i not in told], left=sorted(told - set(ids)))


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
    repo: Path | None = None  # the repo holding the recipe's task (recipe data: we open its dataset)

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
        self._clock_at = 0.0  # the rounds' clocks run no sooner than this (_step) ...
        self._unticked = False  # ... after events they have not seen yet
        self._joined = asyncio.Condition()
        self._started = False
        self._finished = False
        self._tasks: set[asyncio.Task] = set()
        # Each settled round's figures. Its units and per-member bytes are in its `round` event
        # (metrics.jsonl), not here: a thousand members' units, kept a round after round, grow
        # the coordinator by megabytes a round.
        self.results: list[RoundResult] = []
        self.initial_val_loss: float | None = None
        self.final_val_loss: float | None = None  # of the final θ, once the run completed
        self.vals: dict[int, float] = {}  # the val loss of θ after each round (-1: the initial θ)
        self.swarm = Swarm(r, note=self.note)  # members, speeds, strikes, checksums, ring epoch
        self.joining: list[Peer] = []  # admitted after the start: enter at the next round
        # A resumed checkpoint's θ, to members (init_weights: self.base, drift/base.py).
        self.state = StateServer(allowed=self._member)
        self.base: BaseServer | None = None  # recipe init_weights: θ₀ and/or the frozen base, served by us
        self.data: DataServer | None = None  # recipe data: the samples we serve (drift-data/0)
        self.data_holders: dict[str, str] = {}  # node id -> ticket: members that serve a copy of it too
        self._logged: dict[
            str, tuple[float, int]
        ] = {}  # node id -> when (and in which round) its last NodeLog was kept
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
        self._skipped: int | None = None  # the newest round whose checkpoint was due while one was being written
        self.positions: dict[int, dict] = {}  # the data position after each settled round
        # The last settled round's late members (blocking: the next round merges their work).
        self.late: dict[str, R.Late] = {}
        self.told: set[str] = set()  # the membership the members were last told (TrainingReady, MembersChanged)
        self.most_told = 0  # the most members they were ever told of: how seldom a member may beat
        self.samples_at: dict[int, int] = {}  # samples trained after each settled round
        self._joining_conns = 0  # connections in the handshake, not yet admitted (MAX_JOINING)
        self._joining_by_peer: dict[str, int] = {}  # the same, per node id (MAX_JOINING_PER_PEER)
        self._joining_by_source: dict[str, int] = {}  # the same, per IP address (MAX_JOINING_PER_SOURCE)
        self._telling: set[str] = set()  # strangers being told why they are refused (MAX_TELLING)
        self._refusals = Throttle(self._dropped)  # strangers: a flood of them stays a few lines
        # "Busy, try again" (joining slots or QUIC handshakes full): a thousand nodes starting at
        # once knock thousands of times; they come back by themselves, so a few lines say it all.
        self._busy = Throttle(self._dropped)
        self._data_reports: dict[str, tuple[float, int, int]] = {}  # node -> (window start, kept, left out)
        self.layout = ""  # ParamLayout.digest() of the nodes' θ, once they agreed on it
        self.state_names = rule_class(self.recipe).STATE  # the sync rule's shared state
        self.frozen = ""  # digest of the frozen base every node loaded (set at the start)

    # --- serving connections -------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and start accepting; returns the join ticket (shown to the owner only: it admits)."""
        if (why := self.admission.unreachable()) is not None:  # e.g. fewer allowlisted nodes than needed
            raise CoordinatorError(why)
        if self.recipe.init_weights is not None:
            self.base = await self._open_base()
        if self.recipe.data is not None:
            self.data = await self._open_data()
        alpns = (CONTROL_ALPN, STATE_ALPN, DATA_ALPN, BASE_ALPN)
        self.endpoint = await Endpoint.bind(self.mode, secret_key=self.key, alpns=alpns)
        self._spawn(self._accept_loop())
        self._spawn(self._ping())
        return join_ticket(self.endpoint.ticket(), self.run_id)

    async def _open_data(self) -> DataServer:
        """recipe data: open the task's dataset here and digest every sample (the manifest)."""
        from drift.workers import load_task

        root = self.repo or Path.cwd()
        path = root / self.recipe.task

        def build() -> DataServer:
            try:
                task = load_task(path, root=root)
            except (FileNotFoundError, ImportError, ValueError) as e:
                raise DataError(str(e).splitlines()[0]) from None
            return open_holder(task, self.recipe.task_config, allowed=self._member)

        try:
            server = await asyncio.get_running_loop().run_in_executor(None, build)
        except DataError as e:
            raise CoordinatorError(f"data: {e}") from None
        m = server.manifest
        log.info(
            "data: serving %d + %d samples of %d bytes (manifest %s)",
            m.n["train"],
            m.n["val"],
            m.layout.record,
            server.root,
        )
        return server

    async def _open_base(self) -> BaseServer:
        """recipe init_weights: digest the file, and refuse it here if it does not fit the task's model."""
        from drift.workers import load_task

        root = self.repo or Path.cwd()

        def build() -> BaseServer:
            try:
                shapes = task_state(load_task(root / self.recipe.task, root=root), self.recipe.task_config)
            except (FileNotFoundError, ImportError, ValueError):
                shapes = None  # the nodes load it, and say what is wrong
            return BaseServer.open(Path(self.recipe.init_weights), shapes, allowed=self._member)

        try:
            server = await asyncio.get_running_loop().run_in_executor(None, build)
        except BaseError as e:
            raise CoordinatorError(f"init_weights: {e}") from None
        m = server.manifest
        log.info(
            "init_weights: serving %d tensors, %.1f MiB (manifest %s)", len(m.tensors), m.size / 2**20, server.root
        )
        return server

    def data_source(self) -> P.DataSource | None:
        if self.data is None:
            return None
        return P.DataSource(root=self.data.root, size=len(self.data.blob), tickets=self._data_tickets())

    def _data_tickets(self) -> list[str]:
        """Who serves the data: we do, then the members that hold a copy."""
        return [self.endpoint.ticket(), *(t for i, t in self.data_holders.items() if i in self.ready)]

    def _holders_changed(self) -> None:
        self._spawn(self.broadcast(list(self.ready.values()), P.DataHolders(tickets=self._data_tickets())))

    def _unique_name(self, name: str, node_id: str) -> str:
        """Two members never share a name (a round's nodes are keyed by it): two nodes on one
        machine, both named after it, are "vm" and "vm-2"."""
        taken = {p.info.name for i, p in self.ready.items() if i != node_id}
        k, unique = 1, name
        while unique in taken:
            k += 1
            unique = f"{name[: P.MAX_NAME - len(str(k)) - 1]}-{k}"
        return unique

    def node_log(self, peer: Peer, msg: P.NodeLog) -> None:
        """A member's own metrics: a `log` event (metrics.jsonl, dashboard, W&B, TensorBoard), at
        most one a node every LOG_EVERY_S, and its first of each round (a faster node's extra ones
        are dropped): a node whose round is shorter than that still reports every round."""
        now, rnd = time.monotonic(), self.current.rnd if self.current is not None else -1
        when, last = self._logged.get(peer.id, (-math.inf, -1))
        if now - when >= P.LOG_EVERY_S or rnd > last:
            self._logged[peer.id] = (now, rnd)
            self.note("log", node_id=peer.id, name=peer.info.name, step=msg.step, metrics=msg.metrics)

    def data_report(self, peer: Peer, msg: P.DataReport) -> None:
        """A node about the served data: logged (but the totals), and an event in metrics.jsonl. A
        node that holds a copy ("holds") is named to every node as a holder after us; what it
        serves is checked against the manifest like ours, so a liar is only passed over."""
        if not self._report_due(peer):
            return
        if msg.kind == "holds" and self.data is not None:
            if peer.id in self.data_holders:  # (each time would tell every node again)
                return
            log.info("node %s holds a copy of the data and serves it too", peer.info.name)
            self.data_holders[peer.id] = peer.info.ring_ticket
            self._holders_changed()
        elif msg.kind != "fetched":
            log.warning("node %s: data %s: %s", peer.info.name, msg.kind.replace("_", " "), msg.reason)
        fields = msg.model_dump(exclude={"type", "kind"})
        self.note(f"data_{msg.kind}", node_id=peer.id, name=peer.info.name, **fields)

    def _report_due(self, peer: Peer) -> bool:
        """Whether a node's DataReport is within MAX_DATA_REPORTS this window; those beyond are
        counted, and the count is one line and one event when the next window starts."""
        now = time.monotonic()
        start, n, held = self._data_reports.get(peer.id, (now, 0, 0))
        if now - start >= DATA_REPORT_WINDOW_S:
            if held:
                log.warning(
                    "node %s: %d data reports over %d a minute left out", peer.info.name, held, MAX_DATA_REPORTS
                )
                self.note("data_reports_left_out", node_id=peer.id, name=peer.info.name, count=held)
            start, n, held = now, 0, 0
        due = n < MAX_DATA_REPORTS
        self._data_reports[peer.id] = (start, n + due, held + (not due))
        return due

    def _member(self, peer: str) -> bool:
        """Who may fetch θ or samples from us: admitted nodes, and those in their handshake."""
        return peer in self.ready or peer in self._handshaking

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        """Serve drift/0 (nodes) and drift-state/1 (θ of a resumed checkpoint) until the endpoint
        closes. A connection that fails, whatever its bytes, ends in one connection_dropped line."""
        assert self.endpoint is not None
        await self.endpoint.serve(
            {
                CONTROL_ALPN: self._serve,
                STATE_ALPN: lambda conn: self.state.handle(conn, on_drop=self._dropped, on_stranger=self._refusals),
                **(
                    {BASE_ALPN: lambda conn: self.base.handle(conn, on_drop=self._dropped, on_stranger=self._refusals)}
                    if self.base
                    else {}
                ),
                **(
                    {DATA_ALPN: lambda conn: self.data.handle(conn, on_drop=self._dropped, on_stranger=self._refusals)}
                    if self.data
                    else {}
                ),
            },
            on_drop=self._served_drop,
        )

    def _served_drop(self, peer: str, why: str) -> None:
        """A connection the endpoint dropped: a refusal for now (handshakes full) is throttled."""
        (self._busy if HANDSHAKES_FULL in why else self._dropped)(peer, why)

    def _dropped(self, peer: str, why: str) -> None:
        """One line (and one connection_dropped event) per dropped connection; `why` as plain text."""
        peer = peer[:10] if len(peer) == 64 else P.printable(peer, 64)  # a node id, else an address
        why = P.printable(why, 300)
        log.warning("dropping connection from %s: %s", peer, why)
        if self.monitor:
            self.monitor.event("connection_dropped", peer=peer, reason=why)

    def _drop(self, ch: Channel | None, conn, why: str) -> None:
        self._dropped(peer_of(conn), why)
        try:
            (ch.close(why) if ch else close_conn(conn, why))
        except Exception:
            pass

    async def _refuse(self, ch: Channel, conn, why: str, retry: bool = False) -> None:
        """Tell a node why it is refused (TrainingCancel), let it read that, then drop it."""
        await _tell(ch, why, retry)
        self._drop(ch, conn, why)

    async def _stranger(self, conn, peer_id: str, why: str) -> None:
        """A node not on the allowlist. It holds no joining slot and costs one (throttled) line;
        while few are being told, it is told why (TrainingCancel: its operator learns what to
        do); any more are closed at once with the reason."""
        self._refusals(peer_id, why)
        if len(self._telling) >= MAX_TELLING or peer_id in self._telling:
            close_conn(conn, why)
            return
        self._telling.add(peer_id)
        try:
            await _tell(await Endpoint.accept_channel(conn, timeout=TELL_TIMEOUT), why)
        except Exception:
            pass
        finally:
            self._telling.discard(peer_id)
            close_conn(conn, why)

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
        peer_id = peer_of(conn)  # known from the QUIC handshake: the allowlist needs no stream
        try:
            self.admission.check_allowed(peer_id)
        except AuthError as e:
            await self._stranger(conn, peer_id, str(e))
            return
        source = source_of(conn)
        if self._joining_by_peer.get(peer_id, 0) >= MAX_JOINING_PER_PEER:
            full = f"{MAX_JOINING_PER_PEER} connections from this node"
        elif self._joining_by_source.get(source, 0) >= MAX_JOINING_PER_SOURCE:
            full = f"{MAX_JOINING_PER_SOURCE} connections from {source}"
        elif self._joining_conns >= MAX_JOINING:
            full = f"{MAX_JOINING} connections"
        else:
            full = None
        if full is not None:  # for now: the node tries again (node.join_again)
            why = f"{P.JOIN_BUSY}: {full} are already joining"
            self._busy(peer_id, why)
            close_conn(conn, why)
            return
        self._joining_conns += 1
        self._joining_by_peer[peer_id] = self._joining_by_peer.get(peer_id, 0) + 1
        self._joining_by_source[source] = self._joining_by_source.get(source, 0) + 1
        try:
            ch = await Endpoint.accept_channel(conn, timeout=HANDSHAKE_TIMEOUT)
            if self._finished:  # (a --local node started just before a Ctrl-C need not wait to be killed)
                await self._refuse(ch, conn, "this run has finished")
                return
            if (why := self.swarm.banned.get(ch.peer_id)) is not None:
                await self._refuse(ch, conn, f"excluded from this run: {why}")
                return
            rnd = self.current.rnd if self.current is not None else 0
            if (back := self.swarm.back_from(ch.peer_id, rnd)) is not None:
                await self._refuse(ch, conn, f"dropped for its strikes; it may rejoin from round {back}", retry=True)
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
            if info.run is not None and info.run != self.run_id:  # an earlier run's ticket (--keep-key)
                await self._refuse(
                    ch, conn, f"this run has finished (run {info.run}); ask its owner for the current join command"
                )
                return
            peer = Peer(info, ch)
            await ch.send_frame(
                P.encode(
                    P.TrainConfig(
                        run_id=self.run_id,
                        recipe=self.recipe.model_dump(mode="json"),
                        commit=self.commit,
                        base=None
                        if self.base is None
                        else self.base.source([self.endpoint.ticket()], self.resume is None),
                        data=self.data_source(),
                    )
                )
            )
            load_s = LOAD_TIMEOUT + (0 if self.base is None else self.base.manifest.size / BASE_MIN_RATE)
            rc = await self._next_message(ch, load_s)  # the node loads the task (and init_weights) first: it heartbeats
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
            info = peer.info = info.model_copy(update={"name": self._unique_name(info.name, peer.id)})
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
            self.swarm.seen(peer.id)
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
            if (left := self._joining_by_peer.pop(peer_id) - 1) > 0:
                self._joining_by_peer[peer_id] = left
            if (left := self._joining_by_source.pop(source) - 1) > 0:
                self._joining_by_source[source] = left
            if ch is not None and self._handshaking.get(ch.peer_id) is ch:
                del self._handshaking[ch.peer_id]
        # From here on every frame of this node feeds the round loop. Liveness is stamped here, as
        # frames arrive, not when the round loop gets to them: a round that starts after a long
        # checkpoint must not take a backlog of heartbeats for silence.
        try:
            while True:
                patience = self.patience()  # (it grows with the membership: read it at each frame)
                msg = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=patience))
                self.swarm.seen(peer.id)
                self.events.put_nowait((peer, msg))
        except Exception as e:
            silent = isinstance(e, TransportTimeout)
            peer.gone = peer.broken or (f"silent for {patience:g}s" if silent else f"connection closed ({_why(e)})")
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

    def _will_tell(self, members: int) -> None:
        """The members are about to be told a membership of this size. A member beats more
        seldom once it knows a larger one (rules.quiet_limit), so our patience grows before it
        can: a member whose beats slow down at once (it beats once when they do) is never taken
        for silent. It never shrinks: a member told fewer beats more often, and sooner or later."""
        self.most_told = max(self.most_told, members)

    def patience(self) -> float:
        """Seconds of silence after which an admitted node is dropped (rules.patience)."""
        return rules.patience(self.recipe.heartbeat_s, self.recipe.stale_after_s, self.most_told)

    async def _ping(self) -> None:
        """Every heartbeat_s, a Ping to every connected node we sent nothing for a while
        (rules.quiet_limit, for the membership it was told over this connection: a node not yet
        told any, a newcomer or one back on a new connection, expects the recipe's): a node that
        hears nothing from us for its patience knows the coordinator is gone (and tries to
        rejoin). (A ping to each of a thousand nodes whatever else they were sent was a fifth of
        the coordinator's frames a round.) Each Ping goes on its own, at most one a node at a
        time: a node that stops reading holds up its own (a send to it waits for its window),
        never the others'."""
        r = self.recipe
        pinging: set[str] = set()

        async def ping(p: Peer, frame: bytes) -> None:
            try:
                await p.ch.send_frame(frame, timeout=r.heartbeat_s)
            except TransportError:
                pass
            finally:
                pinging.discard(p.id)

        frame, alone = P.encode(P.Ping()), rules.quiet_limit(r.heartbeat_s, r.stale_after_s)
        while True:
            await asyncio.sleep(r.heartbeat_s)
            told, quiet = self.told, rules.quiet_limit(r.heartbeat_s, r.stale_after_s, len(self.told))
            for p in list(self.ready.values()):
                member = p.id in told and self.swarm.members.get(p.id) is p
                if p.id in pinging or p.ch.quiet_s() < (quiet if member else alone):
                    continue
                pinging.add(p.id)
                self._spawn(ping(p, frame))

    # --- the run -------------------------------------------------------------------------------

    async def broadcast(self, peers: list[Peer], msg: P._Msg) -> None:
        """The same message to every peer at once; a failed send only ever costs its own node.
        Encoded once: a TrainingReady or BarrierReady names every member, so encoding it for each
        of them would cost the coordinator N² a round."""
        frame = P.encode(msg) if peers else b""
        if len(peers) == 1:  # (most are: a grant, an answer; a task and a gather for one cost more than the send)
            await self.send(peers[0], msg, frame)
        else:
            await asyncio.gather(*(self.send(p, msg, frame) for p in peers))

    async def _next_event(self, timeout: float) -> tuple[Peer, P.Message | None] | None:
        """The next message of an admitted node (None: its connection ended), or None after
        `timeout` seconds of none (at once when one is queued; at once, None, when `timeout` ≤ 0).
        Every phase of the run reads the nodes' messages through here."""
        if not self.events.empty():
            return self.events.get_nowait()
        if timeout <= 0:
            return None
        try:
            return await within(self.events.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def wait_for_nodes(self) -> list[Peer]:
        n = max(self.recipe.min_nodes, self.admission.threshold)
        async with self._joined:
            await self._joined.wait_for(lambda: len(self.ready) >= n or self._auth_abort is not None)
            self._started = True
        if self._auth_abort is not None:
            peers = list(self.ready.values())
            await self.broadcast(peers, P.TrainingCancel(reason=self._auth_abort))
            left: set[str] = set()
            while len(left) < len(peers):  # give every node the time to read why before the endpoint closes
                if (ev := await self._next_event(5.0)) is None:
                    break
                if ev[1] is None:
                    left.add(ev[0].id)
            raise CoordinatorError(self._auth_abort)
        return list(self.ready.values())

    async def run(self) -> list[RoundResult]:
        """Wait for min_nodes, then run every round; returns one result per round."""
        peers = await self._same_task(await self.wait_for_nodes())
        self._will_tell(len(peers))
        await self.broadcast(peers, ready_message(self.admission, [p.id for p in peers], self.recipe.auth_threshold))
        self.told = {p.id for p in peers}
        r = self.recipe
        self.swarm.agreed(-1, peers[0].commit.param_checksum, ())
        self.n_train, self.n_params = peers[0].commit.n_train, peers[0].commit.n_params
        self.layout = peers[0].commit.layout  # ParamLayout.digest(): checkpoints are checked against it
        self.frozen = peers[0].commit.frozen_checksum  # the base every node must share (not in θ)
        self.note(
            "training_started",
            nodes=len(peers),
            n_train=self.n_train,
            unit_samples=r.unit_samples,
            checksum=self.swarm.checksums[-1],
            n_params=self.n_params,
        )
        for p in peers:
            self.swarm.enter(p, -1)
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
        if (
            owed := rules.checkpoint_owed(self._skipped, self.swarm.newest(), self.last_checkpoint, self._saves_over())
        ) is not None:
            self._start_checkpoint(owed)
            await self._wait_checkpoint()
        await self._finish_evaluations(timeout=max(30.0, 3 * r.stale_after_s))
        behind = await self._hand_final_theta(timeout=max(30.0, 3 * r.stale_after_s))
        final = self.results[-1].val_loss if self.results else None
        final = self.final_val_loss = self.vals.get(self.swarm.newest()) if final is None else final
        self._finished = True
        await self._last_word(list(self.ready.values()), P.TrainComplete(rounds=r.rounds, final_val_loss=final))
        if self.monitor:
            self.monitor.event("complete", rounds=r.rounds, final_val_loss=final, behind=behind, **queue.position())
        return self.results

    async def _same_task(self, peers: list[Peer]) -> list[Peer]:
        """The first nodes must have loaded the same task (initial θ, dataset, model size). Nodes
        outside a strict majority are refused and the run goes on with the others; with no
        majority nobody can tell which task is the run's, and everyone is cancelled."""

        counts = Counter(_task_of(p) for p in peers)
        top, n = counts.most_common(1)[0]
        if 2 * n <= len(peers):
            k = next(k for k in range(len(top)) if len({_task_of(p)[k] for p in peers}) > 1)
            seen = sorted({str(_task_of(p)[k]) for p in peers})
            await self.broadcast(peers, P.TrainingCancel(reason=f"nodes loaded different tasks ({_TASK_PARTS[k]})"))
            raise CoordinatorError(f"nodes loaded different tasks: {_TASK_PARTS[k]} differs {seen}")
        for p in peers:
            if _task_of(p) != top:
                differs = ", ".join(_TASK_PARTS[k] for k in range(len(top)) if _task_of(p)[k] != top[k])
                why = f"this node loaded a different task than the others ({differs} differs)"
                log.warning("node %s (%s) refused: %s", p.info.name, p.id[:10], why)
                await self.send(p, P.TrainingCancel(reason=why))
                self.note("node_refused", node_id=p.id, reason=why)
                self.ready.pop(p.id, None)
        return [p for p in peers if _task_of(p) == top]

    async def _rounds(self, first: int, queue: UnitQueue) -> None:
        """Every round. Blocking sync: one at a time. Overlapped: round r+1 starts as soon as the
        ring of round r is out, and r is settled while r+1 trains (its ring waits for that)."""
        r = self.recipe
        overlapped = r.overlap
        prev: Round | None = None
        for rnd in range(first, r.rounds):
            if self.stopping:
                return
            if self.monitor:
                self.monitor.round, self.monitor.rounds = rnd + 1, r.rounds
            await self._admit_late_joiners(rnd)
            if not self.swarm.members:
                raise CoordinatorError(f"every node has left (round {rnd})")
            taken = queue.take_round(R.budget(self.swarm, queue.pending_samples()))
            cur = self.current = Round(self.swarm, self, rnd, taken, time.monotonic(), prev, self.late)
            self.late = {}
            self.live = [x for x in (prev, cur) if x is not None]
            await self._apply(cur, cur.start(self.samples_seen))
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
        """Handle the events queued (waiting for one until the clocks are due), then run the
        clocks if due; True once `cur` (or, with no cur, prev) settled. A round that settles is
        recorded and checkpointed as due. The clocks look at every node: once per batch of
        events and at most every rules.clock_interval, or a round of N nodes would cost N² (a
        thousand nodes' messages come one by one while they train, and together at the barrier)."""
        wait = self._clock_at - time.monotonic() if self._unticked else 0.5  # (no event: the clocks every 0.5 s)
        ev = await self._next_event(wait)
        handled = 0
        self._unticked = self._unticked or ev is not None
        while ev is not None:
            if self.stopping:
                # Ctrl-C: interrupt() owns the rounds and the events now. This task was cancelled, but
                # before Python 3.12 wait_for returns an event that arrived with the cancel instead of
                # raising it; settling a round here would race interrupt()'s choice of checkpoint.
                self.events.put_nowait(ev)
                raise asyncio.CancelledError
            await self._handle(prev, cur, *ev)
            handled += 1
            ev = await self._next_event(0) if handled < MAX_EVENT_BATCH else None
        if self.stopping:
            raise asyncio.CancelledError
        now = time.monotonic()
        if self._unticked and now < self._clock_at:
            return (cur or prev).settled
        self._unticked, self._clock_at = False, now + rules.clock_interval(len(self.swarm.members))
        self._check_silence(now, (cur or prev).rnd)
        for rd in (prev, cur):
            if rd is None or rd.settled:
                continue
            if await self._event(rd, R.Tick(may_reduce=rd is prev or prev is None or prev.settled)):
                await self._settle(rd)
        return (cur or prev).settled

    async def _handle(self, prev: Round | None, cur: Round | None, peer: Peer, msg: P.Message | None) -> None:
        """One event of an admitted node (msg None: its connection ended)."""
        if peer.id in self.swarm.members:  # else: a node already dropped
            match msg:
                case None:
                    self.drop(peer.id, peer.gone or "connection closed", (cur or prev).rnd)
                case P.Heartbeat(held=held) if held is not None:
                    self.swarm.holds(peer.id, held)
                case P.Heartbeat():
                    pass
                case P.DataReport():
                    self.data_report(peer, msg)
                case P.HolderReport(holder=holder):
                    if self.swarm.named_holder(peer.id, holder):
                        self.note("holder_named", node_id=holder, name=self.swarm.name(holder), round=msg.round)
                case P.NodeLog():
                    self.node_log(peer, msg)
                case P.RoundDone() | P.RingFailed() | P.BarrierSync() if prev is not None and msg.round == prev.rnd:
                    await self._event(prev, R.Message(peer.id, msg))  # overlapped: the round still being reduced
                case _:
                    await self._event(cur or prev, R.Message(peer.id, msg))

    async def _event(self, rd: Round, event: R.Event) -> bool:
        """One event of round rd, its actions applied; True once rd settled (then call _settle)."""
        return await self._apply(rd, rd.step(event, time.monotonic()))

    async def _apply(self, rd: Round, actions: list[R.Action]) -> bool:
        """Carry out what round rd decided, in order; True if it settled. The only writer of the
        swarm, the monitor and the wire for a round: the round itself writes none of them."""
        settled = False
        s = self.swarm
        for a in actions:
            if R.write_swarm(s, a, rd.rnd):
                continue
            match a:
                case R.Send(nodes=nodes, msg=msg):
                    await self.broadcast([s.members[i] for i in nodes if i in s.members], msg)
                case R.TellAgreed(nodes=nodes, round=rnd, abandoned=abandoned):  # (where from: the new θ's donors)
                    told = [(s.members[i], self.state_source(i, force=True)) for i in nodes if i in s.members]
                    for peer, src in told:
                        keep = a.scale if peer.id in a.keep else 0.0
                        await self.broadcast([peer], P.Agreed(round=rnd, abandoned=abandoned, state=src, keep=keep))
                case R.Note(kind=kind, fields=fields):
                    self.note(kind, **fields)
                case R.Log(level=level, text=text):
                    log.log(level, "%s", text)
                case R.GiveBack(units=units):
                    self.queue.give_back(list(units))
                case R.CatchUp(node=i) if rd.prev is not None:
                    await self._apply(rd.prev, rd.prev.step(R.CatchingUp(i), time.monotonic()))
                case R.Drop(node=i, why=why):
                    self.drop(i, why, rd.rnd)
                case R.Evaluate(node=i) if i in self.swarm.members:
                    await self.assign_evaluation(self.swarm.members[i], rd.rnd, rd.epoch)
                case R.RecordVal():
                    self.record_val(a.after_round, a.val_loss, a.val_samples, a.metrics)
                case R.RecordEval(node=i, msg=msg, again=again):
                    if self.record_eval(i, msg) and again and msg.after_round < self.swarm.newest():
                        await self.assign_evaluation(self.swarm.members[i], rd.rnd, rd.epoch)
                case R.Progress(node=i, unit=u) if self.monitor is not None:
                    if (v := self.monitor.nodes.get(i)) is not None:
                        v.samples_per_s, v.loss, v.samples = a.samples_per_s, a.loss, v.samples + a.samples
                        self.monitor.event(
                            "progress",
                            node_id=i,
                            round=rd.rnd,
                            unit=[u.epoch, u.id, u.lo, u.hi],
                            loss=a.loss,
                            samples_per_s=a.samples_per_s,
                        )
                case R.Settled():
                    settled = True
        return settled

    async def _settle(self, rd: Round, checkpoint: bool = True) -> None:
        # The data position of θ after this round: a next round may have taken units already.
        nxt = self.current if self.current is not None and self.current.rnd > rd.rnd else None
        result, actions = rd.finish(time.monotonic())
        if self.monitor:
            self.monitor.val_loss = result.val_loss if result.val_loss is not None else self.monitor.val_loss
            for i, n in result.bytes_sent.items():
                if i in self.monitor.nodes:
                    self.monitor.nodes[i].bytes_sent += n
        self._record(result)
        await self._apply(rd, actions)
        if nxt is not None:  # overlapped: the next round's clocks start now, and its evaluators' jobs
            await self._event(nxt, R.PrevSettled())
        # Blocking, the late members' units are with them until the next round merges them: a
        # resume from here trains them again.
        self.late = result.late
        held = [u for w in result.late.values() for u in w.units]
        self.positions[rd.rnd] = (
            UnitQueue.with_pending(self.queue.position(), held)
            if nxt is None
            else UnitQueue.with_pending(nxt.queue_before, result.given_back)
        )
        r = self.recipe
        if checkpoint and not self.stopping and ((rd.rnd + 1) % r.checkpoint_every == 0 or rd.rnd == r.rounds - 1):
            # A round given up changed nothing: the checkpoint due is the last agreed θ's.
            due = self.swarm.newest() if result.abandoned else rd.rnd
            if due >= 0 and due != self.last_checkpoint:
                self._start_checkpoint(due)

    def _check_silence(self, now: float, rnd: int) -> None:
        """Drop every node silent for our patience, stale_after_s in a swarm of a few (its
        connection may look open: a sleeping laptop does not say goodbye)."""
        patience = self.patience()
        for i in list(self.swarm.members):
            silent = now - self.swarm.last_seen.get(i, now)
            if silent > patience:
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
        if list(ck.state_flat) != list(self.state_names):
            raise CoordinatorError(
                f"{ck.path}: holds the state {list(ck.state_flat)}, sync rule {self.recipe.sync} keeps {list(self.state_names)}"
            )
        theta = ck.theta_flat
        arrays = (theta, *ck.state_flat.values())  # mapped from the files, not read
        got, want = checksum(*arrays), ck.manifest.get("checksum")
        if want not in (got, stream_checksum(*arrays)):  # (a checkpoint from before drift-state/1)
            raise CoordinatorError(f"{ck.path}: θ and outer state do not match the checksum in its manifest")
        if theta.size != self.n_params:
            raise CoordinatorError(f"{ck.path}: θ has {theta.size} values, the nodes' model {self.n_params}")
        if ck.manifest.get("frozen_base", "") != self.frozen:
            raise CoordinatorError(f"{ck.path}: checkpoint needs another frozen base than the nodes loaded")
        layout = ParamLayout(ck.names, ck.shapes, int(ck.manifest.get("buffers", 0)))
        if self.layout and layout.digest() != self.layout:
            raise CoordinatorError(f"{ck.path}: its tensor names, shapes or order are not those of the nodes' model")
        self.state.publish(ck.round, arrays, got, layout)
        self.swarm.agreed(ck.round, got, ())
        queue.restore(ck.manifest["queue"])
        self.samples_seen = self.samples_at[ck.round] = ck.manifest.get("samples_seen", 0)
        self.positions[ck.round] = ck.manifest["queue"]
        self.last_checkpoint, self.last_checkpoint_path = ck.round, ck.path
        self.note("resumed", round=ck.round, path=str(ck.path), samples_seen=self.samples_seen)
        return ck.round + 1

    def _start_checkpoint(self, rnd: int, timeout: float = CHECKPOINT_FETCH_S) -> None:
        """Write the checkpoint of round `rnd` in the background: the rounds go on meanwhile (the
        nodes serve that θ until their next outer step; a transfer begun goes on from a copy).
        `timeout`: per node asked (see checkpoint)."""
        if self._saver is not None and not self._saver.done():
            log.warning("the checkpoint of an earlier round is still being written: none for round %d", rnd)
            self._skipped = rnd
            return
        self._saver = asyncio.ensure_future(self._save(rnd, timeout))

    async def _save(self, rnd: int, timeout: float) -> Path | None:
        """The checkpoint of round `rnd`, or, when its holders have moved on, of the newest agreed
        round (rules.checkpoint_instead); its path, None when none was written."""
        tries = 0
        while (path := await self.checkpoint(rnd, self._checkpoint_meta(rnd), timeout)) is None:
            tries += 1
            newer = rules.checkpoint_instead(rnd, self.swarm.newest(), tries, self._saves_over())
            if newer is None:
                return None
            log.warning("checkpointing round %d in place of round %d", newer, rnd)
            rnd = newer
        return path

    def _saves_over(self) -> bool:
        """No checkpoint is tried any more: the run is stopping, or its dir failed (a full disk
        would only fail again)."""
        return self.stopping or (self.monitor is not None and self.monitor.error is not None)

    def _checkpoint_meta(self, rnd: int) -> dict:
        """What a checkpoint of round `rnd` records beside θ and the outer state."""
        return {
            "checksum": self.swarm.checksums[rnd],
            "samples_seen": self.samples_at[rnd],
            "commit": self.commit,
            "recipe_hash": recipe_hash(self._model_fields()),
            "frozen_base": self.frozen,  # the digest of the frozen parameters this θ needs ("" none)
            **self._model_fields(),  # what builds the model again (drift sample)
            "run_id": self.run_id,
            "queue": self.positions[rnd],
            "recipe": self.recipe.model_dump(mode="json", exclude={"wandb"}),  # --resume says what changed
        }

    async def _wait_checkpoint(self) -> None:
        if self._saver is not None:
            await asyncio.wait({self._saver})

    async def checkpoint(self, rnd: int, meta: dict, timeout: float = CHECKPOINT_FETCH_S) -> Path | None:
        """Stream θ and the outer state after round `rnd` from a node straight into a checkpoint
        (checksum-verified before it is committed; never all in memory). None (and
        `checkpoint_error` says why) when no node could hand it over. The donors are
        Swarm.donors (never one that left or whose connection is gone), at most DONOR_TRIES of
        them, pieces from several at once, each given up once it stalls (fetch_state; `timeout`
        bounds connecting to one)."""
        if self.last_checkpoint == rnd:
            return self.last_checkpoint_path
        if rnd not in self.swarm.checksums or self.endpoint is None:
            return None
        donors = [self.swarm.members[i].info.ring_ticket for i in self.swarm.donors(rnd)[:DONOR_TRIES]]
        if self.state.current is not None and self.state.current.round == rnd:
            donors.append(self.endpoint.ticket())  # a resumed checkpoint we serve ourselves
        writers: list[CheckpointWriter] = []

        def sink(layout: ParamLayout):
            if self.layout and layout.digest() != self.layout:  # the names, shapes, order the nodes built
                raise StateError("the peer's tensor names, shapes or order are not the model's")
            for w in writers:
                w.abort()
            writers.append(
                CheckpointWriter(self.run_dir / "checkpoints", rnd, layout.names, layout.shapes, self.state_names)
            )
            meta["buffers"] = layout.n_buffers
            return writers[-1].write

        try:
            if not donors:
                raise StateError("no connected node holds it")
            await fetch_state(
                self.endpoint,
                donors,
                rnd,
                self.swarm.checksums[rnd],
                sink,
                size=self.n_params,
                timeout=timeout,
                arrays=1 + len(self.state_names),
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
            if isinstance(e, OSError) and self.monitor:  # our disk (full, read-only), not a peer: the run ends
                self.monitor.fail(f"cannot write {self.run_dir / 'checkpoints'}: {e.strerror or e}")
            return None
        self.last_checkpoint, self.last_checkpoint_path = rnd, path
        self.note("checkpoint", round=rnd, path=str(path))
        return path

    async def interrupt(self, reason: str, per_donor_s: float = INTERRUPT_FETCH_S) -> str:
        """A clean stop (Ctrl-C): keep the newest finished round we can get, tell every node why;
        a holder of θ that hangs is given up after `per_donor_s`. Returns one line saying what
        --resume will continue from."""
        self.stopping = True
        await self._wait_checkpoint()  # a save in flight ends first
        await self._finish_reduce()
        newest = max((r for r in self.swarm.checksums if r >= 0), default=None)
        path = None
        if newest is not None:
            # Bounded: the nodes may have died with us (a terminal's Ctrl-C reaches them too). One
            # that hangs costs per_donor_s, then the next holder is asked.
            self._start_checkpoint(newest, timeout=per_donor_s)
            size = 4 * (1 + len(self.state_names)) * self.n_params
            bound = (DONOR_TRIES + 1) * per_donor_s + size / STATE_MIN_RATE
            try:
                path = await asyncio.wait_for(asyncio.shield(self._saver), bound)
            except asyncio.TimeoutError:
                self.checkpoint_error = f"timed out after {bound:.0f}s"
        self._finished = True
        await self._last_word(list(self.ready.values()), P.TrainingCancel(reason=reason), timeout=5.0)
        if newest is None and self.resume is not None:
            return f"no round finished since the resume; --resume continues from round {self.resume.round} ({self.resume.path})"
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
        # (A ring of two that has not committed its step yet holds the round before: nothing to wait for.)
        for cur in [rd for rd in self.live if rd.ring is not None and not rd.settled and not rd.announcing()]:
            deadline = time.monotonic() + INTERRUPT_FETCH_S
            while not cur.agreed() and time.monotonic() < deadline:
                if (ev := await self._next_event(deadline - time.monotonic())) is None:
                    break
                peer, msg = ev
                if peer.id in self.swarm.members and isinstance(msg, P.RoundDone) and msg.round == cur.rnd:
                    await self._event(cur, R.Message(peer.id, msg))
            if cur.agreed():
                await self._settle(cur, checkpoint=False)

    def _record(self, result: RoundResult) -> None:
        self.results.append(replace(result, trained=[], given_back=[], late={}, bytes_sent={}))
        self.samples_seen += result.samples
        self.samples_at[result.round] = self.samples_seen

    async def _last_word(self, peers: list[Peer], msg: P._Msg, timeout: float = 10.0) -> None:
        """Send a final message, then wait (briefly) for each node to hang up: closing at once
        could discard the message while it is still in flight. Nodes still loading the task get
        it too (a node that joins as the run ends learns that it ended)."""
        self._finished = True
        loading = list(self._handshaking.values())
        await asyncio.gather(
            *(self.send(p, msg) for p in peers),
            *(ch.send_frame(P.encode(msg), timeout=5.0) for ch in loading),
            return_exceptions=True,
        )
        left: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(left) < len(peers) and time.monotonic() < deadline:
            if (ev := await self._next_event(max(0.05, deadline - time.monotonic()))) is None:
                break
            if ev[1] is None:
                left.add(ev[0].id)
        while any(ch in self._handshaking.values() for ch in loading) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _hand_final_theta(self, timeout: float) -> list[str]:
        """Members that do not hold the final θ (they evaluated or sat out the last round) take
        it before the run ends, as a job to evaluate it: every node leaves with the swarm's
        model (an own loop's model object is what its script saves next). When none does and the
        last round has no val loss (the member asked for it was excluded in that round), the
        fastest member evaluates the final θ. The names of those that still do not hold it."""
        last = self.swarm.newest()
        behind = [
            p
            for i, p in self.swarm.members.items()
            if self.swarm.state_round.get(i) != last and i not in self.swarm.evaluating  # (those: out of time)
        ]
        if not behind and self.results and self.results[-1].val_loss is None and last not in self.vals:
            fastest = max(self.swarm.members, key=lambda i: self.swarm.speed.get(i, 0.0), default=None)
            behind = [self.swarm.members[fastest]] if fastest is not None else []
        for p in behind:
            await self.assign_evaluation(p, last, self.queue.epoch)
        await self._finish_evaluations(timeout)
        return sorted(p.info.name for i, p in self.swarm.members.items() if self.swarm.state_round.get(i) != last)

    async def _finish_evaluations(self, timeout: float) -> None:
        """Give evaluations still in flight a chance to land before the run ends."""
        deadline = time.monotonic() + timeout
        while self.swarm.evaluating and time.monotonic() < deadline:
            if (ev := await self._next_event(0.5)) is None:
                continue
            peer, msg = ev
            if peer.id not in self.swarm.members:
                self.swarm.evaluated(peer.id)
            elif msg is None:  # its connection ended: it evaluates nothing more, and is not asked again
                self.drop(peer.id, peer.gone or "connection closed", self.swarm.newest())
            elif isinstance(msg, P.EvalResult):
                self.record_eval(peer.id, msg)
            elif isinstance(msg, P.Heartbeat) and msg.held is not None:
                self.swarm.holds(peer.id, msg.held)
            elif isinstance(msg, P.AskForMoreWork) and peer.id in self.swarm.evaluating:
                if self.swarm.state_round.get(peer.id) == self.swarm.newest():
                    self.swarm.evaluated(peer.id)  # it holds the final θ (a loop without evaluate)
                else:  # its job named a θ no donor holds any more: the final one, then
                    await self.assign_evaluation(peer, self.swarm.newest(), self.queue.epoch)
        if self.swarm.evaluating:
            log.warning("ending without %d evaluation(s) still running", len(self.swarm.evaluating))

    def record_eval(self, i: str, msg: P.EvalResult) -> bool:
        """Record an evaluator's result; False if it is not the answer to a job we gave."""
        if i not in self.swarm.evaluating or msg.after_round not in self.swarm.checksums:
            return False  # not a job we gave (or for a θ that never was): counts for nothing
        self.swarm.evaluated(i)
        self.swarm.holds(i, msg.after_round)  # it took that θ for the job we gave
        if i in self.swarm.members:
            self.swarm.claimed_speed(i, msg.samples_per_s)
        self.record_val(msg.after_round, msg.val_loss, msg.val_samples, msg.metrics)
        return True

    def record_val(self, after_round: int, val_loss: float, val_samples: int, metrics: dict[str, float]) -> None:
        """The val loss of θ after round `after_round` (-1: the initial θ)."""
        if after_round in self.vals:  # the first answer stands: a second one cannot overwrite it
            return
        self.vals[after_round] = val_loss
        if after_round < 0:
            self.initial_val_loss = val_loss
            self.note("initial", val_loss=val_loss, val_samples=val_samples, metrics=metrics)
        else:
            self.note("val", after_round=after_round, val_loss=val_loss, val_samples=val_samples, metrics=metrics)

    # --- membership ----------------------------------------------------------------------------

    async def _admit_late_joiners(self, rnd: int) -> None:
        """Nodes admitted during the last round join now; they fetch θ from a peer first."""
        async with self._joined:
            joining, self.joining = self.joining, []
        entered: list[str] = []
        for p in joining:
            if _task_of(p) != (
                self.swarm.checksums[-1],
                self.frozen,
                self.n_train,
                self.n_params,
                self.layout,
            ):
                why = "this node loaded a different task (initial θ or dataset differs)"
                await self.send(p, P.TrainingCancel(reason=why))
                self.note("node_refused", node_id=p.id, reason=why)
                continue
            self.swarm.enter(p, -1)
            entered.append(p.id)
            self.note("node_entered", node_id=p.id, name=p.info.name, round=rnd)
        if entered:  # everyone learns the new membership (each checks a newcomer as they first talk)
            members = list(self.swarm.members.values())
            ids = [p.id for p in members]
            new = set(entered)
            ready = ready_message(self.admission, ids, self.recipe.auth_threshold)
            self._will_tell(len(ids))
            await self.broadcast([p for p in members if p.id in new], ready)  # a newcomer: all of it
            changed = members_changed(self.told, ids)
            await self.broadcast([p for p in members if p.id not in new], changed)  # the others: what changed
            self.told = set(ids)

    def state_source(self, node: str, force: bool = False) -> P.StateSource | None:
        """Where `node` gets the swarm's newest agreed θ (Swarm.state_source), with us as the last
        donor when we serve that θ ourselves (a resumed checkpoint)."""
        own = None
        if self.state.current is not None and self.state.current.round == self.swarm.newest():
            own = self.endpoint.ticket()
        return self.swarm.state_source(node, force, own)

    # --- one round -----------------------------------------------------------------------------

    def drop(self, i: str, why: str, rnd: int) -> None:
        """Remove a node from the swarm; every live round redoes its work (and its ring)."""
        if i not in self.swarm.members:
            return
        for rd in self.live:
            rd.step(R.Left(i), time.monotonic())  # (its work is redone: nothing to send)
        peer = self.swarm.leave(i)
        if self.data_holders.pop(i, None) is not None:
            self._holders_changed()
        log.warning("node %s (%s) dropped: %s", peer.info.name, i[:10], why)
        self.note("node_left", node_id=i, name=peer.info.name, reason=why, round=rnd)
        if i in self.swarm.banned:
            self._spawn(self._expel(peer, self.swarm.banned[i]))
        else:
            peer.ch.close(why)
        if self.monitor:
            self.monitor.nodes.pop(i, None)

    async def _expel(self, peer: Peer, why: str) -> None:
        """A node out for the run is told why, so it leaves instead of rejoining; its connection
        closes a moment later either way."""
        await self.send(peer, P.TrainingCancel(reason=f"excluded from this run: {why}"))
        await asyncio.sleep(2.0)
        peer.ch.close(why)

    def note(self, kind: str, **fields) -> None:
        if self.monitor:
            self.monitor.event(kind, **fields)

    async def assign_evaluation(self, peer: Peer, rnd: int, epoch: int) -> None:
        """Send an evaluator its next job: the val loss of the newest agreed θ."""
        self.swarm.evaluates(peer.id)
        await self.send(
            peer,
            P.ShardAssignment(round=rnd, epoch=epoch, units=[], role="evaluate", state=self.state_source(peer.id)),
        )

    async def send(self, peer: Peer, msg: P._Msg, frame: bytes | None = None) -> bool:
        """Send one message (`frame`: it encoded already); never raises. A node whose stream fails
        (it stopped reading, a write timed out) is dropped: its connection is closed here, and the
        end of it drops the node with one line, in the round loop like any connection that ends."""
        try:
            await peer.ch.send_frame(P.encode(msg) if frame is None else frame)
            return True
        except Exception as e:
            why = f"sending {msg.type} to it failed ({_why(e)})"
            if peer.broken is None:
                peer.broken = why
                log.warning("node %s (%s): %s; dropping it", peer.info.name, peer.id[:10], why)
                peer.ch.close(why)
            return False

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self.data is not None:
            self.data.close()
        for p in list(self.ready.values()):  # (connections end meanwhile)
            await p.ch.finish()
        if self.endpoint:
            await self.endpoint.close()
