"""A joiner taking θ (drift-state/1) from one holder vs from several at once, each holder its own
process serving a real StateServer on a real iroh endpoint; on loopback, and (as root) between
network namespaces where each holder's upload is limited by tc tbf (benchmarks/netns.py).

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_state_fetch.py                  # 1024 MiB
    flock /tmp/drift-cpu.lock python3 benchmarks/bench_state_fetch.py --mib 256 --no-netns

Printed per row: holders asked, seconds from the first connect to the last piece written
(manifest checked, every piece checked against its digest), MiB/s, and the pieces each holder
sent. θ only (arrays=1, as the sparse rule's transfer): N MiB of float32. The two "liar" rows
add a holder that serves bad pieces under the right manifest, named first: the first fetch
finds it out on its first piece, the second does not ask it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _theta(mib: int) -> np.ndarray:
    """The same θ in every process, cheap to make: N MiB of float32."""
    theta = np.arange(mib << 18, dtype=np.float32)
    theta *= np.float32(1e-3)
    return theta


async def holder(args: argparse.Namespace) -> None:
    """Serve θ until stdin closes; print the ticket, then (at the end) the pieces served."""
    from drift.diloco import ParamLayout, checksum
    from drift.state import StateServer
    from drift.transport import STATE_ALPN, Endpoint

    theta = _theta(args.mib)
    agreed = checksum(theta)  # (its piece digests are what this process serves as the manifest)
    if args.lies:  # θ changed after its checksum was taken: the manifest is right, the pieces not
        theta[:: 1 << 20] += 1
    server = StateServer(allowed=lambda peer: True)
    server.publish(0, (theta,), agreed, ParamLayout(("w",), ((theta.size,),)))
    ep = await Endpoint.bind(args.mode, alpns=(STATE_ALPN,))
    serving = asyncio.ensure_future(ep.serve({STATE_ALPN: server.handle}))
    print(json.dumps({"ticket": ep.ticket()}), flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        if line.strip() == "served":
            print(json.dumps({"served": server.served}), flush=True)
    serving.cancel()
    await ep.close()


async def joiner(args: argparse.Namespace) -> None:
    """Fetch θ from each list of tickets read from stdin (one JSON list a line); print the time."""
    from drift.diloco import checksum
    from drift.state import fetch_state, into_arrays
    from drift.transport import Endpoint

    want = checksum(_theta(args.mib))
    into = np.zeros(args.mib << 18, np.float32)
    into += 1  # (pages backed before the clock starts)
    ep = await Endpoint.bind(args.mode)
    print(json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        tickets = json.loads(line)
        t0 = time.perf_counter()
        await fetch_state(ep, tickets, 0, want, into_arrays(into), size=into.size, arrays=1, timeout=30)
        print(json.dumps({"s": time.perf_counter() - t0}), flush=True)
    await ep.close()


def _start(prefix: list[str], role: str, args: argparse.Namespace, mode: str, lies: bool = False) -> subprocess.Popen:
    cmd = [*prefix, sys.executable, str(Path(__file__).resolve()), role, "--mib", str(args.mib), "--mode", mode]
    cmd += ["--lies"] if lies else []
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def _ask(p: subprocess.Popen, line: str) -> dict:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()
    out = p.stdout.readline()
    if not out:
        raise RuntimeError(f"{p.args} ended with {p.wait()}")
    return json.loads(out)


def run(args: argparse.Namespace, label: str, swarm=None) -> None:
    """Holders in processes 1..H (namespaces 1..H), the joiner in process 0; one row per count.
    With --liar, one more holder serves bad pieces under the right manifest: it is asked first,
    together with the others, twice (the second time it is remembered as a liar)."""
    n = max(args.holders) + args.liar
    mode = "local" if swarm is None else "lan"
    prefix = (lambda i: []) if swarm is None else swarm.exec_prefix
    procs: list[subprocess.Popen] = []
    try:
        procs = [_start(prefix(i + 1), "--holder", args, mode, lies=args.liar and i == n - 1) for i in range(n)]
        tickets = [json.loads(p.stdout.readline())["ticket"] for p in procs]  # type: ignore[union-attr]
        join = _start(prefix(0), "--joiner", args, mode)
        procs.append(join)
        assert json.loads(join.stdout.readline())["ready"]  # type: ignore[union-attr]
        plan = [(f"holders {k}", tickets[:k], range(k)) for k in args.holders for _ in range(args.reps)]
        if args.liar:
            k, who = max(args.holders), [n - 1, *range(n - 1)]
            plan += [(f"liar + {k} holders", [tickets[-1], *tickets[: n - 1]], who)] * 2
        for name, asked, who in plan:
            before = [_ask(p, "served")["served"] for p in procs[:n]]
            s = _ask(join, json.dumps(asked))["s"]
            after = [_ask(p, "served")["served"] for p in procs[:n]]
            served = [after[i] - before[i] for i in who]
            print(
                f"{label:>24}  {args.mib:>5} MiB  {name:<18} {s:7.2f} s  "
                f"{args.mib / s:7.1f} MiB/s  pieces sent per holder {served}",
                flush=True,
            )
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--holder", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--joiner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="local", help=argparse.SUPPRESS)
    ap.add_argument("--lies", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mib", type=int, default=1024, help="θ size (default 1024 MiB)")
    ap.add_argument("--holders", type=int, nargs="+", default=[1, 4], help="holder counts to compare")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--liar", type=int, choices=(0, 1), default=1, help="add rows with a lying holder (default 1)")
    ap.add_argument("--rate", default="100mbit", help="each holder's upload on the limited links")
    ap.add_argument("--netns-mib", type=int, default=None, help="θ size on limited links (default --mib)")
    ap.add_argument("--no-netns", action="store_true")
    ap.add_argument("--no-loopback", action="store_true")
    args = ap.parse_args()
    if args.holder:
        asyncio.run(holder(args))
        return
    if args.joiner:
        asyncio.run(joiner(args))
        return
    if not args.no_loopback:
        run(args, "loopback")
    if not args.no_netns:
        from netns import NetnsUnavailable, Swarm

        args.mib = args.netns_mib or args.mib
        try:
            # the joiner's download is not the limit: each holder's upload is
            with Swarm(n=1 + max(args.holders) + args.liar, up=args.rate, down="10gbit") as swarm:
                run(args, f"netns, {args.rate} up", swarm)
        except NetnsUnavailable as e:
            print(f"skipping the limited links: {e}")


if __name__ == "__main__":
    main()
