"""The overlapped sync rule (`sync: overlapped`): nodes train round r+1 while round r's all-reduce
runs, and the outer step lands a round late. θ_global must stay bit-identical on every node (a
round event is only written once all ring members reported the same checksum), every sample is
trained exactly once, and retries, late joins, evaluators and checkpoints keep working."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SIM as CONF_SIM
from conftest import SIM_BATCH as BATCH
from conftest import WRAPPERS, check_exactly_once, make_task_repo

from drift.diloco import ParamLayout
from drift.protocol import RingMember
from drift.recipe import Recipe
from drift.sync import catch_up, make_rule
from harness.simulate import Swarm

SIM = {**CONF_SIM, "sync": "overlapped"}


def test_catch_up_keeps_the_progress_made_since_the_barrier() -> None:
    """In numbers: the local copy moves by exactly what θ_global moved relative to the snapshot
    taken at the barrier, so the next pseudo-gradient is just the progress made since."""
    layout = ParamLayout(("w",), ((1000,),))
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(1000).astype(np.float32)
    local_at_barrier = theta - np.float32(0.01) * rng.standard_normal(1000).astype(np.float32)
    progress = np.float32(0.001) * rng.standard_normal(1000).astype(np.float32)
    base = {"name": "x", "task": "t.py", "rounds": 1, "inner_steps": 1, "batch_size": 1}
    blocking = make_rule(layout, Recipe.model_validate({**base, "sync": "blocking"}))
    overlapped = make_rule(layout, Recipe.model_validate({**base, "sync": "overlapped"}))
    t_block, t_over = theta.copy(), theta.copy()
    for rule, t in ((blocking, t_block), (overlapped, t_over)):  # the same reduced Δ on both
        ring = [RingMember(node_id="0" * 64, ticket="t", weight=1.0)]
        assert rule.combine(rule.contribute(theta - local_at_barrier, 1.0, 0), ring).problem is None
        rule.apply(t)
    assert np.array_equal(t_block, t_over)  # the outer step itself is DiLoCo's
    snap = local_at_barrier.copy()
    catch_up(t_over, snap)
    local_now = local_at_barrier + progress  # trained on while the reduce ran
    local_now += snap
    np.testing.assert_allclose(t_over - local_now, -progress, atol=1e-6)  # next Δ: the progress only


@pytest.mark.swarm
def test_overlapped_swarm_trains_with_a_late_joiner_a_retry_and_a_checkpoint(tmp_path: Path) -> None:
    """Three nodes; one stops itself in round 2's all-reduce and is killed (the survivors retry
    while the next round already trains); a fourth joins late (it catches up on the round in
    flight); checkpoints are written while rounds go on."""
    # 24 rounds of ~0.5 s: the late node's load (checkout, worker, calibration: 3-5 s on a busy
    # 2-core machine) ends well before the run does.
    n = 24
    recipe = make_task_repo(tmp_path / "repo", min_nodes=3, rounds=n, inner_steps=6, checkpoint_every=3, **SIM)
    swarm = Swarm(recipe, tmp_path)
    victim = swarm.join("0.05", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "stop-in-allreduce:2"})
    swarm.join("0.05")
    swarm.join("0.05")
    go = tmp_path / "go"
    late = swarm.join("0.05", name="late", script=WRAPPERS / "held_node.py", env={"DRIFT_TEST_GO": str(go)})
    from test_swarm_sim import _wait_stopped

    _wait_stopped(victim)
    swarm.kill(victim)
    swarm.wait_event(lambda e: e["event"] == "round" and e["round"] == 3)
    go.touch()
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [-9, 0, 0, 0], swarm.node_logs()  # the victim was killed
    events = swarm.events()
    rounds = [e for e in events if e["event"] == "round"]
    assert [r["round"] for r in rounds] == list(range(n))
    assert len({r["checksum"] for r in rounds}) == n  # θ moved every round, agreed every round
    retry = [e for e in events if e["event"] == "ring_retry"]
    assert retry and retry[0]["round"] == 2
    entered = next(e for e in events if e["event"] == "node_entered")
    assert entered["name"] == "late"
    assert any(r["nodes"].get("late", {"samples": 0})["samples"] > 0 for r in rounds[entered["round"] + 1 :])
    # One checkpoint each 3 rounds, the last round's among them. A checkpoint due may be of a later
    # round: round 2's is asked for once its retry settles, and the survivors may have applied
    # round 3 by then (rules.checkpoint_instead).
    saved, due = [e["round"] for e in events if e["event"] == "checkpoint"], [*range(2, n, 3)]
    assert len(saved) == len(due) and all(d <= s < d + 3 for s, d in zip(saved, due)), saved
    assert saved[-1] == n - 1
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    assert rounds[-1]["val_loss"] < initial
    check_exactly_once(events, 2 * BATCH)
    assert late.wait(timeout=60) == 0


@pytest.mark.swarm
def test_overlapped_evaluator_and_slow_node(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=6, inner_steps=20, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.02")
    swarm.join("1", name="slow")  # 50x slower: it evaluates instead of training
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [0, 0], swarm.node_logs()
    events = swarm.events()
    rounds = [e for e in events if e["event"] == "round"]
    assert all(r["evaluators"] == ["slow"] and list(r["nodes"]) == ["n0"] for r in rounds), rounds
    assert any(e["event"] == "val" for e in events)
    # it leaves with the final θ: a job its donor had moved past is followed by a fresh one (before,
    # "no more work" for that round left it idle to the end, and the run waited 60 s for it)
    assert next(e for e in events if e["event"] == "complete")["behind"] == []
    check_exactly_once(events, 2 * BATCH)
