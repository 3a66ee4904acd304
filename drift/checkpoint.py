"""Checkpoints: θ and the outer optimizer's velocity as safetensors, plus a manifest.

    CKPT_DIR/round-000012/theta.safetensors    named like the model's parameters
                         /outer.safetensors    the Nesterov velocity, same names
                         /manifest.json        format, round, created, sha256 + size of each file, meta

A checkpoint is written into a temp dir, every file fsynced, then renamed into place: a crash
leaves the old set or the new one, never half a round dir. Loading verifies every hash, so a
truncated or corrupted checkpoint is skipped (with a warning) in favour of an older one.
The coordinator writes these without torch (safetensors.numpy).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

CHECKPOINT_FORMAT = 1
_FILES = ("theta.safetensors", "outer.safetensors")
_RESERVED = ("format", "round", "created", "files")  # manifest keys that meta may not set
_ROUND_DIR = re.compile(r"round-(\d+)")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; str() names the file and what is wrong."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path                       # the round-NNNNNN directory
    round: int                       # θ after this round's outer step
    theta: dict[str, np.ndarray]     # float32, named like the model's parameters
    velocity: dict[str, np.ndarray]  # the outer Nesterov momentum, same names and shapes
    manifest: dict                   # everything in manifest.json (meta's keys at the top level)


def recipe_hash(fields: dict) -> str:
    """sha256 (hex) of the canonical JSON (sorted keys) of the given recipe fields."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _rounds(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(round, dir) of every round-NNNNNN dir, oldest first (by number, not by name)."""
    found = ((_ROUND_DIR.fullmatch(p.name), p) for p in ckpt_dir.iterdir() if p.is_dir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


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


def _swap(a: Path, b: Path) -> bool:
    """Exchange two dirs in one atomic step (Linux renameat2, macOS renamex_np); False if unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "renameat2"):    # renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
        rc = libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2)
    elif hasattr(libc, "renamex_np"):  # renamex_np(a, b, RENAME_SWAP)
        rc = libc.renamex_np(os.fsencode(a), os.fsencode(b), 2)
    else:
        return False
    err = ctypes.get_errno()
    if rc == 0:
        return True
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def save_checkpoint(ckpt_dir: Path, round: int, theta: dict[str, np.ndarray], velocity: dict[str, np.ndarray],
                    meta: dict, keep: int = 3) -> Path:
    """Write ckpt_dir/round-NNNNNN atomically, then keep only the newest `keep` checkpoints."""
    if {k: np.shape(v) for k, v in theta.items()} != {k: np.shape(v) for k, v in velocity.items()}:
        raise ValueError("θ and velocity must have the same names and shapes")
    if clash := sorted(set(meta) & set(_RESERVED)):
        raise ValueError(f"meta may not set the manifest's own keys {clash}")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"round-{round:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=ckpt_dir))
    try:
        files = {}
        for name, tensors in zip(_FILES, (theta, velocity)):
            save_file({k: np.asarray(v, np.float32, order="C") for k, v in tensors.items()}, tmp / name)  # keeps 0-d
            _fsync(tmp / name)
            files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
        manifest = {**meta, "format": CHECKPOINT_FORMAT, "round": round, "created": time.time(), "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / "manifest.json")
        _fsync(tmp)
        if not final.exists():
            tmp.rename(final)
        elif not _swap(tmp, final):   # same round again, no atomic exchange here: two renames
            old = ckpt_dir / f".tmp-old-{final.name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        _fsync(ckpt_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # nothing, or the swapped-out old copy, or a failed write
    for stale in ckpt_dir.glob(".tmp-*"):        # left behind by a crash mid-save
        shutil.rmtree(stale, ignore_errors=True)
    for _, old in _rounds(ckpt_dir)[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _load_tensors(f: Path) -> dict[str, np.ndarray]:
    try:
        return load_file(f)
    except Exception as e:  # safetensors raises its own error types on bad headers
        raise CheckpointError(f"{f}: not loadable as safetensors ({str(e).splitlines()[0]})") from None


def load_checkpoint(path: Path) -> Checkpoint:
    """Load one checkpoint dir, verifying the manifest, each file's size and sha256, names and shapes."""
    mf = path / "manifest.json"
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mf}: unreadable ({e.__class__.__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{mf}: format {fmt!r}, expected {CHECKPOINT_FORMAT}")
    files, rnd = manifest.get("files"), manifest.get("round")
    if not isinstance(files, dict) or not isinstance(rnd, int):
        raise CheckpointError(f"{mf}: no 'files' table or no integer 'round'")
    if (m := _ROUND_DIR.fullmatch(path.name)) and int(m.group(1)) != rnd:
        raise CheckpointError(f"{mf}: says round {rnd}, but the dir is {path.name}")
    for name in _FILES:
        f, want = path / name, files.get(name) or {}
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if (size := f.stat().st_size) != want.get("bytes"):
            raise CheckpointError(f"{f}: {size} bytes, manifest says {want.get('bytes')} (truncated?)")
        if _sha256(f) != want.get("sha256"):
            raise CheckpointError(f"{f}: sha256 differs from the manifest (corrupted)")
    theta, velocity = _load_tensors(path / _FILES[0]), _load_tensors(path / _FILES[1])
    if {k: (v.shape, v.dtype) for k, v in theta.items()} != {k: (v.shape, v.dtype) for k, v in velocity.items()}:
        raise CheckpointError(f"{path / _FILES[1]}: names, shapes or dtypes differ from {_FILES[0]}")
    return Checkpoint(path, rnd, theta, velocity, manifest)


def latest_checkpoint(ckpt_dir: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that verifies, and one warning line per newer one skipped."""
    warnings: list[str] = []
    for _, path in reversed(_rounds(ckpt_dir)) if ckpt_dir.is_dir() else []:
        try:
            return load_checkpoint(path), warnings
        except CheckpointError as e:
            warnings.append(f"skipping checkpoint {e}")
    return None, warnings
