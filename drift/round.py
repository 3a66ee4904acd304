"""One outer round as the coordinator runs it: grant units, watch progress, cut the round's
tail, enforce deadlines, run the barrier, retry a broken all-reduce, agree on θ's checksum.

Every control message of the round's nodes goes to `Round.on_message`; `Round.tick` runs the
clocks (liveness, deadlines, the barrier) after every message and twice a second. Membership
(who is in the swarm) belongs to the Coordinator; a round reads it and drops nodes through it.

Who takes part, in the order a round decides it:
  * evaluators: too slow to train without holding everyone back (Coordinator._evaluators);
  * trainers: everyone else. A trainer that misses its deadline, or whose θ disagrees with the
    majority after the outer step, *sits out*: its units of the round are redone by others, it
    is not in the ring, and next round it fetches θ like a late joiner. It stays a member: a
    node that is slow for a while is not a node that left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from drift import protocol as P
from drift.scheduler import RoundPlan, UnitQueue, check_accounting

if TYPE_CHECKING:
    from drift.coordinator import Coordinator, Peer

log = logging.getLogger("drift.coord")

MAX_RING_RETRIES = 5


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


def _samples(units: list[P.WorkUnit]) -> int:
    return sum(u.hi - u.lo for u in units)


class Round:
    """The coordinator's side of round `rnd`; `await Round(...).run()` returns its result."""

    def __init__(self, coord: Coordinator, rnd: int, queue: UnitQueue, prev: Round | None = None):
        """`prev`: with the overlapped sync rule, the round before, still in its all-reduce."""
        self.c, self.rnd, self.queue, self.r = coord, rnd, queue, coord.recipe
        self.prev = prev
        self.t0 = time.monotonic()
        self.steal = self.r.schedule == "steal"
        members = coord.members
        self.participants = set(members)  # nodes that joined later enter the next round
        self.budget = self.r.round_samples if self.steal else len(members) * self.r.inner_steps * self.r.batch_size
        self.evaluators = coord._evaluators(self.budget) if self.steal else set()
        # Overlapped: a node that needs θ first (it joined, or its θ is stale) cannot fetch the
        # agreed θ while the round before is being reduced (its donors move on to the next one):
        # it waits this round out and gets θ with that round's Agreed.
        in_flight = prev is not None and not prev.settled
        self.waiting = {
            i
            for i in members
            if in_flight
            and i not in self.evaluators
            and coord.state_round.get(i) != max(coord.checksums)
            and (prev.ring is None or i not in {m.node_id for m in prev.ring})
        }
        self.trainers = {i: coord.speed[i] for i in members if i not in self.evaluators and i not in self.waiting}
        self.queue_before = queue.position()  # the data position before this round took its units
        self.epoch, units = queue.take(self.budget)
        # Lockstep (for comparison) gives every node the same share, whatever its speed.
        self.plan = RoundPlan.make(
            units, self.trainers if self.steal else dict.fromkeys(self.trainers, 1.0), self.steal
        )
        self.fastest = max(self.trainers, key=self.trainers.get)
        now = time.monotonic()
        self.last_progress = dict.fromkeys(members, now)
        self.trained_so_far = dict.fromkeys(members, 0)  # from TrainProgress, this round
        self.synced: dict[str, P.BarrierSync] = {}
        self.t_sync: dict[str, float] = {}
        self.done: dict[str, P.RoundDone] = {}
        self.excluded: set[str] = set()  # weight 0 this round (bad report, deadline)
        self.sitting_out: set[str] = set()  # not in the ring this round (never synced, or diverged)
        self.early: set[str] = set()  # stopped ahead of the others (see tail())
        self.give_back: list[P.WorkUnit] = []
        self.stop_sent, self.t_stop, self.t_ready = False, 0.0, 0.0
        self.ring: list[P.RingMember] | None = None
        self.retry_reason: str | None = None  # why the all-reduce in flight must be redone
        self.ring_failed_at: float | None = None
        self.suspects: dict[str, set[str]] = {}  # ring member -> the neighbours that caught it sending bad bytes
        self.abandoned: str | None = None  # why this round's all-reduce was given up (θ unchanged)
        self.catching_up: set[str] = set()  # told to catch up on prev (not in its ring)
        self.settled = False
        self.given_back: list[P.WorkUnit] = []  # what went back to the queue when it settled
        self.epoch0 = coord.ring_epoch

    # --- who is where ---------------------------------------------------------------------------

    def part(self) -> list[str]:
        """The nodes in this round's barrier and ring."""
        return [
            i
            for i in self.c.members
            if i in self.participants
            and i not in self.evaluators
            and i not in self.sitting_out
            and i not in self.waiting
        ]

    def name(self, i: str) -> str:
        return self.c.members[i].info.name if i in self.c.members else i[:10]

    # --- the round ------------------------------------------------------------------------------

    async def start(self) -> None:
        c, prev = self.c, self.prev
        # The lr schedule follows the swarm's samples: those of the round still being reduced count.
        progress = c.samples_seen + (prev.samples_synced() if prev is not None else 0)
        in_flight = prev is not None and not prev.settled
        for i, peer in list(c.members.items()):
            if i in self.evaluators:  # evaluators work at their own pace: a new job once the last is done
                if i not in c.evaluating and not in_flight:  # (overlapped: once prev is agreed, see finish)
                    await c._assign_evaluation(peer, self.rnd, self.epoch)
                continue
            catch_up = None
            if in_flight and (prev.ring is None or i not in {m.node_id for m in prev.ring}):
                catch_up = prev.rnd  # it does not reduce prev itself: Agreed tells it what θ became
                prev.catching_up.add(i)
            if i in self.waiting:
                await c._send(
                    peer, P.ShardAssignment(round=self.rnd, epoch=self.epoch, units=[], role="wait", catch_up=catch_up)
                )
                continue
            last_round = self.rnd == self.r.rounds - 1
            await c._send(
                peer,
                P.ShardAssignment(
                    round=self.rnd,
                    epoch=self.epoch,
                    units=self.plan.grant_first(i),
                    planned=len(self.plan.planned[i]),
                    report_val=i == self.fastest and (not self.evaluators or last_round),
                    state=c._state_source(i),
                    progress=progress,
                    catch_up=catch_up,
                ),
            )

    def samples_synced(self) -> int:
        """Samples the nodes reported at this round's barrier (counted ones)."""
        return sum(_samples(s.trained) for i, s in self.synced.items() if i not in self.excluded)

    def forget(self, i: str, name: str) -> None:
        """Node i left the swarm: its work of this round is redone; a ring it was in is redone."""
        if i in self.synced and i not in self.excluded:
            self.give_back.extend(self.synced[i].trained)
        self.synced.pop(i, None)
        self.done.pop(i, None)
        self.plan.drop(i)
        if self.ring is not None and self.abandoned is None and i in {m.node_id for m in self.ring}:
            self.retry_reason = f"{name} left during the all-reduce"

    async def on_message(self, peer: Peer, msg: P.Message) -> None:
        i = peer.id
        handler = getattr(self, f"on_{msg.type}", None)
        if handler is not None:
            await handler(i, msg)
        elif not isinstance(msg, (P.Heartbeat, P.Pong)):
            log.warning("ignoring unexpected %s from %s in round %d", msg.type, peer.info.name, self.rnd)

    async def on_TrainProgress(self, i: str, msg: P.TrainProgress) -> None:
        u = msg.unit
        if msg.round != self.rnd or not any(
            g.epoch == u.epoch and g.id == u.id and g.lo <= u.lo and u.hi <= g.hi for g in self.plan.granted.get(i, [])
        ):
            return  # a late report, or samples it was never granted: counts for nothing
        self.last_progress[i] = time.monotonic()
        n = msg.unit.hi - msg.unit.lo
        self.trained_so_far[i] += n
        self.c._measured_speed(i, msg.samples_per_s)
        mon = self.c.monitor
        if mon and i in mon.nodes:
            v = mon.nodes[i]
            v.samples_per_s, v.loss, v.samples = msg.samples_per_s, msg.loss, v.samples + n
            mon.event(
                "progress",
                node_id=i,
                round=self.rnd,
                unit=[msg.unit.epoch, msg.unit.id, msg.unit.lo, msg.unit.hi],
                loss=msg.loss,
                samples_per_s=msg.samples_per_s,
            )

    async def on_AskForMoreWork(self, i: str, msg: P.AskForMoreWork) -> None:
        peer = self.c.members[i]
        if i in self.evaluators and msg.round == self.rnd:  # its job could not start (no donor had
            await self.c._assign_evaluation(peer, self.rnd, self.epoch)  # that θ any more): a fresh one
            return
        nxt = None
        if msg.round == self.rnd and i not in self.excluded | self.early and i not in self.synced:
            nxt = self.plan.next_for(i)
        if nxt is not None:
            self.last_progress[i] = time.monotonic()
            await self.c._send(peer, P.AssignNext(round=self.rnd, unit=nxt))
            return
        await self.c._send(peer, P.NoMoreWork(round=msg.round))
        if self.steal and self.plan.remaining() == 0:
            await self.stop_all("the round's budget is handed out")

    async def on_BarrierSync(self, i: str, msg: P.BarrierSync) -> None:
        if msg.round != self.rnd or i in self.sitting_out or i in self.synced:
            return  # a node that sat out a round reports it late: its work there is redone already
        self.synced[i], self.t_sync[i] = msg, time.monotonic()
        if i not in self.excluded and i not in self.evaluators:
            wrong = check_accounting(self.plan.granted.get(i, []), msg.trained, msg.returned)
            if msg.delta_error and not wrong:
                log.warning("node %s: %s; its work this round is redone", self.name(i), msg.delta_error)
                self.c._note("bad_delta", node_id=i, reason=msg.delta_error, round=self.rnd)
                self.exclude(i)  # everything granted to it, trained or returned, is redone
            elif wrong:
                log.warning("node %s: bad work report (%s); its work this round is redone", self.name(i), wrong)
                self.c._note("bad_report", node_id=i, reason=wrong, round=self.rnd)
                self.exclude(i)
            else:  # accounted for: what it trained is in synced, the rest goes back
                self.give_back.extend(msg.returned)
                self.plan.granted[i] = []
        if msg.val_loss is not None and i == self.fastest:  # the node asked for it (report_val)
            if self.rnd == 0:
                self.c.initial_val_loss = msg.val_loss
                self.c._note("initial", val_loss=msg.val_loss, val_samples=msg.val_samples, metrics=msg.metrics)
            else:
                self.c._note(
                    "val",
                    after_round=self.rnd - 1,
                    val_loss=msg.val_loss,
                    val_samples=msg.val_samples,
                    metrics=msg.metrics,
                )

    async def on_RoundDone(self, i: str, msg: P.RoundDone) -> None:
        if msg.round == self.rnd and msg.ring_epoch == self.c.ring_epoch and i in self.part():
            self.done[i] = msg

    async def on_RingFailed(self, i: str, msg: P.RingFailed) -> None:
        if self.ring is None or msg.round != self.rnd or msg.ring_epoch != self.c.ring_epoch:
            return
        if msg.sit_out:  # it already applied an earlier attempt's outer step: it cannot redo it
            self.sit_out(i, "retry", "it finished an earlier attempt of this all-reduce", strike=False)
            self.retry_reason = self.retry_reason or f"{self.name(i)} cannot take part in the retry"
            return
        if msg.suspect in self.part() and msg.suspect != i:
            self.suspects.setdefault(msg.suspect, set()).add(i)
        if self.ring_failed_at is None:
            log.warning("round %d: %s reports the all-reduce failed: %s", self.rnd, self.name(i), msg.reason)
            self.ring_failed_at = time.monotonic()

    async def on_EvalResult(self, i: str, msg: P.EvalResult) -> None:
        if self.c._on_eval(i, msg) and i in self.evaluators and msg.after_round < max(self.c.checksums):
            # A newer θ is already agreed: evaluate it now rather than at the next round.
            await self.c._assign_evaluation(self.c.members[i], self.rnd, self.epoch)

    # --- decisions --------------------------------------------------------------------------------

    async def stop_all(self, reason: str) -> None:
        if not self.stop_sent:
            self.stop_sent, self.t_stop = True, time.monotonic()
            log.info("round %d: %s; stopping at the next inner step", self.rnd, reason)
            await asyncio.gather(
                *(
                    self.c._send(self.c.members[i], P.StopRound(round=self.rnd))
                    for i in self.part()
                    if i not in self.synced
                )
            )

    def exclude(self, i: str) -> None:
        """Weight 0 this round: everything granted to it (trained or not) is redone by others."""
        self.excluded.add(i)
        self.plan.drop(i)

    def drop(self, i: str, why: str) -> None:
        """Remove a node from the swarm mid-round (every live round forgets it)."""
        self.c.drop(i, why, self.rnd)

    async def tick(self, now: float, may_reduce: bool = True) -> bool:
        """Run the clocks; True once the round is settled (every ring member reported θ, or the
        all-reduce was given up). `may_reduce` False holds the ring back (the round before is
        still being reduced)."""
        if self.steal and self.ring is None and not self.stop_sent:
            await self.tail()
        await self.deadlines(now)
        if self.ring is None:
            return await self.barrier(now) if may_reduce else False
        return await self.reduce_progress(now)

    async def tail(self) -> None:
        """A node whose next inner step would end after everyone else ran out of work stops now,
        so nobody waits at the barrier for most of a slow step."""
        active = [i for i in self.part() if i not in self.synced and i not in self.excluded and i not in self.early]
        in_hand = {i: _samples(self.plan.granted.get(i, [])) - self.trained_so_far[i] for i in active}
        speed = self.c.speed
        for i in sorted(active, key=lambda i: speed[i]):  # slowest first
            others = [j for j in active if j != i]
            if not others:
                break
            left_s = (self.plan.remaining() + sum(in_hand[j] for j in others)) / sum(speed[j] for j in others)
            if self.r.batch_size / speed[i] > left_s:
                self.early.add(i)
                active.remove(i)
                await self.c._send(self.c.members[i], P.StopRound(round=self.rnd))

    async def deadlines(self, now: float) -> None:
        r, c = self.r, self.c
        if self.prev is not None and not self.prev.settled:
            return  # overlapped: the nodes wait at this barrier for the round before to land
        for i in list(c.members):
            if (
                i not in self.participants
                or self.ring is not None
                or i in self.synced
                or i in self.excluded
                or i in self.evaluators
            ):
                continue
            # Deadlines: a unit should take unit_samples/speed, and after StopRound a node should
            # reach the barrier within one inner step. Past unit_deadline_factor times that (plus
            # heartbeat slack), its work is reassigned and it sits this round out.
            if self.stop_sent or i in self.early:
                since, expected = max(self.t_stop, self.last_progress[i]), r.batch_size / c.speed[i]
            elif i in self.trainers and self.plan.granted.get(i):
                since, expected = self.last_progress[i], r.unit_samples / c.speed[i]
            else:
                continue
            if self.rnd == 0 and i == self.fastest and not self.stop_sent:  # it evaluates θ0 before training
                expected += r.eval_batches * r.batch_size / c.speed[i]
            waited = now - since
            others = [j for j in self.part() if j != i and j not in self.excluded]
            if others and waited > r.unit_deadline_factor * expected + 2 * r.heartbeat_s:
                name = self.name(i)
                log.warning(
                    "node %s has not finished its work in %.1fs (expected %.2fs): its units are "
                    "reassigned and it sits out this round",
                    name,
                    waited,
                    expected,
                )
                c._note("deadline", node_id=i, name=name, round=self.rnd, waited_s=waited, expected_s=expected)
                self.exclude(i)
                # What we know now: it is at least this slow. Plans (and the choice of evaluators)
                # from the next round on use that.
                c.speed[i] = min(c.speed[i], r.batch_size / waited)
                await c._send(c.members[i], P.StopRound(round=self.rnd))

    async def barrier(self, now: float) -> bool:
        """Once every trainer synced (or sits out past its deadline), send the ring."""
        part = self.part()
        if not part:
            raise RoundError(f"every training node has left (round {self.rnd})")
        unsynced = [i for i in part if i not in self.synced]
        if any(i not in self.excluded for i in unsynced):
            return False
        if not any(i in self.synced and i not in self.excluded for i in part):
            # Every node's work of this round is void (bad reports, bad Δ, deadlines): θ stays.
            self.abandon("no node's work of this round can be used")
            return True
        for i in unsynced:  # stragglers past their deadline: the swarm goes on without them
            self.sitting_out.add(i)
            self.c._note("sat_out", node_id=i, name=self.name(i), round=self.rnd, reason="deadline")
        self.t_ready = now
        await self.send_ring()
        return False

    async def send_ring(self) -> None:
        """BarrierReady to every node in the barrier: the ring order and each node's weight."""
        part = self.part()
        counted = [i for i in part if i not in self.excluded]
        total = sum(_samples(self.synced[i].trained) for i in counted)

        def weight(i: str) -> float:
            return _samples(self.synced[i].trained) / total if i in counted and total else 0.0

        c = self.c
        order = part if c.ring_epoch % 2 == 0 else part[::-1]  # a retry swaps everyone's neighbours
        self.ring = [P.RingMember(node_id=i, ticket=c.members[i].info.ring_ticket, weight=weight(i)) for i in order]
        c._note("barrier", round=self.rnd, ring_epoch=c.ring_epoch, nodes=len(self.ring))
        await c._broadcast(
            [c.members[i] for i in part],
            P.BarrierReady(round=self.rnd, ring=self.ring, codec=self.r.codec, ring_epoch=c.ring_epoch),
        )

    async def reduce_progress(self, now: float) -> bool:
        """While the ring runs: retry it when it broke; once every member reported, check θ."""
        part = self.part()
        if (
            self.retry_reason is None
            and self.ring_failed_at is not None
            and now - self.ring_failed_at > 2 * self.r.heartbeat_s + 1
        ):
            # The ring is all or nothing: if every other member finished it, they agree on θ and
            # the reporters' word against them changes nothing (a node repeating RingFailed cannot
            # hold every round hostage); the reporters get θ with Agreed.
            failed = [i for i in part if i not in self.done]
            if failed and 2 * (len(part) - len(failed)) > len(part) and self.minority() == []:
                # Their Δ is in the others' result (that is how a ring finishes), so their work
                # counts; only their θ is behind.
                log.warning(
                    "round %d: %d node(s) reported a failed all-reduce that the others finished; "
                    "they get θ from a peer",
                    self.rnd,
                    len(failed),
                )
                return True
            self.retry_reason = "a node reported a broken all-reduce and nobody left"
        if self.retry_reason is None and part and all(i in self.done for i in part):
            diverged = self.minority()
            if not diverged:
                return True
            for i in diverged:
                self.sit_out_diverged(i)
            self.retry_reason = f"{len(diverged)} node(s) disagreed with the majority on θ"
        if self.retry_reason is None:
            return False
        # A member caught by both its neighbours (bad bytes, or silence) sits the round out, so one
        # bad node cannot hold the all-reduce hostage. Both: the ring is reversed on every retry,
        # so its other neighbour sees its output too; one node alone cannot frame another.
        for i, reporters in self.suspects.items():
            if len(reporters) >= 2 and i in self.part():
                self.sit_out(i, "ring", "both its ring neighbours caught it breaking the all-reduce")
        if not self.part():
            raise RoundError(f"every training node has left (round {self.rnd})")
        if self.c.ring_epoch - self.epoch0 >= MAX_RING_RETRIES:
            self.abandon(f"the all-reduce failed {MAX_RING_RETRIES + 1} times (last: {self.retry_reason})")
            return True
        log.warning(
            "round %d: %s; retrying the all-reduce with %d node(s)", self.rnd, self.retry_reason, len(self.part())
        )
        self.c._note("ring_retry", round=self.rnd, reason=self.retry_reason, nodes=len(self.part()))
        self.retry_reason, self.ring_failed_at = None, None
        self.done.clear()
        self.c.ring_epoch += 1
        await self.send_ring()
        return False

    def agreed(self) -> bool:
        """Every ring member reported θ after the outer step, and all the same θ."""
        part = self.part()
        return (
            bool(part)
            and all(i in self.done for i in part)
            and len({self.done[i].checksum for i in part}) == 1
            and self.retry_reason is None
        )

    def minority(self) -> list[str]:
        """Ring members whose θ checksum disagrees with the majority's (RoundError if none has one)."""
        counts = Counter(d.checksum for d in self.done.values())
        if len(counts) == 1:
            return []
        top, n = counts.most_common(1)[0]
        if 2 * n <= len(self.done):
            detail = ", ".join(f"{self.name(i)}={d.checksum[:12]}" for i, d in self.done.items())
            raise RoundError(f"replicas diverged after round {self.rnd} and no majority agrees on θ: {detail}")
        return [i for i, d in self.done.items() if d.checksum != top]

    def sit_out_diverged(self, i: str) -> None:
        """A node whose θ disagrees with the majority's: out of the ring, its work redone."""
        self.c._note("diverged", node_id=i, name=self.name(i), round=self.rnd, checksum=self.done[i].checksum)
        self.sit_out(i, "diverged", f"its θ after round {self.rnd} disagrees with the majority's")

    def sit_out(self, i: str, kind: str, why: str, strike: bool = True) -> None:
        """Out of this round's ring, its work redone; Agreed gives it θ when the round settles. A
        node that keeps misbehaving is dropped (Coordinator.strike)."""
        log.warning("node %s: %s; it sits out this round and its work is redone", self.name(i), why)
        self.c._note("sat_out", node_id=i, name=self.name(i), round=self.rnd, reason=kind)
        if i not in self.excluded and i in self.synced:
            self.give_back.extend(self.synced[i].trained)
        self.excluded.add(i)
        self.sitting_out.add(i)
        self.done.pop(i, None)
        if strike and self.c.strike(i):
            self.drop(i, f"{why}, again")

    def abandon(self, why: str) -> None:
        """Give up this round's all-reduce: θ stays as it was, every unit of the round is redone."""
        log.warning("round %d: %s; the round is given up, θ is unchanged and its work is redone", self.rnd, why)
        self.c._note("round_abandoned", round=self.rnd, reason=why)
        self.abandoned = why
        for i in self.part():
            if i not in self.excluded and i in self.synced:
                self.give_back.extend(self.synced[i].trained)

    # --- the result ------------------------------------------------------------------------------

    async def finish(self) -> RoundResult:
        """Record the settled round, and tell the nodes that did not compute θ themselves what it
        is now (Agreed): those that sat out, joined meanwhile, or lost an earlier attempt."""
        result = self._record()
        c = self.c
        told = [
            i
            for i in c.members
            if i not in self.done and ((i in self.participants and i not in self.evaluators) or i in self.catching_up)
        ]
        for i in told:  # (their state_round follows from their heartbeats, once they hold it)
            src = c._state_source(i, force=True)
            await c._send(c.members[i], P.Agreed(round=self.rnd, abandoned=self.abandoned is not None, state=src))
        nxt = c.current if c.current is not None and c.current is not self else None
        if nxt is not None:  # overlapped: the next round's clocks start now, and its evaluators' jobs
            now = time.monotonic()
            nxt.t_stop = max(nxt.t_stop, now) if nxt.stop_sent else nxt.t_stop
            nxt.last_progress = dict.fromkeys(nxt.last_progress, now)
            for i in nxt.evaluators:
                if i in c.members and i not in c.evaluating:
                    await c._assign_evaluation(c.members[i], nxt.rnd, nxt.epoch)
        return result

    def _record(self) -> RoundResult:
        c, rnd = self.c, self.rnd
        if self.abandoned:  # θ unchanged: nobody's work counts, the last agreed θ stays the newest
            checksum, weights, done = c.checksums[max(c.checksums)], {}, {}
        else:
            checksum, weights, done = (
                next(iter(self.done.values())).checksum,
                {m.node_id: m.weight for m in self.ring or []},
                self.done,
            )
            c.checksums[rnd] = checksum
            for i in done:
                c.state_round[i] = rnd
        counted = {i: s for i, s in self.synced.items() if weights.get(i, 0) > 0}
        for s in counted.values():
            c.ledger.add(s.trained)
        self.given_back = self.give_back + self.plan.leftover()
        self.queue.give_back(self.given_back)
        losses = [(s.loss, s.samples) for s in counted.values() if s.loss is not None]
        train_loss = sum(loss * n for loss, n in losses) / sum(n for _, n in losses) if losses else None
        val, metrics = next(((d.val_loss, d.metrics) for d in done.values() if d.val_loss is not None), (None, {}))
        samples = sum(_samples(s.trained) for s in counted.values())
        res = RoundResult(rnd, val, train_loss, checksum, samples, time.monotonic() - self.t0)
        mon = c.monitor
        if mon:
            mon.val_loss = val if val is not None else mon.val_loss
            for i, d in done.items():
                if i in mon.nodes:
                    mon.nodes[i].bytes_sent += d.bytes_sent
            mon.event(
                "round",
                round=rnd,
                epoch=self.epoch,
                val_loss=val,
                metrics=metrics,
                train_loss=train_loss,
                samples=samples,
                seconds=res.seconds,
                checksum=checksum,
                bytes_sent=sum(d.bytes_sent for d in done.values()),
                evaluators=sorted(self.name(i) for i in self.evaluators if i in c.members),
                reduce_s=max((d.reduce_s for d in done.values()), default=0.0),
                abandoned=self.abandoned,
                nodes={
                    self.name(i): {
                        "node_id": i,
                        "samples": _samples(s.trained) if i in counted else 0,
                        "steps": s.steps,
                        "weight": weights.get(i, 0.0),
                        "busy_s": self.t_sync[i] - self.t0,
                        "step_s": s.busy_s,
                        "lr": s.lr,
                        "idle_s": max(0.0, self.t_ready - self.t_sync[i]),
                        "sync_s": done[i].reduce_s if i in done else 0.0,
                        "bytes_sent": done[i].bytes_sent if i in done else 0,
                        "role": "evaluate" if i in self.evaluators else "train",
                        "trained": [[u.epoch, u.id, u.lo, u.hi] for u in s.trained],
                    }
                    for i, s in self.synced.items()
                    if i in c.members
                },
            )
        return res
