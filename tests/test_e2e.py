"""End to end: `drift coord RECIPE --local 3` with real processes, real iroh, real training."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import drift_cmd

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)


def _as_typed(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """`drift ARGS...` as a user types it in the clone `repo`: paths relative to it."""
    return subprocess.run(drift_cmd(*args), cwd=repo, capture_output=True, text=True, timeout=600)


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_local_swarm_learns_and_replicas_agree(tiny_recipe: Path, tmp_path: Path) -> None:
    # Paths as a user types them, relative to the repo the shell is in: the recipe, --run-dir, and
    # --local's node checkouts under it.
    repo = tiny_recipe.parents[1]
    run_dir = repo / "runs" / "tiny"
    out = _as_typed(repo, "coord", "recipes/tiny.yaml", "--local", "3", "--run-dir", "runs/tiny")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert list((run_dir / "repos").glob("*/*/recipes"))  # each node's checkout of the commit
    events = _events(run_dir)
    joined = [e for e in events if e["event"] == "node_joined"]
    rounds = [e for e in events if e["event"] == "round"]
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    assert len(joined) == 3
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    # The coordinator checks per round that every node reported the same checksum; a round
    # event is only written after that check, and carries that one checksum.
    assert all(len(r["checksum"]) == 24 for r in rounds)
    assert len({r["checksum"] for r in rounds}) == 4  # θ moved every round
    assert rounds[-1]["val_loss"] < initial - 0.5, (initial, [r["val_loss"] for r in rounds])
    assert all(r["bytes_sent"] > 0 for r in rounds)  # the ring really moved data
    assert all(sum(n["samples"] for n in r["nodes"].values()) == r["samples"] for r in rounds)
    assert events[-1]["event"] == "complete"
    # the run's page outlives the coordinator: its events up to "complete" in the run dir
    assert f"page:       {run_dir / 'dashboard.html'}" in out.stderr + out.stdout
    assert '"event": "complete"' in (run_dir / "dashboard.html").read_text()
    for i in range(3):  # each node's log: joined, then a line a round with the share we counted for it
        shares = {r["round"] + 1: r["nodes"][f"local-{i}"] for r in rounds}
        log = (run_dir / f"node-{i}.log").read_text()
        assert "drift: joined run " in log, log
        lines = [line for line in log.splitlines() if line.startswith("drift: round ")]
        for k in range(1, len(rounds) + 1):
            mine = [line for line in lines if line.startswith(f"drift: round {k}/{len(rounds)}")]
            assert len(mine) == 1, log
            assert " samples (" in mine[0] and "sent " in mine[0], mine
            share = f"trained {shares[k]['samples']} samples ({100 * shares[k]['weight']:.0f}% of the round)"
            assert share in mine[0], mine
        assert "ETA" in lines[0], lines
    for r in rounds:  # what `drift report` plots per node: time split and bytes
        for n in r["nodes"].values():
            assert n["busy_s"] > 0 and n["idle_s"] >= 0 and n["sync_s"] > 0 and n["bytes_sent"] > 0
            assert 0 < n["check_s"] < n["sync_s"]  # the checks' share of it (benchmarks/bench_checks.py --swarm)
        assert sum(n["bytes_sent"] for n in r["nodes"].values()) == r["bytes_sent"]

    # TensorBoard event files beside metrics.jsonl: one scalar per round per metric.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir))
    board.Reload()
    vals = {s.step: s.value for s in board.Scalars("loss/val")}
    assert vals[-1] == np.float32(initial)
    # A round with an evaluator (a node too slow to train, as under a loaded CI machine) leaves its
    # val loss to the evaluator (`loss/val_evaluator`); the last round always has one.
    assert all(r["val_loss"] is not None or r["evaluators"] for r in rounds)
    scored = [r for r in rounds if r["val_loss"] is not None]
    assert scored[-1] is rounds[-1]
    assert [vals[r["round"]] for r in scored] == [np.float32(r["val_loss"]) for r in scored]
    assert len(board.Scalars("round/samples_per_s")) == 4 and len(board.Scalars("sync/MiB_sent")) == 4

    # `drift report` on the real run, typed as above (relative to the repo): three PNGs, the run's
    # page again, and a summary quoting the run's own figures.
    rep = _as_typed(repo, "report", "runs/tiny", "--out", "plots")
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert '"event": "complete"' in (repo / "plots" / "dashboard.html").read_text()
    for name in ("loss.png", "nodes.png", "bytes.png"):
        png = (repo / "plots" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    row = next(line for line in rep.stdout.splitlines() if line.startswith("tiny "))
    assert row.split()[1:4] == ["4", str(sum(r["samples"] for r in rounds)), f"{rounds[-1]['val_loss']:.4f}"]

    # `drift sample`: text from the newest checkpoint, the prompt continued by -n characters.
    args = ("sample", str(run_dir), "--prompt", "ROMEO:", "-n", "40", "--repo", str(tiny_recipe.parents[1]))
    first, again = (subprocess.run(drift_cmd(*args), capture_output=True, text=True, timeout=120) for _ in range(2))
    assert first.returncode == 0, first.stdout + first.stderr
    text = first.stdout[:-1]  # click.echo's newline
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 40
    assert again.stdout == first.stdout  # a fixed seed: the same checkpoint writes the same text
    bad = subprocess.run(drift_cmd("sample", str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and bad.stderr.startswith("drift: error: ") and len(bad.stderr.splitlines()) == 1


def test_a_sparse_recipe_runs_from_a_clone_as_typed(tmp_path: Path) -> None:
    """`sync: sparse` in a user's recipe, run as typed from the repo with relative paths: its first
    rounds go around the dense ring, the rest all-gather sparse payloads of a fraction of that,
    and `drift status` and `drift report` read the run where it was written."""
    from conftest import make_task_repo

    from drift.sync.sparse import SparseParams

    repo = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=4, sync="sparse").parents[1]
    out = _as_typed(repo, "coord", "recipes/tiny.yaml", "--local", "2", "--run-dir", "runs/sparse")
    assert out.returncode == 0, out.stdout + out.stderr
    events = _events(repo / "runs" / "sparse")
    rounds = [e for e in events if e["event"] == "round"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3] and len({r["checksum"] for r in rounds}) == 4
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    assert rounds[-1]["val_loss"] < initial - 0.3, (initial, [r["val_loss"] for r in rounds])
    dense = SparseParams().dense_rounds
    assert 0 < dense < len(rounds)
    sent = [sorted(n["bytes_sent"] for n in r["nodes"].values()) for r in rounds]
    # int8 around the ring: a byte a value of θ, each way; a sparse payload: a few % of the values
    assert all(0 < b < min(sent[0]) / 8 for r in sent[dense:] for b in r), sent
    status = _as_typed(repo, "status", "runs/sparse")
    report = _as_typed(repo, "report", "runs/sparse", "--out", "plots")
    assert status.returncode == 0 and "run complete: 4 rounds" in status.stdout, status.stdout + status.stderr
    assert report.returncode == 0, report.stdout + report.stderr
    assert (repo / "plots" / "bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batchnorm_task_with_dict_batches_trains_in_a_swarm(tmp_path: Path) -> None:
    """A task of the general interface (make_model, dict batches, a task loss) with BatchNorm, in a
    real 2-node swarm: the float buffers are part of θ, averaged at every barrier (the checksum
    every node reports covers them, so they are equal on both nodes after each round) and
    checkpointed by name; the checkpoint loads into a plain torch model."""
    import torch

    from drift.checkpoint import latest_checkpoint
    from drift.workers import load_task
    from harness.simulate import make_task_repo

    root = Path(__file__).resolve().parents[1]
    cfg = {"width": 8, "blocks": 1}
    recipe = make_task_repo(
        tmp_path / "repo",
        {
            "name": "digits",
            "task_config": cfg,
            "min_nodes": 2,
            "rounds": 4,
            "inner_steps": 10,
            "batch_size": 32,
            "unit_steps": 5,
            "eval_batches": 4,
            "inner_optimizer": {"lr": 0.003},
            "codec": "fp32",
            "outer_optimizer": {"lr": 1.0, "momentum": 0.0},
        },
        task=root / "recipes" / "digits_resnet.py",
    )
    run_dir = tmp_path / "run"
    out = subprocess.run(
        drift_cmd("coord", str(recipe), "--local", "2", "--run-dir", str(run_dir)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    events = _events(run_dir)
    rounds = [e for e in events if e["event"] == "round"]
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    assert len(rounds) == 4 and rounds[-1]["val_loss"] < initial
    ckpt, _ = latest_checkpoint(run_dir / "checkpoints")
    buffers = [n for n in ckpt.names if "running_" in n]
    assert buffers and ckpt.manifest["buffers"] == len(buffers)
    model = load_task(root / "recipes" / "digits_resnet.py").make_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(v.copy()) for k, v in ckpt.theta.items()}, strict=False
    )
    assert not unexpected and all(m.endswith("num_batches_tracked") for m in missing)
    assert any(not torch.equal(before[k], model.state_dict()[k]) for k in before)  # the statistics were learned

    # The task's metrics(model, batch) (accuracy) beside the loss: metrics.jsonl, the terminal,
    # TensorBoard and `drift report`'s metrics.png.
    acc = [r["metrics"]["accuracy"] for r in rounds]
    first = next(e for e in events if e["event"] == "initial")["metrics"]["accuracy"]
    # (4 short rounds: accuracy rises by 0.1-0.3 depending on which node trained what; it rises)
    assert all(0.0 <= a <= 1.0 for a in [first, *acc]) and acc[-1] > first, (first, acc)
    assert f"val accuracy {acc[-1]:.4g}" in out.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir))
    board.Reload()
    assert [s.value for s in board.Scalars("metrics/accuracy")] == [np.float32(a) for a in [first, *acc]]
    rep = subprocess.run(
        drift_cmd("report", str(run_dir), "--out", str(tmp_path / "plots")), capture_output=True, text=True, timeout=120
    )
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert (tmp_path / "plots" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
