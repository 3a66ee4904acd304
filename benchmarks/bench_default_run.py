"""Wall-clock of the default run a newcomer types first, with what it learned.

python benchmarks/bench_default_run.py [--recipe recipes/shakespeare.yaml] [--local 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="recipes/shakespeare.yaml")
    ap.add_argument("--local", type=int, default=3)
    a = ap.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="drift-default-run-")) / "run"
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "drift", "coord", a.recipe, "--local", str(a.local), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
    )
    wall = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(out.stdout + out.stderr)
    ev = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [e for e in ev if e["event"] == "round"]
    initial = next(e["val_loss"] for e in ev if e["event"] == "initial")
    first_round = next(e["t"] for e in ev if e["event"] == "round")
    print(
        f"drift coord {a.recipe} --local {a.local}: {wall:.1f}s wall-clock "
        f"({rounds[0]['t'] - rounds[0]['seconds']:.1f}s to start: imports, handshakes, calibration; "
        f"{sum(r['seconds'] for r in rounds):.1f}s in {len(rounds)} rounds)"
    )
    print(
        f"val loss {initial:.3f} -> {rounds[-1]['val_loss']:.3f} (ln 80 = 4.382); "
        f"{sum(r['samples'] for r in rounds)} samples; sync {sum(r['reduce_s'] for r in rounds):.1f}s total; "
        f"first round done at {first_round:.1f}s"
    )


if __name__ == "__main__":
    main()
