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

from tests.conftest import ROOT, git


def readme_block(first_line: str) -> str:
    """The fenced code block of README.md whose first line starts with `first_line`."""
    blocks = re.findall(r"```\w*\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if b.startswith(first_line))


def test_readme_own_loop_script_trains_as_two_nodes(tmp_path: Path) -> None:
    script, recipe = readme_block("# train.py"), readme_block("# own-loop.yaml")
    added = [line for line in script.splitlines() if line.rstrip().endswith("# drift") or "# drift (" in line]
    assert 1 <= len(added) <= 6, added  # a plain PyTorch script joins with at most 6 added lines
    repo = tmp_path / "loop"
    repo.mkdir()
    (repo / "train.py").write_text(script)
    (repo / "own-loop.yaml").write_text(recipe)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "loop")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    run_dir = tmp_path / "run"
    with open(tmp_path / "coord.log", "w") as log:
        coord = subprocess.Popen(
            [sys.executable, "-m", "drift", "coord", "own-loop.yaml", "--run-dir", str(run_dir)],
            cwd=repo,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**env, "DRIFT_HOME": str(tmp_path / "coord-home")},
        )
    nodes = []
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"--ticket (\S+)", (tmp_path / "coord.log").read_text())):
            assert time.monotonic() < deadline and coord.poll() is None, (tmp_path / "coord.log").read_text()
            time.sleep(0.1)
        for i in range(2):
            nodes.append(
                subprocess.Popen(
                    [sys.executable, "train.py", m.group(1)],
                    cwd=repo,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**env, "DRIFT_HOME": str(tmp_path / f"home-{i}")},  # each node its own key
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
