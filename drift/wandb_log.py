"""Weights & Biases, when a recipe asks for it (`wandb: {project: ...}`, `pip install -e '.[wandb]'`):
the coordinator logs the same scalars as TensorBoard (monitor.scalars), one W&B run per swarm
(its id is the swarm's run id). Nodes never log. `WANDB_MODE=offline` keeps it on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drift.monitor import scalars
from drift.recipe import Recipe


class WandbError(Exception):
    """W&B was asked for and cannot be used; str() is the one line shown to the user."""


class WandbLog:
    """A Monitor subscriber: each event's scalars, against the round (W&B's `round` step metric)."""

    def __init__(self, run) -> None:
        self.run = run

    @classmethod
    def open(cls, recipe: Recipe, run_id: str, run_dir: Path) -> WandbLog:
        cfg = recipe.wandb
        assert cfg is not None
        try:
            import wandb
        except ImportError:
            raise WandbError(
                "the recipe asks for wandb, which is not installed: pip install -e '.[wandb]' (or remove wandb:)"
            ) from None
        try:
            run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.name or f"{recipe.name}-{run_id}",
                id=run_id,
                dir=str(run_dir),
                config=recipe.model_dump(mode="json", exclude={"wandb"}),
                tags=cfg.tags or None,
            )
            run.define_metric("round")
            run.define_metric("*", step_metric="round")
            run.define_metric("log/step")  # swarm.log's metrics, at the node's own step
            run.define_metric("log/*", step_metric="log/step")
        except Exception as e:  # no login, a bad entity, ...: W&B says what
            raise WandbError(f"wandb: {e}") from None
        return cls(run)

    def event(self, rec: dict[str, Any]) -> None:
        for step, values in scalars(rec):
            logged = {k: float(v) for k, v in values.items() if v is not None}
            if logged:
                self.run.log({"log/step" if rec["event"] == "log" else "round": step, **logged})

    def close(self) -> None:
        self.run.finish()
