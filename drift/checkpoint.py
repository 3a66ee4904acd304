"""Checkpoints: θ and the outer optimizer's velocity as safetensors, plus a manifest.

    CKPT_DIR/round-000012/theta.safetensors    named like the model's parameters
                         /outer.safetensors    the Nesterov velocity, same names
                         /manifest.json        format, round, sha256 + size of each file, meta

A checkpoint is written into a temp dir, every file fsynced, then renamed into place: a crash
leaves the old set or the new one, never half a round dir. Loading verifies every hash, so a
truncated or corrupted checkpoint is skipped (with a warning) in favour of an older one.
The coordinator writes these without torch (safetensors.numpy).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

CHECKPOINT_FORMAT = 1
_FILES = ("theta.safetensors", "outer.safetensors")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; str() names the file and what is wrong."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    round: int                       # θ after this round's outer step
    theta: dict[str, np.ndarray]
    velocity: dict[str, np.ndarray]
    manifest: dict


def recipe_hash(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_dir: Path, round: int, theta: dict[str, np.ndarray], velocity: dict[str, np.ndarray],
                    meta: dict, keep: int = 3) -> Path:
    """Write round `round` atomically, then keep only the newest `keep` checkpoints."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"round-{round:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=ckpt_dir))
    try:
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in theta.items()}, tmp / _FILES[0])
        save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in velocity.items()}, tmp / _FILES[1])
        files = {}
        for name in _FILES:
            _fsync(tmp / name)
            files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
        manifest = {"format": CHECKPOINT_FORMAT, "round": round, "created": time.time(), "files": files, **meta}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / "manifest.json")
        _fsync(tmp)
        if final.exists():  # same round written again: swap it out, then drop the old copy
            old = ckpt_dir / f".old-{final.name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync(ckpt_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for stale in ckpt_dir.glob(".tmp-*"):  # left behind by a crash mid-save
        shutil.rmtree(stale, ignore_errors=True)
    rounds = sorted(ckpt_dir.glob("round-*"))
    for old in rounds[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> Checkpoint:
    """Load one checkpoint dir, verifying the manifest, each file's size and sha256, and shapes."""
    mf = path / "manifest.json"
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mf}: unreadable manifest ({e.__class__.__name__})") from None
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{mf}: format {manifest.get('format')!r}, expected {CHECKPOINT_FORMAT}")
    for name in _FILES:
        f, want = path / name, manifest.get("files", {}).get(name, {})
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if f.stat().st_size != want.get("bytes") or _sha256(f) != want.get("sha256"):
            raise CheckpointError(f"{f}: size or sha256 differs from the manifest (truncated or corrupted)")
    try:
        theta, velocity = load_file(path / _FILES[0]), load_file(path / _FILES[1])
    except Exception as e:  # safetensors raises its own error types on bad headers
        raise CheckpointError(f"{path}: cannot load tensors ({e})") from None
    if {k: v.shape for k, v in theta.items()} != {k: v.shape for k, v in velocity.items()}:
        raise CheckpointError(f"{path}: θ and the outer state have different names or shapes")
    return Checkpoint(path, int(manifest["round"]), theta, velocity, manifest)


def latest_checkpoint(ckpt_dir: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that verifies, and a warning for each newer one skipped."""
    warnings: list[str] = []
    for path in sorted(ckpt_dir.glob("round-*"), reverse=True):
        try:
            return load_checkpoint(path), warnings
        except CheckpointError as e:
            warnings.append(f"skipping checkpoint {path.name}: {e}")
    return None, warnings
