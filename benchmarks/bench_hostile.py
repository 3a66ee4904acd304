"""What hostile traffic costs a coordinator (real processes, real iroh on loopback).

    flock /tmp/drift-bench.lock python benchmarks/bench_hostile.py [--repeat 50] [--rounds 6]

For each ALPN a coordinator's endpoint can be dialled on (drift/0, drift-state/0, and drift-ring/0,
which it does not serve), the benchmark throws the hostile connections and frames of
benchmarks/harness/hostile.py at a real `drift coord` before any node has joined, twice, and prints how many
it tried, how many the coordinator dropped (connection_dropped lines in metrics.jsonl) and the
coordinator's RSS (psutil) before and after each barrage. Then two real `drift join` nodes run
the recipe against that same coordinator, and the wall-clock from their start to the
coordinator's exit is compared side by side with a clean run (fresh coordinator, no hostile
traffic) and with a run during which a barrage goes on (from this process: on 2 cores the
attacker competes for CPU too). Runs alternate (clean, after, during) --pairs times; the table
shows each run and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from drift.transport import CONTROL_ALPN, RING_ALPN, STATE_ALPN, Endpoint
from harness import hostile
from harness.simulate import Swarm, make_task_repo

TASK = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}
MODES = ("clean", "after", "during")


def recipe(rounds: int) -> dict:
    return {
        "name": "hostile",
        "task_config": TASK,
        "min_nodes": 2,
        "rounds": rounds,
        "inner_steps": 10,
        "batch_size": 16,
        "unit_steps": 2,
        "eval_batches": 4,
        "seed": 7,
    }


async def attack_all(ticket: str, repeat: int, out: dict[str, hostile.Tally]) -> None:
    """One barrage per ALPN, counted into `out` as it goes."""
    clients = await hostile.clients(4)
    other = await Endpoint.bind("local")
    plan = {
        "drift/0": (CONTROL_ALPN, hostile.control_attacks(other), repeat),
        "drift-state/0": (STATE_ALPN, hostile.state_attacks(), repeat),
        "drift-ring/0 (not served)": (
            RING_ALPN,
            {"wrong ALPN": hostile.wrong_alpn},
            10 * repeat,
        ),
    }
    try:
        for name, (alpn, attacks, n) in plan.items():
            out[name] = hostile.Tally()
            await hostile.barrage(
                clients,
                ticket,
                alpn,
                attacks,
                n,
                concurrency=32,
                patience=1.0,
                tally=out[name],
            )
    finally:
        for c in [*clients, other]:
            await c.close()


def rss_mib(swarm: Swarm) -> float:
    return psutil.Process(swarm.coord.pid).memory_info().rss / 2**20


def drops(swarm: Swarm) -> int:
    return sum(e["event"] == "connection_dropped" for e in swarm.events())


def settle(swarm: Swarm, want: int) -> None:
    """Until the coordinator has logged `want` drops (the last idle connections close late)."""
    deadline = time.monotonic() + 60
    while drops(swarm) < want and time.monotonic() < deadline:
        time.sleep(0.1)


async def train(swarm: Swarm, mode: str, repeat: int, res: dict) -> float:
    """Start two nodes; the seconds until the coordinator exits (a barrage goes on meanwhile, during)."""
    t0 = time.monotonic()
    swarm.join()
    swarm.join()
    attack = None
    if mode == "during":
        res["tallies"].append({})
        attack = asyncio.ensure_future(attack_all(swarm.ticket, repeat, res["tallies"][-1]))
    while swarm.coord.poll() is None and time.monotonic() - t0 < 600:
        await asyncio.sleep(0.02)
    seconds = time.monotonic() - t0
    if attack is not None:
        attack.cancel()
        await asyncio.gather(attack, return_exceptions=True)
    return seconds


def run(work: Path, rounds: int, mode: str, repeat: int) -> dict:
    """One swarm: clean; after (two barrages first, then the nodes); during (both at once)."""
    swarm = Swarm(make_task_repo(work / "repo", recipe(rounds)), work)
    res: dict = {"mode": mode, "tallies": []}
    try:
        time.sleep(1.0)  # the coordinator has bound and printed its ticket: let it settle
        res["rss"] = [rss_mib(swarm)]
        if mode == "after":
            for _ in range(2):
                res["tallies"].append({})
                asyncio.run(attack_all(swarm.ticket, repeat, res["tallies"][-1]))
                settle(
                    swarm,
                    sum(t.connections for d in res["tallies"] for t in d.values()),
                )
                res["rss"].append(rss_mib(swarm))
            res["drops"] = drops(swarm)
        res["seconds"] = asyncio.run(train(swarm, mode, repeat, res))
        if swarm.coord.returncode != 0:
            raise SystemExit(f"{mode} run failed:\n{swarm.log()}")
        res["rounds"] = sum(e["event"] == "round" for e in swarm.events())
    finally:
        swarm.finish(timeout=5)
    return res


def report(results: list[dict], a: argparse.Namespace) -> None:
    print(f"\nhostile traffic at a real `drift coord` before any node joined, twice (--repeat {a.repeat}):")
    print(f"{'ALPN':28} {'connections':>11} {'frames':>7} {'closed by coord':>15}")
    for r in (x for x in results if x["mode"] == "after"):
        for k, tallies in enumerate(r["tallies"]):
            for name, t in tallies.items():
                print(f"{name:28} {t.connections:>11} {t.frames:>7} {t.closed_by_server:>15}")
            total = sum(t.connections for t in tallies.values())
            print(
                f"{'  barrage ' + str(k + 1):28} {total:>11}   coordinator RSS {r['rss'][k]:.1f} -> {r['rss'][k + 1]:.1f} MiB"
            )
        total = sum(t.connections for d in r["tallies"] for t in d.values())
        print(f"{'  both':28} {total:>11}   connection_dropped lines in metrics.jsonl: {r['drops']}\n")
    for r in (x for x in results if x["mode"] == "during"):
        t = r["tallies"][0]
        parts = ", ".join(f"{k} {x.connections}" for k, x in t.items())
        print(f"during a run: {sum(x.connections for x in t.values())} hostile connections ({parts})")
    secs = {m: [r["seconds"] for r in results if r["mode"] == m] for m in MODES}
    med = {m: statistics.median(v) for m, v in secs.items()}
    print(f"\n2-node swarm, {a.rounds} rounds: nodes started -> coordinator exited (each run; median; ratio)")
    for m in MODES:
        runs = ", ".join(f"{s:.1f}" for s in secs[m])
        print(f"  {m:7} {runs:>20} s   median {med[m]:.1f} s   {med[m] / med['clean']:.2f}x clean")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--repeat",
        type=int,
        default=50,
        help="times each hostile kind is tried per ALPN",
    )
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--pairs", type=int, default=2, help="runs of each mode (clean, after, during)")
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.pairs):
            for mode in MODES:
                results.append(run(Path(tmp) / f"{mode}{i}", a.rounds, mode, a.repeat))
                r = results[-1]
                print(
                    f"  {mode:6} run {i}: {r['seconds']:.1f} s, {r['rounds']} rounds",
                    flush=True,
                )
    report(results, a)


if __name__ == "__main__":
    main()
