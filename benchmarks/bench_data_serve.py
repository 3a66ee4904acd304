"""How many nodes one data holder can feed (recipe `data:`, drift/data.py): one DataServer in a
process of its own (real iroh on loopback, the coordinator's code path) and N fetch-only clients
(drift.data.DataClient, an endpoint and a disk cache each, in this process) that fetch units of
fresh samples back to back, as fast as the server answers, for --seconds at each N.

Prints per N: the samples/s served in all and per client, a unit's fetch time (median and 90th
percentile), and the server's CPU seconds per sample (the kernel's rusage of the server process,
all its threads, over the timed part only) and its cores in use. A node with one unit in flight
waits once fetching a unit takes longer than training one, so one server feeds about
(samples/s served at saturation) / (one node's samples/s) nodes, and one server core
1 / (CPU s per sample x a node's samples/s).

--task tokens: recipes/token_file.py over uint16 token files of the default task's text (block
64: 130 bytes a sample), units of 160 samples (bench_data.py's node). --task gpt2: the GPT-2-class
byte recipe (recipes/gpt2-small.yaml's dataset: batch() gives int64 input_ids and labels of 1024
each, 16,384 bytes a sample), units of 160 samples (10 steps of 16).

    python3 benchmarks/bench_data_serve.py [--task tokens|gpt2] [--clients 1,2,4,8] [--seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from drift import protocol as P  # noqa: E402
from drift.data import DataClient, DataServer, build_manifest  # noqa: E402
from drift.transport import DATA_ALPN, Endpoint  # noqa: E402

UNIT = 160  # samples a unit


def dataset(task: str, work: Path):
    from drift.workers import load_task

    if task == "gpt2":
        return load_task(ROOT / "recipes" / "gpt2_shakespeare.py").make_dataset({})
    char = load_task(ROOT / "recipes" / "shakespeare_char.py")
    ds = char.CharDataset(char.load_text(), 64)
    for split in ("train", "val"):
        ds.tokens(split).astype(np.uint16).tofile(work / f"{split}.bin")
    return load_task(ROOT / "recipes" / "token_file.py").make_dataset(
        {"data_dir": str(work), "block_size": 64, "vocab_size": ds.vocab_size}
    )


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def serve(task: str) -> None:
    """The server process: one line of JSON (ticket, manifest), then a line with its CPU seconds
    for every line read from stdin (the timed part starts and ends there)."""
    with tempfile.TemporaryDirectory() as d:
        ds = dataset(task, Path(d))
        m = build_manifest(ds)
        server = DataServer(ds, m, allowed=lambda peer: True)
        ep = await Endpoint.bind("local", alpns=(DATA_ALPN,))
        serving = asyncio.ensure_future(ep.serve({DATA_ALPN: server.handle}))
        print(
            json.dumps({"ticket": ep.ticket(), "root": m.root, "size": len(server.blob), "n": m.n["train"]}),
            flush=True,
        )
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, sys.stdin.readline):
            print(json.dumps({"cpu": cpu()}), flush=True)
        serving.cancel()


async def clients(n: int, seconds: float, src: P.DataSource, n_train: int, work: Path, server) -> dict:
    eps = [await Endpoint.bind("local", alpns=(DATA_ALPN,)) for _ in range(n)]
    cs = [await DataClient.open(ep, src, work / f"c{n}-{i}", 1) for i, ep in enumerate(eps)]  # 1 byte: no reuse
    rng = np.random.default_rng(n)
    units = n_train // UNIT
    times: list[float] = []

    async def one(c: DataClient, end: float) -> None:
        while time.monotonic() < end:
            u = int(rng.integers(units))
            t0 = time.perf_counter()
            await c.fetch("train", np.arange(u * UNIT, (u + 1) * UNIT))
            times.append(time.perf_counter() - t0)

    await asyncio.gather(*(one(c, time.monotonic() + 1.0) for c in cs))  # warm: connections up
    times.clear()
    before = [c.stats.samples for c in cs]
    server.stdin.write("\n")
    server.stdin.flush()
    cpu0 = json.loads(server.stdout.readline())["cpu"]
    t0 = time.monotonic()
    await asyncio.gather(*(one(c, t0 + seconds) for c in cs))
    wall = time.monotonic() - t0
    server.stdin.write("\n")
    server.stdin.flush()
    cpu1 = json.loads(server.stdout.readline())["cpu"]
    samples = sum(c.stats.samples - b for c, b in zip(cs, before))
    read_us = _read_cost(cs[0])
    for c in cs:
        c.close()
    for ep in eps:
        await ep.close()
    times.sort()
    return {
        "clients": n,
        "samples_per_s": samples / wall,
        "unit_ms": 1e3 * statistics.median(times),
        "unit_p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
        "cpu_us_per_sample": 1e6 * (cpu1 - cpu0) / max(1, samples),
        "server_cores": (cpu1 - cpu0) / wall,
        "read_us": read_us,
    }


def _read_cost(c: DataClient, batch: int = 32, reps: int = 200) -> float:
    """What a training step pays for its batch on the served path (the loop thread's part): a
    batch of the last unit fetched read from the cache, checked, unpacked; microseconds."""
    split, ix, _ = next(reversed(c.cache._files.values()))
    idx = ix[:batch]
    t0 = time.perf_counter()
    for _ in range(reps):
        c.manifest.layout.batch(c.batch_rows(split, idx))
    return 1e6 * (time.perf_counter() - t0) / reps


async def main(a: argparse.Namespace) -> None:
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--task", a.task],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        head = json.loads(server.stdout.readline())
        src = P.DataSource(root=head["root"], size=head["size"], tickets=[head["ticket"]])
        with tempfile.TemporaryDirectory() as d:
            for n in (int(x) for x in a.clients.split(",")):
                r = await clients(n, a.seconds, src, head["n"], Path(d), server)
                print(
                    f"{a.task} clients {n:3d}: {r['samples_per_s']:9.0f} samples/s served "
                    f"({r['samples_per_s'] / n:8.0f} a client), a unit of {UNIT} in {r['unit_ms']:7.1f} ms "
                    f"(p90 {r['unit_p90_ms']:7.1f}), server {r['cpu_us_per_sample']:6.1f} us CPU a sample, "
                    f"{r['server_cores']:.2f} cores; a cached batch of 32 read in {r['read_us']:.0f} us",
                    flush=True,
                )
    finally:
        server.stdin.close()
        server.wait(timeout=30)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", choices=("tokens", "gpt2"), default="tokens")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    asyncio.run(serve(a.task) if a.serve else main(a))
