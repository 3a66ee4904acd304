"""Served data versus local data: one node on a 100 Mbit link (a network namespace each for the
coordinator and the node, tbf on both ends, benchmarks/netns.py; needs root).

The task is recipes/token_file.py over nanoGPT-style token files made from the default task's
Shakespeare text, with the default task's GPT (block 64, 2 layers, 128 wide). "served": the
files are ignored by git, so the node's checkout lacks them and every sample comes from the
coordinator over drift-data/0; "local": the files are committed, so the node opens its own copy
(checked against the coordinator's manifest) and fetches nothing. Prints, per mode, the node's
samples/s over rounds 1.. (round 0 includes start-up) by the rounds' wall time, its samples/s
while in inner steps, the bytes it fetched per sample, and the CPU seconds (the kernel's rusage,
all threads) the node and the coordinator spent per sample trained: served minus local is what
fetching costs the node and what serving costs the coordinator, robust to a busy machine where
wall-clock rates are not.

    python3 benchmarks/bench_data.py [--rate 100mbit] [--rounds 6] [--pairs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from netns import Swarm  # noqa: E402


def make_repo(path: Path, served: bool, rounds: int) -> Path:
    from drift.workers import load_task

    char = load_task(ROOT / "recipes" / "shakespeare_char.py")
    rec = path / "recipes"
    (rec / "data").mkdir(parents=True)
    for name in ("token_file.py", "shakespeare_char.py"):
        shutil.copy(ROOT / "recipes" / name, rec / name)
    ds = char.CharDataset(char.load_text(), 64)
    for split in ("train", "val"):
        ds.tokens(split).astype(np.uint16).tofile(rec / "data" / f"{split}.bin")
    recipe = {
        "name": "tokens",
        "task": "recipes/token_file.py",
        "task_config": {"block_size": 64, "vocab_size": ds.vocab_size, "n_layer": 2, "n_head": 4, "n_embd": 128},
        "data": {"cache_mb": 256},
        "min_nodes": 1,
        "rounds": rounds,
        "inner_steps": 25,
        "batch_size": 32,
        "unit_steps": 5,
        "eval_batches": 4,
        "network": "lan",
    }
    (rec / "tokens.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    if served:
        (path / ".gitignore").write_text("recipes/data/\n")
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "task"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True)
    return rec / "tokens.yaml"


def run(mode: str, rate: str, rounds: int, work: Path) -> dict:
    repo = work / mode
    recipe = make_repo(repo, mode == "served", rounds)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    drift = [sys.executable, "-m", "drift"]
    with Swarm(n=2, rate=rate) as sw:
        coord = subprocess.Popen(
            [
                *sw.exec_prefix(0),
                "env",
                f"DRIFT_HOME={work / mode}-home0",
                *drift,
                "coord",
                str(recipe),
                "--run-dir",
                str(work / f"{mode}-run"),
                "--dashboard",
                "off",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        seen = ""
        while "join with:" not in seen:
            line = coord.stdout.readline()
            if not line:
                raise SystemExit(f"the coordinator ended: {seen}")
            seen += line
        ticket = re.search(r"--ticket (\S+)", seen).group(1)
        with open(work / f"{mode}-node.log", "w") as log:
            node = subprocess.Popen(
                [
                    *sw.exec_prefix(1),
                    "env",
                    f"DRIFT_HOME={work / mode}-home1",
                    *drift,
                    "join",
                    "--repo",
                    str(repo),
                    "--ticket",
                    ticket,
                    "--name",
                    "node",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            out = coord.stdout.read()
            coord_cpu = _reap(coord)
            node_cpu = _reap(node)
    if coord.returncode != 0:
        raise SystemExit(f"{mode}: the coordinator failed: {out[-2000:]}")
    events = [json.loads(x) for x in (work / f"{mode}-run" / "metrics.jsonl").read_text().splitlines()]
    rounds_ = [e for e in events if e["event"] == "round" and e["round"] >= 1]
    samples = sum(r["samples"] for r in rounds_)
    busy = sum(n["busy_s"] for r in rounds_ for n in r["nodes"].values())
    fetched = [e for e in events if e["event"] == "data_fetched"]
    total = sum(n["samples"] for e in events if e["event"] == "round" for n in e["nodes"].values())
    last = fetched[-1] if fetched else {"samples": 0, "bytes": 0}
    return {
        "mode": mode,
        "samples_per_s": samples / sum(r["seconds"] for r in rounds_),
        "busy_samples_per_s": samples / busy,
        "fetched_samples": last["samples"],
        "bytes_per_sample": last["bytes"] / max(1, total),
        "bad": len([e for e in events if e["event"] == "data_bad_chunk"]),
        "unavailable": len([e for e in events if e["event"] == "data_unavailable"]),
        "said": "not on this machine" in (work / f"{mode}-node.log").read_text(),
        "node_cpu_ms": 1e3 * node_cpu / max(1, total),
        "coord_cpu_ms": 1e3 * coord_cpu / max(1, total),
    }


def _reap(proc: subprocess.Popen) -> float:
    """Wait for the process; its CPU seconds (user + system, from the kernel's rusage)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--pairs", type=int, default=1, help="local/served pairs, run alternately")
    a = ap.parse_args()
    for i in range(a.pairs):
        work = Path(tempfile.mkdtemp(prefix="bench-data-"))
        try:
            results = [run(mode, a.rate, a.rounds, work) for mode in ("local", "served")]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for r in results:
            print(
                f"{r['mode']:7s} {r['samples_per_s']:8.1f} samples/s (rounds 1..)  "
                f"{r['busy_samples_per_s']:8.1f} in steps  fetched {r['fetched_samples']} samples, "
                f"{r['bytes_per_sample']:.1f} B/sample trained  CPU per sample trained: node "
                f"{r['node_cpu_ms']:.3f} ms, coordinator {r['coord_cpu_ms']:.3f} ms  "
                f"bad chunks {r['bad']}  unavailable {r['unavailable']}  fetching said: {r['said']}"
            )
        local, served = results
        print(
            f"pair {i + 1}: served/local {served['samples_per_s'] / local['samples_per_s']:.3f} (rounds' wall time), "
            f"{served['busy_samples_per_s'] / local['busy_samples_per_s']:.3f} (in steps); CPU per sample "
            f"served - local: node {served['node_cpu_ms'] - local['node_cpu_ms']:+.3f} ms, "
            f"coordinator {served['coord_cpu_ms'] - local['coord_cpu_ms']:+.3f} ms"
        )


if __name__ == "__main__":
    main()
