"""The weights of recipe ``init_weights``, shipped from one machine (ALPN ``drift-base/0``).

The file (a safetensors file, or a ``save_pretrained`` directory of them) lives with the
coordinator only. It may hold the model's trainable state (θ₀: a pretrained start), its frozen
part (the base of a LoRA or partial fine-tune), or both: every floating tensor in it must be a
tensor of the task's model, and each of the two parts is in it whole or not at all. What a node
builds itself (LoRA's fresh adapters, say) is what the file leaves out.

At start the coordinator reads the file once and publishes a manifest: each tensor's name,
dtype, shape, size and blake2b digest of its bytes as stored. The manifest's own digest (the
root) travels in TrainConfig, from the coordinator the node dialled, so a holder cannot swap a
single byte. Before the coordinator binds, it builds the task's model with no storage (torch's
meta device) and refuses a file that does not fit it; a node checks the manifest against the
model it built before it asks for any tensor (the same check, for a task the coordinator could
not build that way).

A node keeps every tensor it fetched under ``$DRIFT_HOME/base/`` named by its digest (written to
a temporary name, fsynced, renamed), and the manifest by its root: a second run, or another base
that shares tensors, fetches nothing it has. Every byte read from the cache or a holder is
checked against the manifest's digest before it is used. The sync never sends the base: it is
fetched once, at join.

Everything from a holder is untrusted: frames are capped, every read has a timeout, and a
transfer slower than MIN_RATE is given up (the next holder is asked).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import iroh
import numpy as np

from drift import protocol as P
from drift.transport import BASE_ALPN, Channel, Endpoint, TransportError, close_conn, peer_of

log = logging.getLogger("drift.base")

DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}  # bfloat16: the high half of a float32
MAX_TENSORS = 1 << 17
MAX_MANIFEST = 1 << 26  # bytes of the manifest (~200 bytes a tensor)
MAX_HEADER = 100 << 20  # bytes of a safetensors file's JSON header (as the safetensors library caps it)
MAX_REQUEST = 256
FRAME = 1 << 20
TIMEOUT = 30.0  # connecting, and each frame
IDLE_S = 60.0  # a client connection with no request for this long is closed by the holder
MIN_RATE = 1 << 20  # bytes/s: a transfer slower than this overall (after TIMEOUT) is given up
MAX_CLIENTS = 64
DIGEST = 16  # bytes of blake2b


class BaseError(Exception):
    """Weights that cannot be used or fetched; str() says which tensor and why (one line)."""


class Misfit(BaseError):
    """The weights do not fit the task's model (which tensor, and how)."""


def digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=DIGEST).hexdigest()


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # safetensors' name: F32, F16, BF16, F64
    shape: tuple[int, ...]
    digest: str  # blake2b of its bytes as stored

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(DTYPES[self.dtype]).itemsize


@dataclass(frozen=True)
class Manifest:
    tensors: tuple[Tensor, ...]

    def encode(self) -> bytes:
        return json.dumps(
            {"tensors": [[t.name, t.dtype, list(t.shape), t.digest] for t in self.tensors]}, separators=(",", ":")
        ).encode()

    @property
    def root(self) -> str:
        return digest(self.encode())

    @property
    def size(self) -> int:
        return sum(t.size for t in self.tensors)

    @classmethod
    def decode(cls, blob: bytes) -> Manifest:
        """A manifest from a holder (untrusted: checked field by field)."""
        try:
            rows = json.loads(blob)["tensors"]
            if not isinstance(rows, list) or len(rows) > MAX_TENSORS:
                raise ValueError
            tensors = []
            for name, dtype, shape, dig in rows:
                ok = (
                    isinstance(name, str)
                    and len(name) <= 1024
                    and dtype in DTYPES
                    and isinstance(shape, list)
                    and len(shape) <= 32
                    and all(type(d) is int and 0 <= d < 1 << 40 for d in shape)
                    and isinstance(dig, str)
                    and len(dig) == 2 * DIGEST
                    and all(c in "0123456789abcdef" for c in dig)
                )
                if not ok:
                    raise ValueError
                tensors.append(Tensor(name, dtype, tuple(shape), dig))
        except (ValueError, TypeError, KeyError, RecursionError):
            raise BaseError("the holder's manifest is malformed") from None
        if len({t.name for t in tensors}) != len(tensors):
            raise BaseError("the holder's manifest names a tensor twice")
        return cls(tuple(tensors))


# --- the file ----------------------------------------------------------------------------------


def weight_files(path: Path) -> list[Path]:
    """The safetensors file(s) at path: the file itself, or a directory's *.safetensors."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files
        raise BaseError(f"{path}: no *.safetensors file in this directory")
    raise BaseError(f"{path}: no such file or directory")


@dataclass(frozen=True)
class Stored:
    file: Path
    offset: int  # of the tensor's bytes in the file
    tensor: Tensor


def _header(f: Path) -> tuple[dict, int]:
    """A safetensors file's header and where its data starts."""
    with open(f, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= n <= MAX_HEADER:
            raise BaseError(f"{f}: not a safetensors file")
        try:
            meta = json.loads(fh.read(n))
        except (ValueError, RecursionError):
            raise BaseError(f"{f}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(meta, dict):
        raise BaseError(f"{f}: not a safetensors file")
    return meta, 8 + n


def read_weights(path: Path) -> list[Stored]:
    """Every floating-point tensor at path with its digest (a BatchNorm's integer step counter is
    not a weight): reads all of it once."""
    out: dict[str, Stored] = {}
    for f in weight_files(path):
        meta, start = _header(f)
        end = f.stat().st_size
        with open(f, "rb") as fh:
            for name, info in sorted(meta.items()):
                if name == "__metadata__":
                    continue
                try:
                    dtype, shape, (a, b) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
                except (TypeError, KeyError, ValueError):
                    raise BaseError(f"{f}: not a safetensors file (tensor {name})") from None
                if dtype not in DTYPES:
                    continue
                if name in out:
                    raise BaseError(f"{f}: tensor {name} is also in {out[name].file}")
                t = Tensor(name, dtype, shape, "")
                if not (0 <= a <= b and start + b <= end and b - a == t.size):
                    raise BaseError(f"{f}: tensor {name}: its bytes lie outside the file")
                fh.seek(start + a)
                h = hashlib.blake2b(digest_size=DIGEST)
                for chunk in _chunks(fh, b - a):
                    h.update(chunk)
                out[name] = Stored(f, start + a, Tensor(name, dtype, shape, h.hexdigest()))
    if not out:
        raise BaseError(f"{path}: no floating-point tensors")
    return list(out.values())


def _chunks(fh, n: int) -> Iterator[bytes]:
    while n > 0:
        chunk = fh.read(min(FRAME, n))
        if not chunk:
            raise BaseError(f"{fh.name}: ends early")
        n -= len(chunk)
        yield chunk


def as_float32(t: Tensor, data: bytes | memoryview) -> np.ndarray:
    """The tensor's values as a float32 array of its shape."""
    a = np.frombuffer(data, DTYPES[t.dtype])
    if t.dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
    return a.astype(np.float32).reshape(t.shape)


# --- does it fit the model ---------------------------------------------------------------------


def _plain(name: str) -> str:
    """A name as the unwrapped model calls it: peft wraps the base in ``base_model.model.`` and a
    targeted layer's own weight in ``.base_layer``, a save_pretrained base has neither."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


@dataclass(frozen=True)
class Place:
    index: int  # in the manifest
    name: str  # the model's
    theta: bool  # trainable state (θ₀), else the frozen base


def fit(tensors: tuple[Tensor, ...], theta: dict[str, tuple], frozen: dict[str, tuple]) -> list[Place]:
    """Where each tensor of the file goes in the model (θ: the trainable state, with its floating
    buffers; frozen: the rest of its parameters), or BaseError naming the tensor that does not fit."""
    mine = {**{n: (s, True) for n, s in theta.items()}, **{n: (s, False) for n, s in frozen.items()}}
    plain: dict[str, str | None] = {}
    for n in mine:
        p = _plain(n)
        plain[p] = None if p in plain else n  # two model tensors with one plain name: match neither
    out, seen = [], set()
    for i, t in enumerate(tensors):
        name = t.name if t.name in mine else plain.get(_plain(t.name))
        if name is None or name in seen:
            raise Misfit(f"tensor {t.name} is not in the model")
        seen.add(name)
        want, is_theta = mine[name]
        if tuple(t.shape) != tuple(want):
            raise Misfit(f"tensor {t.name} has shape {list(t.shape)}, the model's {name} {list(want)}")
        out.append(Place(i, name, is_theta))
    for part, names in (("trainable", theta), ("frozen", frozen)):
        got = [n for n in names if n in seen]
        if got and len(got) < len(names):
            missing = next(n for n in sorted(names) if n not in seen)
            raise Misfit(f"holds {len(got)} of the model's {len(names)} {part} tensors; {missing} is missing")
    return out


def model_state(model: Any) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(θ's shapes: trainable parameters and floating persistent buffers, frozen parameters' shapes)
    of a torch module, as the torch worker splits it."""
    named = sorted(model.named_parameters())
    theta = {n: tuple(p.shape) for n, p in named if p.requires_grad}
    persistent = model.state_dict(keep_vars=True).keys()
    theta.update({n: tuple(b.shape) for n, b in model.named_buffers() if b.is_floating_point() and n in persistent})
    return theta, {n: tuple(p.shape) for n, p in named if not p.requires_grad}


def task_state(task: Any, cfg: dict) -> tuple[dict[str, tuple], dict[str, tuple]] | None:
    """The model's state shapes, built on torch's meta device (no memory, no weights): None for a
    task that builds its model otherwise, or that cannot be built so (its nodes check instead)."""
    if not callable(getattr(task, "make_model", None)):
        return None
    try:
        import torch

        with torch.device("meta"):
            model = task.make_model(cfg)
        if not isinstance(model, torch.nn.Module):
            return None
        return model_state(model)
    except Exception:  # the nodes build it for real, and check the manifest before any fetch
        log.debug("init_weights: the task's model could not be built on the meta device", exc_info=True)
        return None


# --- the holder --------------------------------------------------------------------------------


class BaseServer:
    """Serves the manifest and the tensors of one weights file to peers that are `allowed`."""

    def __init__(self, stored: list[Stored], allowed: Callable[[str], bool] = lambda peer: False) -> None:
        self.stored = stored
        self.manifest = Manifest(tuple(s.tensor for s in stored))
        self.blob = self.manifest.encode()
        self.root = digest(self.blob)
        self.allowed = allowed
        self.sent = 0  # tensor bytes served (a test can see nothing was fetched)
        self._clients = 0

    @classmethod
    def open(cls, path: Path, task_shapes: tuple[dict, dict] | None, allowed: Callable[[str], bool]) -> BaseServer:
        """Read and digest the file; BaseError naming the file and the tensor if it does not fit
        the task's model (when its shapes are known)."""
        stored = read_weights(path)
        if task_shapes is not None:
            try:
                fit(tuple(s.tensor for s in stored), *task_shapes)
            except Misfit as e:
                bad = next((s.file for s in stored if f"tensor {s.tensor.name} " in str(e)), path)
                raise Misfit(f"{bad}: {e}") from None
        return cls(stored, allowed)

    def source(self, tickets: list[str], theta: bool) -> P.BaseSource:
        return P.BaseSource(root=self.root, size=self.manifest.size, tickets=tickets, theta=theta)

    async def handle(self, conn: iroh.Connection, on_drop=None, on_stranger=None) -> None:
        """Requests on one stream until the peer hangs up: ``{"get": "manifest"}`` or ``{"get": i}``
        (tensor i of the manifest); each answer is a frame with its size, then its bytes."""
        drop = on_drop or (lambda peer, why: log.warning("dropping base request from %s: %s", peer[:10], why))
        peer = peer_of(conn)
        if not self.allowed(peer):
            (on_stranger or drop)(peer, "base request refused: not a member of this run")
            close_conn(conn, "not a member of this run")
            return
        if self._clients >= MAX_CLIENTS:
            drop(peer, "base request refused: too many in progress")
            close_conn(conn, "busy")
            return
        self._clients += 1
        try:
            ch = await Endpoint.accept_channel(conn, timeout=TIMEOUT)
            while True:
                try:
                    frame = await ch.recv_frame(MAX_REQUEST, timeout=IDLE_S)
                except TransportError:
                    return  # the peer has all it wanted (or went quiet)
                await self._answer(ch, frame)
        except (BaseError, TransportError) as e:
            drop(peer, P.printable(str(e), 300))
        finally:
            self._clients -= 1
            close_conn(conn, "done", code=0)

    async def _answer(self, ch: Channel, frame: bytes) -> None:
        try:
            want = json.loads(frame)["get"]
        except (ValueError, TypeError, KeyError, RecursionError):
            raise BaseError('base request is not {"get": ...}') from None
        if want == "manifest":
            await ch.send_frame(json.dumps({"size": len(self.blob)}).encode())
            for i in range(0, len(self.blob), FRAME):
                await ch.send_frame(self.blob[i : i + FRAME])
            return
        if type(want) is not int or not 0 <= want < len(self.stored):
            raise BaseError(f"base request for tensor {P.printable(str(want), 40)}: no such tensor")
        s = self.stored[want]
        n = s.tensor.size
        await ch.send_frame(json.dumps({"size": n}).encode())
        end = time.monotonic() + TIMEOUT + n / MIN_RATE
        with open(s.file, "rb") as fh:  # read now: what the holder's disk holds is what it sends
            fh.seek(s.offset)
            for chunk in _chunks(fh, n):
                if (left := end - time.monotonic()) <= 0:
                    raise BaseError(f"reader too slow for tensor {s.tensor.name}")
                await ch.send_frame(chunk, timeout=min(TIMEOUT, left))
                self.sent += len(chunk)


# --- a node ------------------------------------------------------------------------------------


@dataclass
class Fetched:
    manifest: Manifest
    cached: int  # tensors found in the cache (or equal to one fetched before them)
    fetched: int  # tensors fetched now
    bytes: int  # tensor bytes fetched now


class BaseCache:
    """Tensors by digest and manifests by root under one directory; each file written atomically."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / key

    def read(self, key: str, size: int) -> bytes | None:
        """The cached bytes of `key` if they are there and match it (a bad file is removed)."""
        p = self.path(key)
        try:
            if p.stat().st_size != size:
                raise OSError
            data = p.read_bytes()
        except OSError:
            return None
        if digest(data) != key:
            log.warning("base cache: %s does not match its digest; removed", p)
            p.unlink(missing_ok=True)
            return None
        return data

    def has(self, t: Tensor) -> bool:
        p = self.path(t.digest)
        return p.is_file() and p.stat().st_size == t.size

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[Any]:
        """A file to write `key`'s bytes to: in place (fsynced, renamed) once the block ends, gone
        if it raises."""
        tmp = self.root / f".{key}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path(key))
        finally:
            tmp.unlink(missing_ok=True)


async def _read(ch: Channel, size_cap: int, sink: Callable[[bytes], None]) -> int:
    head = json.loads(await ch.recv_frame(256, timeout=TIMEOUT))
    n = head.get("size") if isinstance(head, dict) else None
    if type(n) is not int or not 0 <= n <= size_cap:
        raise BaseError(f"the holder announced {P.printable(str(n), 40)} bytes, expected at most {size_cap}")
    got, end = 0, time.monotonic() + TIMEOUT + n / MIN_RATE
    while got < n:
        left = end - time.monotonic()
        if left <= 0:
            raise BaseError(f"transfer too slow: {n} bytes not received within {TIMEOUT:g} s + {MIN_RATE >> 20} MiB/s")
        frame = await ch.recv_frame(min(FRAME, n - got), timeout=min(TIMEOUT, left))
        if not frame:
            raise BaseError("the holder sent an empty frame")
        sink(frame)
        got += len(frame)
    return n


async def fetch_base(
    endpoint: Endpoint,
    src: P.BaseSource,
    cache: BaseCache,
    check: Callable[[Manifest], Any] = lambda m: None,
) -> Fetched:
    """The manifest `src` announces (from the cache, else a holder), passed to `check` (which
    raises BaseError for a file that does not fit: then nothing else is fetched), and every tensor
    of it in the cache, each verified against its digest. BaseError if no holder can serve it all."""
    blob, p = None, cache.path(src.root)
    if p.is_file() and p.stat().st_size <= MAX_MANIFEST:
        data = p.read_bytes()
        blob = data if digest(data) == src.root else None
    errors: list[str] = []
    manifest: Manifest | None = None if blob is None else Manifest.decode(blob)
    if manifest is not None:
        check(manifest)
    if manifest is not None and all(cache.has(t) for t in manifest.tensors):
        return Fetched(manifest, len(manifest.tensors), 0, 0)
    fetched = nbytes = 0
    for i, ticket in enumerate(src.tickets):
        who = "the coordinator" if i == 0 else f"holder {ticket[:20]}..."
        try:
            ch = await endpoint.connect(ticket, BASE_ALPN, timeout=TIMEOUT)
        except TransportError as e:
            errors.append(f"init_weights from {who}: {e}")
            continue
        try:
            if manifest is None:
                parts: list[bytes] = []
                await ch.send_frame(b'{"get":"manifest"}')
                await _read(ch, MAX_MANIFEST, parts.append)
                blob = b"".join(parts)
                if digest(blob) != src.root:
                    raise BaseError("its manifest is not the one the coordinator announced")
                manifest = Manifest.decode(blob)
                check(manifest)  # before a single tensor: a file that does not fit is refused here
                with cache.writing(src.root) as fh:
                    fh.write(blob)
            for j, t in enumerate(manifest.tensors):
                if cache.has(t):
                    continue
                h = hashlib.blake2b(digest_size=DIGEST)
                with cache.writing(t.digest) as fh:  # streamed to disk: a tensor is never held whole

                    def take(frame: bytes, h=h, fh=fh) -> None:
                        h.update(frame)
                        fh.write(frame)

                    await ch.send_frame(json.dumps({"get": j}).encode())
                    n = await _read(ch, t.size, take)
                    if n != t.size or h.hexdigest() != t.digest:
                        raise BaseError(
                            f"tensor {t.name}: its bytes do not match the manifest's digest {t.digest[:12]}; refused"
                        )
                fetched, nbytes = fetched + 1, nbytes + n
            return Fetched(manifest, len(manifest.tensors) - fetched, fetched, nbytes)
        except Misfit:
            raise  # the file does not fit this model: no other holder changes that
        except (BaseError, TransportError) as e:
            errors.append(f"init_weights from {who}: {e}")
        finally:
            with contextlib.suppress(Exception):
                ch.close("done")
    raise BaseError("; ".join(errors or ["no holder to ask"]))


def tensors(cache: BaseCache, manifest: Manifest, places: list[Place]) -> Iterator[tuple[Place, np.ndarray]]:
    """Each placed tensor from the cache as float32, checked against its digest once more."""
    for p in places:
        t = manifest.tensors[p.index]
        data = cache.read(t.digest, t.size)
        if data is None:
            raise BaseError(f"tensor {t.name}: the cached copy is gone or damaged; run again to fetch it")
        yield p, as_float32(t, data)


async def take(
    endpoint: Endpoint, src: P.BaseSource, worker: Any, layout: Any, theta: np.ndarray, cache: BaseCache
) -> Fetched:
    """A node's side: the file's frozen tensors into `worker`'s model, and (when `src.theta`) its
    trainable ones into θ₀ (`theta`, laid out by `layout`). The manifest is checked against this
    model before any tensor is fetched; BaseError (Misfit: it does not fit) otherwise, a line
    that says so."""
    shapes = dict(zip(layout.names, layout.shapes, strict=True))
    frozen = worker.frozen_shapes()
    plan: list[Place] = []

    def check(m: Manifest) -> None:
        plan[:] = fit(m.tensors, shapes, frozen)

    try:
        got = await fetch_base(endpoint, src, cache, check)
    except Misfit as e:
        raise Misfit(f"init_weights do not fit this model: {e}") from None
    where = {name: sl for name, sl, _ in layout.slices()}
    for p, a in tensors(cache, got.manifest, plan):
        if not p.theta:
            worker.set_frozen({p.name: a})
        elif src.theta:
            theta[where[p.name]] = a.ravel()
    return got
