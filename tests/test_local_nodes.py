"""`drift coord --local N`'s nodes as the user sees them: forked from one process that imported
torch once (drift/forks.py, Linux), each still a node of its own: the torch threads it was given,
its log, `drift join --name local-I` in `ps` without its ticket, and gone when the coordinator is.
Where nodes are not forked (macOS, Windows: tests/wrappers/fresh_nodes_coord.py), a node is a fresh
process, and its ticket still stays out of `ps`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import WRAPPERS, drift_cmd

from drift.monitor import read_events
from harness.simulate import make_task_repo

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)

POINTS = Path(__file__).parent / "tasks" / "points_mlp.py"

# The task tells its log how many torch threads its training step runs on, once.
THREADS_TASK = """
_told = []


class Told(MLP):
    def forward(self, x, y):
        if not _told:
            _told.append(True)
            print(f"torch threads in a training step: {torch.get_num_threads()}", flush=True)
        return super().forward(x, y)


def make_torch_model(cfg: dict, vocab_size: int) -> nn.Module:
    return Told(int(cfg.get("hidden", 32)), vocab_size)
"""


def _start(tmp_path: Path, forked: bool = True) -> tuple[subprocess.Popen, Path, Path]:
    """`drift coord recipes/told.yaml --local 2 --threads 1 --run-dir run` as typed in the task's
    repo, in a session of its own as a shell's job: (the coordinator, its run dir, its output).
    Not `forked`: its nodes fresh processes, as where forking is not used."""
    task = tmp_path / "told_mlp.py"
    task.write_text(POINTS.read_text() + THREADS_TASK)
    recipe = {
        "name": "told",
        "task_config": {"hidden": 32},
        "min_nodes": 2,
        "rounds": 400,
        "inner_steps": 20,
        "batch_size": 16,
        "unit_steps": 2,
        "eval_batches": 2,
        "checkpoint_every": 1000,
    }
    repo = tmp_path / "repo"
    make_task_repo(repo, recipe, task)
    out = tmp_path / "coord.log"
    cmd = drift_cmd("coord", "recipes/told.yaml", "--local", "2", "--threads", "1", "--run-dir", "run")
    if not forked:
        cmd[1:3] = [str(WRAPPERS / "fresh_nodes_coord.py")]
    with open(out, "w") as fh:
        coord = subprocess.Popen(cmd, cwd=repo, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    run = repo / "run"
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").exists() or not any(e["event"] == "round" for e in read_events(run)):
        assert coord.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.1)
    return coord, run, out


def _nodes(coord: subprocess.Popen) -> dict[str, psutil.Process]:
    """The coordinator's --local nodes by name, from their command lines."""
    found = {}
    for p in psutil.Process(coord.pid).children(recursive=True):
        m = re.search(r"--name (local-\d+)", " ".join(p.cmdline()))
        if m:
            found[m.group(1)] = p
    return found


@pytest.mark.parametrize("forked", [True, False], ids=["forked", "fresh"])
def test_local_nodes_train_on_the_threads_they_were_given_and_show_no_ticket(tmp_path: Path, forked: bool) -> None:
    coord, run, out = _start(tmp_path, forked)
    try:
        nodes = _nodes(coord)
        assert sorted(nodes) == ["local-0", "local-1"], [p.cmdline() for p in psutil.Process(coord.pid).children(True)]
        ticket = re.search(r"--ticket (\S+)", out.read_text()).group(1)
        for name, p in nodes.items():
            assert ticket not in " ".join(p.cmdline()), p.cmdline()  # a secret, readable by any user in ps
            assert os.getsid(p.pid) == p.pid, name  # its own session: a terminal's Ctrl-C is the coordinator's
        for i in range(2):
            log = (run / f"node-{i}.log").read_text()
            assert "torch threads in a training step: 1" in log, log
        # `kill %1` in the shell: SIGTERM to the job's process group. The coordinator stops as on
        # Ctrl-C; the nodes and their fork server, in sessions of their own, are told why.
        os.killpg(coord.pid, signal.SIGTERM)
        assert coord.wait(timeout=120) == 130, out.read_text()
        _, alive = psutil.wait_procs(list(nodes.values()), timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        for i in range(2):
            log = (run / f"node-{i}.log").read_text()
            assert "coordinator was stopped" in log and "is gone" not in log, log[-2000:]
    finally:
        if coord.poll() is None:
            coord.kill()


def test_local_nodes_leave_when_their_coordinator_is_killed(tmp_path: Path) -> None:
    coord, run, _ = _start(tmp_path)
    nodes = _nodes(coord)
    assert len(nodes) == 2, nodes
    coord.kill()  # kill -9: it tells nobody
    coord.wait()
    _, alive = psutil.wait_procs(list(nodes.values()), timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    for i in range(2):
        log = (run / f"node-{i}.log").read_text()
        assert "the coordinator that started this node is gone; leaving" in log, log[-2000:]
