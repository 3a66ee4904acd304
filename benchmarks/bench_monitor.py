"""What the coordinator's own view costs per event (issue 40, item 3): `drift coord` in a terminal
draws a live table of its nodes; every unit a node reports is an event. N nodes in the table, then
N progress events, in a child process whose stdout is a pseudo-terminal (as in a terminal), and in
one whose stdout is a pipe (a log: no table).

    python3 benchmarks/bench_monitor.py --nodes 16 256 1000
    python3 benchmarks/bench_monitor.py --tree /tmp/old --tree .      # A/B, side by side

Each tree runs in a fresh process with TREE first on PYTHONPATH; --reps runs of each, interleaved;
the median is printed.
"""

from __future__ import annotations

import argparse
import os
import pty
import statistics
import subprocess
import sys
import threading
from pathlib import Path

CHILD = """
import sys, tempfile, time
from pathlib import Path
from drift.monitor import Monitor, NodeView
n = int(sys.argv[1])
with tempfile.TemporaryDirectory() as d:
    m = Monitor(Path(d))
    for i in range(n):
        m.nodes[f"{i:064x}"] = NodeView(f"n{i}", "cpu", samples_per_s=100.0 + i)
    t = time.perf_counter()
    for i in range(n):
        m.event("progress", node_id=f"{i:064x}", round=1, unit=[0, i, 0, 16], loss=1.0, samples_per_s=100.0)
    dt = time.perf_counter() - t
    m.close()
print(dt / n * 1e6, file=sys.stderr)
"""


def once(tree: str, n: int, terminal: bool) -> float:
    """Microseconds an event, in a child with TREE on its path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tree).resolve()), os.environ.get("PYTHONPATH", "")])}
    master, slave = pty.openpty() if terminal else os.pipe()[::-1]
    drained = threading.Thread(target=_drain, args=(master,), daemon=True)
    drained.start()
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(n)], stdout=slave, stderr=subprocess.PIPE, text=True, env=env, cwd="/"
    )
    os.close(slave)
    drained.join(10)
    if p.returncode != 0:
        raise SystemExit(f"{tree}: {p.stderr.strip()[-500:]}")
    return float(p.stderr.strip().splitlines()[-1])


def _drain(fd: int) -> None:
    """Read what the child draws until it closes (a full pty would block it)."""
    try:
        while os.read(fd, 1 << 16):
            pass
    except OSError:  # a pty's master reads EIO once the child's side is closed
        pass
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 256, 1000])
    ap.add_argument("--tree", action="append", help="a drift checkout (default: this one)")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    trees = a.tree or [str(Path(__file__).resolve().parent.parent)]
    print(f"{'tree':<24} {'N':>5} {'terminal us/event':>18} {'log us/event':>13}")
    for n in a.nodes:
        got: dict[tuple[str, bool], list[float]] = {}
        for _ in range(a.reps):
            for tree in trees:
                for terminal in (True, False):
                    got.setdefault((tree, terminal), []).append(once(tree, n, terminal))
        for tree in trees:
            term, log = (statistics.median(got[(tree, t)]) for t in (True, False))
            print(f"{tree:<24} {n:>5} {term:>18.1f} {log:>13.1f}", flush=True)


if __name__ == "__main__":
    main()
