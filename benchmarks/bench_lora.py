"""LoRA against a full-parameter run of the same model (issue 21, item 2): bytes each node sends
per round and the peak RSS of a real `drift join` node against a plain torch loop.

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_lora.py      # ~3 min on 2 cores

Model: recipes/lora_llama.py's Llama (4 layers, 512 wide, 17.1M parameters) on Shakespeare's
bytes, built from a config. "lora": peft LoRA r=8 on q/v (65,536 trainable); "full": the same
model with every parameter trained (lora_r 0). Each runs as a real 2-node swarm on loopback
(`benchmarks/harness/simulate.py`'s `Swarm`: coordinator + 2 `drift join`, 1 torch thread each, int8 ring, 2 rounds);
bytes per node per round are the round events' bytes_sent / 2. The plain loop is the same model,
AdamW over the trainable parameters and the node's number of steps, in a fresh process. The
target: bytes ∝ trainable parameters; node − plain ≤ 3 × trainable bytes + the frozen base once.

    flock /tmp/drift-cpu.lock python3 benchmarks/bench_lora.py --models char-256,char-512,char-512+overlap,gpt2-small

The same measurement on issue 25's many-tensor models (target: ≤ 3 bytes of RAM per byte of θ
beyond the plain loop, fixed cost ≤ 512 MiB): the char GPT of recipes/shakespeare_char.py at 8
layers, 256 and 512 wide (θ 24 and 96 MiB; drift starts it from the task's init_params), and
recipes/gpt2-small.yaml's model (recipes/gpt2_shakespeare.py, 86M parameters) at block 256 and
batch 1; int8, outer momentum 0.9; `+overlap` runs a model with the recipe's `overlap: true`, `+sparse` with
`sync: sparse` (its defaults: error feedback, no velocity).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from bench_scale import Sampler, kill_all, own_hwm, read_json  # noqa: E402

ROUNDS, INNER, BATCH = 2, 2, 4
TASK_FILES = ("lora_llama.py", "gpt2_shakespeare.py", "shakespeare_char.py")
CHAR = {"block_size": 64, "n_layer": 8, "n_head": 8}
MODELS = {  # name: (task file, task_config, batch)
    "lora": ("lora_llama.py", {"lora_r": 8}, BATCH),
    "full": ("lora_llama.py", {"lora_r": 0}, BATCH),
    "char-256": ("shakespeare_char.py", {**CHAR, "n_embd": 256}, BATCH),
    "char-512": ("shakespeare_char.py", {**CHAR, "n_embd": 512}, BATCH),
    "gpt2-small": ("gpt2_shakespeare.py", {"block_size": 256}, 1),
}


def model_of(mode: str) -> tuple[str, dict, int, str]:
    """(task file, task_config, batch, flag) of a --models entry such as char-512+overlap."""
    name, _, flag = mode.partition("+")
    if name not in MODELS or flag not in ("", "overlap", "sparse"):
        raise SystemExit(f"unknown model {mode!r}; known: {', '.join(MODELS)} (each may end in +overlap or +sparse)")
    return (*MODELS[name], flag)


def recipe(mode: str) -> dict:
    task, cfg, batch, flag = model_of(mode)
    return {
        "name": f"bench-{mode.replace('+', '-')}",
        "task": f"recipes/{task}",
        "task_config": cfg,
        "min_nodes": 2,
        "rounds": ROUNDS,
        "inner_steps": INNER,
        "batch_size": batch,
        "unit_steps": 1,
        "eval_batches": 1,
        "codec": "int8",
        "outer_optimizer": {"lr": 0.7, "momentum": 0.9},
        "overlap": flag == "overlap",
        "sync": "sparse" if flag == "sparse" else "dense",
        "seed": 1,
        "stale_after_s": 600.0,
        "heartbeat_s": 2.0,
        "network": "local",
    }


def task_repo(path: Path, mode: str) -> Path:
    import yaml

    from harness.simulate import git

    (path / "recipes").mkdir(parents=True)
    for f in TASK_FILES:
        shutil.copy(ROOT / "recipes" / f, path / "recipes" / f)
    out = path / "recipes" / f"{recipe(mode)['name']}.yaml"
    out.write_text(yaml.safe_dump(recipe(mode), sort_keys=False))
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "task")
    return out


def _plain(mode: str, steps: int) -> None:
    """The same model and AdamW over its trainable parameters, by hand; prints its peak RSS."""
    import numpy as np
    import torch

    from drift.workers import load_task

    torch.set_num_threads(1)
    task_file, cfg, batch, _ = model_of(mode)
    task = load_task(ROOT / "recipes" / task_file)
    ds = task.make_dataset(cfg)
    torch.manual_seed(1)
    model = task.make_model(cfg) if hasattr(task, "make_model") else task.make_torch_model(cfg, ds.vocab_size)
    params = [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        b = ds.batch("train", rng.integers(0, ds.n_train, batch))
        opt.zero_grad(set_to_none=True)
        if isinstance(b, dict):
            loss = model(**{k: torch.from_numpy(v) for k, v in b.items()}).loss
        else:
            loss = model(*(torch.from_numpy(v) for v in b))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    trainable = sum(p.numel() for p in params)
    total = sum(p.numel() for p in model.parameters())
    print(json.dumps({"hwm": own_hwm(), "trainable": trainable, "total": total}), flush=True)


def plain(mode: str, steps: int) -> dict:
    p = subprocess.Popen(
        [sys.executable, __file__, "--role", "plain", "--mode", mode, "--steps", str(steps)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )
    s = Sampler({"plain": p.pid})
    s.start()
    try:
        r = read_json(p, 1800)
        p.wait(60)
    finally:
        s.stop()
        kill_all([p])
    return {**r, "hwm": max(r["hwm"], s.peak["plain"])}


def swarm(mode: str, tmp: Path) -> dict:
    from harness.simulate import Swarm

    work = Path(tempfile.mkdtemp(prefix=f"bench-lora-{mode}-", dir=tmp))
    try:
        sw = Swarm(task_repo(work / "repo", mode), work)
        sampler = Sampler({"coord": sw.coord.pid})
        sampler.start()
        for i in range(2):
            sampler.add(f"n{i}", sw.join().pid)
        t0 = time.monotonic()
        try:
            rc = sw.finish(timeout=1800)
        finally:
            sampler.stop()
        if rc != 0:
            raise RuntimeError(f"{mode} swarm failed (rc {rc}):\n{sw.log()[-3000:]}")
        rounds = [e for e in sw.events() if e["event"] == "round"]
        return {
            "node_peak": max(sampler.peak["n0"], sampler.peak["n1"]),
            "bytes_per_node_round": sum(e["bytes_sent"] for e in rounds) / len(rounds) / 2,
            "wall": time.monotonic() - t0,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="bench")
    ap.add_argument("--mode", default="lora")
    ap.add_argument(
        "--models", default="lora,full", help=f"of {', '.join(MODELS)}, each may end in +overlap or +sparse"
    )
    ap.add_argument("--steps", type=int, default=4 + ROUNDS * INNER)  # calibration + a node's share
    a = ap.parse_args()
    if a.role == "plain":
        return _plain(a.mode, a.steps)
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    mib = 2**20
    rows, plains = {}, {}
    try:
        for mode in a.models.split(","):
            model_of(mode)  # a typo fails before anything runs
        for mode in a.models.split(","):
            base = mode.partition("+")[0]  # the plain loop knows no overlap
            plains[base] = plains.get(base) or plain(base, a.steps)
            rows[mode] = {**plains[base], **swarm(mode, tmp)}
            print(f"{mode}: {json.dumps(rows[mode])}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        "| run | trainable (θ) | frozen | sent per node per round | node peak | plain loop | node − plain "
        "| budget 3 × θ + frozen |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        theta, frozen = 4 * r["trainable"], 4 * (r["total"] - r["trainable"])
        extra = r["node_peak"] - r["hwm"]
        print(
            f"| {mode} | {r['trainable']:,} ({theta / mib:.2f} MiB) | {frozen / mib:.1f} MiB "
            f"| {r['bytes_per_node_round'] / mib:.3f} MiB | {r['node_peak'] / mib:,.0f} MiB | {r['hwm'] / mib:,.0f} MiB "
            f"| {extra / mib:,.1f} MiB | {(3 * theta + frozen) / mib:,.1f} MiB |"
        )
    if "lora" in rows and "full" in rows:
        lo, fu = rows["lora"], rows["full"]
        print(
            f"\nbytes lora / full: {lo['bytes_per_node_round'] / fu['bytes_per_node_round']:.5f}; "
            f"trainable lora / full: {lo['trainable'] / fu['trainable']:.5f}"
        )
    print("\n| model | θ | node − plain | (node − plain) / θ |\n|---|---|---|---|")
    for mode, r in rows.items():
        theta = 4 * r["trainable"]
        extra = r["node_peak"] - r["hwm"]
        print(f"| {mode} | {theta / mib:.2f} MiB | {extra / mib:,.1f} MiB | {extra / theta:.2f} |")


if __name__ == "__main__":
    main()
