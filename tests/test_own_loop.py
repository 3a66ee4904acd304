"""The README's own-loop script, exactly as shown there: committed into a fresh git repo with the
README's recipe, run as two nodes (`python train.py TICKET`) against a real `drift coord`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, git

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)


def readme_block(first_line: str) -> str:
    """The fenced code block of README.md whose first line starts with `first_line`."""
    blocks = re.findall(r"```\w*\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if b.startswith(first_line))


def _repo(tmp_path: Path) -> Path:
    script, recipe = readme_block("# train.py"), readme_block("# own-loop.yaml")
    repo = tmp_path / "loop"
    repo.mkdir()
    (repo / "train.py").write_text(script)
    (repo / "own-loop.yaml").write_text(recipe)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "loop")
    return repo


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _coord(tmp_path: Path, repo: Path) -> tuple[subprocess.Popen, str]:
    with open(tmp_path / "coord.log", "w") as log:
        coord = subprocess.Popen(
            [sys.executable, "-m", "drift", "coord", "own-loop.yaml", "--run-dir", str(tmp_path / "run")],
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


def test_readme_own_loop_script_trains_as_two_nodes(tmp_path: Path) -> None:
    added = [
        ln for ln in readme_block("# train.py").splitlines() if ln.rstrip().endswith("# drift") or "# drift (" in ln
    ]
    assert 1 <= len(added) <= 6, added  # a plain PyTorch script joins with at most 6 added lines
    repo = _repo(tmp_path)
    run_dir = tmp_path / "run"
    coord, ticket = _coord(tmp_path, repo)
    nodes = []
    try:
        for i in range(2):
            nodes.append(
                subprocess.Popen(
                    [sys.executable, "train.py", ticket],
                    cwd=repo,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**ENV, "DRIFT_HOME": str(tmp_path / f"home-{i}")},  # each node its own key
                )
            )
        outs = [n.communicate(timeout=240)[0] for n in nodes]
        assert coord.wait(timeout=60) == 0, (tmp_path / "coord.log").read_text()
    finally:
        for p in [coord, *nodes]:
            if p.poll() is None:
                p.kill()
    for n, out in zip(nodes, outs):
        assert n.returncode == 0, out
        assert "run complete: 3 rounds" in out, out
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    assert [e["round"] for e in rounds] == [0, 1, 2]
    assert all(e["samples"] > 0 for e in rounds)
    assert rounds[-1]["val_loss"] is not None  # the script's evaluate, asked for by the coordinator
    initial = next(e for e in events if e["event"] == "initial")["val_loss"]
    assert rounds[-1]["val_loss"] < initial  # the loop trained, and the swarm's θ got better
    started = next(e for e in events if e["event"] == "training_started")
    assert started["n_train"] == 4000  # samples=len(x)


def test_a_script_with_uncommitted_changes_is_refused_in_one_line(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    coord, ticket = _coord(tmp_path, repo)
    try:
        (repo / "train.py").write_text((repo / "train.py").read_text() + "# a local edit\n")
        out = subprocess.run(
            [sys.executable, "train.py", ticket],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=120,
            env={**ENV, "DRIFT_HOME": str(tmp_path / "home")},
        )
    finally:
        coord.kill()
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("drift: error:") and "uncommitted changes (train.py)" in lines[-1], out.stderr
    assert "Traceback" not in out.stderr
