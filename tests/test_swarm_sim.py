"""Simulations of staggered devices: real `drift join` processes with simulated step times
(tests/wrappers/sim_node.py, $DRIFT_SIM_STEP: absolute, so a simulation means the same on any machine).

Each test asserts the accounting (every sample trained exactly once), that replicas agree (the
coordinator refuses to go on otherwise, so a completed run proves it), and that nobody trained on
while others waited at the barrier (_check_idle)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from conftest import SIM, WRAPPERS, check_exactly_once, make_task_repo
from conftest import SIM_BATCH as BATCH

from drift.recipe import load_recipe
from harness.simulate import Swarm

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)


def _check_idle(events: list[dict]) -> None:
    """Nobody trains on while others wait at the barrier: once told StopRound (the round's budget
    handed out, or the tail rule), every trainer reports at most the unit it had in flight, cut at
    its next inner step (tests/test_inner.py), and one whose report crossed StopRound on the wire,
    never the units granted ahead; and rounds were cut at all (all but the last, which trains its
    whole budget)."""
    rounds = [e for e in events if e["event"] == "round"]
    for r in rounds[:-1]:
        for name, v in r["nodes"].items():
            assert v["units_after_stop"] <= 2, (r["round"], name, v)
    assert any(v["units_after_stop"] for r in rounds[:-1] for v in r["nodes"].values()), "no round was cut"


def _check_dropped_not_waited_for(swarm: Swarm, name: str) -> None:
    """A killed node is dropped with a line, never waited for: not by the rounds, nor for the
    final θ at the end."""
    assert re.search(rf"node {name} \(\w+\) dropped: ", swarm.log()), swarm.log()
    assert "evaluation(s) still running" not in swarm.log(), swarm.log()


def test_shares_follow_each_nodes_speed_as_it_changes(tmp_path: Path) -> None:
    """Three devices 5x apart, one of which gets 10x slower from round 2 on (a laptop that got
    hot): each round's shares follow the speeds measured, and the run trains its whole budget."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=3, rounds=5, inner_steps=10, **SIM)
    swarm = Swarm(recipe, tmp_path)
    for step_s in ("0.04", "0.04,0.04,0.4", "0.2"):  # (well above a step's compute on a loaded 2-core machine)
        swarm.join(step_s)
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [0, 0, 0], swarm.node_logs()
    events = swarm.events()
    check_exactly_once(events, 2 * BATCH)
    _check_idle(events)
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 5
    # The run trains its whole budget: what a round's cut left is trained later, the last round
    # is not cut (5 rounds × 3 nodes × 10 steps × 8 samples).
    assert sum(r["samples"] for r in rounds) >= 5 * 3 * 10 * BATCH, [r["samples"] for r in rounds]
    assert next(e for e in events if e["event"] == "complete")["pending"] == []
    # Shares follow speed (5x apart): over the run the fastest node trained clearly more.
    total = {n: sum(r["nodes"].get(n, {"samples": 0})["samples"] for r in rounds) for n in ("n0", "n2")}
    assert total["n0"] > 2 * total["n2"], [r["nodes"] for r in rounds]
    # n1 is as fast as n0, then the slowest (once slow it may even evaluate: less work too)
    share = [r["nodes"].get("n1", {"samples": 0})["samples"] / max(1, r["samples"]) for r in rounds]
    assert share[0] > 0.3 and max(share[2:]) < 0.2, share


def test_node_dies_mid_round(tmp_path: Path) -> None:
    """kill -9 a node in the middle of round 1 (it stops itself right after its first finished
    unit there): its units are redone by the others, none twice, and the swarm goes on."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=3, rounds=4, inner_steps=20, **SIM)
    swarm = Swarm(recipe, tmp_path)
    victim = swarm.join("0.02", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "stop-after-progress:1"})
    swarm.join("0.02")
    swarm.join("0.02")
    _wait_stopped(victim)
    swarm.kill(victim)
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [-9, 0, 0], swarm.node_logs()  # the victim was killed
    _check_dropped_not_waited_for(swarm, "n0")
    events = swarm.events()
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 4 and rounds[0]["nodes"]["n0"]["weight"] > 0
    assert all(r["nodes"].get("n0", {"weight": 0})["weight"] == 0 for r in rounds[1:])
    check_exactly_once(events, 2 * BATCH)  # its units of round 1 were redone, none twice


def test_a_node_late_at_the_barrier_is_not_waited_for_and_its_work_reaches_theta_a_round_later(
    tmp_path: Path,
) -> None:
    """n3's BarrierSync of round 1 comes 1.5 s late (heartbeating on). Once the quorum (three of
    four equal nodes) has synced, the round goes on without it after a moment, not at its deadline;
    what it trained in round 1 is neither redone nor lost: its Δ, kept at the staleness scale on
    top of the new θ, reaches θ in round 2 (the last round: never cut), where its report counts
    those units beside its own."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=4, rounds=3, inner_steps=30, quorum=0.7, **SIM)
    swarm = Swarm(recipe, tmp_path)
    for _ in range(3):
        swarm.join("0.05")
    swarm.join("0.05", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "late-sync:1"})
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [0, 0, 0, 0], swarm.node_logs()
    events = swarm.events()
    late = [(e["name"], e["round"]) for e in events if e["event"] == "late"]
    assert ("n3", 1) in late and ("n3", 2) not in late, late  # (another may be late on a loaded machine)
    assert not [e for e in events if e["event"] in ("diverged", "disagreed", "bad_report")]
    rounds = [e for e in events if e["event"] == "round"]
    n3 = rounds[0]["nodes"]["n3"]["node_id"]
    mine = {tuple(e["unit"]) for e in events if e["event"] == "progress" and e["node_id"] == n3 and e["round"] == 1}
    assert mine and rounds[1]["nodes"].get("n3", {"weight": 0})["weight"] == 0
    merged = {tuple(u) for u in rounds[2]["nodes"]["n3"]["trained"]}
    assert mine <= merged and rounds[2]["nodes"]["n3"]["weight"] > 0, (mine, merged)
    check_exactly_once(events, 2 * BATCH)  # its round-1 units counted once, in round 2
    assert "(late: 71% of its Δ rides into round 3)" in (tmp_path / "n3.log").read_text()  # (its rounds count from 1)


def test_node_that_suddenly_becomes_very_slow_sits_out_then_evaluates(tmp_path: Path) -> None:
    """From round 1 one inner step of n1 takes 3 s, 150x longer than before: the swarm cuts it at
    the deadline (its units go to n0, it sits the round out, not dropped), and from then on its
    measured speed makes it an evaluator, so no later round waits for one of its steps."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=6, inner_steps=10, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.02")
    slow = swarm.join("0.02,3")  # (a unit of 2 steps: 6 s, past its deadline of 4 x ~0.2 s + 1 s)
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [0, 0], swarm.node_logs()
    events = swarm.events()
    deadline = [e for e in events if e["event"] == "deadline"]
    assert [(e["name"], e["round"]) for e in deadline] == [("n1", 1)], deadline
    assert any(e["event"] == "sat_out" and e["name"] == "n1" and e["round"] == 1 for e in events)
    assert not any(e["event"] == "node_left" for e in events)
    rounds = [e for e in events if e["event"] == "round"]
    assert "n1" in rounds[0]["nodes"] and rounds[0]["nodes"]["n1"]["weight"] > 0
    assert rounds[1]["nodes"].get("n1", {"weight": 0})["weight"] == 0
    assert all(r["evaluators"] == ["n1"] and list(r["nodes"]) == ["n0"] for r in rounds[2:]), rounds[2:]
    assert "its units are reassigned" in swarm.log()
    check_exactly_once(events, 2 * BATCH)
    assert slow.wait(timeout=60) == 0, (tmp_path / "n1.log").read_text()


def test_late_joiner_fetches_state_and_trains(tmp_path: Path) -> None:
    """A node that joins a running swarm fetches θ, trains from the next round, and trains at the
    same learning rate as everyone (the schedule follows the swarm's samples, not a node's steps)."""
    schedule = {"warmup_samples": 750, "min_lr": 0.001}  # (warmup ~8 of 20 rounds of 96 samples, then decay)
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=20, inner_steps=6, lr_schedule=schedule, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.05")
    swarm.join("0.05")
    go = tmp_path / "go"  # the late node starts now, but connects only once this file exists
    late = swarm.join("0.05", name="late", script=WRAPPERS / "held_node.py", env={"DRIFT_TEST_GO": str(go)})
    swarm.wait_event(lambda e: e["event"] == "round" and e["round"] == 1)
    go.touch()
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [0, 0, 0], swarm.node_logs()
    events = swarm.events()
    entered = next(e for e in events if e["event"] == "node_entered")
    assert entered["name"] == "late" and entered["round"] >= 2
    rounds = [e for e in events if e["event"] == "round"]
    # It trained from the round it entered, and the checksums kept agreeing (else no round event).
    assert all(r["nodes"]["late"]["samples"] > 0 for r in rounds[entered["round"] :])
    check_exactly_once(events, 2 * BATCH)
    assert late.wait(timeout=60) == 0, (tmp_path / "late.log").read_text()
    lrs = [{n["lr"] for n in r["nodes"].values()} for r in rounds]
    assert all(len(x) == 1 for x in lrs), lrs  # one rate per round, the late node's too
    lrs = [x.pop() for x in lrs]
    r = load_recipe(recipe)
    done = 0
    for rnd, lr in zip(rounds, lrs):  # the schedule of the swarm's samples
        assert lr == r.round_lr(done), (rnd["round"], lr)
        done += rnd["samples"]
    assert lrs[0] < lrs[2] and lrs[-1] < max(lrs)  # warmup, then decay


def test_very_slow_node_evaluates_instead_of_training(tmp_path: Path) -> None:
    """A node ~50x slower than the other would hold every barrier for one of its steps: it
    reports the validation loss instead, at its own pace, and the fast node never waits for it."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=6, inner_steps=12, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.02")
    swarm.join("1", name="slow")  # 50x slower: one step is longer than a whole round (24 of the other's steps)
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [0, 0], swarm.node_logs()
    events = swarm.events()
    rounds = [e for e in events if e["event"] == "round"]
    assert all(r["evaluators"] == ["slow"] and list(r["nodes"]) == ["n0"] for r in rounds), rounds
    vals = [e for e in events if e["event"] in ("initial", "val")]
    assert vals and vals[0]["event"] == "initial"  # the evaluator's first job: θ0
    assert any(e["event"] == "val" for e in vals)  # then the newest θ, fetched from n0
    # and it leaves with the final θ, as the node that trained the last round does
    assert next(e for e in events if e["event"] == "complete")["behind"] == []
    check_exactly_once(events, 2 * BATCH)


def test_node_dies_during_the_all_reduce(tmp_path: Path) -> None:
    """kill -9 a ring member in the middle of the all-reduce (it stops itself as it is about to send
    its first chunk of round 1, so the reduce cannot finish without it): the survivors retry
    without it, weights renormalised, and no sample is lost or counted twice."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=3, rounds=3, inner_steps=4, **SIM)
    swarm = Swarm(recipe, tmp_path)
    victim = swarm.join("0.02", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "stop-in-allreduce:1"})
    swarm.join("0.02")
    swarm.join("0.02")
    _wait_stopped(victim)
    swarm.kill(victim)
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [-9, 0, 0], swarm.node_logs()  # the victim was killed
    _check_dropped_not_waited_for(swarm, "n0")
    events = swarm.events()
    retry = [e for e in events if e["event"] == "ring_retry"]
    assert retry and retry[0]["round"] == 1 and retry[0]["nodes"] == 2, [e for e in events if e["event"] != "progress"]
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 3 and sorted(rounds[1]["nodes"]) == ["n1", "n2"]
    assert abs(sum(n["weight"] for n in rounds[1]["nodes"].values()) - 1) < 1e-6
    check_exactly_once(events, 2 * BATCH)


@pytest.mark.parametrize("sync", ["blocking", "overlapped"])
def test_a_node_whose_own_attempt_was_redone_without_it_keeps_the_work_it_did_since(tmp_path: Path, sync: str) -> None:
    """Two of three nodes report round 2's all-reduce failed after it finished, so the third
    alone applied that attempt; the coordinator redoes it without the third, which trained on
    meanwhile (overlapped: it synced round 3 already). It takes round 2's agreed θ without losing
    that work and reduces round 3 with the others (before, overlapped: it dropped round 3's sync
    and the swarm waited 150 s for it)."""
    n = 4
    recipe = make_task_repo(tmp_path / "repo", min_nodes=3, rounds=n, inner_steps=6, sync=sync, **SIM)
    swarm = Swarm(recipe, tmp_path)
    for _ in range(2):
        swarm.join("0.05", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "deny-ring:2"})
    swarm.join("0.05", name="honest")
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [0, 0, 0], swarm.node_logs()
    events = swarm.events()
    sat_out = [(e["name"], e["round"], e["reason"]) for e in events if e["event"] == "sat_out"]
    assert sat_out == [("honest", 2, "retry")], swarm.log()
    assert not [e for e in events if e["event"] in ("deadline", "diverged", "disagreed", "round_abandoned")]
    rounds = [e for e in events if e["event"] == "round"]
    assert [r["round"] for r in rounds] == list(range(n))
    assert rounds[2]["nodes"]["honest"]["weight"] == 0  # its attempt was not the round's
    assert all(r["nodes"]["honest"]["weight"] > 0 for r in rounds[3:])  # and it trains on with the swarm
    check_exactly_once(events, 2 * BATCH)


def test_a_retry_that_comes_while_a_node_reports_its_failure_is_not_lost(tmp_path: Path) -> None:
    """A network blip breaks round 1's all-reduce on one node, and its report of it is slow to
    leave: the coordinator's retry reaches that node while it is still reporting, and it must
    take part (seen in CI: the retry was dropped and the others waited out the ring's 120 s)."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=3, inner_steps=4, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.02", name="blip", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "blip-in-allreduce:1"})
    swarm.join("0.02", name="steady")
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [0, 0], swarm.node_logs()
    events = swarm.events()
    retries = [(e["round"], e["nodes"]) for e in events if e["event"] == "ring_retry"]
    assert retries == [(1, 2)], swarm.log()  # one retry, both in it, and it worked
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 3 and sorted(rounds[1]["nodes"]) == ["blip", "steady"]
    check_exactly_once(events, 2 * BATCH)


def _wait_stopped(p, timeout: float = 300) -> None:
    """Until process p is stopped (SIGSTOP): a state to wait for, polled, so no moment is missed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if psutil.Process(p.pid).status() == psutil.STATUS_STOPPED:
            return
        assert p.poll() is None, "the node exited before it reached the all-reduce"
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    raise AssertionError("the node never stopped in the all-reduce")


def test_node_admitted_in_the_last_round_leaves_with_the_run_complete(tmp_path: Path) -> None:
    """A node that joins while the last round runs is admitted but never trains: it is still told
    the run is complete, says so, and exits 0 (not 'coordinator closed the connection')."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=2, inner_steps=16, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.02,0.25")  # round 0 in a moment; the last round lasts 16 steps of 0.25 s
    swarm.join("0.02,0.25")
    go = tmp_path / "go"
    late = swarm.join("0.02", name="late", script=WRAPPERS / "held_node.py", env={"DRIFT_TEST_GO": str(go)})
    swarm.wait_event(lambda e: e["event"] == "round" and e["round"] == 0)
    go.touch()  # the last round (1) has just started (it lasts 16 steps of 0.25 s)
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [0, 0, 0], swarm.node_logs()
    assert late.wait(timeout=60) == 0, (tmp_path / "late.log").read_text()
    assert "run complete: 2 rounds" in (tmp_path / "late.log").read_text()
    rounds = [e for e in swarm.events() if e["event"] == "round"]
    assert all("late" not in r["nodes"] for r in rounds)


def test_node_that_sleeps_and_wakes_rejoins_by_itself(tmp_path: Path) -> None:
    """A laptop that sleeps: the node is stopped (SIGSTOP) for longer than stale_after_s, so the
    swarm drops it; when it wakes (SIGCONT) it reconnects with the same identity, is verified
    again, fetches θ and trains again, and exits 0 when the run completes."""
    # (it is back by round ~8 when idle: 24 rounds leave it 16 or more to rejoin in on a loaded machine)
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=24, inner_steps=6, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.05")
    sleeper = swarm.join("0.05", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "stop-after-progress:2"})
    _wait_stopped(sleeper)
    left = swarm.wait_event(lambda e: e["event"] == "node_left" and e["name"] == "n1")
    assert "silent" in left["reason"]
    sleeper.send_signal(signal.SIGCONT)  # it wakes up
    back = swarm.wait_event(lambda e: e["event"] == "node_entered" and e["name"] == "n1")
    assert swarm.finish() == 0, swarm.log()
    assert swarm.node_exits() == [0, 0], swarm.node_logs()
    assert sleeper.wait(timeout=60) == 0, (tmp_path / "n1.log").read_text()
    log = (tmp_path / "n1.log").read_text()
    assert "rejoining" in log and "run complete" in log, log
    events = swarm.events()
    rounds = [e for e in events if e["event"] == "round"]
    assert any(r["nodes"].get("n1", {"samples": 0})["samples"] > 0 for r in rounds[back["round"] :])
    check_exactly_once(events, 2 * BATCH)
