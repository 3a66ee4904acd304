"""Codecs for the ring's tensor chunks: numpy, no networking.

A codec turns a flat float32 chunk into a payload of bytes and back. The ring relies on three
properties, which the tests check:

* ``encoded_nbytes(n)`` is fixed by the codec and n alone, so a receiver knows the exact size of a
  valid payload before decoding it (a wrong size is refused, never decoded);
* ``decode`` is a deterministic function of the payload bytes (integer casts and one correctly
  rounded float32 multiply), so every node decoding the same bytes gets the same float32 values;
* payloads are little-endian whatever the machine, so heterogeneous nodes agree.

Payload layouts (n values in, k = max(1, ceil(fraction * n)) kept by top-k, B = block size):

    fp32   n x <f4
    fp16   n x <f2            (values beyond +-65504 are clipped, not turned into inf)
    bf16   n x <u2            (upper half of the float32, round to nearest even)
    int8   ceil(n/B) x <f4 scales, then n x i1      value = q * scale, scale = max|x| / 127
    topk   k x <u4 indices (strictly increasing), ceil(k/B) x <f4 scales, k x i1 values

Top-k keeps the k largest magnitudes; what it drops (and the int8 rounding of what it keeps) is
meant to be kept by the caller and added back next round (``error_feedback`` is True).

int8 and top-k can hand their arithmetic to `Kernels` (a worker on a GPU offers them:
workers/torch_codec.py): the same operations on the worker's device, numpy arrays in and out.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Protocol

import numpy as np

_F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")
_U32 = np.dtype("<u4")
_I8 = np.dtype("i1")
_FP16_MAX = np.float32(65504.0)


class Kernels(Protocol):
    """int8 and top-k arithmetic done elsewhere (on the worker's device), numpy in and out; the
    same results as _quantize_blocks, _dequantize_blocks and top-k's selection here."""

    def quantize(self, x: np.ndarray, block: int, scales: np.ndarray, q: np.ndarray) -> None: ...

    def dequantize(self, q: np.ndarray, scales: np.ndarray, block: int, out: np.ndarray) -> None: ...

    def top_k(self, x: np.ndarray, k: int, idx: np.ndarray) -> None: ...


class CodecError(ValueError):
    """An unknown codec name, bad codec options, or a payload that cannot be decoded."""


class Codec(ABC):
    """Encode float32 chunks to bytes and back. Instances hold scratch space: one per thread."""

    name: str = ""
    id: int = -1  # the codec byte in the ring's chunk header
    lossy: bool = True
    error_feedback: bool = False  # the caller should carry encode error into the next round

    @abstractmethod
    def encoded_nbytes(self, n: int) -> int:
        """Exact payload size for a chunk of n values."""

    @abstractmethod
    def encode(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Payload for float32 chunk x, as a uint8 array (written into `out` when given)."""

    @abstractmethod
    def decode(self, payload, out: np.ndarray) -> np.ndarray:
        """Overwrite float32 `out` (len n) with the decoded chunk; returns out."""

    def decode_add(self, payload, out: np.ndarray) -> None:
        """out += decoded chunk (float32 accumulation)."""
        out += self.decode(payload, self._scratch(out.size))

    # --- helpers -------------------------------------------------------------------------------

    def _scratch(self, n: int, slot: int = 0) -> np.ndarray:
        bufs = self.__dict__.setdefault("_bufs", {})
        buf = bufs.get(slot)
        if buf is None or buf.size < n:
            buf = bufs[slot] = np.empty(max(n, 1), np.float32)
        return buf[:n]

    def _payload(self, payload, n: int) -> np.ndarray:
        """The payload as uint8, after checking its size against n."""
        p = np.frombuffer(payload, dtype=np.uint8)
        want = self.encoded_nbytes(n)
        if p.size != want:
            raise CodecError(f"{self.name} payload for {n} values must be {want} bytes, got {p.size}")
        return p

    def _out(self, out: np.ndarray | None, n: int) -> np.ndarray:
        size = self.encoded_nbytes(n)
        if out is None:
            return np.empty(size, np.uint8)
        if out.dtype != np.uint8 or out.size < size:
            raise ValueError(f"{self.name}: output buffer needs {size} uint8 bytes")
        return out[:size]

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class Fp32(Codec):
    name, id, lossy = "fp32", 0, False

    def encoded_nbytes(self, n: int) -> int:
        return 4 * n

    def encode(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None and x.dtype == _F32:
            return x.view(np.uint8)  # no copy: the chunk is its own payload
        o = self._out(out, x.size)
        o.view(_F32)[:] = x
        return o

    def decode(self, payload, out: np.ndarray) -> np.ndarray:
        out[:] = self._payload(payload, out.size).view(_F32)
        return out

    def decode_add(self, payload, out: np.ndarray) -> None:
        out += self._payload(payload, out.size).view(_F32)


class Fp16(Codec):
    name, id = "fp16", 1

    def encoded_nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        o = self._out(out, x.size)
        s = np.clip(x, -_FP16_MAX, _FP16_MAX, out=self._scratch(x.size, 1))
        o.view(_F16)[:] = s
        return o

    def decode(self, payload, out: np.ndarray) -> np.ndarray:
        out[:] = self._payload(payload, out.size).view(_F16)
        return out


class Bf16(Codec):
    name, id = "bf16", 2

    def encoded_nbytes(self, n: int) -> int:
        return 2 * n

    def encode(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        o = self._out(out, x.size)
        u = np.ascontiguousarray(x, dtype=_F32).view(np.uint32)
        t = self._scratch(x.size, 1).view(np.uint32)
        # round to nearest even on the 16 bits dropped: add 0x7FFF plus the lowest kept bit
        np.right_shift(u, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        t += 0x7FFF
        t += u
        np.right_shift(t, 16, out=t)
        o.view(_U16)[:] = t
        nan = np.isnan(x)
        if nan.any():  # the carry above would turn NaN into a number; keep it NaN
            o.view(_U16)[nan] = 0x7FC0
        return o

    def decode(self, payload, out: np.ndarray) -> np.ndarray:
        h = self._payload(payload, out.size).view(_U16)
        u = out.view(np.uint32)
        u[:] = h
        np.left_shift(u, 16, out=u)
        return out


def _quantize_blocks(x: np.ndarray, block: int, scales: np.ndarray, q: np.ndarray, tmp: np.ndarray) -> None:
    """Symmetric int8 with one float32 scale per block of `block` values (last block may be short)."""
    n = x.size
    nb_full = n // block
    m = nb_full * block
    a = np.abs(x, out=tmp)
    if nb_full:
        np.max(a[:m].reshape(nb_full, block), axis=1, out=scales[:nb_full])
    if m < n:
        scales[nb_full] = a[m:].max()
    inv = np.divide(np.float32(127.0), scales, out=np.zeros_like(scales), where=scales > 0)
    scales /= np.float32(127.0)
    if nb_full:
        np.multiply(x[:m].reshape(nb_full, block), inv[:nb_full, None], out=tmp[:m].reshape(nb_full, block))
    if m < n:
        np.multiply(x[m:], inv[nb_full], out=tmp[m:])
    np.rint(tmp, out=tmp)
    np.copyto(q, tmp, casting="unsafe")


def _dequantize_blocks(q: np.ndarray, scales: np.ndarray, block: int, out: np.ndarray) -> None:
    n = q.size
    nb_full = n // block
    m = nb_full * block
    out[:] = q
    if nb_full:
        o = out[:m].reshape(nb_full, block)
        o *= scales[:nb_full, None]
    if m < n:
        out[m:] *= scales[nb_full]


class Int8Block(Codec):
    name, id = "int8", 3

    def __init__(self, block: int = 256, kernels: Kernels | None = None):
        if block < 1:
            raise CodecError(f"int8 block size must be >= 1, got {block}")
        self.block, self.kernels = block, kernels

    def encoded_nbytes(self, n: int) -> int:
        return 4 * math.ceil(n / self.block) + n

    def encode(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        n = x.size
        o = self._out(out, n)
        nb = math.ceil(n / self.block)
        scales, q = o[: 4 * nb].view(_F32), o[4 * nb :].view(_I8)
        if self.kernels is not None:
            self.kernels.quantize(x, self.block, scales, q)
        else:
            _quantize_blocks(x, self.block, scales, q, self._scratch(n, 1))
        return o

    def decode(self, payload, out: np.ndarray) -> np.ndarray:
        n = out.size
        p = self._payload(payload, n)
        nb = math.ceil(n / self.block)
        q, scales = p[4 * nb :].view(_I8), p[: 4 * nb].view(_F32)
        if self.kernels is not None:
            self.kernels.dequantize(q, scales, self.block, out)
        else:
            _dequantize_blocks(q, scales, self.block, out)
        return out


class TopK(Codec):
    name, id, error_feedback = "topk", 4, True

    def __init__(self, fraction: float = 0.01, block: int = 256, kernels: Kernels | None = None):
        if not 0 < fraction <= 1:
            raise CodecError(f"topk_fraction must be in (0, 1], got {fraction}")
        self.fraction, self.kernels = fraction, kernels
        self.values = Int8Block(block, kernels)

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.fraction * n))) if n else 0

    def encoded_nbytes(self, n: int) -> int:
        k = self.k(n)
        return 4 * k + self.values.encoded_nbytes(k)

    def encode(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        n = x.size
        o = self._out(out, n)
        k = self.k(n)
        if k == 0:
            return o
        idx = o[: 4 * k].view(_U32)
        if k < n and self.kernels is not None:
            self.kernels.top_k(x, k, idx)
        elif k < n:
            mag = np.abs(x, out=self._scratch(n, 1))
            sel = np.argpartition(mag, n - k)[n - k :]
            sel.sort()
            idx[:] = sel
        else:
            idx[:] = np.arange(n, dtype=np.uint32)
        self.values.encode(x[idx], out=o[4 * k :])
        return o

    def _parts(self, payload, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = self._payload(payload, n)
        k = self.k(n)
        if k == 0:
            return np.empty(0, np.intp), np.empty(0, np.float32)
        idx = p[: 4 * k].view(_U32)
        if idx[-1] >= n or (k > 1 and not (np.diff(idx.astype(np.int64)) > 0).all()):
            raise CodecError(f"topk payload indices are not strictly increasing below {n}")
        vals = self.values.decode(p[4 * k :], self._scratch(k, 2))
        return idx, vals

    def decode(self, payload, out: np.ndarray) -> np.ndarray:
        idx, vals = self._parts(payload, out.size)
        out[:] = 0
        out[idx] = vals
        return out

    def decode_add(self, payload, out: np.ndarray) -> None:
        idx, vals = self._parts(payload, out.size)
        out[idx] += vals  # indices are unique (checked), so fancy += adds every value


CODECS: dict[str, type[Codec]] = {"fp32": Fp32, "fp16": Fp16, "bf16": Bf16, "int8": Int8Block, "topk": TopK}
CODEC_IDS: dict[int, str] = {c.id: name for name, c in CODECS.items()}


def make_codec(name: str, *, topk_fraction: float = 0.01, block: int = 256, kernels: Kernels | None = None) -> Codec:
    """The codec called `name`; options that do not apply to it are ignored."""
    cls = CODECS.get(name)
    if cls is None:
        raise CodecError(f"unknown codec {name!r}; valid codecs: {', '.join(CODECS)}")
    if cls is TopK:
        return TopK(topk_fraction, block, kernels)
    if cls is Int8Block:
        return Int8Block(block, kernels)
    return cls()


def relative_error(approx: np.ndarray, exact: np.ndarray) -> float:
    """||approx - exact|| / ||exact|| in float64 (0 when both are zero)."""
    d = np.linalg.norm(approx.astype(np.float64) - exact.astype(np.float64))
    e = np.linalg.norm(exact.astype(np.float64))
    return float(d / e) if e else float(d)
