"""A LoRA fine-tune whose base exists only on the coordinator's machine (recipe init_weights, real
processes over real iroh): nodes in homes of their own fetch it once, verified, and train only the
adapters; a base that does not fit the task is refused before any node fetches a byte; a second
run takes it from each node's cache; a holder's corrupted tensor is refused with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, drift_cmd

from drift.base import read_weights
from drift.checkpoint import latest_checkpoint
from drift.workers import load_task
from drift.workers.torch_worker import TorchWorker, frozen_digest
from harness.simulate import Swarm, git

pytestmark = pytest.mark.swarm

LORA = {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 64, "intermediate": 128, "lora_r": 8}
TASK_FILES = ("lora_llama.py", "gpt2_shakespeare.py", "shakespeare_char.py")


def _base(where: Path, seed: int, **cfg) -> Path:
    """A save_pretrained base of the task's Llama (no adapters), from another seed than the nodes'."""
    torch.manual_seed(seed)
    load_task(ROOT / "recipes" / "lora_llama.py").make_model({**LORA, **cfg, "lora_r": 0}).save_pretrained(where)
    return where


def _repo(tmp_path: Path, init_weights: Path, **recipe) -> Path:
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    for f in TASK_FILES:
        shutil.copy(ROOT / "recipes" / f, repo / "recipes" / f)
    r = yaml.safe_load((ROOT / "recipes" / "lora.yaml").read_text())
    r.update(task_config=LORA, rounds=2, inner_steps=2, unit_steps=1, batch_size=4, eval_batches=1)
    r.update(init_weights=str(init_weights), **recipe)
    (repo / "recipes" / "lora.yaml").write_text(yaml.safe_dump(r))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "lora task")
    return repo / "recipes" / "lora.yaml"


def _peft_over(base: Path) -> torch.nn.Module:
    """What a user would build by hand: peft's LoRA over the base loaded by transformers."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, bias="none")
    return get_peft_model(LlamaForCausalLM.from_pretrained(base), cfg)


def _run(recipe: Path, work: Path, homes: list[Path]) -> Swarm:
    work.mkdir()
    swarm = Swarm(recipe, work)
    for i, home in enumerate(homes):
        swarm.join(name=f"n{i}", env={"DRIFT_HOME": str(home)})
    assert swarm.finish() == 0, swarm.log() + swarm.node_logs()
    assert swarm.node_exits() == [0] * len(homes), swarm.node_logs()
    return swarm


def test_a_lora_base_from_the_coordinator_trains_and_is_cached(tmp_path: Path) -> None:
    base = _base(tmp_path / "coordinator-only" / "base", seed=123)
    recipe = _repo(tmp_path, base)
    homes = [tmp_path / "home-a", tmp_path / "home-b"]
    swarm = _run(recipe, tmp_path / "first", homes)
    events = swarm.events()
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 2
    own = TorchWorker(load_task(recipe.parents[1] / "recipes" / "lora_llama.py"), LORA, {}, seed=0)
    n_adapter = sum(a.size for a in own.get_params().values())
    # the sync sends the adapters (int8: a byte a value), never the base: within 2x of that per node
    assert all(r["bytes_sent"] / 2 <= 2 * n_adapter for r in rounds), ([r["bytes_sent"] for r in rounds], n_adapter)
    # every node's frozen base is the file's (the coordinator recorded the digest the nodes agreed on)
    frozen = {n: p for n, p in _peft_over(base).named_parameters() if not p.requires_grad}
    want = frozen_digest((n, frozen[n].detach().float().numpy()) for n in sorted(frozen))
    ck, _ = latest_checkpoint(swarm.run_dir / "checkpoints")
    assert ck is not None and ck.manifest["frozen_base"] == want != own.frozen_checksum()
    unique = {s.tensor.digest: s.tensor.size for s in read_weights(base)}  # the norms' ones: one file
    n, u = len(frozen), len(unique)
    for i in range(2):
        log = (tmp_path / "first" / f"n{i}.log").read_text()
        assert f"init_weights: {n} tensors" in log, log
        assert f"{u} fetched ({sum(unique.values())} bytes), {n - u} already here" in log, log
        assert len(list((homes[i] / "base").iterdir())) == u + 1  # each tensor by its digest, and the manifest
    # a second run, by one of those nodes (both caches were filled alike, above): nothing
    # fetched, the same base
    swarm = _run(_repo(tmp_path / "again", base, rounds=1, min_nodes=1), tmp_path / "second", homes[1:])
    ck, _ = latest_checkpoint(swarm.run_dir / "checkpoints")
    assert ck is not None and ck.manifest["frozen_base"] == want
    log = (tmp_path / "second" / "n0.log").read_text()
    assert f"0 fetched (0 bytes), {n} already here" in log, log


def test_a_base_that_does_not_fit_is_refused_before_any_node_fetches(tmp_path: Path) -> None:
    base = _base(tmp_path / "coordinator-only" / "base", seed=1, intermediate=96)  # another MLP width
    recipe = _repo(tmp_path, base)
    out = subprocess.run(
        drift_cmd("coord", str(recipe), "--local", "2", "--run-dir", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last == (
        f"drift: error: init_weights: {base / 'model.safetensors'}: tensor model.layers.0.mlp.down_proj.weight "
        "has shape [64, 96], the model's base_model.model.model.layers.0.mlp.down_proj.weight [64, 128]"
    ), out.stderr
    assert not (Path(os.environ["DRIFT_HOME"]) / "base").exists()  # no node fetched (or cached) anything


def test_a_corrupted_tensor_from_the_coordinator_is_refused_with_the_reason(tmp_path: Path) -> None:
    base = _base(tmp_path / "coordinator-only" / "base", seed=123)
    recipe = _repo(tmp_path, base)
    (tmp_path / "work").mkdir()
    swarm = Swarm(recipe, tmp_path / "work")  # it has digested the file: the manifest is the good one
    f = base / "model.safetensors"
    big = max(read_weights(f), key=lambda s: s.tensor.size)  # a tensor no other one equals
    data = bytearray(f.read_bytes())
    data[big.offset + 5] ^= 0x01  # then one bit of it flips on the coordinator's disk
    f.write_bytes(bytes(data))
    try:
        node = swarm.join(name="n0", env={"DRIFT_HOME": str(tmp_path / "home")})
        refused = swarm.wait_event(lambda e: e["event"] == "node_refused", timeout=40)
        assert node.wait(60) != 0
    finally:
        if swarm.coord.poll() is None:  # it waits for nodes that fit: the run never starts
            swarm.kill(swarm.coord)
        swarm.finish(nodes_timeout=1)
    assert f"tensor {big.tensor.name}: its bytes do not match the manifest's digest" in refused["reason"], refused
    assert "its bytes do not match the manifest's digest" in (tmp_path / "work" / "n0.log").read_text()
