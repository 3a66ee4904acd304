"""One outer round as the coordinator runs it: grant units, watch progress, cut the round's
tail, enforce deadlines, run the barrier, retry a broken all-reduce, agree on θ's checksum.

The round is driven by events, `Round.step(event, now) -> list[Action]`: a member's control
message (`Message`, one `match`), the clocks (`Tick`, after every message and twice a second), a
member that left (`Left`) and, overlapped, the round before settling (`PrevSettled`) or a member
that takes its θ from that round's Agreed (`CatchingUp`). No I/O, no asyncio, no logging and no
clock inside: the time comes with the event, and what the round decides comes back as actions
(sends, notes, log lines, strikes, bans, drops, speeds, the ring epoch, the agreed θ, `Settled`)
that the Coordinator, its only shell, applies in order. What the round knows of each node is one
record (rules.NodeRound); the decisions over those records are pure functions in drift.rules.
The swarm's state (members, speeds, strikes, checksums, ring epoch) belongs to
drift.swarm.Swarm: the round reads it through a read-only view (SwarmView) and writes nothing
there, nor into the unit queue (the shell takes its units and applies GiveBack) or the round
before: the shell applies each write (Strike, Ban, Measured, ...) by a public method of the Swarm,
between one event and the next. Where a decision needs a write of the same event (a second
strike, a ban), the round counts the actions it has not handed out yet.

Who takes part, in the order a round decides it:
  * evaluators: too slow to train without holding everyone back (rules.evaluators);
  * trainers: everyone else. A trainer that misses its deadline, or whose θ disagrees with the
    majority after the outer step, *sits out*: its units of the round are redone by others, it
    is not in the ring, and next round it fetches θ like a late joiner. It stays a member: a
    node that is slow for a while is not a node that left.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Protocol

from drift import diloco, hierarchy, rules
from drift import protocol as P
from drift.gather import signed_payload
from drift.recipe import Recipe
from drift.ring import MIN_RATE, grid, neighbours, proves_forgery, signer
from drift.ring import links as ring_links
from drift.rules import NodeRound, samples
from drift.scheduler import RoundPlan, Taken, check_accounting
from drift.swarm import Peer, Swarm
from drift.sync import collective, rule_class

MAX_RING_RETRIES = 5
FORGED = "it forwarded ring bytes that their owner did not sign (proven by its own signature)"
EQUIVOCATED = "it sent different payloads to different members of one all-gather (proven by its own signatures)"
FALSE_SUM = "it sent a block payload other than its block computed (proven by its signature and two of its block's)"


class RoundError(Exception):
    """The round cannot finish (nobody left to train, no majority on θ); str() is for the user."""


@dataclass
class RoundResult:
    round: int
    val_loss: float | None
    train_loss: float | None
    checksum: str
    samples: int
    seconds: float
    trained: list[P.WorkUnit] = field(default_factory=list)  # the units whose samples count
    bytes_sent: dict[str, int] = field(default_factory=dict)  # per member that reported θ
    abandoned: str | None = None  # why the all-reduce was given up (θ unchanged)
    given_back: list[P.WorkUnit] = field(default_factory=list)  # what went back to the queue
    late: dict[str, Late] = field(default_factory=dict)  # members it went on without: for the next round


@dataclass
class Late:
    """A member a round went on without (rules.quorum_cut): the units of that round it holds
    (those granted; once its late report is accounted, those it trained). What it trained merges
    into its next round (Round.on_sync); anything else goes back to the queue."""

    units: list[P.WorkUnit]
    reported: bool = False


class Host(Protocol):
    """What a round reads from the coordinator (nothing it writes): where a node gets θ, and how
    many values θ has (the nodes agreed on it when training started)."""

    n_params: int

    def state_source(self, node: str, force: bool = False) -> P.StateSource | None: ...


class SwarmView(Protocol):
    """What a round reads of the swarm (drift.swarm.Swarm is one): nothing here is written by a
    round; the Coordinator applies its actions through the Swarm's methods."""

    @property
    def recipe(self) -> Recipe: ...
    @property
    def members(self) -> Mapping[str, Peer]: ...
    @property
    def speed(self) -> Mapping[str, float]: ...
    @property
    def measured(self) -> Set[str]: ...
    @property
    def state_round(self) -> Mapping[str, int]: ...
    @property
    def checksums(self) -> Mapping[int, str]: ...
    @property
    def evaluating(self) -> Set[str]: ...
    @property
    def ring_epoch(self) -> int: ...
    @property
    def flat_until(self) -> int: ...
    @property
    def poison_suspects(self) -> Set[str]: ...
    @property
    def banned(self) -> Mapping[str, str]: ...

    def name(self, i: str) -> str: ...
    def newest(self) -> int: ...
    def evaluators(self, budget: int) -> set[str]: ...
    def struck_out(self, i: str, rnd: int, more: int = 1) -> bool: ...
    def ticket_news(self, i: str, peers: Iterable[str]) -> dict[str, str]: ...
    def told_order(self, order: list[str]) -> Set[str]: ...


# --- events: what happens to a round ----------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """A control message from member `node` about this round."""

    node: str
    msg: P.Message


@dataclass(frozen=True)
class Tick:
    """The clocks. `may_reduce` False holds the ring back (the round before is still reduced)."""

    may_reduce: bool = True


@dataclass(frozen=True)
class Left:
    """Member `node` left the swarm (dropped, or its connection ended). It returns no actions (the
    shell drops a node where it cannot apply them): what the round decides comes out with its next
    event."""

    node: str


@dataclass(frozen=True)
class PrevSettled:
    """Overlapped: the round before settled; this round's clocks and evaluations start now."""


@dataclass(frozen=True)
class CatchingUp:
    """Overlapped: member `node` is not in this round's ring and trains the next round: it takes
    θ of this round from its Agreed (the next round's CatchUp, handed over by the shell)."""

    node: str


Event = Message | Tick | Left | PrevSettled | CatchingUp


def budget(swarm: SwarmView, owed: int) -> int:
    """The samples a round takes from the queue: the recipe's round_samples and what earlier
    rounds' cuts handed back (`owed`: UnitQueue.pending_samples), trained on top; lockstep:
    inner_steps batches per member."""
    r = swarm.recipe
    return r.round_samples + owed if r.schedule == "steal" else len(swarm.members) * r.inner_steps * r.batch_size


# --- actions: what the round decides, for the Coordinator to apply in order --------------------


@dataclass(frozen=True)
class Send:
    """`msg` to each of `nodes` (at once)."""

    nodes: tuple[str, ...]
    msg: P._Msg


@dataclass(frozen=True)
class Note:
    """One metrics event."""

    kind: str
    fields: dict


@dataclass(frozen=True)
class Drop:
    """Remove `node` from the swarm now (every live round forgets it)."""

    node: str
    why: str


@dataclass(frozen=True)
class Evaluate:
    """Give evaluator `node` its next job: the val loss of the newest agreed θ."""

    node: str


@dataclass(frozen=True)
class RecordVal:
    """The val loss of θ after round `after_round`, reported by the node asked for it."""

    after_round: int
    val_loss: float
    val_samples: int
    metrics: dict


@dataclass(frozen=True)
class RecordEval:
    """An evaluator's result; `again`: if it counts and a newer θ is agreed, a new job at once."""

    node: str
    msg: P.EvalResult
    again: bool


@dataclass(frozen=True)
class Progress:
    """Member `node` finished `samples` of unit `unit` (the dashboard's per-node figures)."""

    node: str
    unit: P.WorkUnit
    samples: int
    loss: float | None
    samples_per_s: float


@dataclass(frozen=True)
class Settled:
    """Every ring member reported θ, or the all-reduce was given up: call Round.finish."""


@dataclass(frozen=True)
class Log:
    """One line of the coordinator's log (`level`: logging.WARNING, logging.INFO)."""

    level: int
    text: str


@dataclass(frozen=True)
class Strike:
    """A strike for `node` in this round (Swarm.strike; the round drops it once it has too many)."""

    node: str
    why: str


@dataclass(frozen=True)
class Ban:
    """`node` is out for the run for `why` (Swarm.ban: it is refused if it comes back)."""

    node: str
    why: str


@dataclass(frozen=True)
class Measured:
    """Our clock measured member `node` at `samples_per_s` on a unit it finished (Swarm.measured_speed)."""

    node: str
    samples_per_s: float | None


@dataclass(frozen=True)
class Slowed:
    """A missed deadline: `node` is at most this fast (Swarm.slowed)."""

    node: str
    samples_per_s: float


@dataclass(frozen=True)
class Told:
    """Member `node` was sent the tickets of `peers` (Swarm.told_tickets)."""

    node: str
    peers: tuple[str, ...]


@dataclass(frozen=True)
class ToldOrder:
    """These members were sent the ring's `order` (Swarm.told_order: later BarrierReadys leave it out)."""

    nodes: tuple[str, ...]
    order: tuple[str, ...]


@dataclass(frozen=True)
class FlatRing:
    """A grid attempt failed with nobody named: the swarm reduces on the flat ring for a while
    (Swarm.distrust_grid)."""


@dataclass(frozen=True)
class NewRingEpoch:
    """The all-reduce is retried as ring epoch `epoch` (Swarm.ring_renewed): older connections are stale."""

    epoch: int


@dataclass(frozen=True)
class Suspects:
    """One of `nodes` sent more into a ring than it reported (Swarm.suspect): the next search starts there."""

    nodes: frozenset[str]


@dataclass(frozen=True)
class Moved:
    """`node` applied an attempt that was given up: it holds no agreed θ (Swarm.moved), so it is nobody's donor."""

    node: str


@dataclass(frozen=True)
class AgreedTheta:
    """θ after round `round` has checksum `checksum`, and `holders` hold it (Swarm.agreed)."""

    round: int
    checksum: str
    holders: tuple[str, ...]


@dataclass(frozen=True)
class TellAgreed:
    """P.Agreed to each of `nodes` with where it gets θ now (the host's state_source, forced),
    after the actions before this one are applied (its donors are those of the new θ)."""

    nodes: tuple[str, ...]
    round: int
    abandoned: bool
    keep: tuple[str, ...] = ()  # late members: they keep `scale` of their own Δ of the round (Agreed.keep)
    scale: float = 0.0


@dataclass(frozen=True)
class GiveBack:
    """The round's units nobody's Δ in θ holds go back to the front of the queue (UnitQueue.give_back)."""

    units: tuple[P.WorkUnit, ...]


@dataclass(frozen=True)
class CatchUp:
    """Overlapped: member `node` takes θ of the round before from its Agreed: the shell hands that
    round CatchingUp(node)."""

    node: str


Action = (
    Send
    | Note
    | Drop
    | Evaluate
    | RecordVal
    | RecordEval
    | Progress
    | Settled
    | Log
    | Strike
    | Ban
    | Measured
    | Slowed
    | NewRingEpoch
    | FlatRing
    | Told
    | ToldOrder
    | Suspects
    | Moved
    | AgreedTheta
    | TellAgreed
    | GiveBack
    | CatchUp
)


def write_swarm(swarm: Swarm, a: Action, rnd: int) -> bool:
    """Apply `a` if it is one of round `rnd`'s writes to the swarm (strikes, bans, speeds, the ring
    epoch, tickets told, suspects, moves, the agreed θ) through the Swarm's methods; False for any other action.
    The shells (the Coordinator, the tests' and the harness's) apply the rest themselves."""
    match a:
        case Strike(node=i):
            swarm.strike(i, rnd)
        case Ban(node=i, why=why):
            swarm.ban(i, why)
        case Measured(node=i, samples_per_s=sps):
            swarm.measured_speed(i, sps)
        case Slowed(node=i, samples_per_s=sps):
            swarm.slowed(i, sps)
        case NewRingEpoch(epoch=epoch):
            swarm.ring_renewed(epoch)
        case FlatRing():
            swarm.distrust_grid(rnd)
        case Told(node=i, peers=peers):
            swarm.told_tickets(i, peers)
        case ToldOrder(nodes=nodes, order=order):
            swarm.ring_told(nodes, order)
        case Suspects(nodes=nodes):
            swarm.suspect(nodes)
        case Moved(node=i):
            swarm.moved(i)
        case AgreedTheta(round=r, checksum=checksum, holders=holders):
            swarm.agreed(r, checksum, holders)
        case _:
            return False
    return True


class Round:
    """The coordinator's side of round `rnd`; driven by start(), step(event, now), finish()."""

    def __init__(
        self,
        swarm: SwarmView,
        host: Host,
        rnd: int,
        taken: Taken,
        now: float,
        prev: Round | None = None,
        late: Mapping[str, Late] | None = None,
    ):
        """`taken`: the round's units, taken from the queue by the shell (UnitQueue.take_round,
        for budget()); `prev`: with the overlapped sync rule, the round before, still in its
        all-reduce; `late`: blocking, the members the round before went on without
        (RoundResult.late): their work of it merges into this round."""
        self.s, self.host, self.rnd, self.r = swarm, host, rnd, swarm.recipe
        self.prev = prev
        self.t0 = self.now = now
        self.out: list[Action] = []  # what the event being handled decided
        self.steal = self.r.schedule == "steal"
        members = swarm.members
        # The last round is not cut at all: a run trains rounds × round_samples samples.
        self.last = rnd == self.r.rounds - 1
        self.budget = taken.budget
        evaluators = swarm.evaluators(self.budget) if self.steal else set()
        # Overlapped: a node that needs θ first (it joined, or its θ is stale) cannot fetch the
        # agreed θ while the round before is being reduced (its donors move on to the next one):
        # it waits this round out and gets θ with that round's Agreed.
        in_flight = prev is not None and not prev.settled
        prev_ring = prev.ring_ids() if prev is not None else set()

        def role(i: str) -> rules.Role:
            if i in (late or {}):  # its Δ holds work of the round before: it trains, so it is merged
                return "train"
            if i in evaluators:
                return "evaluate"
            if in_flight and swarm.state_round.get(i) != swarm.newest() and (prev.ring is None or i not in prev_ring):
                return "wait"
            return "train"

        # Nodes that join later enter the next round: the records are this round's participants.
        self.nodes: dict[str, NodeRound] = {i: NodeRound(role(i), last_progress=now, t_unit=now) for i in members}
        self._part: list[str] | None = None  # part(), kept until a node leaves or sits out
        trainers = {i: swarm.speed[i] for i, n in self.nodes.items() if n.role == "train"}
        self.trainers = rules.planning_speeds(trainers, swarm.measured)
        self.queue_before = taken.before  # the data position before this round took its units
        self.epoch, units = taken.epoch, taken.units
        # Lockstep (for comparison) gives every node the same share, whatever its speed.
        self.plan = RoundPlan.make(
            units, self.trainers if self.steal else dict.fromkeys(self.trainers, 1.0), self.steal
        )
        self.fastest = max(self.trainers, key=self.trainers.get)
        self.give_back: list[P.WorkUnit] = []
        self.carry: dict[str, Late] = {}  # the round before's late members: their work merges here
        for i, w in (late or {}).items():
            if i in members:
                self.carry[i] = Late(list(w.units), w.reported)
            else:  # it left meanwhile
                self.give_back.extend(w.units)
        self.late: dict[str, Late] = {}  # this round's, for the next
        self.t_quorum: float | None = None  # since when members holding the quorum are at the barrier
        self.stop_sent, self.t_stop, self.t_ready = False, 0.0, 0.0
        self.t_ring = 0.0  # when the all-reduce in flight was sent (BarrierReady)
        self.done_after: dict[str, float] = {}  # ring member -> seconds after BarrierReady it reported θ
        # Members' RoundDones of earlier attempts (their own word, on their own connection): the
        # only proof that a member applied an attempt and cannot take part in a retry.
        self.applied_before: dict[str, P.RoundDone] = {}
        self.rings: dict[int, set[str]] = {}  # ring epoch -> its members
        self.drops: list[tuple[str, str]] = []  # nodes to drop once the round settles (node, why): finish()
        self.val_reporter: str | None = None  # the node asked for the val loss (report_val)
        self.poisoned: set[str] = set()  # members that refused this attempt's sum (larger than the norms allow)
        self.bisect_out: list[str] = []  # sat out of this attempt to find who poisons the sum
        self.ring: list[P.RingMember] | None = None
        self.retry_reason: str | None = None  # why the all-reduce in flight must be redone
        self.ring_failed_at: float | None = None
        self.failed: set[str] = set()  # members that reported this attempt failed (RingFailed)
        self.heard_alone: set[str] = set()  # members whose lone failure report had an attempt redone
        # (attempt, suspect, accuser, level): who named whom for bad bytes or silence, at which level
        # of the hierarchy (drift/hierarchy.py; 0 for a ring), and at which level each reporter failed
        self.accusations: list[tuple[int, str, str, int]] = []
        self.failed_at: dict[tuple[int, str], tuple[int, str]] = {}
        self.forgers: set[str] = set()  # ring members proven to forward bytes their owner did not sign
        self.flat = False  # the attempt in flight runs on the flat ring, even at a grid's size
        self.abandoned: str | None = None  # why this round's all-reduce was given up (θ unchanged)
        # A ring of two (BarrierReady.confirm): its members announce θ before applying the step.
        self.confirm = False  # this attempt's members announce first
        self.committed = False  # ... and they announced the same θ: Commit sent, the real RoundDones follow
        self.announced: dict[str, str] = {}  # what the committed members announced
        self.earlier: dict[str, str] = {}  # the announcements that disagreed (then every redo rechecks)
        self.settled = False  # set by finish(): read-only for everyone else
        self.epoch0 = swarm.ring_epoch
        self.attempt = swarm.ring_epoch  # the ring epoch of this round's attempt, once its ring is out

    # --- who is where ---------------------------------------------------------------------------

    def part(self) -> list[str]:
        """The nodes in this round's barrier and ring (worked out again only after one leaves or
        sits out: the clocks ask at every tick, a pass over a thousand records each)."""
        if self._part is None:
            self._part = rules.part(self.nodes)
        return list(self._part)

    def _sits_out(self, n: NodeRound) -> None:
        n.sitting_out, self._part = True, None

    def ring_ids(self) -> set[str]:
        return {m.node_id for m in self.ring or []}

    def role(self, i: str) -> rules.Role | None:
        n = self.nodes.get(i)
        return n.role if n is not None else None

    def name(self, i: str) -> str:
        return self.s.name(i)

    def peer(self, i: str) -> Peer:
        return self.s.members[i]

    # --- the round ------------------------------------------------------------------------------

    def start(self, samples_seen: int) -> list[Action]:
        """The round's assignments: ShardAssignment to every member, jobs to its evaluators."""
        s, host, prev = self.s, self.host, self.prev
        # The lr schedule follows the swarm's samples: those of the round still being reduced count.
        progress = samples_seen + (prev.samples_synced() if prev is not None else 0)
        in_flight = prev is not None and not prev.settled
        has_evaluators = any(x.role == "evaluate" for x in self.nodes.values())
        first = {i: self.plan.grant_first(i) for i in self.trainers}  # (all first: `no_more` knows what is left)
        for i in list(s.members):
            n = self.nodes[i]
            if n.role == "evaluate":  # evaluators work at their own pace: a new job once the last is done
                if i not in s.evaluating and not in_flight:  # (overlapped: once prev is agreed, PrevSettled)
                    self.out.append(Evaluate(i))
                continue
            catch_up = None
            if in_flight and (prev.ring is None or i not in prev.ring_ids()):
                catch_up = prev.rnd  # it does not reduce prev itself: Agreed tells it what θ became
                self.out.append(CatchUp(i))
            if n.role == "wait":
                self.send(
                    i, P.ShardAssignment(round=self.rnd, epoch=self.epoch, units=[], role="wait", catch_up=catch_up)
                )
                continue
            last_round = self.rnd == self.r.rounds - 1
            report_val = i == self.fastest and (not has_evaluators or last_round)
            if report_val:
                self.val_reporter = i
            self.send(
                i,
                P.ShardAssignment(
                    round=self.rnd,
                    epoch=self.epoch,
                    units=first[i],
                    planned=len(self.plan.planned[i]),
                    no_more=self.plan.exhausted_for(i),
                    report_val=report_val,
                    state=host.state_source(i),
                    progress=progress,
                    catch_up=catch_up,
                ),
            )
        return self.flush()

    def send(self, i: str, msg: P._Msg) -> None:
        self.out.append(Send((i,), msg))

    def note(self, kind: str, **fields) -> None:
        self.out.append(Note(kind, fields))

    def warn(self, text: str) -> None:
        self.out.append(Log(logging.WARNING, text))

    def pending(self, kind: type, i: str) -> int:
        """How many `kind` actions for node i this event decided so far (not applied yet)."""
        return sum(isinstance(a, kind) and a.node == i for a in self.out)

    def ring_epoch(self) -> int:
        """The ring epoch of this round: the swarm's until its ring is out, then its attempt's
        (while its ring runs, only its own retries renew the epoch: the next round's ring waits)."""
        return self.s.ring_epoch if self.ring is None else self.attempt

    def flush(self) -> list[Action]:
        out, self.out = self.out, []
        return out

    def step(self, event: Event, now: float) -> list[Action]:
        """Handle one event at time `now`; returns what to do, in order. The shell applies them
        before the round's next event: from then on the round reads their effect in the swarm."""
        self.now = now
        match event:
            case Message(node=i, msg=msg):
                self.on_message(i, msg)
            case Tick(may_reduce=may_reduce):
                if self.tick(now, may_reduce):
                    self.out.append(Settled())
            case Left(node=i):
                self.forget(i)
                return []  # (the shell drops a node where it cannot act: this comes out with the next event)
            case PrevSettled():
                self.prev_settled(now)
            case CatchingUp(node=i):
                self.nodes.setdefault(i, NodeRound("late")).catching_up = True  # (a late record: in no part)
        return self.flush()

    def samples_synced(self) -> int:
        """Samples the nodes reported at this round's barrier (counted ones)."""
        return sum(samples(n.synced.trained) for n in self.nodes.values() if n.counted)

    def forget(self, i: str) -> None:
        """Node i left the swarm: its work of this round is redone. A ring it was in is redone
        unless the others finish it: its leaving counts as a report that the ring failed, so the
        members' RoundDones of the next moment decide (a majority that applied it keeps it)."""
        n, self._part = self.nodes.pop(i, None), None
        if n is not None and n.counted:
            self.give_back.extend(n.synced.trained)
        for book in (self.carry, self.late):
            if (w := book.pop(i, None)) is not None:
                self.give_back.extend(w.units)
        self._drop_from_plan(i)
        if self.ring is not None and self.abandoned is None and i in self.ring_ids() and self.ring_failed_at is None:
            self.warn(f"round {self.rnd}: {self.name(i)} left during the all-reduce")
            self.ring_failed_at = self.now

    def on_message(self, i: str, msg: P.Message) -> None:
        """Every message of a member about this round, in one place."""
        if i not in self.nodes:  # entered after this round started: it is in the next one
            if not isinstance(msg, P.Heartbeat):
                self.warn(f"ignoring {msg.type} from {self.name(i)}: it is not in round {self.rnd}")
            return
        match msg:
            case P.TrainProgress():
                self.on_progress(i, msg)
            case P.AskForMoreWork():
                self.on_ask(i, msg)
            case P.BarrierSync() if msg.round == self.rnd - 1 and i in self.carry:
                self.on_late_report(self.carry, i, msg)
            case P.BarrierSync():
                self.on_sync(i, msg)
            case P.RoundDone():
                if (
                    msg.round == self.rnd
                    and msg.ring_epoch == self.ring_epoch()
                    and rules.takes_part(self.nodes[i])
                    and msg.announced == self.announcing()
                ):
                    self.nodes[i].done = msg
                    self.done_after.setdefault(i, self.now - self.t_ring)
                elif (
                    msg.round == self.rnd
                    and msg.ring_epoch < self.ring_epoch()
                    and i in self.rings.get(msg.ring_epoch, ())
                    and not msg.announced
                ):  # an earlier attempt it applied before the retry reached it
                    self.applied_before[i] = msg
            case P.RingFailed():
                self.on_ring_failed(i, msg)
            case P.EvalResult():  # (if a newer θ is already agreed: evaluate it now rather than next round)
                self.out.append(RecordEval(i, msg, again=self.role(i) == "evaluate"))
            case P.Heartbeat():
                pass
            case _:
                self.warn(f"ignoring unexpected {msg.type} from {self.name(i)} in round {self.rnd}")

    def on_progress(self, i: str, msg: P.TrainProgress) -> None:
        if not self._count(i, msg.round, msg.units, msg.loss, msg.samples_per_s):
            return
        if msg.ask:
            self.on_ask(i, P.AskForMoreWork(round=msg.round))
        elif self.nodes[i].ask_held and self._room(i):
            self._answer_ask(i, self.rnd)

    def on_last_units(self, i: str, msg: P.BarrierSync) -> None:
        """The units its barrier report lists that no TrainProgress reported: count them now, as
        if reported with it. (A node does not report the units it ended its round with on their
        own: one frame a node, not two.) Units that overlap reported ones are the report's to
        account for (check_accounting), not counted again."""
        n = self.nodes[i]
        claimed = msg.samples / msg.busy_s if msg.busy_s > 0 else 0.0  # (its word: only shown)
        # (each checked as the one before is counted: a unit listed twice counts once, and
        # check_accounting names the report)
        self._count(i, msg.round, (u for u in msg.trained if not n.reported_any(u)), msg.loss, claimed)

    def _count(self, i: str, rnd: int, units: Iterable[P.WorkUnit], loss: float, claimed_sps: float) -> bool:
        """Node i says it trained these units (of round rnd), one after the other: each counted if
        we granted it those samples this round and it did not report them before, and their time
        measured by our clock (`claimed_sps`, its own word, is only shown). Whether any counted."""
        if rnd != self.rnd:
            return False  # a late report: counts for nothing
        n, now, first, k = self.nodes[i], self.now, self.nodes[i].trained == 0, 0
        for u in units:
            if not any(
                g.epoch == u.epoch and g.id == u.id and g.lo <= u.lo and u.hi <= g.hi
                for g in self.plan.granted.get(i, [])
            ):
                continue  # samples it was never granted: count for nothing
            if n.reported_any(u):
                # Samples it reported before: a unit counts once, and honest code reports each once.
                if not n.repeated:
                    n.repeated = True
                    self.lied(i, "false_claim", "it reported samples it had already reported trained", claim="progress")
                continue
            n.reported.append((u.epoch, u.id, u.lo, u.hi))
            k += u.hi - u.lo
            n.units_after_stop += self.stop_sent or n.early
            self.out.append(Progress(i, u, u.hi - u.lo, loss, claimed_sps))
        if k == 0:
            return False
        # Its speed by our clock, not its word, over the units reported together (not round 0's
        # first report of the node asked for the val loss: it evaluated θ0 before it).
        if first and i == self.val_reporter and self.rnd == 0:
            n.t_unit = now
        elif (sps := n.measure(k, now)) is not None:
            self.out.append(Measured(i, sps))
        n.trained += k
        n.last_progress = now
        return True

    def on_ask(self, i: str, msg: P.AskForMoreWork) -> None:
        n = self.nodes[i]
        if n.role == "evaluate" and msg.round <= self.rnd:
            # Its job could not start (no donor held that θ any more): a fresh one, also when the
            # job was of an earlier round. Rounds go on meanwhile (it waits a second before it
            # asks), and "no more work" for an old round left an evaluator idle to the run's end.
            self.out.append(Evaluate(i))
            return
        if msg.round == self.rnd and not n.excluded and not n.early and n.synced is None and not self._room(i):
            # It holds its allowance already: the answer waits for its progress (asking again and
            # again hoards nothing, and an honest node that asked early is not told "no more").
            n.ask_held = True
            return
        self._answer_ask(i, msg.round)

    def _room(self, i: str) -> bool:
        """Node i may be granted one more unit: what it holds not yet reported trained is within
        its allowance."""
        return self.in_hand(i) <= rules.ask_allowance(self.r.unit_samples, self._measured(i))

    def _measured(self, i: str) -> float | None:
        """Node i's speed as our clock measured it (None: not measured yet)."""
        return self.s.speed.get(i) if i in self.s.measured else None

    def in_hand(self, i: str) -> int:
        """Samples granted to node i that it has not reported trained."""
        return samples(self.plan.granted.get(i, [])) - self.nodes[i].trained

    def _answer_ask(self, i: str, rnd: int) -> None:
        n = self.nodes[i]
        n.ask_held = False
        units: list[P.WorkUnit] = []
        if rnd == self.rnd and not n.excluded and not n.early and n.synced is None and not self.stop_sent:
            us, measured, held = self.r.unit_samples, self._measured(i), self.in_hand(i)
            most = rules.ask_allowance(us, measured)
            for _ in range(rules.grant_units(us, measured, self.plan.remaining(), len(self.nodes))):
                if (units and held >= most) or (u := self.plan.next_for(i)) is None:
                    break
                units.append(u)
                held += u.hi - u.lo
        if units:
            n.last_progress = self.now
            self.send(i, P.AssignNext(round=self.rnd, units=units, no_more=self.plan.exhausted_for(i)))
            return
        self.send(i, P.NoMoreWork(round=rnd))
        if rnd == self.rnd:
            self._out_of_work(i)

    def _drop_from_plan(self, i: str) -> None:
        """Node i's units go back to the plan (it left, or its work was voided). If nothing was
        left before, the grants that emptied it said so (`no_more`, NoMoreWork): the nodes still
        training ask again (MoreWork), or the units would wait for the next round (and in the last
        one, never be trained). A node past its last unit ignores it; nobody is granted anything
        it did not ask for."""
        was_empty = self.plan.remaining() == 0
        self.plan.drop(i)
        if not self.steal or not was_empty or self.stop_sent or self.plan.remaining() == 0:
            return
        to = [i for i in self.part() if (n := self.nodes[i]).synced is None and not n.excluded and not n.early]
        if to:
            self.out.append(Send(tuple(to), P.MoreWork(round=self.rnd)))

    def _out_of_work(self, i: str) -> None:
        """Nothing is left to grant and node i holds nothing more to train: the others stop at their
        next inner step (the round of a schedule that steals ends once its budget is handed out).
        A node that asked ahead still trains what it holds first: by what we granted and it
        reported, not by its ask."""
        if self.steal and not self.last and self.plan.remaining() == 0 and self.in_hand(i) <= 0:
            self.stop_all("the round's budget is handed out")

    def on_sync(self, i: str, msg: P.BarrierSync) -> None:
        n = self.nodes[i]
        if msg.round == self.rnd and n.synced is None:
            self.on_last_units(i, msg)
        if msg.round == self.rnd and i in self.late:
            self.on_late_report(self.late, i, msg)
            return
        if msg.round != self.rnd or n.sitting_out or n.synced is not None:
            return  # a node that sat out a round reports it late: its work there is redone already
        n.synced, n.t_sync = msg, self.now
        if n.role == "train" and not n.excluded and not n.early:
            self._out_of_work(i)  # (it asked ahead and was told "no more": it trained what it held)
        if not n.excluded and n.role != "evaluate":
            wrong = check_accounting(self.plan.granted.get(i, []), msg.trained, msg.returned)
            if not wrong and msg.trained and msg.delta_norm is None and not msg.delta_error:
                wrong = "it reported no norm of its Δ"  # without it, nobody can bound the ring's sum
            if msg.delta_error and not wrong:
                self.warn(f"node {self.name(i)}: {msg.delta_error}; its work this round is redone")
                self.note("bad_delta", node_id=i, reason=msg.delta_error, round=self.rnd)
                self.exclude(i)  # everything granted to it, trained or returned, is redone
            elif wrong:
                self.warn(f"node {self.name(i)}: bad work report ({wrong}); its work this round is redone")
                self.note("bad_report", node_id=i, reason=wrong, round=self.rnd)
                self.exclude(i)
            else:  # accounted for: what it trained is in synced, the rest goes back
                self.give_back.extend(msg.returned)
                self.plan.granted[i] = []
                if i in self.carry:
                    self.merge_late(i, msg)
        if msg.val_loss is not None and i == self.fastest:  # the node asked for it (report_val)
            self.out.append(RecordVal(self.rnd - 1, msg.val_loss, msg.val_samples, msg.metrics))

    def on_late_report(self, book: dict[str, Late], i: str, msg: P.BarrierSync) -> None:
        """The barrier report of a member round msg.round went on without: what it trained there
        merges into its next round (merge_late). A report that does not account for its units, or
        a Δ it could not use, gives them back to be redone."""
        w = book[i]
        if w.reported:
            return
        wrong = check_accounting(w.units, msg.trained, msg.returned) or msg.delta_error
        if not wrong and msg.trained and msg.delta_norm is None:
            wrong = "it reported no norm of its Δ"
        if wrong:
            self.warn(f"node {self.name(i)}: its late report of round {msg.round} does not count ({wrong})")
            self.note("bad_report", node_id=i, reason=wrong, round=msg.round)
            self.give_back.extend(w.units)
            if book is self.late or msg.delta_error:
                del book[i]  # it keeps nothing of that round (not told to, or its Δ was unusable)
            else:
                w.units = []  # it kept its Δ: merge_late redoes its next round's work too
            return
        self.give_back.extend(msg.returned)
        w.units, w.reported = list(msg.trained), True

    def merge_late(self, i: str, msg: P.BarrierSync) -> None:
        """Node i synced this round, late in the one before: its report counts the units it
        trained there too, as its Δ holds them (Agreed.keep). Without an accounted late report
        its Δ holds work nobody can count: its work of both rounds is redone."""
        w = self.carry.pop(i)
        if w.reported:
            n = self.nodes[i]
            n.synced = msg.model_copy(
                update={"trained": [*w.units, *msg.trained], "samples": msg.samples + samples(w.units)}
            )
            return
        why = f"its Δ holds round {self.rnd - 1}'s work, which it never accounted for"
        self.warn(f"node {self.name(i)}: {why}; its work is redone")
        self.note("bad_report", node_id=i, reason=why, round=self.rnd)
        self.give_back.extend([*w.units, *msg.trained])
        self.exclude(i)

    def on_ring_failed(self, i: str, msg: P.RingFailed) -> None:
        if self.ring is None or msg.round != self.rnd or msg.ring_epoch != self.ring_epoch():
            return
        if i not in self.ring_ids() or i not in self.part():  # (sat out, or never in this attempt)
            return
        self.failed.add(i)
        named = msg.suspect if msg.suspect and self.witnessed(i, msg.suspect, msg.level) else ""
        self.failed_at.setdefault((self.attempt, i), (msg.level, named))
        if msg.sit_out:  # it already applied an earlier attempt's outer step: it cannot redo it
            if i in self.applied_before:  # ... and its own RoundDone of that attempt says so
                self.sit_out(i, "retry", "it finished an earlier attempt of this all-reduce", strike=False)
                self.retry_reason = self.retry_reason or f"{self.name(i)} cannot take part in the retry"
                return
            # Its word alone: a report of a failed ring like any other (the others' RoundDones
            # decide whether the ring finished), and a strike for the claim.
            why = "it said it had applied an attempt of this all-reduce it never reported"
            self.lied(i, "false_claim", why, claim="sit_out")
        if msg.poisoned:
            self.poisoned.add(i)
        if msg.proof is not None and not self.proven(i, msg):
            # Honest code sends only proof it checked: this accuser lied (its word counts for nothing).
            why = "it accused a ring neighbour with proof that does not hold"
            self.lied(i, "false_accusation", why, accused=msg.suspect)
        elif named in self.part() and named != i:
            self.accusations.append((self.attempt, named, i, msg.level))
            if msg.proof is not None:
                self.forgers.add(named)
        if self.ring_failed_at is None:
            self.warn(f"round {self.rnd}: {self.name(i)} reports the all-reduce failed: {msg.reason}")
            self.ring_failed_at = self.now

    def suspects(self) -> dict[str, set[str]]:
        """Ring member -> the members that named it (rules.accused: not those its own failure
        below explains)."""
        return rules.accused(self.accusations, self.failed_at)

    def witnessed(self, i: str, suspect: str, level: int) -> bool:
        """Whether i sends to or takes from `suspect` in this attempt (at `level` of the sparse
        rule's hierarchy): only those witness its bytes or silence, so only their word that it
        broke the all-reduce counts. Two members anywhere else could name anyone."""
        ids = [m.node_id for m in self.ring]
        if i not in ids or suspect not in ids:
            return False
        if collective(self.r, self.rnd) == "ring":
            return suspect in neighbours(ids, i, self.r.codec, self.flat)
        levels = self.levels()
        return not levels or (level < len(levels) and ids.index(suspect) in levels[level].neighbours(ids.index(i)))

    def links(self, order: list[str]) -> dict[str, set[str]]:
        """Each member's peers in this attempt over `order` (the ring or grid, or the sparse rule's
        levels): the members it sends to or takes from, the only ones whose tickets it needs. A
        thousand members' tickets to each of a thousand was 150 MB from the coordinator."""
        if collective(self.r, self.rnd) == "ring":
            return ring_links(order, self.r.codec, self.flat)
        if not (levels := self.levels()):
            return {i: set(order) - {i} for i in order}
        return {i: {order[m] for level in levels for m in level.neighbours(k)} for k, i in enumerate(order)}

    def levels(self) -> list[hierarchy.Level]:
        """The sparse rule's hierarchy over this attempt's ring ([]: a rule without one, or a
        round that goes around the ring)."""
        if collective(self.r, self.rnd) == "ring":
            return []
        fanout = getattr(rule_class(self.r).Params.model_validate(self.r.sync_params), "fanout", 0)
        return hierarchy.plan(len(self.ring), fanout) if fanout and self.ring else []

    def proven(self, i: str, msg: P.RingFailed) -> bool:
        """Whether msg.proof shows that msg.suspect forwarded, in this attempt's ring (or a pass of
        its grid), bytes of a segment that its owner (by the ring we sent, not the accuser's word)
        did not sign."""
        p, ids = msg.proof, [m.node_id for m in self.ring]
        return (
            p.forwarder == msg.suspect != i
            and p.round == self.rnd
            and p.generation == self.ring_epoch()
            and (owner := signer(ids, self.r.codec, p.forwarder, p.level, p.segment, p.part, self.flat)) is not None
            and proves_forgery(p, owner)
        )

    # --- decisions --------------------------------------------------------------------------------

    def stop_all(self, reason: str) -> None:
        if not self.stop_sent:
            self.stop_sent, self.t_stop = True, self.now
            self.out.append(Log(logging.INFO, f"round {self.rnd}: {reason}; stopping at the next inner step"))
            to = [i for i in self.part() if self.nodes[i].synced is None]
            # One that trained all it was granted has no step to stop at: it syncs, or asks and is
            # told "no more" (a thousand nodes with a unit each: most had reported it already).
            self.out.append(Send(tuple(i for i in to if self.in_hand(i) > 0), P.StopRound(round=self.rnd)))
            for i in to:
                self._no_more(i)

    def _stop(self, i: str) -> None:
        """StopRound to node i alone (and "no more" to the ask it waits on, if held)."""
        self.send(i, P.StopRound(round=self.rnd))
        self._no_more(i)

    def _no_more(self, i: str) -> None:
        """A held ask is answered when the node stops: it waits for that answer to sync."""
        if self.nodes[i].ask_held:
            self.nodes[i].ask_held = False
            self.send(i, P.NoMoreWork(round=self.rnd))

    def exclude(self, i: str) -> None:
        """Weight 0 this round: everything granted to it (trained or not) is redone by others."""
        self.nodes[i].excluded = True
        self._drop_from_plan(i)

    def drop(self, i: str, why: str) -> None:
        """Remove a node from the swarm mid-round (every live round forgets it)."""
        self.out.append(Drop(i, why))

    def tick(self, now: float, may_reduce: bool = True) -> bool:
        """Run the clocks; True once the round is settled (every ring member reported θ, or the
        all-reduce was given up). `may_reduce` False holds the ring back (the round before is
        still being reduced)."""
        if self.steal and self.ring is None and not self.stop_sent and not self.last:
            self.tail()
        self.deadlines(now)
        if self.ring is None:
            return self.barrier(now) if may_reduce else False
        return self.reduce_progress(now)

    def tail(self) -> None:
        """A node whose next inner step would end after everyone else ran out of work stops now
        (rules.tail_stops)."""
        active = [i for i in self.part() if (n := self.nodes[i]).synced is None and not n.excluded and not n.early]
        in_hand = {i: self.in_hand(i) for i in active}
        speeds = rules.planning_speeds({i: self.s.speed[i] for i in active}, self.s.measured)  # (as the plan's)
        for i in rules.tail_stops(active, in_hand, self.plan.remaining(), speeds, self.r.batch_size):
            self.nodes[i].early = True
            self._stop(i)

    def deadlines(self, now: float) -> None:
        r, s = self.r, self.s
        if (self.prev is not None and not self.prev.settled) or self.ring is not None:
            return  # overlapped: the nodes wait at this barrier for the round before to land
        in_part = {j for j in self.part() if not self.nodes[j].excluded}  # (once: not a scan per node)
        for i, n in list(self.nodes.items()):
            if n.role in ("evaluate", "late") or n.synced is not None or n.excluded:
                continue
            # Deadlines: a unit should take unit_samples/speed, and after StopRound a node should
            # reach the barrier within one inner step. Past unit_deadline_factor times that (plus
            # heartbeat slack), its work is reassigned and it sits this round out.
            if self.stop_sent or n.early:
                since, expected = max(self.t_stop, n.last_progress), r.batch_size / s.speed[i]
            elif n.role == "train" and self.plan.granted.get(i):
                since, expected = n.last_progress, r.unit_samples / s.speed[i]
            else:
                continue
            if self.rnd == 0 and i == self.val_reporter and n.trained == 0:
                # It evaluates θ0 before it trains: a StopRound that comes meanwhile waits for that too.
                expected += r.eval_batches * r.batch_size / s.speed[i]
            waited = now - since
            others = len(in_part) - (i in in_part)
            # The only trainer has a deadline too when anyone else could take over (evaluators):
            # it holds the whole swarm up, so missing it counts as a strike.
            alone = not others
            spare = others or len([j for j in s.members if j != i])
            if rules.overdue(waited, expected, r.unit_deadline_factor, r.heartbeat_s, spare):
                name = self.name(i)
                self.warn(
                    f"node {name} has not finished its work in {waited:.1f}s (expected {expected:.2f}s): "
                    "its units are reassigned and it sits out this round"
                )
                self.note("deadline", node_id=i, name=name, round=self.rnd, waited_s=waited, expected_s=expected)
                self.exclude(i)
                in_part.discard(i)
                # What we know now: it is at least this slow. Plans (and the choice of evaluators)
                # from the next round on use that.
                self.out.append(Slowed(i, r.batch_size / waited))
                self._stop(i)
                if alone:
                    self.strike(i, "it held the whole swarm up")
        self.quorum_cuts(now, in_part)

    def quorum_cuts(self, now: float, in_part: set[str]) -> None:
        """A moment after members holding the quorum of the barrier's weight synced, the round
        goes on without the rest (rules.quorum_cut): blocking, what they trained merges into
        their next round (Late); overlapped, or late twice running, it is redone. No strike."""
        r, s = self.r, self.s
        if r.quorum >= 1 or self.last:
            return  # (the last round has no next one to merge into)
        waiting = [i for i in in_part if self.nodes[i].synced is None]
        if not waiting or (self.rnd == 0 and self.val_reporter in waiting):
            return  # (round 0's val reporter evaluates θ0 first: its deadline allows for that)
        share = sum(s.speed[i] for i in in_part if self.nodes[i].synced is not None) / sum(s.speed[i] for i in in_part)
        if share < r.quorum:
            self.t_quorum = None  # (a synced member's work was voided meanwhile)
            return
        self.t_quorum = now if self.t_quorum is None else self.t_quorum
        speeds = sorted(s.speed[i] for i in in_part)
        grace = rules.quorum_grace(r.batch_size / speeds[len(speeds) // 2])
        if not rules.quorum_cut(share, r.quorum, now - self.t_quorum, grace):
            return
        for i in waiting:
            n, name = self.nodes[i], self.name(i)
            self.warn(f"node {name} is not at the barrier {grace:.1f}s after {share:.0%} of the swarm: it is late")
            self.note("late", node_id=i, name=name, round=self.rnd, synced_share=share)
            n.late_cut = True
            if not self.stop_sent and not n.early:
                self._stop(i)
            if r.overlap or i in self.carry:
                self.exclude(i)
                self.give_back.extend(self.carry.pop(i, Late([])).units)
            else:
                n.excluded = True
                self.late[i] = Late(self.plan.take(i))

    def barrier(self, now: float) -> bool:
        """Once every trainer synced (or sits out past its deadline), send the ring."""
        try:
            d = rules.barrier(self.nodes)
        except ValueError:
            if not self.s.members:
                raise RoundError(f"every training node has left (round {self.rnd})") from None
            self.abandon("every training node of the round has left")  # the others train the next one
            return True
        if d.action == "wait":
            return False
        if d.action == "abandon":
            # Every node's work of this round is void (bad reports, bad Δ, deadlines): θ stays.
            self.abandon("no node's work of this round can be used")
            return True
        for i in d.stragglers:  # stragglers past their deadline or late: the swarm goes on without them
            self._sits_out(self.nodes[i])
            reason = "late" if self.nodes[i].late_cut else "deadline"
            self.note("sat_out", node_id=i, name=self.name(i), round=self.rnd, reason=reason)
        counted = {i: self.nodes[i].synced for i in self.part() if self.nodes[i].counted}
        bs = self.r.batch_size  # steps by what it was granted and trained, not by its word
        for i in rules.norm_outliers(
            {i: (b.delta_norm or 0.0, rules.steps_of(b.trained, bs)) for i, b in counted.items()}
        ):
            why = "the norm of its Δ is far outside the others'"
            self.warn(f"node {self.name(i)}: {why}; its work this round is redone")
            self.note("outlier_delta", node_id=i, name=self.name(i), round=self.rnd, norm=counted[i].delta_norm)
            self.give_back.extend(counted[i].trained)  # (accounted at its sync: no longer in the plan)
            self.exclude(i)
            self.strike(i, why)
        self.t_ready = now
        self.send_ring()
        return False

    def send_ring(self) -> None:
        """BarrierReady to every node in the barrier: the ring's order (to those not sent it last
        time), each member's counted samples (its weight) and the bound on the sum's norm."""
        s, part = self.s, self.part()
        epoch = self.attempt = self.ring_epoch()
        self.flat = self.flat or self.rnd < s.flat_until
        n, w = rules.counted(self.nodes, part), rules.weights(self.nodes, part)
        order = part if epoch % 2 == 0 else part[::-1]  # a retry swaps everyone's neighbours
        self.ring = [P.RingMember(node_id=i, weight=w[i]) for i in order]
        for i, peers in self.links(order).items():  # the tickets of those it connects to, not yet told
            if news := s.ticket_news(i, peers):  # (then the ring names ids alone)
                self.send(i, P.Tickets(tickets=news))
                self.out.append(Told(i, tuple(news)))
        self.t_ring, self.done_after = self.now, {}
        self.rings[epoch] = set(part)
        self.confirm, self.committed, self.announced = len(self.ring) == 2, False, {}
        self.note("barrier", round=self.rnd, ring_epoch=epoch, nodes=len(self.ring))
        ready = P.BarrierReady(
            round=self.rnd,
            samples=[n[i] for i in order],
            bound=diloco.norm_bound((w[i], self.nodes[i].synced.delta_norm) for i in order if w[i] > 0),
            codec=self.r.codec,
            ring_epoch=epoch,
            confirm=self.confirm,
            recheck=self.confirm and bool(self.earlier),
            flat=self.flat,
            slack_s=min(3600.0, 2 * self.r.heartbeat_s + (self.slowest_step(part) if self.r.overlap else 0.0)),
        )
        told = s.told_order(order)  # the members sent this order last time are not sent it again
        if knew := tuple(i for i in part if i in told):
            self.out.append(Send(knew, ready))
        if new := tuple(i for i in part if i not in told):
            self.out.append(Send(new, ready.model_copy(update={"order": order})))
            self.out.append(ToldOrder(new, tuple(order)))

    def slowest_step(self, part: list[str]) -> float:
        """Seconds one inner step takes the slowest of these members, by their measured speeds."""
        return max(self.r.batch_size / self.s.speed[i] for i in part)

    def done(self) -> dict[str, P.RoundDone]:
        """The ring members' reports of θ after the outer step (this ring epoch)."""
        return {i: n.done for i, n in self.nodes.items() if n.done is not None}

    def applied(self) -> list[str]:
        """The members taking part that applied this attempt's outer step (a ring of two's
        announcement applies nothing)."""
        return [] if self.announcing() else [i for i in self.part() if self.nodes[i].done is not None]

    def refused(self) -> int:
        """How many members taking part refused this attempt's sum (`poisoned`)."""
        return len(self.poisoned & set(self.part()))

    def first_alone(self) -> bool:
        """One member alone reports a plain failure (no refusal), the first time this round: it has
        the attempt redone at the grace. A failure in a ring's setup may reach nobody else (its
        neighbours never connected), and the others would wait out their 120 s timeouts; so only
        within the time a setup may take (REDUCE_DEADLINE_S). A second lone report of the same
        member waits for the others' reports: one member's word redoes at most one attempt a
        round, early in it, never every attempt of a slow all-reduce."""
        return (
            len(self.failed) == 1
            and not self.poisoned
            and not (self.failed & self.heard_alone)
            and self.ring_failed_at is not None
            and self.ring_failed_at - self.t_ring <= rules.REDUCE_DEADLINE_S  # (while a setup may still fail)
        )

    def reduce_progress(self, now: float) -> bool:
        """While the ring runs: retry it when it broke; once every member reported, check θ."""
        part, done = self.part(), self.done()
        if (self.ring_failed_at is not None or self.poisoned) and (kept := self.committed_theta()) is not None:
            return self.keep_committed(kept)
        if (
            self.retry_reason is None
            and self.ring_failed_at is not None
            and rules.failure_heard(
                part,
                set(done),
                self.failed,
                {*rules.caught(self.suspects(), part), *(i for i in part if self.nodes[i].behind)},
                bool(self.forgers) or any(i not in self.nodes for i in self.ring_ids()) or self.first_alone(),
                now - self.ring_failed_at,
                2 * self.r.heartbeat_s + 1,
                now - self.t_ring > rules.reduce_deadline(self.host.n_params, MIN_RATE),
            )
        ):
            # The ring is all or nothing: if most members finished it, they agree on θ and the
            # reporters' word against them changes nothing (a node repeating RingFailed cannot
            # hold every round hostage); the reporters get θ with Agreed. That holds for a refusal
            # too (`poisoned`): every honest member checks the same sum against the same bound.
            keep = rules.held_by_majority({i: d.checksum for i, d in done.items()}, len(self.ring))
            if self.poisoned and (keep is not None or self.refused() < len(self.applied())):
                self.poisoned.clear()  # (more applied the sum: their word against a few, a failure report)
            if self.poisoned:
                return self.redo_poisoned(now)
            if rules.finished_by_majority(part, set(done)) and keep is not None:
                # Their Δ is in the others' result (that is how a ring finishes), so their work
                # counts; only their θ is behind. (A proven forger's too: it is out from now on.)
                # A reporter of another θ than the majority's diverged.
                for i in [i for i, d in done.items() if d.checksum != keep]:
                    self.diverged(i)
                for i in self.forgers:
                    self.convict(i, "forged", FORGED, sit_out=False)
                self.warn(
                    f"round {self.rnd}: {len([i for i in part if i not in done])} node(s) reported a failed "
                    "all-reduce that the others finished; they get θ from a peer"
                )
                return True
            if keep is None:  # (else every member reported θ, a reporter of a failure too: below)
                if self.first_alone():
                    self.heard_alone |= self.failed
                self.retry_reason = "a node reported a broken all-reduce and nobody left"
        if self.retry_reason is None:
            self.behind(now, part)
        if (
            self.retry_reason is None
            and not self.poisoned
            and part
            and all(i in done or self.nodes[i].behind for i in part)
            and done
        ):
            if not self.committed:  # (after Commit the members report again what they announced)
                self.equivocation()
            if self.confirm:
                return self.pair_progress(now)
            for i in self.minority():
                self.diverged(i)
            self.cleared()
            return True
        if self.retry_reason is None:
            return False
        return self.retry(now)

    def committed_theta(self) -> str | None:
        """A ring of two that committed: the θ both members announced, once one of them applied it
        (its RoundDone after the Commit). Both named it, so it is proven."""
        values = set(self.announced.values())
        if not self.committed or len(self.announced) < 2 or len(values) != 1:
            return None
        (theta,) = values
        return theta if any(d.checksum == theta for d in self.done().values()) else None

    def keep_committed(self, theta: str) -> bool:
        """The committed θ stands whatever else a member says of the attempt (it failed, or it
        refused the sum it announced the step of): a redo would leave it to the one that did not
        apply it, alone, and its own Δ would be the round. That member is behind: θ with Agreed.
        True: settled."""
        applied = [i for i in self.part() if (d := self.nodes[i].done) is not None and d.checksum == theta]
        why = "a member of the ring of two reported a failure after both announced θ; the applied θ stands"
        return self.stands(theta, applied, why)

    def pair_progress(self, now: float) -> bool:
        """A ring of two, every member reported (or is behind). Announcements: commit the θ they
        agree on, else redo or drop by rules.pair_verdict; after Commit, the members' reports are
        what they announced. True once settled."""
        done = self.done()
        if self.committed:
            for i in [i for i, d in done.items() if d.checksum != self.announced.get(i)]:
                why = f"its θ after round {self.rnd} is not the θ it announced"  # (honest code reports that one)
                self.note("diverged", node_id=i, name=self.name(i), round=self.rnd, checksum=done[i].checksum)
                self.fell_behind(i)
                self.drops.append((i, why))
            if not self.done():
                raise RoundError(f"no node's θ after round {self.rnd} is the θ it announced")
            self.cleared()
            return True
        verdict = rules.pair_verdict(
            {i: d.checksum for i, d in done.items()},
            {i: d.before for i, d in done.items()},
            self.earlier,
            self.s.checksums[self.s.newest()],
        )
        if verdict.action == "commit":
            self.committed, self.announced = True, {i: d.checksum for i, d in done.items()}
            for i in done:
                self.nodes[i].done = None
            self.t_ring, self.done_after = now, {}  # the step's own deadline
            self.out.append(Send(tuple(done), P.Commit(round=self.rnd, ring_epoch=self.attempt)))
            return False
        detail = ", ".join(f"{self.name(i)}={d.checksum[:12]}" for i, d in done.items())
        self.note("disagreed", round=self.rnd, ring_epoch=self.attempt, verdict=verdict.action)
        if verdict.action == "redo":
            self.earlier = {i: d.checksum for i, d in done.items()}
            self.retry_reason = f"the two nodes' outer steps would give different θ ({detail}); none applied it"
        elif verdict.action == "drop":
            for i, why in verdict.culprits.items():
                if self.s.state_round.get(i) != self.s.newest():
                    # The swarm knows it does not hold that θ yet (it sat the round before out and
                    # fetches it; overlapped, the next ring starts meanwhile): behind, not broken.
                    self.sit_out(i, "behind", f"it does not hold the θ of round {self.s.newest()} yet")
                    continue
                self.sit_out(i, "diverged", why, strike=False)
                self.drops.append((i, why))
            self.retry_reason = f"{len(verdict.culprits)} node(s) disagreed with their own earlier state"
        else:
            raise RoundError(
                f"the two nodes disagree on θ after round {self.rnd} again, and nothing tells which is right: {detail}"
            )
        return self.retry(now)

    def retry(self, now: float) -> bool:
        """Redo the all-reduce (retry_reason says why) without the members that sit out; give the
        round up after MAX_RING_RETRIES. True once the round is settled (given up)."""
        # A member caught by both its neighbours (bad bytes, or silence) sits the round out, so one
        # bad node cannot hold the all-reduce hostage.
        caught = rules.caught(self.suspects(), self.part())
        ring = self.ring_ids()
        was_grid = collective(self.r, self.rnd) == "ring" and grid(len(ring), self.r.codec, self.flat) is not None
        unnamed = rules.flat_from_now(
            was_grid, [*self.forgers, *caught], ring - set(self.part()), self.failed, len(ring)
        )
        for i in self.forgers:
            self.convict(i, "forged", FORGED)
        for i in caught:
            if i in self.part():
                self.sit_out(i, "ring", "both its ring neighbours caught it breaking the all-reduce")
        # Members that applied the last attempt cannot redo it (announced steps were never applied)
        applied = self.applied()
        if applied and not self.poisoned and self.applied_by_majority(applied):
            return True
        if unnamed:
            self.flat = True
            self.warn(f"round {self.rnd}: the grid's all-reduce failed and nobody was named; on the flat ring a while")
            self.note("flat_ring", round=self.rnd, ring_epoch=self.attempt)
            self.out.append(FlatRing())
        for i in applied:
            self.applied_before[i] = self.nodes[i].done
            self.sit_out(i, "retry", "it applied an earlier attempt of this all-reduce", strike=False)
        if not self.part():
            # (nobody left to redo it: θ stays; the coordinator ends the run only when no node is left at all)
            self.abandon(f"no member is left to redo the all-reduce ({self.retry_reason})")
            return True
        if self.attempt - self.epoch0 >= MAX_RING_RETRIES:
            self.abandon(f"the all-reduce failed {MAX_RING_RETRIES + 1} times (last: {self.retry_reason})")
            return True
        self.warn(f"round {self.rnd}: {self.retry_reason}; retrying the all-reduce with {len(self.part())} node(s)")
        self.note("ring_retry", round=self.rnd, reason=self.retry_reason, nodes=len(self.part()))
        self.retry_reason, self.ring_failed_at = None, None
        self.poisoned, self.forgers, self.failed = set(), set(), set()
        for n in self.nodes.values():
            n.done, n.behind = None, False
        self.attempt += 1
        self.out.append(NewRingEpoch(self.attempt))
        self.send_ring()
        return False

    def applied_by_majority(self, applied: list[str]) -> bool:
        """A retry is due, but more than half of the attempt's ring applied it to the same θ: the
        round is that θ (the ring is all or nothing: their Δ sums hold everyone's), whoever failed
        or left is behind (θ comes with Agreed), whoever applied another θ diverged. A round its
        members applied is never redone or given up because another member says it failed. True
        once settled."""
        ring = self.ring_ids()
        keep = rules.held_by_majority({i: self.nodes[i].done.checksum for i in applied}, len(ring))
        if keep is None:
            return False
        why = f"{self.retry_reason}, but {len(applied)} of {len(ring)} members applied the all-reduce and agree"
        return self.stands(keep, applied, f"{why}: the round stands")

    def stands(self, keep: str, applied: list[str], why: str) -> bool:
        """θ `keep`, which `applied` applied, is the round's although a retry was due: whoever
        did not apply it is behind (θ with Agreed), whoever applied another θ diverged. True."""
        for i in self.part():
            if i not in applied:
                self.fell_behind(i)
            elif self.nodes[i].done.checksum != keep:
                self.diverged(i)
        self.warn(f"round {self.rnd}: {why}")
        self.retry_reason = self.ring_failed_at = None
        self.poisoned.clear()
        self.cleared()
        return True

    def redo_poisoned(self, now: float) -> bool:
        """The ring finished but members refused its sum: someone sent more than it reported (θ
        did not move on any honest node). A member that applied that sum anyway is the culprit;
        else the culprit is found by halves: half of the candidates sit the retry out; if the
        retry passes the culprit was among them, else among the rest (log2 N retries; the
        candidates carry over to the next round). A ring without X that passes, after one
        with X was refused, names X."""
        part = self.part()
        applied = self.applied()
        if applied and len(applied) < len(part) and 2 * self.refused() > len(part):
            for i in applied:
                self.poisoner(i, "it applied an all-reduced Δ that the others refused")
        elif len(part) == 2 and sum(n.role == "train" for n in self.nodes.values()) == 2:
            # A swarm of two: one's word against the other's; and a poisoner left alone by a search
            # by halves could send its own Δ, pass, and have its partner named. Redone (then given
            # up), both suspects. (A pair a search narrowed a larger ring to is searched on.)
            self.out.append(Suspects(frozenset(part)))
        elif len(part) == 1:  # alone, only its own contribution was in the sum: no honest node's is refused
            self.poisoner(part[0], "found by halves")
            self.abandon("the all-reduce was poisoned; its sender is out, the round's work is redone")
            return True
        else:
            # (whoever sat the last retry out is not in part: the culprit was in that ring)
            cands = [i for i in part if i in self.poison_suspects()] or part
            self.out.append(Suspects(frozenset(cands)))
            self.bisect_out = cands[len(cands) // 2 :]
            for i in self.bisect_out:
                self.sit_out(i, "bisect", "finding who poisons the all-reduce", strike=False)
        self.retry_reason = (
            f"{len(self.poisoned)} node(s) refused the all-reduced Δ (larger than the reported norms allow)"
        )
        self.note("poisoned", round=self.rnd, ring_epoch=self.attempt, refused_by=len(self.poisoned))
        return self.retry(now)

    def poisoner(self, i: str, why: str) -> None:
        """Node i sent more into the all-reduce than it reported: out of the round and of the run."""
        self.out.append(Suspects(frozenset({i})))  # the first one sat out next time
        self.convict(i, why, f"it poisoned the all-reduce ({why})")

    def convict(self, i: str, reason: str, why: str, sit_out: bool = True) -> None:
        """Node i did what no honest node does (sent more than its reported norm allows, was named
        an outlier by most of the ring, forwarded bytes their owner did not sign, signed different
        payloads for different members): a `poisoner` event, out of this round's ring (`sit_out`,
        its work redone) and of the run: dropped and refused from now on (a smaller lie next time
        could pass the checks)."""
        if i not in self.s.members or i in self.s.banned or self.pending(Ban, i):
            return
        self.note("poisoner", node_id=i, name=self.name(i), round=self.rnd, reason=reason)
        if sit_out and i in self.part():
            self.sit_out(i, "poisoned", why, strike=False)
        self.out.append(Ban(i, why))
        self.drops.append((i, why))

    def cleared(self) -> None:
        """An attempt passed: if the one before (with bisect_out in it) was refused, the culprit
        is among bisect_out; one node alone is the culprit. A member that most of the others
        named an outlier (a sync rule that sees every contribution clipped it) is out for the run."""
        reports = {i: d.outliers for i, d in self.done().items()}
        for i in rules.named_outliers(reports, self.part()):
            why = "its contribution was far outside the others' (named by most of the ring)"
            self.convict(i, "outlier", f"it poisoned the all-reduce ({why})", sit_out=False)
        if self.bisect_out:
            self.out.append(Suspects(frozenset(self.bisect_out)))
            if len(self.bisect_out) == 1:
                self.convict(self.bisect_out[0], "bisected", "it poisoned the all-reduce (found by halves)")

    def behind(self, now: float, part: list[str]) -> None:
        """Members that did not report θ long after a majority did (rules.reduce_overdue) are
        behind: the round settles without them and they get θ with Agreed (their Δ is in it: the
        ring finished). Holding the swarm up is a strike; twice, and the node is dropped. With no
        majority past the reduce deadline (rules.reduce_timed_out) the all-reduce is redone; a
        ring of one that stays silent is struck (nobody else could have held it up), and so is the
        silent member of a ring of two whose partner reported, which sits the round out."""
        r = self.r
        majority_s = rules.majority_done_s(self.done_after, part)
        extra = {}
        if self.val_reporter is not None:  # it evaluates θ before it reports
            extra[self.val_reporter] = r.eval_batches * r.batch_size / self.s.speed[self.val_reporter]
        late = rules.reduce_overdue(
            [i for i in part if i not in self.failed],  # (a member that reported a failure is not silent)
            self.nodes,
            now - self.t_ring,
            majority_s,
            r.unit_deadline_factor,
            2 * r.heartbeat_s,
            extra,
        )
        for i in late:
            name = self.name(i)
            self.warn(
                f"round {self.rnd}: node {name} did not report θ within {now - self.t_ring:.1f}s of the "
                "all-reduce; the round goes on without it and it gets θ from a peer"
            )
            self.note("deadline", node_id=i, name=name, round=self.rnd, waited_s=now - self.t_ring, phase="reduce")
            self.fell_behind(i)
            self.strike(i, "it did not report θ after the all-reduce")
        waited, deadline = now - self.t_ring, rules.reduce_deadline(self.host.n_params, MIN_RATE)
        if self.ring_failed_at is None and waited > deadline and majority_s is None:
            for i in rules.reduce_timed_out(self.part(), self.done(), waited, deadline):
                self.note("deadline", node_id=i, name=self.name(i), round=self.rnd, waited_s=waited, phase="reduce")
                if len(self.part()) > 1:  # the others go on without it
                    self.sit_out(i, "deadline", f"it did not report θ within {waited:.0f}s of the all-reduce")
                else:
                    self.strike(i, "it did not report θ after the all-reduce")
            self.retry_reason = f"no majority of the ring reported θ within {deadline:.0f}s"

    def announcing(self) -> bool:
        """A ring of two whose members announced (or will announce) a θ nobody has applied yet."""
        return self.confirm and not self.committed

    def agreed(self) -> bool:
        """Every ring member reported θ after the outer step (or is behind), and all the same θ.
        (Never while a ring of two is announcing: an announced θ is not held by anyone.)"""
        part, done = self.part(), self.done()
        return (
            not self.announcing()
            and bool(done)
            and all(i in done or self.nodes[i].behind for i in part)
            and len({d.checksum for d in done.values()}) == 1
            and self.retry_reason is None
        )

    def minority(self) -> list[str]:
        """Ring members whose θ checksum disagrees with the majority's (RoundError if none has one)."""
        done = self.done()
        try:
            return rules.minority({i: d.checksum for i, d in done.items()})
        except rules.NoMajority:
            detail = ", ".join(f"{self.name(i)}={d.checksum[:12]}" for i, d in done.items())
            raise RoundError(
                f"replicas diverged after round {self.rnd} and no majority agrees on θ: {detail}"
            ) from None

    def equivocation(self) -> None:
        """Before the checksum majority: what the members' reports of the all-gather prove
        (RoundDone.heard, rules.equivocation). A member that signed two different payloads for
        this attempt is out for the run, like a forger, and its θ counts for nothing. The others
        it split hold different θ, each as good as another (every honest payload is in each, and
        one the equivocator signed), and each has applied its own, so the round cannot be redone
        (a member that applied an attempt sits the retry out): the θ most of them hold is kept
        (rules.kept) and those holding another are behind, not diverged: no strike, their Δ
        counts (it is in the kept θ), θ comes with Agreed. A member proven to have sent a false
        block payload in the hierarchy (drift/hierarchy.py) is out the same way, and those it
        misled are behind. A member that reports a payload its owner did not sign made it up: a
        strike, as for any false accusation."""
        rnd, epoch, ring, levels = self.rnd, self.attempt, [m.node_id for m in self.ring], self.levels()
        place = {j: k for k, j in enumerate(ring)}
        found = rules.equivocation(
            {i: [(h.owner, h.digest, h.sig, h.level) for h in d.heard] for i, d in self.done().items()},
            ring,
            lambda owner, digest, sig, level: signed_payload(owner, rnd, epoch, digest, sig, level),
            lambda j, level: levels[level].block(place[j]).start if level < len(levels) else j,
        )
        for i in found.false:
            self.lied(i, "false_accusation", "it reported an all-gather payload that its owner did not sign")
        if not found.equivocators and not found.false_sums:
            return
        for x in found.equivocators:
            self.warn(f"round {rnd}: node {self.name(x)}: {EQUIVOCATED}")
            self.convict(x, "equivocated", EQUIVOCATED, sit_out=False)
            self.fell_behind(x)
        for x in found.false_sums:
            self.warn(f"round {rnd}: node {self.name(x)}: {FALSE_SUM}")
            self.convict(x, "false_sum", FALSE_SUM, sit_out=False)
            self.fell_behind(x)
        rest = {i: d.checksum for i, d in self.done().items()}
        if not rest:
            raise RoundError(f"after round {rnd} only nodes that sent different payloads reported θ")
        keep = rules.kept(rest, ring)
        for i in [i for i, c in rest.items() if c != keep]:
            self.warn(
                f"round {rnd}: node {self.name(i)} holds another θ than the one kept (an equivocator's other "
                "payload); it gets θ from a peer, no strike"
            )
            self.note("split", node_id=i, name=self.name(i), round=rnd, checksum=rest[i])
            self.fell_behind(i)

    def diverged(self, i: str) -> None:
        """A node whose θ after the step disagrees with the majority's: the majority's θ is kept
        (its Δ is in it: the ring finished), and the node gets that θ with Agreed. The round is
        not redone: every member has applied its step, and a step applied twice is not the round.
        Disagreeing is a strike; twice, and the node is dropped."""
        why = f"its θ after round {self.rnd} disagrees with the majority's"
        self.warn(f"round {self.rnd}: node {self.name(i)}: {why}; it gets θ from a peer")
        self.note("diverged", node_id=i, name=self.name(i), round=self.rnd, checksum=self.nodes[i].done.checksum)
        self.fell_behind(i)
        self.strike(i, why)

    def fell_behind(self, i: str) -> None:
        """Node i's Δ is in the round's θ but its own θ is not that θ (or it never said): the
        round settles without its report, and it gets θ with Agreed."""
        self.nodes[i].done, self.nodes[i].behind = None, True

    def strike(self, i: str, why: str) -> None:
        """A strike for node i (Swarm.strike: they decay); one too many, and it is dropped for
        `why` once the round settles."""
        if self.struck(i, why):
            self.drops.append((i, f"{why}, again"))

    def lied(self, i: str, kind: str, why: str, **fields) -> None:
        """Node i said what honest code never says (its claim is contradicted by the round's own
        record or by a signature): a `kind` event naming it, and a strike. One too many, and it is
        out for the run (Ban), not only dropped: a liar that rejoined would lie again."""
        self.warn(f"round {self.rnd}: node {self.name(i)}: {why}")
        self.note(kind, node_id=i, name=self.name(i), round=self.rnd, **fields)
        if self.struck(i, why) and not self.pending(Ban, i):
            self.out.append(Ban(i, f"{why}, again"))
            self.drops.append((i, f"{why}, again"))

    def struck(self, i: str, why: str) -> bool:
        """A Strike for node i; True if that is one too many (Swarm.struck_out). Its strikes of
        this event count too: they are not applied yet."""
        out = self.s.struck_out(i, self.rnd, self.pending(Strike, i) + 1)
        self.out.append(Strike(i, why))
        return out

    def poison_suspects(self) -> Set[str]:
        """The swarm's poison suspects, as this event left them (Suspects not applied yet)."""
        told = [a.nodes for a in self.out if isinstance(a, Suspects)]
        return told[-1] if told else self.s.poison_suspects

    def sit_out(self, i: str, kind: str, why: str, strike: bool = True) -> None:
        """Out of this round's ring, its work redone; Agreed gives it θ when the round settles. A
        node that keeps misbehaving is dropped (Swarm.strike)."""
        self.warn(f"node {self.name(i)}: {why}; it sits out this round and its work is redone")
        self.note("sat_out", node_id=i, name=self.name(i), round=self.rnd, reason=kind)
        n = self.nodes[i]
        if n.counted:
            self.give_back.extend(n.synced.trained)
        n.excluded = True
        self._sits_out(n)
        n.done = None
        if strike and self.struck(i, why):
            self.drop(i, f"{why}, again")

    def abandon(self, why: str) -> None:
        """Give up this round's all-reduce: θ stays as it was, every unit of the round is redone."""
        self.warn(f"round {self.rnd}: {why}; the round is given up, θ is unchanged and its work is redone")
        self.note("round_abandoned", round=self.rnd, reason=why)
        self.abandoned = why
        for i in self.part():
            if self.nodes[i].counted:
                self.give_back.extend(self.nodes[i].synced.trained)
        done = self.done()
        if self.announcing():  # (an announcement applied nothing: it hears, with the others, that θ stays)
            for i in done:
                self.nodes[i].done = None
            done = {}
        for i in [*self.applied_before, *done]:  # its θ moved: it is no donor of the agreed one
            self.out.append(Moved(i))

    # --- the result ------------------------------------------------------------------------------

    def finish(self, now: float) -> tuple[RoundResult, list[Action]]:
        """Record the settled round, and tell the nodes that did not compute θ themselves what it
        is now (Agreed): those that sat out, joined meanwhile, or lost an earlier attempt."""
        self.now = now
        result = self._record()
        s = self.s
        told = [
            i
            for i in s.members
            if (n := self.nodes.get(i)) is not None
            and n.done is None
            and (n.role in ("train", "wait") or n.catching_up)
        ]
        if told:  # (their state_round follows from their heartbeats, once they hold it)
            keep = tuple(i for i in told if i in self.late)
            self.out.append(
                TellAgreed(tuple(told), self.rnd, self.abandoned is not None, keep, rules.staleness_scale(1))
            )
        self.settled = True  # (before the drops: dropping a ring member mid-round redoes the ring)
        self.out.extend(Drop(i, why) for i, why in self.drops)
        return result, self.flush()

    def prev_settled(self, now: float) -> None:
        """Overlapped: the round before settled; this round's clocks start now, and its evaluators' jobs."""
        self.prev = None  # (held, it would hold the one before it, and so on: every round of the run)
        self.t_stop = max(self.t_stop, now) if self.stop_sent else self.t_stop
        for n in self.nodes.values():
            n.last_progress = now
        for i, n in self.nodes.items():
            if n.role == "evaluate" and i in self.s.members and i not in self.s.evaluating:
                self.out.append(Evaluate(i))

    def _record(self) -> RoundResult:
        s, rnd = self.s, self.rnd
        nodes = self.nodes
        if self.abandoned:  # θ unchanged: nobody's work counts, the last agreed θ stays the newest
            checksum, weights, done = s.checksums[s.newest()], {}, {}
        else:
            done = self.done()
            checksum, weights = next(iter(done.values())).checksum, {m.node_id: m.weight for m in self.ring or []}
            self.out.append(AgreedTheta(rnd, checksum, tuple(done)))
        synced = {i: n.synced for i, n in nodes.items() if n.synced is not None}
        counted = {i: b for i, b in synced.items() if weights.get(i, 0) > 0}
        given_back = self.give_back + self.plan.leftover()
        for w in self.carry.values():  # late members that did not train this round: redone
            given_back += w.units
        self.out.append(GiveBack(tuple(given_back)))
        losses = [(b.loss, b.samples) for b in counted.values() if b.loss is not None]
        train_loss = sum(loss * n for loss, n in losses) / sum(n for _, n in losses) if losses else None
        # Only the node asked for it reports the round's val loss (any other member's is ignored).
        val, metrics = (
            (done[self.val_reporter].val_loss, done[self.val_reporter].metrics)
            if self.val_reporter in done
            else (None, {})
        )
        n_samples = sum(samples(b.trained) for b in counted.values())
        res = RoundResult(
            rnd,
            val,
            train_loss,
            checksum,
            n_samples,
            self.now - self.t0,
            [u for b in counted.values() for u in b.trained],
            {i: d.bytes_sent for i, d in done.items()},
            self.abandoned,
            given_back,
            dict(self.late),  # (a drop after finish() forgets the node here, not in the next round)
        )
        self.note(
            "round",
            round=rnd,
            epoch=self.epoch,
            val_loss=val,
            metrics=metrics,
            train_loss=train_loss,
            samples=n_samples,
            seconds=res.seconds,
            checksum=checksum,
            bytes_sent=sum(d.bytes_sent for d in done.values()),
            evaluators=sorted(self.name(i) for i, n in nodes.items() if n.role == "evaluate" and i in s.members),
            reduce_s=max((d.reduce_s for d in done.values()), default=0.0),
            abandoned=self.abandoned,
            nodes={
                self.name(i): {
                    "node_id": i,
                    "samples": samples(b.trained) if i in counted else 0,
                    "steps": rules.steps_of(b.trained, self.r.batch_size) if b.trained else 0,
                    "weight": weights.get(i, 0.0),
                    "busy_s": nodes[i].t_sync - self.t0,
                    "step_s": b.busy_s,
                    "lr": b.lr,
                    "idle_s": max(0.0, self.t_ready - nodes[i].t_sync),
                    "units_after_stop": nodes[i].units_after_stop,  # the one in flight (and one crossing StopRound)
                    "sync_s": done[i].reduce_s if i in done else 0.0,
                    "check_s": done[i].check_s if i in done else 0.0,
                    "bytes_sent": done[i].bytes_sent if i in done else 0,
                    "role": "evaluate" if nodes[i].role == "evaluate" else "train",
                    "trained": [[u.epoch, u.id, u.lo, u.hi] for u in b.trained],
                }
                for i, b in synced.items()
                if i in s.members
            },
        )
        return res
