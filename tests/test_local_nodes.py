"""`drift coord --local N`'s nodes as the user sees them: forked from one process that imported
torch once (drift/forks.py, Linux), each still a node of its own: the torch threads it was given,
its log, `drift join --name local-I` in `ps` without its ticket, and gone when the coordinator is.
A user's own-loop script is forked too, its ticket argument out of `ps`. Where nodes are not forked
(macOS, Windows: tests/wrappers/fresh_nodes_coord.py), a node is a fresh process, and its ticket
still stays out of `ps`."""

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
from harness.simulate import git, make_task_repo
from tests.test_own_loop import _repo as own_loop_repo

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
    return _job(cmd, repo, out)


def _job(cmd: list[str], repo: Path, out: Path) -> tuple[subprocess.Popen, Path, Path]:
    """`cmd` (a coordinator writing to `repo`/run) started in `repo` as a shell's job, once its
    first round is recorded."""
    with open(out, "w") as fh:
        coord = subprocess.Popen(cmd, cwd=repo, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    run = repo / "run"
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").exists() or not any(e["event"] == "round" for e in read_events(run)):
        assert coord.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.1)
    return coord, run, out


def _nodes(coord: subprocess.Popen, pattern: str = r"--name (local-\d+)") -> dict[str, psutil.Process]:
    """The coordinator's --local nodes by name, from their command lines."""
    found = {}
    for p in psutil.Process(coord.pid).children(recursive=True):
        m = re.search(pattern, " ".join(p.cmdline()))
        if m:
            found[m.group(1)] = p
    return found


def _stop_as_kill_percent_1(coord: subprocess.Popen, nodes: dict[str, psutil.Process], run: Path, out: Path) -> None:
    """`kill %1` in the shell: SIGTERM to the job's process group. The coordinator stops as on
    Ctrl-C; the nodes and their fork server, in sessions of their own, are told why."""
    os.killpg(coord.pid, signal.SIGTERM)
    assert coord.wait(timeout=120) == 130, out.read_text()
    _, alive = psutil.wait_procs(list(nodes.values()), timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    for i in range(len(nodes)):
        log = (run / f"node-{i}.log").read_text()
        assert "coordinator was stopped" in log and "is gone" not in log, log[-2000:]


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
        _stop_as_kill_percent_1(coord, nodes, run, out)
    finally:
        if coord.poll() is None:
            coord.kill()


def test_an_own_loop_scripts_local_nodes_show_no_ticket_and_stop_with_their_coordinator(tmp_path: Path) -> None:
    """README's own-loop script (`python train.py TICKET` for each node) under `drift coord
    own-loop.yaml --local 2`: forked too, its ticket argument out of `ps`."""
    repo = own_loop_repo(tmp_path)
    recipe = repo / "own-loop.yaml"
    assert "rounds: 3\n" in recipe.read_text()  # (README's: longer here, so the nodes are seen while they train)
    recipe.write_text(recipe.read_text().replace("rounds: 3\n", "rounds: 400\n"))
    git(repo, "commit", "-q", "-am", "a long run")
    coord, run, out = _job(
        drift_cmd("coord", "own-loop.yaml", "--local", "2", "--run-dir", "run"), repo, tmp_path / "coord.log"
    )
    try:
        nodes = _nodes(coord, r"drift --local node (\d+)")
        assert sorted(nodes) == ["0", "1"], [p.cmdline() for p in psutil.Process(coord.pid).children(True)]
        ticket = re.search(r"--ticket (\S+)", out.read_text()).group(1)
        for name, p in nodes.items():
            assert "train.py" in " ".join(p.cmdline()) and ticket not in " ".join(p.cmdline()), p.cmdline()
            assert os.getsid(p.pid) == p.pid, name
        _stop_as_kill_percent_1(coord, nodes, run, out)
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
