"""Swarms of real processes on one machine, for tests and benchmarks of staggered devices.

A Swarm is a real `drift coord` plus `drift join` processes on real iroh (loopback) training the
real task; a node's simulated step time (tests/wrappers/sim_node.py, $DRIFT_SIM_STEP) makes every inner step
last exactly that long, so a 2-core machine can play a swarm of very different devices, and a
simulated swarm means the same on any machine. On Linux the nodes are forked, as `drift coord
--local`'s are, from one fork server a process (drift/forks.py): importing torch was most of a
node's start.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from drift import forks
from drift.monitor import read_events

ROOT = Path(__file__).resolve().parents[2]


def run_events(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl events so far ([] before it has one), a round's rows all there
    (drift.monitor.read_events)."""
    return read_events(run_dir, whole=True) if (run_dir / "metrics.jsonl").exists() else []


# (without PYTHONDONTWRITEBYTECODE: a swarm's processes compile drift once, not each: tests/conftest.py)
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "PYTHONUNBUFFERED": "1"}
SIM_NODE = ROOT / "tests" / "wrappers" / "sim_node.py"  # `drift join` on a simulated device
_SERVER: list[forks.Server] = []  # this process's fork server, started by its first node


def _fork_server() -> forks.Server | None:
    if not forks.available():
        return None
    if not _SERVER or not _SERVER[0].alive():
        _SERVER[:] = [forks.Server()]
    return _SERVER[0]


# The simulated swarms' task: a tiny model, fast liveness, a simulated step time (tests/wrappers/sim_node.py) sets each node's pace.
SIM_BATCH = 8
SIM = dict(
    task_config={"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
    batch_size=SIM_BATCH,
    unit_steps=2,
    eval_batches=2,
    stale_after_s=4.0,
    heartbeat_s=0.5,
)

# Small enough that a 3-node swarm finishes a few rounds in seconds on 2 cores.
TINY_RECIPE = {
    "name": "tiny",
    "task_config": {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
    "min_nodes": 3,
    "rounds": 4,
    "inner_steps": 10,
    "batch_size": 16,
    "unit_steps": 2,
    "inner_optimizer": {"lr": 0.01},
    "eval_batches": 4,
    "seed": 7,
    "network": "local",  # tests stay on loopback; tests/test_netns.py runs the default across namespaces
}


class Swarm:
    def __init__(
        self,
        recipe: Path,
        work: Path,
        *coord_args: str,
        log_name: str = "coord.log",
        wrap: list[str] | None = None,
        session: bool = False,
    ):
        """`wrap` prefixes the coordinator's command (e.g. `ip netns exec NS`); join() takes one too.
        `session`: the coordinator leads a process group of its own, as a shell's foreground job
        does (nodes can join that group: a terminal's Ctrl-C then reaches all of them)."""
        self.recipe, self.work = recipe, work
        self.run_dir = work / "run"
        self.nodes: list[subprocess.Popen | forks.Forked] = []
        self.coord_log = work / log_name
        with open(self.coord_log, "w") as fh:
            self.coord = subprocess.Popen(
                [
                    *(wrap or []),
                    sys.executable,
                    "-m",
                    "drift",
                    "coord",
                    str(recipe),
                    "--run-dir",
                    str(self.run_dir),
                    "--key",
                    str(work / "coord.key"),
                    *coord_args,
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=ENV,
                preexec_fn=(lambda: os.setpgid(0, 0)) if session else None,
            )
        self.ticket = self._wait_for(r"--ticket (\S+)", 60)

    def _wait_for(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log())
            if m:
                return m.group(1)
            if self.coord.poll() is not None:
                raise AssertionError("coordinator exited early:\n" + self.log())
            time.sleep(0.1)
        raise AssertionError(f"coordinator never printed {pattern!r}")

    def join(
        self,
        sim_step: str | None = None,
        name: str | None = None,
        wrap: list[str] | None = None,
        script: Path | None = None,
        env: dict[str, str] | None = None,
        process_group: int | None = None,
        key: Path | None = None,
        args: tuple[str, ...] = (),
    ) -> subprocess.Popen | forks.Forked:
        """Start `drift join`; `sim_step` is its simulated step time (tests/wrappers/sim_node.py:
        $DRIFT_SIM_STEP; None: the real speed), `wrap` prefixes
        the command (`ip netns exec NS`), `script` runs instead of `python -m drift` (a test's
        wrapper that calls drift.cli.main, e.g. tests/held_node.py); `args` go after join's own.
        Forked where it can be (not wrapped, nor in another process group)."""
        i = len(self.nodes)
        name = name or f"n{i}"
        stem = name if re.fullmatch(r"[\w.-]+", name) else f"n{i}"  # a name made to break things is no file name
        log = self.work / f"{stem}.log"
        sim = {"DRIFT_SIM_STEP": sim_step} if sim_step else {}
        script = script or (SIM_NODE if sim_step else None)
        join = [
            "join",
            "--repo",
            str(self.recipe.parents[1]),
            "--ticket",
            self.ticket,
            "--name",
            name,
            "--threads",
            "1",
            "--key",
            str(key or self.work / f"{stem}.key"),
            "--cache-dir",
            str(self.work / "cache"),
            *args,
        ]
        env = {**ENV, **sim, **(env or {})}
        server = None if wrap or process_group is not None else _fork_server()
        if server is not None:
            p = server.fork(join, env, log, f"drift join --name {stem}", 1, script=script)
        else:
            launcher = [sys.executable, str(script)] if script else [sys.executable, "-m", "drift"]
            with open(log, "w") as fh:
                p = subprocess.Popen(
                    [*(wrap or []), *launcher, *join],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=env,
                    preexec_fn=None if process_group is None else (lambda: os.setpgid(0, process_group)),
                )
        self.nodes.append(p)
        return p

    def events(self) -> list[dict]:
        return run_events(self.run_dir)

    def wait_event(self, pred, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events():
                if pred(e):
                    return e
            if self.coord.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError("event never came; coordinator log:\n" + self.log() + "\nnode logs:\n" + self.node_logs())

    def kill(self, p: subprocess.Popen | forks.Forked, sig: int = signal.SIGKILL) -> int:
        p.send_signal(sig)
        return p.wait(timeout=120)

    def finish(self, timeout: float = 300, nodes_timeout: float = 30, leave: list | None = None) -> int:
        """The coordinator's exit code; the nodes (or just those in `leave`: a node the swarm
        dropped may still be trying to rejoin) get `nodes_timeout` to leave after it (they were
        told the run ended), then whatever is left is killed."""
        try:
            rc = self.coord.wait(timeout)
            deadline = time.monotonic() + nodes_timeout
            for p in self.nodes if leave is None else leave:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            return rc
        finally:
            for p in [self.coord, *self.nodes]:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def log(self) -> str:
        return self.coord_log.read_text()

    def node_exits(self) -> list[int | None]:
        """Each node's exit code, in join order (after finish(): -9 for one still running then)."""
        return [p.returncode for p in self.nodes]

    def node_logs(self) -> str:
        """The tail of every node's log, for an assertion message."""
        return "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(self.work.glob("*.log")))


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "drift",
        "GIT_AUTHOR_EMAIL": "drift@localhost",
        "GIT_COMMITTER_NAME": "drift",
        "GIT_COMMITTER_EMAIL": "drift@localhost",
    }
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env
    ).stdout.strip()


def make_task_repo(path: Path, recipe: dict, task: Path = ROOT / "recipes" / "shakespeare_char.py") -> Path:
    """A real git repo holding `task` and recipes/<name>.yaml, committed; returns the recipe path.
    Its swarms run on this machine: `network: local` unless the recipe says otherwise."""
    (path / "recipes").mkdir(parents=True)
    shutil.copy(task, path / "recipes" / task.name)
    out = path / "recipes" / f"{recipe['name']}.yaml"
    out.write_text(yaml.safe_dump({"task": f"recipes/{task.name}", "network": "local", **recipe}, sort_keys=False))
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "task")
    return out
