"""θ is the trainable state: a LoRA fine-tune (peft on a config-built Llama) sends, checksums and
checkpoints only its adapters; the frozen base stays in each node's model, checked at join."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import ROOT, drift_cmd

from drift.checkpoint import latest_checkpoint
from drift.workers import load_task
from drift.workers.torch_worker import TorchWorker
from harness.simulate import Swarm, git

TINY_LORA = {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32, "intermediate": 64, "lora_r": 4}
TASK_FILES = ("lora_llama.py", "gpt2_shakespeare.py", "shakespeare_char.py")


def _worker(**cfg) -> TorchWorker:
    return TorchWorker(load_task(ROOT / "recipes" / "lora_llama.py"), {**TINY_LORA, **cfg}, {}, seed=0)


def test_only_trainable_parameters_are_theta() -> None:
    w = _worker()
    trainable = {n for n, p in w.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert set(w.get_params()) == trainable == {n for n, _ in w.iter_state()}
    assert sum(a.size for a in w.get_params().values()) == 1 * 2 * 4 * (32 + 32)  # r (in + out), q and v
    before = {n: p.detach().clone() for n, p in w.model.named_parameters() if not p.requires_grad}
    w.train_step(np.arange(4))
    assert all(np.array_equal(p.detach(), before[n]) for n, p in w.model.named_parameters() if n in before)
    # the frozen base's digest: the same on every node that built the same base, another otherwise
    assert w.frozen_checksum() == _worker().frozen_checksum() != ""
    assert _worker(n_embd=16, n_head=2).frozen_checksum() != w.frozen_checksum()
    assert _worker(lora_r=0).frozen_checksum() == ""  # a full fine-tune freezes nothing


@pytest.mark.swarm
def test_lora_swarm_sends_and_checkpoints_only_the_adapters(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    for f in TASK_FILES:
        shutil.copy(ROOT / "recipes" / f, repo / "recipes" / f)
    recipe = yaml.safe_load((ROOT / "recipes" / "lora.yaml").read_text())
    recipe.update(task_config=TINY_LORA, rounds=2, inner_steps=2, unit_steps=1, batch_size=4, eval_batches=1)
    (repo / "recipes" / "lora.yaml").write_text(yaml.safe_dump(recipe))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "lora task")
    run_dir = tmp_path / "run"
    out = subprocess.run(
        drift_cmd("coord", str(repo / "recipes" / "lora.yaml"), "--local", "2", "--run-dir", str(run_dir)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    w = _worker()
    n_trainable = sum(a.size for a in w.get_params().values())
    n_total = sum(p.numel() for p in w.model.parameters())
    assert next(e for e in events if e["event"] == "training_started")["n_params"] == n_trainable
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 2
    # int8: ~1 byte per trainable value per node, nowhere near one per frozen value
    assert all(r["bytes_sent"] < 4 * n_trainable < n_total for r in rounds), [r["bytes_sent"] for r in rounds]
    ck, _ = latest_checkpoint(run_dir / "checkpoints")
    assert ck is not None and set(ck.names) == set(w.get_params())
    assert ck.manifest["frozen_base"] == w.frozen_checksum()


MY_LORA = '''"""A user's LoRA fine-tune: the base comes from a local from_pretrained directory ($MY_BASE)."""
import os

from lora_llama import make_dataset  # noqa: F401
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM


def make_model(cfg):
    base = LlamaForCausalLM.from_pretrained(os.environ.get("MY_BASE", {default!r}))
    base.loss_type = "ForCausalLM"
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
'''


@pytest.mark.swarm
def test_a_node_whose_frozen_base_differs_is_refused_and_told_why(tmp_path: Path) -> None:
    """Each machine loads its base from its own disk; one friend's copy is another revision. The
    node is refused at the start with the reason, and the run goes on with the two that agree."""
    import torch

    bases = [tmp_path / "base", tmp_path / "base-edited"]  # two "revisions" of the same base model
    base = _worker(lora_r=0).model
    base.save_pretrained(bases[0])
    with torch.no_grad():
        next(base.parameters())[0, 0] += 1e-3
    base.save_pretrained(bases[1])
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    for f in TASK_FILES:
        shutil.copy(ROOT / "recipes" / f, repo / "recipes" / f)
    (repo / "recipes" / "my_lora.py").write_text(MY_LORA.format(default=str(bases[0])))
    recipe = yaml.safe_load((ROOT / "recipes" / "lora.yaml").read_text())
    recipe.update(
        task="recipes/my_lora.py",
        task_config=TINY_LORA,
        min_nodes=3,
        rounds=1,
        inner_steps=2,
        unit_steps=1,
        batch_size=4,
    )
    recipe.update(eval_batches=1)
    (repo / "recipes" / "my_lora.yaml").write_text(yaml.safe_dump(recipe))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "my lora task")
    swarm = Swarm(repo / "recipes" / "my_lora.yaml", tmp_path, "--local", "2")
    other = swarm.join(name="friend", env={"MY_BASE": str(bases[1])})
    assert swarm.finish() == 0, swarm.log()
    assert other.wait(60) != 0
    events = swarm.events()
    refused = [e for e in events if e["event"] == "node_refused"]
    assert len(refused) == 1 and "frozen base differs" in refused[0]["reason"], refused
    assert "frozen base differs" in swarm.node_logs()
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 1 and "friend" not in rounds[0]["nodes"] and len(rounds[0]["nodes"]) == 2
