"""How cost grows with model size (issue 14, item 5): one table per cost, for θ of 10M, 124M,
500M and 1B float32 parameters, as far as this machine's memory allows (it says where it stops).

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_scale.py                  # everything (root: netns)
    flock /tmp/drift-cpu.lock python3 benchmarks/bench_scale.py --sizes 10M,124M --parts ring,state
    python3 benchmarks/bench_scale.py --quick                                    # smoke run, ~2 min

Parts (--parts, default all):
  ring    drift/ring.py `Ring.allreduce_sum` between 2 processes (one per node, real iroh), codecs
          fp32 / int8 / topk (1 %): (a) loopback, (b) 100 Mbit links between network namespaces
          (benchmarks/netns.py, needs root). A size whose run would take longer than --netns-max-s
          on the limited links (estimated from its bytes at the link rate, or from the loopback run
          if that was slower) is skipped and said so; nothing is extrapolated. Time = the slower
          node, median over reps.
  state   drift/state.py: a `StateServer` process publishing θ + velocity, and in another process
          (1) `fetch_state(..., into_arrays(...))` into live (already touched) arrays, (2) the
          coordinator's checkpoint path: `fetch_state` streaming into a
          `drift.checkpoint.CheckpointWriter`, then `commit` (fsync, sha256, rename), and (3)
          `load_checkpoint` of what was written, with the files evicted from the page cache (cold)
          and again (hot), and the mapping alone (`_map_tensors`). The server publishes one array
          as both θ and velocity (the bytes on the wire and on disk are the same as with two; it
          halves the server's memory so that 1B fits).
  rss     peak RSS of a real `drift join` node in a real 2-node swarm (`benchmarks/harness/simulate.py`'s `Swarm`,
          coordinator + 2 nodes on loopback, 1 torch thread each) training benchmarks/bigtask.py
          (exactly N parameters: one embedding table of 1000-wide rows, dense gradients, AdamW),
          against a plain torch loop in a fresh process with the same model, AdamW, grad clip,
          batch and steps. Figure: (node − plain) / θ bytes (issue target ≤ 3). codec fp32 and
          int8 with the blocking rule (outer momentum 0.9); the overlapped rule at one size; int8
          with outer momentum 0 (no velocity held: diloco.NesterovOuter) at one size.
  worker  the 124M-class recipe (recipes/gpt2_shakespeare.py, GPT-2 small shape, byte vocabulary)
          shrunk to batch 1 x block 256 (12 layers, 768 wide, 12 heads: 85.5M parameters):
          samples/s of `workers.make_worker(...).train_step` against a hand-written torch loop
          (same model and init, AdamW with the same decay groups, grad clip 1.0, same batches), in
          this process, 1 thread, stretches interleaved A/B/B/A...; median ratio (target ≥ 97 %).

Memory: every run is checked against min(--max-gib, MemAvailable − 1.5 GiB) before it starts,
with the peak it needs (estimated from what the code keeps); a run that does not fit is skipped
with the figures that say why.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

MiB, GiB = 1 << 20, 1 << 30
DEFAULT_SIZES = "10M,124M,500M,1B"
CODECS = ("fp32", "int8", "topk")


# --- small helpers -----------------------------------------------------------------------------


def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([kKmMbBgG]?)\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"size {s!r}: expected e.g. 10M, 124M, 1B")
    mult = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}[m.group(2).lower()]
    return round(float(m.group(1)) * mult)


def fmt_size(n: int) -> str:
    for unit, v in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= v and n % (v // 1000 or 1) == 0:
            x = n / v
            return f"{x:g}{unit}"
    return str(n)


def gib(b: float) -> str:
    return f"{b / GiB:.2f}"


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = int(v.split()[0]) * 1024
    return out


def proc_status(pid: int) -> dict[str, int] | None:
    """VmRSS / VmHWM of a live process in bytes, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out or None


def own_hwm() -> int:
    return (proc_status(os.getpid()) or {}).get("VmHWM", 0)


class Sampler(threading.Thread):
    """Polls VmRSS and VmHWM of some processes until they exit: the peak (the last VmHWM read,
    or the highest VmRSS seen) and a timeline of (seconds, RSS)."""

    def __init__(self, pids: dict[str, int], every: float = 0.05):
        super().__init__(daemon=True)
        self.pids, self.every = dict(pids), every
        self.peak = {k: 0 for k in pids}
        self.timeline: dict[str, list[tuple[float, int]]] = {k: [] for k in pids}
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def add(self, name: str, pid: int) -> None:
        self.pids[name] = pid
        self.peak.setdefault(name, 0)
        self.timeline.setdefault(name, [])

    def run(self) -> None:
        while not self._halt.is_set():
            for name, pid in list(self.pids.items()):
                st = proc_status(pid)
                if st is None:
                    continue
                self.peak[name] = max(self.peak[name], st.get("VmHWM", 0), st.get("VmRSS", 0))
                self.timeline[name].append((time.monotonic() - self.t0, st.get("VmRSS", 0)))
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join()


class Budget:
    """What a run may use: min(--max-gib, MemAvailable now − 1.5 GiB)."""

    def __init__(self, max_gib: float):
        self.max_bytes = int(max_gib * GiB)

    def why_not(self, need: int) -> str | None:
        avail = meminfo()["MemAvailable"] - int(1.5 * GiB)
        limit = min(self.max_bytes, avail)
        if need <= limit:
            return None
        which = (
            f"the {self.max_bytes / GiB:g} GiB cap"
            if limit == self.max_bytes
            else f"MemAvailable − 1.5 GiB ({gib(avail)} GiB)"
        )
        return f"needs ~{gib(need)} GiB, over {which}"


def rate_bits(rate: str) -> float:
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise SystemExit(f"--rate {rate!r}: expected e.g. 100mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def table(title: str, head: list[str], rows: list[list], note: str = "") -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    if note:
        print(f"\n{note}")
    sys.stdout.flush()


def spawn(args: list[str], prefix: list[str] | None = None, stdin: bool = True) -> subprocess.Popen:
    return subprocess.Popen(
        [*(prefix or []), sys.executable, str(Path(__file__).resolve()), *args],
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )


def read_json(p: subprocess.Popen, timeout: float) -> dict:
    """The next JSON line a worker prints (anything else it prints is passed on to stderr)."""
    box: list = []

    def reader() -> None:
        while True:
            line = p.stdout.readline()
            if not line:
                box.append(None)
                return
            if line.startswith("{"):
                box.append(json.loads(line))
                return
            sys.stderr.write(line)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise TimeoutError(f"worker {p.args[-8:]} silent for {timeout:.0f}s")
    if box[0] is None:
        raise RuntimeError(f"worker exited early (rc {p.wait()})")
    return box[0]


def plain_adamw(params: list, lr: float):
    """The plain loops' AdamW: decay on matrices only, as drift's TorchWorker groups it."""
    import torch

    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def fill(x, seed: int) -> None:
    """Pseudo-gradient-like values (uniform ±1e-3), generated in place, in pieces."""
    import numpy as np

    rng = np.random.default_rng(seed)
    step = 1 << 24
    for a in range(0, x.size, step):
        v = x[a : a + step]
        rng.random(out=v, dtype=np.float32)
        v -= np.float32(0.5)
        v *= np.float32(2e-3)


# --- part 1: ring all-reduce between two processes ---------------------------------------------


async def _ring_worker(a: argparse.Namespace) -> None:
    import numpy as np

    from drift.protocol import RingMember
    from drift.ring import Ring
    from drift.transport import RING_ALPN, Endpoint

    loop = asyncio.get_running_loop()
    readline = lambda: loop.run_in_executor(None, sys.stdin.readline)  # noqa: E731
    ep = await Endpoint.bind(a.mode)
    ring = Ring(ep, timeout=900)
    print(json.dumps({"ticket": ep.ticket(), "node_id": ep.node_id}), flush=True)
    peers = json.loads(await readline())
    members = [RingMember(node_id=p["node_id"], ticket=p["ticket"], weight=0.5) for p in peers]
    serve = asyncio.ensure_future(ep.serve({RING_ALPN: ring.handle_incoming}))
    await ring.allreduce_sum(np.ones(1024, np.float32), members, 0)  # connections up before timing
    x = np.empty(a.n, np.float32)
    runs = []
    for rep in range(a.reps):
        fill(x, seed=1000 * a.rank + rep)
        print(json.dumps({"ready": rep}), flush=True)
        await readline()  # "go", written to both nodes at once
        t0, c0 = time.perf_counter(), time.process_time()
        st = await ring.allreduce_sum(x, members, rep + 1, codec=a.codec, topk_fraction=a.topk_fraction)
        runs.append(
            {
                "t": time.perf_counter() - t0,
                "cpu": time.process_time() - c0,
                "sent": st.bytes_sent,
                "codec_s": st.codec_seconds,
            }
        )
    print(json.dumps({"runs": runs, "hwm": own_hwm()}), flush=True)
    await readline()  # both finish before either closes its connections
    serve.cancel()
    ring.close()
    await ep.close()


def ring_need(n: int, codec: str) -> int:
    """Peak of both ring processes: x, plus top-k's two error-feedback residuals (2θ), plus ~150
    MiB of interpreter, iroh and pooled payload buffers each."""
    per = 4 * n + {"fp32": 0, "int8": 0, "topk": 8 * n}[codec] + 150 * MiB
    return 2 * per


def ring_pair(n: int, codec: str, reps: int, topk_fraction: float, swarm=None) -> dict:
    mode = "local" if swarm is None else "lan"
    procs = []
    try:
        for i in range(2):
            procs.append(
                spawn(
                    [
                        "--role",
                        "ring",
                        "--rank",
                        str(i),
                        "--n",
                        str(n),
                        "--codec",
                        codec,
                        "--reps",
                        str(reps),
                        "--mode",
                        mode,
                        "--topk-fraction",
                        str(topk_fraction),
                    ],
                    prefix=None if swarm is None else swarm.exec_prefix(i),
                )
            )
        peers = [read_json(p, 120) for p in procs]
        for p in procs:
            p.stdin.write(json.dumps(peers) + "\n")
            p.stdin.flush()
        for _ in range(reps):
            for p in procs:
                read_json(p, 600)  # ready (x filled)
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
        res = [read_json(p, 1800) for p in procs]
        for p in procs:
            p.stdin.write("bye\n")
            p.stdin.flush()
        for p in procs:
            p.wait(60)
    finally:
        kill_all(procs)
    ts = [max(r["runs"][k]["t"] for r in res) for k in range(reps)]
    return {
        "t": statistics.median(ts),
        "ts": ts,
        "sent": statistics.median(r["runs"][k]["sent"] for r in res for k in range(reps)),
        "cpu": statistics.median(sum(r["runs"][k]["cpu"] for r in res) for k in range(reps)),
        "codec_s": statistics.median(max(r["runs"][k]["codec_s"] for r in res) for k in range(reps)),
        "hwm": max(r["hwm"] for r in res),
    }


def part_ring(sizes: list[int], args: argparse.Namespace, budget: Budget) -> dict:
    rows, skipped, loop_t = [], [], {}
    links = [("loopback", None)]
    if not args.no_netns:
        links.append((args.rate, "netns"))
    for label, kind in links:
        sw = None
        if kind == "netns":
            from netns import NetnsUnavailable, Swarm

            try:
                sw = Swarm(2, rate=args.rate).__enter__()
            except NetnsUnavailable as e:
                skipped.append(f"{args.rate}: all sizes ({e})")
                continue
        try:
            for n in sizes:
                for codec in args.codecs:
                    from drift.compress import make_codec

                    wire = make_codec(codec, topk_fraction=args.topk_fraction).encoded_nbytes(n)
                    why = budget.why_not(ring_need(n, codec))
                    if why is None and sw is not None:
                        est = max(wire / (rate_bits(args.rate) / 8 * 0.95), loop_t.get((n, codec), 0.0))
                        if est > args.netns_max_s:
                            why = (
                                f"one run would take ~{est:.0f} s (> {args.netns_max_s:.0f} s: "
                                f"{wire / MiB:.0f} MiB per node at {args.rate})"
                            )
                    if why:
                        skipped.append(f"{label}, θ {fmt_size(n)}, {codec}: {why}")
                        print(f"  [ring] skip {label} {fmt_size(n)} {codec}: {why}", file=sys.stderr, flush=True)
                        continue
                    reps = args.reps if 4 * n <= args.many_reps_below else 1
                    t0 = time.time()
                    r = ring_pair(n, codec, reps, args.topk_fraction, sw)
                    print(
                        f"  [ring] {label} {fmt_size(n)} {codec}: {r['t']:.2f} s ({time.time() - t0:.0f} s wall)",
                        file=sys.stderr,
                        flush=True,
                    )
                    if sw is None:
                        loop_t[(n, codec)] = r["t"]
                    theta = 4 * n
                    rows.append(
                        [
                            label,
                            fmt_size(n),
                            f"{theta / MiB:,.0f}",
                            codec,
                            reps,
                            f"{r['t']:.2f}",
                            f"{r['t'] / (theta / GiB):.2f}",
                            f"{theta / MiB / r['t']:.1f}",
                            f"{r['sent'] / MiB:,.1f}",
                            f"{r['sent'] / MiB / r['t']:.1f}",
                            f"{r['codec_s']:.2f}",
                            f"{r['cpu'] / (2 * r['sent'] / MiB):.4f}",
                            f"{r['hwm'] / theta:.2f}",
                        ]
                    )
        finally:
            if sw is not None:
                sw.close()
    table(
        "Ring all-reduce, 2 nodes (one process each), drift/ring.py Ring.allreduce_sum",
        [
            "link",
            "θ",
            "θ MiB",
            "codec",
            "reps",
            "time s",
            "s per GiB θ",
            "algbw MiB/s",
            "MiB sent/node",
            "wire MiB/s",
            "codec s",
            "CPU s/MiB",
            "peak RSS/θ per node",
        ],
        rows,
        "time: the slower node, median over reps; algbw = θ bytes / time; MiB sent/node: frames incl. headers; "
        "CPU s/MiB: CPU seconds of both processes per MiB sent by both; peak RSS/θ: VmHWM of the larger "
        "ring process over θ bytes (x, plus top-k's two residuals).",
    )
    if skipped:
        print("\nSkipped (nothing extrapolated):\n" + "\n".join(f"* {s}" for s in skipped))
    return {"rows": rows, "skipped": skipped}


# --- part 2: state transfer, checkpoint write, checkpoint load --------------------------------


async def _state_server(a: argparse.Namespace) -> None:
    import numpy as np

    from drift.diloco import ParamLayout, checksum
    from drift.state import StateServer
    from drift.transport import STATE_ALPN, Endpoint

    loop = asyncio.get_running_loop()
    ep = await Endpoint.bind("local")
    theta = np.empty(a.n, np.float32)
    fill(theta, seed=7)
    server = StateServer(allowed=lambda peer: True)
    layout = ParamLayout(("theta",), ((a.n,),))
    ck = checksum(theta, theta)
    server.publish(0, (theta, theta), ck, layout)  # one array as θ and velocity (see the docstring)
    serve = asyncio.ensure_future(ep.serve({STATE_ALPN: server.handle}))
    print(json.dumps({"ticket": ep.ticket(), "checksum": ck}), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    print(json.dumps({"hwm": own_hwm()}), flush=True)
    serve.cancel()
    await ep.close()


def _evict(path: Path) -> None:
    """Drop this file's pages from the page cache (only this file's: nothing else is touched)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def _state_client(a: argparse.Namespace) -> None:
    import numpy as np

    from drift import checkpoint as C
    from drift.state import fetch_state, into_arrays
    from drift.transport import Endpoint

    ep = await Endpoint.bind("local")
    out: dict = {}
    if a.what == "fetch":
        theta, velocity = np.empty(a.n, np.float32), np.empty(a.n, np.float32)
        theta.fill(0)  # a node's θ and velocity are live arrays: their pages exist already
        velocity.fill(0)
        t0 = time.perf_counter()
        await fetch_state(ep, [a.ticket], 0, a.checksum, into_arrays(theta, velocity), size=a.n, timeout=600)
        out["fetch_s"] = time.perf_counter() - t0
    else:
        ckdir = Path(a.dir) / "checkpoints"
        writers: list = []

        def sink(layout):
            for w in writers:
                w.abort()
            writers.append(C.CheckpointWriter(ckdir, 0, layout.names, layout.shapes))
            return writers[-1].write

        t0 = time.perf_counter()
        await fetch_state(ep, [a.ticket], 0, a.checksum, sink, size=a.n, timeout=600)
        t1 = time.perf_counter()
        path = writers[-1].commit({"bench": "scale"}, keep=3)
        t2 = time.perf_counter()
        out.update(stream_s=t1 - t0, commit_s=t2 - t1)
        files = [path / "theta.safetensors", path / "outer.safetensors"]
        for f in files:
            _evict(f)
        t0 = time.perf_counter()
        ck = C.load_checkpoint(path)
        out["load_cold_s"] = time.perf_counter() - t0
        assert ck.theta_flat.size == a.n
        del ck
        t0 = time.perf_counter()
        ck = C.load_checkpoint(path)
        out["load_hot_s"] = time.perf_counter() - t0
        del ck
        t0 = time.perf_counter()
        for f in files:
            C._map_tensors(f)
        out["map_s"] = time.perf_counter() - t0
        out["file_bytes"] = sum(f.stat().st_size for f in files)
    out["hwm"] = own_hwm()
    print(json.dumps(out), flush=True)
    await ep.close()


def part_state(sizes: list[int], args: argparse.Namespace, budget: Budget) -> dict:
    rows, skipped = [], []
    for n in sizes:
        theta = 4 * n
        need = theta + 2 * theta + 400 * MiB  # server: one array; fetch client: θ + velocity
        if why := budget.why_not(need):
            skipped.append(f"θ {fmt_size(n)}: {why}")
            continue
        free_disk = shutil.disk_usage(args.tmp).free
        if free_disk < 2 * theta + 4 * GiB:
            skipped.append(f"θ {fmt_size(n)} checkpoint: {free_disk / GiB:.0f} GiB free on {args.tmp}")
            continue
        d = Path(tempfile.mkdtemp(prefix="bench-scale-state-", dir=args.tmp))
        srv = spawn(["--role", "state-server", "--n", str(n)])
        try:
            hello = read_json(srv, 600)
            common = ["--n", str(n), "--ticket", hello["ticket"], "--checksum", hello["checksum"], "--dir", str(d)]
            f = spawn(["--role", "state-client", "--what", "fetch", *common], stdin=False)
            fr = read_json(f, 1800)
            f.wait(60)
            c = spawn(["--role", "state-client", "--what", "ckpt", *common], stdin=False)
            cr = read_json(c, 3600)
            c.wait(60)
            srv.stdin.write("bye\n")
            srv.stdin.flush()
            read_json(srv, 60)
            srv.wait(60)
        finally:
            kill_all([srv])
            shutil.rmtree(d, ignore_errors=True)
        moved = 2 * theta
        print(
            f"  [state] {fmt_size(n)}: fetch {fr['fetch_s']:.1f} s, checkpoint {cr['stream_s']:.1f}+"
            f"{cr['commit_s']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        rows.append(
            [
                fmt_size(n),
                f"{moved / MiB:,.0f}",
                f"{fr['fetch_s']:.2f}",
                f"{moved / MiB / fr['fetch_s']:.0f}",
                f"{cr['stream_s']:.2f}",
                f"{cr['commit_s']:.2f}",
                f"{cr['stream_s'] + cr['commit_s']:.2f}",
                f"{(cr['stream_s'] + cr['commit_s']) / (moved / GiB):.2f}",
                f"{cr['load_cold_s']:.2f}",
                f"{cr['load_hot_s']:.2f}",
                f"{cr['map_s'] * 1e3:.2f}",
                f"{fr['hwm'] / theta:.2f}",
                f"{cr['hwm'] / MiB:.0f}",
            ]
        )
    table(
        "State transfer (drift-state/0, loopback) and checkpoints",
        [
            "θ",
            "θ+velocity MiB",
            "fetch_state s",
            "fetch MiB/s",
            "ckpt stream s",
            "commit s",
            "ckpt total s",
            "ckpt s per GiB",
            "load cold s",
            "load hot s",
            "map only ms",
            "fetcher RSS/θ",
            "ckpt writer RSS MiB",
        ],
        rows,
        "fetch_state: into two live float32 arrays in another process (blake2b of every chunk included). ckpt: "
        "fetch_state streaming into CheckpointWriter (as Coordinator.checkpoint), then commit (fsync both files, "
        "sha256 both, manifest, rename). load: load_checkpoint, which verifies both files' sha256 (cold: the "
        "files evicted from the page cache first) and then maps them; 'map only' is drift.checkpoint._map_tensors "
        "of both files. RSS: peak VmHWM of the receiving process.",
    )
    if skipped:
        print("\nSkipped:\n" + "\n".join(f"* {s}" for s in skipped))
    return {"rows": rows, "skipped": skipped}


# --- part 3: peak RSS of a real node vs a plain torch loop -------------------------------------

RSS_ROUNDS, RSS_INNER, RSS_BATCH = 2, 2, 4


def rss_recipe(n: int, codec: str, sync: str, n_tensors: int, momentum: float = 0.9) -> dict:
    return {
        "name": f"scale-{fmt_size(n)}-{codec}-{sync}",
        "outer_optimizer": {"lr": 0.7, "momentum": momentum},
        "task_config": {"n_params": n, "n_tensors": n_tensors},
        "min_nodes": 2,
        "rounds": RSS_ROUNDS,
        "inner_steps": RSS_INNER,
        "batch_size": RSS_BATCH,
        "unit_steps": 1,
        "eval_batches": 1,
        "codec": codec,
        "sync": sync,
        "seed": 1,
        "checkpoint_every": 1000,
        "stale_after_s": 600.0,
        "heartbeat_s": 2.0,
        "network": "local",
    }


def _plain_loop(a: argparse.Namespace) -> None:
    """The same model, AdamW (decay groups as TorchWorker), grad clip and steps, by hand."""
    import numpy as np
    import torch

    from drift.workers import load_task

    torch.set_num_threads(1)
    task = load_task(HERE / "bigtask.py")
    cfg = {"n_params": a.n, "n_tensors": a.n_tensors}
    ds = task.make_dataset(cfg)
    torch.manual_seed(1)
    model = task.make_model(cfg)
    params = [p for _, p in sorted(model.named_parameters())]
    opt = plain_adamw(params, lr=3e-3)
    rng = np.random.default_rng(0)
    for _ in range(a.steps):
        (ids,) = ds.batch("train", rng.integers(0, ds.n_train, a.batch))
        opt.zero_grad(set_to_none=True)
        loss = model(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        float(loss.item())
    with torch.no_grad():
        float(model(*ds.batch("val", np.arange(a.batch))))
    print(json.dumps({"hwm": own_hwm()}), flush=True)


def plain_rss(n: int, n_tensors: int, steps: int) -> int:
    p = spawn(
        [
            "--role",
            "plain",
            "--n",
            str(n),
            "--n-tensors",
            str(n_tensors),
            "--steps",
            str(steps),
            "--batch",
            str(RSS_BATCH),
        ],
        stdin=False,
    )
    s = Sampler({"plain": p.pid})
    s.start()
    try:
        r = read_json(p, 3600)
        p.wait(60)
    finally:
        s.stop()
        kill_all([p])
    return max(r["hwm"], s.peak["plain"])


def node_rss(n: int, codec: str, sync: str, n_tensors: int, tmp: str, momentum: float = 0.9) -> dict:
    from harness.simulate import Swarm, make_task_repo

    work = Path(tempfile.mkdtemp(prefix="bench-scale-rss-", dir=tmp))
    try:
        recipe = make_task_repo(
            work / "repo", rss_recipe(n, codec, sync, n_tensors, momentum), task=HERE / "bigtask.py"
        )
        t0 = time.monotonic()
        sw = Swarm(recipe, work)
        sampler = Sampler({"coord": sw.coord.pid})
        sampler.start()
        for i in range(2):
            p = sw.join()
            sampler.add(f"n{i}", p.pid)
        try:
            rc = sw.finish(timeout=3600)
        finally:
            sampler.stop()
        wall = time.monotonic() - t0
        if rc != 0:
            raise RuntimeError(f"swarm failed (rc {rc}):\n{sw.log()[-3000:]}")
        ev = sw.events()
        rounds = [e for e in ev if e["event"] == "round"]
        steps = sum(e.get("steps", 0) for e in rounds) or None
        out = {
            "peak": {k: v for k, v in sampler.peak.items()},
            "timeline": sampler.timeline,
            "wall": wall,
            "rounds": len(rounds),
            "reduce_s": [e.get("reduce_s") for e in rounds],
            "steps": steps,
        }
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def part_rss(sizes: list[int], args: argparse.Namespace, budget: Budget) -> dict:
    runs = [(n, codec, "blocking", 1, 0.9) for n in sizes for codec in ("fp32", "int8")]
    if args.rss_overlapped:
        n_ov = min(sizes, key=lambda n: abs(n - parse_size(args.rss_overlapped)))
        runs.append((n_ov, "int8", "overlapped", 1, 0.9))
        runs.append((n_ov, "fp32", "overlapped", 1, 0.9))
    if args.rss_no_momentum:  # outer momentum 0 (the Shakespeare recipe's): no velocity held
        n_nm = min(sizes, key=lambda n: abs(n - parse_size(args.rss_no_momentum)))
        runs += [(n_nm, "int8", sync, 1, 0.0) for sync in ("blocking", "overlapped")]
    if args.rss_tensors > 1:
        n_tt = min(sizes, key=lambda n: abs(n - parse_size(args.rss_overlapped or "124M")))
        runs.append((n_tt, "fp32", "blocking", args.rss_tensors, 0.9))
    rows, skipped, plains, detail = [], [], {}, []
    # node: θ, grad, AdamW's 2 moments, AdamW's update temporary (5θ, as the plain loop) + θ_global,
    # velocity, all-reduce buffer (+ the snapshot when overlapped) + the worker's per-tensor copy
    plain_steps = 4 + RSS_ROUNDS * RSS_INNER  # calibration (1 + 3 steps) and about a node's share of the rounds
    for n, codec, sync, nt, mu in runs:
        theta = 4 * n
        need = 2 * (10 * theta + 400 * MiB) + 300 * MiB
        if why := budget.why_not(need):
            skipped.append(
                f"θ {fmt_size(n)} {codec} {sync} μ={mu:g}: 2 nodes at ~{10 * theta / GiB:.1f} GiB each: {why}"
            )
            print(f"  [rss] skip {fmt_size(n)} {codec} {sync}: {why}", file=sys.stderr, flush=True)
            continue
        key = (n, nt)
        if key not in plains:
            plains[key] = plain_rss(n, nt, plain_steps)
        plain = plains[key]
        r = node_rss(n, codec, sync, nt, args.tmp, mu)
        node = max(r["peak"]["n0"], r["peak"]["n1"])
        print(
            f"  [rss] {fmt_size(n)} {codec} {sync} μ={mu:g} x{nt}: node {gib(node)} GiB, plain {gib(plain)} GiB "
            f"({r['wall']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        rows.append(
            [
                fmt_size(n),
                nt,
                codec,
                sync,
                f"{mu:g}",
                f"{theta / MiB:,.0f}",
                f"{node / MiB:,.0f}",
                f"{min(r['peak']['n0'], r['peak']['n1']) / MiB:,.0f}",
                f"{plain / MiB:,.0f}",
                f"{node / theta:.2f}",
                f"{plain / theta:.2f}",
                f"**{(node - plain) / theta:.2f}**",
                f"{r['peak']['coord'] / MiB:,.0f}",
                f"{r['wall']:.0f}",
            ]
        )
        detail.append(
            {
                "n": n,
                "codec": codec,
                "sync": sync,
                "momentum": mu,
                "tensors": nt,
                "node": node,
                "plain": plain,
                "theta": theta,
                "timeline": {k: v[:: max(1, len(v) // 400)] for k, v in r["timeline"].items()},
            }
        )
    table(
        "Peak RSS of a real `drift join` node (2-node swarm) vs a plain torch loop",
        [
            "θ",
            "tensors",
            "codec",
            "sync",
            "outer momentum",
            "θ MiB",
            "node peak MiB",
            "other node MiB",
            "plain loop MiB",
            "node / θ",
            "plain / θ",
            "(node − plain) / θ",
            "coord peak MiB",
            "swarm wall s",
        ],
        rows,
        f"Swarm: coordinator + 2 nodes on loopback, {RSS_ROUNDS} rounds, {RSS_INNER} inner steps per node and "
        f"round at batch {RSS_BATCH}, 1 torch thread per node, checkpoint at the end (streamed by the "
        f"coordinator from a node). Plain loop: {plain_steps} AdamW steps + 1 eval batch in a fresh process. "
        "Peak: VmHWM (polled every 50 ms until exit). Target (issue 14): (node − plain) / θ ≤ 3.",
    )
    # the same peaks fitted across sizes: the fixed part (imports, iroh) drops out of the slope
    by = {}
    for d in detail:
        if d["tensors"] == 1 and d["sync"] == "blocking" and d["momentum"]:
            by.setdefault(d["codec"], []).append(d)
    slope_rows = []
    for codec, ds in by.items():
        ds.sort(key=lambda d: d["n"])
        for lo, hi in itertools.pairwise(ds):
            dth = hi["theta"] - lo["theta"]
            slope_rows.append(
                [
                    codec,
                    f"{fmt_size(lo['n'])} → {fmt_size(hi['n'])}",
                    f"{(hi['node'] - lo['node']) / dth:.2f}",
                    f"{(hi['plain'] - lo['plain']) / dth:.2f}",
                    f"**{((hi['node'] - hi['plain']) - (lo['node'] - lo['plain'])) / dth:.2f}**",
                    f"{((lo['node'] - lo['plain']) - (hi['node'] - hi['plain']) * lo['theta'] / hi['theta']) / MiB / (1 - lo['theta'] / hi['theta']):.0f}",
                ]
            )
    if slope_rows:
        table(
            "The same, per extra byte of θ between two sizes (fixed overheads drop out)",
            ["codec", "sizes", "Δnode / Δθ", "Δplain / Δθ", "Δ(node − plain) / Δθ", "fixed node − plain MiB"],
            slope_rows,
        )
    if detail:
        print("\nRSS over a node's life (MiB, the larger node, sampled; phases from the shape):")
        for d in detail:
            tl = max((d["timeline"][k] for k in ("n0", "n1")), key=lambda v: max((x for _, x in v), default=0))
            pts = tl[:: max(1, len(tl) // 24)]
            print(
                f"* {fmt_size(d['n'])} {d['codec']} {d['sync']} μ={d['momentum']:g} x{d['tensors']}: "
                + " ".join(f"{t:.0f}s:{x / MiB:.0f}" for t, x in pts)
            )
    if skipped:
        print("\nSkipped:\n" + "\n".join(f"* {s}" for s in skipped))
    return {"rows": rows, "skipped": skipped, "detail": detail}


# --- part 4: the GPT-2-shaped recipe through drift's worker vs a plain loop --------------------


def part_worker(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    from drift.workers import load_task, make_worker

    torch.set_num_threads(1)
    task = load_task(ROOT / "recipes" / "gpt2_shakespeare.py")
    from shakespeare_char import load_text  # a sibling of the task file (load_task put it on sys.path)

    cfg = {"block_size": 256} if not args.quick else {"block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 128}
    bs = 1
    ds = task.make_dataset(cfg)

    class Cached:  # the task, with its dataset built once
        make_dataset = staticmethod(lambda c: ds)
        make_model = staticmethod(task.make_model)

    opt = {"lr": 6e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "grad_clip": 1.0}
    worker = make_worker(Cached, cfg, opt, backend="torch", device="cpu", seed=0, threads=1)

    torch.manual_seed(0)
    model = task.make_model(cfg)
    params = [p for _, p in sorted(model.named_parameters())]
    popt = plain_adamw(params, lr=6e-4)
    block = cfg["block_size"]
    data = np.frombuffer(load_text().encode("utf-8"), np.uint8)
    tokens = torch.from_numpy(data[: ds.n_train * block].astype(np.int64))
    offsets = torch.arange(block)
    model.train()

    def plain(batches: list) -> None:
        loss = None
        for idx in batches:
            w = tokens[torch.from_numpy(idx * block)[:, None] + offsets]
            popt.zero_grad(set_to_none=True)
            loss = model(input_ids=w, labels=w).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            popt.step()
        float(loss.item())

    def drift(batches: list) -> None:
        for idx in batches:
            worker.train_step(idx)

    rng = np.random.default_rng(0)
    draw = lambda k: [rng.integers(0, ds.n_train, bs) for _ in range(k)]  # noqa: E731

    def timed(fn, batches) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        fn(batches)
        return len(batches) * bs / (time.perf_counter() - t0), len(batches) * bs / (time.process_time() - c0)

    warm = draw(2)
    timed(drift, warm)
    timed(plain, warm)
    w_r, p_r, w_c, p_c = [], [], [], []
    for i in range(args.worker_pairs):
        b = draw(args.worker_steps)
        order = [(drift, w_r, w_c), (plain, p_r, p_c)]
        for fn, rates, cpus in order if i % 2 == 0 else order[::-1]:
            r, c = timed(fn, b)
            rates.append(r)
            cpus.append(c)
    ratios = [w / p for w, p in zip(w_r, p_r)]
    cratios = [w / p for w, p in zip(w_c, p_c)]
    n_params = sum(p.numel() for p in model.parameters())
    med = statistics.median
    table(
        f"Worker vs plain loop: recipes/gpt2_shakespeare.py shrunk ({cfg}, batch {bs}), "
        f"{n_params / 1e6:.1f}M params, 1 thread",
        ["loop", "samples/s (median)", "samples per CPU-s (median)", "worker / plain, wall", "worker / plain, CPU"],
        [
            ["plain torch loop", f"{med(p_r):.3f}", f"{med(p_c):.3f}", "", ""],
            [
                "drift TorchWorker.train_step",
                f"{med(w_r):.3f}",
                f"{med(w_c):.3f}",
                f"**{med(ratios) * 100:.1f} %**",
                f"{med(cratios) * 100:.1f} %",
            ],
        ],
        f"{args.worker_pairs} pairs x {args.worker_steps} steps, same batches in a pair, who goes first alternating; "
        f"pairs (wall): {', '.join(f'{r * 100:.1f}' for r in ratios)}. Target (issue 14): ≥ 97 %.",
    )
    return {"ratio": med(ratios), "cpu_ratio": med(cratios), "worker": med(w_r), "plain": med(p_r)}


# --- main --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help=f"θ sizes in float32 parameters [default: {DEFAULT_SIZES}]")
    ap.add_argument("--parts", default="ring,state,rss,worker")
    ap.add_argument("--quick", action="store_true", help="smoke run: small sizes, 1 rep, tiny models")
    ap.add_argument("--codecs", default="fp32,int8,topk")
    ap.add_argument("--reps", type=int, default=3, help="ring repetitions for θ under --many-reps-below")
    ap.add_argument("--many-reps-below", type=int, default=600 * MiB, help=argparse.SUPPRESS)
    ap.add_argument("--topk-fraction", type=float, default=0.01)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--netns-max-s", type=float, default=180.0, help="skip limited-link runs longer than this")
    ap.add_argument("--no-netns", action="store_true")
    ap.add_argument("--rss-sizes", default=None, help="sizes for the rss part [default: --sizes]")
    ap.add_argument("--rss-overlapped", default="124M", help="size for the overlapped-rule runs ('' = none)")
    ap.add_argument("--rss-no-momentum", default="124M", help="size for the outer-momentum-0 runs ('' = none)")
    ap.add_argument("--rss-tensors", type=int, default=1, help="also one fp32 run with θ split into this many tensors")
    ap.add_argument("--worker-pairs", type=int, default=6)
    ap.add_argument("--worker-steps", type=int, default=3)
    ap.add_argument("--max-gib", type=float, default=16.0, help="memory cap for one run (all its processes)")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where checkpoints and swarm dirs go")
    ap.add_argument("--json", default=None, help="also write every figure here")
    # worker processes
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--codec", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="local", help=argparse.SUPPRESS)
    ap.add_argument("--what", default="fetch", help=argparse.SUPPRESS)
    ap.add_argument("--ticket", default="", help=argparse.SUPPRESS)
    ap.add_argument("--checksum", default="", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--n-tensors", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=4, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.role == "ring":
        asyncio.run(_ring_worker(args))
        return 0
    if args.role == "state-server":
        asyncio.run(_state_server(args))
        return 0
    if args.role == "state-client":
        asyncio.run(_state_client(args))
        return 0
    if args.role == "plain":
        _plain_loop(args)
        return 0

    if args.quick:
        args.sizes = args.sizes or "2M,10M"
        args.reps, args.worker_pairs, args.worker_steps = 1, 2, 2
        args.netns_max_s = min(args.netns_max_s, 20.0)
        args.rss_overlapped = args.rss_overlapped if args.rss_overlapped != "124M" else "10M"
        args.rss_no_momentum = args.rss_no_momentum if args.rss_no_momentum != "124M" else "10M"
    sizes = [parse_size(s) for s in (args.sizes or DEFAULT_SIZES).split(",") if s.strip()]
    args.codecs = [c for c in args.codecs.split(",") if c]
    parts = [p for p in args.parts.split(",") if p]
    budget = Budget(args.max_gib)
    mi = meminfo()
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        rev = "?"
    import numpy
    import torch

    print(
        f"bench_scale: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, drift {rev}, {os.cpu_count()} CPUs, "
        f"RAM {gib(mi['MemTotal'])} GiB (available {gib(mi['MemAvailable'])}), cap {args.max_gib:g} GiB per run, "
        f"torch {torch.__version__}, numpy {numpy.__version__}"
    )
    print(f"sizes: {', '.join(f'{fmt_size(n)} ({4 * n / MiB:,.0f} MiB)' for n in sizes)}; parts: {', '.join(parts)}")
    t_start = time.time()
    out: dict = {"sizes": sizes}
    if "ring" in parts:
        out["ring"] = part_ring(sizes, args, budget)
    if "state" in parts:
        out["state"] = part_state(sizes, args, budget)
    if "rss" in parts:
        rss_sizes = [parse_size(s) for s in args.rss_sizes.split(",")] if args.rss_sizes else sizes
        out["rss"] = part_rss(rss_sizes, args, budget)
    if "worker" in parts:
        out["worker"] = part_worker(args)
    print(f"\nbench_scale: done in {time.time() - t_start:.0f} s wall-clock")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    sys.exit(main())
