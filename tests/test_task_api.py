"""The general task interface (workers/base.py) on real tasks, and what every worker offers drift
beyond get/set_params: buffers, set_lr, micro-batches, precision, close, isolated task imports.

Tasks: recipes/digits_resnet.py (dict batches, BatchNorm, a task loss), recipes/gpt2_shakespeare.py
(transformers, model(**batch).loss) and the LM-shaped default task on all three backends.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch

from drift.workers import BackendError, TaskError, Worker, load_task, make_worker

ROOT = Path(__file__).resolve().parents[1]
CHAR_CFG = {"block_size": 32, "n_layer": 1, "n_head": 4, "n_embd": 32}
DIGITS_CFG = {"width": 8}
GPT2_CFG = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}
BACKENDS = ("torch", "mlx", "numpy")
U = 2.0**-24  # float32's unit roundoff


@pytest.fixture(scope="module")
def digits() -> ModuleType:
    return load_task(ROOT / "recipes" / "digits_resnet.py")


@pytest.fixture(scope="module")
def char() -> SimpleNamespace:
    """The default (LM-shaped) task with its dataset built once for the module."""
    task = load_task(ROOT / "recipes" / "shakespeare_char.py")
    ds = task.make_dataset(CHAR_CFG)
    names = ("init_params", "make_torch_model", "make_mlx_model", "make_numpy_model")
    return SimpleNamespace(make_dataset=lambda cfg: ds, **{k: getattr(task, k) for k in names})


# ---- a dict-batch task with BatchNorm -------------------------------------------------------------


@pytest.mark.swarm  # seconds of floods or training: the slow tier
def test_batchnorm_task_trains_and_its_buffers_round_trip(digits: ModuleType) -> None:
    w = make_worker(digits, DIGITS_CFG, {"lr": 2e-2}, backend="torch", device="cpu", seed=0)
    assert isinstance(w, Worker) and w.precision == "fp32"
    named = dict(w.model.named_buffers())
    initial = w.get_buffers()
    assert list(initial) == sorted(n for n, b in named.items() if b.is_floating_point())
    assert len(initial) == 12 and all(n.endswith(("running_mean", "running_var")) for n in initial)
    assert any(n.endswith("num_batches_tracked") for n in named)  # integer: stays local
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in initial.values())

    rng = np.random.default_rng(0)
    losses = [w.train_step(rng.integers(0, w.n_train, 32)) for _ in range(30)]
    assert np.mean(losses[-5:]) < 0.5 * losses[0], losses
    trained = w.get_buffers()
    assert all(not np.array_equal(trained[n], initial[n]) for n in initial)  # every BatchNorm learned
    trained["1.running_mean"][:] = 123.0  # a copy: the worker is not affected
    assert not np.any(w.get_buffers()["1.running_mean"] == 123.0)
    trained = w.get_buffers()

    # Evaluation normalises with the buffers: they are state that must travel with θ.
    val = w.evaluate(12, 32)
    w.set_buffers(initial)
    assert named["1.running_var"] is dict(w.model.named_buffers())["1.running_var"]  # copied in place
    assert w.evaluate(12, 32) != val
    other = make_worker(digits, DIGITS_CFG, {}, backend="torch", device="cpu", seed=1)
    other.set_params(w.get_params())
    other.set_buffers(trained)
    assert other.evaluate(12, 32) == val

    before = w.get_buffers()
    for bad, needle in (
        (dict(before, **{"1.running_mean": np.zeros(3, np.float32)}), r"buffer 1\.running_mean: shape"),
        ({n: a for n, a in before.items() if n != "1.running_var"}, r"missing buffer.*1\.running_var"),
        (dict(before, bogus=np.zeros(1, np.float32)), "unexpected buffer.*bogus"),
    ):
        with pytest.raises(ValueError, match=needle):
            w.set_buffers(bad)
    after = w.get_buffers()
    assert all(np.array_equal(before[n], after[n]) for n in before)  # nothing half-applied


def test_digits_split_is_fixed_and_held_out(digits: ModuleType) -> None:
    a, b = digits.make_dataset({}), digits.make_dataset({})
    assert a.n_train + a.n_val == 1797 and a.n_val == 359
    tr, va = a.batch("train", np.arange(a.n_train)), a.batch("val", np.arange(a.n_val))
    assert tr["x"].shape == (a.n_train, 1, 8, 8) and tr["x"].dtype == np.float32 and tr["y"].dtype == np.int64
    assert tr["x"].min() >= 0.0 and tr["x"].max() <= 1.0 and set(tr["y"]) == set(range(10))
    np.testing.assert_array_equal(b.batch("val", np.arange(a.n_val))["x"], va["x"])  # same split on every node
    train_rows = {r.tobytes() for r in tr["x"]}
    assert sum(r.tobytes() in train_rows for r in va["x"]) < 10  # the digits set has a few duplicate images
    with pytest.raises(ValueError, match="width"):
        digits.make_model({"widht": 8})


# ---- the learning rate ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_lr_scales_the_next_step(char: SimpleNamespace, backend: str) -> None:
    idx = np.arange(8)
    w = make_worker(char, CHAR_CFG, {"lr": 1e-2}, backend=backend, device="cpu", seed=0)
    theta0 = w.get_params()
    w.set_lr(0.0)
    assert math.isfinite(w.train_step(idx))
    after = w.get_params()
    assert all(np.array_equal(after[n], theta0[n]) for n in theta0)  # lr 0: AdamW moves nothing
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="learning rate"):
            w.set_lr(bad)

    # AdamW's step, decay included, is lr times a function of the same gradient: twice the lr,
    # twice the step. Each run rounds θ·(1 - lr·wd) and θ - update (≤ u|θ| each) and ~5 ops of
    # the update (≤ 5u|Δ|); Δ2 - 2Δ1 collects one run's errors once and the other's twice.
    steps = {}
    for lr in (1e-3, 2e-3):
        w = make_worker(char, CHAR_CFG, {"lr": 1e-2}, backend=backend, device="cpu", seed=0)
        w.set_lr(lr)
        w.train_step(idx)
        got = w.get_params()
        steps[lr] = {n: got[n].astype(np.float64) - theta0[n] for n in got}
    for n, d2 in steps[2e-3].items():
        tol = 6 * U * np.abs(theta0[n]) + 15 * U * np.abs(d2)
        assert np.all(np.abs(d2 - 2 * steps[1e-3][n]) <= tol), n
    assert any(np.any(d != 0) for d in steps[1e-3].values())


# ---- gradient accumulation ------------------------------------------------------------------------

# Float32 against exact: every gradient element is a sum over the batch's N = B*T token positions
# of products computed through a few rounded operations. By probabilistic rounding-error analysis
# (Higham & Mary 2019) a length-n reduction is off by at most ~sqrt(n)*u relative, with high
# probability, whatever the order of its additions (so any BLAS); N = 26*32 = 832 gives 29u, and
# the backward pass chains two such reductions (a layer's input gradient, then its weight
# gradient): 64u per tensor, normwise. Accumulation adds k weighted additions (k*u, well inside).
# A weighting mistake (equal weights for parts of 7 and 6 samples, a sum for a mean, clipping or
# stepping per part) is off by 1e-2 or more.
ACCUM_TOL = 64 * U


def test_micro_batches_equal_one_batch_of_all_samples(char: SimpleNamespace) -> None:
    """k micro-batches, gradients accumulated: the gradient, clipping, loss and single AdamW step of
    one batch of all the samples, checked against that batch's gradient in float64."""
    idx = np.random.default_rng(0).integers(0, 100_000, 26)
    clip = 0.05  # below the gradient's norm: clipping acts, on the accumulated gradient
    got: dict[int, tuple[float, dict[str, np.ndarray]]] = {}
    for k in (1, 4, 26):  # parts of 7,7,6,6 samples; single samples
        w = make_worker(char, CHAR_CFG, {"lr": 1e-3, "grad_clip": clip}, backend="torch", device="cpu", seed=0)
        if k == 1:
            exact = copy.deepcopy(w.model).double()
        loss = w.train_step(idx, micro_batches=k)
        assert all(s["step"].item() == 1 for s in w.optimizer.state.values())  # one optimizer step
        got[k] = (loss, {n: p.grad.numpy().astype(np.float64) for n, p in w._params.items()})  # clipped

    x, y = char.make_dataset(CHAR_CFG).batch("train", idx)
    ref = exact(torch.from_numpy(x), torch.from_numpy(y))
    ref.backward()
    grads = {n: p.grad.numpy() for n, p in sorted(exact.named_parameters())}
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    assert norm > 2 * clip
    grads = {n: g * (clip / (norm + 1e-6)) for n, g in grads.items()}
    for k, (loss, g) in got.items():
        assert abs(loss - ref.item()) <= ACCUM_TOL * ref.item(), k
        for n, want in grads.items():
            assert np.linalg.norm(g[n] - want) <= ACCUM_TOL * np.linalg.norm(want), (k, n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_micro_batches_on_every_backend(char: SimpleNamespace, backend: str) -> None:
    """With betas 0, eps 1 and no decay, AdamW's first step is g/(|g|+1): smooth in the gradient,
    so the steps of 3 micro-batches and of one batch agree as their gradients do (each within
    ACCUM_TOL of exact), plus the rounding of θ - step (u|θ| each)."""
    idx = np.arange(20)
    optim = {"lr": 1.0, "betas": (0.0, 0.0), "eps": 1.0, "weight_decay": 0.0, "grad_clip": 0.0}
    losses, steps = {}, {}
    for k in (1, 3):
        w = make_worker(char, CHAR_CFG, optim, backend=backend, device="cpu", seed=0)
        theta0 = w.get_params()
        losses[k] = w.train_step(idx, micro_batches=k)
        got = w.get_params()
        steps[k] = {n: theta0[n].astype(np.float64) - got[n] for n in got}
    assert abs(losses[3] - losses[1]) <= 2 * ACCUM_TOL * losses[1]
    for n, one in steps[1].items():
        tol = 2 * ACCUM_TOL * np.linalg.norm(one) + 2 * U * np.linalg.norm(theta0[n])
        assert np.linalg.norm(steps[3][n] - one) <= tol, n
    with pytest.raises(ValueError, match="micro_batches"):
        w.train_step(np.arange(2), micro_batches=3)
    with pytest.raises(ValueError, match="at least one"):
        w.train_step(np.arange(0), micro_batches=1)


# ---- mixed precision ------------------------------------------------------------------------------


def test_bf16_on_cpu_trains_with_float32_master_weights(digits: ModuleType) -> None:
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 1000, 32) for _ in range(30)]
    ws = {
        p: make_worker(digits, DIGITS_CFG, {"lr": 2e-2}, backend="torch", device="cpu", seed=0, precision=p)
        for p in ("fp32", "bf16")
    }
    losses = {p: [w.train_step(b) for b in batches] for p, w in ws.items()}
    bf16 = ws["bf16"]
    assert bf16.precision == "bf16"
    assert all(math.isfinite(v) for v in losses["bf16"]) and np.mean(losses["bf16"][-5:]) < 0.5 * losses["bf16"][0]
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in bf16.model.parameters())
    state = next(iter(bf16.optimizer.state.values()))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # The same first step in bf16 and fp32: not equal (autocast is on), but close: bf16 keeps 8
    # significant bits (relative rounding 2^-8 = 0.4 %) on the inputs of 6 conv/linear layers.
    first = abs(losses["bf16"][0] - losses["fp32"][0]) / losses["fp32"][0]
    assert 0 < first < 6 * 2.0**-8
    assert math.isfinite(bf16.evaluate(4, 32))


def test_unsupported_precision_is_a_one_line_error(digits: ModuleType, char: SimpleNamespace) -> None:
    with pytest.raises(BackendError, match=r"^precision fp16 is not supported on cpu: .*use bf16 or fp32$"):
        make_worker(digits, DIGITS_CFG, {}, backend="torch", device="cpu", precision="fp16")
    with pytest.raises(BackendError, match="precision 'fp8' is unknown; choose from fp32, bf16, fp16"):
        make_worker(digits, DIGITS_CFG, {}, backend="torch", device="cpu", precision="fp8")
    for backend in ("mlx", "numpy"):
        with pytest.raises(BackendError, match=f"^precision bf16 is not supported by the {backend} backend on cpu"):
            make_worker(char, CHAR_CFG, {}, backend=backend, device="cpu", precision="bf16")
    no_torch = SimpleNamespace(make_dataset=char.make_dataset, make_numpy_model=char.make_numpy_model)
    with pytest.raises(BackendError, match=r"^precision bf16 needs the torch backend, and task x has no make_model"):
        make_worker(no_torch, CHAR_CFG, {}, precision="bf16", task_name="task x")


# ---- a HuggingFace model --------------------------------------------------------------------------


def test_tiny_gpt2_task_builds_and_trains() -> None:
    task = load_task(ROOT / "recipes" / "gpt2_shakespeare.py")  # imports its sibling shakespeare_char
    ws = [make_worker(task, GPT2_CFG, {"lr": 3e-3}, backend="torch", device="cpu", seed=5) for _ in range(2)]
    w = ws[0]
    a, b = (x.get_params() for x in ws)
    assert all(np.array_equal(a[n], b[n]) for n in a)  # the same θ0 on every node, from the seed
    names = w.param_names()
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # tied: listed once
    assert w.model.lm_head.weight is w.model.transformer.wte.weight
    assert w.get_buffers() == {}

    batch = w.dataset.batch("train", np.array([0, 3]))
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (2, 32)
    text = task.load_text().encode("utf-8")
    assert bytes(batch["input_ids"][1].astype(np.uint8)) == text[3 * 32 : 4 * 32]

    rng = np.random.default_rng(0)
    losses = [w.train_step(rng.integers(0, w.n_train, 16), micro_batches=2) for _ in range(15)]
    assert abs(losses[0] - math.log(256)) < 0.3  # starts near uniform over bytes
    assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
    assert math.isfinite(w.evaluate(2, 8))


# ---- task mistakes --------------------------------------------------------------------------------


def test_a_task_breaking_the_interface_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "bad_task.py").write_text(
        textwrap.dedent("""
        import numpy as np, torch

        class Data:
            n_train = n_val = 8
            def batch(self, split, indices):
                x = np.ones((len(indices), 3), np.float32)
                return {"x": x} if split == "train" else 7

        def make_dataset(cfg):
            return Data()

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(3, 2)
            def forward(self, x):
                return self.lin(x)  # logits, not a loss

        def make_model(cfg):
            return Model()
        """)
    )
    task = load_task(tmp_path / "bad_task.py")
    w = make_worker(task, {}, {}, backend="torch", device="cpu")
    with pytest.raises(TaskError, match=r"^task bad_task\.py: model\(\*\*batch\) returned Tensor of shape \(2, 2\)"):
        w.train_step(np.arange(2))
    with pytest.raises(TaskError, match=r"^task bad_task\.py: dataset\.batch\(\) returned int"):
        w.evaluate(1, 2)
    with pytest.raises(BackendError, match=r"task bad_task\.py has no mlx implementation \(make_mlx_model\)"):
        make_worker(task, {}, {}, backend="mlx")


# ---- loading a task from its own checkout ---------------------------------------------------------


def _task_checkout(base: Path, tag: str) -> Path:
    """A git-less checkout: recipes/task.py imports a sibling module at load time and a package of
    the checkout root lazily, inside a function."""
    (base / "recipes").mkdir(parents=True)
    (base / "recipes" / f"helpers_{tag}.py").write_text("WHO = 'sibling'\n")
    (base / f"pkg_{tag}").mkdir()
    (base / f"pkg_{tag}" / "__init__.py").write_text("WHO = 'root package'\n")
    task = base / "recipes" / "task.py"
    task.write_text(
        f"import helpers_{tag}\nWHO = helpers_{tag}.WHO\n\ndef lazy():\n"
        f"    import pkg_{tag}\n    return pkg_{tag}.WHO\n"
    )
    return task


def test_load_task_imports_siblings_and_the_checkouts_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored afterwards
    task_file = _task_checkout(tmp_path / "checkout", "a1")
    task = load_task(task_file, root=tmp_path / "checkout")
    assert task.WHO == "sibling" and task.lazy() == "root package"
    assert sys.path[:2] == [str(task_file.parent.resolve()), str((tmp_path / "checkout").resolve())]
    with pytest.raises(ValueError, match="not under"):
        load_task(task_file, root=tmp_path / "elsewhere")


@pytest.mark.swarm
def test_load_task_does_not_take_a_module_of_the_working_directory(tmp_path: Path) -> None:
    """`python -m drift` runs with its working directory first on sys.path: a helpers module there
    must not stand in for the task's own."""
    task_file = _task_checkout(tmp_path / "checkout", "b2")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "helpers_b2.py").write_text("WHO = 'working directory'\n")
    (cwd / "pkg_b2.py").write_text("WHO = 'working directory'\n")
    code = (
        "import sys; from drift.workers import load_task; "
        "t = load_task(sys.argv[1], root=sys.argv[2]); print(t.WHO, '|', t.lazy())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(task_file), str(tmp_path / "checkout")],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "sibling | root package"


# ---- buffers and close on every backend -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["mlx", "numpy"])
def test_backends_without_buffers_accept_only_none(char: SimpleNamespace, backend: str) -> None:
    w = make_worker(char, CHAR_CFG, {}, backend=backend, device="cpu")
    assert w.get_buffers() == {}
    w.set_buffers({})
    with pytest.raises(ValueError, match=r"unexpected buffer.*running_mean"):
        w.set_buffers({"running_mean": np.zeros(3, np.float32)})
    w.close()
    w.close()  # idempotent


def test_closed_mlx_worker_has_ended_its_thread(char: SimpleNamespace) -> None:
    w = make_worker(char, CHAR_CFG, {}, backend="mlx", device="cpu")
    w.train_step(np.arange(4))
    thread_id = w._thread_id
    assert thread_id in {t.ident for t in threading.enumerate()}
    w.close()
    assert thread_id not in {t.ident for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="closed"):
        w.train_step(np.arange(4))
    w.close()


MLX_EXIT = """
import sys
import numpy as np
from drift.workers import load_task, make_worker
task = load_task(sys.argv[1])
w = make_worker(task, {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16}, {}, backend="mlx", seed=0)
for i in range(3):
    w.train_step(np.arange(8) + 8 * i)
if sys.argv[2] == "close":
    w.close()
"""


@pytest.mark.swarm
def test_mlx_process_exits_cleanly(tmp_path: Path) -> None:
    """The mlx worker's thread once held a Python object in C++ thread-local storage that it freed
    only after the interpreter had begun to shut down: the process then aborted at exit ("terminate
    called without an active exception") in most runs on a 2-core machine. Closed or not, it exits 0."""
    script = tmp_path / "mlx_exit.py"
    script.write_text(MLX_EXIT)
    task = str(ROOT / "recipes" / "shakespeare_char.py")
    for mode in ("close", "exit", "close", "exit"):
        out = subprocess.run(
            [sys.executable, str(script), task, mode],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=120,
            check=False,
        )
        assert out.returncode == 0 and "terminate" not in out.stderr, (mode, out.returncode, out.stderr)
