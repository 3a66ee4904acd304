"""Point-to-point iroh throughput between two processes on loopback, with and without drift's
fix for the per-byte copy in iroh's Python binding (drift/transport.py).

    python benchmarks/bench_transport.py [--mib 256] [--write-mib 1]

Prints MiB/s for each configuration and the ratio: the binding as shipped, drift's fix on one
QUIC stream, and the fix on 4 concurrent streams of one connection. The unfixed binding is so
slow that it is measured on a smaller payload (the rate, not the total, is what is compared).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import numpy as np

from drift import transport
from drift.transport import CONTROL_ALPN, Channel, Endpoint


async def receiver(fixed_mib: int, write_mib: float) -> None:
    ep = await Endpoint.bind("local")
    rows = []
    for fix, streams, mib in ((False, 1, 4), (True, 1, fixed_mib), (True, 4, fixed_mib)):
        proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--send",
                ep.ticket(),
                "--mib",
                str(mib),
                "--write-mib",
                str(write_mib),
                "--streams",
                str(streams),
            ]
            + ([] if fix else ["--nofix"]),
            stdout=subprocess.PIPE,
            text=True,
        )
        _alpn, conn = await ep.accept(timeout=60)
        chans = [await Endpoint.accept_channel(conn, timeout=60) for _ in range(streams)]

        async def drain(ch) -> int:
            got = 0
            while frame := await ch.recv_frame(64 << 20, timeout=600):
                got += len(frame)
            return got

        got = sum(await asyncio.gather(*(drain(c) for c in chans)))
        await chans[0].send_frame(b"done")
        out, _ = proc.communicate(timeout=60)
        rows.append((fix, streams, got / 2**20, float(out.strip())))
    await ep.close()
    print(f"{'copy fix':<10}{'streams':>8}{'MiB sent':>10}{'seconds':>10}{'MiB/s':>10}")
    for fix, streams, mib, secs in rows:
        print(f"{'on' if fix else 'off':<10}{streams:>8}{mib:>10.0f}{secs:>10.2f}{mib / secs:>10.1f}")
    rate = [mib / secs for _, _, mib, secs in rows]
    print(f"speed-up of the fix: {rate[1] / rate[0]:.0f}x on one stream, {rate[2] / rate[0]:.0f}x on 4 streams")


async def sender(ticket: str, mib: int, write_mib: float, fix: bool, streams: int) -> None:
    if not fix:
        transport.uninstall_copy_fix()
    ep = await Endpoint.bind("local")
    ch = await ep.connect(ticket, CONTROL_ALPN)
    chans = [ch] + [Channel(ch.conn, await ch.conn.open_bi()) for _ in range(streams - 1)]
    chunk = np.random.default_rng(0).integers(0, 256, int(write_mib * 2**20), dtype=np.uint8)
    n = int(mib / write_mib) // streams

    async def pump(c: Channel) -> None:
        for _ in range(n):
            await c.send_frame(chunk)
        await c.send_frame(b"")

    t0 = time.perf_counter()
    await asyncio.gather(*(pump(c) for c in chans))
    await ch.recv_frame(16, timeout=600)
    print(time.perf_counter() - t0)
    await ep.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--write-mib", type=float, default=1.0)
    ap.add_argument("--send")
    ap.add_argument("--nofix", action="store_true")
    ap.add_argument("--streams", type=int, default=1)
    a = ap.parse_args()
    if a.send:
        asyncio.run(sender(a.send, a.mib, a.write_mib, not a.nofix, a.streams))
    else:
        asyncio.run(receiver(a.mib, a.write_mib))


if __name__ == "__main__":
    main()
