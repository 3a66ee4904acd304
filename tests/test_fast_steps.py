"""Fast devices: inner steps of a few milliseconds (a small model on a GPU). Grants, StopRound and
progress reports then cross each other all the time; no honest node may ever be flagged, and every
sample must be trained exactly once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import check_exactly_once, drift_cmd

from harness.simulate import make_task_repo

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)

TASK = Path(__file__).parent / "tasks" / "points_mlp.py"
BATCH, UNIT_STEPS = 16, 2


def test_millisecond_steps_never_flag_an_honest_node(tmp_path: Path) -> None:
    recipe = make_task_repo(
        tmp_path / "repo",
        {
            "name": "points",
            "task_config": {"hidden": 32},
            "min_nodes": 2,
            "rounds": 25,
            "inner_steps": 60,
            "batch_size": BATCH,
            "unit_steps": UNIT_STEPS,
            "eval_batches": 2,
            "inner_optimizer": {"lr": 0.01},
            "codec": "fp32",
        },
        task=TASK,
    )
    run = tmp_path / "run"
    out = subprocess.run(
        drift_cmd("coord", str(recipe), "--local", "2", "--run-dir", str(run)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    flagged = [e for e in events if e["event"] in ("bad_report", "deadline", "sat_out", "node_left", "diverged")]
    assert not flagged, flagged
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 25
    for r in rounds:  # weights are exactly the shares of samples trained (a node may get none)
        assert all(abs(n["weight"] - n["samples"] / r["samples"]) < 1e-9 for n in r["nodes"].values()), r["nodes"]
    assert check_exactly_once(events, BATCH * UNIT_STEPS) == sum(r["samples"] for r in rounds) + sum(
        hi - lo for _, _, lo, hi in next(e for e in events if e["event"] == "complete")["pending"]
    )
    steps = [e["samples_per_s"] for e in events if e["event"] == "progress"]
    assert len(steps) > 100  # units really crossed the wire many times per round
    # Each unit a node trains is one job on its training thread and one report: the progress
    # events of a round are exactly the pieces of units its nodes trained, each once, in steps of
    # one batch. (How fast such steps are, alone and two at once, is benchmarks/bench_local_swarm.py's.)
    for r in rounds:
        for n in r["nodes"].values():
            reported = sorted(
                e["unit"]
                for e in events
                if e["event"] == "progress" and e["round"] == r["round"] and e["node_id"] == n["node_id"]
            )
            assert reported == sorted(n["trained"]), (r["round"], reported, n["trained"])
            assert n["steps"] == sum(-(-(hi - lo) // BATCH) for _, _, lo, hi in n["trained"]), n
    per_node = {
        name: sum(r["nodes"][name]["step_s"] for r in rounds if name in r["nodes"])
        / max(1, sum(r["nodes"][name]["steps"] for r in rounds if name in r["nodes"]))
        for name in {n for r in rounds for n in r["nodes"]}
    }
    print("seconds per inner step:", per_node)
