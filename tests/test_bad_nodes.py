"""One bad node never ends everyone's run: an admitted node whose Δ goes NaN, that sends NaN or
malformed chunks into the ring, that lies about its work, or whose θ disagrees with the others',
is excluded (its work redone) and the swarm goes on; replicas stay bit-identical and finite.
The misbehaving node is a real `drift join` with one fault injected (tests/wrappers/fault_node.py)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
from conftest import SIM as CONF_SIM
from conftest import SIM_BATCH as BATCH
from conftest import WRAPPERS, check_exactly_once, make_task_repo

from harness.simulate import Swarm

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)

# quorum 1: rounds wait for every node (one cut as late under load would never bring its fault to the round checked)
SIM = {**CONF_SIM, "inner_steps": 6, "codec": "fp32", "quorum": 1.0}


def _run(
    tmp_path: Path, fault: str, nodes: int = 2, rounds: int = 4, told: bool = False, bad_step_s: str = "0.02"
) -> tuple[Swarm, list[dict]]:
    """`told`: the bad node is told it is out, so it leaves by itself (wait for it too)."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=nodes, rounds=rounds, **SIM)
    swarm = Swarm(recipe, tmp_path)
    bad = swarm.join(bad_step_s, name="bad", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": fault})
    good = [swarm.join("0.02", name=f"good{i}") for i in range(nodes - 1)]
    assert swarm.finish(leave=[bad, *good] if told else good) == 0, swarm.log()
    assert swarm.node_exits()[1:] == [0] * (nodes - 1), swarm.node_logs()  # the good ones
    events = swarm.events()
    rounds_ = [e for e in events if e["event"] == "round"]
    assert len(rounds_) == rounds and all(math.isfinite(r["val_loss"] or 0.0) for r in rounds_)
    assert math.isfinite(next(e for e in events if e["event"] == "complete")["final_val_loss"])
    check_exactly_once(events, 2 * BATCH)
    return swarm, events


def _weight(events: list[dict], rnd: int, name: str) -> float:
    r = next(e for e in events if e["event"] == "round" and e["round"] == rnd)
    return r["nodes"].get(name, {"weight": 0.0})["weight"]


def test_nan_delta_is_reported_not_sent(tmp_path: Path) -> None:
    _, events = _run(tmp_path, "nan-params:1")
    bad = [e for e in events if e["event"] == "bad_delta"]
    assert [e["round"] for e in bad] == [1] and "NaN" in bad[0]["reason"]
    assert _weight(events, 1, "bad") == 0 and _weight(events, 2, "bad") > 0  # it trains again next round


def test_nan_sent_into_the_ring_gets_its_sender_excluded(tmp_path: Path) -> None:
    _, events = _run(tmp_path, "nan-ring:1", nodes=3)
    out = [e for e in events if e["event"] == "sat_out"]
    assert [(e["name"], e["round"], e["reason"]) for e in out] == [("bad", 1, "ring")], out
    assert any(e["event"] == "ring_retry" and e["round"] == 1 for e in events)
    assert _weight(events, 1, "bad") == 0 and _weight(events, 2, "bad") > 0


def test_malformed_ring_chunks_get_their_sender_excluded(tmp_path: Path) -> None:
    _, events = _run(tmp_path, "short-chunks:2", nodes=3)
    out = [e for e in events if e["event"] == "sat_out"]
    assert [(e["name"], e["round"], e["reason"]) for e in out] == [("bad", 2, "ring")], out


def test_lying_work_report_is_excluded_and_its_work_redone(tmp_path: Path) -> None:
    _, events = _run(tmp_path, "lie-report:1")
    bad = [e for e in events if e["event"] == "bad_report"]
    assert [e["round"] for e in bad] == [1] and "twice" in bad[0]["reason"]
    assert _weight(events, 1, "bad") == 0


def test_node_whose_theta_diverges_takes_the_majoritys_and_the_round_stands(tmp_path: Path) -> None:
    # Before, the round was retried although the majority had applied its step: each of them sat
    # the retry out in turn, and the last one redid the step alone on a θ that had already moved.
    _, events = _run(tmp_path, "diverge:1", nodes=3)
    div = [e for e in events if e["event"] == "diverged"]
    assert [(e["round"]) for e in div] == [1]
    assert not [e for e in events if e["event"] in ("ring_retry", "sat_out") and e["round"] == 1]
    r1 = next(e for e in events if e["event"] == "round" and e["round"] == 1)
    assert all(r1["nodes"][n]["bytes_sent"] > 0 for n in ("good0", "good1")), r1["nodes"]  # they reduced it
    assert all(r1["nodes"][n]["weight"] > 0 for n in ("good0", "good1", "bad")), r1["nodes"]  # every Δ is in θ
    assert _weight(events, 2, "bad") > 0  # θ refetched, it trains again


def test_node_that_stops_reading_is_dropped_with_a_line_and_the_run_goes_on(tmp_path: Path) -> None:
    # It stops reading its control stream (QUIC STOP_SENDING): every send to it fails. Before, the
    # first broadcast to it (BarrierReady) ended the coordinator: "sending a frame header failed".
    _, events = _run(tmp_path, "stop-reading:1", nodes=3)
    left = [e for e in events if e["event"] == "node_left" and e["name"] == "bad"]
    # Dropped at the coordinator's first send that meets the stop: BarrierReady of round 1, or (when
    # that write beat the node's STOP_SENDING to the coordinator and went into its read in flight)
    # the next frame to it, round 1's Agreed; not by its silence, and its work counts nowhere after.
    assert left and "failed" in left[0]["reason"] and left[0]["round"] in (1, 2), left
    assert _weight(events, 2, "bad") == _weight(events, 3, "bad") == 0


def test_node_that_never_reports_theta_is_not_waited_for_and_is_dropped_the_second_time(tmp_path: Path) -> None:
    # It does its part of the all-reduce, then never sends RoundDone while heartbeating: before,
    # the round never settled (0 rounds in 60 s).
    swarm, events = _run(tmp_path, "withhold-done:1", nodes=3, rounds=8)  # (rounds to try to rejoin in)
    late = [(e["round"], e["name"]) for e in events if e["event"] == "deadline" and e.get("phase") == "reduce"]
    assert late[:2] == [(1, "bad"), (2, "bad")], late
    left = [e for e in events if e["event"] == "node_left" and e["name"] == "bad"]
    assert left and left[0]["round"] == 2 and "again" in left[0]["reason"], left
    # Struck out, it is refused until a strike expires, not let back in to hold up another round.
    assert [e["name"] for e in events if e["event"] == "node_joined"].count("bad") == 1, events
    assert "it may rejoin from round 11" in (tmp_path / "bad.log").read_text(), swarm.node_logs()


def test_one_node_with_another_task_among_the_first_is_refused_and_the_run_goes_on(tmp_path: Path) -> None:
    # Before, one such node among the first min_nodes cancelled everyone.
    recipe = make_task_repo(tmp_path / "repo", min_nodes=3, rounds=2, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.02", name="bad", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "other-task:0"})
    for i in range(2):
        swarm.join("0.02", name=f"good{i}")
    assert swarm.finish() == 0, swarm.log()
    events = swarm.events()
    assert next(e["reason"] for e in events if e["event"] == "node_refused").startswith("this node loaded a different")
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 2 and all("bad" not in r["nodes"] for r in rounds)


def test_node_claiming_a_billion_samples_per_second_gets_its_real_share(tmp_path: Path) -> None:
    # Speeds are the coordinator's own clock (grant to progress), not the node's word. Before, the
    # liar's claim made every honest node an evaluator, every round, and the ring was [liar, 1.0].
    _, events = _run(tmp_path, "claim-fast:0", nodes=3, rounds=3)
    # From the first round on: before anyone is measured, a claim is bounded by the others'.
    for r in [e for e in events if e["event"] == "round"]:
        assert r["evaluators"] == [], r
        rnd = r["round"]
        assert _weight(events, rnd, "bad") < 0.6, r["nodes"]
        # every honest node trains; once measured (round 1 on), at least half its fair share of a
        # third (a loaded machine can start one late in round 0)
        least = 1 / 6 if rnd >= 1 else 0.0
        assert _weight(events, rnd, "good0") > least and _weight(events, rnd, "good1") > least, r["nodes"]


def test_only_the_node_asked_for_it_sets_a_rounds_val_loss(tmp_path: Path) -> None:
    # Slower than the others, so it is never the node asked (the fastest), and its lie is told.
    _, events = _run(tmp_path, "val-every-round:0", nodes=3, rounds=3, bad_step_s="0.04")
    assert all(e["val_loss"] != 1e6 for e in events if e["event"] == "round")
    assert "RoundDone with a val loss nobody asked for" in (tmp_path / "bad.log").read_text()  # the lie was told


def test_an_evaluation_answered_as_of_the_initial_theta_does_not_overwrite_it(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=4, **{**SIM, "inner_steps": 12})
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.02")
    swarm.join("1", name="slow", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "eval-initial:0"})
    assert swarm.finish() == 0, swarm.log()
    events = swarm.events()
    assert any(r["evaluators"] == ["slow"] for r in events if r["event"] == "round")
    assert len([e for e in events if e["event"] == "initial"]) == 1, [e for e in events if e["event"] == "initial"]


@pytest.mark.parametrize("attack", ["flip-ring"])  # (x1000 and noise: the same wiring; tests/test_rules.py)
def test_poisoned_contribution_is_refused_before_theta_moves_and_its_sender_found(tmp_path: Path, attack: str) -> None:
    # 3 honest nodes + 1 that sends -10 x its Δ while reporting its true norm, the attack nearest
    # the bound (x1000 and noise of 10 x are refused by the same check: tests/test_rules.py).
    # Before, the run ended "fine" with val loss ~51,795 (x1000) and nobody noticed.
    recipe = make_task_repo(tmp_path / "repo", min_nodes=4, rounds=4, **SIM)
    swarm = Swarm(recipe, tmp_path)
    # Equal speeds: its fair share is 1/4. A sign-flipped x10 makes the sum (1 - 11w)Δ at worst,
    # refused by the norm bound for w > (2 + diloco.NORM_SLACK)/11 = 0.186.
    swarm.join("0.02", name="bad", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": f"{attack}:1"})
    for i in range(3):
        swarm.join("0.02", name=f"good{i}")
    assert swarm.finish() == 0, swarm.log()
    events = swarm.events()
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    vals = [e["val_loss"] for e in events if e["event"] == "round" and e["val_loss"] is not None]
    assert len(vals) >= 2 and max(vals) < initial, (initial, vals)  # θ was never poisoned
    assert any(e["event"] == "poisoned" for e in events)
    found = {e["name"] for e in events if e["event"] == "poisoner"}
    assert found == {"bad"}, found  # and no honest node was ever blamed
    named = min(e["round"] for e in events if e["event"] == "poisoner")
    # By halves: log2(4) = 2 retries a round at most (before, one left alone in a retry was never
    # named, and the round was given up after 6 attempts).
    retries = Counter(e["round"] for e in events if e["event"] == "ring_retry")
    assert max(retries.values()) <= 2, retries
    later = [e for e in events if e["event"] == "round" and e["round"] > named]
    assert all(r["nodes"].get("bad", {"weight": 0.0})["weight"] == 0 for r in later)  # out for the run
    assert all(e["name"] == "bad" for e in events if e["event"] == "node_left")
    check_exactly_once(events, 2 * BATCH)
    # It was told, and left (before, it kept rejoining until it was killed).
    assert swarm.node_exits()[0] not in (None, -9) and "excluded from this run" in (tmp_path / "bad.log").read_text()


def test_node_that_tampers_what_it_forwards_is_proven_and_excluded_not_its_neighbour(tmp_path: Path) -> None:
    # It alters the bytes of another node's segment it forwards in the all-gather. Before, its right
    # neighbour alone ended with another θ, sat out as the checksum minority and was struck (dropped
    # at the second), while the attacker kept 0 strikes. Now its right neighbour refuses the chunk
    # (the owner did not sign it) before θ moves, with the attacker's own signature as proof.
    swarm, events = _run(tmp_path, "tamper-forward:1", nodes=3, told=True)
    found = [(e["name"], e["round"], e["reason"]) for e in events if e["event"] == "poisoner"]
    assert found == [("bad", 1, "forged")], found
    assert not [e for e in events if e["event"] in ("diverged", "false_accusation")]
    assert all(e["name"] == "bad" for e in events if e["event"] == "node_left")
    # An honest node may sit a round out for being slow (a loaded CI machine: `deadline`, `late`, the
    # slow-node rule), never for what the tamperer did.
    assert all(e["name"] == "bad" or e["reason"] in ("deadline", "late") for e in events if e["event"] == "sat_out")
    assert all(_weight(events, r, "bad") == 0 for r in (2, 3))  # out for the run
    assert swarm.node_exits()[0] not in (None, -9) and "excluded from this run" in (tmp_path / "bad.log").read_text()


# A ring of two has no majority: its members announce θ before applying the outer step, and a
# disagreement is redone (nothing was applied) rather than ending the run.


def test_two_nodes_that_disagree_once_redo_the_round_and_both_go_on(tmp_path: Path) -> None:
    _, events = _run(tmp_path, "announce-wrong:1")
    dis = [(e["round"], e["verdict"]) for e in events if e["event"] == "disagreed"]
    assert dis == [(1, "redo")], dis
    assert any(e["event"] == "ring_retry" and e["round"] == 1 for e in events)
    assert not [e for e in events if e["event"] in ("diverged", "sat_out", "node_left")]
    assert _weight(events, 1, "bad") > 0 and _weight(events, 1, "good0") > 0  # both nodes' work counts


def test_of_two_nodes_the_one_whose_state_changed_is_dropped_and_the_other_goes_on(tmp_path: Path) -> None:
    _, events = _run(tmp_path, "corrupt-theta:1")
    dis = [(e["round"], e["verdict"]) for e in events if e["event"] == "disagreed"]
    assert dis == [(1, "redo"), (1, "drop")], dis
    out = [(e["name"], e["reason"]) for e in events if e["event"] == "sat_out"]
    assert out == [("bad", "diverged")], out
    left = [e for e in events if e["event"] == "node_left"]
    assert [e["name"] for e in left][:1] == ["bad"] and "agreed θ" in left[0]["reason"], left
    assert _weight(events, 1, "bad") == 0 and _weight(events, 1, "good0") == 1.0


def test_of_two_nodes_the_one_that_applies_another_step_than_it_announced_is_dropped_a_round_later(
    tmp_path: Path,
) -> None:
    # Its θ after round 1 is not the θ it announced (and reported): round 2's step starts from it.
    _, events = _run(tmp_path, "diverge:1")
    dis = [(e["round"], e["verdict"]) for e in events if e["event"] == "disagreed"]
    assert dis == [(2, "redo"), (2, "drop")], dis
    left = [e for e in events if e["event"] == "node_left"]
    assert [e["name"] for e in left][:1] == ["bad"] and "agreed θ" in left[0]["reason"], left
    assert _weight(events, 2, "bad") == 0 and _weight(events, 3, "good0") == 1.0
