"""drift.launch: a command forked from the warm server is the process a fresh interpreter would be:
its argv, environment, working directory, output, session and exit code (a signal's too)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from drift import launch

pytestmark = [
    pytest.mark.swarm,  # starts `python -m drift.launch`
    pytest.mark.skipif(not launch.WARM, reason="the warm server is Linux only (elsewhere: a plain subprocess)"),
]

SCRIPT = """
import os, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("LAUNCH_TEST"), "sid", os.getsid(0) == os.getpid())
import torch  # already imported by the server: the fork is warm
print("torch", torch.__version__ == sys.argv[2], flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""


def test_a_forked_command_takes_its_argv_env_cwd_log_session_and_exit_code(tmp_path: Path) -> None:
    import torch

    script = tmp_path / "cmd.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "LAUNCH_TEST": "seen"}
    log = tmp_path / "out.log"
    p = launch.start(["3", torch.__version__], log, env, script=script, cwd=tmp_path, session=True)
    assert p.wait(timeout=60) == 3
    assert log.read_text().splitlines() == [
        f"argv ['3', '{torch.__version__}'] cwd {tmp_path} env seen sid True",
        "torch True",
    ]

    other = tmp_path / "other"
    other.mkdir()
    log2 = tmp_path / "out2.log"
    p = launch.start(["sleep", torch.__version__], log2, {**os.environ}, script=script, cwd=other)
    deadline = time.monotonic() + 60
    while "torch" not in log2.read_text():
        assert p.poll() is None and time.monotonic() < deadline, log2.read_text()
        time.sleep(0.05)
    assert p.poll() is None and f"cwd {other} env None sid False" in log2.read_text()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == -signal.SIGTERM  # as subprocess.Popen says a signal


def test_drift_itself_runs_with_its_exit_code(tmp_path: Path) -> None:
    log = tmp_path / "join.log"
    p = launch.start(["join", "--no-such-option"], log, {**os.environ})
    assert p.wait(timeout=60) == 2, log.read_text()
    assert "No such option '--no-such-option'" in log.read_text()
    assert sys.modules["drift.launch"]._server.proc.poll() is None  # one server serves every command
