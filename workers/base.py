"""The backend-neutral Worker interface: what drift's node needs from local compute.

A worker owns one copy of the model, its inner optimizer (AdamW) and the task's data. Parameters
cross this boundary only as float32 numpy arrays keyed by name, so drift never touches a
framework tensor. Inner-optimizer state lives inside the worker and survives set_params: DiLoCo
keeps each node's AdamW state across outer rounds.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Worker(Protocol):
    """One node's local trainer (torch today; mlx and numpy backends fit the same shape)."""

    backend: str  # "torch"
    device: str   # "cpu", "cuda:0", "mps", ...
    n_train: int  # training samples available (valid indices: 0 .. n_train-1)
    n_val: int    # validation samples available

    def param_names(self) -> list[str]:
        """Parameter names, sorted: the order every node uses to lay out θ."""
        ...

    def get_params(self) -> dict[str, np.ndarray]:
        """A copy of every parameter as a float32, C-contiguous array (the caller may keep them)."""
        ...

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        """Overwrite the parameters in place (optimizer state is kept).

        Names and shapes must match exactly; otherwise ValueError naming the offender, and
        nothing is changed.
        """
        ...

    def train_step(self, indices: np.ndarray) -> float:
        """One inner optimizer step on the training samples with these indices; the loss."""
        ...

    def evaluate(self, max_batches: int, batch_size: int) -> float:
        """Mean val loss over the first max_batches*batch_size val samples.

        Deterministic, no gradients, parameters and optimizer state untouched.
        """
        ...


def check_params(expected: dict[str, tuple[int, ...]], params: dict[str, np.ndarray]) -> None:
    """ValueError naming the first missing, unexpected or mis-shaped parameter, if any."""
    missing = sorted(set(expected) - set(params))
    if missing:
        raise ValueError(f"missing parameter(s): {', '.join(missing)}")
    unexpected = sorted(set(params) - set(expected))
    if unexpected:
        raise ValueError(f"unexpected parameter(s): {', '.join(unexpected)}")
    for name in sorted(expected):
        shape = tuple(np.shape(params[name]))
        if shape != expected[name]:
            raise ValueError(f"parameter {name}: shape {shape}, expected {expected[name]}")
