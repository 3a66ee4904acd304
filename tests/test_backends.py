"""One model, three backends: torch, mlx and numpy implementations of the default task agree on
names, shapes, initial values, losses and gradients, and train one model together in a swarm."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import mlx.core  # noqa: F401 - the test extra installs mlx (mlx[cpu] on Linux): its absence is a failure
import numpy as np
import pytest
from conftest import ROOT, drift_cmd, git, make_task_repo

from drift.workers import Worker, load_task, make_worker

CFG = {"block_size": 32, "n_layer": 1, "n_head": 4, "n_embd": 32}
BACKENDS = ("torch", "mlx", "numpy")


@pytest.fixture(scope="module")
def task() -> ModuleType:
    return load_task(ROOT / "recipes" / "shakespeare_char.py")


@pytest.fixture(scope="module")
def cached(task: ModuleType) -> SimpleNamespace:
    """The real task with its dataset built once for the module."""
    ds = task.make_dataset(CFG)
    return SimpleNamespace(
        make_dataset=lambda cfg: ds,
        **{k: getattr(task, k) for k in ("init_params", "make_torch_model", "make_mlx_model", "make_numpy_model")},
    )


def workers(task: SimpleNamespace, seed: int = 3, **optim) -> dict[str, Worker]:
    return {b: make_worker(task, CFG, optim, backend=b, device="cpu", seed=seed) for b in BACKENDS}


# ---- the models ----------------------------------------------------------------------------------


def test_same_names_and_shapes_on_every_backend(task: ModuleType) -> None:
    import mlx.utils

    cfg, vocab = {**CFG, "n_layer": 2}, 67
    expected = task.param_shapes(cfg, vocab)
    torch_shapes = {n: tuple(p.shape) for n, p in task.make_torch_model(cfg, vocab).named_parameters()}
    mlx_shapes = {n: tuple(a.shape) for n, a in mlx.utils.tree_flatten(task.make_mlx_model(cfg, vocab).parameters())}
    init = task.init_params(cfg, vocab, seed=1)
    assert torch_shapes == mlx_shapes == task.make_numpy_model(cfg, vocab).shapes == expected
    assert {n: a.shape for n, a in init.items()} == expected and "tok_emb.weight" in expected
    assert all(a.dtype == np.float32 for a in init.values())
    again, other = task.init_params(cfg, vocab, seed=1), task.init_params(cfg, vocab, seed=2)
    assert all(np.array_equal(init[n], again[n]) for n in init)
    assert not np.array_equal(init["tok_emb.weight"], other["tok_emb.weight"])
    assert np.all(init["blocks.1.ln2.weight"] == 1) and np.all(init["blocks.0.attn.qkv.bias"] == 0)


def test_numpy_backward_matches_torch_autograd(task: ModuleType) -> None:
    """The hand-written backward pass against torch autograd, on the same parameters and batch."""
    import mlx.core as mx
    import torch
    from mlx.utils import tree_unflatten

    cfg, vocab = {**CFG, "n_layer": 2}, 61
    params = task.init_params(cfg, vocab, seed=5)
    params = {
        n: a + np.float32(0.05) * np.random.default_rng(1).standard_normal(a.shape, dtype=np.float32)
        for n, a in params.items()
    }  # off the init, so LayerNorm gains and biases matter too
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, vocab, (3, 24)), rng.integers(0, vocab, (3, 24))

    model = task.make_torch_model(cfg, vocab)
    named = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(torch.from_numpy(params[n]))
    ref = model(torch.from_numpy(x), torch.from_numpy(y))
    ref.backward()

    loss, grads = task.make_numpy_model(cfg, vocab).loss_and_grads(params, x, y)
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    for n, p in named.items():
        g = p.grad.numpy()
        np.testing.assert_allclose(grads[n], g, rtol=0, atol=1e-4 * float(np.abs(g).max()), err_msg=n)

    mlx_model = task.make_mlx_model(cfg, vocab)
    mlx_model.update(tree_unflatten([(n, mx.array(a)) for n, a in params.items()]))
    assert mlx_model(mx.array(x), mx.array(y)).item() == pytest.approx(ref.item(), rel=1e-5)


def test_numpy_model_refuses_dropout(task: ModuleType) -> None:
    with pytest.raises(ValueError, match="dropout"):
        task.make_numpy_model({**CFG, "dropout": 0.1}, 60)


# ---- the workers ---------------------------------------------------------------------------------


@pytest.mark.swarm  # seconds of floods or training: the slow tier
def test_three_workers_start_identical_and_train_alike(cached: SimpleNamespace) -> None:
    ws = workers(cached, lr=0.01)
    first = {b: w.get_params() for b, w in ws.items()}
    for b, w in ws.items():
        assert isinstance(w, Worker) and (w.backend, w.device) == (b, "cpu")
        assert w.param_names() == sorted(first["torch"])
        assert all(np.array_equal(first["torch"][n], first[b][n]) for n in first["torch"])  # bit-identical θ0
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, ws["torch"].n_train, 16) for _ in range(12)]
    losses = {b: np.array([w.train_step(idx) for idx in batches]) for b, w in ws.items()}
    after = {b: w.get_params() for b, w in ws.items()}
    vals = {b: w.evaluate(2, 16) for b, w in ws.items()}
    assert np.mean(losses["torch"][-3:]) < losses["torch"][0] - 0.5

    # Same AdamW (bias correction, decay groups, clipping) on the same batches: the same path down,
    # up to what float32 rounding does to this path. Two float32 implementations (or two BLAS
    # builds) differ in the order of their additions; so does torch on the same batches with the
    # samples permuted: the same mathematics, other roundings. Replaying torch that way measures
    # how far rounding alone moves this trajectory by each step: ~1e-7 relative at first, growing
    # ~10x a step late in the run, where Adam's normalised update amplifies rounding differences
    # in tiny gradients (it reaches ~2e-4, which a fixed rtol cannot both allow and stay tight).
    # The floor 4u|L| stands for the steps where a reordering happens not to change the loss.
    # mlx and numpy also round each elementwise op differently (their own softmax, LayerNorm and,
    # for numpy, an erf approximation good to 1.5e-7 ~ 2.5u), roughly doubling the rounding sites
    # of a reordering; the factor 4 is that 2x, and 2x again for the largest of 8 replays standing
    # for the spread of all orders.
    u = 2.0**-24
    noise, param_noise, val_noise = np.zeros(len(batches)), 0.0, 0.0
    for s in range(8):
        order = np.random.default_rng([s, 7])
        w = make_worker(cached, CFG, {"lr": 0.01}, backend="torch", device="cpu", seed=3)
        replay = np.array([w.train_step(order.permutation(idx)) for idx in batches])
        noise = np.maximum(noise, np.abs(replay - losses["torch"]))
        params = w.get_params()
        param_noise = max(param_noise, *(float(np.abs(params[n] - after["torch"][n]).max()) for n in params))
        val_noise = max(val_noise, abs(w.evaluate(2, 16) - vals["torch"]))
    loss_tol = 4 * np.maximum(noise, 4 * u * losses["torch"])
    param_tol = 4 * max(param_noise, 4 * u * max(float(np.abs(a).max()) for a in after["torch"].values()))
    val_tol = 4 * max(val_noise, 4 * u * vals["torch"])
    for b in ("mlx", "numpy"):
        off = np.abs(losses[b] - losses["torch"])
        assert np.all(off <= loss_tol), (b, off / loss_tol)
        param_off = max(float(np.abs(after[b][n] - after["torch"][n]).max()) for n in after[b])
        assert param_off <= param_tol, (b, param_off, param_tol)
        assert abs(vals[b] - vals["torch"]) <= val_tol, (b, vals, val_tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reset_optimizer_trains_like_a_fresh_worker(cached: SimpleNamespace, backend: str) -> None:
    """A node calibrates on a few steps, restores θ0 and resets AdamW: from then on it must train
    exactly like a node that never calibrated (bias correction restarts, no stale moments)."""
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 1000, 8) for _ in range(3)]
    fresh, used, stale = (make_worker(cached, CFG, {"lr": 0.01}, backend=backend, seed=0) for _ in range(3))
    theta0 = used.get_params()
    for w in (used, stale):
        for b in batches:
            w.train_step(b)
        w.set_params(theta0)
    used.reset_optimizer()  # `stale` is not reset: it must differ, or this test could not fail
    for b in batches:
        assert used.train_step(b) == fresh.train_step(b)
        stale.train_step(b)
    got, want, old = used.get_params(), fresh.get_params(), stale.get_params()
    assert all(np.array_equal(got[n], want[n]) for n in want)
    assert any(not np.array_equal(old[n], want[n]) for n in want)


@pytest.mark.parametrize("backend", ["mlx", "numpy"])
def test_worker_contract(cached: SimpleNamespace, backend: str) -> None:
    """What test_worker.py checks for torch, for the other two backends."""
    w = make_worker(cached, CFG, {"beta1": 0.8}, backend=backend, seed=0)
    rng = np.random.default_rng(0)
    w.train_step(rng.integers(0, w.n_train, 8))
    params = w.get_params()
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in params.values())
    params["ln_f.weight"][:] = 123.0  # a copy
    assert not np.any(w.get_params()["ln_f.weight"] == 123.0)
    other = make_worker(cached, CFG, {}, backend=backend, seed=1).get_params()
    w.set_params(other)
    got = w.get_params()
    assert all(np.array_equal(got[n], other[n]) for n in other)
    assert w.step == 1  # the optimizer state survived set_params
    w.train_step(rng.integers(0, w.n_train, 8))
    assert w.step == 2
    before = w.get_params()
    for bad, needle in (
        (dict(before, **{"ln_f.weight": np.zeros(5, np.float32)}), r"ln_f\.weight"),
        ({n: a for n, a in before.items() if n != "pos_emb.weight"}, r"pos_emb\.weight"),
        (dict(before, bogus=np.zeros(1, np.float32)), "bogus"),
    ):
        with pytest.raises(ValueError, match=needle):
            w.set_params(bad)
    a, b = w.evaluate(3, 16), w.evaluate(3, 16)
    assert a == b and math.isfinite(a)
    assert w.evaluate(1, 48) == pytest.approx(a, rel=1e-5)
    after = w.get_params()
    assert all(np.array_equal(before[n], after[n]) for n in before) and w.step == 2
    with pytest.raises(ValueError, match="at least one"):
        w.train_step(np.array([], dtype=np.int64))


def test_diloco_rounds_over_mixed_backends_keep_one_theta(cached: SimpleNamespace) -> None:
    """Three backends, DiLoCo outer rounds in process: every node's θ is bit-identical each round
    (the swarm test below does the same over iroh with real processes)."""
    from drift.diloco import NesterovOuter, ParamLayout, checksum, weighted_delta

    ws = workers(cached, lr=0.01)
    layout = ParamLayout.of(ws["torch"].get_params())
    thetas = {b: layout.flatten(w.get_params()) for b, w in ws.items()}
    outers = {b: NesterovOuter(layout.size) for b in BACKENDS}
    weights = {"torch": 0.5, "mlx": 0.3, "numpy": 0.2}
    rng = np.random.default_rng(0)
    sums = []
    for _ in range(3):
        for w in ws.values():
            for _ in range(3):
                w.train_step(rng.integers(0, w.n_train, 16))
        deltas = {b: weighted_delta(thetas[b], layout.flatten(w.get_params()), weights[b]) for b, w in ws.items()}
        total = deltas["torch"] + deltas["mlx"] + deltas["numpy"]  # what the ring all-reduce delivers
        for b, w in ws.items():
            outers[b].step(thetas[b], total.copy())
            w.set_params(layout.unflatten(thetas[b]))
        sums.append({checksum(layout.flatten(w.get_params())) for w in ws.values()})
    assert all(len(s) == 1 for s in sums) and len(set().union(*sums)) == 3


# ---- a real swarm: three processes, three backends ----------------------------------------------


def _start_coord(recipe: Path, tmp: Path) -> tuple[subprocess.Popen, Path, str]:
    out = tmp / "coord.out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DRIFT_HOME": str(tmp / "home"), "COLUMNS": "400"}
    with open(out, "w") as fh:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            drift_cmd("coord", str(recipe), "--run-dir", str(tmp / "run")), stdout=fh, stderr=subprocess.STDOUT, env=env
        )
    deadline = time.time() + 120
    while time.time() < deadline:
        text = out.read_text()
        if "--ticket " in text:
            return proc, out, text.split("--ticket ", 1)[1].split()[0]
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"coordinator printed no ticket: {out.read_text()}")


def _join(repo: Path, ticket: str, tmp: Path, backend: str, no_torch: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DRIFT_HOME": str(tmp / f"home-{backend}")}
    if no_torch:  # this node's Python cannot import torch at all
        block = tmp / "no-torch"
        block.mkdir(exist_ok=True)
        (block / "torch.py").write_text("raise ImportError('torch is not installed (blocked by this test)')\n")
        env["PYTHONPATH"] = f"{block}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = drift_cmd(
        "join",
        "--repo",
        str(repo),
        "--ticket",
        ticket,
        "--backend",
        backend,
        "--threads",
        "1",
        "--name",
        f"node-{backend}",
        "--key",
        str(tmp / f"{backend}.key"),
        "--cache-dir",
        str(tmp / f"cache-{backend}"),
    )
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.mark.swarm
def test_swarm_of_torch_mlx_and_numpy_nodes_trains_one_model(tmp_path: Path) -> None:
    # lockstep: every node trains its share each round (steal would let the slow ones evaluate instead)
    recipe = make_task_repo(tmp_path / "repo", rounds=3, schedule="lockstep")
    coord, out, ticket = _start_coord(recipe, tmp_path)
    nodes = [_join(tmp_path / "repo", ticket, tmp_path, b, no_torch=(b == "numpy")) for b in BACKENDS]
    try:
        coord.wait(300)
        results = [n.communicate(timeout=60) for n in nodes]
    finally:
        _stop(coord, *nodes)
    assert coord.returncode == 0, out.read_text() + "\n".join(e for _, e in results)
    for n, (_, err) in zip(nodes, results):
        assert "Traceback" not in err, err
        assert n.returncode == 0, err
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(e["backend"] for e in events if e["event"] == "node_joined") == sorted(BACKENDS)
    rounds = [e for e in events if e["event"] == "round"]
    # The coordinator accepts a round only when every node reported the same checksum of θ.
    assert [r["round"] for r in rounds] == [0, 1, 2] and len({r["checksum"] for r in rounds}) == 3
    for r in rounds:  # and every backend's node trained, so θ moved by all three kinds of Δ
        assert sorted(r["nodes"]) == [f"node-{b}" for b in sorted(BACKENDS)]
        assert all(n["samples"] > 0 and n["weight"] > 0 for n in r["nodes"].values()), r["nodes"]
    initial = next(e["val_loss"] for e in events if e["event"] == "initial")
    assert rounds[-1]["val_loss"] < initial - 0.3
    assert events[-1]["event"] == "complete"


@pytest.mark.swarm
def test_task_without_the_nodes_backend_is_refused_at_join(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    recipe = make_task_repo(repo, min_nodes=1)
    with open(repo / "recipes" / "shakespeare_char.py", "a") as f:
        f.write("\ndel make_mlx_model  # this task offers torch and numpy only\n")
    git(repo, "commit", "-qam", "torch and numpy only")
    coord, _, ticket = _start_coord(recipe, tmp_path)
    node = _join(repo, ticket, tmp_path, "mlx")
    try:
        _, err = node.communicate(timeout=120)
    finally:
        _stop(node, coord)
    assert node.returncode != 0 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0] == (
        "drift: error: task recipes/shakespeare_char.py has no mlx implementation "
        "(make_mlx_model); it supports: torch, numpy"
    )


def test_mlx_worker_runs_mlx_on_its_own_thread(cached: SimpleNamespace) -> None:
    """Metal streams are thread-local (mlx >= 0.31.2) and drift calls train_step from executor
    threads: the mlx worker must do all mlx work on one thread of its own."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    w = make_worker(cached, CFG, {}, backend="mlx", seed=0)
    seen: list[int] = []
    for name in ("_train_step", "_get_params", "_set_params", "_evaluate"):
        inner = getattr(w, name)
        setattr(w, name, lambda *a, _f=inner: (seen.append(threading.get_ident()), _f(*a))[1])
    with ThreadPoolExecutor(2) as ex:
        ex.submit(w.train_step, np.arange(8)).result()
        params = ex.submit(w.get_params).result()
        ex.submit(w.set_params, params).result()
        ex.submit(w.evaluate, 1, 8).result()
    w.train_step(np.arange(8))  # and from this (the main) thread
    assert len(seen) == 5 and set(seen) == {w._thread_id} != {threading.get_ident()}
