"""Checkpoints on real files: round trip, verification, pruning, crash safety, torch loading."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from drift.checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    recipe_hash,
    save_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]
META = {
    "samples_seen": 1234,
    "commit": "abc123",
    "recipe_hash": "f" * 64,
    "checksum": "c0ffee",
    "queue": {"epoch": 1, "pos": 7},
}


def params(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shapes = {"tok_emb.weight": (17, 8), "blocks.0.ln1.bias": (8,), "scalar": ()}
    theta = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    return theta, {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def save(ckpt_dir: Path, rnd: int, keep: int = 100) -> Path:
    theta, velocity = params(rnd)
    return save_checkpoint(ckpt_dir, rnd, theta, {"velocity": velocity}, {**META, "samples_seen": rnd}, keep=keep)


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_round_trip_is_exact(tmp_path: Path) -> None:
    theta, velocity = params(0)
    path = save_checkpoint(tmp_path / "ck", 12, theta, {"velocity": velocity}, META)
    assert path == tmp_path / "ck" / "round-000012"
    assert listing(path) == ["manifest.json", "outer.safetensors", "theta.safetensors"]
    ck = load_checkpoint(path)
    assert ck.round == 12 and ck.path == path
    for want, got in ((theta, ck.theta), (velocity, ck.state("velocity"))):
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == np.float32 and got[k].shape == want[k].shape
            assert got[k].tobytes() == want[k].tobytes()
    m = ck.manifest
    assert m["format"] == CHECKPOINT_FORMAT and m["round"] == 12 and abs(m["created"] - time.time()) < 60
    assert {k: m[k] for k in META} == META
    assert set(m["files"]) == {"theta.safetensors", "outer.safetensors"}
    assert m["files"]["theta.safetensors"]["bytes"] == (path / "theta.safetensors").stat().st_size
    assert m == json.loads((path / "manifest.json").read_text())


def test_save_rejects_mismatch_and_reserved_meta(tmp_path: Path) -> None:
    theta, velocity = params(0)
    with pytest.raises(ValueError, match="same names and shapes"):
        save_checkpoint(tmp_path, 1, theta, {"velocity": {**velocity, "extra": np.zeros(2, np.float32)}}, META)
    with pytest.raises(ValueError, match="round"):
        save_checkpoint(tmp_path, 1, theta, {"velocity": velocity}, {"round": 5})
    assert listing(tmp_path) == []  # nothing written, no temp dir left


def test_latest_skips_broken_newer_checkpoints_with_a_warning_each(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    for rnd in range(1, 7):
        save(d, rnd)
    theta6 = d / "round-000006" / "theta.safetensors"
    theta6.write_bytes(theta6.read_bytes()[:-10])  # truncated
    outer5 = d / "round-000005" / "outer.safetensors"
    raw = bytearray(outer5.read_bytes())
    raw[-3] ^= 0x01  # one flipped bit
    outer5.write_bytes(bytes(raw))
    (d / "round-000004" / "manifest.json").unlink()  # missing manifest
    (d / "round-000003" / "outer.safetensors").unlink()  # missing file
    half = d / ".tmp-crashed"  # half-written temp dir
    half.mkdir()
    (half / "theta.safetensors").write_bytes(b"\x00" * 10)

    ck, warnings = latest_checkpoint(d)
    assert ck is not None and ck.round == 2 and ck.manifest["samples_seen"] == 2
    assert len(warnings) == 4, warnings
    expected = [
        ("round-000006/theta.safetensors", "(truncated?)"),
        ("round-000005/outer.safetensors", "sha256"),
        ("round-000004/manifest.json", "unreadable"),
        ("round-000003/outer.safetensors", "missing"),
    ]
    for w, (file, what) in zip(warnings, expected):
        assert w.startswith("skipping checkpoint ") and file in w and what in w and "\n" not in w, w
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(d / "round-000006")


def test_latest_on_empty_or_absent_dir(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "nope") == (None, [])
    (tmp_path / "round-000001").mkdir()
    ck, warnings = latest_checkpoint(tmp_path)
    assert ck is None and len(warnings) == 1 and "round-000001" in warnings[0]


def test_bad_manifest_format_and_round(tmp_path: Path) -> None:
    path = save(tmp_path, 3)
    mf = path / "manifest.json"
    good = json.loads(mf.read_text())
    mf.write_text(json.dumps({**good, "format": 99}))
    with pytest.raises(CheckpointError, match="format 99, expected 1"):
        load_checkpoint(path)
    mf.write_text(json.dumps({**good, "round": 4}))
    with pytest.raises(CheckpointError, match="says round 4"):
        load_checkpoint(path)
    mf.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"manifest\.json: format None"):
        load_checkpoint(path)


def test_keep_prunes_oldest_but_never_the_new_one(tmp_path: Path) -> None:
    for rnd in (1, 2, 3, 9, 10, 1000000):  # 7 digits: pruning goes by number, not by name
        save(tmp_path, rnd, keep=3)
    assert listing(tmp_path) == ["round-000009", "round-000010", "round-1000000"]
    save(tmp_path, 4, keep=2)  # older than the rest (e.g. after resuming past a corrupt one): kept
    assert listing(tmp_path) == ["round-000004", "round-000010", "round-1000000"]
    assert latest_checkpoint(tmp_path)[0].round == 1000000


def test_same_round_is_replaced(tmp_path: Path) -> None:
    save(tmp_path, 5)
    theta, velocity = params(99)
    save_checkpoint(tmp_path, 5, theta, {"velocity": velocity}, META)
    assert listing(tmp_path) == ["round-000005"]
    assert load_checkpoint(tmp_path / "round-000005").theta["scalar"] == theta["scalar"]


def test_leftover_temp_dir_is_ignored_then_cleaned(tmp_path: Path) -> None:
    save(tmp_path, 1)
    crashed = tmp_path / ".tmp-abc123"  # what an interrupted save leaves behind
    crashed.mkdir()
    (crashed / "theta.safetensors").write_bytes(b"partial")
    ck, warnings = latest_checkpoint(tmp_path)
    assert ck.round == 1 and warnings == []
    save(tmp_path, 2)
    assert listing(tmp_path) == ["round-000001", "round-000002"]


_SAVER = """
import sys, numpy as np
from pathlib import Path
from drift.checkpoint import save_checkpoint
d, i = Path(sys.argv[1]), 0
theta = {f"w{k}": np.full((256, 1024), k, np.float32) for k in range(8)}
print("ready", flush=True)
while True:
    i += 1
    theta["w0"][0, 0] = i
    save_checkpoint(d, 1 + i % 2, theta, {"velocity": theta}, {"i": i}, keep=2)
"""


@pytest.mark.swarm
def test_kill_9_mid_save_never_leaves_a_broken_checkpoint(tmp_path: Path) -> None:
    """Real crashes: a process rewriting rounds 1 and 2 over and over, killed at random moments."""
    d = tmp_path / "ck"
    save(d, 1)
    rng = np.random.default_rng(0)
    for _ in range(4):
        p = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(d)],
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert p.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.05, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait()
        rounds = [p for p in d.iterdir() if p.name.startswith("round-")]
        assert rounds and all(load_checkpoint(r) for r in rounds)  # every round dir verifies
        ck, warnings = latest_checkpoint(d)
        assert ck is not None and warnings == []
    save(d, 3, keep=2)
    assert not [p for p in d.iterdir() if p.name.startswith(".")]


def test_recipe_hash_is_canonical() -> None:
    a = recipe_hash({"task": "t.py", "task_config": {"n_layer": 2, "n_embd": 128}, "seed": 1})
    b = recipe_hash({"seed": 1, "task_config": {"n_embd": 128, "n_layer": 2}, "task": "t.py"})
    assert a == b and len(a) == 64 and int(a, 16) >= 0
    assert a != recipe_hash({"task": "t.py", "task_config": {"n_layer": 3, "n_embd": 128}, "seed": 1})


def test_checkpoint_loads_into_a_plain_torch_model(tmp_path: Path) -> None:
    """The README recipe: θ is named like named_parameters(); the tied lm_head is not in it."""
    import torch

    from drift.workers import load_task

    task = load_task(ROOT / "recipes" / "shakespeare_char.py")
    cfg, vocab_size = {}, 80
    model = task.make_torch_model(cfg, vocab_size)
    theta = {k: p.detach().numpy().astype(np.float32) + np.float32(0.5) for k, p in model.named_parameters()}
    velocity = {k: np.zeros_like(v) for k, v in theta.items()}
    path = save_checkpoint(tmp_path, 7, theta, {"velocity": velocity}, META)

    ck = load_checkpoint(path)
    model2 = task.make_torch_model(cfg, vocab_size)
    state = {k: torch.from_numpy(v) for k, v in ck.theta.items()}
    with pytest.raises(RuntimeError, match=r'Missing key.*"lm_head\.weight"'):
        model2.load_state_dict(state, strict=True)  # state_dict() lists the tied weight twice
    missing, unexpected = model2.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    assert model2.lm_head.weight is model2.tok_emb.weight  # still tied, so it was loaded too
    for k, p in model2.named_parameters():
        assert torch.equal(p.detach(), torch.from_numpy(theta[k])), k
    assert torch.equal(model2.lm_head.weight.detach(), torch.from_numpy(theta["tok_emb.weight"]))


def test_a_checkpoint_from_before_sync_rules_were_files_still_loads(tmp_path: Path) -> None:
    """Its manifest has no `state`: outer.safetensors is dense's velocity, as it always was."""
    theta, velocity = params(3)
    path = save_checkpoint(tmp_path, 3, theta, {"velocity": velocity}, META)
    m = json.loads((path / "manifest.json").read_text())
    assert m.pop("state") == ["velocity"]
    (path / "manifest.json").write_text(json.dumps(m))
    ck = load_checkpoint(path)
    assert list(ck.state_flat) == ["velocity"]
    assert all(ck.state("velocity")[k].tobytes() == velocity[k].tobytes() for k in velocity)


def test_a_rule_without_shared_state_checkpoints_theta_alone(tmp_path: Path) -> None:
    theta, _ = params(4)
    path = save_checkpoint(tmp_path, 4, theta, {}, META)
    assert listing(path) == ["manifest.json", "theta.safetensors"]
    assert load_checkpoint(path).state_flat == {}


def test_a_checkpoint_from_before_content_addressed_checksums_still_resumes(tmp_path: Path) -> None:
    # Its manifest holds the whole-stream blake2b of θ and the outer state (drift-state/0): a
    # resume takes it (the files' sha256 vouch for the bytes) and serves θ under today's root.
    from drift.coordinator import Coordinator, CoordinatorError
    from drift.diloco import checksum, stream_checksum
    from drift.recipe import Recipe
    from drift.scheduler import UnitQueue

    recipe = Recipe(name="t", task="x.py", rounds=9, inner_steps=1, batch_size=1)
    theta, velocity = params(3)
    fields = {"task": recipe.task, "task_config": recipe.task_config, "seed": recipe.seed}
    flat = [np.concatenate([a[k].ravel() for k in a]) for a in (theta, velocity)]
    queue = UnitQueue(100, recipe.unit_samples)
    for rnd, (digest, ok) in enumerate([(stream_checksum(*flat), True), ("0" * 24, False)]):
        meta = {**META, "checksum": digest, "recipe_hash": recipe_hash(fields), "queue": queue.position()}
        ck = load_checkpoint(save_checkpoint(tmp_path / "ck", rnd, theta, {"velocity": velocity}, meta))
        coord = Coordinator(recipe, tmp_path / "run", resume=ck)
        coord.n_params = flat[0].size
        if not ok:
            with pytest.raises(CoordinatorError, match="do not match the checksum in its manifest"):
                coord._load_resume(queue)
            continue
        assert coord._load_resume(queue) == rnd + 1
        assert coord.swarm.checksums[rnd] == checksum(*flat) != digest  # served under the new root
