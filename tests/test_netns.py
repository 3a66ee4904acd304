"""Across machines as the README says it: a coordinator and nodes each in a network namespace of
their own (a machine each: own loopback, own ~/.drift), joined by veth pairs through a bridge, no
default route (nothing leaves them, and no relay is reachable). Started with exactly the two
commands README.md gives, read from README.md; the recipe has no `network:`. Needs root."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, drift_cmd, git
from test_readme import _fenced

pytestmark = [pytest.mark.swarm, pytest.mark.root]  # network namespaces

SUBNET = "10.79.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def machines() -> Iterator[list[str]]:
    """Three namespaces on one bridge (in a fourth), addresses 10.79.0.1-3; deleted in finally."""
    tag = os.getpid() % 100000
    sw, names = f"dt{tag}sw", [f"dt{tag}m{i}" for i in range(3)]
    made: list[str] = []
    try:
        for ns in (sw, *names):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(names):  # each pair is made inside its two namespaces
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{i}", "up")
        yield names
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _readme_commands() -> tuple[str, str]:
    """The coordinator and node commands of README's "Your own model", as README spells them."""
    readme = (ROOT / "README.md").read_text()
    coord = re.search(r"Across machines, run `(drift coord mytask\.yaml)` on one", readme)
    join = re.search(r"`(drift join --repo <your repo URL> --ticket \.\.\.)` \(that command", readme)
    assert coord and join, "README.md no longer shows the two commands this test runs"
    assert "A recipe without `network:`\nbinds every interface" in readme
    return coord.group(1), join.group(1)


def _repo(path: Path) -> Path:
    """README's task and recipe, copied from README.md, in a git repo of their own; 3 rounds."""
    readme = (ROOT / "README.md").read_text()
    path.mkdir()
    (path / "mytask.py").write_text(_fenced(readme, "# mytask.py"))
    recipe = _fenced(readme, "# mytask.yaml")
    assert "network" not in recipe and "rounds: 20" in recipe
    # (slow_node_fraction: on a loaded test machine one node's calibration can come out 20x
    # slower, and it would evaluate instead: the ring between the machines is what is tested)
    (path / "mytask.yaml").write_text(
        recipe.replace("rounds: 20", "rounds: 3").rstrip() + "\nslow_node_fraction: 0.9\n"
    )
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "task")
    return path


def _until(proc: subprocess.Popen, needle: str) -> str:
    """What `proc` printed up to and including the first line holding `needle`."""
    seen = ""
    while needle not in seen:
        line = proc.stdout.readline()
        assert line, seen
        seen += line
    return seen


def _in(ns: str, command: str, home: Path) -> list[str]:
    """`command` (README's, `drift ...`) run on machine `ns`: its own network, host name and ~/.drift."""
    host = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', ns]
    return ["ip", "netns", "exec", ns, *host, "env", f"DRIFT_HOME={home}", *drift_cmd(*command.split()[1:])]


@pytest.mark.timeout(180)
def test_readme_commands_train_across_machines(machines: list[str], tmp_path: Path) -> None:
    coord_cmd, join_cmd = _readme_commands()
    repo = _repo(tmp_path / "mine")
    coord = subprocess.Popen(
        _in(machines[0], coord_cmd, tmp_path / "home0"),
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(150, coord.kill)
    watchdog.start()
    nodes: list[subprocess.Popen] = []
    try:
        seen = _until(coord, "commit:")
        printed = re.search(r"join with:\s+(drift join .*)", seen).group(1)
        # The printed command is README's, filled in: a repo path and a ticket.
        template = re.escape(join_cmd).replace(re.escape("<your repo URL>"), r"(\S+)")
        m = re.fullmatch(template.replace(re.escape("..."), r"(\S+)"), printed.strip())
        assert m and Path(m.group(1)) == repo, (join_cmd, printed)
        from drift.transport import parse_ticket

        addrs = parse_ticket(m.group(2)).direct_addresses()
        assert any(a.startswith(f"{SUBNET}.1:") for a in addrs), addrs  # not loopback: other machines reach it
        for i in (1, 2):
            log = (tmp_path / f"node{i}.log").open("w")
            nodes.append(
                subprocess.Popen(
                    _in(machines[i], printed, tmp_path / f"home{i}"),
                    cwd=tmp_path,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        seen += coord.stdout.read()
        assert coord.wait() == 0, seen
        assert "no iroh relay reachable" in seen, seen  # said, and the run went on without one
        assert [n.wait(timeout=60) for n in nodes] == [0, 0], [
            (tmp_path / f"node{i}.log").read_text()[-2000:] for i in (1, 2)
        ]
    finally:
        watchdog.cancel()
        for p in (coord, *nodes):
            if p.poll() is None:
                p.kill()
    events = [json.loads(x) for x in next(repo.glob("runs/points-*/metrics.jsonl")).read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 3 and events[-1]["event"] == "complete"
    assert {e["name"] for e in events if e["event"] == "node_joined"} == set(machines[1:])
    # The two nodes' ring ran between their machines (a node still loading sits out round 0).
    both = [r for r in rounds if len(r["nodes"]) == 2 and all(n["weight"] > 0 for n in r["nodes"].values())]
    assert both and all(r["bytes_sent"] > 0 for r in both), rounds


@pytest.mark.timeout(120)
def test_a_loopback_ticket_dialed_from_another_machine_says_what_to_change(machines: list[str], tmp_path: Path) -> None:
    repo = _repo(tmp_path / "mine")
    recipe = repo / "mytask.yaml"
    recipe.write_text(recipe.read_text() + "network: local\n")
    git(repo, "commit", "-q", "-am", "local")
    coord = subprocess.Popen(
        _in(machines[0], "drift coord mytask.yaml", tmp_path / "home0"),
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = _until(coord, "commit:")
        printed = re.search(r"join with:\s+(drift join .*)", seen).group(1)
        # (nothing from machine 1 reaches a loopback address: its dial gives up after --connect-timeout)
        printed += " --connect-timeout 3"
        node = subprocess.run(
            _in(machines[1], printed, tmp_path / "home1"), cwd=tmp_path, capture_output=True, text=True, timeout=90
        )
    finally:
        coord.kill()
        coord.wait()
    assert "works on this machine only" in seen, seen
    lines = node.stderr.strip().splitlines()
    assert node.returncode != 0 and len(lines) == 1 and lines[0].startswith("drift: error: "), node.stderr
    assert "loopback addresses only" in lines[0] and "without `network: local`" in lines[0], lines[0]
