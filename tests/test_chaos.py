"""Chaos: the coordinator is killed or stopped, checkpoints get corrupted, and the run still
finishes, losing at most the rounds since the last checkpoint and training no sample twice.
(Node deaths mid-round and mid-all-reduce are in test_swarm_sim.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SIM as CONF_SIM
from conftest import SIM_BATCH as BATCH
from conftest import WRAPPERS, check_exactly_once, drift_cmd, make_task_repo

from harness.simulate import Swarm

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)

SIM = {**CONF_SIM, "inner_steps": 6}


def _after_resume(events: list[dict]) -> list[dict]:
    """The events that count: the first run's up to the checkpoint it resumed from, then the second's."""
    i = max(k for k, e in enumerate(events) if e["event"] == "resumed")
    kept = events[i]["round"]
    return [e for e in events[:i] if e["event"] != "round" or e["round"] <= kept] + events[i:]


def test_coordinator_killed_then_resumed(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=6, checkpoint_every=1, **SIM)
    first = Swarm(recipe, tmp_path)
    nodes = [first.join("0.02"), first.join("0.02")]
    first.wait_event(lambda e: e["event"] == "checkpoint" and e["round"] == 2)
    first.kill(first.coord)  # kill -9, mid-run
    for p in nodes:
        first.kill(p)
    last_done = max(e["round"] for e in first.events() if e["event"] == "round")

    second = Swarm(recipe, tmp_path, "--resume", log_name="coord2.log")
    second.join("0.02")
    second.join("0.02")
    assert second.finish() == 0, second.log()
    assert second.node_exits() == [0, 0], second.node_logs()
    events = second.events()
    resumed = next(e for e in events if e["event"] == "resumed")
    assert resumed["round"] >= 2 and "resuming:   after round" in second.log()
    assert last_done - resumed["round"] <= 1  # at most the round in flight was lost
    rounds = [e["round"] for e in events[events.index(resumed) :] if e["event"] == "round"]
    assert rounds == list(range(resumed["round"] + 1, 6))
    check_exactly_once(_after_resume(events), 2 * BATCH)


def test_ctrl_c_checkpoints_and_a_corrupt_checkpoint_is_skipped(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=40, checkpoint_every=1, **SIM)
    first = Swarm(recipe, tmp_path)
    nodes = [first.join("0.02"), first.join("0.02")]
    first.wait_event(lambda e: e["event"] == "round" and e["round"] == 2)
    assert first.kill(first.coord, signal.SIGINT) == 130, first.log()  # Ctrl-C: a clean stop
    assert "interrupted: checkpoint" in first.log()
    for p in nodes:  # the nodes were told, and left
        assert p.wait(timeout=60) != 0
    assert "coordinator was stopped" in (tmp_path / "n0.log").read_text()
    ckpts = sorted((first.run_dir / "checkpoints").glob("round-*"))
    newest = ckpts[-1]
    data = bytearray((newest / "theta.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    (newest / "theta.safetensors").write_bytes(bytes(data))

    second = Swarm(recipe, tmp_path, "--resume", log_name="coord2.log")
    second.join("0.02")
    second.join("0.02")
    second.wait_event(lambda e: e["event"] == "resumed")
    assert "warning" in second.log() and newest.name in second.log()
    resumed = next(e for e in second.events() if e["event"] == "resumed")
    assert resumed["path"] == str(ckpts[-2])  # the newest one that verifies
    assert second.kill(second.coord, signal.SIGINT) == 130, second.log()
    second.finish()
    assert "Traceback" not in second.log()


def _events(run: Path) -> list[dict]:
    """The run's events so far (the line being written may be incomplete)."""
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()[:-1]] if f.exists() else []


def _one_line_per_problem(text: str) -> None:
    """What the user reads: no tracebacks, no Rust error chains with source locations."""
    assert "Traceback" not in text and "Caused by" not in text and ".rs:" not in text, text


def _local_coord(tmp_path: Path) -> tuple[Path, Path, Path, subprocess.Popen]:
    """`drift coord --local 2` of a long run, in its own session as a terminal's job leader:
    (recipe, run dir, its output file, the process)."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=400, checkpoint_every=1000, **SIM)
    run = tmp_path / "run"
    out = tmp_path / "coord.log"
    with open(out, "w") as fh:
        coord = subprocess.Popen(
            drift_cmd("coord", str(recipe), "--local", "2", "--run-dir", str(run)),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return recipe, run, out, coord


def test_ctrl_c_in_a_terminal_reaches_the_local_nodes_too(tmp_path: Path) -> None:
    """A terminal's Ctrl-C goes to the whole foreground process group: `drift coord --local 2`
    and, with it, any node started from the same shell job. The coordinator keeps the newest
    finished round (its --local nodes live in their own session, so they can still hand over θ),
    tells every node why, and exits 130 with one line per problem."""
    _, run, out, coord = _local_coord(tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not any(e["event"] == "round" and e["round"] >= 2 for e in _events(run)):
            assert coord.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        os.killpg(coord.pid, signal.SIGINT)  # what the terminal does
        assert coord.wait(timeout=120) == 130, out.read_text()
    finally:
        if coord.poll() is None:
            coord.kill()
    text = out.read_text()
    _one_line_per_problem(text)
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    newest = max(e["round"] for e in events if e["event"] == "round")
    assert f"interrupted: checkpoint of round {newest}: " in text, text
    assert (run / "checkpoints" / f"round-{newest:06d}" / "manifest.json").exists()
    logs = sorted(run.glob("node-*.log"))
    assert len(logs) == 2, logs
    for log in logs:
        assert "coordinator was stopped" in log.read_text(), log.read_text()


def test_a_local_node_that_dies_leaves_the_run_going_and_the_last_one_ends_it(tmp_path: Path) -> None:
    """`drift coord --local 2`, one node killed mid-run: a line names it, its exit and its log,
    and the other trains on alone (the dead one is never asked for θ: it is the one that joined
    first, the first a coordinator would ask). The last node killed ends the run in one line
    naming it, with the resume command."""
    import psutil

    recipe, run, out, coord = _local_coord(tmp_path)

    def wait_round(pred) -> dict:
        deadline = time.monotonic() + 300
        while True:
            found = [e for e in _events(run) if e["event"] == "round" and pred(e)]
            if found:
                return found[0]
            assert coord.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)

    try:
        wait_round(lambda e: e["round"] >= 2)
        nodes = {  # (forked from a fork server on Linux: the coordinator's grandchildren)
            m.group(1): p
            for p in psutil.Process(coord.pid).children(recursive=True)
            if (m := re.search(r"--name (local-\d+)", " ".join(p.cmdline())))
        }
        assert sorted(nodes) == ["local-0", "local-1"], nodes
        first = next(e["name"] for e in _events(run) if e["event"] == "node_joined")
        (survivor,) = set(nodes) - {first}
        nodes[first].kill()
        killed_at = max(e["round"] for e in _events(run) if e["event"] == "round")
        wait_round(lambda e: e["round"] >= killed_at + 2 and set(e["nodes"]) == {survivor})
        assert coord.poll() is None, out.read_text()  # the run went on
        assert f"warning: local node {first} exited with code -9 (SIGKILL)" in out.read_text()
        nodes[survivor].kill()
        assert coord.wait(timeout=120) != 0, out.read_text()
    finally:
        if coord.poll() is None:
            coord.kill()
    text = out.read_text()
    _one_line_per_problem(text)
    assert f"error: local node {survivor} exited with code -9 (SIGKILL)" in text, text
    assert f"resume with: drift coord {recipe} --resume --run-dir {run}" in text, text


def test_ctrl_c_while_two_nodes_announce_their_step_keeps_the_round_they_hold(tmp_path: Path) -> None:
    """A ring of two announces the θ its outer step would give and applies it only on Commit.
    A Ctrl-C in that window (one announcement still on its way) must not count the round as
    done: the nodes still hold the round before, and that is the one checkpointed."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=400, checkpoint_every=1000, **SIM)
    swarm = Swarm(recipe, tmp_path, session=True)
    swarm.join("0.02", name="slow", script=WRAPPERS / "fault_node.py", env={"DRIFT_TEST_FAULT": "slow-announce:2"})
    swarm.join("0.02", name="fast")
    swarm.wait_event(lambda e: e["event"] == "barrier" and e["round"] == 2)
    os.killpg(swarm.coord.pid, signal.SIGINT)  # its announcement arrives while the coordinator stops
    assert swarm.finish(timeout=120) == 130, swarm.log()
    text = swarm.log()
    assert "interrupted: checkpoint of round 1: " in text, text
    assert (swarm.run_dir / "checkpoints" / "round-000001" / "manifest.json").exists()
    assert not [e for e in swarm.events() if e["event"] == "round" and e["round"] >= 2]


def test_ctrl_c_that_kills_the_nodes_too_names_the_checkpoint_resume_uses(tmp_path: Path) -> None:
    """Nodes started from the same shell job die with the coordinator's Ctrl-C: θ of the newest
    round cannot be fetched any more, and the coordinator says so and which checkpoint --resume
    continues from, in one line, soon (no minute of retries against dead nodes)."""
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=400, checkpoint_every=2, **SIM)
    swarm = Swarm(recipe, tmp_path, session=True)
    for _ in range(2):
        swarm.join("0.02", process_group=swarm.coord.pid)
    swarm.wait_event(lambda e: e["event"] == "checkpoint" and e["round"] >= 1)
    # A round past the first checkpoint that has none of its own (checkpoints: rounds 1, 3, ...):
    # θ of that round lives only on the nodes, which the Ctrl-C takes down with the coordinator.
    swarm.wait_event(lambda e: e["event"] == "round" and e["round"] >= 2 and e["round"] % 2 == 0)
    # The shell's Ctrl-C reaches every process of the job; a node may still hand θ over before it
    # exits (then the coordinator checkpoints that round instead). Nodes that are gone first are
    # the case this test is for: they die at once, the coordinator gets the Ctrl-C.
    for p in swarm.nodes:
        p.kill()
    os.killpg(swarm.coord.pid, signal.SIGINT)
    assert swarm.finish(timeout=120) == 130, swarm.log()
    text = swarm.log()
    _one_line_per_problem(text)
    line = next(x for x in text.splitlines() if x.startswith("interrupted: "))
    ckpts = sorted((swarm.run_dir / "checkpoints").glob("round-*"))
    assert "could not fetch" in line, line  # the nodes were gone before they could hand θ over
    assert f"--resume continues from round {int(ckpts[-1].name[6:])} ({ckpts[-1]})" in line, line
    assert "resume with: drift coord" in text
