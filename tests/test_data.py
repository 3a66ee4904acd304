"""Data on one machine (recipe `data:`): real `drift` processes, real iroh on loopback. The token
files exist only in the coordinator's working tree (untracked: the nodes' clean checkouts lack
them), so every sample a node trains comes over drift-data/0, verified against the manifest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import ROOT, WRAPPERS, check_exactly_once, drift_cmd

from drift.workers import load_task
from harness.simulate import Swarm, git

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)

BLOCK = 16
UNIT_SAMPLES = 2 * 8  # unit_steps * batch_size


def token_repo(path: Path, *, nodes: int, rounds: int, cache_mb: float = 64.0, tokens: int = 40_000) -> Path:
    """A git repo with the token-file task and a recipe serving its data; the token files are
    written beside it but ignored by git. Returns the recipe path."""
    rec = path / "recipes"
    (rec / "data").mkdir(parents=True)
    for name in ("token_file.py", "shakespeare_char.py"):
        (rec / name).write_text((ROOT / "recipes" / name).read_text())
    rng = np.random.default_rng(0)
    # A learnable stream: each token is the last one plus 1 or 2 (mod 64).
    for split, n in (("train", tokens), ("val", 4000)):
        stream = np.cumsum(rng.integers(1, 3, n)) % 64
        stream.astype(np.uint16).tofile(rec / "data" / f"{split}.bin")
    recipe = {
        "name": "tok",
        "task": "recipes/token_file.py",
        "task_config": {"block_size": BLOCK, "vocab_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 16},
        "data": {"cache_mb": cache_mb},
        "min_nodes": nodes,
        "rounds": rounds,
        "inner_steps": 6,
        "batch_size": 8,
        "unit_steps": 2,
        "eval_batches": 2,
        "inner_optimizer": {"lr": 0.01},
        "network": "local",
        "stale_after_s": 4.0,
        "heartbeat_s": 0.5,
    }
    (rec / "tok.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    (path / ".gitignore").write_text("recipes/data/\n")
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "task")
    return rec / "tok.yaml"


def _events(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.endswith("}")]


def _cache_files(home: Path) -> dict[str, list[Path]]:
    """Each node's cache files, by node."""
    return {d.name: sorted(d.glob("*/*.rows")) for d in (home / "data").iterdir()}


def test_only_the_coordinator_has_the_data_and_the_cache_stays_within_its_limit(tmp_path: Path) -> None:
    """Two nodes whose checkouts lack the token files train on samples the coordinator serves;
    each node's cache never holds more than data.cache_mb (older files are evicted)."""
    limit_mb = 0.004  # ~4 KiB: a few units' samples (each unit's file is ~700 bytes)
    recipe = token_repo(tmp_path / "repo", nodes=2, rounds=4, cache_mb=limit_mb)
    run_dir, home = tmp_path / "run", Path(os.environ["DRIFT_HOME"])
    out = subprocess.run(  # from the repo, with relative paths, as a user types it
        drift_cmd("coord", "recipes/tok.yaml", "--local", "2", "--run-dir", "../run", "--dashboard", "off"),
        cwd=recipe.parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    events = _events(run_dir)
    rounds = [e for e in events if e["event"] == "round"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    assert rounds[-1]["val_loss"] < initial, (initial, rounds[-1]["val_loss"])
    check_exactly_once(events, UNIT_SAMPLES)
    for i in range(2):  # each node said where its samples come from
        assert "data: not on this machine (FileNotFoundError" in (run_dir / f"node-{i}.log").read_text()
    fetched = [e for e in events if e["event"] == "data_fetched"]
    last = {e["node_id"]: e for e in fetched}  # the totals after each node's last round
    assert len(last) == 2
    trained = {i: sum(n["samples"] for r in rounds for n in r["nodes"].values() if n["node_id"] == i) for i in last}
    for i, e in last.items():
        # every sample it trained (plus its val samples) came over the wire, 2 bytes a token
        assert e["samples"] >= trained[i] > 0
        assert e["bytes"] >= e["samples"] * 2 * (BLOCK + 1)
        # the limit bit: a node that fetched more than the limit deleted files to stay within it
        # (under load one node may train so few units that it never reaches it: CI saw 0 evicted)
        assert e["evicted"] > 0 or e["bytes"] <= limit_mb * 2**20, e
    assert any(e["evicted"] > 0 for e in last.values()), last  # (together they fetch several times the limit)
    caches = _cache_files(home)
    assert len(caches) == 2
    for files in caches.values():
        assert files and sum(f.stat().st_size for f in files) <= limit_mb * 2**20
        assert not list(files[0].parent.glob("*.tmp"))  # written under a temporary name, renamed
    assert not [e for e in events if e["event"] in ("data_bad_chunk", "data_unavailable")]


def test_a_coordinator_without_the_data_says_so_in_one_line(tmp_path: Path) -> None:
    recipe = token_repo(tmp_path / "repo", nodes=1, rounds=1)
    (recipe.parent / "data" / "train.bin").unlink()
    out = subprocess.run(
        drift_cmd("coord", str(recipe), "--run-dir", str(tmp_path / "run"), "--dashboard", "off"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("drift: error: data: the task's make_dataset() failed here: FileNotFoundError")


def test_a_corrupted_chunk_is_fetched_again_and_trained_once(tmp_path: Path) -> None:
    """The holder flips a byte of its first reply (tests/wrappers/corrupt_data_coord.py): the
    node finds the sample that fails its digest, says so, fetches it again; the run trains every
    sample exactly once."""
    recipe = token_repo(tmp_path / "repo", nodes=1, rounds=3)
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            str(WRAPPERS / "corrupt_data_coord.py"),
            "coord",
            str(recipe),
            "--local",
            "1",
            "--run-dir",
            str(run_dir),
            "--dashboard",
            "off",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    events = _events(run_dir)
    bad = [e for e in events if e["event"] == "data_bad_chunk"]
    assert len(bad) == 1 and bad[0]["samples"] == 1 and "failed their digest" in bad[0]["reason"], bad
    assert "failed their digest; fetching them again" in (run_dir / "node-0.log").read_text()
    assert [r["round"] for r in events if r["event"] == "round"] == [0, 1, 2]
    check_exactly_once(events, UNIT_SAMPLES)


def _wait_for(run_dir: Path, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in _events(run_dir):
            if e["event"] == what:
                return e
        assert proc.poll() is None, f"the coordinator exited ({proc.returncode}) before {what}"
        time.sleep(0.05)
    raise AssertionError(f"no {what} event within {timeout:g}s")


def test_the_node_sits_out_while_the_holder_cannot_serve_and_resumes(tmp_path: Path) -> None:
    """The coordinator's token files go away mid-run (a disk unmounted): the node says which
    samples it cannot get and waits, not crashing; once they are back it trains on, and nothing
    is trained twice or lost."""
    recipe = token_repo(tmp_path / "repo", nodes=1, rounds=30, tokens=200_000)
    data, away = recipe.parent / "data", recipe.parent / "data.away"
    run_dir = tmp_path / "run"
    log = tmp_path / "coord.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            drift_cmd("coord", str(recipe), "--local", "1", "--run-dir", str(run_dir), "--dashboard", "off"),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(run_dir, proc, "round")
        data.rename(away)
        gone = _wait_for(run_dir, proc, "data_unavailable")
        assert "no data holder could serve" in gone["reason"] and "FileNotFoundError" in gone["reason"], gone
        away.rename(data)
        back = _wait_for(run_dir, proc, "data_back")
        assert back["round"] >= gone["round"]
        assert proc.wait(timeout=240) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    events = _events(run_dir)
    assert [r["round"] for r in events if r["event"] == "round"] == list(range(30))
    check_exactly_once(events, UNIT_SAMPLES)
    text = (run_dir / "node-0.log").read_text()
    assert "sitting out until a holder can serve them" in text and "Traceback" not in text


def test_a_node_with_a_copy_serves_the_others_when_the_coordinator_cannot(tmp_path: Path) -> None:
    """The coordinator holds the token files, node "a" a copy of its own (it matches the manifest,
    so it trains on it and serves it), node "b" none. The coordinator's files go away mid-run: b
    fetches from a instead and trains on without sitting out; nothing is trained twice or lost."""
    recipe = token_repo(tmp_path / "repo", nodes=2, rounds=24, tokens=200_000)
    cfg = yaml.safe_load(recipe.read_text())
    cfg["task_config"]["data_dir"] = "~/tokdata"  # each process's own $HOME
    recipe.write_text(yaml.safe_dump(cfg, sort_keys=False))
    git(recipe.parents[1], "commit", "-q", "-am", "data in the home directory")
    homes = {w: tmp_path / f"home-{w}" for w in ("coord", "a", "b")}
    for h in homes.values():
        h.mkdir()
    (recipe.parent / "data").rename(homes["coord"] / "tokdata")
    shutil.copytree(homes["coord"] / "tokdata", homes["a"] / "tokdata")
    sw = Swarm(recipe, tmp_path, "--dashboard", "off", wrap=["env", f"HOME={homes['coord']}"])
    try:
        # Steps of 0.1 s (simulated): a round lasts well beyond a fetch's switch to the next
        # holder. At full speed its rounds took 60 ms, and b, switching, could find a round's
        # units all trained by a (0 samples) without ever sitting out.
        sw.join("0.1", name="a", env={"HOME": str(homes["a"])})
        sw.join("0.1", name="b", env={"HOME": str(homes["b"])})
        holds = sw.wait_event(lambda e: e["event"] == "data_holds")
        assert holds["name"] == "a", holds
        sw.wait_event(lambda e: e["event"] == "round" and e["round"] >= 1)
        (homes["coord"] / "tokdata").rename(homes["coord"] / "tokdata.away")
        gone_after = max(e["round"] for e in sw.events() if e["event"] == "round")
        assert sw.finish(timeout=300) == 0, sw.log()
    finally:
        sw.finish(timeout=0.1)
    events = sw.events()
    rounds = [e for e in events if e["event"] == "round"]
    assert [r["round"] for r in rounds] == list(range(24))
    check_exactly_once(events, UNIT_SAMPLES)
    b = next(e["node_id"] for e in events if e["event"] == "data_fetched" and e["name"] == "b")
    # b trained in every round after the coordinator's data went away, and never sat out
    later = [r for r in rounds if r["round"] > gone_after + 1]
    assert later and all(n["samples"] > 0 for r in later for n in r["nodes"].values() if n["node_id"] == b)
    assert not [e for e in events if e["event"] in ("data_unavailable", "data_bad_chunk")]
    fetched = {e["round"]: e["samples"] for e in events if e["event"] == "data_fetched" and e["node_id"] == b}
    assert fetched[max(fetched)] > fetched[gone_after + 1] > 0  # it went on fetching: from a
    assert "data: cannot read" in sw.log()  # the coordinator was asked, and could not serve
    a_log = (tmp_path / "a.log").read_text()
    assert "this machine has the holder's data" in a_log and "Traceback" not in a_log
    assert "not on this machine" in (tmp_path / "b.log").read_text()


def test_a_meta_pkl_is_read_as_plain_data_only(tmp_path: Path) -> None:
    """token_file reads nanoGPT's meta.pkl for the vocabulary size; one that would run code when
    unpickled (its directory is named by a recipe: someone else's repo) is refused, not run."""
    import pickle

    token_file = load_task(ROOT / "recipes" / "token_file.py")
    for split in ("train", "val"):
        np.arange(100, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    cfg = {"data_dir": str(tmp_path), "block_size": 8}
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "itos": {0: "a"}, "stoi": {"a": 0}}))
    assert token_file.make_dataset(cfg).vocab_size == 65  # nanoGPT's own meta.pkl

    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": Payload()}))
    with pytest.raises(ValueError, match=r"meta.pkl: not a nanoGPT meta.pkl \(it names (posix|os)\.system"):
        token_file.make_dataset(cfg)
    assert not ran.exists()
