"""The ring codecs' arithmetic on a torch device: int8 block quantization and top-k selection run
where the worker's tensors live (a CUDA or ROCm GPU), so the host only copies a chunk there
and its payload back, instead of spending its CPU on every value.

numpy arrays in and out, like the rest of the worker boundary. The operations are the ones
drift/compress.py does in numpy, in the same order (abs, block max, 127/scale, multiply, round
half to even, cast), each correctly rounded in float32, so the payload bytes are the same bit for
bit; decoding is one int8 -> float32 cast and one multiply, so every node decoding the same bytes
gets the same values whichever device it used. (Top-k may break ties between equal magnitudes
differently from numpy: the bytes then differ, but decode(bytes) stays the one result everyone
uses.)
"""

from __future__ import annotations

import numpy as np
import torch


class TorchCodecKernels:
    """What drift's int8 and top-k codecs call instead of numpy (compress.Kernels)."""

    def __init__(self, device: str):
        self.device = torch.device(device)

    def _to(self, a: np.ndarray) -> torch.Tensor:
        # A copy, never a view of the caller's buffer (payloads can be read-only bytes).
        return torch.tensor(a, device=self.device)

    def quantize(self, x: np.ndarray, block: int, scales: np.ndarray, q: np.ndarray) -> None:
        """scales <- max|x| / 127 per block of `block` values (the last may be short); q <- the
        int8 values, rint(x * 127 / max|x|)."""
        n = x.size
        m = n // block * block
        xt = self._to(x)
        blocks = [xt[:m].view(-1, block)] if m else []
        if m < n:
            blocks.append(xt[m:].view(1, -1))
        s_parts, q_parts = [], []
        for b in blocks:
            s = b.abs().amax(dim=1)
            inv = torch.where(s > 0, torch.tensor(127.0, device=self.device) / s, torch.zeros_like(s))
            q_parts.append(torch.round(b * inv[:, None]).to(torch.int8).reshape(-1))
            s_parts.append(s / 127.0)
        # (through numpy: a payload's scales may sit at any byte offset of the caller's buffer)
        scales[:] = torch.cat(s_parts).cpu().numpy()
        q[:] = torch.cat(q_parts).cpu().numpy()

    def dequantize(self, q: np.ndarray, scales: np.ndarray, block: int, out: np.ndarray) -> None:
        """out <- q * scale of its block."""
        n = q.size
        m = n // block * block
        qt, st = self._to(q).to(torch.float32), self._to(scales)
        res = torch.empty(n, dtype=torch.float32, device=self.device)
        if m:
            res[:m] = (qt[:m].view(-1, block) * st[: m // block, None]).reshape(-1)
        if m < n:
            res[m:] = qt[m:] * st[-1]
        out[:] = res.cpu().numpy()

    def top_k(self, x: np.ndarray, k: int, idx: np.ndarray) -> None:
        """idx <- the indices of the k largest |x|, increasing (uint32)."""
        sel = torch.topk(self._to(x).abs(), k, sorted=False).indices.sort().values
        idx[:] = sel.to(torch.int64).cpu().numpy()


def codec_kernels(device: str) -> TorchCodecKernels | None:
    """Kernels for a worker on a CUDA (or ROCm) GPU; None elsewhere. On the CPU numpy is as fast
    or faster (benchmarks/bench_codec.py); on Apple's MPS the host and the GPU share memory, and
    this path is unmeasured there (older torch also limits top-k's k on MPS)."""
    return TorchCodecKernels(device) if torch.device(device).type == "cuda" else None
