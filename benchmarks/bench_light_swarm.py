"""The control plane at scale (issue 40, item 3): a real `drift coord` and N lightweight nodes.

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_light_swarm.py --nodes 4 16 64 256 1000
    flock /tmp/drift-cpu.lock python3 benchmarks/bench_light_swarm.py --nodes 256 1000 --sync sparse --fanout 16

Lightweight nodes (benchmarks/harness/light.py) are drift's own Node, many per process, each with
its own iroh endpoint and key, training a stand-in task whose steps cost microseconds: what is
left is what the swarm's protocol costs, and the coordinator's share of it. Per N (--per-process
nodes a process, default 250; --rounds rounds, default 3):

  joined      seconds from the coordinator's start until all N were admitted (training_started)
  join cpu    the coordinator process's CPU seconds (user + system, /proc) until then
  train cpu   its CPU seconds from a round's start to its BarrierReady (median; round 0 too):
              planning and granting the units, every node's progress, asks and BarrierSync, the
              ring's order and weights sent to every member
  round       the median wall time between two round events (rounds 1..), and its sync part
  coord cpu   its CPU seconds per round (rounds 1..): all it does for a round
  of it python  of that, its Python thread's: drift's own work (the round's logic, the codec,
              its side of each iroh call); the rest is iroh's runtime threads (QUIC, the
              connections' upkeep)
  sync cpu    of that, its CPU seconds per second while the nodes' all-reduce runs (it only waits,
              pings and holds N connections then), and its Python thread's share
  rss         the coordinator's peak RSS (VmHWM), MiB
  round line  the longest round event in metrics.jsonl, KiB (above 16 members: the 16 slowest
              members' rows and a summary; every row in nodes.jsonl)
  ring        the fewest members with a weight in one round's all-reduce (rounds 1..): N when every
              node trained and reduced (a round of a few members says the figures are not a full
              round's)

The nodes share the machine with the coordinator: on 2 cores, a round's wall time at large N is
the nodes' ring all-reduce (2(N-1) hops, each of N nodes, on 2 cores), not the coordinator. A
configuration that does not finish within --timeout prints what it reached. `--sync sparse`: the
sparse rule (8 of each 64 values: θ is 64 values) in place of the fp32 ring, all-gathered in
levels above its `--fanout` (drift/hierarchy.py; 16: 27 transfers a node at 1,000, where the ring
takes 2 x 999 hops; the rule's default, 64: 62).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from drift import hierarchy
from drift.monitor import read_events
from harness.light import LightSwarm

TICK = 0.05  # how often the coordinator's /proc and metrics.jsonl are read


def cpu_s(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (or of its thread tid), in seconds."""
    fields = Path(f"/proc/{pid}" + (f"/task/{tid}" if tid else "") + "/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(n: int, per_process: int, rounds: int, timeout: float, sync: str, fanout: int, beats: list[float]) -> dict:
    rule = (
        {"sync": "sparse", "sync_params": {"chunk": 64, "k": 8, "fanout": fanout, "dense_rounds": 0}}
        if sync == "sparse"
        else {}
    )
    if beats:
        rule |= {"heartbeat_s": beats[0], "stale_after_s": beats[1]}
    with tempfile.TemporaryDirectory(prefix="drift-light-") as tmp:
        s = LightSwarm(Path(tmp), n, max(1, -(-n // per_process)), rounds=rounds, **rule)
        pid = s.coord.pid
        marks: dict[tuple, tuple[float, float, float]] = {}  # (wall, cpu, its Python thread's) as each event came
        rss = 0.0
        deadline = time.monotonic() + timeout
        while s.coord.poll() is None and time.monotonic() < deadline:
            try:
                cpu, py, rss = cpu_s(pid), cpu_s(pid, pid), max(rss, hwm_mib(pid))
            except (OSError, IndexError, ValueError):
                break
            for e in read_events(s.run_dir) if (s.run_dir / "metrics.jsonl").exists() else []:
                key = (e["event"], e.get("round"))
                if e["event"] in ("training_started", "barrier", "round") and key not in marks:
                    marks[key] = (time.monotonic(), cpu, py)
            time.sleep(TICK)
        events = s.events()
        line = max(
            (len(x) for x in (s.run_dir / "metrics.jsonl").read_bytes().splitlines() if b'"event": "round"' in x),
            default=0,
        )
        rc, _ = s.finish(60)
        nodes = s.nodes()
        done = sum(1 for v in nodes.values() if v["code"] == 0)
        rnds = [e for e in events if e["event"] == "round"]
        start = marks.get(("training_started", None))
        ends = [start] + [marks.get(("round", r)) for r in range(rounds)]  # round r: ends[r] .. ends[r + 1]
        walls, cpus, pys, trains, rates, py_rates = [], [], [], [], [], []
        for r in range(rounds):
            a, b, bar = ends[r], ends[r + 1], marks.get(("barrier", r))
            if a is not None and bar is not None:
                trains.append(bar[1] - a[1])
            if r >= 1 and a is not None and b is not None:  # (round 0 also evaluates θ0)
                walls.append(b[0] - a[0])
                cpus.append(b[1] - a[1])
                pys.append(b[2] - a[2])
                if bar is not None and b[0] > bar[0]:
                    rates.append((b[1] - bar[1]) / (b[0] - bar[0]))
                    py_rates.append((b[2] - bar[2]) / (b[0] - bar[0]))
        med = statistics.median
        return {
            "ok": rc == 0 and done == n,
            "joined_s": start[0] - s.started if start else None,
            "join_cpu_s": start[1] if start else None,
            "train_cpu_s": med(trains) if trains else None,
            "round_s": med(walls) if walls else None,
            "sync_s": med(e["reduce_s"] for e in rnds[1:]) if len(rnds) > 1 else None,
            "coord_cpu_s": med(cpus) if cpus else None,
            "py_cpu_s": med(pys) if pys else None,
            "sync_cpu_rate": med(rates) if rates else None,
            "sync_py_rate": med(py_rates) if py_rates else None,
            "rss_mib": rss,
            "ring": min(
                (sum(1 for v in e["nodes"].values() if v.get("weight", 0) > 0) for e in rnds[1:]), default=None
            ),
            "done": done,
            "rounds": len(rnds),
            "line_kib": line / 1024,
        }


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64, 256, 1000])
    ap.add_argument("--per-process", type=int, default=250, help="lightweight nodes a process")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="per N (then what was reached is printed)")
    ap.add_argument("--sync", choices=["dense", "sparse"], default="dense", help="the rule (dense: the fp32 ring)")
    ap.add_argument("--fanout", type=int, default=hierarchy.FANOUT, help="sparse: the hierarchy's fanout")
    ap.add_argument(
        "--beats",
        type=float,
        nargs=2,
        metavar=("HEARTBEAT_S", "STALE_AFTER_S"),
        default=[],
        help="the recipe's liveness (default: the light recipe's, which stretches both with N; drift's own: 2 10)",
    )
    a = ap.parse_args()
    print(
        f"{'N':>5} {'joined s':>9} {'join cpu s':>10} {'train cpu s':>11} {'round s':>8} {'sync s':>7} "
        f"{'coord cpu s/round':>17} {'of it python':>12} {'sync cpu s/s':>12} {'of it python':>12} {'rss MiB':>8} {'ring':>5} {'round line KiB':>14}  completed",
        flush=True,
    )
    for n in a.nodes:
        r = run(n, a.per_process, a.rounds, a.timeout, a.sync, a.fanout, a.beats)
        print(
            f"{n:>5} {_f(r['joined_s'], '{:.1f}'):>9} {_f(r['join_cpu_s']):>10} {_f(r['train_cpu_s'], '{:.3f}'):>11} "
            f"{_f(r['round_s']):>8} {_f(r['sync_s']):>7} {_f(r['coord_cpu_s'], '{:.3f}'):>17} "
            f"{_f(r['py_cpu_s'], '{:.3f}'):>12} {_f(r['sync_cpu_rate'], '{:.3f}'):>12} {_f(r['sync_py_rate'], '{:.3f}'):>12} {r['rss_mib']:>8.0f} {_f(r['ring'], '{}'):>5} {r['line_kib']:>14.1f}  "
            f"{r['done']}/{n} nodes, {r['rounds']} rounds{'' if r['ok'] else '  (not completed)'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
