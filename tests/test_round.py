"""The coordinator's round logic against attacks, in milliseconds: real protocol messages
(drift.protocol) replayed as events into a real drift.round.Round over a real drift.swarm.Swarm,
on a clock the test moves. Round.step returns actions; the test applies them as the Coordinator
does (sends recorded instead of sent, the swarm's writes through its methods): the round itself
writes nothing outside itself. Each test is one attack of issue 36 or a fault an honest swarm
meets; what the round decides is asserted through what it sends, notes, strikes and settles.
"""

from __future__ import annotations

import copy
import gc
import weakref
from types import MappingProxyType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drift import hierarchy, ring, rules
from drift import protocol as P
from drift import round as R
from drift.recipe import Recipe
from drift.ring import GRID_FROM, MIN_RATE, neighbours
from drift.round import Round
from drift.scheduler import UnitQueue
from drift.swarm import Peer, Swarm
from drift.sync import collective

BATCH = 4
GRACE = 2 * 2.0 + 1  # Round.reduce_progress: how long a RingFailed waits for the others' reports


def nid(name: str) -> str:
    return (name.encode().hex() * 64)[:64]


class Host:
    """What a round reads from the coordinator: where a node gets θ, θ's size."""

    def __init__(self, swarm: Swarm, n_params: int = 0):
        self.s = swarm
        self.n_params = n_params

    def state_source(self, node: str, force: bool = False) -> P.StateSource | None:
        return self.s.state_source(node, force)


class Sim:
    """A swarm of named nodes and one round of it, driven by messages and a clock."""

    def __init__(self, names: list[str], rounds: int = 3, speeds: dict[str, float] | None = None, **recipe):
        fields = dict(name="t", task="x.py", rounds=rounds, inner_steps=4, batch_size=BATCH, unit_steps=1)
        fields.update(min_nodes=len(names), **recipe)
        self.recipe = Recipe(**fields)
        self.s = Swarm(self.recipe)
        self.host = Host(self.s)
        self.sent: list[tuple[str, P._Msg]] = []  # (a BarrierReady with the order its node knows)
        self.orders: dict[str, list[str]] = {}  # the ring order each node was last sent
        self.notes: list[tuple[str, dict]] = []
        self.dropped: list[tuple[str, str]] = []
        self.actions: list[R.Action] = []  # everything the round decided, in order
        self.log: list[str] = []
        self.ids = {n: nid(n) for n in names}
        self.names = {v: k for k, v in self.ids.items()}
        for n, i in self.ids.items():
            info = P.NodeInfo(node_id=i, name=n, backend="numpy", device="cpu", ring_ticket=f"ticket-{n}")
            self.s.enter(Peer(info=info, ch=None), -1)  # type: ignore[arg-type]  # (the host sends)
            self.s.speed[i] = (speeds or {}).get(n, 100.0)
        self.s.agreed(-1, "theta0", ())
        self.queue = UnitQueue(10_000, self.recipe.unit_samples)
        self.rd: Round | None = None
        self.late: dict[str, R.Late] = {}  # the last settled round's late members
        self.t0 = self.now = 1000.0  # the test's clock

    # --- driving: as the Coordinator does ----------------------------------------------------

    def apply(self, actions: list[R.Action]) -> bool:
        settled = False
        self.actions += actions
        for a in actions:
            if R.write_swarm(self.s, a, self.rd.rnd):
                continue
            match a:
                case R.Send(nodes=nodes, msg=msg):
                    for i in nodes:
                        m = P.decode(P.encode(msg))  # it must encode
                        if isinstance(m, P.BarrierReady):  # spelled out as the node does
                            m.members(self.orders.get(i))  # (raises when it cannot)
                            self.orders[i] = m.order or self.orders[i]
                            m = m.model_copy(update={"order": self.orders[i]})
                        self.sent.append((i, m))
                case R.TellAgreed(nodes=nodes, round=rnd, abandoned=abandoned):
                    told = [(i, self.host.state_source(i, force=True)) for i in nodes if i in self.s.members]
                    self.sent += [
                        (i, P.Agreed(round=rnd, abandoned=abandoned, state=src, keep=a.scale if i in a.keep else 0.0))
                        for i, src in told
                    ]
                case R.Log(text=text):
                    self.log.append(text)
                case R.Note(kind=kind, fields=fields):
                    self.notes.append((kind, fields))
                case R.Drop(node=i, why=why):
                    self.drop(i, why)
                case R.GiveBack(units=units):
                    self.queue.give_back(list(units))
                case R.Evaluate(node=i):
                    self.s.evaluates(i)
                case R.Settled():
                    settled = True
        return settled

    def drop(self, i: str, why: str) -> None:
        if i in self.s.members:
            self.rd.step(R.Left(i), self.now)
            self.s.leave(i)
            self.dropped.append((i, why))

    def start(self, rnd: int = 0) -> Round:
        taken = self.queue.take_round(R.budget(self.s, self.queue.pending_samples()))
        self.rd = Round(self.s, self.host, rnd, taken, self.now, late=self.late)
        self.apply(self.rd.start(0))
        return self.rd

    def msg(self, name: str, m: P._Msg) -> None:
        m = P.decode(P.encode(m))  # as it arrives: through the wire's codec
        if self.ids[name] in self.s.members:
            self.apply(self.rd.step(R.Message(self.ids[name], m), self.now))

    def tick(self, after: float = 0.0) -> bool:
        """The round's clocks `after` seconds after it started; True once settled."""
        self.now = max(self.now, self.t0 + after)
        settled = self.apply(self.rd.step(R.Tick(), self.now))
        if settled:
            self.result, actions = self.rd.finish(self.now)
            self.late = self.result.late  # (the Coordinator hands them to the next round)
            self.apply(actions)
        return settled

    def train(
        self, name: str, norm: float = 1.0, steps: int | None = None, report_last: bool = True, **sync
    ) -> P.BarrierSync:
        """Node `name` trains every unit it can get (asking until NoMoreWork) and syncs; unless
        `report_last`, the units in hand once nothing is left are reported only by its sync."""
        i, rd = self.ids[name], self.rd
        while True:
            if not report_last and self.told_no_more(name):
                break
            for u in list(rd.plan.granted.get(i, [])):
                if (u.epoch, u.id, u.lo, u.hi) not in rd.nodes[i].reported:
                    self.msg(name, P.TrainProgress(round=rd.rnd, units=[u], steps=1, loss=1.0, samples_per_s=100.0))
            if self.told_no_more(name):
                break  # (its last grant said nothing is left: it does not ask)
            before = len(self.sent)
            self.msg(name, P.AskForMoreWork(round=rd.rnd))
            if not any(isinstance(m, P.AssignNext) for _, m in self.sent[before:]):
                break
        trained = list(rd.plan.granted.get(i, []))
        n = rules.samples(trained)
        msg = P.BarrierSync(
            round=rd.rnd,
            samples=n,
            steps=steps if steps is not None else n // BATCH,
            loss=1.0,
            trained=trained,
            delta_norm=norm * n // BATCH,
            **sync,
        )
        self.msg(name, msg)
        return msg

    def train_all(self, **norms: float) -> None:
        for n in self.ids:
            self.train(n, norm=norms.get(n, 1.0))

    def done(self, name: str, checksum: str = "theta1", epoch: int | None = None, **kw) -> None:
        e = self.s.ring_epoch if epoch is None else epoch
        self.msg(name, P.RoundDone(round=self.rd.rnd, ring_epoch=e, checksum=checksum, **kw))

    def failed(
        self, name: str, suspect: str = "", sit_out: bool = False, epoch: int | None = None, level: int = 0
    ) -> None:
        e = self.s.ring_epoch if epoch is None else epoch
        self.msg(
            name,
            P.RingFailed(
                round=self.rd.rnd,
                ring_epoch=e,
                reason="test",
                suspect=self.ids.get(suspect, ""),
                sit_out=sit_out,
                level=level,
            ),
        )

    # --- what happened -----------------------------------------------------------------------

    def to(self, name: str, kind: type) -> list:
        return [m for i, m in self.sent if i == self.ids[name] and isinstance(m, kind)]

    def told_no_more(self, name: str) -> bool:
        """The last unit granted to `name` this round came with "nothing is left after it" (and
        no MoreWork since)."""
        told = [m for m in self.to(name, (P.ShardAssignment, P.AssignNext, P.MoreWork)) if m.round == self.rd.rnd]
        return bool(told) and getattr(told[-1], "no_more", False)

    def rings(self) -> list[list[str]]:
        """Every BarrierReady's ring, by name (one per attempt)."""
        out: dict[int, list[str]] = {}
        for _, m in self.sent:
            if isinstance(m, P.BarrierReady):
                out[m.ring_epoch] = [self.names[x] for x in m.order]
        return [out[e] for e in sorted(out)]

    def struck(self) -> set[str]:
        return {self.names[i] for i, rs in self.s.strikes.items() if rs}

    def noted(self, kind: str) -> list[dict]:
        return [f for k, f in self.notes if k == kind]

    def ring(self) -> None:
        """Every node trains; the barrier sends the ring."""
        self.train_all()
        assert not self.tick()
        assert self.rd.ring is not None


# --- 1. "I already applied this round" is believed only with its own earlier RoundDone ---------


def test_an_early_sit_out_without_a_round_done_is_a_strike_and_the_round_stands() -> None:
    sim = Sim(["a", "b", "x"])
    sim.start()
    sim.ring()
    sim.failed("x", sit_out=True)  # the moment its ring part ends, before anyone applied
    assert not sim.tick()  # the reporter's word waits for the others' reports
    sim.done("a")
    sim.done("b")
    assert sim.tick()  # every member has reported: decided at once, not after the grace
    assert sim.rd.abandoned is None and sim.result.checksum == "theta1"
    assert sim.struck() == {"x"} and sim.noted("false_claim")[0]["name"] == "x"
    assert [m.abandoned for m in sim.to("x", P.Agreed)] == [False]  # x gets θ; a and b hold it
    assert not sim.to("a", P.Agreed) and not sim.to("b", P.Agreed)
    assert len(sim.rings()) == 1  # no retry


def test_a_sit_out_with_its_round_done_of_the_earlier_attempt_is_accepted_without_a_strike() -> None:
    sim = Sim(["a", "b", "c", "x"])
    sim.start()
    sim.ring()
    sim.failed("c", suspect="x")  # the first attempt breaks: nobody finished it in time
    sim.failed("b")
    sim.failed("x")
    assert not sim.tick(GRACE + 1)
    assert len(sim.rings()) == 2  # redone with everyone (one accuser names nobody)
    # a had applied the first attempt after all: its RoundDone of it comes late, then its answer.
    sim.done("a", epoch=0)
    sim.failed("a", sit_out=True)
    sim.failed("x", sit_out=True)  # x applied nothing it told us about
    assert sim.struck() == {"x"}
    assert [f["name"] for f in sim.noted("sat_out")] == ["a"]


def _applied_by_a_and_b() -> Sim:
    """a, b and x in the round's ring; a and b have applied it, x has said nothing yet."""
    sim = Sim(["a", "b", "x"])
    sim.start()
    sim.ring()
    sim.done("a")
    sim.done("b")
    return sim


def test_a_retry_whose_members_applied_the_attempt_settles_it_instead_of_ending_the_run() -> None:
    # Every member but one applied; the last one then leaves (or is dropped): the round stands.
    sim = _applied_by_a_and_b()
    sim.drop(sim.ids["x"], "connection closed")
    assert sim.tick()
    assert sim.rd.abandoned is None and sim.result.checksum == "theta1"
    assert len(sim.rings()) == 1 and not sim.struck()


def test_sit_outs_of_every_member_abandon_the_round_cleanly() -> None:
    # Every member applied an earlier attempt that the coordinator retried before their reports:
    # nobody is left to redo it. θ stays (no exception, no "every training node has left").
    sim = Sim(["a", "b", "c"])
    sim.start()
    sim.ring()
    sim.failed("a", suspect="b")
    sim.failed("b")
    assert not sim.tick(GRACE + 1)
    for n in "abc":
        sim.done(n, epoch=0)
        sim.failed(n, sit_out=True)
    assert sim.tick()
    assert sim.rd.abandoned is not None and not sim.struck()
    assert all(sim.ids[n] not in sim.s.state_round for n in "abc")  # none is a donor of θ0 any more


# --- 2. steps come from the samples granted, not BarrierSync.steps ----------------------------


def test_a_huge_norm_hidden_behind_a_step_count_lie_is_an_outlier() -> None:
    sim = Sim(["a", "b", "c", "x"])
    sim.start()
    for n in "abc":
        sim.train(n)
    sim.train("x", norm=1000.0, steps=10**9)  # its Δ per step looks tiny by its own count
    assert not sim.tick()
    ring = sim.rd.ring
    assert {sim.names[m.node_id]: m.weight for m in ring}["x"] == 0.0
    assert [f["name"] for f in sim.noted("outlier_delta")] == ["x"] and sim.struck() == {"x"}
    for n in "abcx":
        sim.done(n)
    assert sim.tick()
    _every_unit_once(sim)  # its units are redone, not lost


# --- 3. silence is charged to whom the others name, not to whoever is still waiting -----------


def test_a_withholder_that_finishes_first_gets_nobody_struck_and_is_caught_by_those_it_starved() -> None:
    sim = Sim(["a", "b", "c", "w"])
    sim.start()
    sim.ring()
    sim.done("w")  # it received everyone's bytes and sent none
    assert not sim.tick(100.0)  # long past factor x its time + slack: nobody is behind for it
    assert not sim.struck() and not sim.noted("deadline")
    for n in "abc":
        sim.failed(n, suspect="w")
    assert not sim.tick(100.0 + GRACE + 1)
    assert sim.struck() == {"w"} and sim.rings()[-1] == ["c", "b", "a"]  # redone without it


def test_a_silent_member_that_two_others_name_is_redone_without_at_once() -> None:
    # Attack 3 in the all-gather: w withholds its payload and never reports; a and b name it.
    sim = Sim(["a", "b", "w"])
    sim.start()
    sim.ring()
    sim.failed("a", suspect="w")
    assert not sim.tick() and len(sim.rings()) == 1  # one name: the others' reports may still come
    sim.failed("b", suspect="w")
    assert not sim.tick()  # caught: decided now, not after the grace
    assert [sorted(r) for r in sim.rings()] == [["a", "b", "w"], ["a", "b"]] and sim.struck() == {"w"}


def _grid_swarm() -> Sim:
    """GRID_FROM members with int8: the all-reduce runs as a grid (drift/ring.py); the ring is sent."""
    sim = Sim([f"n{k}" for k in range(GRID_FROM)], codec="int8")
    sim.start()
    sim.ring()
    return sim


def _flat(sim: Sim) -> dict[tuple[int, int], bool]:
    """(round, ring epoch) -> whether its BarrierReady said to reduce on the flat ring."""
    return {(m.round, m.ring_epoch): m.flat for _, m in sim.sent if isinstance(m, P.BarrierReady)}


def test_a_grid_that_fails_with_nobody_named_is_redone_on_the_flat_ring_for_a_while() -> None:
    # A member silent after its row's reduce-scatter stalls its column, and everyone waits to the
    # pass's deadline naming nobody: retried as a grid, it could stall every round unnamed.
    sim = _grid_swarm()
    for n in sim.ids:
        sim.failed(n)
    assert not sim.tick(GRACE + 1)
    assert _flat(sim) == {(0, 0): False, (0, 1): True} and not sim.struck()
    assert [f["ring_epoch"] for f in sim.noted("flat_ring")] == [0]
    for rnd in (1, 2):  # round 1 too (rules.flat_rounds(1) == 2: rounds 0 and 1); round 2 on the grid again
        for n in sim.ids:
            sim.done(n)
        assert sim.tick(GRACE + 2 + rnd)
        sim.start(rnd)
        sim.ring()
        assert _flat(sim)[(rnd, sim.s.ring_epoch)] == (rnd == 1)


def test_one_members_word_that_a_grid_failed_has_it_redone_once_and_keeps_the_grid() -> None:
    sim = _grid_swarm()
    sim.failed("n5")  # nobody else reports a failure, and the grid takes longer than the grace
    assert not sim.tick(GRACE + 1)
    assert _flat(sim) == {(0, 0): False, (0, 1): False} and not sim.noted("flat_ring")
    sim.failed("n5")  # again: its word no longer redoes anything this round
    assert not sim.tick(2 * (GRACE + 1)) and len(sim.rings()) == 2
    for n in [n for n in sim.ids if n != "n5"]:
        sim.done(n)
    assert sim.tick(2 * (GRACE + 1) + 1) and sim.result.checksum == "theta1" and not sim.struck()


@pytest.mark.parametrize("claim", ["failed", "refused"])
def test_one_member_that_says_a_slow_all_reduce_failed_at_every_attempt_has_at_most_one_redone(claim: str) -> None:
    # An all-reduce that takes minutes (a big θ on home links). One member's word that it failed
    # redoes one attempt a round (a failure in a ring's setup may reach nobody else), not the
    # next: it once had every attempt redone 5 s after its report, until the round was given up.
    # Its word that the sum is too large to apply redoes none (every honest member checks the same
    # sum: an honest refusal is never alone), and no longer bans every member that applied it.
    sim = Sim(["a", "b", "c", "x"])
    sim.host.n_params = 10**9
    sim.start()
    sim.ring()
    say = (lambda: sim.failed("x")) if claim == "failed" else (lambda: _poisoned(sim, "x"))
    say()
    assert not sim.tick(GRACE + 1)
    redone = len(sim.rings()) - 1
    assert redone == (1 if claim == "failed" else 0)
    say()
    assert not sim.tick(300.0) and len(sim.rings()) == 1 + redone and not sim.s.banned
    for n in "abc":
        sim.done(n)
    assert sim.tick(301.0)
    assert sim.result.checksum == "theta1" and not sim.s.banned and not sim.dropped
    assert [m.abandoned for m in sim.to("x", P.Agreed)] == [False]  # x takes the round's θ


def test_a_lone_report_late_in_a_slow_all_reduce_redoes_nothing() -> None:
    # Past the time a ring's setup may take, one member's report is only its word: the others'
    # reports decide (it could otherwise throw away minutes of all-reduce once a round).
    sim = Sim(["a", "b", "c", "x"])
    sim.host.n_params = 10**9
    sim.start()
    sim.ring()
    assert not sim.tick(rules.REDUCE_DEADLINE_S + 50)
    sim.failed("x")
    assert not sim.tick(rules.REDUCE_DEADLINE_S + 50 + GRACE + 1) and len(sim.rings()) == 1
    for n in "abc":
        sim.done(n)
    assert sim.tick(rules.REDUCE_DEADLINE_S + 60) and sim.result.checksum == "theta1"


def test_a_refusal_from_a_member_that_also_reported_theta_or_sat_out_keeps_the_round() -> None:
    # Every member reported θ, the refuser too; and one that sits the attempt out refuses it:
    # neither has the round bisected, abandoned, or anyone banned.
    sim = Sim(["a", "b", "c", "x"])
    sim.start()
    sim.ring()
    _poisoned(sim, "x")
    for n in "abcx":
        sim.done(n)
    assert sim.tick(1.0) and sim.rd.abandoned is None and sim.result.checksum == "theta1"
    assert not sim.s.banned and not sim.noted("sat_out")

    sim = Sim(["a", "b", "c", "d", "x"])
    sim.start()
    sim.ring()
    for n in _neighbours(sim, "x"):
        sim.failed(n, suspect="x")  # caught by both its neighbours: it sits the retry out
    for n in [n for n in sim.ids if n not in _neighbours(sim, "x") and n != "x"]:
        sim.failed(n)
    assert not sim.tick(GRACE + 1) and "x" not in sim.rings()[-1]
    _poisoned(sim, "x")
    for n in sim.rings()[-1]:
        sim.done(n)
    assert sim.tick(GRACE + 2) and sim.rd.abandoned is None and sim.result.checksum == "theta1"
    assert not sim.s.banned


def test_a_lone_refusal_does_not_keep_a_silent_member_from_being_behind() -> None:
    sim = Sim(["a", "b", "c", "d", "x"])
    sim.host.n_params = 10**8
    sim.start()
    sim.ring()
    _poisoned(sim, "x")
    for n in "abc":
        sim.done(n)  # d says nothing: behind, as without x's refusal
    assert not sim.tick(60.0)  # (d is found behind now; then everyone is accounted for)
    assert sim.tick(60.1) and sim.result.checksum == "theta1" and sim.struck() == {"d"}


def test_in_a_ring_of_two_a_refusal_against_an_announcement_convicts_nobody() -> None:
    # One word against the other: whoever refuses, nobody can tell which of the two is honest.
    sim = Sim(["a", "x"])
    sim.start()
    sim.ring()
    _poisoned(sim, "x")
    sim.done("a", checksum="theta-a", announced=True, before="theta0")
    assert not sim.tick(GRACE + 1)
    assert not sim.s.banned and len(sim.rings()) == 2


@pytest.mark.parametrize("first", ["a", "x"])
def test_a_pair_that_refuses_the_sum_convicts_nobody_and_both_stay_suspects(first: str) -> None:
    # Searched by halves, the poisoner left alone could send its own Δ, pass, and have its honest
    # partner named: in a pair a refusal is redone (then given up, θ unchanged), nobody convicted.
    sim = Sim(["a", "x"] if first == "a" else ["x", "a"])
    sim.start()
    sim.ring()
    for n in "ax":
        _poisoned(sim, n)
    assert not sim.tick(GRACE + 1) and len(sim.rings()) == 2 and sorted(sim.rings()[-1]) == ["a", "x"]
    assert not sim.s.banned and sim.s.poison_suspects == {sim.ids["a"], sim.ids["x"]}


def test_a_pair_given_up_tells_the_member_that_announced_that_theta_stays() -> None:
    sim = Sim(["a", "x"])
    sim.start()
    sim.ring()
    t = 0.0
    while not sim.tick(t):
        _poisoned(sim, "x")
        sim.done("a", checksum="theta-a", announced=True)
        t += GRACE + 1
    assert sim.rd.abandoned and not sim.s.banned
    assert [m.abandoned for m in sim.to("a", P.Agreed)] == [True] and not _of(sim, R.Moved)


def test_in_a_ring_of_two_a_report_that_the_partner_is_silent_is_decided_at_the_grace() -> None:
    sim = Sim(["a", "x"])
    sim.host.n_params = 10**8  # (a reduce deadline of ~40 minutes)
    sim.start()
    sim.ring()
    sim.failed("a", suspect="x")  # a's pass timed out on x
    assert not sim.tick(GRACE - 1) and len(sim.rings()) == 1
    assert not sim.tick(GRACE + 1) and len(sim.rings()) == 2


def test_a_member_cannot_excuse_itself_by_naming_one_it_exchanged_nothing_with() -> None:
    # The sparse rule's hierarchy: h fails at level 0 naming y, whom two of y's neighbours caught
    # there, but h is no neighbour of y: its failure is not excused, and those it held up at
    # level 1 catch it.
    sim = Sim([f"n{k}" for k in range(9)], sync="sparse", sync_params={"fanout": 3, "dense_rounds": 0})
    sim.start()
    sim.ring()
    order = sim.rings()[-1]
    y = order[0]
    h = next(n for n in order if n != y and n not in _neighbours(sim, y) and y not in _neighbours(sim, n, level=1))

    def report(name: str, suspect: str, level: int) -> None:
        e = sim.rd.ring_epoch()
        sim.msg(name, P.RingFailed(round=0, ring_epoch=e, reason="t", suspect=sim.ids[suspect], level=level))

    for n in _neighbours(sim, y)[:2]:
        report(n, y, 0)
    report(h, y, 0)
    for n in _neighbours(sim, h, level=1):
        report(n, h, 1)
    caught = {sim.names[i] for i in rules.caught(sim.rd.suspects(), sim.rd.part())}
    assert caught == {y, h}


def test_a_lone_report_of_a_failure_nobody_else_settles_is_redone_at_the_reduce_deadline() -> None:
    sim = Sim(["a", "b", "c", "x"])
    sim.start()
    sim.ring()
    sim.failed("x")  # and nobody else reports anything: redone once (its first lone report)
    assert not sim.tick(GRACE + 1) and len(sim.rings()) == 2
    sim.failed("x")  # again: the others' reports, or the retry's reduce deadline, decide
    assert not sim.tick(GRACE + 1 + rules.REDUCE_DEADLINE_S - 1) and len(sim.rings()) == 2
    assert not sim.tick(GRACE + 1 + rules.REDUCE_DEADLINE_S + 1) and len(sim.rings()) == 3


def _neighbours(sim: Sim, name: str, level: int = 0, gathered: bool | None = None) -> list[str]:
    """Who `name` sends to or takes from in the attempt in flight (by the ring it was sent);
    `gathered`: as if the round were all-gathered in levels (True) or went around the ring."""
    order = sim.rings()[-1]
    if collective(sim.recipe, sim.rd.rnd) == "allgather" if gathered is None else gathered:
        level_ = hierarchy.plan(len(order), sim.recipe.sync_params["fanout"])[level]
        return sorted(order[k] for k in level_.neighbours(order.index(name)))
    ids, flat = [sim.ids[n] for n in order], [m for _, m in sim.sent if isinstance(m, P.BarrierReady)][-1].flat
    return sorted(sim.names[i] for i in neighbours(ids, sim.ids[name], sim.recipe.codec, flat))


def test_a_grid_attempt_whose_breaker_two_members_name_is_redone_as_a_grid_without_it() -> None:
    sim = _grid_swarm()
    named_by = _neighbours(sim, "n0")[:2]
    for n in named_by:
        sim.failed(n, suspect="n0")
    for n in [n for n in sim.ids if n not in named_by and n != "n0"]:
        sim.failed(n)
    assert not sim.tick(GRACE + 1)
    assert _flat(sim) == {(0, 0): False, (0, 1): False} and not sim.noted("flat_ring")
    assert "n0" not in sim.rings()[-1] and sim.struck() == {"n0"}


@pytest.mark.parametrize("swarm", ["flat ring", "grid", "sparse hierarchy"])
def test_two_members_that_exchange_no_bytes_with_a_member_cannot_have_it_caught(swarm: str) -> None:
    """Only a member's neighbours in the attempt (those it sends to or takes from, at the
    accusation's level of a hierarchy) witness its bytes or its silence: two colluders anywhere
    else who name it are not evidence, so it stays in the retry, unstruck. Its neighbours' word is."""
    names = [f"n{k}" for k in range(GRID_FROM if swarm == "grid" else 9)]
    recipe = {
        "flat ring": {"codec": "int8"},
        "grid": {"codec": "int8"},
        "sparse hierarchy": {"sync": "sparse", "sync_params": {"fanout": 3, "dense_rounds": 0}},
    }[swarm]
    sim = Sim(names, **recipe)
    sim.start()
    sim.ring()
    victim = sim.rings()[-1][0]
    far = [n for n in names if n != victim and n not in _neighbours(sim, victim)]
    for n in far[:2]:
        sim.failed(n, suspect=victim)
    for n in [n for n in names if n not in far[:2]]:
        sim.failed(n)
    sim.tick(GRACE + 1)
    assert victim in sim.rings()[-1] and len(sim.rings()) == 2 and victim not in sim.struck()
    # the same words from two of its neighbours catch it
    for n in _neighbours(sim, victim)[:2]:
        sim.failed(n, suspect=victim)
    for n in [n for n in names if n not in _neighbours(sim, victim)[:2]]:
        sim.failed(n)
    sim.tick(2 * (GRACE + 1))
    assert victim not in sim.rings()[-1] and victim in sim.struck()


def test_in_the_sparse_rules_dense_rounds_its_ring_neighbours_witness_a_member_not_its_blocks() -> None:
    """The sparse rule's first rounds go around the ring (`dense_rounds`): there a member's
    witnesses are its ring neighbours. Two members its hierarchy would make witnesses at level 1,
    were the round all-gathered, exchange no bytes with it around the ring: their word is not
    evidence, and it stays in the retry, unstruck."""
    names = [f"n{k}" for k in range(9)]
    sim = Sim(names, sync="sparse", sync_params={"fanout": 3})  # 3 blocks of 3, were it gathered
    sim.start()
    sim.ring()
    assert collective(sim.recipe, sim.rd.rnd) == "ring"
    victim = sim.rings()[-1][0]
    ring = _neighbours(sim, victim)
    far = [n for n in _neighbours(sim, victim, level=1, gathered=True) if n not in ring]
    assert len(far) == 2, far
    for n in far:
        sim.failed(n, suspect=victim, level=1)
    for n in [n for n in names if n not in far]:
        sim.failed(n)
    sim.tick(GRACE + 1)
    assert victim in sim.rings()[-1] and len(sim.rings()) == 2 and victim not in sim.struck()


def test_a_member_silent_long_after_a_majority_reported_is_behind() -> None:
    sim = Sim(["a", "b", "c"])
    sim.start()
    sim.ring()
    sim.done("a")
    sim.done("b")
    # Its slack is the unit deadline's (two heartbeats), not the silence that drops a node.
    assert not sim.tick(2 * sim.recipe.heartbeat_s - 0.1)
    assert sim.tick(2 * sim.recipe.heartbeat_s + 0.1)
    assert sim.struck() == {"c"} and [m.abandoned for m in sim.to("c", P.Agreed)] == [False]


def test_a_ring_of_one_that_stays_silent_is_redone_and_struck_at_the_reduce_deadline() -> None:
    sim = Sim(["x"])
    sim.start()
    sim.ring()
    assert not sim.tick(rules.REDUCE_DEADLINE_S - 1)
    assert not sim.tick(rules.REDUCE_DEADLINE_S + 1)
    assert sim.struck() == {"x"} and len(sim.rings()) == 2


def test_a_ring_of_two_whose_partner_never_announces_is_redone_and_the_silent_one_struck() -> None:
    # x sends its bytes, then neither announces its θ nor says the ring failed, keeping its
    # connection: the member that announced waits for a Commit that only x's report can bring.
    sim = Sim(["a", "x"])
    sim.start()
    sim.ring()
    assert sim.rd.confirm
    sim.done("a", checksum="theta-a", announced=True, before="theta0")
    assert not sim.tick(rules.REDUCE_DEADLINE_S - 1) and len(sim.rings()) == 1
    assert not sim.tick(rules.REDUCE_DEADLINE_S + 1)
    # Redone without x (nobody had applied the announced step), and x struck.
    assert sim.struck() == {"x"} and sim.rings() == [["a", "x"], ["a"]] and not sim.to("a", P.Commit)
    sim.done("a", checksum="theta-a2")
    assert sim.tick(rules.REDUCE_DEADLINE_S + 2)
    assert sim.rd.abandoned is None and sim.result.checksum == "theta-a2"
    assert [m.abandoned for m in sim.to("x", P.Agreed)] == [False]  # x gets the round's θ from a


@pytest.mark.parametrize("then", ["dies", "fails", "refuses"])
def test_a_committed_ring_of_two_keeps_the_theta_one_applied_whatever_the_other_does_next(then: str) -> None:
    # --local 2: both announced the same θ and got the Commit; a applied it and reported. Then x's
    # process is killed, or x says the step failed, or that it refused the sum. Both named that θ,
    # so it is the round's, settled at the next tick; x, if still there, is behind and gets θ from
    # a. (Before: a dead partner had the round given up, and the run ended; one that failed or
    # refused had a sit the retry out, one applier of two being no majority, and redid the round
    # alone: its own Δ, a's dropped, became the round's θ.)
    sim = Sim(["a", "x"])
    sim.start()
    sim.ring()
    for n in "ax":
        sim.done(n, checksum="theta-1", announced=True, before="theta0")
    assert not sim.tick() and sim.to("a", P.Commit) and sim.to("x", P.Commit)
    sim.done("a", checksum="theta-1")
    if then == "dies":
        sim.drop(sim.ids["x"], "its process exited")
    else:
        sim.msg("x", P.RingFailed(round=0, ring_epoch=sim.s.ring_epoch, reason="test", poisoned=then == "refuses"))
    assert sim.tick() and sim.rings() == [["a", "x"]]
    assert sim.rd.abandoned is None and sim.result.checksum == "theta-1" and not sim.struck()
    if then != "dies":
        assert not sim.dropped and [m.abandoned for m in sim.to("x", P.Agreed)] == [False]


def test_of_two_the_one_known_not_to_hold_the_agreed_theta_yet_sits_out_and_is_not_dropped() -> None:
    # Overlapped: x sat round 0 out (it applied an attempt that was redone without it) and is
    # fetching round 0's θ while round 1's ring of two already runs. Its step starts from another
    # state; the swarm's own record says why, so it sits the round out instead of being dropped.
    sim = Sim(["a", "x"])
    sim.s.agreed(0, "theta-r0", [sim.ids["a"]])
    sim.start(1)
    sim.ring()
    for attempt in range(2):  # different θ: redone once, then the states they step from decide
        sim.done("a", checksum="theta-a", announced=True, before="theta-r0")
        sim.done("x", checksum="theta-x", announced=True, before="theta-attempt0")
        assert not sim.tick(attempt)
    assert [sorted(r) for r in sim.rings()] == [["a", "x"], ["a", "x"], ["a"]] and sim.struck() == {"x"}
    assert [(f["name"], f["reason"]) for f in sim.noted("sat_out")] == [("x", "behind")]
    sim.done("a", checksum="theta-a2")
    assert sim.tick(3)
    assert sim.result.checksum == "theta-a2" and not sim.dropped
    assert [m.abandoned for m in sim.to("x", P.Agreed)] == [False]  # x gets round 1's θ


def test_a_big_models_all_reduce_is_redone_only_past_what_its_bytes_take_at_the_nodes_slowest_rate() -> None:
    # 100M values: the nodes' own pass deadlines allow ~2,400 s at 1 MiB/s; 150 s redid every round
    sim = Sim(["a", "b", "c"])
    sim.host.n_params = 100_000_000
    sim.start()
    sim.ring()
    deadline = rules.reduce_deadline(sim.host.n_params, MIN_RATE)
    assert deadline > 2000
    assert not sim.tick(rules.REDUCE_DEADLINE_S + 1) and len(sim.rings()) == 1  # still reducing
    assert not sim.tick(deadline + 1) and len(sim.rings()) == 2  # past what its bytes allow: redone


def test_a_ring_nobody_finishes_is_redone_at_the_deadline_and_nobody_struck() -> None:
    sim = Sim(["a", "b", "c"])
    sim.start()
    sim.ring()
    assert not sim.tick(rules.REDUCE_DEADLINE_S + 1)
    assert not sim.struck() and len(sim.rings()) == 2


def test_a_ring_allows_two_heartbeats_and_overlapped_one_inner_step_of_its_slowest_member() -> None:
    # Overlapped, a member finishes the step in hand before its part of the all-gather starts:
    # the deadlines that name a late payload allow the slowest member's step (measured speed).
    speeds = {"a": 100.0, "b": 50.0, "c": 4.0}
    for overlap, want in ((True, BATCH / 4.0), (False, 0.0)):
        sim = Sim(["a", "b", "c"], speeds=speeds, overlap=overlap)
        sim.start()
        sim.ring()
        assert {m.slack_s for _, m in sim.sent if isinstance(m, P.BarrierReady)} == {2 * sim.recipe.heartbeat_s + want}


def test_an_overlapped_round_lets_go_of_the_round_before_once_it_settled() -> None:
    # Overlapped, round r + 1 starts while round r is in its all-reduce and reads it until it
    # settles. Held after that, each round would hold the one before it: a coordinator keeping
    # every round of the run, every node's messages in each (megabytes a round at 1,000 nodes).
    sim = Sim(["a", "b", "c"], rounds=3, overlap=True)
    r0 = sim.start(0)
    sim.ring()
    taken = sim.queue.take_round(R.budget(sim.s, sim.queue.pending_samples()))
    r1 = Round(sim.s, sim.host, 1, taken, sim.now, prev=r0)
    sim.apply(r1.start(0))
    for n in sim.ids:
        sim.done(n)
    assert sim.tick()
    held = weakref.ref(r0)
    sim.rd = r1
    sim.apply(r1.step(R.PrevSettled(), sim.now))
    del r0
    gc.collect()
    assert held() is None


# --- rounds that close at a quorum: a late member's work merges into its next round ------------


def _late_round(quorum: float = 0.75) -> tuple[Sim, Round, P.WorkUnit]:
    """Round 0 of a, b, c and a slow x: x trains its first unit, the others sync."""
    sim = Sim(["a", "b", "c", "x"], speeds={"x": 10.0}, quorum=quorum)
    rd = sim.start()
    u = rd.plan.granted[sim.ids["x"]][0]
    sim.msg("x", P.TrainProgress(round=0, units=[u], steps=1, loss=1.0, samples_per_s=10.0))
    for n in "abc":
        sim.train(n)
    return sim, rd, u


def _cut(sim: Sim) -> None:
    """The quorum is in; past the grace, x is late."""
    sim.tick(sim.now - sim.t0)
    sim.tick(sim.now - sim.t0 + 1.0)


def _late_settled() -> tuple[Sim, P.WorkUnit]:
    """Round 0 settled without x, whose late report accounted for the unit it trained."""
    sim, _, u = _late_round()
    _cut(sim)
    _sync(sim, "x", 0, [u])
    _settle(sim, "abc")
    return sim, u


def _sync(sim: Sim, name: str, rnd: int, trained: list[P.WorkUnit], **kw) -> None:
    n = rules.samples(trained)
    sim.msg(
        name, P.BarrierSync(round=rnd, samples=n, steps=n // BATCH, loss=1.0, trained=trained, delta_norm=1.0, **kw)
    )


def _settle(sim: Sim, names: str) -> None:
    for n in names:
        sim.done(n)
    assert sim.tick(sim.now - sim.t0)


def test_the_barrier_goes_on_a_grace_after_the_quorum_and_the_late_node_s_work_merges_into_its_next_round() -> None:
    sim, rd, u = _late_round()
    x = sim.ids["x"]
    t = sim.now - sim.t0
    grace = rules.quorum_grace(BATCH / 100.0)
    assert sim.recipe.unit_deadline_factor * BATCH / 10.0 + 2 * sim.recipe.heartbeat_s > grace + 0.1
    sim.tick(t)  # the quorum is in (300 of 310 samples/s)
    sim.tick(t + grace - 0.01)
    assert rd.ring is None and not sim.noted("late")  # merely behind: waited for
    sim.tick(t + grace + 0.01)
    assert [f["name"] for f in sim.noted("late")] == ["x"] and not sim.noted("deadline")
    assert sim.rings() == [["a", "b", "c"]] and not sim.struck()
    _sync(sim, "x", 0, [u])  # its late report: it trained the unit it held
    _settle(sim, "abc")
    assert u not in sim.result.trained and u not in sim.result.given_back  # neither counted nor redone ...
    assert [m.keep for m in sim.to("x", P.Agreed)] == [pytest.approx(rules.staleness_scale(1))]  # ... it keeps it
    assert not [m for n in "abc" for m in sim.to(n, P.Agreed)]
    sim.start(1)  # round 1: x's report counts round 0's unit beside its own
    for n in "abcx":
        sim.train(n)
    sim.tick(sim.now - sim.t0)
    ring = {m.node_id: m.weight for m in sim.rd.ring}
    counted = {i: rules.samples(n.synced.trained) for i, n in sim.rd.nodes.items()}
    assert ring[x] == pytest.approx(counted[x] / sum(counted.values()))  # its weight counts round 0's unit
    assert u in sim.rd.nodes[x].synced.trained
    _settle(sim, "abcx")
    assert sim.result.trained.count(u) == 1 and u in sim.rd.nodes[x].synced.trained


def test_a_late_report_that_does_not_account_for_its_units_has_them_redone_and_keeps_nothing() -> None:
    sim, _, u = _late_round()
    _cut(sim)
    assert [f["name"] for f in sim.noted("late")] == ["x"]
    stranger = u.model_copy(update={"id": u.id + 5000})
    _sync(sim, "x", 0, [stranger])  # samples it was never granted
    _settle(sim, "abc")
    assert [f["node_id"] for f in sim.noted("bad_report")] == [sim.ids["x"]]
    assert u in sim.result.given_back and not sim.result.late
    assert [m.keep for m in sim.to("x", P.Agreed)] == [0.0]


def test_a_late_node_that_leaves_before_its_next_barrier_has_its_late_work_redone() -> None:
    sim, u = _late_settled()
    sim.start(1)
    sim.drop(sim.ids["x"], "connection closed")
    for n in "abc":
        sim.train(n)
    sim.tick(sim.now - sim.t0)
    _settle(sim, "abc")
    assert u in sim.result.given_back and u not in sim.result.trained


def test_a_late_node_that_syncs_its_next_round_without_its_late_report_has_both_redone() -> None:
    # Honest code sends the late report first (one connection, in order): a Δ holding work nobody
    # accounted for does not reach θ.
    sim, _, u = _late_round()
    _cut(sim)
    _settle(sim, "abc")  # (x's report never comes)
    assert [m.keep for m in sim.to("x", P.Agreed)] == [pytest.approx(rules.staleness_scale(1))]
    sim.start(1)
    for n in "abcx":
        sim.train(n)
    mine = list(sim.rd.nodes[sim.ids["x"]].synced.trained)
    assert sim.rd.nodes[sim.ids["x"]].excluded and [f["node_id"] for f in sim.noted("bad_report")] == [sim.ids["x"]]
    sim.tick(sim.now - sim.t0)
    assert {m.node_id: m.weight for m in sim.rd.ring}[sim.ids["x"]] == 0.0  # (in the ring, weight 0)
    _settle(sim, "abcx")
    assert u in sim.result.given_back and all(v in sim.result.given_back for v in mine)


def test_a_late_node_dropped_as_its_round_settles_has_its_late_work_redone() -> None:
    sim, u = _late_settled()
    sim.drop(sim.ids["x"], "struck out")  # (the shell drops it after finish(): the settled round forgets it)
    sim.start(1)
    for n in "abc":
        sim.train(n)
    sim.tick(sim.now - sim.t0)
    _settle(sim, "abc")
    assert u in sim.result.given_back


def test_a_late_node_trains_its_next_round_even_if_it_is_now_slow_enough_to_evaluate() -> None:
    # An evaluator's round is not merged: its Δ, which holds its late work, would never reach θ.
    sim, _ = _late_settled()
    x = sim.ids["x"]
    sim.s.speed[x] = 0.5  # measured: 200x slower than the others
    assert x in sim.s.evaluators(sim.recipe.round_samples)
    rd = sim.start(1)
    assert rd.nodes[x].role == "train" and x in rd.carry


def test_below_the_quorum_nobody_is_cut_early() -> None:
    sim = Sim(["a", "x", "y"], speeds={"x": 10.0, "y": 10.0}, quorum=0.9)
    rd = sim.start()
    sim.train("a")  # 100 of 120 samples/s synced
    sim.tick(sim.now - sim.t0 + 5.0)  # (their deadlines: 5.6 s)
    assert not sim.noted("late") and rd.ring is None


# --- 4. a late sit_out cannot void a round its members applied --------------------------------


def test_a_late_sit_out_after_the_others_applied_does_not_void_the_round() -> None:
    sim = _applied_by_a_and_b()
    sim.failed("x", sit_out=True)  # a second after its RoundDone would have gone
    assert sim.tick(GRACE + 1)
    assert sim.rd.abandoned is None and sim.result.checksum == "theta1"
    assert sim.s.checksums[0] == "theta1" and sim.struck() == {"x"}
    assert not sim.noted("round_abandoned")


def test_a_sit_out_that_comes_after_the_round_settled_without_it_changes_nothing() -> None:
    # tests/wrappers/fault_node.py's sit-out-late, its claim later than the others' window.
    sim = _applied_by_a_and_b()
    assert sim.tick(GRACE + 60)  # x silent past its window: the round settles on a and b
    assert sim.result.checksum == "theta1" and sim.struck() == {"x"}
    sim.failed("x", sit_out=True)
    sim.tick(1)
    assert sim.rd.abandoned is None and sim.s.checksums[0] == "theta1"
    assert not sim.noted("round_abandoned") and sim.struck() == {"x"}


# --- 6. a unit counts once; asking again hoards nothing; speed is capped -----------------------


def test_repeated_progress_counts_once_and_is_named_and_struck_once_a_round() -> None:
    sim = Sim(["a", "x"])
    rd = sim.start()
    u = rd.plan.granted[sim.ids["x"]][0]
    half = u.model_copy(update={"hi": u.lo + (u.hi - u.lo) // 2})
    sim.msg("x", P.TrainProgress(round=0, units=[half], steps=1, loss=1.0, samples_per_s=1e9))
    sim.msg(
        "x",
        P.TrainProgress(round=0, units=[u.model_copy(update={"lo": half.hi})], steps=1, loss=1.0, samples_per_s=1.0),
    )
    assert not sim.struck()  # the two halves of a unit are no repeat
    for _ in range(50):
        sim.msg("x", P.TrainProgress(round=0, units=[u], steps=1, loss=1.0, samples_per_s=1e9))
    assert rd.nodes[sim.ids["x"]].trained == u.hi - u.lo
    assert [(f["name"], f["claim"]) for f in sim.noted("false_claim")] == [("x", "progress")]
    assert sim.struck() == {"x"} and sim.s.strikes[sim.ids["x"]] == [0]


def test_units_only_the_barrier_report_lists_count_then_once_and_as_measured_speed() -> None:
    # A node does not report on their own the units it ended its round with (one frame a node
    # less): its BarrierSync lists them.
    sim = Sim(["a", "x"])
    rd = sim.start()
    x = sim.ids["x"]
    sim.now += 1.0
    granted = sim.train("x", report_last=False).trained
    assert len(granted) >= 2 and rd.nodes[x].trained == rules.samples(granted)  # counted, reported or not
    counted = sorted((a.unit.id, a.unit.lo) for a in sim.actions if isinstance(a, R.Progress) and a.node == x)
    assert counted == sorted((u.id, u.lo) for u in granted)  # each once
    assert [a.samples_per_s for a in sim.actions if isinstance(a, R.Measured) and a.node == x]  # by our clock
    assert not sim.struck() and not sim.noted("bad_report") and not sim.noted("false_claim")


def test_a_unit_listed_twice_in_a_barrier_report_counts_once_and_is_a_bad_report_not_a_repeat() -> None:
    sim = Sim(["a", "x"])
    rd = sim.start()
    x = sim.ids["x"]
    u = rd.plan.granted[x][0]
    n = 2 * (u.hi - u.lo)
    sim.msg("x", P.BarrierSync(round=0, samples=n, steps=2, loss=1.0, trained=[u, u], delta_norm=1.0))
    assert rd.nodes[x].trained == u.hi - u.lo
    assert [f["node_id"] for f in sim.noted("bad_report")] == [x] and not sim.noted("false_claim")


def test_a_node_our_clock_measured_fast_gets_grant_s_of_units_at_an_ask_and_its_word_gets_it_one() -> None:
    # Units of a few milliseconds: a frame each way a unit costs the coordinator (and the node)
    # more than they save. How many at once is what our clock measured, never what it claims.
    sim = Sim(["a", "x", "liar"], inner_steps=40, speeds={"liar": 1e9})
    rd = sim.start()
    x, u = sim.ids["x"], sim.recipe.unit_samples
    sim.s.measured_speed(x, 10 * u / rules.GRANT_S)  # ten units in GRANT_S (averaged in with its claim)
    want = rules.grant_units(u, sim.s.speed[x], rd.plan.remaining(), 3)
    held = rd.in_hand(x)
    sim.msg("x", P.AskForMoreWork(round=0))
    [grant] = sim.to("x", P.AssignNext)
    assert want >= 3 and len(grant.units) == want and grant.units == rd.plan.granted[x][-want:]
    assert rd.in_hand(x) == held + want * u <= rules.ask_allowance(u, sim.s.speed[x]) + u
    sim.msg("liar", P.AskForMoreWork(round=0))
    [grant] = sim.to("liar", P.AssignNext)
    assert len(grant.units) == 1  # (its claim of 1e9 samples/s: measured, it is not)


def test_units_reported_in_one_frame_count_once_each_and_their_speed_is_measured_over_all_of_them() -> None:
    sim = Sim(["a", "x"], inner_steps=40)
    rd = sim.start()
    x = sim.ids["x"]
    for _ in range(3):
        sim.msg("x", P.AskForMoreWork(round=0))
    units = list(rd.plan.granted[x])
    assert len(units) >= 3
    sim.now += 0.1
    sim.msg("x", P.TrainProgress(round=0, units=units, steps=len(units), loss=1.0, samples_per_s=1.0))
    assert rd.nodes[x].trained == rules.samples(units)
    counted = [(a.unit.id, a.samples) for a in sim.actions if isinstance(a, R.Progress) and a.node == x]
    assert counted == [(v.id, v.hi - v.lo) for v in units]
    # (its first report, 0.1 s after the round started: all of them over that time, not the first)
    assert [a.samples_per_s for a in sim.actions if isinstance(a, R.Measured) and a.node == x] == [
        pytest.approx(rules.samples(units) / 0.1)
    ]
    sim.msg("x", P.TrainProgress(round=0, units=units[-1:], steps=1, loss=1.0, samples_per_s=1.0))
    assert rd.nodes[x].trained == rules.samples(units) and [f["node_id"] for f in sim.noted("false_claim")] == [x]


def test_asking_again_and_again_grants_at_most_two_units_ahead() -> None:
    sim = Sim(["a", "b", "x"])
    rd = sim.start()
    for _ in range(20):
        sim.msg("x", P.AskForMoreWork(round=0))
    # the first unit, and two ahead (one in training, one asked ahead): 20 asks hoard no more
    assert len(rd.plan.granted[sim.ids["x"]]) == 3
    assert len(sim.to("x", P.AssignNext)) == 2
    assert sim.to("x", P.NoMoreWork) == []  # held, not refused: the plan still has work for it


def test_an_ask_ahead_of_its_progress_is_answered_when_the_progress_comes_and_the_round_gets_its_budget() -> None:
    # A fast node asks ahead of its TrainProgress reports (they cross on the way): the coordinator
    # holds the ask and grants on the progress, instead of "no more work", which ended a lone
    # node's round after a few units and left the last round's budget untrained.
    sim = Sim(["x"], inner_steps=40)
    rd = sim.start()
    granted = rd.plan.granted[sim.ids["x"]]
    reported = 0
    while not sim.to("x", P.NoMoreWork):
        for _ in range(3):  # its round trip is longer than a unit: it asks again as each answer
            sim.msg("x", P.AskForMoreWork(round=0))  # comes, its progress reports still on the way
        while reported < len(granted):  # (a report may answer the held ask: one more to train)
            sim.msg("x", P.TrainProgress(round=0, units=[granted[reported]], steps=1, loss=1.0, samples_per_s=1.0))
            reported += 1
    assert rules.samples(rd.plan.granted[sim.ids["x"]]) == rd.budget  # the whole round's budget
    assert rd.plan.remaining() == 0


def test_a_held_ask_is_answered_no_more_when_the_round_stops() -> None:
    # The node waits for the answer to its ask before it syncs: a held one that nobody answered
    # kept an honest node from the barrier until its deadline.
    sim = Sim(["a", "x"])
    rd = sim.start()
    for _ in range(3):
        sim.msg("x", P.AskForMoreWork(round=0))
    assert rd.nodes[sim.ids["x"]].ask_held and sim.to("x", P.NoMoreWork) == []
    sim.train("a")  # takes the rest of the budget: the round stops
    assert sim.to("x", P.StopRound) and len(sim.to("x", P.NoMoreWork)) == 1


def test_a_grant_that_leaves_nothing_to_grant_says_so_and_nobody_asks_in_vain() -> None:
    # A thousand nodes with a unit each: every ask was answered "no more", two frames a node.
    sim = Sim(["a", "b", "c"], inner_steps=1)  # a unit a node: the first grants take everything
    rd = sim.start()
    assert rd.plan.remaining() == 0
    assert all(sim.to(n, P.ShardAssignment)[0].no_more for n in "abc")
    (u,) = rd.plan.granted[sim.ids["b"]]
    sim.msg("b", P.TrainProgress(round=0, units=[u], steps=1, loss=1.0, samples_per_s=100.0))
    sim.train("a")  # reports its unit, does not ask, syncs: the others stop at their next step ...
    assert len(sim.to("c", P.StopRound)) == 1
    assert sim.to("b", P.StopRound) == []  # ... but b trained all it holds: nothing to stop
    sim.train("b")
    sim.train("c")
    sim.tick()
    assert not any(n.excluded for n in rd.nodes.values()) and sim.rings() == [["a", "b", "c"]]


def test_only_the_grant_that_takes_the_last_unit_says_nothing_is_left() -> None:
    sim = Sim(["a", "b"], inner_steps=4)
    rd = sim.start()
    assert not any(sim.to(n, P.ShardAssignment)[0].no_more for n in "ab")
    sim.train("a")  # asks until nothing is left: it stole b's planned units
    nexts = sim.to("a", P.AssignNext)
    assert [m.no_more for m in nexts] == [False] * (len(nexts) - 1) + [True]
    assert rd.plan.remaining() == 0


def test_without_stealing_a_node_is_told_no_more_once_its_own_plan_is_granted() -> None:
    sim = Sim(["a", "b"], inner_steps=4, schedule="lockstep")
    rd = sim.start()
    a = sim.ids["a"]
    assert not sim.to("a", P.ShardAssignment)[0].no_more  # its plan holds more units
    sim.train("a")
    assert sim.to("a", P.AssignNext)[-1].no_more and rd.plan.remaining() > 0  # b's plan is b's
    assert not rd.plan.planned[a]


@pytest.mark.parametrize("how", ["left", "deadline"])
def test_units_that_come_back_after_nothing_was_left_are_trained_in_the_same_round(how) -> None:
    # The last round has no next one: a unit given back at its end is never trained.
    sim = Sim(["a", "b", "c", "d"], rounds=1, inner_steps=1)  # a unit each, all told no_more
    rd = sim.start()
    d = sim.ids["d"]
    (lost,) = rd.plan.granted[d]
    if how == "left":
        sim.drop(d, "gone")
        sim.tick()
    else:  # the others report their units and are still working out their Δ; d is past its deadline
        sim.now = sim.t0 + 5.0
        for n in "abc":
            (u,) = rd.plan.granted[sim.ids[n]]
            sim.msg(n, P.TrainProgress(round=0, units=[u], steps=1, loss=1.0, samples_per_s=100.0))
        sim.tick(after=5.0)
        assert rd.nodes[d].excluded
    assert rd.plan.remaining() == lost.hi - lost.lo  # back in the plan ...
    assert all(len(sim.to(n, P.MoreWork)) == 1 for n in "abc")  # ... and those still training ask again
    for n in "abc":
        sim.train(n)
    sim.tick(after=5.0)
    trained = [u for n in "abc" for u in rd.nodes[sim.ids[n]].synced.trained]
    assert lost in trained and rules.samples(trained) == 4 * (lost.hi - lost.lo)
    assert sim.to("a", P.AssignNext)[-1].no_more  # (a took it, and was told nothing is left again)


def test_units_back_in_a_round_where_nobody_was_told_nothing_is_left_need_no_more_work() -> None:
    sim = Sim(["a", "b", "c"], inner_steps=4)  # more units than nodes: the plans hold more
    rd = sim.start()
    a = sim.ids["a"]
    sim.msg("a", P.BarrierSync(round=0, samples=0, steps=0, loss=None, trained=[]))  # its units unaccounted
    assert rd.nodes[a].excluded
    sim.msg("a", P.AskForMoreWork(round=0))  # "no more" for it alone: others' plans hold units
    assert sim.to("a", P.NoMoreWork) and rd.plan.remaining() > 0
    sim.drop(sim.ids["c"], "gone")
    sim.tick()
    assert sim.to("b", P.MoreWork) == []  # b was never told nothing is left: it asks anyway


def test_one_slow_measurement_beside_unmeasured_claims_neither_evaluates_nor_loses_its_share() -> None:
    # Seen at 64 lightweight nodes: units of microseconds, a few measured over the coordinator's
    # lag, the rest planned with their calibration claims: 59 evaluated, 5 trained everything.
    sim = Sim(["a", "b", "c", "d"], speeds={"a": 1e5, "b": 1e5, "c": 1e5, "d": 1e5}, inner_steps=4)
    sim.s.measured_speed(sim.ids["d"], 150.0)  # our clock saw d's unit take its time
    rd = sim.start()
    assert rd.role(sim.ids["d"]) == "train"
    assert {len(rd.plan.planned[i]) + len(rd.plan.granted[i]) for i in rd.part()} == {4}  # equal shares
    sim.tick()  # ... which the early stop of the round's tail does not undo by the claims either
    assert not rd.nodes[sim.ids["d"]].early and len(rd.plan.planned[sim.ids["d"]]) == 3


def test_the_budget_handed_out_stops_the_others_once_the_asker_has_trained_what_it_holds() -> None:
    # Seen under load: a node asking ahead took the last unit, its next ask was answered "no more"
    # and stopped everyone at once, so the units held ahead went back untrained (a round of 96
    # samples trained 16, and a node sat it out).
    sim = Sim(["a", "b"], inner_steps=8)
    rd = sim.start()
    a, reported = sim.ids["a"], 0
    while not sim.to("a", P.NoMoreWork):
        sim.msg("a", P.AskForMoreWork(round=0))
        granted = rd.plan.granted[a]
        while reported < len(granted) - 1:  # it always holds the unit it asked ahead for
            sim.msg("a", P.TrainProgress(round=0, units=[granted[reported]], steps=1, loss=1.0, samples_per_s=1.0))
            reported += 1
    assert rd.plan.remaining() == 0 and rd.in_hand(a) > 0
    assert sim.to("b", P.StopRound) == [] and sim.to("a", P.StopRound) == []  # b trains on meanwhile
    last = rd.plan.granted[a][-1]
    sim.msg("a", P.TrainProgress(round=0, units=[last], steps=1, loss=1.0, samples_per_s=1.0))
    assert sim.to("b", P.StopRound) == []
    trained, n = rd.plan.granted[a], rd.nodes[a].trained
    sim.msg("a", P.BarrierSync(round=0, samples=n, steps=n // BATCH, loss=1.0, trained=trained, delta_norm=1.0))
    assert len(sim.to("b", P.StopRound)) == 1 and sim.to("a", P.StopRound) == []  # a is at the barrier


def test_the_val_reporter_stopped_while_it_evaluates_theta0_keeps_the_time_of_that_evaluation() -> None:
    # Seen under load: the others took round 0's budget while the node asked for the val loss still
    # evaluated θ0; after StopRound its deadline was one inner step, it sat round 0 out and the
    # run had no initial val loss.
    sim = Sim(["a", "x"], speeds={"a": 100.0, "x": 200.0})
    rd = sim.start()
    x = sim.ids["x"]
    assert rd.val_reporter == x
    sim.train("a")
    assert sim.to("x", P.StopRound)
    r, step_s = sim.recipe, BATCH / 200.0
    eval_s = r.eval_batches * BATCH / 200.0
    past_one_step = r.unit_deadline_factor * step_s + 2 * r.heartbeat_s + 0.1
    assert past_one_step < r.unit_deadline_factor * (step_s + eval_s) + 2 * r.heartbeat_s
    sim.tick(past_one_step)
    assert sim.noted("deadline") == [] and not rd.nodes[x].excluded
    sim.tick(r.unit_deadline_factor * (step_s + eval_s) + 2 * r.heartbeat_s + 0.1)
    assert [f["name"] for f in sim.noted("deadline")] == ["x"]  # but not forever


def test_an_ask_riding_on_a_progress_report_is_answered_as_one() -> None:
    sim = Sim(["a", "x"])
    rd = sim.start()
    u = rd.plan.granted[sim.ids["x"]][0]
    sim.msg("x", P.TrainProgress(round=0, units=[u], steps=1, loss=1.0, samples_per_s=1.0, ask=True))
    assert rd.nodes[sim.ids["x"]].trained == u.hi - u.lo
    [grant] = sim.to("x", P.AssignNext)
    assert grant.units == [rd.plan.granted[sim.ids["x"]][-1]] and u not in grant.units
    sim.msg("x", P.TrainProgress(round=0, units=[u], steps=1, loss=1.0, samples_per_s=1.0, ask=True))
    assert len(sim.to("x", P.AssignNext)) == 1  # a repeated report's ask is not answered either


def test_a_measured_speed_is_capped_relative_to_the_others_and_cannot_make_them_all_evaluate() -> None:
    sim = Sim(["a", "b", "c", "x"])
    sim.s.measured_speed(sim.ids["x"], 1e12)  # (all equal: capped by the others' 100)
    assert sim.s.speed[sim.ids["x"]] <= 1000 * 100.0
    sim.s.measured_speed(sim.ids["x"], 1e12)  # now the fastest: capped by the next, not by itself
    assert sim.s.speed[sim.ids["x"]] <= 1000 * 100.0
    assert sim.s.evaluators(10_000) == set()  # one node's speed makes nobody else an evaluator


def test_a_measured_speed_is_capped_by_the_fastest_other_member_whoever_was_measured_between() -> None:
    sim = Sim(["a", "b", "x"])
    sim.s.measured_speed(sim.ids["x"], 1e12)
    sim.s.measured_speed(sim.ids["x"], 1e12)
    sim.s.measured_speed(sim.ids["a"], 1.2e5)  # (over the cap of b's 100: a's is x's speed)
    x, a = sim.s.speed[sim.ids["x"]], sim.s.speed[sim.ids["a"]]
    assert a < x
    sim.s.measured_speed(sim.ids["x"], 7e7)  # over a's cap, under its own speed's
    assert sim.s.speed[sim.ids["x"]] == 0.5 * x + 0.5 * 1000 * a


# --- 5. an abandoned round due a checkpoint (the coordinator) ----------------------------------


def test_an_abandoned_round_due_a_checkpoint_checkpoints_the_last_agreed_theta(tmp_path, caplog) -> None:
    import asyncio
    import time

    from drift.coordinator import Coordinator
    from drift.transport import Endpoint

    class Wire:  # the nodes' end of their connections: what the coordinator sends them
        def __init__(self) -> None:
            self.frames: list[P.Message] = []

        async def send_frame(self, frame: bytes, timeout: float | None = None) -> None:
            self.frames.append(P.decode(frame))

        def close(self, why: str) -> None:
            raise AssertionError(f"closed: {why}")

    sim = Sim(["a", "b"], rounds=2)
    coord = Coordinator(sim.recipe, tmp_path)
    coord.swarm, coord.queue = sim.s, sim.queue
    for p in sim.s.members.values():
        p.ch = Wire()
    coord.swarm.checksums[0] = "theta-r0"
    coord.samples_at[0], coord.positions[0] = 16, sim.queue.position()

    async def settle() -> None:
        coord.endpoint = await Endpoint.bind("local")
        try:
            taken = sim.queue.take_round(R.budget(sim.s, 0))
            rd = coord.current = Round(sim.s, coord, 1, taken, time.monotonic())
            coord.live = [rd]
            rd.abandon("every Δ was bad")
            await coord._settle(rd)  # round 1 is the last: a checkpoint is due
            await coord._wait_checkpoint()
        finally:
            await coord.endpoint.close()

    with caplog.at_level("WARNING", logger="drift.coord"):
        asyncio.run(settle())
    # No KeyError: the checkpoint asked for is round 0's (no node holds it in this test).
    assert "no checkpoint for round 0: no connected node holds it" in caplog.text
    told = [m for p in sim.s.members.values() for m in p.ch.frames]
    assert [(m.type, m.round, m.abandoned, m.state.round) for m in told] == [("Agreed", 1, True, 0)] * 2


# --- 7. θ is asked of nodes that can hand it over (a checkpoint, a late joiner, an evaluator) ---


def test_theta_is_asked_of_the_members_holding_it_fastest_first_never_of_one_gone() -> None:
    """Who is asked for θ of the newest round: the members holding it, fastest first. Never a node
    that left (drift coord --local drops one whose process exited), one whose connection ended
    before the round loop read that (gone), one whose stream we closed (broken), one banned, one
    holding another round, nor the asker itself."""
    speeds = {"exited": 900.0, "gone": 800.0, "broken": 700.0, "banned": 600.0, "behind": 500.0}
    speeds |= {"fast": 300.0, "mid": 200.0, "slow": 100.0, "more": 50.0, "joiner": 1000.0}
    sim = Sim(list(speeds), speeds=speeds)
    s, i = sim.s, sim.ids
    for r in range(3):
        s.checksums[r] = f"theta{r + 1}"
    for n in speeds:
        s.holds(i[n], 1 if n == "behind" else 2)
    s.state_round[i["joiner"]] = -1  # admitted late: it holds the initial θ
    s.leave(i["exited"])  # as Coordinator.drop does
    s.members[i["gone"]].gone = "connection closed"
    s.members[i["broken"]].broken = "sending TrainProgress to it failed"
    s.banned[i["banned"]] = "it sent more into the ring than it reported"
    assert [sim.names[x] for x in s.donors(2)] == ["fast", "mid", "slow", "more"]
    assert [sim.names[x] for x in s.donors(2, but=i["fast"])] == ["mid", "slow", "more"]
    assert [sim.names[x] for x in s.donors(1)] == ["behind"]
    src = s.state_source(i["joiner"])
    assert src is not None and (src.round, src.checksum) == (2, "theta3")
    assert src.tickets == ["ticket-fast", "ticket-mid", "ticket-slow", "ticket-more"]


def _every_unit_once(sim: Sim) -> None:
    """Every sample the round took is counted (its Δ is in θ) or handed back to be redone, once."""
    spans = [(u.epoch, u.id, u.lo, u.hi) for u in [*sim.result.trained, *sim.result.given_back]]
    assert len(spans) == len(set(spans)), spans
    assert rules.samples([*sim.result.trained, *sim.result.given_back]) == sim.rd.budget


def test_a_holder_two_members_name_for_bad_pieces_is_nobodys_donor_and_one_name_changes_nothing() -> None:
    sim = Sim(["a", "b", "c", "x"], speeds={"x": 1000.0})
    sim.s.agreed(0, "theta-r0", [sim.ids[n] for n in "abcx"])
    donors = lambda: [sim.names[i] for i in sim.s.donors(0)]  # noqa: E731
    assert donors()[0] == "x"  # the fastest is asked first
    assert not sim.s.named_holder(sim.ids["a"], sim.ids["x"])
    assert not sim.s.named_holder(sim.ids["a"], sim.ids["x"])  # the same member again counts once
    assert not sim.s.named_holder(sim.ids["x"], sim.ids["x"])  # nor does its own word
    assert donors()[0] == "x"
    assert sim.s.named_holder(sim.ids["b"], sim.ids["x"])  # two members: it is remembered
    assert "x" not in donors() and sorted(donors()) == ["a", "b", "c"]
    assert not sim.s.named_holder(sim.ids["c"], sim.ids["x"])  # (said once, when it became two)


def test_the_honest_round_settles_with_every_unit_counted_once() -> None:
    sim = Sim(["a", "b", "c"])
    sim.start()
    sim.ring()
    for n in "abc":
        sim.done(n)
    assert sim.tick()
    spans = [(u.epoch, u.id, u.lo, u.hi) for u in sim.result.trained]
    assert len(spans) == len(set(spans)) and sim.result.samples == sim.rd.budget
    assert not sim.struck() and not sim.dropped


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level("ERROR", logger="drift.coord")


# --- random interleavings: the invariants hold whatever up to a third of the members send --------

HOSTILE = [
    "dup_progress",  # repeats its progress reports
    "hoard",  # asks for work again and again
    "step_lie",  # a huge Δ norm over a huge step count
    "sit_out_early",  # "I already applied it" the moment the ring starts
    "sit_out_late",  # ... after the others applied
    "accuse",  # names an honest member as the one that broke the ring
    "withhold",  # gets everyone's bytes, sends none, reports θ first
    "silent",  # sends nothing in the all-reduce
    "wrong_checksum",  # reports another θ
    "stale",  # reports θ of another round and epoch, then behaves
    "leave",  # disconnects in the middle of the all-reduce
]
RING_TIMEOUT_S = 120.0  # how long an honest node waits for a silent peer before it names it (drift.ring)


def _honest_reply(sim: Sim, name: str, m: P._Msg, applied: dict[str, int], withholders: set[str]) -> list[P._Msg]:
    """What honest node `name` answers to a BarrierReady or Commit (as drift.node does)."""
    match m:
        case P.BarrierReady(ring_epoch=e) if name in applied:
            return [P.RingFailed(round=m.round, ring_epoch=e, reason="applied", sit_out=True)]
        case P.BarrierReady(ring_epoch=e):
            ring = {sim.names[x] for x in m.order}
            if culprit := sorted(ring & withholders):  # (after waiting for its bytes)
                return [P.RingFailed(round=m.round, ring_epoch=e, reason="t", suspect=sim.ids[culprit[0]])]
            if m.confirm:  # a ring of two announces before applying
                return [
                    P.RoundDone(round=m.round, ring_epoch=e, checksum=f"theta-e{e}", announced=True, before="theta0")
                ]
            applied[name] = e
            return [P.RoundDone(round=m.round, ring_epoch=e, checksum=f"theta-e{e}")]
        case P.Commit(ring_epoch=e):
            applied[name] = e
            return [P.RoundDone(round=m.round, ring_epoch=e, checksum=f"theta-e{e}")]
    return []


def _hostile_reply(sim: Sim, name: str, how: str, m: P._Msg, honest: list[str]) -> list[tuple[float, P._Msg]]:
    """What a hostile node sends (delay, message) on a BarrierReady, by its strategy."""
    if not isinstance(m, P.BarrierReady):
        return []
    r, e = m.round, m.ring_epoch
    good = P.RoundDone(round=r, ring_epoch=e, checksum=f"theta-e{e}", announced=m.confirm, before="theta0")
    match how:
        case "sit_out_early":
            return [(0.0, P.RingFailed(round=r, ring_epoch=e, reason="x", sit_out=True))]
        case "sit_out_late":
            return [(3.0, P.RingFailed(round=r, ring_epoch=e, reason="x", sit_out=True))]
        case "accuse":
            return [(0.0, P.RingFailed(round=r, ring_epoch=e, reason="x", suspect=sim.ids[honest[0]]))]
        case "withhold":
            return [(0.0, good)]
        case "silent":
            return []
        case "wrong_checksum":
            return [(1.0, P.RoundDone(round=r, ring_epoch=e, checksum="evil", announced=m.confirm, before="theta0"))]
        case "stale":
            return [(0.0, P.RoundDone(round=r + 1, ring_epoch=e + 3, checksum="old")), (1.0, good)]
        case "leave":
            return [(1.0, None)]  # (None: its connection ends)
    return [(1.0, good)]


@pytest.mark.parametrize("how", HOSTILE)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(n=st.integers(3, 6), data=st.data())
def test_random_interleavings_of_hostile_messages_keep_the_invariants(how: str, n: int, data: st.DataObject) -> None:
    # Up to a third of the members are hostile: the first with `how`, a second (6 members) drawn.
    names = [f"n{k}" for k in range(n)]
    bad = {names[k]: how if k == 0 else data.draw(st.sampled_from(HOSTILE), label=f"n{k}") for k in range(n // 3)}
    honest = [x for x in names if x not in bad]
    sim = Sim(names)
    rd = sim.start()
    for name in data.draw(st.permutations(names), label="barrier order"):
        how = bad.get(name)
        if how == "dup_progress":
            u = rd.plan.granted[sim.ids[name]][0]
            for _ in range(5):
                sim.msg(name, P.TrainProgress(round=0, units=[u], steps=1, loss=1.0, samples_per_s=1e6))
        if how == "hoard":
            for _ in range(10):
                sim.msg(name, P.AskForMoreWork(round=0))
        sim.train(name, **({"norm": 1000.0, "steps": 10**9} if how == "step_lie" else {}))
    for name in names:  # a unit counts once: nobody trained more than it was granted
        granted = [
            u for to, m in sim.sent if to == sim.ids[name] for u in getattr(m, "units", [getattr(m, "unit", None)])
        ]
        assert rd.nodes[sim.ids[name]].trained <= rules.samples([u for u in granted if u is not None])
    withholders = {x for x, how in bad.items() if how in ("withhold", "silent")}
    applied: dict[str, int] = {}
    queue: list[tuple[float, int, str, P._Msg]] = []  # (when, order, sender, message)
    seen, k = 0, 0
    limit = sim.t0 + (R.MAX_RING_RETRIES + 2) * (rules.REDUCE_DEADLINE_S + 2 * sim.recipe.stale_after_s)
    settled = sim.tick()
    while not settled and sim.now < limit:
        for to, m in sim.sent[seen:]:
            name = sim.names[to]
            if name in bad:
                replies = _hostile_reply(sim, name, bad[name], m, honest)
            else:
                jitter = data.draw(st.sampled_from([0.1, 0.5, 2.0]), label="delay")
                replies = _honest_reply(sim, name, m, applied, withholders)
                replies = [(RING_TIMEOUT_S if isinstance(r, P.RingFailed) else jitter, r) for r in replies]
            for delay, r in replies:
                queue.append((sim.now + delay, k := k + 1, name, r))
        seen = len(sim.sent)
        queue.sort(key=lambda q: q[:2])
        if queue and queue[0][0] <= sim.now + 5.0:
            when, _, name, m = queue.pop(0)
            sim.now = max(sim.now, when)
            if m is None:
                sim.drop(sim.ids[name], "connection closed")
            else:
                sim.msg(name, m)
            settled = sim.tick(sim.now - sim.t0)
        else:
            settled = sim.tick(sim.now - sim.t0 + 5.0)  # (the clocks' thresholds are seconds apart)
    assert settled, f"round 0 did not end by {limit - sim.t0:.0f}s ({bad})"
    if sim.rd.abandoned:
        assert sim.result.checksum == "theta0"  # cleanly: θ unchanged
    else:
        assert sim.result.checksum.startswith("theta-e"), (sim.result.checksum, bad)  # an honest θ
    # A θ an honest member applied is the round's: never abandoned, never redone over it.
    assert {f"theta-e{e}" for e in applied.values()} <= {sim.result.checksum}, (applied, sim.result, bad)
    assert sim.struck() <= set(bad) and {sim.names[i] for i, _ in sim.dropped} <= set(bad), (bad, sim.notes)
    _every_unit_once(sim)
    liars = {sim.ids[x] for x, how in bad.items() if how == "step_lie"}  # its Δ never weighs in
    assert all(
        m.weight == 0
        for _, b in sim.sent
        if isinstance(b, P.BarrierReady)
        for m in b.members(None)  # (the order as its node knows it)
        if m.node_id in liars
    )


# --- the round writes nothing: every write is an action the shell applies ----------------------


def _of(sim: Sim, kind: type) -> list:
    return [a for a in sim.actions if isinstance(a, kind)]


def _poisoned(sim: Sim, name: str) -> None:
    """Node `name` refuses the all-reduced sum: larger than the reported norms allow."""
    e = sim.rd.ring_epoch()
    sim.msg(name, P.RingFailed(round=sim.rd.rnd, ring_epoch=e, reason="too large", poisoned=True))


def test_a_node_that_applied_a_sum_the_others_refused_is_banned_with_its_reason() -> None:
    sim = Sim(["a", "b", "c", "x"])
    sim.start()
    sim.ring()
    for n in "abc":
        _poisoned(sim, n)
    sim.done("x")  # it applied the sum everyone else refused: it sent more than it reported
    assert not sim.tick(GRACE + 1)
    why = "it poisoned the all-reduce (it applied an all-reduced Δ that the others refused)"
    x = sim.ids["x"]
    assert _of(sim, R.Ban) == [R.Ban(x, why)] and _of(sim, R.Suspects) == [R.Suspects(frozenset({x}))]
    assert sim.s.banned == {x: why} and sim.s.poison_suspects == {x}  # (applied by the shell)
    assert sim.rings()[-1] == ["c", "b", "a"]  # redone without it
    for n in "abc":
        sim.done(n)
    assert sim.tick(GRACE + 2)
    assert sim.dropped == [(x, why)]  # out once the round settled


def test_a_ring_retry_is_a_new_ring_epoch_and_only_its_reports_count() -> None:
    sim = Sim(["a", "b", "c"])
    sim.start()
    sim.ring()
    assert not sim.tick(rules.REDUCE_DEADLINE_S + 1)  # nobody finished: redone
    assert _of(sim, R.NewRingEpoch) == [R.NewRingEpoch(1)] and sim.s.ring_epoch == 1
    assert [m.ring_epoch for _, m in sim.sent if isinstance(m, P.BarrierReady)] == [0] * 3 + [1] * 3
    for n in "abc":
        sim.done(n, checksum="stale", epoch=0)  # reports of the attempt given up count for nothing
    assert not sim.tick(rules.REDUCE_DEADLINE_S + 2)
    for n in "abc":
        sim.done(n, epoch=1)
    assert sim.tick(rules.REDUCE_DEADLINE_S + 3)
    assert sim.result.checksum == "theta1" and _of(sim, R.AgreedTheta) == [
        R.AgreedTheta(0, "theta1", tuple(sim.ids.values()))
    ]
    assert sim.s.checksums[0] == "theta1" and all(sim.s.state_round[i] == 0 for i in sim.ids.values())


def test_two_strikes_in_one_message_drop_the_node() -> None:
    # One RingFailed with a claim it never proved (sit_out) and a forgery proof that does not
    # hold: two strikes in one event, the second of which is one too many although the first is
    # not applied to the swarm yet.
    sim = Sim(["a", "b", "c", "x"])
    sim.start()
    sim.ring()
    bogus = P.Forgery(
        forwarder=sim.ids["a"],
        round=0,
        generation=0,
        segment=0,
        lo=0,
        hi=1,
        total=1,
        digest="00" * 32,
        owner_sig="00" * 64,
        step=0,
        chunk=0,
        hop_sig="00" * 64,
    )
    fail = P.RingFailed(round=0, ring_epoch=0, reason="x", suspect=sim.ids["a"], sit_out=True, proof=bogus)
    sim.msg("x", fail)
    x = sim.ids["x"]
    assert [a.node for a in _of(sim, R.Strike)] == [x, x] and sim.s.strikes[x] == [0, 0]
    assert not sim.dropped  # (a ring member is dropped once the round settles: dropping it now redoes the ring)
    for n in "abc":
        sim.done(n)
    assert sim.tick(GRACE + 1)
    assert sim.dropped == [(x, "it accused a ring neighbour with proof that does not hold, again")]
    assert "a" not in sim.struck()


def test_a_second_lie_bans_the_liar_for_the_run_while_lateness_twice_only_drops() -> None:
    # x says "I already applied" without a RoundDone, twice; y reports θ late, twice. Both are
    # struck out, but only x's strikes are lies no honest code tells: x is banned (a rejoin is
    # refused), y only dropped (a slow node may come back).
    sim = Sim(["a", "b", "c", "x", "y"])
    for rnd in range(2):
        sim.t0 = sim.now = 1000.0 + rnd * 100
        sim.start(rnd)
        sim.ring()
        for n in "abc":
            sim.done(n)
        sim.failed("x", sit_out=True)
        assert not sim.tick(2 * sim.recipe.heartbeat_s + 0.5)  # y is behind
        assert sim.tick(GRACE + 1)
    x, y = sim.ids["x"], sim.ids["y"]
    assert [n["name"] for n in sim.noted("false_claim")] == ["x", "x"]
    assert [n["name"] for n in sim.noted("deadline")] == ["y", "y"]
    assert {i for i, _ in sim.dropped} == {x, y}
    assert set(sim.s.banned) == {x} and "again" in sim.s.banned[x]


def test_a_second_strike_of_a_node_struck_before_drops_it_at_once_when_it_sits_out() -> None:
    # A strike in an earlier round is the swarm's (applied by the shell); a sit-out with a strike
    # now is the second: it is dropped at once (Drop), not when the round settles.
    sim = Sim(["a", "b", "c", "x"])
    x = sim.ids["x"]
    sim.s.strike(x, 0)
    sim.start(1)
    sim.ring()
    for n in "abc":
        sim.failed(n, suspect="x")  # caught by both its neighbours (and a third)
    assert not sim.tick(GRACE + 1)
    why = "both its ring neighbours caught it breaking the all-reduce"
    assert _of(sim, R.Drop) == [R.Drop(x, f"{why}, again")] and sim.dropped == [(x, f"{why}, again")]
    assert sim.rings()[-1] == ["c", "b", "a"] and x not in sim.s.members


class ReadOnly:
    """A Swarm seen as a round sees it (round.SwarmView): mappings read-only, sets frozen, and
    no attribute assignable."""

    def __init__(self, swarm: Swarm) -> None:
        object.__setattr__(self, "_swarm", swarm)

    def __getattr__(self, name: str):
        v = getattr(self._swarm, name)
        if isinstance(v, dict):
            return MappingProxyType(v)
        return frozenset(v) if isinstance(v, set) else v

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a round assigned Swarm.{name}")


class Frozen(Sim):
    """A Sim whose round sees the swarm read-only and whose actions nobody applies: they are
    only recorded (and the sends, to answer them)."""

    def start(self, rnd: int = 0) -> Round:
        taken = self.queue.take_round(R.budget(self.s, self.queue.pending_samples()))
        self.rd = Round(ReadOnly(self.s), self.host, rnd, taken, self.now)
        self.apply(self.rd.start(0))
        return self.rd

    def apply(self, actions: list[R.Action]) -> bool:
        self.actions += actions
        self.sent += [(i, a.msg) for a in actions if isinstance(a, R.Send) for i in a.nodes]
        return any(isinstance(a, R.Settled) for a in actions)

    def tick(self, after: float = 0.0) -> bool:
        self.now = max(self.now, self.t0 + after)
        if settled := self.apply(self.rd.step(R.Tick(), self.now)):
            self.rd.settled = True
            self.result, actions = self.rd.finish(self.now)
            self.apply(actions)
        return settled


def _public(s: Swarm, q: UnitQueue) -> dict:
    return copy.deepcopy({**{k: v for k, v in vars(s).items() if k != "note"}, "queue": q.position()})


@pytest.mark.parametrize("how", ["poisoned", "abandoned"])
def test_a_round_driven_through_every_kind_of_write_leaves_the_swarm_as_it_was(how: str) -> None:
    sim = Frozen(["a", "b", "c", "d", "x"], speeds={"x": 10.0})
    before = _public(sim.s, sim.queue)
    rd = sim.start()
    after_take = _public(sim.s, sim.queue)  # (the shell took the round's units; nothing else)
    assert {k: v for k, v in after_take.items() if k != "queue"} == {k: v for k, v in before.items() if k != "queue"}
    sim.now += 1.0  # (speeds are measured over a window)
    for n in "abcd":
        sim.train(n)
    assert not sim.tick(100.0)  # x trained nothing: past its deadline it sits out, slowed
    assert rd.ring is not None and len(rd.ring) == 4
    sim.msg("x", P.RingFailed(round=0, ring_epoch=0, reason="x", sit_out=True))  # sat out: not heard
    sim.msg("a", P.RingFailed(round=0, ring_epoch=0, reason="x", sit_out=True))  # a claim: a strike
    if how == "poisoned":
        for n in "abc":
            _poisoned(sim, n)
        sim.done("d", epoch=0)
        assert not sim.tick(100.0 + GRACE + 1)  # d is convicted; redone without it
        for n in "abc":
            sim.done(n, epoch=1)
        assert sim.tick(100.0 + GRACE + 2)
    else:
        for n in "abc":
            sim.failed(n, epoch=0)
        assert not sim.tick(100.0 + GRACE + 1)
        for n in "abcd":
            sim.done(n, epoch=0)
            sim.failed(n, sit_out=True, epoch=1)
        assert sim.tick(100.0 + GRACE + 2) and rd.abandoned
    kinds = {type(a) for a in sim.actions}
    writes = {R.Measured, R.Slowed, R.Strike, R.NewRingEpoch, R.GiveBack, R.TellAgreed, R.Log}
    writes |= {R.Ban, R.Suspects, R.AgreedTheta} if how == "poisoned" else {R.Moved}
    assert writes <= kinds, writes - kinds  # the round decided every kind of write ...
    assert _public(sim.s, sim.queue) == after_take  # ... and made none


# --- what a BarrierReady carries: the ring told once ---------------------------------------------


def test_the_ring_order_and_the_tickets_go_to_a_member_only_when_they_changed() -> None:
    # Every member's id, ticket, weight and norm to every member, every round, was N² bytes a
    # round from the coordinator (110 MB at 1,000 nodes): a member is sent the ring's order, and
    # the members' tickets, when they are new to it; weights go as counted samples, norms as one bound.
    sim = Sim(["a", "b", "c"])

    def readies() -> list[tuple[set[str], P.BarrierReady]]:
        out = [({sim.names[i] for i in a.nodes}, a.msg) for a in sim.actions if isinstance(a, R.Send)]
        sim.actions.clear()
        return [(to, m) for to, m in out if isinstance(m, P.BarrierReady)]

    def tickets() -> dict[str, set[str]]:
        return {sim.names[i]: {sim.names[j] for j in m.tickets} for i, m in sim.sent if isinstance(m, P.Tickets)}

    sim.start()
    sim.train("a", norm=1.0)
    sim.train("b", norm=2.0)
    sim.train("c", norm=4.0)
    assert not sim.tick()
    [(to, m)] = readies()
    assert to == {"a", "b", "c"} and [sim.names[i] for i in m.order] == ["a", "b", "c"]
    n = rules.counted(sim.rd.nodes, sim.rd.part())
    assert m.samples == [n[i] for i in m.order] and sum(m.samples) > 0
    w = rules.weights(sim.rd.nodes, sim.rd.part())
    assert [(x.node_id, x.weight) for x in m.members(None)] == [(i, w[i]) for i in m.order]  # the same floats
    reported = {i: sim.rd.nodes[i].synced.delta_norm for i in m.order}
    assert m.bound == pytest.approx(sum(w[i] * reported[i] for i in m.order))
    assert tickets() == {x: set("abc") - {x} for x in "abc"}  # (a ring of three: each dials the other two)
    for x in "abc":
        sim.done(x)
    assert sim.tick()

    sim.sent.clear()
    sim.start(1)
    sim.ring()
    [(to, m)] = readies()
    assert to == {"a", "b", "c"} and m.order is None  # the same ring: the order they hold
    assert not tickets()
    assert not sim.tick(rules.REDUCE_DEADLINE_S + 1)  # nobody finished: a retry reverses the ring
    [(to, m)] = readies()
    assert to == {"a", "b", "c"} and [sim.names[i] for i in m.order] == ["c", "b", "a"]
    assert [sim.names[x.node_id] for x in m.members(None)] == ["c", "b", "a"]

    for x in "abc":
        sim.done(x)
    assert sim.tick()

    # c's process restarts: its new session knows no order and no ticket (a and b keep theirs).
    c = sim.s.members[sim.ids["c"]]
    sim.s.leave(sim.ids["c"])
    sim.s.enter(c, 1)
    assert sim.s.told_order([sim.ids[x] for x in "cba"]) == {sim.ids["a"], sim.ids["b"]}
    sim.sent.clear()
    sim.start(2)
    sim.ring()
    sent = readies()
    assert {x for to, m in sent if m.order is not None for x in to} >= {"c"}
    assert tickets() == {"a": {"c"}, "b": {"c"}, "c": {"a", "b"}}  # (c came back: its ticket may be new)


@pytest.mark.parametrize("rule", ["dense", "sparse"])
def test_a_member_is_told_the_tickets_of_the_members_it_connects_to_and_no_others(rule: str) -> None:
    # Every member's ticket to every member at the first ring was N² bytes from the coordinator
    # (150 MB at 1,000 nodes). A member dials only its neighbours in the attempt (a grid's row and
    # column, the sparse rule's level siblings): it is told theirs, and on a retry, whose reversed
    # order changes its neighbours, those of its new ones it was not told.
    names = [f"n{k:03}" for k in range(70)]  # (a grid of 8 x 8 and 6 passengers; 2 levels)
    sparse = {"sync": "sparse", "sync_params": {"dense_rounds": 0, "fanout": 16}} if rule == "sparse" else {}
    sim = Sim(names, **sparse)

    def tickets() -> dict[str, set[str]]:
        out: dict[str, set[str]] = {n: set() for n in names}
        for i, m in sim.sent:
            if isinstance(m, P.Tickets):
                out[sim.names[i]] |= {sim.names[j] for j in m.tickets}
        sim.sent.clear()
        return out

    def links() -> dict[str, set[str]]:
        ids = [m.node_id for m in sim.rd.ring]
        if rule == "dense":
            got = ring.links(ids, sim.recipe.codec)
        else:
            levels = hierarchy.plan(len(ids), 16)
            got = {i: {ids[m] for level in levels for m in level.neighbours(k)} for k, i in enumerate(ids)}
        return {sim.names[i]: {sim.names[j] for j in v} for i, v in got.items()}

    sim.start()
    sim.ring()
    first = links()
    assert tickets() == first and max(map(len, first.values())) <= 20  # of 69
    assert not sim.tick(rules.REDUCE_DEADLINE_S + 1)  # nobody finished: redone, the ring reversed
    again = links()
    assert again != first
    assert tickets() == {n: again[n] - first[n] for n in names}


def test_an_evaluator_whose_job_could_not_start_gets_a_fresh_one_also_rounds_later() -> None:
    # Its job named θ of round 2; by the time it reached the donor, the donor held round 4, so it
    # waited a second and asked again, for round 2's job. "No more work (round 2)" left it idle
    # to the end of the run, the coordinator counting it as evaluating (CI: it left behind).
    sim = Sim(["a", "b", "slow"], speeds={"slow": 0.01})
    assert sim.s.evaluators(sim.recipe.round_samples) == {sim.ids["slow"]}
    sim.start(4)
    assert sim.rd.nodes[sim.ids["slow"]].role == "evaluate"
    for rnd in (4, 2):  # its job of this round, or of an earlier one
        sim.actions.clear()
        sim.msg("slow", P.AskForMoreWork(round=rnd))
        assert [a for a in sim.actions if isinstance(a, R.Evaluate)] == [R.Evaluate(sim.ids["slow"])], rnd
        assert not sim.to("slow", P.NoMoreWork)


@settings(max_examples=200, deadline=None)
@given(
    speeds=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=8),
    sizes=st.lists(st.integers(0, 16), min_size=1, max_size=40),
    asks=st.lists(st.integers(0, 7), max_size=80),
)
def test_a_node_out_of_work_takes_the_last_unit_of_the_node_expected_to_finish_last(speeds, sizes, asks) -> None:
    # The steal's choice, kept as a running count (summing every queue at every steal was most of
    # a thousand nodes' round logic): the same unit as the sum over each node's plan would pick.
    from collections import deque

    from drift.scheduler import RoundPlan

    ids = [f"n{k}" for k in range(len(speeds))]
    units = [P.WorkUnit(epoch=0, id=k, lo=0, hi=n) for k, n in enumerate(sizes)]
    plan = RoundPlan.make(units, dict(zip(ids, speeds)))
    mine = {i: deque(q) for i, q in plan.planned.items()}  # the reference: the plan as it was made
    for a in asks:
        node = ids[a % len(ids)]
        if mine[node]:
            want = mine[node].popleft()
        else:
            busy = [(sum(u.hi - u.lo for u in q) / plan.speeds[v], v) for v, q in mine.items() if q]
            want = mine[max(busy)[1]].pop() if busy else None
        assert plan.next_for(node) == want
        assert plan.remaining() == sum(u.hi - u.lo for q in mine.values() for u in q)
