"""Checkpoints: θ and the sync rule's shared state as safetensors, plus a manifest.

    CKPT_DIR/round-000012/theta.safetensors    named like the model's parameters (and buffers)
                         /outer.safetensors    the state array `velocity` (dense's Nesterov momentum), same names
                         /NAME.safetensors     any other state array NAME of the rule, same names
                         /manifest.json        format, round, created, state (its names, in order),
                                               sha256 + size of each file, meta

A manifest without `state` (written before rules were files) holds ["velocity"].

A checkpoint is written into a temp dir, every file fsynced, then renamed into place: a crash
leaves the old set or the new one, never half a round dir. Loading verifies every hash, so a
truncated or corrupted checkpoint is skipped (with a warning) in favour of an older one.

The tensors lie in the files in drift's layout order (parameters, then buffers, each sorted), so
a file's data is θ's flat vector: a `CheckpointWriter` streams a state transfer straight to disk
and a loaded checkpoint maps the files instead of reading them (no copy of θ in memory, whatever
the model's size). The files stay standard safetensors (`safetensors.numpy.load_file` reads them).
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

CHECKPOINT_FORMAT = 1
_THETA = "theta.safetensors"
_RESERVED = ("format", "round", "created", "files", "state")  # manifest keys that meta may not set
_STATE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")  # a state array's name (its file, its manifest entry)
_ROUND_DIR = re.compile(r"round-(\d+)")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; str() names the file and what is wrong."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path  # the round-NNNNNN directory
    round: int  # θ after this round's outer step
    names: tuple[str, ...]  # tensors in file (= drift's layout) order
    shapes: tuple[tuple[int, ...], ...]
    theta_flat: np.ndarray  # float32, the whole of θ: a copy-on-write map of the file
    state_flat: dict[str, np.ndarray]  # the sync rule's shared state by name, same layout, in order
    manifest: dict  # everything in manifest.json (meta's keys at the top level)

    def _named(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        out, i = {}, 0
        for name, shape in zip(self.names, self.shapes):
            n = int(np.prod(shape, dtype=np.int64))
            out[name] = flat[i : i + n].reshape(shape)
            i += n
        return out

    @property
    def theta(self) -> dict[str, np.ndarray]:
        """θ by name (views), named like the model's parameters and buffers."""
        return self._named(self.theta_flat)

    def state(self, name: str) -> dict[str, np.ndarray]:
        """The state array `name` by tensor name (views)."""
        return self._named(self.state_flat[name])


def state_file(name: str) -> str:
    """The file of a state array: dense's velocity keeps the name it always had."""
    return "outer.safetensors" if name == "velocity" else f"{name}.safetensors"


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
    if hasattr(libc, "renameat2"):  # renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
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


class CheckpointWriter:
    """One checkpoint written while its bytes arrive: the header of each file first (from the
    layout), then θ's and each state array's bytes, piece by piece in any order. commit() fsyncs, writes the manifest
    and renames the dir into place atomically; abort() leaves nothing."""

    def __init__(
        self,
        ckpt_dir: Path,
        round: int,
        names: tuple[str, ...],
        shapes: tuple[tuple[int, ...], ...],
        state: tuple[str, ...] = ("velocity",),
    ):
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique")
        if len(set(state)) != len(state) or not all(_STATE_NAME.fullmatch(n) for n in state):
            raise ValueError(f"state names must be distinct lowercase identifiers: {state}")
        self.state = tuple(state)
        self.ckpt_dir, self.round = ckpt_dir, round
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=ckpt_dir))
        header, offset = {}, 0
        for name, shape in zip(names, shapes):
            n = 4 * int(np.prod(shape, dtype=np.int64))
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
        self.nbytes = offset
        self._names = [_THETA, *(state_file(n) for n in self.state)]
        self._files = [open(self.tmp / name, "wb") for name in self._names]
        for f in self._files:
            f.write(len(raw).to_bytes(8, "little") + raw)
        self._base = 8 + len(raw)
        self._written = [0] * len(self._files)

    def write(self, which: int, offset: int, data: memoryview | bytes) -> None:
        """Bytes of θ (which 0) or of state array which-1 at byte `offset`, each byte once, in
        any order (a transfer's pieces arrive from several holders)."""
        if offset < 0 or offset + len(data) > self.nbytes:
            raise ValueError(f"checkpoint bytes at {offset}..{offset + len(data)} outside 0..{self.nbytes}")
        f = self._files[which]
        f.seek(self._base + offset)
        f.write(data)
        self._written[which] += len(data)

    def commit(self, meta: dict, keep: int = 3) -> Path:
        """Make it ckpt_dir/round-NNNNNN (replacing one of the same round), keep the newest `keep`."""
        if clash := sorted(set(meta) & set(_RESERVED)):
            raise ValueError(f"meta may not set the manifest's own keys {clash}")
        if self._written != [self.nbytes] * len(self._files):
            raise ValueError(f"checkpoint incomplete: {self._written} of {self.nbytes} bytes")
        ckpt_dir, tmp, final = self.ckpt_dir, self.tmp, self.ckpt_dir / f"round-{self.round:06d}"
        try:
            files = {}
            for name, f in zip(self._names, self._files):
                f.flush()
                os.fsync(f.fileno())
                f.close()
                files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
            manifest = {
                **meta,
                "format": CHECKPOINT_FORMAT,
                "round": self.round,
                "state": list(self.state),
                "created": time.time(),
                "files": files,
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            _fsync(tmp / "manifest.json")
            _fsync(tmp)
            if not final.exists():
                tmp.rename(final)
            elif not _swap(tmp, final):  # same round again, no atomic exchange here: two renames
                old = ckpt_dir / f".tmp-old-{final.name}-{os.getpid()}"
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            _fsync(ckpt_dir)
        finally:
            self.abort()  # nothing left, or the swapped-out old copy, or a failed write
        for stale in ckpt_dir.glob(".tmp-*"):  # left behind by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
        for _, old in _rounds(ckpt_dir)[:-keep] if keep > 0 else []:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def abort(self) -> None:
        for f in self._files:
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def save_checkpoint(
    ckpt_dir: Path,
    round: int,
    theta: dict[str, np.ndarray],
    state: dict[str, dict[str, np.ndarray]],
    meta: dict,
    keep: int = 3,
) -> Path:
    """Write ckpt_dir/round-NNNNNN atomically, then keep only the newest `keep` checkpoints.
    `state`: the rule's state arrays by name, each by tensor name like θ. The tensors go in the
    dicts' order (drift's layout order: see ParamLayout.unflatten)."""
    shapes = {k: np.shape(v) for k, v in theta.items()}
    for name, tensors in state.items():
        if {k: np.shape(v) for k, v in tensors.items()} != shapes:
            raise ValueError(f"θ and {name} must have the same names and shapes")
    if clash := sorted(set(meta) & set(_RESERVED)):
        raise ValueError(f"meta may not set the manifest's own keys {clash}")
    names = tuple(theta)
    w = CheckpointWriter(ckpt_dir, round, names, tuple(tuple(np.shape(theta[n])) for n in names), tuple(state))
    try:
        for which, tensors in enumerate((theta, *state.values())):
            offset = 0
            for n in names:
                data = memoryview(np.ascontiguousarray(tensors[n], np.float32)).cast("B")
                w.write(which, offset, data)
                offset += len(data)
    except BaseException:
        w.abort()
        raise
    return w.commit(meta, keep)


def _map_tensors(f: Path) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...], np.ndarray]:
    """A safetensors file of float32 tensors: (names, shapes) in data order and the whole data as
    one flat float32 copy-on-write map (nothing read into memory; writes never reach the file)."""
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= 1 << 30:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        size = f.stat().st_size - 8 - n
        names, shapes, end = [], [], 0
        for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            a, b = t["data_offsets"]
            shape = tuple(int(d) for d in t["shape"])
            if t["dtype"] != "F32" or a != end or b - a != 4 * int(np.prod(shape, dtype=np.int64)):
                raise ValueError(f"tensor {name}: {t}")
            names.append(name)
            shapes.append(shape)
            end = b
        if end != size or size % 4:
            raise ValueError(f"data of {size} bytes, tensors cover {end}")
        flat = (
            np.memmap(f, dtype=np.float32, mode="c", offset=8 + n, shape=(size // 4,))
            if size
            else np.zeros(0, np.float32)
        )
        return tuple(names), tuple(shapes), flat
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{f}: not a float32 safetensors file ({str(e).splitlines()[0]})") from None


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
    state = manifest.get("state", ["velocity"])
    if not (
        isinstance(state, list)
        and all(isinstance(n, str) and _STATE_NAME.fullmatch(n) for n in state)
        and len(set(state)) == len(state)
    ):
        raise CheckpointError(f"{mf}: 'state' is not a list of distinct state names")
    for name in [_THETA, *(state_file(n) for n in state)]:
        f, want = path / name, files.get(name) or {}
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if (size := f.stat().st_size) != want.get("bytes"):
            raise CheckpointError(f"{f}: {size} bytes, manifest says {want.get('bytes')} (truncated?)")
        if _sha256(f) != want.get("sha256"):
            raise CheckpointError(f"{f}: sha256 differs from the manifest (corrupted)")
    names, shapes, theta = _map_tensors(path / _THETA)
    arrays = {}
    for n in state:
        snames, sshapes, arrays[n] = _map_tensors(path / state_file(n))
        if (snames, sshapes) != (names, shapes):
            raise CheckpointError(f"{path / state_file(n)}: names, shapes or order differ from {_THETA}")
    return Checkpoint(path, rnd, names, shapes, theta, arrays, manifest)


def latest_checkpoint(ckpt_dir: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that verifies, and one warning line per newer one skipped."""
    warnings: list[str] = []
    for _, path in reversed(_rounds(ckpt_dir)) if ckpt_dir.is_dir() else []:
        try:
            return load_checkpoint(path), warnings
        except CheckpointError as e:
            warnings.append(f"skipping checkpoint {e}")
    return None, warnings
