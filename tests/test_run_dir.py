"""The run directory fails under the coordinator (a full disk, a path it cannot write), or was
left torn by kill -9: the run ends in one line keeping the newest checkpoint, and a resumed run
appends whole lines only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import SIM, WRAPPERS, drift_cmd, make_task_repo

from drift.checkpoint import latest_checkpoint
from drift.monitor import Monitor, read_events
from harness.simulate import Swarm


def _coord(recipe: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        drift_cmd("coord", str(recipe), "--local", "1", "--run-dir", str(run_dir), *args),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.swarm
def test_the_last_rounds_checkpoint_is_written_when_rounds_are_shorter_than_a_save(tmp_path: Path) -> None:
    # Each checkpoint is due every round, and each save takes seconds (the only holder of θ serves
    # every piece 1 s late): the rounds after round 0 end while its save is still being written.
    # Before, their checkpoints were skipped and the run ended with round 0's as its newest.
    recipe = make_task_repo(tmp_path / "repo", min_nodes=1, rounds=3, checkpoint_every=1, **SIM)
    swarm = Swarm(recipe, tmp_path)
    swarm.join("0.02", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "slow-serve:0"})
    assert swarm.finish() == 0, swarm.log()
    saved = [e["round"] for e in swarm.events() if e["event"] == "checkpoint"]
    assert saved[0] == 0 and saved[-1] == 2, saved
    assert "still being written: none for round" in swarm.log()  # (rounds 1 and 2 ended during round 0's save)
    ckpt, _ = latest_checkpoint(swarm.run_dir / "checkpoints")
    assert ckpt is not None and ckpt.round == 2


@pytest.mark.swarm
def test_a_checkpoint_asked_for_after_its_holders_moved_on_is_written_of_the_newest_round(tmp_path: Path) -> None:
    # The coordinator asks for round 1's checkpoint only once round 2 is agreed (a busy one, or a
    # round settled late after a retry): the nodes hold round 2's θ by then. Before, the
    # checkpoint due was skipped ("have round 2"), and the run went 4 rounds without one.
    repo = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=6, checkpoint_every=2, **SIM).parents[1]
    coord = [sys.executable, str(WRAPPERS / "late_checkpoint_coord.py"), "coord"]  # (`drift coord`, asking late)
    out = subprocess.run(
        [*coord, "recipes/tiny.yaml", "--local", "2", "--run-dir", "run"],  # as typed in the task's repo
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    saved = [e["round"] for e in read_events(repo / "run") if e["event"] == "checkpoint"]
    # Round 1's comes as round 2's (it was skipped: [3, 5]); round 3's is written or, when round 3
    # settles while that save is still being written, skipped (the test above).
    assert saved[0] == 2 and saved[-1] == 5, (saved, out.stderr)
    assert "checkpointing round 2 in place of round 1" in out.stderr, out.stderr
    ckpt, _ = latest_checkpoint(repo / "run" / "checkpoints")
    assert ckpt is not None and ckpt.round == 5


@pytest.mark.swarm
def test_a_full_disk_ends_the_run_in_one_line_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=1, rounds=2, checkpoint_every=1, **SIM)
    run_dir = tmp_path / "run"
    first = _coord(recipe, run_dir)
    assert first.returncode == 0, first.stderr
    ckpt, _ = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and ckpt.round == 1
    # More rounds, resumed with metrics.jsonl on a disk that is full.
    data = yaml.safe_load(recipe.read_text())
    recipe.write_text(yaml.safe_dump({**data, "rounds": 4}))
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").symlink_to("/dev/full")
    out = _coord(recipe, run_dir, "--resume")
    assert out.returncode != 0 and "Traceback" not in out.stderr + out.stdout, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("drift: error: ")]
    assert len(errors) == 1, out.stderr
    assert f"cannot write {run_dir / 'metrics.jsonl'}: No space left on device" in errors[0]
    assert f"--resume continues from round 1 ({ckpt.path})" in errors[0]
    kept, _ = latest_checkpoint(run_dir / "checkpoints")
    assert kept is not None and kept.round == 1  # nothing half-written replaced it


@pytest.mark.swarm
def test_a_run_dir_that_cannot_be_written_is_one_line(tmp_path: Path, tiny_recipe: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory\n")
    out = subprocess.run(
        drift_cmd("coord", str(tiny_recipe), "--run-dir", str(blocker / "run")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"drift: error: cannot write {blocker / 'run'}"), out.stderr


def test_a_torn_last_line_is_cut_before_a_resumed_run_appends(tmp_path: Path) -> None:
    """kill -9 mid-write leaves half a line; the resumed coordinator's first event must not be
    glued to it (that made the line, and `drift report`, unreadable)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    whole = json.dumps({"t": 1.0, "event": "initial", "val_loss": 4.0})
    (run_dir / "metrics.jsonl").write_text(whole + "\n" + '{"t": 2.0, "event": "rou')
    monitor = Monitor(run_dir, live=False)
    monitor.event("resumed", round=0)
    monitor.close()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["initial", "resumed"]


@pytest.mark.swarm
@pytest.mark.root  # a mount namespace of its own
@pytest.mark.swarm
def test_a_checkpoint_dir_that_turns_read_only_mid_run_ends_in_one_line_and_keeps_the_checkpoint(
    tmp_path: Path,
) -> None:
    """The disk under the checkpoints goes read-only between rounds (a failing disk, a remount):
    the coordinator, in a mount namespace of its own, sees that directory remounted read-only."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=1, rounds=40, checkpoint_every=1, **SIM)
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True)
    inner = " ".join(drift_cmd("coord", str(recipe), "--local", "1", "--run-dir", str(run_dir)))
    coord = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", f"mount --bind {ckpts} {ckpts} && exec {inner}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        while (ckpt := latest_checkpoint(ckpts)[0]) is None or ckpt.round < 1:
            assert coord.poll() is None, coord.communicate()
            time.sleep(0.1)
        # (a remount is refused while a checkpoint file is open for writing: try again)
        remount = ["nsenter", "-t", str(coord.pid), "-m", "mount", "-o", "remount,bind,ro", str(ckpts)]
        while subprocess.run(remount, capture_output=True).returncode != 0:
            assert coord.poll() is None, coord.communicate()
            time.sleep(0.05)
        out, err = coord.communicate(timeout=120)
    finally:
        coord.kill()
    assert coord.returncode != 0 and "Traceback" not in out + err, err
    errors = [line for line in err.splitlines() if line.startswith("drift: error: ")]
    assert len(errors) == 1, err
    assert "Read-only file system" in errors[0], errors
    kept, _ = latest_checkpoint(ckpts)
    assert kept is not None and kept.round >= ckpt.round  # the newest whole checkpoint stays
    assert f"--resume continues from round {kept.round}" in errors[0], errors
