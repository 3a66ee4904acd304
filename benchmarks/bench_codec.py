"""The ring codecs' arithmetic on the host (numpy) against the same on a torch device (what a GPU
worker's node uses: workers/torch_codec.py), side by side in one run, per 1 Mi-value chunk (the
ring's chunk size for int8).

    python benchmarks/bench_codec.py                  # the best torch device here (cuda, mps, cpu)
    python benchmarks/bench_codec.py --device cpu --reps 50

Printed per codec and path: encode and decode+add time per chunk, and the host-CPU seconds they
cost (process CPU time: on a GPU the device's time is not the host's); the ratio is numpy's time
over the device path's. A device path includes its copies: the chunk to the device, the payload
back (encode); the payload there, the values back (decode).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from drift.compress import make_codec
from drift.workers.torch_codec import TorchCodecKernels
from drift.workers.torch_worker import resolve_device


def _time(fn, reps: int) -> tuple[float, float]:
    """(wall s, process CPU s) per call, after one warm-up call."""
    fn()
    w, c = time.perf_counter(), time.process_time()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - w) / reps, (time.process_time() - c) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="torch device for the kernels (default: the best here)")
    ap.add_argument("--values", type=int, default=1 << 20, help="values per chunk")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    device = resolve_device(a.device)
    x = (np.random.default_rng(0).standard_normal(a.values) * 1e-3).astype(np.float32)
    print(f"chunk of {a.values} float32 values, {a.reps} reps; device path on {device}")
    print(f"{'codec':6} {'path':8} {'encode ms':>10} {'host CPU':>9} {'decode+add ms':>14} {'host CPU':>9}")
    for name in ("int8", "topk"):
        rows = {}
        for path, kernels in (("numpy", None), (device, TorchCodecKernels(device))):
            c = make_codec(name, topk_fraction=0.01, kernels=kernels)
            out = np.empty(c.encoded_nbytes(a.values), np.uint8)
            payload = c.encode(x, out=out).tobytes()
            acc = np.zeros(a.values, np.float32)
            enc = _time(lambda c=c, out=out: c.encode(x, out=out), a.reps)
            dec = _time(lambda c=c, acc=acc, payload=payload: c.decode_add(payload, acc), a.reps)
            rows[path] = (enc, dec)
            print(
                f"{name:6} {path:8} {enc[0] * 1e3:10.2f} {enc[1] * 1e3:8.2f}ms "
                f"{dec[0] * 1e3:14.2f} {dec[1] * 1e3:8.2f}ms"
            )
        (e0, d0), (e1, d1) = rows["numpy"], rows[device]
        print(f"{name:6} numpy/{device}: encode {e0[0] / e1[0]:.2f}x, decode+add {d0[0] / d1[0]:.2f}x (wall)")


if __name__ == "__main__":
    main()
