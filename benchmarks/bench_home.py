"""The home link: seconds per sync for the int8 ring and the sparse direct all-gather, 4 nodes on
asymmetric links (benchmarks/netns.py: 20 Mbit/s up, 100 Mbit/s down per node, + 20 ms each way),
real iroh processes in network namespaces (needs root). (A tree all-gather, measured beside them
in BENCHMARKS.md at commit cf30232, was removed from drift/gather.py since.)

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_home.py
    flock /tmp/drift-cpu.lock python3 benchmarks/bench_home.py --sizes 124000000 --reps 2

θ is one flat float32 tensor of each size (benchmarks/bigtask.py's θ has the same bytes). The ring
reduces a real θ-sized vector (int8, drift's default codec); the all-gathers carry payloads of the
sparse rule's exact size (drift/sync/sparse.py, top-64 of 4,096, a sign bit a value: 0.14 bits per
value of θ), whose content does not change what the wire carries. So a 1B θ fits this machine for the
sparse rows (30 MB per payload); a 1B ring needs 4 × 4 GB of θ and ~10 minutes per sync on these
links: it runs only with --ring-max (parameters), else it is computed from the ring's measured
bytes per second and printed as computed. The sparse rule's CPU work (encode one θ, decode and sum
4 payloads) is timed here once per size in this process, before the swarm starts, and added to the
transfer for "s/sync".

Then node utilization for recipes/gpt2-small.yaml's round (inner_steps x one GPU step, from a
published throughput, below) against those seconds per sync: blocking (compute, then sync) and
overlapped (the sync of round r runs under round r+1's compute: recipe `overlap`).
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

HERE = Path(__file__).resolve().parent

MiB = 1 << 20
CHUNK, K = 4096, 64  # the sparse rule's defaults

# Published GPU figure: llm.c's GPT-2 (124M) reproduction, 10B tokens in ~90 min on one 8xA100
# 80GB SXM node (Karpathy, github.com/karpathy/llm.c discussion #481, 2024-05-28):
# 10e9 / 5400 s / 8 = 231k tokens/s per A100. Scaled to the recipe's 86.0M-parameter model by
# training FLOPs per token (6N + 12 L T d: 859M for 124M, 629M for 86.0M at L 12, T 1024, d 768).
A100_TOKENS_S_124M = 10e9 / 5400 / 8
RECIPE_PARAMS = 86_039_040
FLOPS_124M = 6 * 124_439_808 + 12 * 12 * 1024 * 768
FLOPS_RECIPE = 6 * RECIPE_PARAMS + 12 * 12 * 1024 * 768


# --- worker (one per node, in its namespace) ---------------------------------------------------


async def _worker() -> None:
    import numpy as np

    from drift.gather import Gather
    from drift.protocol import RingMember
    from drift.ring import Ring
    from drift.sync.sparse import Codec
    from drift.transport import GATHER_ALPN, RING_ALPN, Endpoint

    ep = await Endpoint.bind("lan")
    ring, gather = Ring(ep, timeout=1200), Gather(ep, timeout=600)
    serving = asyncio.ensure_future(ep.serve({RING_ALPN: ring.handle_incoming, GATHER_ALPN: gather.handle_incoming}))
    print(json.dumps({"ticket": ep.ticket(), "node_id": ep.node_id}), flush=True)
    loop = asyncio.get_running_loop()
    readline = lambda: loop.run_in_executor(None, sys.stdin.readline)  # noqa: E731
    peers = json.loads(await readline())
    members = [RingMember(node_id=p["node_id"], ticket=p["ticket"], weight=1 / len(peers)) for p in peers]
    rng = np.random.default_rng(int(ep.node_id[:8], 16))
    rnd = 0
    while line := (await readline()).strip():
        op, n = json.loads(line)
        rnd += 1
        if op == "ring":
            x = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
            t0 = time.perf_counter()
            st = await ring.allreduce_sum(x, members, rnd, codec="int8")
            del x
        else:
            nbytes = Codec(n, CHUNK, K).nbytes
            payload = rng.bytes(nbytes)
            t0 = time.perf_counter()
            got, st = await gather.allgather(payload, members, rnd, nbytes)
            assert len(got) == len(members) and all(len(b) == nbytes for b in got)
        print(json.dumps({"t": time.perf_counter() - t0, "sent": st.bytes_sent}), flush=True)
    serving.cancel()
    ring.close()
    await ep.close()


# --- orchestrator ------------------------------------------------------------------------------


def sparse_cpu_seconds(n: int, nodes: int) -> tuple[float, float]:
    """(encode one θ of n values, decode + norm + sum `nodes` payloads) in this process, seconds."""
    import numpy as np

    from drift.sync.sparse import Codec

    codec = Codec(n, CHUNK, K)
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    t0 = time.perf_counter()
    payload = codec.encode(x)
    t_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(nodes):  # what SparseLoCo.combine does per payload: its norm, then its terms
        codec.norm(payload)
        for flat, vals in codec.pieces(payload):
            x[flat] += np.float32(0.25) * vals
    return t_enc, time.perf_counter() - t0


def _bps(rate: str) -> float:
    """'20mbit' -> bytes per second."""
    return float(rate.lower().removesuffix("mbit")) * 1e6 / 8


def calibrate(res: dict, nodes: int, up: float, down: float, rtt: float) -> None:
    """The link model of bench_collectives.py beside each measured transfer, and its two knobs fitted
    to them (least squares): the share of the link rate a transfer gets, and a step's cost beyond
    half an RTT. Its scale table then states sync times with these (--efficiency, --step-ms)."""
    import numpy as np
    from bench_collectives import rows, seconds

    name = {"ring": "int8 ring", "direct": "sparse, flat all-gather"}
    xs, ys, seen = [], [], []
    for (op, n), runs in sorted(res.items()):
        steps = next(st for m, nm, _, _, st in rows(n, [nodes], CHUNK, K, []) if nm == name[op])
        t = statistics.median(r["t"] for r in runs)
        xs.append([seconds(steps, up, down, 0.0), sum(c for c, _, _ in steps)])
        ys.append(t - seconds(steps, np.inf, np.inf, rtt))
        seen.append((op, n, t, seconds(steps, up, down, rtt), steps))
    if len(ys) < 2:
        return
    (inv_eff, step_s), *_ = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)
    eff = 1 / inv_eff
    print(f"\nthe link model, fitted: efficiency {eff:.3f}, a step {step_s * 1e3:.1f} ms beyond half an RTT")
    print(f"{'θ':>6} {'method':<24}{'measured s':>11}{'model s':>9}{'fitted s':>10}")
    for op, n, t, model, steps in seen:
        fitted = seconds(steps, up, down, rtt, eff, step_s)
        print(f"{n / 1e6:>5.0f}M {name[op]:<24}{t:>11.2f}{model:>9.2f}{fitted:>10.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[124_000_000, 1_000_000_000], help="θ sizes (values)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--up", default="20mbit")
    ap.add_argument("--down", default="100mbit")
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--ring-max", type=int, default=200_000_000, help="largest θ the ring is run for")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        asyncio.run(_worker())
        return 0

    from netns import Swarm

    print(
        f"bench_home: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {os.cpu_count()} CPUs, {a.nodes} nodes, "
        f"links {a.up} up / {a.down} down + {a.delay_ms:g} ms each way"
    )
    cpu = {n: sparse_cpu_seconds(n, a.nodes) for n in a.sizes if n <= a.ring_max or n == min(a.sizes)}
    for n, (enc, comb) in cpu.items():
        print(f"  sparse CPU, θ {n / 1e6:.0f}M: encode {enc:.2f} s, decode + sum {a.nodes} payloads {comb:.2f} s")
    plan = [(op, n) for n in a.sizes for op in (["ring"] if n <= a.ring_max else []) + ["direct"]]
    res: dict[tuple[str, int], list[dict]] = {}
    with Swarm(a.nodes, up=a.up, down=a.down, delay_ms=a.delay_ms) as sw:
        procs = [
            subprocess.Popen(
                [*sw.exec_prefix(i), sys.executable, str(Path(__file__).resolve()), "--worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            for i in range(a.nodes)
        ]
        try:
            peers = [json.loads(p.stdout.readline()) for p in procs]
            for p in procs:
                p.stdin.write(json.dumps(peers) + "\n")
                p.stdin.flush()
            for op, n in [("ring", 1024), ("direct", 1024)] + plan * a.reps:  # warm-up first
                tx0 = [sw.tx_bytes(i) for i in range(a.nodes)]
                for p in procs:  # all start together: the orchestrator is the barrier
                    p.stdin.write(json.dumps([op, n]) + "\n")
                    p.stdin.flush()
                rows = [json.loads(p.stdout.readline() or "null") for p in procs]
                if None in rows:
                    raise RuntimeError(f"a worker exited during {op} {n}")
                wire = max(sw.tx_bytes(i) - b for i, b in enumerate(tx0))
                r = {"t": max(x["t"] for x in rows), "sent": max(x["sent"] for x in rows), "wire": wire}
                if n > 1024:
                    res.setdefault((op, n), []).append(r)
                    print(
                        f"  {op:<7}{n / 1e6:>7.0f}M  {r['t']:8.2f} s  {r['sent'] / MiB:8.1f} MiB sent, wire {wire / MiB:.1f}"
                    )
            for p in procs:
                p.stdin.write("\n")
                p.stdin.flush()
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    out = []
    base = max(cpu)  # the sparse CPU work of bigger θ is scaled from it (linear in values)
    print(f"\n{'θ':>6} {'method':<14}{'transfer s':>11}{'+ CPU s':>9}{'s/sync':>9}{'MiB up/node':>13}{'wire MiB':>10}")
    for n in a.sizes:
        for op in ("ring", "direct"):
            label = {"ring": "int8 ring", "direct": "sparse direct"}[op]
            if runs := res.get((op, n)):
                t, sent, wire, how = (
                    statistics.median(r["t"] for r in runs),
                    runs[0]["sent"],
                    runs[0]["wire"],
                    "measured",
                )
            elif op == "ring" and any(
                o == "ring" for o, _ in res
            ):  # from the largest ring measured: its bytes and bytes per second, x n
                m = max(k for o, k in res if o == "ring")
                r0 = res[("ring", m)]
                t0, sent0 = statistics.median(r["t"] for r in r0), r0[0]["sent"]
                t, sent, wire, how = t0 * n / m, sent0 * n / m, 0, f"computed from {m / 1e6:.0f}M"
            else:
                continue
            extra = 0.0 if op == "ring" else sum(cpu.get(n) or (v * n / base for v in cpu[base]))
            if op != "ring" and n not in cpu:
                how += " (CPU scaled)"
            row = dict(n=n, method=label, how=how, transfer_s=t, cpu_s=extra, s_sync=t + extra, sent_mib=sent / MiB)
            out.append(row)
            w = f"{wire / MiB:.1f}" if wire else "-"
            print(
                f"{n / 1e6:>5.0f}M {label:<14}{t:>11.2f}{extra:>9.2f}{t + extra:>9.2f}{sent / MiB:>13.1f}{w:>10}  {how}"
            )

    calibrate(res, a.nodes, _bps(a.up), _bps(a.down), 2 * a.delay_ms / 1e3)

    tok_s = A100_TOKENS_S_124M * FLOPS_124M / FLOPS_RECIPE
    step = 16 * 1024 / tok_s
    compute = 50 * step
    print(
        f"\nrecipes/gpt2-small.yaml: θ {RECIPE_PARAMS:,}, 50 inner steps of 16 x 1024 tokens; one A100 at "
        f"{tok_s / 1e3:.0f}k tokens/s (llm.c's 124M figure, scaled by FLOPs/token) -> {step * 1e3:.0f} ms a step, "
        f"{compute:.2f} s of compute a round. Sync seconds scaled from the θ nearest it to "
        f"{RECIPE_PARAMS / 1e6:.1f}M by bytes (linear)."
    )
    small = min(a.sizes, key=lambda n: abs(n - RECIPE_PARAMS))
    for row in (r for r in out if r["n"] == small):
        s = row["s_sync"] * RECIPE_PARAMS / small
        print(
            f"  {row['method']:<14} {s:7.2f} s/sync  utilization blocking {compute / (compute + s):6.1%}"
            f"  overlapped {compute / max(compute, s):6.1%}"
        )
    print("\nJSON " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
