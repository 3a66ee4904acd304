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
from dataclasses import dataclass, field
from pathlib import Path

from drift import protocol as P
from drift.monitor import Monitor, NodeView
from drift.recipe import Recipe
from drift.scheduler import UnitQueue, split_proportional
from drift.transport import CONTROL_ALPN, MAX_CONTROL_FRAME, Channel, Endpoint, NetworkMode, TransportError

log = logging.getLogger("drift.coord")

HANDSHAKE_TIMEOUT = 30.0
LOAD_TIMEOUT = 600.0  # a node may have to import torch and build the model first


class CoordinatorError(Exception):
    """The run cannot go on; str() is the one line shown to the user."""


@dataclass
class Peer:
    info: P.NodeInfo
    ch: Channel
    commit: P.RepoCommit | None = None
    samples_total: int = 0

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

    def __post_init__(self) -> None:
        self.endpoint: Endpoint | None = None
        self.ready: dict[str, Peer] = {}
        self.events: asyncio.Queue[tuple[Peer, P.Message | None]] = asyncio.Queue()
        self._joined = asyncio.Condition()
        self._started = False
        self._finished = False
        self._tasks: set[asyncio.Task] = set()
        self.results: list[RoundResult] = []
        self.initial_val_loss: float | None = None
        self.rejected: list[str] = []  # why connections were dropped (also logged)

    # --- serving connections -------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and start accepting; returns the join ticket."""
        self.endpoint = await Endpoint.bind(self.mode, alpns=(CONTROL_ALPN,))
        self._spawn(self._accept_loop())
        return self.endpoint.ticket()

    def _spawn(self, coro) -> None:  # noqa: ANN001
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        assert self.endpoint is not None
        while True:
            try:
                _alpn, conn = await self.endpoint.accept()
            except TransportError:
                return
            self._spawn(self._serve(conn))

    def _drop(self, ch: Channel | None, conn, why: str) -> None:  # noqa: ANN001
        peer = str(conn.remote_id())[:10]
        log.warning("dropping connection from %s: %s", peer, why)
        self.rejected.append(why)
        if self.monitor:
            self.monitor.event("connection_dropped", peer=peer, reason=why)
        (ch.close(why) if ch else conn.close(1, why.encode()[:100]))

    async def _serve(self, conn) -> None:  # noqa: ANN001 - iroh.Connection
        ch: Channel | None = None
        try:
            ch = await Endpoint.accept_channel(conn, timeout=HANDSHAKE_TIMEOUT)
            info = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=HANDSHAKE_TIMEOUT))
            if not isinstance(info, P.NodeInfo):
                raise P.ProtocolError(f"expected NodeInfo first, got {info.type}")
            if info.node_id != ch.peer_id:
                raise P.ProtocolError("NodeInfo.node_id is not the id of the connecting endpoint")
            if self._started:
                await ch.send_frame(P.encode(P.TrainingCancel(
                    reason="the run has already started; late join is not supported yet")))
                raise P.ProtocolError("joined after the run started")
            peer = Peer(info, ch)
            await ch.send_frame(P.encode(P.TrainConfig(run_id=self.run_id, recipe=self.recipe.model_dump(mode="json"),
                                                       commit=self.commit)))
            rc = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=LOAD_TIMEOUT))
            if not isinstance(rc, P.RepoCommit):
                raise P.ProtocolError(f"expected RepoCommit, got {rc.type}")
            peer.commit = rc
            async with self._joined:
                self.ready[peer.id] = peer
                self._joined.notify_all()
            if self.monitor:
                self.monitor.nodes[peer.id] = NodeView(info.name, info.device)
                self.monitor.event("node_joined", node_id=peer.id, name=info.name, device=info.device,
                                   backend=info.backend, commit=rc.commit)
        except (P.ProtocolError, TransportError) as e:
            self._drop(ch, conn, str(e))
            return
        # From here on every frame of this node feeds the round loop.
        try:
            while True:
                msg = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=None))
                self.events.put_nowait((peer, msg))
        except (P.ProtocolError, TransportError) as e:
            if not self._finished:
                self._drop(ch, conn, str(e))
            self.events.put_nowait((peer, None))

    # --- the run -------------------------------------------------------------------------------

    async def _broadcast(self, peers: list[Peer], msg: P._Msg) -> None:
        await asyncio.gather(*(p.ch.send_frame(P.encode(msg)) for p in peers))

    async def wait_for_nodes(self) -> list[Peer]:
        n = self.recipe.min_nodes
        async with self._joined:
            await self._joined.wait_for(lambda: len(self.ready) >= n)
            self._started = True
        return list(self.ready.values())

    async def run(self) -> list[RoundResult]:
        """Wait for min_nodes, then run every round; returns one result per round."""
        peers = await self.wait_for_nodes()
        for what in ("param_checksum", "n_train"):
            seen = {getattr(p.commit, what) for p in peers}
            if len(seen) != 1:
                await self._broadcast(peers, P.TrainingCancel(reason=f"nodes loaded different tasks ({what})"))
                raise CoordinatorError(f"nodes loaded different tasks: {what} differs {sorted(map(str, seen))}")
        await self._broadcast(peers, P.TrainingReady(nodes=[p.id for p in peers]))
        r = self.recipe
        queue = UnitQueue(peers[0].commit.n_train, r.unit_samples)
        for rnd in range(r.rounds):
            if self.monitor:
                self.monitor.round, self.monitor.rounds = rnd + 1, r.rounds
            result = await self._round(rnd, peers, queue)
            self.results.append(result)
        final = self.results[-1].val_loss if self.results else None
        self._finished = True
        await self._broadcast(peers, P.TrainComplete(rounds=r.rounds, final_val_loss=final))
        if self.monitor:
            self.monitor.event("complete", rounds=r.rounds, final_val_loss=final)
        return self.results

    async def _round(self, rnd: int, peers: list[Peer], queue: UnitQueue) -> RoundResult:
        t0 = time.time()
        r = self.recipe
        epoch, units = queue.take(r.units_per_round)
        shares = split_proportional(units, [p.info.samples_per_s or 1.0 for p in peers])
        for i, (p, share) in enumerate(zip(peers, shares)):
            await p.ch.send_frame(P.encode(P.ShardAssignment(round=rnd, epoch=epoch, units=share,
                                                             evaluate=(i == 0))))
        synced: dict[str, P.BarrierSync] = {}
        done: dict[str, P.RoundDone] = {}
        while len(done) < len(peers):
            peer, msg = await self.events.get()
            if msg is None:
                raise CoordinatorError(f"node {peer.info.name} ({peer.id[:10]}) left during round {rnd}")
            if isinstance(msg, P.TrainProgress):
                if self.monitor and peer.id in self.monitor.nodes:
                    v = self.monitor.nodes[peer.id]
                    v.samples_per_s, v.loss, v.samples = msg.samples_per_s, msg.loss, v.samples + msg.samples
                    self.monitor.event("progress", node_id=peer.id, round=rnd, unit=msg.unit,
                                       samples=msg.samples, loss=msg.loss, samples_per_s=msg.samples_per_s)
            elif isinstance(msg, P.AskForMoreWork):
                await peer.ch.send_frame(P.encode(P.NoMoreWork(round=rnd)))
            elif isinstance(msg, P.BarrierSync):
                synced[peer.id] = msg
                if len(synced) == len(peers):
                    total = sum(s.samples for s in synced.values())
                    ring = [P.RingMember(node_id=p.id, ticket=p.info.ring_ticket,
                                         weight=synced[p.id].samples / total if total else 1 / len(peers))
                            for p in peers]
                    await self._broadcast(peers, P.BarrierReady(round=rnd, ring=ring, codec=r.codec))
            elif isinstance(msg, P.RoundDone):
                done[peer.id] = msg
            elif isinstance(msg, (P.Heartbeat, P.Pong)):
                pass
            else:
                log.warning("ignoring unexpected %s from %s in round %d", msg.type, peer.info.name, rnd)
        checksums = {d.checksum for d in done.values()}
        if len(checksums) != 1:
            detail = ", ".join(f"{self.ready[i].info.name}={d.checksum[:12]}" for i, d in done.items())
            await self._broadcast(peers, P.TrainingCancel(reason=f"replicas diverged in round {rnd}"))
            raise CoordinatorError(f"replicas diverged after round {rnd}: {detail}")
        losses = [(s.loss, s.samples) for s in synced.values() if s.loss is not None]
        train_loss = sum(l * n for l, n in losses) / sum(n for _, n in losses) if losses else None
        val = next((d.val_loss for d in done.values() if d.val_loss is not None), None)
        val_start = next((s.val_loss_start for s in synced.values() if s.val_loss_start is not None), None)
        if val_start is not None:
            self.initial_val_loss = val_start
            if self.monitor:
                self.monitor.event("initial", val_loss=val_start)
        samples = sum(s.samples for s in synced.values())
        res = RoundResult(rnd, val, train_loss, checksums.pop(), samples, time.time() - t0)
        if self.monitor:
            self.monitor.val_loss = val
            for pid, d in done.items():
                if pid in self.monitor.nodes:
                    self.monitor.nodes[pid].bytes_sent += d.bytes_sent
            self.monitor.event("round", round=rnd, val_loss=val, train_loss=train_loss, samples=samples,
                               seconds=res.seconds, checksum=res.checksum,
                               bytes_sent=sum(d.bytes_sent for d in done.values()),
                               reduce_s=max(d.reduce_s for d in done.values()),
                               nodes={self.ready[i].info.name: {"samples": s.samples, "steps": s.steps}
                                      for i, s in synced.items()})
        return res

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for p in self.ready.values():
            await p.ch.finish()
        if self.endpoint:
            await self.endpoint.close()
