"""The trainers people already use, each joining a two-node swarm as recipes/trainers/ shows: a
Hugging Face Trainer (drift.hf.DriftCallback), a Lightning Trainer (drift.lightning.DriftCallback)
and an accelerate loop over `DataLoader(batch_sampler=swarm.batches())`. Each script is committed
into a fresh git repo as written, run as two processes against a real `drift coord`; the two
replicas' final weights must be bit-identical and the swarm's validation loss must fall."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, git

pytestmark = pytest.mark.swarm

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
EXAMPLES = ROOT / "recipes" / "trainers"


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "project"
    shutil.copytree(EXAMPLES, repo / "recipes" / "trainers", ignore=shutil.ignore_patterns("__pycache__"))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "trainers")
    return repo


def _coord(tmp_path: Path, repo: Path, recipe: str) -> tuple[subprocess.Popen, str]:
    with open(tmp_path / "coord.log", "w") as log:
        coord = subprocess.Popen(
            [sys.executable, "-m", "drift", "coord", f"recipes/trainers/{recipe}", "--run-dir", str(tmp_path / "run")],
            cwd=repo,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**ENV, "DRIFT_HOME": str(tmp_path / "coord-home")},
        )
    deadline = time.monotonic() + 60
    while not (m := re.search(r"--ticket (\S+)", (tmp_path / "coord.log").read_text())):
        if time.monotonic() > deadline or coord.poll() is not None:
            coord.kill()
            raise AssertionError((tmp_path / "coord.log").read_text())
        time.sleep(0.1)
    return coord, m.group(1)


def _swarm(tmp_path: Path, recipe: str, script: str, outs: list[Path]) -> list[dict]:
    """Two nodes run `script TICKET OUT`; the coordinator's events once all three exited 0."""
    repo = _repo(tmp_path)
    coord, ticket = _coord(tmp_path, repo, recipe)
    nodes = []
    try:
        for i, out in enumerate(outs):
            nodes.append(
                subprocess.Popen(
                    [sys.executable, f"recipes/trainers/{script}", ticket, str(out)],
                    cwd=repo,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**ENV, "DRIFT_HOME": str(tmp_path / f"home-{i}")},  # each node its own key
                )
            )
        logs = [n.communicate(timeout=280)[0] for n in nodes]
        assert coord.wait(timeout=60) == 0, (tmp_path / "coord.log").read_text()
    finally:
        for p in [coord, *nodes]:
            if p.poll() is None:
                p.kill()
    for n, log in zip(nodes, logs):
        assert n.returncode == 0, log
        assert "run complete: 3 rounds" in log, log
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Two nodes on one machine, both named after it: the swarm tells them apart ("vm", "vm-2").
    names = [e["name"] for e in events if e["event"] == "node_joined"]
    assert len(names) == len(set(names)) == 2 and names[1] == f"{names[0]}-2", names
    return events


def _trained_together(events: list[dict], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:  # the replicas agree bit for bit: both hold the swarm's θ after the last round
        assert torch.equal(a[name], b[name]), name
    rounds = [e for e in events if e["event"] == "round"]
    assert [e["round"] for e in rounds] == [0, 1, 2]
    assert all(e["samples"] > 0 for e in rounds)
    # trained, and the swarm's θ got better: the last val loss is below the first one the run
    # reported (θ's initial one; under heavy load the coordinator may get round 0's first)
    vals = [e["val_loss"] for e in events if e["event"] in ("initial", "round") and e.get("val_loss") is not None]
    assert rounds[-1]["val_loss"] is not None and len(vals) >= 2 and vals[-1] < vals[0], vals


def _added_lines(script: str) -> list[str]:
    text = (EXAMPLES / script).read_text().splitlines()
    return [ln for ln in text if ln.rstrip().endswith("# drift") or "# drift (" in ln]


def test_hugging_face_trainer_joins_a_swarm_with_a_callback(tmp_path: Path) -> None:
    assert 1 <= len(_added_lines("hf_trainer.py")) <= 6
    outs = [tmp_path / "out-0", tmp_path / "out-1"]
    events = _swarm(tmp_path, "hf.yaml", "hf_trainer.py", outs)
    a, b = (load_file(str(o / "model.safetensors")) for o in outs)
    _trained_together(events, a, b)


def test_lightning_trainer_joins_a_swarm_with_a_callback(tmp_path: Path) -> None:
    assert 1 <= len(_added_lines("lightning_trainer.py")) <= 6
    outs = [tmp_path / "theta-0.pt", tmp_path / "theta-1.pt"]
    events = _swarm(tmp_path, "lightning.yaml", "lightning_trainer.py", outs)
    _trained_together(events, *(torch.load(o) for o in outs))


def test_accelerate_loop_joins_a_swarm_through_the_batch_sampler(tmp_path: Path) -> None:
    assert 1 <= len(_added_lines("accelerate_loop.py")) <= 6
    outs = [tmp_path / "theta-0.pt", tmp_path / "theta-1.pt"]
    events = _swarm(tmp_path, "accelerate.yaml", "accelerate_loop.py", outs)
    _trained_together(events, *(torch.load(o) for o in outs))
    # swarm.log: each node's loss and its own metric reach the coordinator's events, bounded
    logs = [e for e in events if e["event"] == "log"]
    assert {e["node_id"] for e in logs} == {e["node_id"] for e in events if e["event"] == "node_joined"}
    assert all(set(e["metrics"]) == {"loss", "progress"} for e in logs), logs
    last = max((e for e in events if e["event"] == "round"), key=lambda e: e["round"])
    for name in {e["name"] for e in logs}:  # swarm.progress: the run's fraction done, for a schedule
        seen = [e["metrics"]["progress"] for e in logs if e["name"] == name]
        assert seen == sorted(seen) and seen[0] >= 0 and seen[-1] <= 1, seen
        # A node reports at most every LOG_EVERY_S, but its first step of each round always: one
        # that trained the last round reported it (its first step there is 2/3 of the way).
        if last["nodes"].get(name, {"weight": 0})["weight"] > 0:
            assert seen[-1] > 0.5, (name, seen)
    # the logged loss is the loop's train loss: the rounds report it (an own loop's was "-")
    assert all(e["train_loss"] is not None for e in events if e["event"] == "round")
    _status_tells(tmp_path / "run", events)


def _status(run_dir: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "drift", "status", str(run_dir)], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _status_tells(run_dir: Path, events: list[dict]) -> None:
    """`drift status RUN_DIR` on the finished run, and on the run as it stood after round 1."""
    last = next(e for e in events if e["event"] == "round" and e["round"] == 2)
    out = _status(run_dir)
    assert out[0].startswith(f"{run_dir}: finished"), out
    assert out[1].startswith(f"round 3/3 done  train loss {last['train_loss']:.4f}  val loss {last['val_loss']:.4f}"), (
        out
    )
    assert out[2].startswith("run complete: 3 rounds"), out
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    cut = next(i for i, ln in enumerate(lines) if json.loads(ln).get("event") == "round") + 1
    live = run_dir.parent / "live"
    live.mkdir()
    (live / "metrics.jsonl").write_text("\n".join(lines[:cut]) + "\n")
    out = _status(live)
    assert out[0].startswith(f"{live}: training round 2/3"), out
    assert out[1].startswith("round 1/3 done"), out
    assert out[2].startswith("nodes 2"), out
    assert out[3].startswith("ETA "), out


def test_status_of_a_folder_that_is_no_run_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "drift", "status", str(tmp_path)], capture_output=True, text=True, env=ENV
    )
    assert done.returncode == 1
    assert done.stderr.startswith(f"drift: error: {tmp_path}: not a run directory"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("local,min_nodes", [(1, ["--min-nodes", "1"]), (2, [])], ids=["solo", "local-2"])
def test_coord_local_runs_an_own_loop_script(tmp_path: Path, local: int, min_nodes: list[str]) -> None:
    """`drift coord own-loop.yaml --local N` runs README's own-loop script as N nodes (`python
    train.py TICKET`); `--min-nodes 1 --local 1` is a swarm of one on this machine, for debugging."""
    from tests.test_own_loop import _repo as own_loop_repo

    repo = own_loop_repo(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "drift", "coord", "own-loop.yaml", "--local", str(local), *min_nodes],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=280,
        env={**ENV, "DRIFT_HOME": str(tmp_path / "home")},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    run_dir = next((repo / "runs").glob("own-loop-*"))
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([e for e in events if e["event"] == "node_joined"]) == local
    assert [e["round"] for e in events if e["event"] == "round"] == [0, 1, 2]
    for i in range(local):
        assert "run complete: 3 rounds" in (run_dir / f"node-{i}.log").read_text()
