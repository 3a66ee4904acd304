"""What one control message costs (issue 40, item 1): CPU and wall time per frame between two
real iroh endpoints on loopback, in one process (both ends' CPU, iroh's runtime threads included).

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_control.py                       # this tree
    flock /tmp/drift-cpu.lock python3 benchmarks/bench_control.py --tree /tmp/old --tree .   # A/B, interleaved

  one-way  N frames of a TrainProgress's size sent back to back (as a node reports units and asks
           for work), until the other end has read them all: CPU and wall per frame.
  echo     a request and its answer (an ask and its AssignNext): CPU and wall per round trip.

Each tree runs in a fresh process with TREE first on PYTHONPATH; --reps runs of each, interleaved;
the median is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MSG = json.dumps(
    {"type": "TrainProgress", "v": 2, "round": 3, "units": [{"epoch": 0, "id": 17, "lo": 0, "hi": 16}], "steps": 2}
).encode()


async def measure(n: int) -> dict:
    from drift.transport import CONTROL_ALPN, Endpoint

    a, b = await Endpoint.bind("local"), await Endpoint.bind("local")
    got: asyncio.Queue[int] = asyncio.Queue()

    async def serve(conn) -> None:
        ch = await Endpoint.accept_channel(conn)
        while True:
            if await ch.recv_frame(1 << 20) == b"echo":
                await ch.send_frame(b"ok")
            else:
                got.put_nowait(1)

    server = asyncio.ensure_future(b.serve({CONTROL_ALPN: serve}))
    ch = await a.connect(b.ticket(), CONTROL_ALPN)
    for _ in range(100):  # warm up
        await ch.send_frame(MSG)
    for _ in range(100):
        await got.get()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        await ch.send_frame(MSG)
    for _ in range(n):
        await got.get()
    c1, t1 = time.process_time(), time.perf_counter()
    for _ in range(n // 3):
        await ch.send_frame(b"echo")
        await ch.recv_frame(16)
    c2, t2 = time.process_time(), time.perf_counter()
    server.cancel()
    k = n // 3
    return {
        "oneway_cpu_us": (c1 - c0) / n * 1e6,
        "oneway_wall_us": (t1 - t0) / n * 1e6,
        "echo_cpu_us": (c2 - c1) / k * 1e6,
        "echo_wall_us": (t2 - t1) / k * 1e6,
    }


def run_tree(tree: Path, n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(n)], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path, help="a drift checkout (default: this one)")
    ap.add_argument("--frames", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(measure(args.child))), flush=True)
        os._exit(0)  # (the endpoints' runtime threads need not wind down)
    trees = args.tree or [Path(__file__).resolve().parent.parent]
    runs: dict[Path, list[dict]] = {t: [] for t in trees}
    for _ in range(args.reps):
        for t in trees:
            runs[t].append(run_tree(t, args.frames))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"bench_control {stamp}, {os.cpu_count()} cores, {args.frames} frames, {args.reps} reps (median)")
    for t, rs in runs.items():
        rev = subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"  {rev.stdout.strip() or t}: one-way {med['oneway_cpu_us']:.0f} us CPU, {med['oneway_wall_us']:.0f} us wall"
            f" a frame; echo {med['echo_cpu_us']:.0f} us CPU, {med['echo_wall_us']:.0f} us wall a round trip"
        )


if __name__ == "__main__":
    main()
