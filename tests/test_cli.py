"""A user mistake is one line naming what is wrong and where, a non-zero exit, no traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import yaml
from conftest import TINY_RECIPE, drift_cmd

from drift.transport import loopback_only, parse_ticket


def _drift(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **env} if env else None
    return subprocess.run(drift_cmd(*args), capture_output=True, text=True, timeout=timeout, env=env)


def _one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("drift: error: "), out.stderr
    return lines[0]


@pytest.mark.swarm
@pytest.mark.parametrize(
    "change,needle",
    [
        ({"rounds": None}, "rounds: required field is missing"),
        ({"warp_speed": 9}, "warp_speed: unknown field"),
        ({"batch_size": "lots"}, "batch_size: Input should be a valid integer"),
        ({"outer_optimizer": {"lr": "fast"}}, "outer_optimizer.lr: Input should be a valid number"),
        ({"min_nodes": 0}, "min_nodes: Input should be greater than or equal to 1"),
        ({"quorum": 1.5}, "quorum: Input should be less than or equal to 1"),
        ({"heartbeat_s": 6.0}, "stale_after_s (10) must be at least twice heartbeat_s (6)"),
        ({"task": "recipes/nope.py"}, "task: file recipes/nope.py not found"),
    ],
)
def test_bad_recipe_fields(tiny_recipe: Path, change: dict, needle: str) -> None:
    data = yaml.safe_load(tiny_recipe.read_text())
    for k, v in change.items():
        if v is None:
            data.pop(k)
        else:
            data[k] = v
    tiny_recipe.write_text(yaml.safe_dump(data))
    line = _one_line_error(_drift("coord", str(tiny_recipe)))
    assert str(tiny_recipe) in line and needle in line


@pytest.mark.swarm
def test_missing_and_unparsable_recipe_files(tmp_path: Path) -> None:
    assert "recipe file not found" in _one_line_error(_drift("coord", str(tmp_path / "none.yaml")))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    assert "not valid YAML" in _one_line_error(_drift("coord", str(bad)))


@pytest.mark.swarm
def test_malformed_ticket(repo_root: Path) -> None:
    line = _one_line_error(_drift("join", "--repo", str(repo_root), "--ticket", "garbage"))
    assert "malformed ticket 'garbage'" in line
    # The same ticket from the environment, where a command line (readable by anyone in ps) has none.
    line = _one_line_error(_drift("join", "--repo", str(repo_root), env={"DRIFT_TICKET": "garbage"}))
    assert "malformed ticket 'garbage'" in line


@pytest.mark.swarm
def test_unreachable_ticket_says_what_was_tried(repo_root: Path) -> None:
    # A real ticket of an endpoint that no longer exists.
    import asyncio

    from drift.transport import Endpoint

    async def dead_ticket() -> str:
        ep = await Endpoint.bind("local")
        t = ep.ticket()
        await ep.close()
        return t

    ticket = asyncio.run(dead_ticket())
    line = _one_line_error(_drift("join", "--repo", str(repo_root), "--ticket", ticket, "--connect-timeout", "1"))
    assert "timed out after 1s connecting to" in line and "127.0.0.1" in line


@pytest.mark.swarm
def test_a_recipe_name_cannot_put_the_run_dir_outside_runs(tiny_recipe: Path, tmp_path: Path) -> None:
    data = yaml.safe_load(tiny_recipe.read_text())
    data["name"] = "../../escaped"
    tiny_recipe.write_text(yaml.safe_dump(data))
    line = _one_line_error(_drift("coord", str(tiny_recipe)))
    assert str(tiny_recipe) in line and "name:" in line and "not a plain name" in line
    assert not (tmp_path / "escaped").exists() and not list(tmp_path.glob("escaped*"))


@pytest.mark.swarm
@pytest.mark.parametrize("repo", ["ext::sh -c touch% {marker}", "ext://sh -c touch% {marker}", "fd::3", "-uinstall"])
def test_repo_transports_that_run_commands_are_refused(repo: str, tmp_path: Path) -> None:
    import asyncio

    from drift.transport import Endpoint

    async def dead_ticket() -> str:
        ep = await Endpoint.bind("local")
        t = ep.ticket()
        await ep.close()
        return t

    marker = tmp_path / "pwned"
    repo = repo.format(marker=marker)
    line = _one_line_error(_drift("join", "--repo", repo, "--ticket", asyncio.run(dead_ticket())))
    assert "--repo" in line and ("transport is refused" in line or "cannot start with '-'" in line), line
    assert not marker.exists()


def test_recipe_used_by_default_is_valid(repo_root: Path) -> None:
    from drift.recipe import load_recipe

    r = load_recipe(repo_root / "recipes" / "shakespeare.yaml")
    assert r.min_nodes == 3 and r.codec == "int8" and r.outer_optimizer.lr == 1.3 and r.outer_optimizer.momentum == 0.0
    assert set(TINY_RECIPE) <= set(r.model_dump())


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).parents[1] / "recipes").glob("*.yaml")))
def test_every_shipped_recipe_loads(repo_root: Path, name: str) -> None:
    from drift.recipe import load_recipe

    load_recipe(repo_root / "recipes" / name)  # its fields, its sync rule's settings, its task file


@pytest.mark.swarm
def test_every_recipe_mistake_at_once(tiny_recipe: Path) -> None:
    data = yaml.safe_load(tiny_recipe.read_text())
    data.pop("name")
    data.update(inner_steps="many", min_nodes=-3)
    tiny_recipe.write_text(yaml.safe_dump(data))
    out = _drift("coord", str(tiny_recipe))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert all(ln.startswith(f"drift: error: {tiny_recipe}: ") for ln in lines), out.stderr
    assert sorted(ln.split(": ")[3] for ln in lines) == ["inner_steps", "min_nodes", "name"], out.stderr


@pytest.mark.swarm
def test_local_below_min_nodes_says_the_run_waits_and_how_to_join(tiny_recipe: Path) -> None:
    data = yaml.safe_load(tiny_recipe.read_text())
    del data["network"]  # the default (auto): with --local, loopback all the same
    tiny_recipe.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen(  # paths as typed from the clone's root
        drift_cmd("coord", "recipes/tiny.yaml", "--local", "1", "--run-dir", "run"),
        cwd=tiny_recipe.parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(60, proc.kill)  # (a hang then fails below, instead of waiting)
    watchdog.start()
    try:
        first = proc.stdout.readline()
        proc.send_signal(signal.SIGINT)  # Ctrl-C as soon as anything shows (once, this hung)
        seen = first + proc.stdout.read()
        assert proc.wait() == 130, seen
        assert "the run waits for 2 more" in seen and "drift join --repo" in seen, seen
        assert "interrupted: no round had finished" in seen, seen
        ticket = re.search(r"--ticket (\S+)", seen).group(1)
        assert loopback_only(parse_ticket(ticket)), ticket
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()


def _files_holding(root: Path, needles: list[str]) -> list[str]:
    """Every file under `root` (logs, metrics, TensorBoard, checkpoints, pages) holding a needle."""
    found = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            found += [f"{p.relative_to(root)}: {n[:16]}" for n in needles if n.encode() in data]
    return found


def _first_ticket(proc: subprocess.Popen) -> tuple[str, str]:
    """What `drift coord` printed up to its dashboard line, and the ticket in it."""
    seen = ""
    while "dashboard:" not in seen:
        line = proc.stdout.readline()
        assert line, seen
        seen += line
    return seen, re.search(r"--ticket (\S+)", seen).group(1)


@pytest.mark.swarm
def test_the_ticket_is_shown_once_and_admits_to_its_own_run_only(tiny_recipe: Path, tmp_path: Path) -> None:
    """The join command is on the owner's terminal once; no file of the run (metrics.jsonl, the
    nodes' logs, TensorBoard, checkpoints), neither page (live, `drift report`'s) holds the ticket or
    the coordinator's id (with iroh's discovery an id is enough to dial it). Every run has a fresh
    key unless kept; a finished run's ticket is refused with "this run has finished", also by a
    later run under a kept key."""
    import json
    import urllib.request

    data = yaml.safe_load(tiny_recipe.read_text())
    data.update(min_nodes=2, rounds=2)
    tiny_recipe.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        drift_cmd("coord", str(tiny_recipe), "--local", "2", "--run-dir", str(run_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(400, proc.kill)
    watchdog.start()
    try:
        seen, ticket = _first_ticket(proc)
        url = re.search(r"dashboard:\s+(\S+)", seen).group(1)
        snap = urllib.request.urlopen(url.replace("/?", "/snapshot.json?"), timeout=30).read().decode()
        assert json.loads(snap)["events"][0]["event"] == "run"
        seen += proc.stdout.read()
        assert proc.wait() == 0, seen
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    endpoint_part, run_id = ticket.rsplit(".", 1)
    coord_id = str(parse_ticket(ticket).id())
    needles = [endpoint_part, coord_id]
    assert seen.count(endpoint_part) == 1, seen  # the owner's terminal: once
    assert not [n for n in needles if n in snap]  # the live page
    out = _drift("report", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert (run_dir / "dashboard.html").exists()
    assert _files_holding(run_dir, needles) == []

    # the finished run's ticket: nothing answers it (a fresh key), and this machine knows why (once
    # the dial gave up: a short --connect-timeout, as nobody will answer it)
    repo = str(tiny_recipe.parents[1])
    line = _one_line_error(_drift("join", "--repo", repo, "--ticket", ticket, "--connect-timeout", "0.5"))
    assert line == f"drift: error: this run has finished (run {run_id}); ask its owner for the current join command"

    # a fresh key every run, unless kept; a kept key's later run refuses the earlier run's ticket
    ids, tickets = [], []
    for args in ((), ("--keep-key",), ("--keep-key",)):
        coord = subprocess.Popen(
            drift_cmd("coord", str(tiny_recipe), "--run-dir", str(tmp_path / f"r{len(ids)}"), *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            _, t = _first_ticket(coord)
            ids.append(str(parse_ticket(t).id()))
            tickets.append(t)
            if len(tickets) == 3:
                # The second --keep-key run is up: the first one's ticket, as it reaches this one
                # (its addresses are this run's, as iroh's discovery finds the same id here).
                old_run = tickets[1].rsplit(".", 1)[1]
                old = f"{t.rsplit('.', 1)[0]}.{old_run}"
                line = _one_line_error(_drift("join", "--repo", str(tiny_recipe.parents[1]), "--ticket", old))
                assert line.endswith(
                    f"this run has finished (run {old_run}); ask its owner for the current join command"
                )
        finally:
            coord.send_signal(signal.SIGINT)
            coord.communicate(timeout=60)
    assert coord_id != ids[0] != ids[1] and ids[1] == ids[2] and tickets[1] != tickets[2]
