"""Per-node bytes a round, and the sync time a link model gives, by swarm size and collective
(issue 39): the int8 ring (flat, and as a grid from GRID_FROM members: drift/ring.py, `Grid`), the
sparse rule's flat all-gather, its hierarchy (drift/hierarchy.py), and its reduce-scatter
(drift.sync.sparse.scatter_transfers: each member's payload in pieces to the segments' owners,
then each owner's int8 sum of its segment to every member).

    python3 benchmarks/bench_collectives.py
    python3 benchmarks/bench_collectives.py --params 415232 1e9 7e9 --nodes 4 16 64 256 1000 --up-mbit 20 --down-mbit 100 --rtt-ms 40

Bytes are counted from the code, not estimated: int8's encoded size (drift.compress) times the
ring's 2(N-1)/N segments a node sends (and receives); a sparse payload's size (drift.sync.sparse.Codec at
the rule's defaults, or --chunk/--k) times the payloads the busiest node uploads and downloads
(N - 1 flat; hierarchy.transfers). tests/test_thousand.py checks the hierarchy's count against a
real 64-node swarm's bytes; frame headers (94 bytes a transfer) are left out here.

Sync time is a model, not a measurement: each step of a collective takes the longer of its upload
at --up-mbit and its download at --down-mbit, plus half an RTT; the ring runs 2(N-1) such steps of
one segment each; the grid 2(q-1) steps of a row's segment (1/q of θ) and 2(rows-1) of a column's
(1/(q rows)), plus one of a row's segment where a passenger rides (the busiest member); the flat
all-gather one step of N-1 payloads, the hierarchy one step a level, the reduce-scatter two (its
pieces, then the sums). --efficiency and --step-ms
calibrate it: benchmarks/bench_home.py fits both to real swarms on emulated home links.
"""

from __future__ import annotations

import argparse

from drift import hierarchy
from drift.compress import make_codec
from drift.ring import grid
from drift.sync.sparse import Codec, SparseParams, scatter_nbytes, scatter_transfers

Step = tuple[int, float, float]  # (how many such steps, bytes up, bytes down) of the busiest node


def rows(n_params: int, nodes: list[int], chunk: int, k: int, fanouts: list[int]):
    """(N, collective, bytes up, bytes down, steps) per swarm size and collective."""
    seg = make_codec("int8").encoded_nbytes(n_params)
    payload = Codec(n_params, chunk, k).nbytes
    for n in nodes:
        ring = int(2 * (n - 1) / n * seg)
        yield n, "int8 ring", ring, ring, [(2 * (n - 1), seg / n, seg / n)]
        if (g := grid(n, "int8")) is not None:
            row, col = seg / g.q, seg / g.q / g.rows
            rider = g.rider(0) is not None
            most = 2 * (g.q - 1) * row + 2 * (g.rows - 1) * col + rider * row
            steps = [(2 * (g.q - 1), row, row), (2 * (g.rows - 1), col, col), (int(rider), row, row)]
            yield n, f"int8 grid ({g.rows} rows of {g.q})", int(most), int(most), steps
        flat = (n - 1) * payload
        yield n, "sparse, flat all-gather", flat, flat, [(1, flat, flat)]
        for fanout in fanouts:
            if n <= fanout:
                continue  # (flat)
            steps, (most_up, most_down) = [], hierarchy.transfers(n, fanout)
            for level in hierarchy.plan(n, fanout):
                u = max(len(level.targets(m)) for m in range(n)) * payload
                d = max(len(level.sources(m)) - 1 for m in range(n)) * payload
                steps.append((1, u, d))
            yield n, f"sparse, hierarchy (fanout {fanout})", most_up * payload, most_down * payload, steps
        if n > 1:
            each = scatter_transfers(n_params, chunk, k, n)
            steps = [(1, max(e[0] for e in each), max(e[1] for e in each))]
            steps.append((1, max(e[2] for e in each), max(e[3] for e in each)))
            yield n, "sparse, reduce-scatter + int8 all-gather", *scatter_nbytes(n_params, chunk, k, n), steps


def seconds(steps: list[Step], up: float, down: float, rtt: float, efficiency: float = 1.0, step_s: float = 0.0):
    """The link model: each step takes the longer of its upload at `up` and its download at `down`
    (bytes/s, of which a transfer gets `efficiency`), half an RTT, and `step_s` more."""
    return sum(c * (max(u / up, d / down) / efficiency + rtt / 2 + step_s) for c, u, d in steps)


def human(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:,.1f} {unit}" if unit != "B" else f"{b:,.0f} B"
        b /= 1024
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, nargs="+", default=[415232, 1e9, 7e9])
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64, 256, 1000])
    ap.add_argument("--chunk", type=int, default=SparseParams().chunk)
    ap.add_argument("--k", type=int, default=SparseParams().k)
    ap.add_argument("--fanout", type=int, nargs="+", default=[16, hierarchy.FANOUT], help="the hierarchy's")
    ap.add_argument("--up-mbit", type=float, default=20.0)
    ap.add_argument("--down-mbit", type=float, default=100.0)
    ap.add_argument("--rtt-ms", type=float, default=40.0)
    ap.add_argument(
        "--efficiency", type=float, default=1.0, help="of the link rate a transfer gets (bench_home fits it)"
    )
    ap.add_argument("--step-ms", type=float, default=0.0, help="a step's cost beyond half an RTT (bench_home fits it)")
    a = ap.parse_args()
    up, down, rtt = a.up_mbit * 1e6 / 8, a.down_mbit * 1e6 / 8, a.rtt_ms / 1e3
    for p in a.params:
        n_params = int(p)
        print(
            f"\nθ of {n_params:,} values; sparse {a.k} of {a.chunk}; {a.up_mbit:g}/{a.down_mbit:g} Mbit, RTT {a.rtt_ms:g} ms"
        )
        print("| N | collective | per node up a round | down | sync time (model) |")
        print("|---|---|---|---|---|")
        for n, name, bu, bd, steps in rows(n_params, a.nodes, a.chunk, a.k, a.fanout):
            s = seconds(steps, up, down, rtt, a.efficiency, a.step_ms / 1e3)
            print(f"| {n} | {name} | {human(bu)} | {human(bd)} | {s:,.2f} s |")


if __name__ == "__main__":
    main()
