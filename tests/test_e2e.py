"""End to end: `drift coord RECIPE --local 3` with real processes, real iroh, real training."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import drift_cmd


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_local_swarm_learns_and_replicas_agree(tiny_recipe: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny"
    out = subprocess.run(drift_cmd("coord", str(tiny_recipe), "--local", "3", "--run-dir", str(run_dir)),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    events = _events(run_dir)
    joined = [e for e in events if e["event"] == "node_joined"]
    rounds = [e for e in events if e["event"] == "round"]
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    assert len(joined) == 3
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    # The coordinator checks per round that every node reported the same checksum; a round
    # event is only written after that check, and carries that one checksum.
    assert all(len(r["checksum"]) == 24 for r in rounds)
    assert len({r["checksum"] for r in rounds}) == 4          # θ moved every round
    assert rounds[-1]["val_loss"] < initial - 0.5, (initial, [r["val_loss"] for r in rounds])
    assert all(r["bytes_sent"] > 0 for r in rounds)            # the ring really moved data
    assert all(sum(n["samples"] for n in r["nodes"].values()) == r["samples"] for r in rounds)
    assert events[-1]["event"] == "complete"
    for i in range(3):
        assert (run_dir / f"node-{i}.log").exists()
    for r in rounds:  # what `drift report` plots per node: time split and bytes
        for n in r["nodes"].values():
            assert n["busy_s"] > 0 and n["idle_s"] >= 0 and n["sync_s"] > 0 and n["bytes_sent"] > 0
        assert sum(n["bytes_sent"] for n in r["nodes"].values()) == r["bytes_sent"]

    # `drift report` on the real run: three PNGs and a summary quoting the run's own figures.
    rep = subprocess.run(drift_cmd("report", str(run_dir), "--out", str(tmp_path / "plots")),
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    for name in ("loss.png", "nodes.png", "bytes.png"):
        png = (tmp_path / "plots" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    row = next(line for line in rep.stdout.splitlines() if line.startswith("tiny "))
    assert row.split()[1:4] == ["4", str(sum(r["samples"] for r in rounds)), f"{rounds[-1]['val_loss']:.4f}"]
