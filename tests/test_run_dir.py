"""The run directory fails under the coordinator (a full disk, a path it cannot write), or was
left torn by kill -9: the run ends in one line keeping the newest checkpoint, and a resumed run
appends whole lines only."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml
from conftest import SIM, drift_cmd, make_task_repo

from drift.checkpoint import latest_checkpoint
from drift.monitor import Monitor


def _coord(recipe: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        drift_cmd("coord", str(recipe), "--local", "1", "--run-dir", str(run_dir), *args),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


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
