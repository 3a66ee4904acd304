"""A node a round went on without keeps its work (rounds that close at a quorum): its local copy,
set to the new θ, takes back `keep` of its own Δ of that round, and its next Δ carries it to the
swarm (drift/node.py Trainer.keep_late; the coordinator's side: tests/test_round.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from drift.diloco import ParamLayout
from drift.node import Trainer
from drift.recipe import Recipe
from drift.sync import make_rule
from drift.workers import load_task, make_worker

TASK = Path(__file__).parent / "tasks" / "points_mlp.py"


def _trainer() -> Trainer:
    worker = make_worker(load_task(TASK), {"hidden": 8}, {"lr": 0.05}, backend="torch", device="cpu", threads=1)
    layout = ParamLayout.of_shapes({name: a.shape for name, a in worker.iter_state()})
    recipe = Recipe(name="t", task="points_mlp.py", rounds=3, inner_steps=4, batch_size=8)
    theta = np.empty(layout.size, np.float32)
    t = Trainer(
        worker, recipe, "run", "c" * 40, None, layout, make_rule(layout, recipe), theta, theta.copy(), None, None, ""
    )
    t.read_local(t.theta)
    return t


def _local(t: Trainer) -> np.ndarray:
    out = np.empty_like(t.theta)
    t.read_local(out)
    return out


def test_a_late_node_keeps_its_share_of_its_delta_on_the_new_theta_and_sends_it_next() -> None:
    t = _trainer()
    rng = np.random.default_rng(0)
    for _ in range(3):  # its round: three inner steps on θ_r
        t.worker.train_step(rng.integers(0, 100, 8))
    t.pseudo_gradient()
    mine = t.delta.copy()  # Δ_r = θ_r − local
    assert np.abs(mine).max() > 0
    t.theta -= 0.01 * rng.standard_normal(t.theta.size).astype(np.float32)  # θ_r+1: the swarm's step without it
    t.load_worker()
    t.keep_late(0.7, 3)
    np.testing.assert_allclose(_local(t), t.theta - 0.7 * mine, atol=1e-6)
    assert t.kept_steps == 3
    t.pseudo_gradient()  # its next barrier, before any step: the Δ it sends is the share it kept
    np.testing.assert_allclose(t.delta, 0.7 * mine, atol=1e-6)
