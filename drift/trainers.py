"""What the Hugging Face and Lightning callbacks share (drift/hf.py, drift/lightning.py): a trainer's
own loop as one node of a swarm, fed the swarm's samples.

A trainer's data loader reads ahead (accelerate's and Lightning's fetch the next batch before the
step in hand has run), while the swarm decides the next step's samples only once the step in hand
is done (its share of a round may end there, and θ be averaged and written back). So the loader's
batches only set the trainer's pace: each step trains the batch `Feed.batch()` builds from the
trainer's own dataset and collate function, at the indices the swarm granted; `Feed.advance()`, at
the end of each step, hands the step to the swarm and takes the next one's indices.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np

from drift.loop import USER_ERRORS, DiLoCo
from drift.node import NodeError


class Feed:
    """One node over a trainer's model, optimizer, dataset and collate function."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        dataset: Any,
        collate: Callable[[list], Any],
        ticket: str | None,
        evaluate: Callable[[Any], float] | None,
        key: str | None,
        name: str | None,
    ) -> None:
        try:
            samples = len(dataset)
        except TypeError:
            raise NodeError(
                "drift needs a training dataset with a length (a map-style dataset, not an iterable one)"
            ) from None
        self.dataset, self.collate = dataset, collate
        self.swarm = DiLoCo(model, optimizer, ticket=ticket, samples=samples, evaluate=evaluate, key=key, name=name)
        self._batches: Iterator[np.ndarray] | None = None
        self.indices: np.ndarray | None = None  # the samples of the step in hand; None once the run ended
        self.ended = False

    def start(self) -> None:
        """Join the swarm (blocks until the first step is granted)."""
        self.swarm.__enter__()
        self._batches = self.swarm.batches()
        hook = sys.excepthook

        def leave(*exc: Any) -> None:  # the trainer crashed: leave the swarm, or the process waits for the node
            hook(*exc)
            self.ended = True
            try:
                self.close()
            except BaseException:
                pass

        sys.excepthook = leave
        if not self.advance():
            self.close()  # the node's own error, in one line, if it had one
            refuse("the swarm's run ended before this node trained a step")

    def advance(self) -> bool:
        """The step in hand is done: the swarm takes it (and syncs, if its share of the round ends
        here) and grants the next one. False once the run has ended."""
        self.indices = next(self._batches, None) if self._batches is not None else None
        if self.indices is None:
            self.ended = True
        return not self.ended

    def batch(self) -> Any:
        """The step in hand's samples, from the trainer's own dataset, through its own collate."""
        if self.indices is None:
            raise NodeError("the swarm's run has ended: no more steps to train")
        return self.collate([self.dataset[int(i)] for i in self.indices])

    def close(self) -> None:
        """Leave the swarm (a trainer that stops before the run ends leaves it early)."""
        if self._batches is None:
            return
        if not self.ended:
            print(
                "drift: the trainer stopped before the swarm's run ended: this node left the swarm "
                "(give the trainer more steps than the recipe's rounds × inner_steps)",
                file=sys.stderr,
                flush=True,
            )
        self._batches = None
        self.swarm.__exit__(None, None, None)


def refuse(why: str) -> NoReturn:
    """A user's mistake under a trainer: one line, exit 1 (as `drift join` says it)."""
    print(f"drift: error: {why}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def joined(make: Callable[[], Feed]) -> Feed:
    """make() and start the feed; a mistake (no ticket, a dirty repo, ...) in one line."""
    try:
        feed = make()
    except USER_ERRORS as e:
        refuse(str(e))
    feed.start()
    return feed


def mean_loss(dataset: Any, collate: Callable[[list], Any], loss: Callable[[Any, Any], Any], batch_size: int = 32):
    """evaluate(model) -> the mean of loss(model, batch) over `dataset` in batches (no grad, eval mode)."""

    def evaluate(model: Any) -> float:
        import torch

        was = model.training
        model.eval()
        total, n = 0.0, 0
        try:
            with torch.no_grad():
                for start in range(0, len(dataset), batch_size):
                    items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
                    total += float(loss(model, collate(items))) * len(items)
                    n += len(items)
        finally:
            model.train(was)
        return total / max(n, 1)

    return evaluate
