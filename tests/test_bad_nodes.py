"""One bad node never ends everyone's run: an admitted node whose Δ goes NaN, that sends NaN or
malformed chunks into the ring, that lies about its work, or whose θ disagrees with the others',
is excluded (its work redone) and the swarm goes on; replicas stay bit-identical and finite.
The misbehaving node is a real `drift join` with one fault injected (tests/wrappers/fault_node.py)."""

from __future__ import annotations

import math
from pathlib import Path

from conftest import SIM as CONF_SIM
from conftest import SIM_BATCH as BATCH
from conftest import WRAPPERS, check_exactly_once, make_task_repo

from drift.simulate import Swarm

SIM = {**CONF_SIM, "inner_steps": 6, "codec": "fp32"}


def _run(tmp_path: Path, fault: str, nodes: int = 2, rounds: int = 4) -> tuple[Swarm, list[dict]]:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=nodes, rounds=rounds, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.02", name="bad", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": fault})
    for i in range(nodes - 1):
        swarm.join("0.02", name=f"good{i}")
    assert swarm.finish() == 0, swarm.log()
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


def test_node_whose_theta_diverges_sits_out_and_the_majority_goes_on(tmp_path: Path) -> None:
    _, events = _run(tmp_path, "diverge:1", nodes=3)
    div = [e for e in events if e["event"] == "diverged"]
    assert [(e["round"]) for e in div] == [1]
    assert any(e["event"] == "ring_retry" and e["round"] == 1 for e in events)
    assert _weight(events, 1, "bad") == 0 and _weight(events, 2, "bad") > 0  # θ refetched, trains again
