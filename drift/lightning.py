"""A Lightning `Trainer` as one node of a swarm: add `DriftCallback` to its callbacks.

    from drift.lightning import DriftCallback
    trainer = L.Trainer(callbacks=[DriftCallback(ticket=sys.argv[1], evaluate=val_loss)])
    trainer.fit(module, DataLoader(train, batch_size=32))

The coordinator's recipe holds the schedule (rounds, `inner_steps` = torchft's `sync_every`, batch
size, the outer optimizer); the module keeps its model, `configure_optimizers` (the inner
optimizer) and data. Each step trains the samples the swarm granted, from the train loader's own
dataset and collate function (drift/trainers.py says why), and the fit ends when the swarm's run
does (leave `max_steps`/`max_epochs` unset, or larger than the run).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from drift.trainers import Feed, joined, refuse


class DriftCallback(pl.Callback):
    """Joins the swarm of `ticket` (default: $DRIFT_TICKET) when training starts.

    evaluate(module) -> val loss: optional (the coordinator asks some nodes for θ's). key, name:
    this node's key file and name, as `drift.DiLoCo` takes them."""

    def __init__(
        self,
        ticket: str | None = None,
        evaluate: Callable[[Any], float] | None = None,
        key: str | None = None,
        name: str | None = None,
    ) -> None:
        self.ticket, self.evaluate, self.key, self.name = ticket, evaluate, key, name
        self.feed: Feed | None = None

    @property
    def swarm(self):
        """The `drift.DiLoCo` under this callback (its `progress`, `log`), once training started."""
        return self.feed.swarm if self.feed is not None else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.accumulate_grad_batches != 1:
            refuse("DriftCallback: accumulate_grad_batches must be 1 (accumulate with the recipe's micro_batches)")
        if len(trainer.optimizers) != 1:
            refuse(
                f"DriftCallback: configure_optimizers must return one optimizer (it returned {len(trainer.optimizers)})"
            )
        loader = trainer.train_dataloader
        dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
        if dataset is None or collate is None:
            refuse("DriftCallback: fit() needs one torch DataLoader over a map-style dataset")
        optimizer = trainer.optimizers[0]
        self.feed = joined(
            lambda: Feed(pl_module, optimizer, dataset, collate, self.ticket, self.evaluate, self.key, self.name)
        )
        step = pl_module.training_step

        def training_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
            # the loader's batch set the pace; the step trains the swarm's samples
            return step(trainer.strategy.batch_to_device(self.feed.batch()), *args, **kwargs)

        pl_module.training_step = training_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        log = getattr(self.swarm, "log", None)
        if log is not None and loss is not None and math.isfinite(float(loss)):
            log(step=trainer.global_step, loss=float(loss))
        if not self.feed.advance():
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.feed is not None:
            self.feed.close()
            del pl_module.training_step  # the module's own again
