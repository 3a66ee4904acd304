"""The round's rules (drift.rules) as pure decisions over one record per node: no processes, no
network, milliseconds. The swarm tests show the same rules acting on real nodes."""

from __future__ import annotations

import hashlib

import nacl.signing
import pytest

from drift import protocol as P
from drift import rules
from drift.gather import payload_message, signed_payload
from drift.rules import NodeRound


def _sync(n: int, rnd: int = 0) -> P.BarrierSync:
    units = [P.WorkUnit(epoch=0, id=0, lo=0, hi=n)] if n else []
    return P.BarrierSync(round=rnd, samples=n, steps=1, loss=None, trained=units)


def _recs(**kw: NodeRound) -> dict[str, NodeRound]:
    return dict(kw)


def test_part_is_the_trainers_not_sitting_out_in_order() -> None:
    recs = _recs(
        a=NodeRound("train"),
        b=NodeRound("evaluate"),
        c=NodeRound("train", sitting_out=True),
        d=NodeRound("wait"),
        e=NodeRound("train"),
        f=NodeRound("late", catching_up=True),
    )
    assert rules.part(recs) == ["a", "e"]


def test_barrier_waits_for_every_trainer_not_excluded() -> None:
    recs = _recs(a=NodeRound("train", synced=_sync(64)), b=NodeRound("train"))
    assert rules.barrier(recs).action == "wait"


def test_barrier_goes_on_without_stragglers_past_their_deadline() -> None:
    recs = _recs(a=NodeRound("train", synced=_sync(64)), b=NodeRound("train", excluded=True))
    d = rules.barrier(recs)
    assert d.action == "ring" and d.stragglers == ("b",)


def test_barrier_abandons_a_round_whose_work_is_all_void() -> None:
    recs = _recs(
        a=NodeRound("train", synced=_sync(64), excluded=True),  # a bad report
        b=NodeRound("train", excluded=True),  # a deadline
    )
    assert rules.barrier(recs).action == "abandon"


def test_barrier_with_nobody_left_is_an_error() -> None:
    with pytest.raises(ValueError):
        rules.barrier(_recs(a=NodeRound("evaluate")))


def test_weights_follow_counted_samples_and_sum_to_one() -> None:
    recs = _recs(
        a=NodeRound("train", synced=_sync(96)),
        b=NodeRound("train", synced=_sync(32)),
        c=NodeRound("train", synced=_sync(64), excluded=True),
    )
    w = rules.weights(recs, ["a", "b", "c"])
    assert w == {"a": 0.75, "b": 0.25, "c": 0.0}


def test_overdue_needs_factor_times_expected_plus_slack_and_someone_else() -> None:
    assert not rules.overdue(waited=4.99, expected=1.0, factor=4.0, heartbeat_s=0.5, others=1)
    assert rules.overdue(waited=5.01, expected=1.0, factor=4.0, heartbeat_s=0.5, others=1)
    assert not rules.overdue(waited=1e9, expected=1.0, factor=4.0, heartbeat_s=0.5, others=0)  # the last one finishes


@pytest.mark.parametrize("heartbeat_s, stale_after_s", [(2.0, 10.0), (0.5, 1.0), (5.0, 10.0), (50.0, 250.0)])
def test_a_quiet_channel_is_beaten_on_within_half_the_other_ends_patience(heartbeat_s, stale_after_s) -> None:
    quiet = rules.quiet_limit(heartbeat_s, stale_after_s)
    # A beat every heartbeat_s sends once the channel was quiet this long: the other end's
    # longest silence is quiet + heartbeat_s, never past its stale_after_s (it would drop us).
    assert quiet + heartbeat_s <= max(1.5 * heartbeat_s, stale_after_s / 2) <= stale_after_s
    assert quiet >= heartbeat_s / 2  # a channel that carried a frame within half a beat needs none


@pytest.mark.parametrize("heartbeat_s, stale_after_s", [(2.0, 10.0), (0.5, 1.0), (5.0, 10.0), (50.0, 250.0)])
@pytest.mark.parametrize("members", [2, 16, 129, 1000, 100_000])
def test_in_a_larger_swarm_beats_come_more_seldom_and_the_other_end_waits_longer_by_as_much(
    heartbeat_s, stale_after_s, members
) -> None:
    alone = rules.quiet_limit(heartbeat_s, stale_after_s)
    quiet = rules.quiet_limit(heartbeat_s, stale_after_s, members)
    patience = rules.patience(heartbeat_s, stale_after_s, members)
    assert quiet >= alone and patience >= stale_after_s
    # The other end's longest silence (quiet + a beat) keeps the margin it had in a swarm of one.
    assert patience - (quiet + heartbeat_s) >= stale_after_s - (alone + heartbeat_s)
    assert rules.patience(heartbeat_s, stale_after_s) == stale_after_s
    # Never shorter for more members: a member told a larger swarm never beats more often.
    assert rules.quiet_limit(heartbeat_s, stale_after_s, 2 * members) >= quiet


def test_at_the_default_beats_a_thousand_members_send_the_coordinator_at_most_fifty_beats_a_second() -> None:
    # Every 3 s of quiet at the defaults: 333 Heartbeats and as many Pings a second at 1,000 members.
    quiet = rules.quiet_limit(2.0, 10.0, 1000)
    assert 1000 / quiet <= rules.BEATS_PER_S
    assert rules.patience(2.0, 10.0, 1000) == pytest.approx(10.0 + 2 * (quiet - 3.0))
    # A swarm of up to 128 members beats as the recipe says, and is dropped after stale_after_s.
    assert rules.quiet_limit(2.0, 10.0, 128) == 3.0 and rules.patience(2.0, 10.0, 128) == 10.0
    assert rules.quiet_limit(2.0, 10.0, 129) > 3.0


def test_a_thousand_nodes_all_reducing_for_a_minute_get_no_ping_and_send_no_heartbeat() -> None:
    # (the lightweight swarm's recipe at 1,000 nodes: beats of 50 s, patience of 250 s)
    assert rules.quiet_limit(50.0, 250.0) > 60.0
    assert rules.quiet_limit(2.0, 10.0) == 3.0  # the defaults: a frame within 5 s of silence


def test_a_speed_nobody_measured_never_outweighs_what_our_clock_measured() -> None:
    speeds = {"a": 150.0, "b": 1e5, "c": 1e5}  # a's unit was measured (slow, under load); b, c only claimed
    planned = rules.planning_speeds(speeds, measured={"a"})
    assert planned == {"a": 150.0, "b": 150.0, "c": 150.0}
    assert rules.evaluators(planned, budget=512, batch_size=4, slow_fraction=0.01) == set()
    assert rules.evaluators(speeds, budget=512, batch_size=4, slow_fraction=0.01) == {"a"}  # (the claims' doing)
    assert rules.planning_speeds(speeds, measured=set()) == speeds  # nothing measured yet: the claims
    assert rules.planning_speeds({"a": 50.0, "b": 400.0}, {"a", "b"}) == {"a": 50.0, "b": 400.0}


def test_quorum_cut_needs_the_quorum_synced_a_grace_ago() -> None:
    assert rules.quorum_cut(0.9, 0.9, 0.51, 0.5)
    assert not rules.quorum_cut(0.9, 0.9, 0.49, 0.5)  # one that is merely behind is waited for
    assert not rules.quorum_cut(0.89, 0.9, 60.0, 0.5)  # most of the swarm out: nobody is cut early
    assert not rules.quorum_cut(0.99, 1.0, 60.0, 0.5)  # quorum 1: only deadlines cut


def test_the_quorum_grace_is_a_median_step_and_never_under_a_messages_lag() -> None:
    assert rules.quorum_grace(2.0) == 2.0
    assert rules.quorum_grace(0.005) == rules.QUORUM_GRACE_MIN_S


def test_a_late_delta_keeps_less_the_later_it_comes() -> None:
    assert rules.staleness_scale(0) == 1.0
    assert rules.staleness_scale(1) == pytest.approx(2**-0.5)  # one round late: ~71 %
    assert rules.staleness_scale(3) == pytest.approx(0.5)


def test_tail_stops_the_slow_node_whose_next_step_outlasts_the_rest() -> None:
    speed = {"fast": 1000.0, "slow": 10.0}
    # 64 samples left in all: fast needs 0.064 s for them, one step of slow takes 6.4 s.
    assert rules.tail_stops(["fast", "slow"], {"fast": 64, "slow": 0}, 0, speed, 64) == ["slow"]
    # Plenty left: nobody stops.
    assert rules.tail_stops(["fast", "slow"], {"fast": 64, "slow": 0}, 100_000, speed, 64) == []
    # Never the last one.
    assert rules.tail_stops(["slow"], {"slow": 0}, 0, speed, 64) == []


def test_minority_and_no_majority() -> None:
    assert rules.minority({"a": "x", "b": "x", "c": "y"}) == ["c"]
    assert rules.minority({"a": "x", "b": "x"}) == []
    with pytest.raises(rules.NoMajority):
        rules.minority({"a": "x", "b": "y"})
    with pytest.raises(rules.NoMajority):
        rules.minority({"a": "x", "b": "x", "c": "y", "d": "y"})


def test_a_ring_finished_by_a_majority_counts() -> None:
    assert rules.finished_by_majority(["a", "b", "c"], {"a", "b"})
    assert not rules.finished_by_majority(["a", "b"], {"a"})  # one of two is no majority
    assert not rules.finished_by_majority(["a", "b", "c"], {"a", "b", "c"})  # nobody failed


def test_only_a_node_caught_by_both_neighbours_sits_out() -> None:
    suspects = {"a": {"b", "c"}, "b": {"a"}, "gone": {"a", "b"}}
    assert rules.caught(suspects, ["a", "b", "c"]) == ["a"]


def test_in_a_hierarchy_the_member_that_withheld_is_caught_not_those_it_held_up() -> None:
    # drift/hierarchy.py: s withholds its payload at level 0 from t1 and t2, which fail there
    # naming it and so send nothing at level 1; their targets u1, u2 (and u3, u4) fail at level 1
    # naming them and send nothing at level 2, where v1, v2 name u1. Only s is caught.
    accusations = [(0, "s", "t1", 0), (0, "s", "t2", 0), (0, "t1", "u1", 1), (0, "t1", "u2", 1)]
    accusations += [(0, "t2", "u3", 1), (0, "t2", "u4", 1), (0, "u1", "v1", 2), (0, "u1", "v2", 2)]
    failed = {(0, "t1"): (0, "s"), (0, "t2"): (0, "s"), (0, "u1"): (1, "t1"), (0, "u2"): (1, "t1")}
    failed |= {(0, "u3"): (1, "t2"), (0, "u4"): (1, "t2"), (0, "v1"): (2, "u1"), (0, "v2"): (2, "u1")}
    ring = ["s", "t1", "t2", "u1", "u2", "u3", "u4", "v1", "v2"]
    assert rules.caught(rules.accused(accusations, failed), ring) == ["s"]
    # without the levels every one of them that held somebody up would be caught
    flat = [(a, s, by, 0) for a, s, by, _ in accusations]
    assert rules.caught(rules.accused(flat, {}), ring) == ["s", "t1", "t2", "u1"]


def test_a_member_that_only_claims_it_was_held_up_is_caught_by_those_it_held_up() -> None:
    # s withholds at level 1 and says it failed at level 0, naming y, whom nobody else names
    accusations = [(0, "y", "s", 0), (0, "s", "a", 1), (0, "s", "b", 1)]
    failed = {(0, "s"): (0, "y"), (0, "a"): (1, "s"), (0, "b"): (1, "s")}
    assert rules.caught(rules.accused(accusations, failed), ["s", "y", "a", "b"]) == ["s"]
    # a failure of another attempt excuses nothing in this one
    assert rules.caught(rules.accused([(1, "s", "a", 1), (1, "s", "b", 1)], failed), ["s", "a", "b"]) == ["s"]


def test_evaluators_are_the_nodes_too_slow_to_train() -> None:
    speeds = {"gpu": 6000.0, "cpu": 10.0, "mid": 3000.0}
    # A round of 6400 samples is ~0.7 s on the trainers; one step of the CPU takes 6.4 s.
    assert rules.evaluators(speeds, 6400, 64, 0.1) == {"cpu"}
    # With a round long enough that one CPU step is a small part of it, the CPU trains too.
    assert rules.evaluators(speeds, 10_000_000, 64, 0.1) == set()
    assert rules.evaluators({"only": 1.0}, 64, 64, 0.1) == set()  # the fastest always trains
    # One node much faster than everyone (or claiming it) makes nobody else evaluate: with three
    # or more, the second fastest is the reference.
    assert rules.evaluators({"liar": 1e9, "a": 100.0, "b": 100.0, "c": 90.0}, 6400, 64, 0.1) == set()
    assert rules.evaluators({"liar": 1e9, "a": 100.0}, 6400, 64, 0.1) == {"a"}  # two: nobody can tell


def test_a_ring_member_silent_long_after_a_majority_reported_is_behind() -> None:
    done = P.RoundDone(round=0, checksum="x")
    recs = _recs(a=NodeRound("train", done=done), b=NodeRound("train"), c=NodeRound("train", done=done))
    # The clock starts when a majority had reported, not at the first reporter (a member that
    # withholds its bytes gets everyone else's and can be first): a at 0.2 s, c at 1 s.
    assert rules.majority_done_s({"a": 0.2}, ["a", "b", "c"]) is None
    majority = rules.majority_done_s({"a": 0.2, "c": 1.0}, ["a", "b", "c"])
    assert majority == 1.0
    # b gets 4 x 1 s + 4 s of slack, and 2 s more when it evaluates.
    assert rules.reduce_overdue(["a", "b", "c"], recs, 7.9, majority, 4.0, 4.0) == []
    assert rules.reduce_overdue(["a", "b", "c"], recs, 8.1, majority, 4.0, 4.0) == ["b"]
    assert rules.reduce_overdue(["a", "b", "c"], recs, 8.1, majority, 4.0, 4.0, {"b": 2.0}) == []
    # No majority yet: nobody is behind (silence is charged to whom the members name).
    assert rules.reduce_overdue(["a", "b", "c"], recs, 1e9, None, 4.0, 4.0) == []
    recs["b"].behind = True  # counted once
    assert rules.reduce_overdue(["a", "b", "c"], recs, 1e9, 1.0, 4.0, 4.0) == []


def test_past_the_reduce_deadline_only_a_ring_of_one_or_a_silent_partner_is_charged() -> None:
    late = rules.REDUCE_DEADLINE_S + 1
    assert rules.reduce_timed_out(["x"], [], late) == ["x"]
    assert rules.reduce_timed_out(["x"], [], rules.REDUCE_DEADLINE_S - 1) == []
    assert rules.reduce_timed_out(["a", "x"], ["a"], late) == ["x"]  # a announced its θ, x stayed silent
    assert rules.reduce_timed_out(["a", "x"], [], late) == []  # neither: nobody can tell which held it
    assert rules.reduce_timed_out(["a", "b", "c"], ["a"], late) == []  # whom to charge: whom two name
    assert rules.reduce_timed_out(["a", "b", "c"], ["a", "b"], late) == []  # a majority finished


def test_steps_come_from_the_samples_trained_not_the_nodes_word() -> None:
    units = [P.WorkUnit(id=0, lo=0, hi=8), P.WorkUnit(id=1, lo=0, hi=6)]
    assert rules.steps_of(units, 4) == 4  # 14 samples in batches of 4
    assert rules.steps_of([], 4) == 1


def test_speed_is_measured_by_our_clock_and_queued_reports_do_not_make_a_node_look_faster() -> None:
    n = NodeRound("train", t_unit=10.0)
    assert n.measure(64, now=10.5) == 128.0
    # Two reports that queued up on the way arrive 0.1 ms apart: not 320,000 samples/s, but
    # counted with the next report, over the time since the last measurement.
    assert n.measure(32, now=10.75) == 128.0
    assert n.measure(32, now=10.7501) is None
    assert n.measure(32, now=11.0) == 64 / 0.25
    # Units of a few milliseconds are measured together, over at least SPEED_WINDOW_S.
    times = [11.0 + 0.005 * j for j in range(1, 41)]
    speeds = [s for t in times if (s := n.measure(32, now=t)) is not None]
    assert speeds and all(abs(s - 6400) < 1e-6 * 6400 for s in speeds)


def test_an_unmeasured_claim_is_at_most_the_median_claim() -> None:
    assert rules.bound_claim(1e9, [100.0]) == 1e9  # two nodes: nobody can tell who lies
    assert rules.bound_claim(1e9, [100.0, 300.0]) == 300.0  # three: one liar cannot move the median
    assert rules.bound_claim(50.0, [100.0, 300.0]) == 50.0  # a slow claim stands
    assert rules.bound_claim(1e9, []) == 1e9  # alone, it is the only speed there is


@pytest.mark.parametrize("seed", range(20))
def test_capping_every_claim_at_once_is_capping_them_one_by_one(seed: int) -> None:
    """A swarm of a thousand enters with one pass (claims_cap), not a median a node: the same speeds."""
    import random

    rng = random.Random(seed)
    claims = [rng.choice([rng.uniform(1, 100), 1e9, 50.0]) for _ in range(rng.randint(0, 30))]
    one_by_one = list(claims)
    for k in range(len(one_by_one)):
        one_by_one[k] = rules.bound_claim(one_by_one[k], one_by_one[:k] + one_by_one[k + 1 :])
    cap = rules.claims_cap(claims)
    assert [min(c, cap) for c in claims] == one_by_one
    if len(claims) >= 3:
        assert max(one_by_one) <= sorted(claims)[(len(claims) - 1) // 2]  # no liar above the median


def test_tail_stops_slowest_first_while_the_others_would_finish_first() -> None:
    """A node whose next step ends after the others' work in hand and the round's rest stops; the
    others' totals are running sums (a round of a thousand nodes runs this every tick)."""
    speed = {"slow": 1.0, "mid": 10.0, "fast": 100.0, "fast2": 100.0}
    in_hand = {"slow": 8, "mid": 8, "fast": 80, "fast2": 80}
    # others finish 168 samples + 0 remaining at 210/s: 0.8 s; slow's step of 4 takes 4 s -> stops;
    # then mid's step (0.4 s) against 160/200 = 0.8 s -> goes on
    assert rules.tail_stops(list(speed), in_hand, 0, speed, 4) == ["slow"]
    assert rules.tail_stops(list(speed), in_hand, 10_000, speed, 4) == []  # plenty left for everyone
    assert rules.tail_stops(["slow"], {"slow": 8}, 0, {"slow": 1.0}, 4) == []  # one always goes on
    # a node that stopped no longer counts as one of "the others": its samples in hand go back
    speed2 = {"a": 1.0, "b": 1.9, "c": 100.0}
    in_hand2 = {"a": 300, "b": 0, "c": 100}  # b: 2.1 s a step, c alone finishes in 1 s (with a's: ~4 s)
    assert rules.tail_stops(list(speed2), in_hand2, 0, speed2, 4) == ["a", "b"]


def test_strikes_decay() -> None:
    from drift.recipe import Recipe
    from drift.swarm import STRIKE_ROUNDS, Swarm

    s = Swarm(Recipe(name="t", task="x.py", rounds=1, inner_steps=1, batch_size=1))
    s.strike("a", 3)
    assert not s.struck_out("a", 3 + STRIKE_ROUNDS)  # the first one expired
    s.strike("a", 3 + STRIKE_ROUNDS)
    assert s.struck_out("a", 4 + STRIKE_ROUNDS)  # two within the window: dropped
    # Dropped for them, it is refused until the older of the two expired, not let back in to be
    # dropped again at the next strike.
    s.strike("b", 5)
    s.strike("b", 6)
    assert s.back_from("b", 6) == 5 + STRIKE_ROUNDS
    assert s.back_from("b", 5 + STRIKE_ROUNDS) is None
    assert s.back_from("a", 4 + STRIKE_ROUNDS) is None  # one strike: it may come back at once


def test_a_reported_norm_far_outside_the_others_is_an_outlier() -> None:
    norms = {"a": (1.0, 10), "b": (1.2, 10), "c": (0.5, 5), "x": (500.0, 10)}
    assert rules.norm_outliers(norms) == ["x"]
    assert rules.norm_outliers({"a": (1.0, 1), "x": (1e6, 1)}) == []  # two: nobody can tell which


def test_a_member_is_named_an_outlier_only_by_more_than_half_of_the_others() -> None:
    ring = ["a", "b", "c", "d", "e"]
    # e named by a and b: half of the other four. b naming it twice, and e naming itself, add nothing.
    reports = {"a": ["e"], "b": ["e", "e"], "c": [], "d": ["a"], "e": ["e", "a"]}
    assert rules.named_outliers(reports, ring) == []
    assert rules.named_outliers({**reports, "c": ["e"]}, ring) == ["e"]


def test_the_reduced_sum_may_not_exceed_the_reported_norms() -> None:
    import numpy as np

    from drift.diloco import norm_bound, reduced_problem

    rng = np.random.default_rng(0)
    deltas = [rng.standard_normal(1000).astype(np.float32) for _ in range(4)]
    ring = norm_bound([(0.25, float(np.linalg.norm(d))) for d in deltas] + [(0.0, None)])  # (weight 0: no norm)
    assert norm_bound([(0.25, 1.0), (0.75, None)]) is None  # a member with weight and no norm: no check
    honest = sum(0.25 * d for d in deltas)
    assert reduced_problem(honest, ring) is None
    for bad in (
        1000 * deltas[3],
        -10 * deltas[3],
        10 * float(np.linalg.norm(deltas[3])) * deltas[0] / np.linalg.norm(deltas[0]),
    ):
        poisoned = sum(0.25 * d for d in deltas[:3]) + 0.25 * bad
        assert "more than" in reduced_problem(poisoned, ring)
    assert reduced_problem(np.full(1000, np.nan, np.float32), ring) is not None
    assert reduced_problem(np.full(1000, 1e30, np.float32), ring) is not None


def test_a_sign_flip_by_a_fair_share_of_five_is_refused_and_honest_int8_sums_pass() -> None:
    import numpy as np

    from drift.compress import make_codec
    from drift.diloco import norm_bound, reduced_problem

    # The worst case for the bound: every member's Δ alike. A liar at weight 1/5 sends -10 x its Δ
    # while reporting its true norm: the sum is (1 - 11/5)Δ, 1.2 x the bound's Σ w·||Δ||.
    d = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    ring = norm_bound([(0.2, float(np.linalg.norm(d)))] * 5)
    assert "more than" in reduced_problem(4 * 0.2 * d + 0.2 * (-10 * d), ring)
    # The honest sum of the same Δs through an int8 ring (every partial sum re-encoded on its way)
    # stays within the bound.
    codec = make_codec("int8")

    def hop(x: np.ndarray) -> np.ndarray:
        return codec.decode(codec.encode(x).copy(), np.empty_like(x))

    acc = hop(0.2 * d)
    for _ in range(4):
        acc = hop(acc + 0.2 * d)
    assert reduced_problem(hop(acc), ring) is None


def test_a_false_accuser_alone_gets_nobody_caught_however_often_it_cries() -> None:
    # f accuses its left neighbour in every attempt; the ring reverses on every retry, so its left
    # is l, then r, then l again: each honest neighbour has one accuser however many retries, while
    # a real culprit is caught by both its neighbours once the ring has turned.
    suspects: dict[str, set[str]] = {}
    for attempt in range(6):
        suspects.setdefault("l" if attempt % 2 == 0 else "r", set()).add("f")
    assert rules.caught(suspects, ["l", "f", "r", "x"]) == []
    suspects.setdefault("x", set()).update({"l", "r"})
    assert rules.caught(suspects, ["l", "f", "r", "x"]) == ["x"]


def test_a_ring_of_two_commits_redoes_or_finds_the_broken_member() -> None:
    v = rules.pair_verdict
    assert v({"a": "x", "b": "x"}, {}, {}, "g").action == "commit"
    assert v({"a": "x"}, {}, {}, "g").action == "commit"  # b is behind: a's θ stands
    assert v({"a": "x", "b": "y"}, {}, {}, "g").action == "redo"  # the first disagreement: nothing moved
    earlier = {"a": "x", "b": "y"}
    assert v({"a": "x", "b": "x"}, {"a": "g", "b": "g"}, earlier, "g").action == "commit"  # a transient fault
    # Again: the member whose state is not the agreed θ any more is the broken one ...
    d = v({"a": "x", "b": "y"}, {"a": "g", "b": "h"}, earlier, "g")
    assert (d.action, list(d.culprits)) == ("drop", ["b"])
    assert v({"a": "x", "b": "z"}, {"a": "g", "b": ""}, earlier, "g").culprits.keys() == {"b"}  # one that withholds it
    # ... else the one whose step gives another θ each time ...
    d = v({"a": "x", "b": "z"}, {"a": "g", "b": "g"}, earlier, "g")
    assert (d.action, list(d.culprits)) == ("drop", ["b"])
    # ... and when that is both or neither, nobody can tell which θ is right.
    assert v({"a": "x", "b": "y"}, {"a": "g", "b": "g"}, earlier, "g").action == "undecided"
    assert v({"a": "w", "b": "z"}, {"a": "g", "b": "g"}, earlier, "g").action == "undecided"
    assert v({"a": "x", "b": "y"}, {"a": "h", "b": "h"}, earlier, "g").action == "undecided"


# --- who sent different payloads to different members (sync: sparse's all-gather) -------------

RND, EPOCH = 3, 1


def _keys(n: int) -> tuple[list[str], list[nacl.signing.SigningKey]]:
    keys = [nacl.signing.SigningKey.generate() for _ in range(n)]
    return [bytes(k.verify_key).hex() for k in keys], keys


def _heard(
    key: nacl.signing.SigningKey, payload: bytes, rnd: int = RND, epoch: int = EPOCH, level: int = 0
) -> tuple[str, str, str, int]:
    """(sender, digest, sig, level) of a payload as its sender signs it (drift.gather.Gather.header)."""
    owner, digest = bytes(key.verify_key).hex(), hashlib.sha256(payload).digest()
    sig = key.sign(payload_message(owner, rnd, epoch, digest, level)).signature
    return owner, digest.hex(), sig.hex(), level


def _signed(owner: str, digest: str, sig: str, level: int) -> bool:
    return signed_payload(owner, RND, EPOCH, digest, sig, level)


def test_a_member_that_signed_two_payloads_is_proven_and_nobody_else() -> None:
    (x, a, b, c), (kx, ka, kb, kc) = _keys(4)
    ring = [a, x, b, c]
    own = {a: _heard(ka, b"A"), b: _heard(kb, b"B"), c: _heard(kc, b"C")}
    one, other = _heard(kx, b"X"), _heard(kx, b"X, altered")  # x sent c another payload, and signed it
    heard = {
        a: [one, own[b], own[c]],
        b: [own[a], one, own[c]],
        c: [own[a], own[b], other],
        x: [own[a], own[b], own[c]],
    }
    assert rules.equivocation(heard, ring, _signed) == rules.Equivocation([x], [])
    # one reporter is proof enough: nobody but x can sign in x's name
    assert rules.equivocation({c: [one, other]}, ring, _signed).equivocators == [x]
    # the same payload reported by everyone proves nothing
    same = {i: [r for j, r in own.items() if j != i] + [one] for i in (a, b, c)}
    assert rules.equivocation(same, ring, _signed) == rules.Equivocation([], [])


def test_in_a_hierarchy_a_sender_owes_one_payload_a_level_and_two_at_one_level_prove_it() -> None:
    # drift/hierarchy.py: x sends its own payload at level 0 and its block's at level 1, each to
    # several members; different payloads at different levels are what it owes, at one level not.
    (x, a, b, c), (kx, *_) = _keys(4)
    ring = [x, a, b, c]
    own, block = _heard(kx, b"X"), _heard(kx, b"X's block", level=1)
    assert rules.equivocation({a: [own], b: [block], c: [block]}, ring, _signed) == rules.Equivocation([], [])
    other = _heard(kx, b"X's block, altered for c", level=1)
    assert rules.equivocation({a: [own], b: [block], c: [other]}, ring, _signed).equivocators == [x]


def test_a_false_block_payload_is_proven_by_its_block_and_those_it_misled_are_not_blamed() -> None:
    # Two levels above the members' own payloads: blocks {a, b, x} and {c, d, e} gather inside
    # (level 1 sends each block's payload to the other), then the two halves of a larger swarm
    # (level 2: {a, b, x, c, d, e} against others, here only what its members signed). x sends
    # c a false level-1 payload of its block; c computes its level-2 payload from it honestly.
    (a, b, x, c, d, e), keys = _keys(6)
    ka, kb, kx, kc, kd, ke = keys
    ring = [a, b, x, c, d, e]
    block = {**dict.fromkeys([a, b, x], "abx"), **dict.fromkeys([c, d, e], "cde")}

    def blocks(j: str, level: int) -> str:
        return j if level == 0 else block[j] if level == 1 else "all"

    ab_x, false_ab_x, cde = _heard(ka, b"ABX", level=1), _heard(kx, b"ABX, false", level=1), b"CDE"
    heard = {
        c: [
            false_ab_x,
            _heard(kc, b"ALL, from the false one", level=2),
        ],  # c was misled (its own level-2 claim: others hear it)
        d: [ab_x, _heard(kd, b"ALL", level=2)],
        e: [_heard(kb, b"ABX", level=1), _heard(ke, b"ALL", level=2)],
        a: [_heard(kc, cde, level=1), _heard(kx, b"ALL", level=2)],
        b: [_heard(kd, cde, level=1), _heard(kc, b"ALL, from the false one", level=2)],
        x: [_heard(ke, cde, level=1), _heard(ka, b"ALL", level=2)],
    }
    got = rules.equivocation(heard, ring, _signed, blocks)
    assert got == rules.Equivocation([], [], [x])  # a and b signed ABX: x's other digest is false; c is not blamed
    # without a second witness in x's block nobody is proven, and c's claim above is not judged either
    alone = {i: [r for r in reports if r[0] != b] for i, reports in heard.items()}
    assert rules.equivocation(alone, ring, _signed, blocks) == rules.Equivocation([], [], [])


def test_a_report_its_owner_did_not_sign_is_a_false_accusation_not_proof() -> None:
    (x, a, b), (kx, ka, _) = _keys(3)
    ring = [x, a, b]
    honest = _heard(ka, b"A")
    lies = [
        (a, hashlib.sha256(b"A, as b says").hexdigest(), honest[2], 0),  # a's signature, other bytes
        _heard(ka, b"A before", rnd=RND - 1),  # a signed it, for the round before
        _heard(ka, b"A before", epoch=EPOCH - 1),  # ... or for the attempt before
        (*_heard(ka, b"A's block", level=1)[:3], 0),  # ... or for another level of the hierarchy
        (a, *_heard(kx, b"A, as b says")[1:]),  # signed with another key
        (a, "zz", "00", 0),  # garbage
    ]
    for lie in lies:
        got = rules.equivocation({x: [honest], b: [lie, _heard(kx, b"X")]}, ring, _signed)
        assert got == rules.Equivocation([], [b]), lie  # nobody frames a; b gets the strike


def test_reports_on_oneself_or_a_non_member_are_ignored_and_each_report_is_checked_once() -> None:
    (x, a, b, stranger), (kx, ka, kb, ks) = _keys(4)
    checks: list[tuple[str, str, str, int]] = []

    def counted(owner: str, digest: str, sig: str, level: int) -> bool:
        checks.append((owner, digest, sig, level))
        return _signed(owner, digest, sig, level)

    ring = [x, a, b]
    one = _heard(kx, b"X")
    heard = {
        a: [one, (a, "00" * 32, "00" * 64, 0), _heard(ks, b"S"), (stranger, "00" * 32, "00" * 64, 0)],
        b: [one, _heard(kb, b"B, other"), _heard(ka, b"A")],
    }
    assert rules.equivocation(heard, ring, counted) == rules.Equivocation([], [])
    assert sorted(checks) == sorted([one, _heard(ka, b"A")])


def test_the_theta_kept_after_an_equivocation_is_the_most_held_then_the_first_in_ring_order() -> None:
    assert rules.kept({"a": "p", "b": "q", "c": "p"}, ["b", "a", "c"]) == "p"
    assert rules.kept({"a": "p", "b": "q"}, ["b", "a"]) == "q"
    assert rules.kept({"a": "p", "b": "q"}, ["a", "b"]) == "p"
    assert rules.kept({"a": "p"}, ["x", "a"]) == "p"


def test_a_node_may_hold_two_units_or_what_our_clock_measured_it_trains_in_a_quarter_second() -> None:
    assert rules.ask_allowance(16, None) == 32  # unmeasured (its own word counts for nothing)
    assert rules.ask_allowance(16, 40.0) == 32  # slow: two units
    assert rules.ask_allowance(16, 4000.0) == int(4000 * rules.AHEAD_S)  # units shorter than a round trip
    assert rules.ask_allowance(16, float("inf")) == 32 and rules.ask_allowance(16, float("nan")) == 32


def test_a_grant_is_the_units_our_clock_measured_a_node_trains_in_grant_s_within_an_even_share_of_whats_left() -> None:
    fast = 16 * 10 / rules.GRANT_S  # ten units of 16 samples in GRANT_S
    assert rules.grant_units(16, fast, 100_000, 4) == 10
    assert rules.grant_units(16, None, 100_000, 4) == 1  # unmeasured (its own word counts for nothing)
    assert rules.grant_units(16, 40.0, 100_000, 4) == 1  # a unit takes longer than GRANT_S
    assert rules.grant_units(16, fast * 1.05, 100_000, 4) == 10  # whole units, never more than GRANT_S
    assert rules.grant_units(16, fast, 16 * 12, 4) == 3  # the round's end: an even share of what is left
    assert rules.grant_units(16, fast, 16, 4) == 1  # (at least one)
    assert rules.grant_units(16, float("inf"), 100_000, 4) == 1 and rules.grant_units(16, float("nan"), 100_000, 4) == 1


def test_a_failed_ring_is_decided_early_only_once_a_member_reported_the_failure() -> None:
    ring = ["a", "b", "c"]

    def heard(done, failed, caught=(), evidence=False, waited=0.1, expired=False):
        return rules.failure_heard(ring, set(done), set(failed), set(caught), evidence, waited, 5.0, expired)

    assert heard("ab", "c")  # all heard
    assert not heard("a", "c")  # b not yet
    assert heard("a", "c", caught="b")  # b caught
    # a member left (nobody reported a failure): the others' RoundDones settle it, not this rule
    assert not rules.failure_heard(["a", "b"], {"a", "b"}, set(), set(), True, 0.1, 5.0, False)
    assert rules.failure_heard(["a", "b"], set(), set(), set(), True, 6.0, 5.0, False)
    # past the grace, a lone report is one member's word: the others' reports (or the deadline) decide
    assert not heard("", "c", waited=60.0)
    assert heard("", "c", waited=60.0, expired=True)
    assert heard("", "bc", waited=6.0) and not heard("", "bc", waited=4.0)  # most of the ring
    assert heard("", "c", evidence=True, waited=6.0)  # and a member left, or one is proven to forge
    assert heard("", "c", caught="b", waited=6.0)


def test_a_run_that_ends_writes_the_checkpoint_it_skipped_while_saving_unless_a_save_failed() -> None:
    # The case of test_run_dir's slow holder: 3 rounds, a checkpoint due each; rounds 1 and 2
    # settled while round 0's save was being written (skipped 2), round 0's is the last written.
    assert rules.checkpoint_owed(skipped=2, newest=2, last=0, failed=False) == 2
    assert rules.checkpoint_owed(skipped=1, newest=2, last=None, failed=False) == 2  # round 0's θ could not be fetched
    assert rules.checkpoint_owed(skipped=None, newest=2, last=1, failed=False) is None  # none skipped (2 was not due)
    assert rules.checkpoint_owed(skipped=1, newest=2, last=2, failed=False) is None  # a later save wrote it
    assert rules.checkpoint_owed(skipped=2, newest=2, last=0, failed=True) is None  # a full disk, or Ctrl-C
    assert rules.checkpoint_owed(skipped=0, newest=-1, last=None, failed=False) is None  # no round agreed


def test_a_checkpoint_whose_holders_moved_on_is_taken_of_the_newest_round_a_bounded_number_of_times() -> None:
    assert rules.checkpoint_instead(failed_round=2, newest=3, tries=1, failed=False) == 3  # asked after round 3's step
    assert rules.checkpoint_instead(failed_round=3, newest=5, tries=2, failed=False) == 5  # moved on again
    assert rules.checkpoint_instead(failed_round=5, newest=6, tries=rules.CHECKPOINT_TRIES, failed=False) is None
    assert rules.checkpoint_instead(failed_round=2, newest=2, tries=1, failed=False) is None  # no holder had it at all
    assert rules.checkpoint_instead(failed_round=2, newest=3, tries=1, failed=True) is None  # a full disk, or Ctrl-C


def test_only_a_grid_failure_most_report_and_nobody_is_named_for_moves_the_swarm_to_the_flat_ring() -> None:
    assert rules.flat_from_now(True, [], [], ["a", "b"], 3)  # a grid, most failed, nobody caught, proven or gone
    assert not rules.flat_from_now(False, [], [], ["a", "b"], 3)  # the flat ring's timeouts name whom they waited for
    assert not rules.flat_from_now(True, ["x"], [], ["a", "b"], 3)  # caught or proven: it sits out, the grid goes on
    assert not rules.flat_from_now(True, [], {"y"}, ["a", "b"], 3)  # a member left during it: that is why it failed
    assert not rules.flat_from_now(True, [], [], ["a"], 3)  # one member's word: the attempt is only redone
    assert [rules.flat_rounds(k) for k in (1, 2, 3)] == [2, 4, 8]  # longer each time, never for good


def test_a_nodes_last_reports_ride_on_its_barrier_report_only_when_that_does_not_make_it_look_slower() -> None:
    assert rules.reports_ride(barrier_s=0.001, unreported_s=1.0, waits=False)  # Δ in 0.1 % of what its last units took
    assert not rules.reports_ride(
        barrier_s=0.5, unreported_s=10.0, waits=False
    )  # 5 %: a 1B model's Δ beside short units
    assert not rules.reports_ride(barrier_s=None, unreported_s=1.0, waits=False)  # its first round: Δ's time unknown
    assert not rules.reports_ride(
        barrier_s=0.001, unreported_s=1.0, waits=True
    )  # overlapped: the round in flight first
