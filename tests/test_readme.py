"""The README's first command, exactly as a newcomer types it: read from README.md (not a copy),
run in a fresh `git clone` with the clone as working directory and relative paths, in a virtualenv
of its own (its `pip install -e .` must not repoint the suite's drift at a temp clone) that sees
the suite's packages, so nothing is downloaded but the build backend."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)


def readme_main_command(readme: Path) -> str:
    """The first indented (4 spaces) or fenced code line that is not the test command."""
    fenced = False
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if (fenced or re.match(r"^    \S", line)) and "pytest" not in line:
            return line.strip()
    raise AssertionError("README.md shows no main command")


@pytest.mark.timeout(1200)
def test_readme_first_command_in_a_fresh_clone(tmp_path: Path) -> None:
    cmd = readme_main_command(ROOT / "README.md")
    assert cmd.startswith("python3 -m pip install") and "drift coord" in cmd, cmd
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}",
        VIRTUAL_ENV=str(venv),
        DRIFT_HOME=str(tmp_path / "home"),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    out = subprocess.run(["bash", "-c", cmd], cwd=clone, env=env, capture_output=True, text=True, timeout=1100)
    assert out.returncode == 0, f"$ {cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]

    runs = list((clone / "runs").glob("*/metrics.jsonl"))  # the run dir is relative to the clone
    assert len(runs) == 1, runs
    events = [json.loads(line) for line in runs[0].read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    assert rounds and events[-1]["event"] == "complete"
    # A round event is written only once every node reported the same checksum of θ.
    assert all(len(r["checksum"]) == 24 for r in rounds) and len({r["checksum"] for r in rounds}) == len(rounds)
    vals = [r["val_loss"] for r in rounds if r["val_loss"] is not None]
    assert vals and vals[-1] < initial - 1.0, (initial, vals)
    logs = sorted(runs[0].parent.glob("node-*.log"))
    assert len(logs) == 3, logs
    for log in logs:  # every node left with the run complete
        assert "run complete" in log.read_text(), log.read_text()[-2000:]


def _fenced(readme: str, first_line: str) -> str:
    """The fenced code block of README.md whose first line is `first_line`."""
    m = re.search(r"```\w*\n(" + re.escape(first_line) + r".*?)```", readme, re.S)
    assert m, f"README.md has no code block starting with {first_line!r}"
    return m.group(1)


def test_the_readme_task_trains_as_the_readme_says(tmp_path: Path) -> None:
    """The task and recipe of README's "Your own model" section, copied from README.md into a
    fresh git repo of their own, run with the command README gives, from the repo's directory."""
    readme = (ROOT / "README.md").read_text()
    repo = tmp_path / "mine"
    repo.mkdir()
    (repo / "mytask.py").write_text(_fenced(readme, "# mytask.py"))
    (repo / "mytask.yaml").write_text(_fenced(readme, "# mytask.yaml"))
    cmd = re.search(r"`(git add -A && git commit -m task && drift coord mytask.yaml --local 2)`", readme).group(1)
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "me",
        "GIT_AUTHOR_EMAIL": "me@localhost",
        "GIT_COMMITTER_NAME": "me",
        "GIT_COMMITTER_EMAIL": "me@localhost",
    }
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=repo, check=True)
    out = subprocess.run(
        ["bash", "-c", cmd.replace("drift coord", f"{sys.executable} -m drift coord")],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    run = next((repo / "runs").glob("points-*"))
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    assert len(rounds) == 20 and rounds[-1]["val_loss"] < initial / 2, (initial, rounds[-1]["val_loss"])
    assert rounds[-1]["metrics"]["accuracy"] > 0.8, rounds[-1]["metrics"]  # the task's metrics(model, batch)
    assert not [e for e in events if e["event"] in ("bad_report", "sat_out", "node_left")]
