"""One node, several devices: `drift join --nproc N` (CPU, gloo) / `--devices cuda:0,cuda:1` (NCCL).

Real rank processes, real gloo on 127.0.0.1. The NCCL path is the same code with the backend
chosen by the device type; this machine has no GPU, so only gloo is tested here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import drift_cmd, make_task_repo

from harness.simulate import Swarm

pytestmark = pytest.mark.swarm  # starts drift processes (a node's ranks too; tests/conftest.py)


def _end(swarm: Swarm) -> None:
    """Whatever a test leaves running of its swarm is killed."""
    if swarm.coord.poll() is None:
        swarm.kill(swarm.coord)
    swarm.finish(timeout=5, nodes_timeout=5)


def _max_diff(a, b) -> float:
    pa, pb = a.get_params(), b.get_params()
    assert pa.keys() == pb.keys()
    return max(float(np.abs(pa[k] - pb[k]).max()) for k in pa)


def test_two_ranks_step_as_one_worker_on_the_whole_batch(tmp_path: Path) -> None:
    """2 ranks x half a batch (DDP over gloo) take the step one worker takes on the whole batch:
    odd batches, a batch smaller than the ranks, micro-batches, and after the node writes θ (the
    outer step), resets AdamW and sets the learning rate. A rank that dies is named, not waited for."""
    from drift.ranks import start_group, task_worker
    from drift.recipe import load_recipe
    from drift.workers.ddp import RankError

    recipe_path = make_task_repo(tmp_path / "repo")
    recipe = load_recipe(recipe_path)
    work, task = recipe_path.parents[1], recipe_path.parents[1] / recipe.task
    failures: list[str] = []
    group = start_group(work, task, recipe, ["cpu", "cpu"], threads=1, on_failure=failures.append)
    try:
        one = task_worker(work, task, recipe, "torch", "cpu", 1)
        assert group.world == 2 and _max_diff(group, one) == 0.0  # same seed, same θ0
        rng = np.random.default_rng(0)
        for n, parts in [(16, 1), (16, 2), (5, 1), (1, 1), (7, 3)]:
            idx = rng.choice(one.n_train, n, replace=False)
            assert group.train_step(idx, parts) == pytest.approx(one.train_step(idx, parts), rel=1e-6)
            assert _max_diff(group, one) < 1e-4, (n, parts)
        theta = {k: v * 0.9 + 0.01 for k, v in one.get_params().items()}  # rank 1 must get it too
        for w in (group, one):
            w.set_params(theta)
            w.reset_optimizer()
            w.set_lr(0.05)
        before = _max_diff(group, one)
        shift = {k: np.full_like(v, 0.01) for k, v in theta.items()}
        for _ in range(2):  # and after a catch-up (the overlapped rule moves the local copy)
            idx = rng.choice(one.n_train, 16, replace=False)
            assert group.train_step(idx) == pytest.approx(one.train_step(idx), rel=1e-6)
            group.add_to_state(shift)
            one.add_to_state(shift)
        idx = rng.choice(one.n_train, 16, replace=False)
        assert group.train_step(idx) == pytest.approx(one.train_step(idx), rel=1e-6)
        # AdamW at lr 0.05 moves each value by up to 0.05 a step and amplifies rounding; a rank
        # that missed θ, the reset or the learning rate would be off by about that much.
        assert before == 0.0 and _max_diff(group, one) < 2e-3

        os.kill(group._ranks[0].proc.pid, signal.SIGKILL)
        with pytest.raises(RankError, match=r"rank 1 of 2 \(cpu\) was killed by SIGKILL"):
            group.train_step(idx)
        assert failures == ["rank 1 of 2 (cpu) was killed by SIGKILL: no output"]
    finally:
        group.close()


def test_a_two_rank_node_is_one_member_of_a_real_swarm(tmp_path: Path) -> None:
    """`drift join --nproc 2` beside a plain node: one identity, one ring member, every round's
    checksum agreed by both, and its ranks gone when the run ends."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=3)
    swarm = Swarm(recipe, tmp_path)
    try:
        ranked = swarm.join(name="ranked", args=("--nproc", "2"))
        swarm.join(name="plain")
        ranks = []
        swarm.wait_event(lambda e: e["event"] == "training_started")
        ranks = [c for c in psutil.Process(ranked.pid).children() if "drift.ranks" in " ".join(c.cmdline())]
        assert len(ranks) == 1, swarm.node_logs()
        assert swarm.finish() == 0, swarm.log() + swarm.node_logs()
    finally:
        _end(swarm)
    assert swarm.node_exits() == [0, 0], swarm.node_logs()
    events = swarm.events()
    joined = {e["name"]: e for e in events if e["event"] == "node_joined"}
    assert sorted(joined) == ["plain", "ranked"] and joined["ranked"]["device"] == "cpu+cpu"
    rounds = [e for e in events if e["event"] == "round"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    # A round event is written once every member reported that one checksum. (On a loaded machine
    # the two-process node may be cut from a round by the slow-node rule: not from all three.)
    assert all(len(r["checksum"]) == 24 and set(r["nodes"]) <= {"plain", "ranked"} for r in rounds), rounds
    both = [r for r in rounds if sorted(r["nodes"]) == ["plain", "ranked"]]
    assert both, rounds
    for r in both:  # one member: one identity, its samples and weight
        assert r["nodes"]["ranked"]["node_id"] == joined["ranked"]["node_id"]
        assert r["nodes"]["ranked"]["samples"] > 0 and r["nodes"]["ranked"]["weight"] > 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    assert "Traceback" not in (tmp_path / "ranked.log").read_text()


def test_a_rank_that_dies_ends_its_node_with_one_line(tmp_path: Path) -> None:
    """A rank killed while its node waits in a swarm: the node says which rank and how, exits 1."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2)
    swarm = Swarm(recipe, tmp_path)
    try:
        ranked = swarm.join(name="ranked", args=("--nproc", "2"))
        swarm.wait_event(lambda e: e["event"] == "node_joined")
        (rank,) = [c for c in psutil.Process(ranked.pid).children() if "drift.ranks" in " ".join(c.cmdline())]
        rank.kill()
        assert ranked.wait(timeout=60) == 1
    finally:
        _end(swarm)
    errors = [ln for ln in (tmp_path / "ranked.log").read_text().splitlines() if ln.startswith("drift: error: ")]
    assert errors == ["drift: error: rank 1 of 2 (cpu) was killed by SIGKILL: no output"], swarm.node_logs()


def _dead_ticket() -> str:
    from drift.transport import Endpoint

    async def make() -> str:
        ep = await Endpoint.bind("local")
        t = ep.ticket()
        await ep.close()
        return t

    return asyncio.run(make())


@pytest.mark.parametrize(
    "args,needle",
    [
        (("--devices", "cuda:0,cuda:0"), "--devices cuda:0,cuda:0: cuda:0 is named twice"),
        (("--devices", "cuda:3"), "--devices cuda:3: device 'cuda:3' is not available here"),
        (("--devices", "cpu,cpu"), "use --nproc N for N CPU processes"),
        (("--nproc", "0"), "--nproc 0: a node needs at least 1 process"),
        (("--nproc", "2", "--devices", "cuda:0,cuda:1"), "--devices and --nproc: give one of them"),
        (("--nproc", "2", "--backend", "numpy"), "the numpy backend trains in one process"),
        (("--nproc", "2", "--backend", "mlx"), "the mlx backend trains in one process"),
    ],
)
def test_bad_device_lists_are_one_line(args: tuple[str, ...], needle: str, repo_root: Path) -> None:
    out = subprocess.run(
        drift_cmd("join", "--repo", str(repo_root), "--ticket", _dead_ticket(), *args),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drift: error: ") and needle in lines[0], out.stderr


_GROUP_IN_NAMESPACE = """
import sys
from pathlib import Path
import psutil
from drift.ranks import start_group
from drift.recipe import load_recipe
recipe_path = Path(sys.argv[1])
recipe = load_recipe(recipe_path)
work = recipe_path.parents[1]
group = start_group(work, work / recipe.task, recipe, ["cpu", "cpu"], threads=1)
me = psutil.Process()
ports = {c.laddr.port for p in (me, *me.children(recursive=True)) for c in p.net_connections("tcp")
         if c.status == psutil.CONN_LISTEN}
print(*sorted(ports), flush=True)
sys.stdin.read()
group.close()
"""

_KNOCK = """
import datetime, socket, sys
import torch.distributed as dist
host, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
for port in ports:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        continue
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=5))
    print("reached", port, store.list_keys(), flush=True)
    store.set("rank0_addr", "10.83.0.2")  # an attacker's own address
print("done", flush=True)
"""


@pytest.mark.root  # two network namespaces (tests/conftest.py: skipped without root, fails under CI)
def test_the_ranks_rendezvous_cannot_be_reached_from_another_network_namespace(tmp_path: Path) -> None:
    """`--nproc 2` in one namespace (a machine), a client in another joined to it by a veth pair:
    none of the node's listening TCP ports (its rendezvous store among them) can be reached, so no
    one off the machine can read or overwrite the group's keys (rank 0's address)."""
    recipe_path = make_task_repo(tmp_path / "repo")
    tag = os.getpid() % 100000
    machine, other = f"dr{tag}a", f"dr{tag}b"
    made: list[str] = []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)

    group = None
    try:
        for ns in (machine, other):
            ip("netns", "add", ns)
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        # the pair is made inside the two namespaces: nothing is added to the root one; no routes
        ip("link", "add", "eth0", "netns", machine, "type", "veth", "peer", "name", "eth0", "netns", other)
        for ns, addr in ((machine, "10.83.0.1"), (other, "10.83.0.2")):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        group = subprocess.Popen(
            ["ip", "netns", "exec", machine, sys.executable, "-c", _GROUP_IN_NAMESPACE, str(recipe_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ports = group.stdout.readline().split()
        assert ports, "the group did not start"
        knock = subprocess.run(
            ["ip", "netns", "exec", other, sys.executable, "-c", _KNOCK, "10.83.0.1", *ports],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert knock.stdout.strip() == "done", (ports, knock.stdout, knock.stderr[-2000:])
    finally:
        if group is not None:
            group.stdin.close()
            try:
                group.wait(timeout=30)
            except subprocess.TimeoutExpired:
                group.kill()
                group.wait()
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
