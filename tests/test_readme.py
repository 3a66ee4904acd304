"""The README's first command, exactly as a newcomer types it: read from README.md (not a copy),
run in a fresh `git clone` with the clone as working directory and relative paths, by a user who
is not root, with a stock PATH and HOME. Run as root (CI), the test drops to `nobody` with a HOME
of its own, so `python3` is the system's Python, the one that refuses a system-wide `pip install`
(PEP 668): the command must make its own virtualenv. That virtualenv installs everything itself,
torch included (from the machine's pip configuration: this project's machines keep the CPU wheel
in `/opt/wheels`); one made with `--system-site-packages` would reuse the suite's torch but would
not be the command README shows."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)

STOCK_PATH = "/usr/local/bin:/usr/bin:/bin"


def readme_commands(readme: Path) -> list[str]:
    """README's first two code lines (indented 4 spaces): the main command, then the test command."""
    lines = [m.group(1) for m in re.finditer(r"^    (\S.*)$", readme.read_text(), re.M)]
    assert len(lines) >= 2, "README.md shows no commands"
    return lines[:2]


def _as_a_user(home: Path) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment of a non-root user whose HOME is `home` (made theirs)."""
    pip_config = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}  # the machine's, not the suite's
    if os.geteuid() != 0:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        return [], {**env, "HOME": str(home), "DRIFT_HOME": str(home / ".drift")}
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv to become another user: install util-linux, or run as non-root")
    nobody = pwd.getpwnam("nobody")
    probe = subprocess.run(
        ["bash", "-c", "python3 -c 'import venv, ensurepip'"], env={"PATH": STOCK_PATH}, capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip("the system's python3 cannot make a virtualenv: apt-get install python3-venv")
    for path in [home, *home.rglob("*")]:
        os.chown(path, nobody.pw_uid, nobody.pw_gid, follow_symlinks=False)
    prefix = [setpriv, f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups", "--"]
    return prefix, {"PATH": STOCK_PATH, "HOME": str(home), "LANG": "C.UTF-8", **pip_config}


@pytest.mark.timeout(1200)
def test_readme_first_command_in_a_fresh_clone() -> None:
    cmd = readme_commands(ROOT / "README.md")[0]
    assert cmd.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install") and "drift coord" in cmd, cmd
    # Not pytest's tmp_path: its parent is root's alone, and the user must reach the clone.
    with tempfile.TemporaryDirectory(prefix="drift-readme-") as tmp:
        home = Path(tmp)
        clone = home / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
        prefix, env = _as_a_user(home)
        out = subprocess.run(
            [*prefix, "bash", "-c", cmd], cwd=clone, env=env, capture_output=True, text=True, timeout=1100
        )
        assert out.returncode == 0, f"$ {cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
        assert (clone / ".venv" / "bin" / "drift").exists()  # drift came from the venv, not from elsewhere
        assert "dashboard:  http://127.0.0.1:" in out.stdout + out.stderr  # what README's first run shows

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
