"""One identity, one node: two nodes with the same key would be one node to the swarm (same id),
so the second is refused with a line that says how to run several nodes on one machine; and
running several nodes on one machine needs no key juggling (each --device gets its own key)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import drift_cmd, make_task_repo

from harness.simulate import Swarm

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)


def _error_line(p: subprocess.Popen, log: Path) -> str:
    assert p.wait(timeout=120) != 0
    text = log.read_text()
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if ln.startswith("drift: error: ")]
    assert len(lines) == 1, text
    return lines[0]


def test_second_node_with_the_same_key_file_is_refused_at_once(tmp_path: Path) -> None:
    recipe = make_task_repo(
        tmp_path / "repo",
        min_nodes=2,
        rounds=2,
        inner_steps=4,
        batch_size=8,
        unit_steps=2,
        task_config={"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32},
    )
    swarm = Swarm(recipe, tmp_path)
    first = swarm.join(name="a")
    swarm.wait_event(lambda e: e["event"] == "node_joined")
    second = swarm.join(name="second", key=tmp_path / "a.key")  # same key file, same machine: a second shell
    line = _error_line(second, tmp_path / "second.log")
    assert "a.key is in use by pid" in line and "--device" in line and "--key" in line, line
    assert first.poll() is None  # the first one is unharmed, still waiting for its peer
    shutil.copy(tmp_path / "a.key", tmp_path / "copy.key")  # the same identity in another file
    copy = swarm.join(name="copy")
    line = _error_line(copy, tmp_path / "copy.log")
    assert "already in this swarm" in line and "--device" in line, line
    swarm.join(name="b")  # a node of its own: the swarm starts and completes
    assert swarm.finish() == 0, swarm.log()
    assert first.returncode == 0 and swarm.nodes[-1].returncode == 0, swarm.node_logs()


def test_each_device_gets_its_own_key(tmp_path: Path) -> None:
    env = {**os.environ, "DRIFT_HOME": str(tmp_path / "home")}
    ids = {
        d: subprocess.run(
            drift_cmd("id", *(["--device", d] if d else [])), capture_output=True, text=True, env=env, check=True
        ).stdout.strip()
        for d in (None, "cuda:0", "cuda:1")
    }
    assert len(set(ids.values())) == 3
    assert (tmp_path / "home" / "node-cuda-1.key").exists() and (tmp_path / "home" / "node.key").exists()
