"""`drift export`: a LoRA run's newest checkpoint as a peft adapter (and, with --merge, a plain
transformers folder) that transformers/peft load in a Python that cannot import drift; the repo is
found from the run directory (not the current one); a run without a checkpoint is one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, git

pytestmark = pytest.mark.swarm

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
RECIPE = {
    "name": "lora-tiny",
    "task": "recipes/lora_llama.py",
    "task_config": {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32, "lora_r": 4},
    "min_nodes": 2,
    "rounds": 1,
    "inner_steps": 2,
    "batch_size": 4,
    "unit_steps": 1,
    "eval_batches": 1,
    "network": "local",
}
LOAD = """
import sys
sys.modules["drift"] = None  # this Python cannot import drift
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import LlamaForCausalLM
out = sys.argv[1]
merged = LlamaForCausalLM.from_pretrained(out + "/merged")
adapter = load_file(out + "/adapter/adapter_model.safetensors")
base = LlamaForCausalLM(merged.config)
model = PeftModel.from_pretrained(base, out + "/adapter")
lora = {k: v for k, v in model.state_dict().items() if "lora_" in k}
assert len(lora) == len(adapter) > 0, (len(lora), len(adapter))
assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)  # trained: B starts at zero
print("loaded", len(adapter), sum(p.numel() for p in merged.parameters()))
"""


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-round LoRA run (two --local nodes) in its repo: REPO/runs/lora."""
    repo = tmp_path_factory.mktemp("export") / "project"
    (repo / "recipes").mkdir(parents=True)
    for task in (ROOT / "recipes").glob("*.py"):  # lora_llama.py and the tasks it builds on
        shutil.copy(task, repo / "recipes" / task.name)
    (repo / "lora.yaml").write_text(yaml.safe_dump(RECIPE))
    (repo / ".gitignore").write_text("runs/\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "lora")
    run = subprocess.run(
        [sys.executable, "-m", "drift", "coord", "lora.yaml", "--local", "2", "--run-dir", "runs/lora"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=280,
        env=ENV,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return repo


def test_export_writes_an_adapter_and_merged_weights_loadable_without_drift(tmp_path: Path, lora_run: Path) -> None:
    repo = lora_run
    elsewhere = tmp_path / "elsewhere"  # export from another folder: the repo comes from the run dir
    elsewhere.mkdir()
    out = tmp_path / "out"
    for args in ([str(out / "adapter")], [str(out / "merged"), "--merge"]):
        done = subprocess.run(
            [sys.executable, "-m", "drift", "export", str(repo / "runs" / "lora"), "--out", *args],
            cwd=elsewhere,
            capture_output=True,
            text=True,
            timeout=120,
            env=ENV,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "merged" / "config.json").is_file()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    loaded = subprocess.run(
        [sys.executable, "-I", "-c", LOAD, str(out)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith("loaded "), loaded.stdout


def test_export_of_a_run_without_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "drift", "export", str(tmp_path / "run")], capture_output=True, text=True, env=ENV
    )
    assert done.returncode == 1
    assert done.stderr.startswith("drift: error:") and "no checkpoint" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "run" / "export").exists()  # nothing half-written


FEWER = ["--local", "1", "--min-nodes", "1"]


def test_resume_with_fewer_nodes_keeps_round_samples_and_warns_of_the_changed_recipe(lora_run: Path) -> None:
    repo = lora_run
    (repo / "lora.yaml").write_text(yaml.safe_dump({**RECIPE, "rounds": 2}))  # one round more
    git(repo, "commit", "-q", "-am", "one round more")
    run = subprocess.run(
        [sys.executable, "-m", "drift", "coord", "lora.yaml", "--resume", "--run-dir", "runs/lora", *FEWER],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=280,
        env=ENV,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    warned = [ln for ln in run.stderr.splitlines() if ln.startswith("drift: warning: --resume:")]
    assert any(ln.startswith("drift: warning: --resume: rounds is 2, the checkpoint's run had 1") for ln in warned), (
        warned
    )
    assert any(ln.startswith("drift: warning: --resume: min_nodes is 1, the checkpoint's run had 2") for ln in warned)
    assert not any("round_samples" in ln for ln in warned), warned  # kept: 2 nodes × 2 steps × 4
    events = [json.loads(line) for line in (repo / "runs" / "lora" / "metrics.jsonl").read_text().splitlines()]
    runs = [e for e in events if e["event"] == "run"]
    assert len(runs) == 2 and runs[-1]["round_samples"] == runs[0]["round_samples"] == 16, runs
    assert [e["round"] for e in events if e["event"] == "round"] == [0, 1]


def test_export_never_writes_into_a_folder_that_holds_files(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    done = subprocess.run(
        [sys.executable, "-m", "drift", "export", str(tmp_path / "run"), "--out", str(taken)],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert done.returncode == 1
    assert done.stderr == f"drift: error: {taken} exists and is not empty: give another --out\n"
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
