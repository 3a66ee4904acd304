"""A swarm in virtual time: drift's own round logic (drift.round.Round over drift.swarm.Swarm and
drift.scheduler.UnitQueue, unmodified) driven by simulated nodes on a simulated clock, for
questions about how rounds are cut that need hundreds of nodes and many rounds (goodput under
failures: benchmarks/bench_goodput.py). Not shipped.

What stands in: the nodes (each trains its granted units at its own speed, asks ahead, stops at
the next inner step on StopRound, and reports as drift.inner does), the wire (a fixed one-way
latency), the all-reduce (every ring member reports θ `sync_s` after BarrierReady) and the
coordinator's shell (this file applies the round's actions as drift.coordinator does). Messages
go through the protocol's codec. Time is virtual: a run of 256 nodes × 20 rounds takes seconds.

Failures, drawn per round and node from one seed: *lost* (the node goes silent at a random
moment of its training; the coordinator drops it after `stale_after_s` of silence, as its
silence check does; a replacement of the same speed joins at the next round) and *slowed* (the
node trains at a third of its speed for the whole round). Losses during the all-reduce are not
modelled (the ring's retries are tested on real processes).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field, fields

from drift import protocol as P
from drift import round as R
from drift import rules
from drift.recipe import Recipe
from drift.round import Round
from drift.scheduler import UnitQueue
from drift.swarm import Peer, Swarm


@dataclass
class Failures:
    """Per round and node: the chance it is lost, and the chance it is slowed (by `slowdown`)."""

    lost: float = 0.0
    slowed: float = 0.0
    slowdown: float = 3.0


@dataclass
class SimNode:
    id: str
    base: float  # samples/s when not slowed
    speed: float = 0.0  # this round's
    queue: deque = field(default_factory=deque)  # granted units not started
    cur: P.WorkUnit | None = None
    t_cur: float = 0.0  # when the unit in training started
    gen: int = 0  # bumps when a scheduled finish is void (StopRound)
    asked: bool = False
    no_more: bool = False
    stopping: bool = False
    synced: bool = True
    trained: list = field(default_factory=list)
    returned: list = field(default_factory=list)
    steps: int = 0
    rnd: int = -1
    lost_at: float = math.inf
    lost: bool = False
    next: P.ShardAssignment | None = None  # the next round's, while it still trains a round it is late in


@dataclass
class RunStats:
    """What rounds did, summed (VirtualSwarm.run: over every round but the last)."""

    rounds: int = 0
    seconds: float = 0.0  # virtual wall time
    samples: int = 0  # samples whose training reached θ (the rounds' counted samples)
    compute: float = 0.0  # samples the swarm could have trained meanwhile (each node's speed × time alive)
    lost: int = 0
    slowed: int = 0
    abandoned: int = 0
    cut: int = 0  # nodes the rounds went on without (deadline or quorum), by the round's notes
    merged: int = 0  # samples trained in a round that went on without their node, merged into its next

    @property
    def goodput(self) -> float:
        return self.samples / self.compute if self.compute else 0.0

    def add(self, other: RunStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class Host:
    n_params = 10**6  # θ's size: only the reduce deadline reads it (REDUCE_DEADLINE_S and a little more)

    def __init__(self, swarm: Swarm):
        self.s = swarm

    def state_source(self, node: str, force: bool = False) -> P.StateSource | None:
        return self.s.state_source(node, force)


class VirtualSwarm:
    """`n` nodes of speeds `speeds` (samples/s) running `recipe` on the real round logic."""

    def __init__(
        self,
        recipe: Recipe,
        speeds: list[float],
        failures: Failures,
        seed: int = 0,
        latency_s: float = 0.02,
        sync_s: float = 1.0,
        ticket: str = "t",
    ):
        """`ticket`: each node's ring ticket is it and the node's number (as long as a real one,
        where the bytes sent matter: `sent`)."""
        self.r, self.fail, self.latency, self.sync_s, self.ticket = recipe, failures, latency_s, sync_s, ticket
        self.sent: Counter[str] = Counter()  # bytes the coordinator sent, by message type
        self.rng = random.Random(seed)
        self.s = Swarm(recipe)
        self.host = Host(self.s)
        self.queue = UnitQueue(10**9, recipe.unit_samples)
        self.now = 0.0
        self.events: list = []
        self.seq = itertools.count()
        self.nodes: dict[str, SimNode] = {}
        self.names = itertools.count()
        self.stats = RunStats()
        self.rd: Round | None = None
        self.late: dict = {}  # the last round's late members (RoundResult.late)
        for sps in speeds:
            self.enter(sps)
        self.s.agreed(-1, "theta-1", tuple(self.s.members))

    # --- the swarm ------------------------------------------------------------------------------

    def enter(self, sps: float) -> None:
        k = next(self.names)
        i = f"{k:064x}"
        info = P.NodeInfo(node_id=i, name=f"n{k}", backend="numpy", device="cpu", ring_ticket=f"{self.ticket}{k}")
        self.s.enter(Peer(info=info, ch=None), -1)  # type: ignore[arg-type]  # (this file sends)
        self.s.speed[i] = sps  # its calibration, exact here
        self.s.seen(i, self.now)
        self.nodes[i] = SimNode(i, sps)

    def at(self, t: float, *event) -> None:
        heapq.heappush(self.events, (t, next(self.seq), event))

    # --- the coordinator's shell ----------------------------------------------------------------

    def apply(self, actions: list[R.Action]) -> bool:
        settled = False
        s = self.s
        for a in actions:
            if R.write_swarm(s, a, self.rd.rnd):
                continue
            match a:
                case R.Send(nodes=nodes, msg=msg):
                    wire = P.encode(msg)
                    self.sent[msg.type] += len(wire) * len(nodes)
                    for i in nodes:
                        self.at(self.now + self.latency, "to_node", i, wire)
                case R.Note(kind=kind):
                    self.stats.cut += kind in ("deadline", "late")
                case R.GiveBack(units=units):
                    self.queue.give_back(list(units))
                case R.Drop(node=i):
                    self.leave(i)
                case R.Settled():
                    settled = True
        return settled

    def leave(self, i: str) -> None:
        if i in self.s.members:
            self.apply(self.rd.step(R.Left(i), self.now))
            self.s.leave(i)

    def to_coordinator(self, i: str, msg: P._Msg) -> None:
        self.at(self.now + self.latency, "to_coord", i, P.encode(msg))

    # --- a node ---------------------------------------------------------------------------------

    def on_node(self, n: SimNode, msg: P.Message) -> None:
        if n.lost:
            return
        match msg:
            case P.ShardAssignment(role="train") if not n.synced:  # late: it finishes that round first
                n.next = msg
            case P.ShardAssignment(role="train"):
                n.rnd, n.synced, n.no_more, n.stopping, n.asked = msg.round, False, msg.no_more, False, False
                n.trained, n.returned, n.steps = [], [], 0
                n.queue.extend(msg.units)
                if not msg.units and not msg.planned:
                    n.no_more = True
                self.advance(n)
            case P.AssignNext(round=rnd, units=us) if rnd == n.rnd and not n.synced:
                n.asked, n.no_more = False, msg.no_more
                (n.returned if n.stopping else n.queue).extend(us)
                self.advance(n)
            case P.MoreWork(round=rnd) if rnd == n.rnd and not n.synced:
                n.no_more = False
                self.advance(n)
            case P.NoMoreWork(round=rnd) if rnd == n.rnd and not n.synced:
                n.asked, n.no_more = False, True
                self.advance(n)
            case P.StopRound(round=rnd) if rnd == n.rnd and not n.synced and not n.stopping:
                n.stopping = True
                if n.cur is not None:  # the step in training ends, then the unit is cut there
                    step = self.r.batch_size / n.speed
                    k = min(math.floor((self.now - n.t_cur) / step) + 1, (n.cur.hi - n.cur.lo) // self.r.batch_size)
                    n.gen += 1
                    self.at(n.t_cur + k * step, "cut", n.id, n.gen, k)
                else:
                    self.advance(n)
            case P.BarrierReady(round=rnd, ring_epoch=e):  # (sent to the ring's members only)
                done = P.RoundDone(round=rnd, ring_epoch=e, checksum=f"theta{rnd}")
                self.at(self.now + self.sync_s, "send", n.id, P.encode(done))

    def advance(self, n: SimNode) -> None:
        """Start the next unit, ask ahead, or sync once nothing is left."""
        if n.cur is not None or n.synced:
            return
        if n.stopping:
            n.returned += list(n.queue)
            n.queue.clear()
        if n.queue:
            n.cur, n.t_cur = n.queue.popleft(), self.now
            self.at(self.now + (n.cur.hi - n.cur.lo) / n.speed, "unit", n.id, n.gen)
            if not n.queue and not n.no_more and not n.asked:  # the last unit in hand: ask ahead
                n.asked = True
                self.to_coordinator(n.id, P.AskForMoreWork(round=n.rnd))
            return
        if not n.no_more and not n.stopping:
            if not n.asked:
                n.asked = True
                self.to_coordinator(n.id, P.AskForMoreWork(round=n.rnd))
            return
        if n.asked:  # a grant may be on its way: it goes back with the rest
            return
        n.synced = True
        if n.next is not None:
            self.at(self.now, "to_node", n.id, P.encode(n.next))
            n.next = None
        trained = sum(u.hi - u.lo for u in n.trained)
        self.to_coordinator(
            n.id,
            P.BarrierSync(
                round=n.rnd,
                samples=trained,
                steps=n.steps,
                loss=1.0,
                trained=n.trained,
                returned=n.returned,
                delta_norm=float(n.steps),
            ),
        )

    def finished(self, n: SimNode, k: int | None = None) -> None:
        """The unit in training ends (whole, or cut after k steps)."""
        u, bs = n.cur, self.r.batch_size
        k = (u.hi - u.lo) // bs if k is None else k
        n.cur = None
        hi = min(u.hi, u.lo + k * bs)
        if k:
            done = u.model_copy(update={"hi": hi})
            n.trained.append(done)
            n.steps += k
            self.to_coordinator(
                n.id, P.TrainProgress(round=n.rnd, units=[done], steps=k, loss=1.0, samples_per_s=n.speed)
            )
        if hi < u.hi:
            n.returned.append(u.model_copy(update={"lo": hi}))
        self.advance(n)

    # --- the run --------------------------------------------------------------------------------

    def run(self, rounds: int) -> RunStats:
        """Runs `rounds` of the recipe's rounds; their totals, but for the recipe's last round: it
        is never cut (it trains the rest of the budget, what earlier cuts handed back included),
        so it is not a round of the steady state."""
        total = RunStats()
        for rnd in range(rounds):
            self.round(rnd)
            if rnd < self.r.rounds - 1:
                total.add(self.stats)
        return total

    def round(self, rnd: int) -> None:
        """One round, from the failures it draws to its settling; what it did in self.stats."""
        t0, self.stats = self.now, RunStats()
        for i in [i for i, n in self.nodes.items() if n.lost]:  # a replacement for each lost node
            if i in self.s.members:  # (the round settled before its silence check dropped it)
                self.s.leave(i)
            self.enter(self.nodes.pop(i).base)
        for n in self.nodes.values():
            slowed = self.rng.random() < self.fail.slowed
            lost = self.rng.random() < self.fail.lost
            n.speed = n.base / self.fail.slowdown if slowed else n.base
            # Lost at a moment of the round's training, as its share of the work would take it.
            expected = self.r.round_samples / sum(x.base for x in self.nodes.values())
            n.lost_at = t0 + self.rng.random() * expected if lost else math.inf
            self.stats.slowed += slowed
            self.stats.lost += lost
            if lost:
                self.at(n.lost_at, "lose", n.id)
        taken = self.queue.take_round(R.budget(self.s, self.queue.pending_samples()))
        carried = self.late
        self.rd = Round(self.s, self.host, rnd, taken, self.now, late=carried)
        settled = self.apply(self.rd.start(0))
        tick_every = max(rules.clock_interval(len(self.s.members)), 0.05)
        self.at(self.now + tick_every, "tick")
        while not settled:
            t, _, ev = heapq.heappop(self.events)
            self.now = max(self.now, t)
            match ev:
                case ("tick",):
                    hb = self.r.heartbeat_s
                    for i in list(self.s.members):
                        n = self.nodes[i]
                        if not n.lost:  # its heartbeats: the last one came at a multiple of heartbeat_s
                            self.s.seen(i, max(self.s.last_seen.get(i, 0.0), hb * math.floor(self.now / hb)))
                        elif self.now - self.s.last_seen[i] > self.r.stale_after_s:  # the silence check
                            self.leave(i)
                    settled = self.apply(self.rd.step(R.Tick(), self.now))
                    self.at(self.now + tick_every, "tick")
                case ("to_coord", i, wire) if i in self.s.members:
                    self.s.seen(i, self.now)
                    settled = self.apply(self.rd.step(R.Message(i, P.decode(wire)), self.now))
                case ("to_node", i, wire) if i in self.nodes:
                    self.on_node(self.nodes[i], P.decode(wire))
                case ("unit", i, gen) if i in self.nodes and self.nodes[i].gen == gen and not self.nodes[i].lost:
                    self.finished(self.nodes[i])
                case ("cut", i, gen, k) if i in self.nodes and self.nodes[i].gen == gen and not self.nodes[i].lost:
                    self.finished(self.nodes[i], k)
                case ("send", i, wire) if i in self.nodes and not self.nodes[i].lost:
                    self.at(self.now + self.latency, "to_coord", i, wire)
                case ("lose", i) if i in self.nodes:
                    if self.nodes[i].synced:  # it reached the barrier first: not lost this round
                        self.stats.lost -= 1
                        self.nodes[i].lost_at = math.inf
                    else:
                        self.nodes[i].lost = True
        result, actions = self.rd.finish(self.now)
        self.late = result.late
        self.apply(actions)
        self.events = [e for e in self.events if e[2][0] != "tick"]  # (the next round ticks anew)
        heapq.heapify(self.events)
        self.stats.rounds += 1
        self.stats.seconds += self.now - t0
        self.stats.abandoned += result.abandoned is not None
        self.stats.samples += 0 if result.abandoned else result.samples
        counted = set(result.trained)
        self.stats.merged += sum(u.hi - u.lo for w in carried.values() for u in w.units if u in counted)
        for n in self.nodes.values():
            self.stats.compute += n.speed * (min(self.now, n.lost_at) - t0)
