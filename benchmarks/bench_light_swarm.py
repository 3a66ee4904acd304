"""The control plane at scale (issue 40, item 3): a real `drift coord` and N lightweight nodes.

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_light_swarm.py --nodes 4 16 64 256 1000

Lightweight nodes (benchmarks/harness/light.py) are drift's own Node, many per process, each with
its own iroh endpoint and key, training a stand-in task whose steps cost microseconds: what is
left is what the swarm's protocol costs, and the coordinator's share of it. Per N (--per-process
nodes a process, default 250):

  joined    seconds from the coordinator's start until all N were admitted (training_started)
  round     the median wall time between two round events (rounds 1..), and its sync part
  coord cpu the coordinator process's CPU seconds (user + system, /proc) per round, median over
            rounds 1..: everything it does for a round (admission is over by then)
  join cpu  its CPU seconds until all joined
  rss       the coordinator's peak RSS (VmHWM), MiB

The nodes share the machine with the coordinator: on 2 cores, a round's wall time at large N is
the nodes' ring all-reduce (2(N-1) hops of N nodes on 2 cores), not the coordinator.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.light import LightSwarm

TICK = 0.05  # how often the coordinator's /proc is read


def cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(n: int, per_process: int, rounds: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="drift-light-") as tmp:
        s = LightSwarm(Path(tmp), n, max(1, -(-n // per_process)), rounds=rounds)
        pid = s.coord.pid
        joined_at = join_cpu = None
        marks: list[tuple[float, float]] = []  # (wall, cpu) as each round event appears
        rss = 0.0
        seen = 0
        deadline = time.monotonic() + timeout
        while s.coord.poll() is None and time.monotonic() < deadline:
            try:
                cpu, rss = cpu_s(pid), max(rss, hwm_mib(pid))
            except (OSError, IndexError, ValueError):
                break
            events = s.events()
            if joined_at is None and any(e["event"] == "training_started" for e in events):
                joined_at, join_cpu = time.monotonic() - s.started, cpu
                marks.append((time.monotonic(), cpu))
            rounds_seen = [e for e in events if e["event"] == "round"]
            if len(rounds_seen) > seen:
                seen = len(rounds_seen)
                marks.append((time.monotonic(), cpu))
            time.sleep(TICK)
        events = s.events()
        rc, _ = s.finish(60)
        nodes = s.nodes()
        done = sum(1 for v in nodes.values() if v["code"] == 0)
        rnds = [e for e in events if e["event"] == "round"]
        walls = [b[0] - a[0] for a, b in itertools.pairwise(marks[1:])]  # rounds 1..
        cpus = [b[1] - a[1] for a, b in itertools.pairwise(marks[1:])]
        return {
            "n": n,
            "ok": rc == 0 and done == n,
            "joined_s": joined_at,
            "join_cpu_s": join_cpu,
            "round_s": statistics.median(walls) if walls else None,
            "sync_s": statistics.median(e["reduce_s"] for e in rnds[1:]) if len(rnds) > 1 else None,
            "coord_cpu_s": statistics.median(cpus) if cpus else None,
            "rss_mib": rss,
            "done": done,
            "rounds": len(rnds),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64, 256, 1000])
    ap.add_argument("--per-process", type=int, default=250, help="lightweight nodes a process")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600.0, help="per N")
    a = ap.parse_args()
    print(
        f"{'N':>5} {'joined s':>9} {'join cpu s':>10} {'round s':>8} {'sync s':>7} {'coord cpu s/round':>17} "
        f"{'rss MiB':>8}  completed"
    )
    for n in a.nodes:
        r = run(n, a.per_process, a.rounds, a.timeout)

        def f(x, fmt="{:.2f}"):
            return "-" if x is None else fmt.format(x)

        print(
            f"{n:>5} {f(r['joined_s'], '{:.1f}'):>9} {f(r['join_cpu_s']):>10} {f(r['round_s']):>8} "
            f"{f(r['sync_s']):>7} {f(r['coord_cpu_s'], '{:.3f}'):>17} {r['rss_mib']:>8.0f}  "
            f"{r['done']}/{n} nodes, {r['rounds']} rounds{'' if r['ok'] else '  FAILED'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
