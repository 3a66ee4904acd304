"""Rounds that close at a quorum, in virtual time: drift's own Round over simulated nodes
(benchmarks/harness/rounds.py, as bench_goodput.py runs it), with an all-reduce that takes
seconds. A round that closes at its quorum goes on without a node that went silent or slow, merges
a late node's work into its next round rather than losing it, and keeps more of the swarm's compute
than rounds that wait for every member."""

from __future__ import annotations

import random

from drift.recipe import Recipe
from harness.rounds import Failures, RunStats, VirtualSwarm

FAILING = Failures(
    lost=0.02, slowed=0.05, slowdown=3.0
)  # each round: 2 % of the nodes go silent, 5 % train at a third of their speed


def _run(quorum: float, failures: Failures, nodes: int = 32, rounds: int = 5) -> RunStats:
    rng = random.Random(0)
    recipe = Recipe(
        name="goodput",
        task="x.py",
        rounds=rounds,
        min_nodes=nodes,
        inner_steps=25,
        batch_size=8,
        unit_steps=5,
        quorum=quorum,
    )
    speeds = [16 * rng.lognormvariate(0, 0.3) for _ in range(nodes)]
    return VirtualSwarm(recipe, speeds, failures, seed=0, sync_s=1.0).run(rounds)


def test_a_round_that_closes_at_its_quorum_keeps_more_of_a_failing_swarms_compute_and_merges_late_work() -> None:
    waited, closed = _run(1.0, FAILING), _run(0.9, FAILING)
    assert waited.lost > 0 and waited.merged == 0  # every round waited for its members (a silent one: until dropped)
    assert closed.merged > 0  # the quorum went on without some; their samples reached θ a round later
    assert closed.goodput > waited.goodput + 0.1


def test_with_no_failures_the_quorum_cuts_nobody() -> None:
    st = _run(0.9, Failures())
    assert st.cut == 0 and st.merged == 0 and st.abandoned == 0
    assert st.goodput > 0.8
