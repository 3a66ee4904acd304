"""A task repo may use any top-level package names, drift's own included: its code imports its
own `workers`, `auth`, `recipes` and `tests`, at load time and inside functions, while the node
runs on drift's. Run as a user would: `drift coord mytask.yaml --local 2` from inside the repo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, git

pytestmark = pytest.mark.swarm  # starts drift processes (tests/conftest.py)

TASK = textwrap.dedent(
    '''
    """The points MLP, with its sizes from the repo's own `workers`, `auth` and `recipes`."""
    from auth import CLASSES  # the repo's auth, not drift's
    from recipes.sizes import HIDDEN
    from workers import POINTS
    from workers.data import Points

    import torch
    from torch import nn


    def make_dataset(cfg):
        from tests.seeds import DATA_SEED  # imported late, inside a function

        return Points(POINTS, DATA_SEED, CLASSES)


    def make_torch_model(cfg, vocab_size):
        from workers import POINTS as again  # still the repo's, after drift ran for a while

        assert again == POINTS
        return nn.Sequential(nn.Linear(2, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, vocab_size))


    def loss(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(torch.as_tensor(x)), torch.as_tensor(y))


    def sample(model, prompt, n):
        from workers import POINTS  # still the repo's, under `drift sample`

        x = torch.tensor([[float(v) for v in prompt.split(",")]])
        return f"{POINTS}:{int(model(x).argmax())}"
    '''
)

DATA = textwrap.dedent(
    """
    import numpy as np

    from . import helper  # a relative import inside the repo's `workers`


    class Points:
        def __init__(self, n, seed, classes):
            rng = np.random.default_rng(seed)
            self.x = rng.uniform(-1, 1, size=(n, 2)).astype(np.float32)
            self.y = helper.rings(self.x, classes)
            self.n_train, self.n_val, self.vocab_size = int(n * 0.9), n - int(n * 0.9), classes

        def batch(self, split, indices):
            base = 0 if split == "train" else self.n_train
            return self.x[base + indices], self.y[base + indices]
    """
)


def _repo(path: Path) -> Path:
    files = {
        "task.py": TASK,
        "workers/__init__.py": "POINTS = 4000\n",
        "workers/data.py": DATA,
        "workers/helper.py": (
            "import numpy as np\n\n\ndef rings(x, k):\n"
            "    r = np.sqrt((x**2).sum(1))\n    return np.minimum((r * k / 1.42).astype(np.int64), k - 1)\n"
        ),
        "auth/__init__.py": "CLASSES = 3\n",
        "recipes/sizes.py": "HIDDEN = 16\n",  # a namespace package (no __init__.py)
        "tests/__init__.py": "",
        "tests/seeds.py": "DATA_SEED = 5\n",
    }
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    recipe = {
        "name": "mytask",
        "task": "task.py",
        "min_nodes": 2,
        "rounds": 2,
        "inner_steps": 4,
        "batch_size": 16,
        "unit_steps": 2,
        "eval_batches": 2,
        "seed": 3,
    }
    (path / "mytask.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "task")
    return path


def test_a_repo_with_its_own_workers_auth_recipes_and_tests_packages_trains(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "mytask")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "drift", "coord", "mytask.yaml", "--local", "2", "--run-dir", str(tmp_path / "run")],
        cwd=repo,  # as a user types it, from inside the repo: its `workers/` is in the working directory
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "run complete: 2 rounds trained, final val loss" in out.stdout  # a sentence, not key=value pairs
    assert "event=" not in out.stdout
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"]
    assert [e["round"] for e in rounds] == [0, 1]
    joined = [e for e in events if e["event"] == "training_started"]
    assert joined and joined[0]["n_train"] == 3600  # the repo's POINTS, through its own `workers`

    # `drift sample` from inside the repo: the task's sample() sees the repo's own `workers`.
    out = subprocess.run(
        [sys.executable, "-m", "drift", "sample", str(tmp_path / "run"), "--prompt", "0.1,0.2", "--repo", "."],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().startswith("4000:"), out.stdout

    # README's checkpoint snippet, typed in the repo: its `workers` and drift's side by side, in
    # either import order.
    load = textwrap.dedent(
        """
        FIRST
        SECOND
        import torch
        from pathlib import Path
        from drift.checkpoint import latest_checkpoint
        from drift.workers import load_task

        ckpt, warnings = latest_checkpoint(Path(CKPT))
        task = load_task("task.py")
        model = task.make_torch_model({}, 3)
        missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in ckpt.theta.items()})
        print(workers.POINTS, auth.CLASSES, drift.workers.Worker.__module__, ckpt.round, missing, unexpected)
        """
    ).replace("CKPT", repr(str(tmp_path / "run" / "checkpoints")))
    orders = [("import workers, auth", "import drift.workers"), ("import drift.workers", "import workers, auth")]
    for first, second in orders:
        code = load.replace("FIRST", first).replace("SECOND", second)
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, env=env, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["4000", "3", "drift.workers.base", "1", "[]", "[]"], out.stdout


def test_a_script_next_to_its_own_workers_package_imports_drift_and_its_own(tmp_path: Path) -> None:
    """A user's own loop (drift.DiLoCo) in a repo with `workers/` and `auth/`: `import drift` gets
    drift's packages, the script's imports get its own, before and inside functions."""
    repo = tmp_path / "loop"
    (repo / "workers").mkdir(parents=True)
    (repo / "workers" / "__init__.py").write_text("HIDDEN = 42\n")
    (repo / "auth.py").write_text("SECRET = 'mine'\n")
    (repo / "train.py").write_text(
        textwrap.dedent(
            """
            import drift
            from workers import HIDDEN
            import auth


            def later():
                from workers import HIDDEN as again
                return again


            import drift.node  # drift's own modules still import drift's workers and auth
            from drift.loop import DiLoCo
            print(HIDDEN, auth.SECRET, later(), drift.node.BackendError.__module__, DiLoCo.__name__)
            """
        )
    )
    git(repo, "init", "-q", "-b", "main")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "train.py"], cwd=repo, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["42", "mine", "42", "drift.workers.base", "DiLoCo"]


def test_a_project_with_its_own_workers_and_auth_imports_them_beside_drift_in_any_order(tmp_path: Path) -> None:
    """`python -c` from a project's root (its `workers/` and `auth/` first on sys.path): nothing of
    drift's is importable as a top-level `workers` or `auth`, in whichever order things import."""
    repo = tmp_path / "proj"
    for pkg, value in (("workers", "'mine-w'"), ("auth", "'mine-a'")):
        (repo / pkg).mkdir(parents=True)
        (repo / pkg / "__init__.py").write_text(f"WHO = {value}\n")
    show = "print(workers.WHO, auth.WHO, drift.workers.__name__, drift.auth.__name__, drift.auth.NodeKey.__name__)"
    orders = [
        "import workers, auth, drift, drift.workers, drift.auth",
        "import drift, drift.workers, drift.auth, workers, auth",
        "import drift.auth; import workers; import drift.workers; import auth; import drift",
        "from drift.loop import DiLoCo; import workers, auth, drift.workers, drift.auth, drift",
    ]
    for order in orders:
        out = subprocess.run(
            [sys.executable, "-c", f"{order}; {show}"], cwd=repo, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, (order, out.stderr)
        assert out.stdout.split() == ["mine-w", "mine-a", "drift.workers", "drift.auth", "NodeKey"], (order, out.stdout)
    # Outside any project, drift's folders are not top-level packages at all.
    out = subprocess.run(
        [sys.executable, "-c", "import drift.workers; import workers"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode != 0 and "No module named 'workers'" in out.stderr
