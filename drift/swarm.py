"""The swarm's state, with one owner: who is in the run, how fast each node is, which θ each
holds, its strikes, the agreed checksum of θ after each round and the ring epoch. The
Coordinator serves connections and applies what the rounds decide (drift.round's actions); it
changes this state only through the methods here. A round only reads it (round.SwarmView).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from drift import protocol as P
from drift import rules
from drift.inner import finite_positive
from drift.recipe import Recipe
from drift.transport import Channel

log = logging.getLogger("drift.coord")

SPEED_CAP = 1000.0  # a measured speed is at most this many times the fastest other member's (honest spreads: ~600x)
MAX_STRIKES = 2  # a node made to sit out for misbehaving (θ that disagrees, a ring it breaks) this often is dropped
STRIKE_ROUNDS = 10  # ... within this many rounds: older strikes expire (an honest node's bad luck decays)
DONOR_TRIES = 3  # the coordinator asks at most this many nodes for one θ (each within its own timeout)


@dataclass
class Peer:
    """An admitted node's connection."""

    info: P.NodeInfo
    ch: Channel
    commit: P.RepoCommit | None = None
    gone: str | None = None  # why its connection ended (for the log), once it has
    broken: str | None = None  # why we closed it ourselves (a send to it failed)

    @property
    def id(self) -> str:
        return self.info.node_id


Note = Callable[..., None]  # note(kind, **fields): one metrics event


class Swarm:
    """Members and what the coordinator knows of each."""

    def __init__(self, recipe: Recipe, note: Note = lambda kind, **fields: None):
        self.recipe = recipe
        self.note = note
        self.members: dict[str, Peer] = {}  # nodes in the run now
        self.speed: dict[str, float] = {}  # samples/s: calibrated at join, then measured
        self.last_seen: dict[str, float] = {}  # monotonic time of each node's last message
        self.state_round: dict[str, int] = {}  # the round whose θ each node holds (-1: initial θ)
        self.checksums: dict[int, str] = {}  # the agreed checksum of θ after each round
        self.evaluating: set[str] = set()  # evaluators with an evaluation in flight
        self.strikes: dict[str, list[int]] = {}  # the rounds of each node's recent misbehaviours (strike)
        self.ring_epoch = 0  # +1 per retried all-reduce (ring connections renew)
        # A grid attempt failed with nobody named (rules.flat_from_now): rounds before this one
        # reduce on the flat ring; how many times that happened (each lasts rules.flat_rounds).
        self.flat_until, self.grid_distrusted = 0, 0
        self.measured: set[str] = set()  # nodes whose speed our own clock has measured
        self.poison_suspects: set[str] = set()  # one of these sent more into a ring than it reported
        self.banned: dict[str, str] = {}  # nodes proven to poison the all-reduce -> why: out for the run
        # holder -> the members it sent pieces that were not the swarm's (HolderReport)
        self.holder_named_by: dict[str, set[str]] = {}
        # Tickets told (a BarrierReady names members by id): each member's ticket and when it was
        # first seen (a counter), and, per member, which of its peers' tickets it was told in its
        # session (as of that counter: a peer back with a new ticket is told again).
        self._seq = 0
        self._ticket_seq: dict[str, tuple[str, int]] = {}
        self._told: dict[str, dict[str, int]] = {}
        # The ring order last sent, and who was sent it (a BarrierReady leaves it out for them).
        self._order: tuple[str, ...] = ()
        self._told_order: set[str] = set()
        self._near_top: str | None = None  # the fastest other member when measured_speed last looked

    def name(self, i: str) -> str:
        return self.members[i].info.name if i in self.members else i[:10]

    def newest(self) -> int:
        """The newest round with an agreed θ (-1: the initial θ)."""
        return max(self.checksums)

    def seen(self, i: str, now: float | None = None) -> None:
        self.last_seen[i] = time.monotonic() if now is None else now

    def holds(self, i: str, rnd: int) -> None:
        """Node i says it holds θ of round rnd (believed only for a θ that was agreed)."""
        if rnd in self.checksums:
            self.state_round[i] = rnd

    def enter(self, p: Peer, state_round: int) -> None:
        self.members[p.id] = p
        if self._ticket_seq.get(p.id, (None, 0))[0] != p.info.ring_ticket:
            self._seq += 1
            self._ticket_seq[p.id] = (p.info.ring_ticket, self._seq)
        self._told[p.id] = {}  # a new session knows no ticket, and no ring order
        self._told_order.discard(p.id)
        self.speed[p.id] = self.checked_speed(p, p.commit.samples_per_s if p.commit else None)
        # Every claim against the new set (as bounded() would one by one, in one pass over it).
        fastest = max((self.speed[j] for j in self.members if j in self.measured), default=None)
        cap = fastest if fastest is not None else rules.claims_cap([self.speed[j] for j in self.members])
        for i in self.members:
            if i not in self.measured:
                self.speed[i] = min(self.speed[i], cap)
        self.seen(p.id)
        self.state_round[p.id] = state_round

    def evaluates(self, i: str) -> None:
        """Evaluator i was given a job."""
        self.evaluating.add(i)

    def evaluated(self, i: str) -> None:
        """Evaluator i's job is over (its result came, or it left)."""
        self.evaluating.discard(i)

    def leave(self, i: str) -> Peer | None:
        """Remove node i from the run; returns its connection (None if it was not a member)."""
        self.evaluating.discard(i)
        self.measured.discard(i)
        self._ticket_seq.pop(i, None)
        self._told.pop(i, None)
        for told in self._told.values():
            told.pop(i, None)
        self._told_order.discard(i)
        return self.members.pop(i, None)

    def ticket_news(self, i: str, peers: Iterable[str]) -> dict[str, str]:
        """The tickets of `peers` (the members i connects to in an all-reduce) that member i was
        not told in this session, or was told before the peer came back with a new one."""
        told, news = self._told.get(i, {}), {}
        for j in peers:
            if (ticket := self._ticket_seq.get(j)) is not None and told.get(j) != ticket[1]:
                news[j] = ticket[0]
        return news

    def told_tickets(self, i: str, peers: Iterable[str]) -> None:
        """Member i was sent the tickets of `peers` that ticket_news gave."""
        if (told := self._told.get(i)) is not None:
            for j in peers:
                if j in self._ticket_seq:
                    told[j] = self._ticket_seq[j][1]

    def told_order(self, order: list[str]) -> frozenset[str]:
        """The members whose last BarrierReady named exactly this ring order."""
        return frozenset(self._told_order) if tuple(order) == self._order else frozenset()

    def ring_told(self, nodes: tuple[str, ...], order: tuple[str, ...]) -> None:
        """These members were sent the ring `order` (a newer order: the others know an older one)."""
        if order != self._order:
            self._order, self._told_order = order, set()
        self._told_order.update(i for i in nodes if i in self.members)

    def checked_speed(self, peer: Peer, sps: float | None) -> float:
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
        self.note("absurd_speed", node_id=peer.id, name=peer.info.name, reported=str(sps), used=fallback)
        return fallback

    def bounded(self, i: str, claim: float) -> float:
        """A speed node i claims (calibration, an evaluation's timing): never above the fastest
        node our clock has measured, and before anyone is measured (the first round) never above
        the median claim (rules.bound_claim)."""
        fastest = max((self.speed[j] for j in self.measured if j != i and j in self.members), default=None)
        if fastest is not None:
            return min(claim, fastest)
        return rules.bound_claim(claim, [self.speed[j] for j in self.members if j != i and j in self.speed])

    def measured_speed(self, i: str, sps: float | None) -> None:
        """A node's speed as our clock measured it on a finished unit, averaged in: one unit of a
        fast device is a few milliseconds, and one hiccup must not make it look 20x slower. A
        node that really became far slower is caught by its deadline instead (slowed)."""
        if i in self.speed and finite_positive(sps):
            # Capped at SPEED_CAP times the fastest other member. Every unit of every node comes
            # here, so that member is looked for (a pass over the members) only when the one found
            # last time, another member still, is not fast enough to leave sps under the cap.
            ref = self._near_top
            if ref is None or ref == i or ref not in self.members or sps > SPEED_CAP * self.speed[ref]:
                ref = self._near_top = max(
                    (j for j in self.members if j != i), key=self.speed.__getitem__, default=None
                )
                if ref is not None:
                    sps = min(sps, SPEED_CAP * self.speed[ref])
            first = i not in self.measured  # a claim above what we measured goes at once
            self.speed[i] = sps if first and sps < self.speed[i] else 0.5 * self.speed[i] + 0.5 * sps
            self.measured.add(i)

    def claimed_speed(self, i: str, sps: float | None) -> None:
        """An evaluator's own estimate of its training speed (from its evaluation's timing):
        averaged in like a measurement, but never above the fastest measured node."""
        if i in self.speed and finite_positive(sps):
            self.speed[i] = 0.5 * self.speed[i] + 0.5 * self.bounded(i, sps)

    def slowed(self, i: str, at_most: float) -> None:
        """What a missed deadline tells: node i is at least this slow."""
        self.speed[i] = min(self.speed[i], at_most)

    def strike(self, i: str, rnd: int) -> None:
        """Count one misbehaviour of node i in round rnd (θ that disagrees, a ring it breaks, a
        round it held up); struck_out() says when it should be dropped."""
        self.strikes[i] = [*self._recent(i, rnd), rnd]

    def struck_out(self, i: str, rnd: int, more: int = 1) -> bool:
        """Whether `more` strikes of node i in round rnd would make MAX_STRIKES within
        STRIKE_ROUNDS rounds (a read: strike() counts one)."""
        return len(self._recent(i, rnd)) + more >= MAX_STRIKES

    def back_from(self, i: str, rnd: int) -> int | None:
        """A node dropped for its strikes may rejoin once the oldest of them expired: the round
        it may come back in, or None if it may now (otherwise it would cost the swarm a deadline
        every time it came back)."""
        recent = self._recent(i, rnd)
        return recent[-MAX_STRIKES] + STRIKE_ROUNDS if len(recent) >= MAX_STRIKES else None

    def _recent(self, i: str, rnd: int) -> list[int]:
        return [r for r in self.strikes.get(i, []) if r > rnd - STRIKE_ROUNDS]

    def ban(self, i: str, why: str) -> None:
        """Node i is out for the run (proven to poison the all-reduce, forge or equivocate): refused from now on."""
        self.banned[i] = why

    def distrust_grid(self, rnd: int) -> None:
        """A grid attempt of round rnd failed and nobody was named: the all-reduces of the next
        rules.flat_rounds rounds, this one's retries included, run on the flat ring."""
        self.grid_distrusted += 1
        self.flat_until = max(self.flat_until, rnd + rules.flat_rounds(self.grid_distrusted))

    def ring_renewed(self, epoch: int) -> None:
        """The all-reduce in flight is retried as ring `epoch`: connections of older epochs are stale."""
        self.ring_epoch = epoch

    def suspect(self, nodes: set[str] | frozenset[str]) -> None:
        """One of `nodes` sent more into a ring than it reported: the next search by halves starts there."""
        self.poison_suspects = set(nodes)

    def moved(self, i: str) -> None:
        """Node i applied an attempt that was given up: it holds no agreed θ (nobody asks it for one)."""
        self.state_round.pop(i, None)

    def agreed(self, rnd: int, checksum: str, holders: tuple[str, ...] | list[str]) -> None:
        """θ after round rnd (-1: the initial θ) has this checksum, and `holders` hold it."""
        self.checksums[rnd] = checksum
        for i in holders:
            self.state_round[i] = rnd

    def evaluators(self, budget: int) -> set[str]:
        """The members too slow to train this round (rules.evaluators)."""
        r = self.recipe
        speeds = rules.planning_speeds({i: self.speed[i] for i in self.members}, self.measured)
        return rules.evaluators(speeds, budget, r.batch_size, r.slow_node_fraction)

    def named_holder(self, by: str, holder: str) -> bool:
        """Member `by` says `holder` sent it a piece of θ that is not the swarm's (HolderReport).
        True when that makes two members who named it: from then on it is nobody's donor
        (donors), however fast. One member's word alone changes nothing."""
        if by == holder or by not in self.members or holder not in self.members:
            return False
        named = self.holder_named_by.setdefault(holder, set())
        before = len(named)
        named.add(by)
        return before < 2 <= len(named)

    def donors(self, rnd: int, but: str | None = None) -> list[str]:
        """The nodes to ask for θ of round `rnd`, fastest first: members that hold it, except `but`,
        a node on its way out (one banned this round is a member until the round settles), one
        whose connection is gone (the round loop has not dropped it yet) and one that two members
        named for sending pieces that were not the swarm's. A node that left, or whose process
        exited (drift coord --local drops it), is no member, so never asked."""
        return sorted(
            (
                i
                for i, p in self.members.items()
                if self.state_round.get(i) == rnd
                and i != but
                and i not in self.banned
                and p.gone is None
                and p.broken is None
                and len(self.holder_named_by.get(i, ())) < 2
            ),
            key=lambda i: -self.speed[i],
        )

    def state_source(self, node: str, force: bool = False, own: str | None = None) -> P.StateSource | None:
        """Where `node` gets the swarm's newest agreed θ, or None when it already holds it. `own`:
        the coordinator's ticket, when it serves that θ itself (a resumed checkpoint)."""
        last = self.newest()
        if self.state_round.get(node) == last and not force:
            return None
        tickets = [self.members[i].info.ring_ticket for i in self.donors(last, but=node)]
        if own is not None:
            tickets.append(own)
        return P.StateSource(round=last, checksum=self.checksums[last], tickets=tickets[: P.MAX_NODES])
