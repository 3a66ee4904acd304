"""What a stranger's flood costs an allowlisted node's join (real iroh on loopback, one process).

    python benchmarks/bench_strangers.py [--idle 0 64 256] [--tries 5]

A coordinator with an allowlist of one node; a stranger endpoint opens IDLE QUIC connections to
its drift/0 and never opens a stream. Then the allowlisted node connects and sends NodeInfo:
printed is the time until it has the coordinator's TrainConfig (median of --tries), or the error
it got, and how many metrics.jsonl lines the flood wrote.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from drift import protocol as P
from drift.auth import NodeKey
from drift.coordinator import Coordinator
from drift.monitor import Monitor
from drift.recipe import load_recipe
from drift.transport import CONTROL_ALPN, MAX_CONTROL_FRAME, Endpoint, parse_ticket
from harness.simulate import TINY_RECIPE, make_task_repo


async def one(recipe_path: Path, run_dir: Path, idle: int) -> tuple[float | str, int]:
    recipe = load_recipe(recipe_path)
    good = NodeKey.generate()
    recipe.allowlist, recipe.min_nodes = [good.node_id], 1
    monitor = Monitor(run_dir, live=False)
    coord = Coordinator(recipe, run_dir, monitor=monitor)
    ticket = await coord.start()
    flood, node = await Endpoint.bind("local"), await Endpoint.bind("local", secret_key=good.seed)
    try:
        addr = parse_ticket(ticket)
        held = [await asyncio.wait_for(flood.ep.connect(addr, CONTROL_ALPN), 10) for _ in range(idle)]  # kept open
        t0 = time.perf_counter()
        try:
            ch = await node.connect(ticket, CONTROL_ALPN)
            info = P.NodeInfo(node_id=node.node_id, name="n", backend="torch", device="cpu", ring_ticket=node.ticket())
            await ch.send_frame(P.encode(info))
            answer = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=60))
            took: float | str = time.perf_counter() - t0 if isinstance(answer, P.TrainConfig) else answer.type
        except Exception as e:
            took = f"failed: {str(e)[:90]}"
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        del held
        return took, sum(flood.node_id[:10] in json.dumps(json.loads(x)) for x in lines)
    finally:
        await coord.close()
        monitor.close()
        await flood.close()
        await node.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=int, nargs="+", default=[0, 64, 256])
    ap.add_argument("--tries", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        recipe = make_task_repo(Path(tmp) / "repo", TINY_RECIPE)
        print(f"{'idle stranger conns':>20} {'join (TrainConfig)':>22} {'flood lines':>12}")
        for idle in a.idle:
            results = [asyncio.run(one(recipe, Path(tmp) / f"run-{idle}-{i}", idle)) for i in range(a.tries)]
            times = [t for t, _ in results if isinstance(t, float)]
            shown = f"{1000 * statistics.median(times):.1f} ms" if len(times) == len(results) else results[0][0]
            print(f"{idle:>20} {shown:>22} {max(n for _, n in results):>12}")


if __name__ == "__main__":
    main()
