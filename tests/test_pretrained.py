"""Initial weights on one machine (recipe init_weights): the coordinator reads them, nodes fetch
θ₀ over drift-base/0, digest-verified, and place it by name (tests/test_base.py: in process)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TINY_RECIPE, drift_cmd, make_task_repo
from safetensors.numpy import save_file

from drift.diloco import ParamLayout, checksum
from drift.recipe import RecipeError, load_recipe
from drift.workers import load_task
from drift.workers.torch_worker import TorchWorker


def _tiny_weights(seed: int) -> dict[str, np.ndarray]:
    task = load_task(ROOT / "recipes" / "shakespeare_char.py")
    cfg = TINY_RECIPE["task_config"]
    return task.init_params(cfg, task.make_dataset(cfg).vocab_size, seed)


@pytest.mark.swarm
def test_nodes_start_from_the_coordinators_weights(tmp_path: Path) -> None:
    weights = _tiny_weights(seed=123)  # not the recipe's seed: a θ₀ no node would build itself
    wfile = tmp_path / "weights" / "model.safetensors"  # outside the task repo: only the coordinator has it
    wfile.parent.mkdir()
    save_file(weights, str(wfile))
    recipe = make_task_repo(tmp_path / "repo", min_nodes=2, rounds=2, init_weights=str(wfile))
    run_dir = tmp_path / "run"
    out = subprocess.run(
        drift_cmd("coord", str(recipe), "--local", "2", "--run-dir", str(run_dir)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    started = next(e for e in events if e["event"] == "training_started")
    flat = ParamLayout.of(weights).flatten(weights)
    assert started["checksum"] == checksum(flat, np.zeros_like(flat))  # every node's θ₀ is the file's
    # ... and the swarm's first evaluation is of those weights
    task = load_task(ROOT / "recipes" / "shakespeare_char.py")
    w = TorchWorker(task, TINY_RECIPE["task_config"], {}, seed=TINY_RECIPE["seed"])
    w.set_params(weights)
    expected = w.evaluate(TINY_RECIPE["eval_batches"], TINY_RECIPE["batch_size"])
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    assert initial == pytest.approx(expected, rel=1e-4)
    assert [e["round"] for e in events if e["event"] == "round"] == [0, 1]


@pytest.mark.swarm
def test_a_recipe_naming_missing_weights_is_one_line(tmp_path: Path) -> None:
    recipe = make_task_repo(tmp_path / "repo", init_weights="no/such/weights.safetensors")
    with pytest.raises(RecipeError, match=r"init_weights: no/such/weights.safetensors not found"):
        load_recipe(recipe)
    out = subprocess.run(drift_cmd("coord", str(recipe), "--local", "2"), capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("drift: error: ")
