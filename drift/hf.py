"""A Hugging Face `Trainer` as one node of a swarm: add `DriftCallback` to its callbacks.

    from drift.hf import DriftCallback
    trainer = Trainer(model, args, train_dataset=train, callbacks=[DriftCallback(ticket=sys.argv[1], eval_dataset=val)])
    trainer.train()

The coordinator's recipe holds the schedule (rounds, `inner_steps` = torchft's `sync_every`, batch
size, the outer optimizer); the Trainer keeps its model, its optimizer (the inner one), its dataset
and collator. Each step trains the samples the swarm granted (drift/trainers.py says why the
Trainer's own batches only set the pace), and the run ends when the swarm's does: give the Trainer
`max_steps` of at least the recipe's rounds × inner_steps.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from transformers import TrainerCallback

from drift.trainers import Feed, joined, mean_loss, refuse


class _Slot(dict):
    """A batch the Trainer's loader produced ahead of time; filled with the swarm's samples just
    before its step. `.to()` keeps it the same object (accelerate moves batches with it)."""

    def to(self, *args: Any, **kwargs: Any) -> _Slot:
        return self


class DriftCallback(TrainerCallback):
    """Joins the swarm of `ticket` (default: $DRIFT_TICKET) when `trainer.train()` starts.

    eval_dataset: optional; the validation loss the coordinator asks some nodes for is the model's
    mean loss on it. key, name: this node's key file and name, as `drift.DiLoCo` takes them."""

    def __init__(
        self,
        ticket: str | None = None,
        eval_dataset: Any = None,
        key: str | None = None,
        name: str | None = None,
    ) -> None:
        self.ticket, self.eval_dataset, self.key, self.name = ticket, eval_dataset, key, name
        self.feed: Feed | None = None
        self._slots: deque[_Slot] = deque()

    @property
    def swarm(self):
        """The `drift.DiLoCo` under this callback (its `progress`, `log`), once training started."""
        return self.feed.swarm if self.feed is not None else None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        if args.gradient_accumulation_steps != 1:
            refuse(
                "DriftCallback: gradient_accumulation_steps must be 1 (a swarm's step is one batch; "
                "accumulate with the recipe's micro_batches)"
            )
        if getattr(train_dataloader, "num_workers", 0):
            refuse("DriftCallback: set dataloader_num_workers=0 (the swarm's samples are read on the step)")
        collate = train_dataloader.collate_fn
        evaluate = None
        if self.eval_dataset is not None:
            evaluate = mean_loss(self.eval_dataset, collate, _model_loss, args.per_device_eval_batch_size)
        dataset = train_dataloader.dataset
        self.feed = joined(lambda: Feed(model, optimizer, dataset, collate, self.ticket, evaluate, self.key, self.name))
        loader = getattr(train_dataloader, "base_dataloader", train_dataloader)  # inside accelerate's adapter
        loader.collate_fn = self._slot  # the loader's own batches become slots the swarm fills

    def _slot(self, items: list) -> _Slot:
        slot = _Slot()
        self._slots.append(slot)
        return slot

    def on_step_begin(self, args, state, control, **kwargs):
        slot = self._slots.popleft()  # the oldest slot is the batch this step trains
        slot.update(self.feed.batch())

    def on_step_end(self, args, state, control, **kwargs):
        if not self.feed.advance():
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float)) and math.isfinite(v)}
        log = getattr(self.swarm, "log", None)
        if log is not None and metrics:
            log(step=state.global_step, **metrics)

    def on_train_end(self, args, state, control, **kwargs):
        if self.feed is not None:
            self.feed.close()


def _model_loss(model: Any, batch: dict) -> float:
    device = next(model.parameters()).device
    return model(**{k: v.to(device) for k, v in batch.items()}).loss.item()
