"""Ring all-reduce, side by side in one run: torch.distributed gloo fp32 vs drift's ring (fp32,
int8, top-k), on loopback and on bandwidth-limited links between network namespaces.

    flock /tmp/drift-bench.lock python benchmarks/bench_ring.py                 # 2 and 4 nodes, 64 MiB
    flock /tmp/drift-bench.lock python benchmarks/bench_ring.py --nodes 2 --mib 16 --no-netns

Every node is its own process (real iroh endpoints; gloo over TCP). Each measurement starts
after a gloo barrier; its time is the slowest node's. Figures printed per row:
  algbw        fp32 bytes reduced / time (the tensor size over the all-reduce time)
  MiB/node     bytes a node sends (drift: frames incl. headers; gloo: 2(N-1)/N x tensor, its
               ring's algorithmic volume); on namespaces also `wire`, the veth tx bytes incl.
               IP/UDP/TCP/QUIC overhead, measured
  x gloo       algbw / gloo's algbw
  vs bound     the time the bytes a node sends would take at the measured point-to-point
               throughput (one iroh stream, nothing else running), over the actual time; for fp32
               this is the ring's lower bound 2(N-1)/N x bytes / p2p
  vs links     the same against `links`: every node sending to its right neighbour and
               receiving from its left at once, raw frames, no reduction (the ring's own link
               load, measured; on 2 shared cores this is what the CPU leaves for each link).
               Also printed: the same raw transfer at 1/4 of the volume (about int8's), to show
               the fixed start-up cost a shorter transfer pays.
  CPU s/MiB    CPU seconds of all nodes (all threads) per MiB sent by all nodes
  py CPU       share of that CPU spent on each node's main (Python/asyncio/numpy) thread; the rest
               is iroh's Rust threads (QUIC, encryption, UDP); gloo runs in a helper thread: `-`
  codec s      seconds a node spent encoding/decoding/accumulating (drift rows)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

MiB = 1 << 20


# --- worker (one per node) ---------------------------------------------------------------------


def _wire_tx(ifname: str | None) -> int:
    if not ifname:
        return 0
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == ifname:
            return int(rest.split()[8])
    return 0


async def _worker(a: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from drift.protocol import RingMember
    from drift.ring import Ring
    from drift.transport import RING_ALPN, Endpoint

    rank, world = a.rank, a.world
    ep = await Endpoint.bind(a.mode)
    ring = Ring(ep, timeout=600, chunk_bytes=a.chunk_kib * 1024)
    print(json.dumps({"ticket": ep.ticket(), "node_id": ep.node_id}), flush=True)
    peers = json.loads(sys.stdin.readline())
    members = [RingMember(node_id=p["node_id"], ticket=p["ticket"], weight=1 / world) for p in peers]

    acc = asyncio.ensure_future(ep.serve({RING_ALPN: ring.handle_incoming}))
    loop = asyncio.get_running_loop()
    if a.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = a.ifname
    await loop.run_in_executor(
        None, lambda: dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=rank, world_size=world)
    )

    async def barrier() -> None:
        await loop.run_in_executor(None, dist.barrier)

    n = a.mib * MiB // 4
    rng = np.random.default_rng(rank)
    base = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    results: dict[str, list[dict]] = {}

    def record(name: str, **kw) -> None:
        results.setdefault(name, []).append(kw)

    async def measure(name: str, body) -> None:
        for _ in range(a.reps):
            await barrier()
            w0, c0, m0, t0 = _wire_tx(a.ifname), time.process_time(), time.thread_time(), time.perf_counter()
            sent, codec_s = await body()
            t = time.perf_counter() - t0
            record(
                name,
                t=t,
                cpu=time.process_time() - c0,
                main=time.thread_time() - m0,
                sent=sent,
                wire=_wire_tx(a.ifname) - w0,
                codec_s=codec_s,
            )

    # connections up once (and warm) before anything is timed
    await barrier()
    await ring.allreduce_sum(np.ones(1024, np.float32), members, 0)
    right, left = await ring._configure(members, 0)
    frame = np.zeros(MiB, np.uint8)

    async def raw_send(ch, total: int) -> None:
        for off in range(0, total, MiB):
            await ch.send_frame(frame[: min(MiB, total - off)], timeout=600)

    async def raw_recv(ch, total: int) -> None:
        for _off in range(0, total, MiB):
            await ch.recv_frame(MiB, timeout=600)

    tensor_bytes = 4 * n

    async def p2p():  # rank 0 -> rank 1 only
        if rank == 0:
            await raw_send(right, tensor_bytes)
            return tensor_bytes, 0.0
        if rank == 1:
            await raw_recv(left, tensor_bytes)
        return 0, 0.0

    link_bytes = 2 * (world - 1) * tensor_bytes // world

    async def links():
        await asyncio.gather(raw_send(right, link_bytes), raw_recv(left, link_bytes))
        return link_bytes, 0.0

    small_bytes = link_bytes // 4  # about what int8 sends: the fixed cost of a shorter transfer

    async def links_small():
        await asyncio.gather(raw_send(right, small_bytes), raw_recv(left, small_bytes))
        return small_bytes, 0.0

    async def gloo_p2p():
        t = torch.from_numpy(base)
        if rank == 0:
            await loop.run_in_executor(None, lambda: dist.send(t, dst=1))
            return tensor_bytes, 0.0
        if rank == 1:
            await loop.run_in_executor(None, lambda: dist.recv(t, src=0))
        return 0, 0.0

    async def gloo():
        t = torch.from_numpy(base.copy())
        await loop.run_in_executor(None, lambda: dist.all_reduce(t))
        return link_bytes, 0.0

    def drift(codec: str):
        async def run():
            x = base.copy()
            st = await ring.allreduce_sum(x, members, 1, codec=codec, topk_fraction=a.topk_fraction)
            return st.bytes_sent, st.codec_seconds

        return run

    await measure("p2p", p2p)
    await measure("links", links)
    await measure("links_small", links_small)
    await measure("gloo_p2p", gloo_p2p)
    await measure("gloo", gloo)
    for codec in a.codecs:
        await measure(codec, drift(codec))
    await barrier()
    print(json.dumps({"results": results}), flush=True)
    acc.cancel()
    ring.close()
    await ep.close()
    dist.destroy_process_group()


# --- orchestrator ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_swarm(world: int, args: argparse.Namespace, swarm=None) -> dict[str, list[list[dict]]]:
    """Start `world` worker processes, wire them up, return per-node results."""
    if swarm is None:
        master, mode, prefixes, ifname = f"127.0.0.1:{_free_port()}", "local", [[]] * world, ""
    else:
        master, mode, ifname = f"{swarm.addr(0)}:29500", "lan", swarm.ifname
        prefixes = [swarm.exec_prefix(i) for i in range(world)]
    procs = []
    try:
        for i in range(world):
            cmd = [
                *prefixes[i],
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                "--rank",
                str(i),
                "--world",
                str(world),
                "--master",
                master,
                "--mode",
                mode,
                "--mib",
                str(args.mib),
                "--reps",
                str(args.reps),
                "--ifname",
                ifname,
                "--topk-fraction",
                str(args.topk_fraction),
                "--chunk-kib",
                str(args.chunk_kib),
                "--codecs",
                *args.codecs,
            ]
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            )
        peers = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.stdin.write(json.dumps(peers) + "\n")
            p.stdin.flush()
        out = []
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker exited early (rc {p.wait()})")
            out.append(json.loads(line)["results"])
            p.wait(timeout=60)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def summarize(world: int, per_node: list[dict], mib: int, label: str) -> list[dict]:
    names = list(per_node[0])
    reps = len(per_node[0][names[0]])
    tensor = mib * MiB

    def med(name: str, key: str, agg) -> float:
        return statistics.median(agg(node[name][r][key] for node in per_node) for r in range(reps))

    t = {k: med(k, "t", max) for k in names}
    p2p_bps = tensor / t["p2p"]
    link_bps = (2 * (world - 1) * tensor // world) / t["links"]
    print(f"\n{label}: {world} nodes, {mib} MiB fp32, median of {reps} runs (slowest node each)")
    print(f"  point to point, iroh (1 stream, alone): {p2p_bps / MiB:8.1f} MiB/s")
    print(f"  ring links, iroh (all {world} at once):     {link_bps / MiB:8.1f} MiB/s per link")
    small = (2 * (world - 1) * tensor // world) // 4
    print(
        f"  ring links, 1/4 of that volume:         {small / t['links_small'] / MiB:8.1f} MiB/s per link"
        f" ({t['links_small']:.2f} s: a shorter transfer pays the same start-up)"
    )
    print(f"  point to point, gloo TCP (alone):       {tensor / t['gloo_p2p'] / MiB:8.1f} MiB/s")
    hdr = (
        f"  {'method':<12}{'time s':>8}{'algbw MiB/s':>13}{'MiB/node':>10}{'wire MiB':>10}{'x gloo':>8}"
        f"{'vs bound':>10}{'vs links':>10}{'CPU s/MiB':>11}{'py CPU':>8}{'codec s':>9}"
    )
    print(hdr)
    rows = []
    for k in ["gloo", *[c for c in names if c not in ("p2p", "links", "links_small", "gloo_p2p", "gloo")]]:
        sent = med(k, "sent", lambda v: sum(v) / world)
        wire = med(k, "wire", lambda v: sum(v) / world)
        cpu = med(k, "cpu", sum)
        codec_s = med(k, "codec_s", max)
        main = med(k, "main", sum)
        row = dict(
            method=k if k == "gloo" else f"drift {k}",
            nodes=world,
            link=label,
            time_s=t[k],
            algbw=tensor / t[k] / MiB,
            mib_node=sent / MiB,
            wire_mib=wire / MiB,
            x_gloo=t["gloo"] / t[k],
            vs_bound=(sent / p2p_bps) / t[k],
            vs_links=(sent / link_bps) / t[k],
            cpu_per_mib=cpu / (sent * world / MiB),
            py_share=main / cpu if cpu else 0.0,
            codec_s=codec_s,
        )
        rows.append(row)
        wire_s = f"{row['wire_mib']:.1f}" if wire else "-"
        py_s = f"{row['py_share']:.2f}" if k != "gloo" else "-"
        print(
            f"  {row['method']:<12}{t[k]:>8.2f}{row['algbw']:>13.1f}{row['mib_node']:>10.1f}"
            f"{wire_s:>10}{row['x_gloo']:>8.2f}{row['vs_bound']:>10.2f}{row['vs_links']:>10.2f}"
            f"{row['cpu_per_mib']:>11.4f}{py_s:>8}{codec_s:>9.2f}"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=int, default=64, help="fp32 tensor size in MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--codecs", nargs="+", default=["fp32", "int8", "topk"])
    ap.add_argument("--topk-fraction", type=float, default=0.01)
    ap.add_argument("--chunk-kib", type=int, default=1024, help="ring chunk size (KiB of float32)")
    ap.add_argument("--rate", default="100mbit", help="tbf rate of each namespace link")
    ap.add_argument("--netns-mib", type=int, default=None, help="tensor size on limited links (default --mib)")
    ap.add_argument("--no-loopback", action="store_true")
    ap.add_argument("--no-netns", action="store_true")
    # worker-only
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--master", default="", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="local", help=argparse.SUPPRESS)
    ap.add_argument("--ifname", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        asyncio.run(_worker(args))
        return 0

    print(
        f"bench_ring: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {os.cpu_count()} CPUs, "
        f"codecs {args.codecs}, topk_fraction {args.topk_fraction}"
    )
    rows: list[dict] = []
    if not args.no_loopback:
        for world in args.nodes:
            rows += summarize(world, run_swarm(world, args), args.mib, "loopback")
    if not args.no_netns:
        from netns import NetnsUnavailable, Swarm

        mib = args.netns_mib or args.mib
        sub = argparse.Namespace(**{**vars(args), "mib": mib})
        try:
            for world in args.nodes:
                with Swarm(world, rate=args.rate) as sw:
                    rows += summarize(world, run_swarm(world, sub, sw), mib, args.rate)
        except NetnsUnavailable as e:
            print(f"\nbandwidth-limited links: skipped ({e})")
    print("\nJSON " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
