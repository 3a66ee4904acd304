"""Chaos: the coordinator is killed or stopped, checkpoints get corrupted, and the run still
finishes, losing at most the rounds since the last checkpoint and training no sample twice.
(Node deaths mid-round and mid-all-reduce are in test_swarm_sim.py.)"""

from __future__ import annotations

import signal
from pathlib import Path

from conftest import check_exactly_once, make_task_repo
from drift.simulate import Swarm

BATCH = 8
SIM = dict(task_config={"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}, batch_size=BATCH,
           unit_steps=2, eval_batches=2, stale_after_s=4.0, heartbeat_s=0.5, inner_steps=6)


def _after_resume(events: list[dict]) -> list[dict]:
    """The events that count: the first run's up to the checkpoint it resumed from, then the second's."""
    i = max(k for k, e in enumerate(events) if e["event"] == "resumed")
    kept = events[i]["round"]
    return [e for e in events[:i] if e["event"] != "round" or e["round"] <= kept] + events[i:]


def test_coordinator_killed_then_resumed(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=6, checkpoint_every=1, **SIM)
    first = Swarm(recipe, tmp_path)
    nodes = [first.join("0.5"), first.join("0.5")]
    first.wait_event(lambda e: e["event"] == "checkpoint" and e["round"] == 2)
    first.kill(first.coord)                                   # kill -9, mid-run
    for p in nodes:
        first.kill(p)
    last_done = max(e["round"] for e in first.events() if e["event"] == "round")

    second = Swarm(recipe, tmp_path, "--resume", log_name="coord2.log")
    second.join("0.5")
    second.join("0.5")
    assert second.finish() == 0, second.log()
    events = second.events()
    resumed = next(e for e in events if e["event"] == "resumed")
    assert resumed["round"] >= 2 and "resuming:   after round" in second.log()
    assert last_done - resumed["round"] <= 1                  # at most the round in flight was lost
    rounds = [e["round"] for e in events[events.index(resumed):] if e["event"] == "round"]
    assert rounds == list(range(resumed["round"] + 1, 6))
    check_exactly_once(_after_resume(events), 2 * BATCH)


def test_ctrl_c_checkpoints_and_a_corrupt_checkpoint_is_skipped(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=40, checkpoint_every=1, **SIM)
    first = Swarm(recipe, tmp_path)
    nodes = [first.join("0.5"), first.join("0.5")]
    first.wait_event(lambda e: e["event"] == "round" and e["round"] == 2)
    assert first.kill(first.coord, signal.SIGINT) == 130, first.log()  # Ctrl-C: a clean stop
    assert "interrupted: checkpoint" in first.log()
    for p in nodes:                                           # the nodes were told, and left
        assert p.wait(timeout=60) != 0
    assert "coordinator was stopped" in (tmp_path / "n0.log").read_text()
    ckpts = sorted((first.run_dir / "checkpoints").glob("round-*"))
    newest = ckpts[-1]
    data = bytearray((newest / "theta.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF                              # one flipped byte
    (newest / "theta.safetensors").write_bytes(bytes(data))

    second = Swarm(recipe, tmp_path, "--resume", log_name="coord2.log")
    second.join("0.5")
    second.join("0.5")
    second.wait_event(lambda e: e["event"] == "resumed")
    assert "warning" in second.log() and newest.name in second.log()
    resumed = next(e for e in second.events() if e["event"] == "resumed")
    assert resumed["path"] == str(ckpts[-2])                  # the newest one that verifies
    second.kill(second.coord, signal.SIGINT)
    second.finish()
