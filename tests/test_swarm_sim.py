"""Simulations of staggered devices: real `drift join` processes with speed factors.

Each test asserts the accounting (every sample trained exactly once), that replicas agree (the
coordinator refuses to go on otherwise, so a completed run proves it), and that fast nodes were not
left idle at a barrier for longer than about one inner step of the slowest trainer."""

from __future__ import annotations

from pathlib import Path


from conftest import check_exactly_once, make_task_repo
from drift.simulate import Swarm

BATCH = 8
SIM = dict(task_config={"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}, batch_size=BATCH,
           unit_steps=2, eval_batches=2, stale_after_s=4.0, heartbeat_s=0.5)


def _step_s(events: list[dict], node_id: str) -> float:
    """The slowest inner step this node was seen to take."""
    sps = [e["samples_per_s"] for e in events if e["event"] == "progress" and e["node_id"] == node_id]
    return BATCH / min(sps)


def _check_idle(events: list[dict], slack_s: float = 0.75) -> None:
    for r in [e for e in events if e["event"] == "round"]:
        trainers = {k: v for k, v in r["nodes"].items() if v["weight"] > 0}
        slowest = max(_step_s(events, v["node_id"]) for v in trainers.values())
        for name, v in trainers.items():
            assert v["idle_s"] <= slowest + slack_s, (r["round"], name, v["idle_s"], slowest)


def test_mixed_speeds(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=3, rounds=3, inner_steps=12, **SIM)
    swarm = Swarm(recipe, tmp_path)
    for speed in ("0.5", "0.2", "0.1"):
        swarm.join(speed)
    assert swarm.finish() == 0, swarm.log()
    events = swarm.events()
    check_exactly_once(events, 2 * BATCH)
    _check_idle(events)
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 3
    # Shares follow speed (5x apart): over the run the fastest node trained clearly more.
    total = {n: sum(r["nodes"].get(n, {"samples": 0})["samples"] for r in rounds) for n in ("n0", "n2")}
    assert total["n0"] > 2 * total["n2"], [r["nodes"] for r in rounds]


def test_node_that_slows_down_gets_less_work(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=5, inner_steps=10, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.5")
    swarm.join("0.5,0.5,0.05")          # 10x slower from round 2 on (a laptop that got hot)
    assert swarm.finish() == 0, swarm.log()
    events = swarm.events()
    check_exactly_once(events, 2 * BATCH)
    rounds = [e for e in events if e["event"] == "round"]
    # (once slow it may even be made an evaluator: then it trains nothing, which is less work too)
    share = [r["nodes"].get("n1", {"samples": 0})["samples"] / max(1, r["samples"]) for r in rounds]
    assert share[0] > 0.3 and share[-1] < 0.2, share
    _check_idle(events[:], slack_s=1.0)


def test_node_dies_mid_round(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=3, rounds=4, inner_steps=20, **SIM)
    swarm = Swarm(recipe, tmp_path)
    victim = None
    for speed in ("0.5", "0.5", "0.5"):
        p = swarm.join(speed)
        victim = victim or p
    joined = swarm.wait_event(lambda e: e["event"] == "node_joined" and e["name"] == "n0")
    swarm.wait_event(lambda e: e["event"] == "progress" and e["round"] == 1 and e["node_id"] == joined["node_id"])
    swarm.kill(victim)                                   # kill -9 in the middle of round 1
    assert swarm.finish() == 0, swarm.log()
    events = swarm.events()
    left = [e for e in events if e["event"] == "node_left"]
    assert left and left[0]["name"] == "n0" and left[0]["round"] == 1
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 4 and "n0" not in rounds[1]["nodes"]
    check_exactly_once(events, 2 * BATCH)             # its units of round 1 were redone, none twice


def test_stuck_node_work_is_reassigned(tmp_path: Path) -> None:
    """A node that suddenly takes forever: its unit is reassigned after a deadline, with a log line."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=3, inner_steps=10, unit_deadline_factor=3.0,
                            **{**SIM, "stale_after_s": 30.0})
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.5")
    swarm.join("0.5,0.002")            # from round 1, one inner step takes ~500x longer
    assert swarm.finish(timeout=400) == 0, swarm.log()
    events = swarm.events()
    assert any(e["event"] == "deadline" for e in events), [e["event"] for e in events]
    assert "its units are reassigned" in swarm.log()
    check_exactly_once(events, 2 * BATCH)


def test_late_joiner_fetches_state_and_trains(tmp_path: Path) -> None:
    # Slow rounds (~1 s), many of them: the late process needs a few seconds to start.
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=40, inner_steps=6, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.05")
    swarm.join("0.05")
    swarm.wait_event(lambda e: e["event"] == "round" and e["round"] == 1)
    swarm.join("0.05", name="late")
    assert swarm.finish() == 0, swarm.log()
    events = swarm.events()
    entered = next(e for e in events if e["event"] == "node_entered")
    assert entered["name"] == "late" and entered["round"] >= 2
    rounds = [e for e in events if e["event"] == "round"]
    # It trained from the round it entered, and the checksums kept agreeing (else no round event).
    assert all(r["nodes"]["late"]["samples"] > 0 for r in rounds[entered["round"]:])
    check_exactly_once(events, 2 * BATCH)


def test_very_slow_node_evaluates_instead_of_training(tmp_path: Path) -> None:
    """A node ~100x slower than the other would hold every barrier for one of its steps: it
    reports the validation loss instead, at its own pace, and the fast node never waits for it."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=6, inner_steps=30, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.5")
    swarm.join("0.005", name="slow")
    assert swarm.finish() == 0, swarm.log()
    events = swarm.events()
    rounds = [e for e in events if e["event"] == "round"]
    assert all(r["evaluators"] == ["slow"] and list(r["nodes"]) == ["n0"] for r in rounds), rounds
    assert all(r["nodes"]["n0"]["idle_s"] < 0.5 for r in rounds)
    vals = [e for e in events if e["event"] in ("initial", "val")]
    assert vals and vals[0]["event"] == "initial"          # the evaluator's first job: θ0
    assert any(e["event"] == "val" for e in vals)           # then the newest θ, fetched from n0
    check_exactly_once(events, 2 * BATCH)


def test_node_dies_during_the_all_reduce(tmp_path: Path) -> None:
    """kill -9 a ring member while the swarm reduces: the survivors retry without it, weights
    renormalised, and no sample is lost or counted twice."""
    big = {**SIM, "task_config": {"block_size": 32, "n_layer": 4, "n_head": 4, "n_embd": 256}}
    recipe = make_task_repo(tmp_path / "repo", min_nodes=3, rounds=3, inner_steps=4, **big)
    swarm = Swarm(recipe, tmp_path)
    victim = swarm.join("1")
    swarm.join("1")
    swarm.join("1")
    swarm.wait_event(lambda e: e["event"] == "barrier" and e["round"] == 1, timeout=300)
    swarm.kill(victim)
    assert swarm.finish() == 0, swarm.log()
    events = swarm.events()
    retry = [e for e in events if e["event"] == "ring_retry"]
    assert retry and retry[0]["round"] == 1 and retry[0]["nodes"] == 2, [e for e in events if e["event"] != "progress"]
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 3 and sorted(rounds[1]["nodes"]) == ["n1", "n2"]
    assert abs(sum(n["weight"] for n in rounds[1]["nodes"].values()) - 1) < 1e-6
    check_exactly_once(events, 2 * BATCH)
