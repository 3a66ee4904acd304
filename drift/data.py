"""Data that lives on one machine (recipe ``data:``): nodes that cannot open the task's dataset
themselves get the samples of their granted units from a data holder, ALPN ``drift-data/0``.

The holder (the coordinator) opens the dataset with the task's own ``make_dataset(cfg)`` and
publishes a manifest at start: the layout of one sample (the arrays ``batch(split, indices)``
returns, one row per sample) and a digest of every sample of both splits. Its digest travels in
TrainConfig, which comes from the coordinator the node dialled, so a holder cannot swap the
data: every sample a node receives is checked against the manifest before it is used, and one
that fails is fetched again (and reported: ``DataReport(kind="bad_chunk")``).

A node keeps what it fetched in an on-disk cache under ``$DRIFT_HOME/data`` within
``data.cache_mb`` (least recently used files go first; each file is written to a temporary name
and renamed, and checked against the manifest when read). The inner loop asks for a unit's
samples as soon as the unit is granted, so the next unit is in flight while this one trains.

Everything from a holder is untrusted: frames are capped, every read has a timeout, a transfer
slower than MIN_RATE is given up, and the next holder (or the same one, later) is asked instead.
A node whose data no holder can serve says so and sits out until one can.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import os
import secrets
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import iroh
import numpy as np

from drift import protocol as P
from drift.transport import (
    DATA_ALPN,
    Channel,
    Endpoint,
    TransportError,
    TransportTimeout,
    close_conn,
    parse_ticket,
    peer_of,
)

log = logging.getLogger("drift.data")

DIGEST = 16  # bytes of blake2b per sample
SPLITS = ("train", "val")
MAX_FIELDS = 16  # arrays in one sample
MAX_RECORD = 1 << 24  # bytes in one sample
MAX_SAMPLES = 1 << 24  # per split: bounds the manifest (16 bytes each)
MAX_REQUEST = 1 << 16  # bytes of one request frame (JSON)
MAX_HEADER = 1 << 16  # bytes of a response's header
MAX_INDICES = 2048  # samples per request (a unit is asked for in pieces of this many)
MAX_REPLY = 64 << 20  # bytes of samples in one reply (fewer samples per request when they are large)
FRAME = 1 << 20  # bytes of one data frame
TIMEOUT = 20.0  # connecting, and each frame
IDLE_S = 300.0  # a client connection with no request for this long is closed by the holder
MIN_RATE = 256 << 10  # bytes/s: a transfer slower than this (after TIMEOUT) is given up
MAX_CLIENTS = 64
MAX_CLIENTS_PER_PEER = 4  # of those, from one peer: one member cannot hold every slot
RETRY_S = (0.5, 10.0)  # backoff between rounds of asking every holder, while none can serve
SYNC_PATIENCE_S = 3600.0  # batch() outside the prefetch path waits at most this long for data


class DataError(Exception):
    """The data cannot be served, or what a holder sent is not usable; str() is for the operator."""


class DataUnavailable(DataError):
    """No holder could serve these samples now."""


# --- what one sample is ----------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    key: str  # the dict key, or the tuple position as a string
    dtype: str  # numpy's dtype.str, e.g. "<u2"
    shape: tuple[int, ...]  # of one sample

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))


@dataclass(frozen=True)
class Layout:
    """How one sample's arrays pack into one fixed-size record of bytes."""

    kind: str  # "tuple" or "dict": what batch() returns
    columns: tuple[Column, ...]

    @property
    def record(self) -> int:
        return sum(c.nbytes for c in self.columns)

    @classmethod
    def of(cls, batch: Any, n: int) -> Layout:
        kind, items = _items(batch)
        cols = []
        for key, a in items:
            a = _numpy(a)
            if a.ndim < 1 or a.shape[0] != n:
                raise DataError(
                    f"batch() returned {key!r} with shape {tuple(a.shape)}: to be served, every array needs one row "
                    f"per sample ({n} here)"
                )
            if a.dtype.hasobject:
                raise DataError(f"batch() returned {key!r} of dtype object: only numeric arrays can be served")
            cols.append(Column(key, a.dtype.str, tuple(int(d) for d in a.shape[1:])))
        return cls(kind, tuple(cols))

    def rows(self, batch: Any, n: int) -> np.ndarray:
        """batch() -> (n, record) uint8, checked against this layout."""
        if Layout.of(batch, n) != self:
            raise DataError("batch() returned arrays of another shape or dtype than its first batch")
        parts = [np.ascontiguousarray(_numpy(a)).reshape(n, -1).view(np.uint8) for _, a in _items(batch)[1]]
        return np.ascontiguousarray(np.concatenate(parts, axis=1)) if len(parts) > 1 else parts[0]

    def batch(self, rows: np.ndarray) -> Any:
        """(n, record) uint8 -> what the task's batch() returned (numpy arrays)."""
        out, at, n = [], 0, rows.shape[0]
        for c in self.columns:
            part = np.ascontiguousarray(rows[:, at : at + c.nbytes])
            out.append((c.key, part.view(np.dtype(c.dtype)).reshape((n, *c.shape))))
            at += c.nbytes
        return dict(out) if self.kind == "dict" else tuple(a for _, a in out)

    def to_json(self) -> dict:
        return {"kind": self.kind, "columns": [[c.key, c.dtype, list(c.shape)] for c in self.columns]}

    @classmethod
    def from_json(cls, obj: Any) -> Layout:
        try:
            kind, cols = obj["kind"], obj["columns"]
            if kind not in ("tuple", "dict") or not isinstance(cols, list) or not 1 <= len(cols) <= MAX_FIELDS:
                raise ValueError
            columns = []
            for key, dtype, shape in cols:
                if not (isinstance(key, str) and len(key) <= 64 and isinstance(dtype, str) and len(dtype) <= 8):
                    raise ValueError
                if not (
                    isinstance(shape, list)
                    and len(shape) <= 8
                    and all(type(d) is int and 0 <= d < 2**31 for d in shape)
                ):
                    raise ValueError
                if np.dtype(dtype).hasobject:
                    raise ValueError
                columns.append(Column(key, np.dtype(dtype).str, tuple(shape)))
            layout = cls(kind, tuple(columns))
        except (ValueError, TypeError, KeyError):
            raise DataError("the holder's sample layout is malformed") from None
        if not 0 < layout.record <= MAX_RECORD:
            raise DataError(f"the holder's samples are {layout.record} bytes each (at most {MAX_RECORD})")
        return layout


def _items(batch: Any) -> tuple[str, list[tuple[str, Any]]]:
    if isinstance(batch, dict):
        if not 1 <= len(batch) <= MAX_FIELDS:
            raise DataError(f"batch() returned a dict of {len(batch)} arrays (1 to {MAX_FIELDS} can be served)")
        return "dict", [(str(k), v) for k, v in batch.items()]
    if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= MAX_FIELDS:
        return "tuple", [(str(i), v) for i, v in enumerate(batch)]
    raise DataError(f"batch() returned {type(batch).__name__}: a dict or a tuple of arrays can be served")


def _numpy(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):  # a torch tensor (drift's data side imports no framework)
        a = a.detach().cpu().numpy()
    return np.asarray(a)


def digests(rows: np.ndarray) -> np.ndarray:
    """The blake2b digest of every row: (n, DIGEST) uint8."""
    out = np.empty((rows.shape[0], DIGEST), np.uint8)
    for i in range(rows.shape[0]):
        out[i] = np.frombuffer(hashlib.blake2b(rows[i].data, digest_size=DIGEST).digest(), np.uint8)
    return out


# --- the manifest ------------------------------------------------------------------------------


@dataclass
class Manifest:
    layout: Layout
    n: dict[str, int]  # samples per split
    vocab_size: int | None
    sums: dict[str, np.ndarray]  # split -> (n, DIGEST) uint8

    def header(self) -> dict:
        return {"layout": self.layout.to_json(), "n": self.n, "vocab_size": self.vocab_size}

    def encode(self) -> bytes:
        """The manifest as bytes: a JSON header (its length first), then every digest."""
        head = json.dumps(self.header(), sort_keys=True, separators=(",", ":")).encode()
        return len(head).to_bytes(4, "big") + head + b"".join(self.sums[s].tobytes() for s in SPLITS)

    @functools.cached_property
    def root(self) -> str:
        return blob_root(self.encode())

    @classmethod
    def decode(cls, blob: bytes) -> Manifest:
        try:
            k = int.from_bytes(blob[:4], "big")
            if not 0 < k <= MAX_HEADER:
                raise ValueError
            head = json.loads(blob[4 : 4 + k])
            n = {s: head["n"][s] for s in SPLITS}
            vocab = head.get("vocab_size")
            if not all(type(v) is int and 0 <= v <= MAX_SAMPLES for v in n.values()):
                raise ValueError
            if vocab is not None and not (type(vocab) is int and 0 < vocab < 2**31):
                raise ValueError
            layout = Layout.from_json(head["layout"])
        except (ValueError, TypeError, KeyError, RecursionError):
            raise DataError("the holder's manifest is malformed") from None
        body = np.frombuffer(blob, np.uint8, offset=4 + k)
        if body.size != DIGEST * (n["train"] + n["val"]):
            raise DataError("the holder's manifest has the wrong number of digests")
        sums = {"train": body[: DIGEST * n["train"]].reshape(-1, DIGEST)}
        sums["val"] = body[DIGEST * n["train"] :].reshape(-1, DIGEST)
        return cls(layout, n, vocab, sums)


def build_manifest(dataset: Any, block: int = 1024) -> Manifest:
    """Read every sample of both splits once (batch() of `block` at a time) and digest it."""
    n = {"train": int(dataset.n_train), "val": int(dataset.n_val)}
    if not all(0 <= v <= MAX_SAMPLES for v in n.values()) or n["train"] < 1:
        raise DataError(f"the dataset has {n['train']} training samples: 1 to {MAX_SAMPLES} can be served")
    layout: Layout | None = None
    sums = {}
    for split in SPLITS:
        out = np.empty((n[split], DIGEST), np.uint8)
        for lo in range(0, n[split], block):
            idx = np.arange(lo, min(lo + block, n[split]))
            b = dataset.batch(split, idx)
            layout = layout or Layout.of(b, len(idx))
            out[lo : lo + len(idx)] = digests(layout.rows(b, len(idx)))
        sums[split] = out
    assert layout is not None
    vocab = getattr(dataset, "vocab_size", None)
    return Manifest(layout, n, int(vocab) if vocab is not None else None, sums)


# --- the holder's side -------------------------------------------------------------------------


def _parse_request(frame: bytes) -> dict:
    try:
        req = json.loads(frame.decode("utf-8"))
    except (ValueError, RecursionError):
        raise DataError("data request is not JSON") from None
    if req == {"manifest": True}:
        return req
    ok = (
        isinstance(req, dict)
        and set(req) == {"split", "indices"}
        and req["split"] in SPLITS
        and isinstance(req["indices"], list)
        and 1 <= len(req["indices"]) <= MAX_INDICES
        and all(type(i) is int and 0 <= i < MAX_SAMPLES for i in req["indices"])
    )
    if not ok:
        raise DataError(f'data request is not {{"split": train|val, "indices": [1..{MAX_INDICES} ints]}}')
    return req


class DataServer:
    """Serves the samples of a dataset this process opened to peers that are `allowed`."""

    def __init__(self, dataset: Any, manifest: Manifest, allowed: Callable[[str], bool]) -> None:
        self.dataset, self.manifest, self.allowed = dataset, manifest, allowed
        self.blob = manifest.encode()
        self.root = blob_root(self.blob)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="drift-data")  # batch() one at a time
        self._clients = 0
        self._by_peer: dict[str, int] = {}  # connections served now, per peer (MAX_CLIENTS_PER_PEER)

    async def handle(
        self,
        conn: iroh.Connection,
        on_drop: Callable[[str, str], None] | None = None,
        on_stranger: Callable[[str, str], None] | None = None,
    ) -> None:
        """Requests on one connection until the peer hangs up or goes idle; whatever it sends ends,
        at worst, in one on_drop(peer, why). A peer that is not `allowed` is closed before anything
        is read, holding no slot, and reported to on_stranger (default: on_drop; pass a Throttle)."""
        drop = on_drop or (lambda peer, why: log.warning("dropping a data request from %s: %s", peer[:10], why))
        peer = peer_of(conn)
        try:
            if not self.allowed(peer):
                (on_stranger or drop)(peer, "data request refused: not a member of this run")
                close_conn(conn, "not a member of this run")
                return
            if self._by_peer.get(peer, 0) >= MAX_CLIENTS_PER_PEER:
                raise DataError(f"refused: {MAX_CLIENTS_PER_PEER} data connections from this peer already")
            if self._clients >= MAX_CLIENTS:
                raise DataError("refused: too many data clients")
            self._clients += 1
            self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
            try:
                ch = await Endpoint.accept_channel(conn, timeout=TIMEOUT)
                while True:
                    try:
                        frame = await ch.recv_frame(MAX_REQUEST, timeout=IDLE_S)
                    except TransportError:
                        return  # the peer hung up, or idled out
                    await self._answer(ch, _parse_request(frame))
            finally:
                self._clients -= 1
                if (left := self._by_peer.pop(peer) - 1) > 0:
                    self._by_peer[peer] = left
        except Exception as e:
            drop(
                peer, P.printable(e if isinstance(e, (DataError, TransportError)) else f"{type(e).__name__}: {e}", 300)
            )
        finally:
            with contextlib.suppress(Exception):
                conn.close(0, b"done")

    async def _answer(self, ch: Channel, req: dict) -> None:
        if "manifest" in req:
            await ch.send_frame(json.dumps({"bytes": len(self.blob)}).encode())
            await self._send_bytes(ch, self.blob)
            return
        split, idx = req["split"], np.asarray(req["indices"], np.int64)
        if idx.size > per_request(self.manifest.layout.record):
            raise DataError(f"data request for {idx.size} samples: at most {MAX_REPLY >> 20} MiB a reply")
        if int(idx.max()) >= self.manifest.n[split]:
            raise DataError(f"data request for {split} sample {int(idx.max())}: there are {self.manifest.n[split]}")
        loop = asyncio.get_running_loop()
        try:
            rows = await loop.run_in_executor(
                self._pool, lambda: self.manifest.layout.rows(self.dataset.batch(split, idx), len(idx))
            )
        except Exception as e:  # the data went away under us (a disk unmounted, a file moved)
            why = P.printable(f"{type(e).__name__}: {e}", 300)
            log.warning("data: cannot read %d %s samples: %s", len(idx), split, why)
            await ch.send_frame(json.dumps({"error": f"unavailable: {why}"}).encode())
            return
        await ch.send_frame(json.dumps({"samples": len(idx)}).encode())
        await self._send_bytes(ch, rows)

    async def _send_bytes(self, ch: Channel, data: bytes | np.ndarray) -> None:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), FRAME):
            await ch.send_frame(view[i : i + FRAME], timeout=TIMEOUT)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def open_holder(task: types.ModuleType, task_config: dict, allowed: Callable[[str], bool]) -> DataServer:
    """The dataset of `task` opened here, its manifest built: a server for it. DataError (one line)
    if this machine cannot open it or its batches cannot be served."""
    try:
        dataset = task.make_dataset(task_config)
    except Exception as e:
        raise DataError(f"the task's make_dataset() failed here: {type(e).__name__}: {e}".splitlines()[0]) from None
    return DataServer(dataset, build_manifest(dataset), allowed)


# --- the node's side: the cache ----------------------------------------------------------------

_MAGIC = b"DRIFTDC1"


class DiskCache:
    """Samples on disk, one file per fetched piece, at most `limit` bytes (least recently used
    files are deleted first). Index: per split, which file and row holds each sample."""

    def __init__(self, root: Path, manifest: Manifest, limit: int) -> None:
        self.root, self.manifest, self.limit = root, manifest, limit
        self.record = manifest.layout.record
        self.root.mkdir(parents=True, exist_ok=True)
        self._file = {s: np.full(manifest.n[s], -1, np.int64) for s in SPLITS}
        self._row = {s: np.zeros(manifest.n[s], np.int64) for s in SPLITS}
        self._files: OrderedDict[int, tuple[str, np.ndarray, int]] = OrderedDict()  # id -> (split, indices, bytes)
        self._lock = threading.Lock()  # the loop thread reads, the node's event loop writes
        self._checked: set[int] = set()  # files whose every row passed its digest in this process
        self.bytes = 0
        self.evicted = 0
        for p in sorted(self.root.glob("*"), key=lambda p: p.stat().st_mtime):
            if p.suffix != ".rows" or not self._adopt(p):
                p.unlink(missing_ok=True)  # a temporary file of a write that died, or a stray
        self._evict()

    def _path(self, fid: int) -> Path:
        return self.root / f"{fid:016x}.rows"

    def _adopt(self, p: Path) -> bool:
        try:
            fid = int(p.stem, 16)
            with open(p, "rb") as f:
                head = f.read(17)
                if len(head) != 17 or head[:8] != _MAGIC or head[8] > 1:
                    return False
                split, k = SPLITS[head[8]], int.from_bytes(head[9:17], "big")
                idx = np.frombuffer(f.read(8 * k), np.int64)
            size = p.stat().st_size
            if (
                idx.size != k
                or size != 17 + 8 * k + k * self.record
                or (idx.size and idx.max() >= self.manifest.n[split])
            ):
                return False
        except (OSError, ValueError):
            return False
        self._index(fid, split, idx, size)
        return True

    def _index(self, fid: int, split: str, idx: np.ndarray, size: int) -> None:
        self._file[split][idx] = fid
        self._row[split][idx] = np.arange(idx.size)
        self._files[fid] = (split, idx, size)
        self.bytes += size

    def missing(self, split: str, idx: np.ndarray) -> np.ndarray:
        with self._lock:
            return idx[self._file[split][idx] < 0]

    def put(self, split: str, idx: np.ndarray, rows: np.ndarray) -> None:
        """Store verified rows (one file, written under a temporary name, then renamed)."""
        fid = secrets.randbits(63)
        path = self._path(fid)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_MAGIC + bytes([SPLITS.index(split)]) + len(idx).to_bytes(8, "big"))
            f.write(idx.astype(np.int64).tobytes())
            f.write(rows.tobytes())
        os.replace(tmp, path)
        with self._lock:
            self._index(fid, split, idx.astype(np.int64), path.stat().st_size)
            self._checked.add(fid)  # (its rows were verified before they were written)
            self._evict(keep=fid)

    def _evict(self, keep: int | None = None) -> None:
        while self.bytes > self.limit and self._files:
            fid = next(iter(self._files))
            if fid == keep:
                if len(self._files) == 1:
                    break
                self._files.move_to_end(fid)
                continue
            self._drop(fid)
            self.evicted += 1

    def _drop(self, fid: int) -> None:
        split, idx, size = self._files.pop(fid)
        self._checked.discard(fid)
        mine = self._file[split][idx] == fid  # (a later file may hold some of these samples again)
        self._file[split][idx[mine]] = -1
        self.bytes -= size
        self._path(fid).unlink(missing_ok=True)

    def read(self, split: str, idx: np.ndarray) -> np.ndarray | None:
        """The rows of these samples, checked against the manifest; None if any is missing (or
        failed its check: its file is dropped, to be fetched again). A file is checked whole at
        its first read in this process (one an earlier run left) and trusted after that, as are
        the files this process wrote (verified before writing): a training step pays for reading
        its batch, not a digest of every sample at every step."""
        out = np.empty((idx.size, self.record), np.uint8)
        with self._lock:
            fids, rows = self._file[split][idx], self._row[split][idx]
            if (fids < 0).any():
                return None
            files = [int(f) for f in np.unique(fids)]
            for fid in files:
                self._files.move_to_end(fid)
            for fid in files:
                sel = np.flatnonzero(fids == fid)
                if not self._read_rows(fid, split, rows[sel], out, sel):
                    log.warning("data: cached samples failed their digest or cannot be read; fetching them again")
                    self._drop(fid)
                    return None
        return out

    def _read_rows(self, fid: int, split: str, rows: np.ndarray, out: np.ndarray, sel: np.ndarray) -> bool:
        fidx = self._files[fid][1]
        base = 17 + 8 * fidx.size
        try:
            if fid not in self._checked:
                body = np.fromfile(self._path(fid), np.uint8, offset=base)
                if body.size != fidx.size * self.record:
                    return False
                body = body.reshape(fidx.size, -1)
                if (digests(body) != self.manifest.sums[split][fidx]).any():
                    return False
                self._checked.add(fid)
                out[sel] = body[rows]
                return True
            with open(self._path(fid), "rb", buffering=0) as f:
                fd = f.fileno()
                for j, r in zip(sel.tolist(), rows.tolist()):
                    if os.preadv(fd, [out[j]], base + r * self.record) != self.record:
                        return False
            return True
        except (OSError, ValueError):
            return False


# --- the node's side: fetching ------------------------------------------------------------------


@dataclass
class Stats:
    samples: int = 0  # received and verified
    bytes: int = 0  # received on the data ALPN (frames included)
    bad: int = 0  # samples that failed their digest


@dataclass
class _Holder:
    ticket: str
    id: str
    ch: Channel | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class DataClient:
    """A node's view of the served data: the manifest, the cache, the holders it asks."""

    def __init__(self, endpoint: Endpoint, manifest: Manifest, tickets: list[str], cache: DiskCache) -> None:
        self.endpoint, self.manifest, self.cache = endpoint, manifest, cache
        self.holders = [_Holder(t, _ticket_id(t)) for t in tickets]
        self.stats = Stats()
        self.loop = asyncio.get_running_loop()
        self._early: list[P.DataReport] = []  # reports made before the node is admitted (calibration)
        self.report: Callable[[P.DataReport], None] = self._early.append  # to the coordinator: see attach()
        self.round = -1  # the round being trained (for reports)
        self.in_use = False  # a ServedDataset reads from this client (not: the node has the data itself)
        self.local: Any = None  # the node's own copy, when it matches the manifest (it may serve it too)
        self._jobs: dict[tuple[str, bytes], asyncio.Task] = {}
        self._out: str | None = None  # why no holder could serve, while that lasts

    @classmethod
    async def open(cls, endpoint: Endpoint, src: P.DataSource, cache_root: Path, cache_bytes: int) -> DataClient:
        """Fetch the manifest from the first holder that has it and matches src.root."""
        errors = []
        for ticket in src.tickets:
            try:
                ch = await endpoint.connect(ticket, DATA_ALPN, timeout=TIMEOUT)
                try:
                    await ch.send_frame(json.dumps({"manifest": True}).encode())
                    head = json.loads(await ch.recv_frame(MAX_HEADER, timeout=TIMEOUT))
                    size = head.get("bytes") if isinstance(head, dict) else None
                    if type(size) is not int or not 0 < size <= src.size:
                        raise DataError(f"the holder's manifest is {size} bytes, expected {src.size}")
                    parts, got = [], 0
                    while got < size:
                        part = await ch.recv_frame(min(FRAME, size - got), timeout=TIMEOUT)
                        if not part:
                            raise DataError("the holder sent an empty frame")
                        parts.append(part)
                        got += len(part)
                finally:
                    ch.close("manifest received")
                blob = b"".join(parts)
                if blob_root(blob) != src.root:
                    raise DataError("the holder's manifest is not the one the coordinator named")
                manifest = Manifest.decode(blob)
                cache = DiskCache(cache_root / src.root, manifest, cache_bytes)
                return cls(endpoint, manifest, list(src.tickets), cache)
            except (DataError, TransportError, ValueError) as e:
                errors.append(f"{ticket[:20]}...: {e}")
        raise DataError("no data holder could hand over the manifest: " + "; ".join(errors or ["no holder named"]))

    def set_holders(self, tickets: list[str]) -> None:
        """Who serves the data now (the coordinator's DataHolders): kept connections are kept;
        this node itself is left out."""
        have = {h.ticket: h for h in self.holders}
        me = self.endpoint.node_id
        fresh = [have.get(t) or _Holder(t, _ticket_id(t)) for t in dict.fromkeys(tickets)]
        for h in self.holders:
            if h not in fresh and h.ch is not None:
                h.ch.close("no longer a data holder")
                h.ch = None
        self.holders = [h for h in fresh if h.id != me]

    def attach(self, send: Callable[[P.DataReport], None]) -> None:
        """From now on reports go to `send` (the coordinator); those made before go now."""
        self.report = send
        early, self._early = self._early[-8:], []
        for msg in early:
            send(msg)

    # --- fetching ---

    def prefetch(self, split: str, idx: np.ndarray) -> asyncio.Task:
        """Start fetching what the cache lacks of these samples (one task per distinct request)."""
        key = (split, idx.tobytes())
        job = self._jobs.get(key)
        if job is None or job.done():
            job = self._jobs[key] = asyncio.ensure_future(self.fetch(split, idx))
            job.add_done_callback(lambda j, key=key: self._jobs.pop(key, None) if self._jobs.get(key) is j else None)
            job.add_done_callback(lambda j: j.cancelled() or j.exception())  # read: never "never retrieved"
        return job

    async def fetch(self, split: str, idx: np.ndarray) -> None:
        """Make these samples cached, verified; DataUnavailable when no holder can serve them."""
        want = self.cache.missing(split, np.asarray(idx, np.int64))
        want, k = np.unique(want), per_request(self.manifest.layout.record)
        for lo in range(0, want.size, k):
            await self._fetch_piece(split, want[lo : lo + k])

    async def _fetch_piece(self, split: str, idx: np.ndarray) -> None:
        errors: list[str] = []
        for h in list(self.holders):
            for _ in range(2):  # a bad chunk is fetched again, from the same holder once, then the next
                try:
                    rows = await self._ask(h, split, idx)
                except (DataError, TransportError) as e:
                    errors.append(f"{h.id[:10]}: {e}")
                    break
                bad = np.flatnonzero((digests(rows) != self.manifest.sums[split][idx]).any(axis=1))
                good = np.setdiff1d(np.arange(idx.size), bad)
                if good.size:
                    self.cache.put(split, idx[good], rows[good])
                    self.stats.samples += good.size
                if not bad.size:
                    if h in self.holders and self.holders[0] is not h:  # ask the one that served first next time
                        self.holders.remove(h)
                        self.holders.insert(0, h)
                    self._back()
                    return
                self.stats.bad += bad.size
                why = f"{bad.size} of {idx.size} {split} samples from {h.id[:10]} failed their digest; fetching them again"
                log.warning("data: %s", why)
                self.report(
                    P.DataReport(kind="bad_chunk", round=self.round, samples=int(bad.size), holder=h.id, reason=why)
                )
                idx = idx[bad]
        why = f"no data holder could serve {idx.size} {split} samples (" + "; ".join(errors[-3:] or ["no holder"]) + ")"
        raise DataUnavailable(why)

    async def _ask(self, h: _Holder, split: str, idx: np.ndarray) -> np.ndarray:
        """One request to one holder over its (kept) connection; the rows, unverified."""
        async with h.lock:
            try:
                if h.ch is None:
                    h.ch = await self.endpoint.connect(h.ticket, DATA_ALPN, timeout=TIMEOUT)
                ch = h.ch
                before = ch.bytes_received
                await ch.send_frame(json.dumps({"split": split, "indices": idx.tolist()}).encode(), timeout=TIMEOUT)
                try:
                    head = json.loads(await ch.recv_frame(MAX_HEADER, timeout=TIMEOUT))
                except (ValueError, RecursionError):
                    raise DataError("the holder's reply is not JSON") from None
                if isinstance(head, dict) and "error" in head:
                    raise DataError(P.printable(head["error"], 300))
                if not isinstance(head, dict) or head.get("samples") != idx.size:
                    raise DataError("the holder's reply is malformed")
                total = idx.size * self.manifest.layout.record
                buf = bytearray(total)
                got, end = 0, time.monotonic() + TIMEOUT + total / MIN_RATE
                while got < total:
                    left = end - time.monotonic()
                    if left <= 0:
                        raise TransportTimeout(
                            f"{total} bytes not received within {TIMEOUT:g} s + {MIN_RATE >> 10} KiB/s"
                        )
                    frame = await ch.recv_frame(min(FRAME, total - got), timeout=min(TIMEOUT, left))
                    if not frame:
                        raise DataError("the holder sent an empty frame")
                    buf[got : got + len(frame)] = frame
                    got += len(frame)
                self.stats.bytes += ch.bytes_received - before
                return np.frombuffer(bytes(buf), np.uint8).reshape(idx.size, -1)
            except (DataError, TransportError):
                if h.ch is not None:  # the stream may be mid-reply: start afresh next time
                    h.ch.close("data request failed")
                    h.ch = None
                raise

    def _back(self) -> None:
        if self._out is not None:
            log.info("data: a holder serves again; training on")
            self.report(P.DataReport(kind="back", round=self.round, reason=f"was: {self._out}"))
            self._out = None

    def _unavailable(self, why: str) -> None:
        if self._out is None:
            log.warning("data: %s; sitting out until a holder can serve them", why)
            self.report(P.DataReport(kind="unavailable", round=self.round, reason=why))
        self._out = why

    async def ready(self, split: str, idx: np.ndarray, stopped: Callable[[], bool]) -> bool:
        """Wait until these samples are cached (True), retrying while no holder can serve them, or
        until stopped() (False: the round went on without this node)."""
        delay = RETRY_S[0]
        while True:
            try:
                await self.prefetch(split, idx)
                return True
            except DataUnavailable as e:
                self._unavailable(str(e))
            end = time.monotonic() + delay
            while time.monotonic() < end:
                if stopped():
                    return False
                await asyncio.sleep(0.2)
            delay = min(2 * delay, RETRY_S[1])

    def fetched(self) -> P.DataReport:
        """What was fetched so far (samples, bytes), for the coordinator's record."""
        s = self.stats
        return P.DataReport(
            kind="fetched", round=max(self.round, 0), samples=s.samples, bytes=s.bytes, evicted=self.cache.evicted
        )

    # --- the loop thread's side ---

    def batch_rows(self, split: str, idx: np.ndarray) -> np.ndarray:
        """From the loop thread: the rows of these samples, fetched now if not cached (blocks)."""
        idx = np.asarray(idx, np.int64)
        deadline = time.monotonic() + SYNC_PATIENCE_S
        delay = RETRY_S[0]
        while True:
            rows = self.cache.read(split, idx)
            if rows is not None:
                return rows
            fut = asyncio.run_coroutine_threadsafe(self.fetch(split, idx), self.loop)
            try:
                fut.result(timeout=max(1.0, deadline - time.monotonic()))
                continue
            except DataUnavailable as e:
                self.loop.call_soon_threadsafe(self._unavailable, str(e))
                if time.monotonic() + delay > deadline:
                    raise
            except concurrent.futures.TimeoutError:
                fut.cancel()
                raise DataUnavailable(
                    f"no data holder served {idx.size} {split} samples within {SYNC_PATIENCE_S:g}s"
                ) from None
            time.sleep(delay)
            delay = min(2 * delay, RETRY_S[1])

    def close(self) -> None:
        for job in self._jobs.values():
            job.cancel()
        for h in self.holders:
            if h.ch is not None:
                h.ch.close("node leaving")


class ServedDataset:
    """What the worker trains on where the data is not: the manifest's sizes, and batch() from the
    cache (fetched from a holder when not there yet)."""

    def __init__(self, client: DataClient) -> None:
        self.client = client
        client.in_use = True
        m = client.manifest
        self.n_train, self.n_val = m.n["train"], m.n["val"]
        if m.vocab_size is not None:
            self.vocab_size = m.vocab_size

    def batch(self, split: str, indices: np.ndarray) -> Any:
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        idx = np.asarray(indices, np.int64)
        return self.client.manifest.layout.batch(self.client.batch_rows(split, idx))


def served_task(task: types.ModuleType, client: DataClient, say: Callable[[str], None] = print) -> types.ModuleType:
    """The task with make_dataset() that opens the data here if this machine has the very samples
    of the manifest, and otherwise serves them from a holder (ServedDataset); `say` tells the
    operator which."""
    own = task.make_dataset
    wrapped = types.ModuleType(task.__name__, task.__doc__)
    wrapped.__dict__.update({k: v for k, v in vars(task).items() if k not in ("__name__", "__doc__")})

    def make_dataset(cfg: dict) -> Any:
        try:
            local = own(cfg)
        except Exception as e:
            why = P.printable(f"{type(e).__name__}: {e}", 200)
            say(f"data: not on this machine ({why}); the samples of granted units come from the data holder")
            return ServedDataset(client)
        try:
            same = build_manifest(local).root == client.manifest.root
        except Exception as e:
            say(f"data: the copy here cannot be checked ({e}); the samples come from the data holder")
            return ServedDataset(client)
        if not same:
            say("data: the copy here differs from the data holder's; the samples come from the holder")
            return ServedDataset(client)
        say("data: this machine has the holder's data (every sample checked); training on it and serving it")
        client.local = local
        return local

    wrapped.make_dataset = make_dataset
    return wrapped


def _ticket_id(ticket: str) -> str:
    try:
        return str(parse_ticket(ticket).id())
    except Exception:
        return "?" * 64


def per_request(record: int) -> int:
    """Samples one request may ask for: MAX_INDICES, fewer when MAX_REPLY binds first."""
    return max(1, min(MAX_INDICES, MAX_REPLY // record))


def blob_root(blob: bytes) -> str:
    """The digest that names a manifest (Manifest.encode's bytes): TrainConfig carries it."""
    return hashlib.blake2b(blob, digest_size=16).hexdigest()
