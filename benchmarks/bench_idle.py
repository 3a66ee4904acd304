"""What an idle connection costs the end that holds many (issue 40, item 3): a coordinator keeps a
control connection to every node, and between a round's messages (a thousand nodes all-reduce for
tens of seconds on this machine) it only holds them.

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_idle.py --conns 250 500 1000

One drift Endpoint accepts N control channels from N client endpoints (in a child process, one
iroh endpoint each, as N nodes), each of which sends one frame and then nothing. After 5 s, the
accepting process's CPU (user + system from /proc, iroh's runtime threads included) and the
clients' over --seconds of silence, per second: what QUIC's keep-alives and iroh's path upkeep
cost, which drift's Python binding of iroh cannot configure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from bench_light_swarm import cpu_s


async def hold(n: int, seconds: float) -> tuple[float, float]:
    """(server ms/s, clients ms/s) with n idle connections."""
    from drift.transport import Endpoint

    ep = await Endpoint.bind("local")
    chans = []

    async def take() -> None:
        while len(chans) < n:
            _, conn = await ep.accept()
            ch = await Endpoint.accept_channel(conn)
            await ch.recv_frame(64)
            chans.append(ch)

    taking = asyncio.ensure_future(take())
    child = subprocess.Popen([sys.executable, __file__, "--client", str(n), ep.ticket()])
    try:
        await asyncio.wait_for(taking, 60 + n / 5)
        await asyncio.sleep(5)  # (handshakes settle)
        me = os.getpid()
        c0, k0, t0 = cpu_s(me), cpu_s(child.pid), time.monotonic()
        await asyncio.sleep(seconds)
        c1, k1, t1 = cpu_s(me), cpu_s(child.pid), time.monotonic()
        return 1000 * (c1 - c0) / (t1 - t0), 1000 * (k1 - k0) / (t1 - t0)
    finally:
        child.kill()
        child.wait()
        await ep.close()


async def clients(n: int, ticket: str) -> None:
    from drift.transport import CONTROL_ALPN, Endpoint

    held = []
    for _ in range(n):
        ep = await Endpoint.bind("local")
        ch = await ep.connect(ticket, CONTROL_ALPN)
        await ch.send_frame(b"hello")
        held.append((ep, ch))
    await asyncio.sleep(3600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, nargs="+", default=[250, 500, 1000])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--client", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        asyncio.run(clients(int(a.client[0]), a.client[1]))
        return
    print(f"{'connections':>11} {'holder ms/s':>11} {'µs/s each':>9} {'clients ms/s':>12}")
    for n in a.conns:
        server, client = asyncio.run(hold(n, a.seconds))
        print(f"{n:>11} {server:>11.1f} {1000 * server / n:>9.1f} {client:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
