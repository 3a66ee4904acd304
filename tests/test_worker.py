"""The default task (recipes/shakespeare_char.py) and the torch Worker, with real torch and data."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from drift.workers import Worker, load_task
from drift.workers.torch_worker import TorchWorker

ROOT = Path(__file__).resolve().parents[1]
TASK_FILE = ROOT / "recipes" / "shakespeare_char.py"
CFG = {"block_size": 32, "n_layer": 1, "n_head": 4, "n_embd": 32}


@pytest.fixture(scope="module")
def task() -> ModuleType:
    return load_task(TASK_FILE)


@pytest.fixture(scope="module")
def cached_task(task: ModuleType) -> SimpleNamespace:
    """The real task, but building the dataset once for the whole module (it takes ~0.2 s)."""
    ds = task.make_dataset(CFG)
    return SimpleNamespace(make_dataset=lambda cfg: ds, make_torch_model=task.make_torch_model)


def make_worker(task_module, seed: int = 0, **optim) -> TorchWorker:
    return TorchWorker(task_module, CFG, optim, device="cpu", seed=seed)


# ---- dataset -----------------------------------------------------------------------------------


def test_dataset_windows_and_split(task: ModuleType) -> None:
    bs = CFG["block_size"]
    ds = task.make_dataset(CFG)
    text = task.load_text()
    assert ds.vocab_size == len(set(text)) and 60 < ds.vocab_size < 100
    for marker in ("**", "_Enter", "\\[", "#"):
        assert marker not in text
    n = int(len(text) * 0.9)  # val = last 10 % of the text
    assert ds.n_train == (n - 1) // bs and ds.n_val == (len(text) - n - 1) // bs

    idx = np.array([0, 1, 7, ds.n_train - 1])
    x, y = ds.batch("train", idx)
    assert x.shape == y.shape == (4, bs) and x.dtype == y.dtype == np.int64
    assert x.flags.c_contiguous and y.flags.c_contiguous
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    np.testing.assert_array_equal(y[0, -1], x[1, 0])  # window i+1 starts where window i's target ends
    for row, i in enumerate(idx):
        assert ds.decode(x[row]) + ds.decode(y[row, -1:]) == text[i * bs : i * bs + bs + 1]
    assert ds.n_train * bs < n  # the last train target lies before the val split

    xv, yv = ds.batch("val", np.array([0, ds.n_val - 1]))
    assert ds.decode(xv[0]) == text[n : n + bs]
    assert ds.decode(yv[1]) == text[n + (ds.n_val - 1) * bs + 1 : n + ds.n_val * bs + 1]

    again = task.make_dataset(CFG)
    np.testing.assert_array_equal(again.batch("train", idx)[0], x)


def test_dataset_rejects_bad_requests(cached_task: SimpleNamespace, task: ModuleType) -> None:
    ds = cached_task.make_dataset(CFG)
    with pytest.raises(ValueError, match="split"):
        ds.batch("test", np.array([0]))
    with pytest.raises(ValueError, match=str(ds.n_train)):
        ds.batch("train", np.array([0, ds.n_train]))
    with pytest.raises(ValueError, match="-1"):
        ds.batch("val", np.array([-1]))
    with pytest.raises(ValueError, match="integer"):
        ds.batch("train", np.array([0.5]))
    with pytest.raises(ValueError, match="n_layers"):
        task.make_torch_model({"n_layers": 2}, ds.vocab_size)


def test_model_ties_lm_head_and_lists_each_tensor_once(cached_task: SimpleNamespace) -> None:
    w = make_worker(cached_task)
    names = w.param_names()
    assert names == sorted(names) and len(names) == len(set(names))
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    assert w.model.lm_head.weight is w.model.tok_emb.weight


# ---- worker ------------------------------------------------------------------------------------


def test_worker_satisfies_protocol(cached_task: SimpleNamespace) -> None:
    w = make_worker(cached_task)
    assert isinstance(w, Worker)
    assert (w.backend, w.device) == ("torch", "cpu")
    assert w.n_train > 1000 and w.n_val > 100


def test_same_seed_same_params(cached_task: SimpleNamespace) -> None:
    a, b, c = make_worker(cached_task, seed=7), make_worker(cached_task, seed=7), make_worker(cached_task, seed=8)
    pa, pb, pc = a.get_params(), b.get_params(), c.get_params()
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    assert not all(np.array_equal(pa[k], pc[k]) for k in pa)


def test_get_set_round_trip_keeps_optimizer_state(cached_task: SimpleNamespace) -> None:
    w = make_worker(cached_task)
    rng = np.random.default_rng(0)
    for _ in range(2):
        w.train_step(rng.integers(0, w.n_train, 8))
    params = w.get_params()
    for name, a in params.items():
        assert a.dtype == np.float32 and a.flags.c_contiguous, name
    params["ln_f.weight"][:] = 123.0  # a copy: the worker is not affected
    assert not np.any(w.get_params()["ln_f.weight"] == 123.0)

    tensor = w._params["tok_emb.weight"]
    exp_avg = w.optimizer.state[tensor]["exp_avg"].clone()
    other = make_worker(cached_task, seed=1).get_params()
    w.set_params(other)
    got = w.get_params()
    assert all(np.array_equal(got[k], other[k]) for k in other)  # exact round trip
    assert w._params["tok_emb.weight"] is tensor  # copied in place, not replaced
    torch.testing.assert_close(w.optimizer.state[tensor]["exp_avg"], exp_avg, rtol=0, atol=0)
    assert w.optimizer.state[tensor]["step"].item() == 2
    w.train_step(rng.integers(0, w.n_train, 8))  # and training continues from there
    assert w.optimizer.state[tensor]["step"].item() == 3


def test_set_params_rejects_wrong_names_and_shapes(cached_task: SimpleNamespace) -> None:
    w = make_worker(cached_task)
    good = w.get_params()
    before = w.get_params()
    bad = dict(good, **{"ln_f.weight": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match=r"ln_f\.weight"):
        w.set_params(bad)
    missing = {k: v for k, v in good.items() if k != "pos_emb.weight"}
    with pytest.raises(ValueError, match=r"pos_emb\.weight"):
        w.set_params(missing)
    with pytest.raises(ValueError, match="bogus"):
        w.set_params(dict(good, bogus=np.zeros(1, np.float32)))
    after = w.get_params()
    assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing half-applied


def test_an_inner_step_is_torch_adamws_to_the_bit(cached_task: SimpleNamespace) -> None:
    # The worker's AdamW (torch's functional kernel, no Optimizer class) against torch.optim.AdamW
    # on a copy of the same model: same groups, gradients, learning rate changes and moment reset.
    w = make_worker(cached_task, lr=0.02, weight_decay=0.3, betas=(0.8, 0.9), grad_clip=0.0)
    ref = copy.deepcopy(w.model)
    params = dict(ref.named_parameters())
    decay = [n for n in w.param_names() if w._params[n].dim() >= 2]
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": 0.3},
        {"params": [params[n] for n in w.param_names() if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=0.02, betas=(0.8, 0.9), eps=1e-8)
    rng = np.random.default_rng(0)
    for k in range(4):
        if k == 2:
            w.set_lr(0.005)
            for g in opt.param_groups:
                g["lr"] = 0.005
        if k == 3:
            w.reset_optimizer()
            opt.state.clear()
        idx = rng.integers(0, w.n_train, 8)
        w.train_step(idx)
        opt.zero_grad()
        x, y = cached_task.make_dataset(CFG).batch("train", idx)
        ref(torch.from_numpy(x).long(), torch.from_numpy(y).long()).backward()
        opt.step()
    assert decay and len(decay) < len(w.param_names())
    for n, got in w.get_params().items():
        np.testing.assert_array_equal(got, params[n].detach().numpy(), err_msg=n)


def test_training_lowers_loss(cached_task: SimpleNamespace) -> None:
    w = make_worker(cached_task)
    rng = np.random.default_rng(0)
    losses = [w.train_step(rng.integers(0, w.n_train, 32)) for _ in range(60)]
    ln_vocab = math.log(w.dataset.vocab_size)
    assert abs(losses[0] - ln_vocab) < 0.5  # starts near uniform
    assert np.mean(losses[-10:]) < 0.8 * ln_vocab, losses[-10:]


def test_evaluate_is_deterministic_and_read_only(cached_task: SimpleNamespace) -> None:
    w = make_worker(cached_task)
    w.train_step(np.arange(16))
    before = w.get_params()
    step = w.optimizer.state[w._params["tok_emb.weight"]]["step"].item()
    a = w.evaluate(max_batches=3, batch_size=16)
    b = w.evaluate(max_batches=3, batch_size=16)
    assert a == b and math.isfinite(a)
    after = w.get_params()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert w.optimizer.state[w._params["tok_emb.weight"]]["step"].item() == step
    assert w.model.training  # left in training mode
    # the mean is over samples: one batch of 48 equals three batches of 16
    assert w.evaluate(max_batches=1, batch_size=48) == pytest.approx(a, rel=1e-5)


def test_bad_device_and_config_are_clear_errors(cached_task: SimpleNamespace) -> None:
    for device in ("cuda:99", "tpu"):
        with pytest.raises(ValueError, match=r"not available.*available: .*cpu"):
            TorchWorker(cached_task, CFG, {}, device=device)
    with pytest.raises(ValueError, match="momentum"):
        TorchWorker(cached_task, CFG, {"momentum": 0.9}, device="cpu")
    w = TorchWorker(cached_task, CFG, {"beta1": 0.8, "beta2": 0.99}, device="cpu")  # the recipe's spelling
    assert w.optimizer.param_groups[0]["betas"] == (0.8, 0.99)


def test_load_task_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.py"):
        load_task(tmp_path / "nope.py")
    broken = tmp_path / "broken_task.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ImportError, match=r"broken_task\.py.*boom"):
        load_task(broken)
    with pytest.raises(TypeError, match="make_dataset"):
        TorchWorker(SimpleNamespace(), CFG, {}, device="cpu")


def test_starts_from_the_tasks_backend_neutral_init(cached_task: SimpleNamespace, task: ModuleType) -> None:
    """With init_params in the task, θ0 is that (what mlx and numpy nodes load too); without it,
    torch's own seeded init."""
    with_init = SimpleNamespace(**vars(cached_task), init_params=task.init_params)
    w = make_worker(with_init, seed=4)
    expected = task.init_params(CFG, w.dataset.vocab_size, 4)
    got = w.get_params()
    assert all(np.array_equal(got[k], expected[k]) for k in expected)
    own = make_worker(cached_task, seed=4).get_params()  # cached_task has no init_params
    assert not np.array_equal(own["tok_emb.weight"], expected["tok_emb.weight"])


def test_dataset_tokens_view(cached_task: SimpleNamespace) -> None:
    ds = cached_task.make_dataset(CFG)
    tokens = ds.tokens("train")
    x, _ = ds.batch("train", np.array([3]))
    np.testing.assert_array_equal(tokens[3 * CFG["block_size"] : 4 * CFG["block_size"]], x[0])
    with pytest.raises(ValueError):
        tokens[0] = 1  # read-only
    with pytest.raises(ValueError, match="split"):
        ds.tokens("test")
