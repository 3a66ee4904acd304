"""A synthetic task with exactly `n_params` float32 parameters, for memory and scale benchmarks
(benchmarks/bench_scale.py). It follows the general task interface (workers/base.py):

    make_dataset(cfg) -> object with n_train, n_val, batch(split, indices) -> (ids,)
    make_model(cfg)   -> torch.nn.Module; model(ids) is a scalar loss

The model is `n_tensors` embedding tables of `dim`-wide rows (plus one 1-D tensor holding the
remainder when n_params is not a multiple of dim), so a step is cheap whatever the size: a few
row lookups forward, a dense gradient of θ's size backward (nn.Embedding's default), and AdamW
over all of θ. What a step costs in memory is what any dense model costs: θ, its gradient and
AdamW's two moments. The loss is the mean square of the rows looked up (a mean over samples).

task_config keys (all optional): n_params (10M), dim (1000), n_tensors (1), n_train (4096),
n_val (256), ids_per_sample (8).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

DEFAULTS: dict[str, Any] = {
    "n_params": 10_000_000,
    "dim": 1000,
    "n_tensors": 1,
    "n_train": 4096,
    "n_val": 256,
    "ids_per_sample": 8,
}


def _config(cfg: dict[str, Any]) -> dict[str, int]:
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"bigtask: unknown task_config key(s) {unknown}; known: {sorted(DEFAULTS)}")
    c = {k: int(v) for k, v in {**DEFAULTS, **cfg}.items()}
    if c["n_params"] < c["dim"] * c["n_tensors"]:
        raise ValueError(f"bigtask: n_params ({c['n_params']}) < dim x n_tensors ({c['dim'] * c['n_tensors']})")
    return c


def _rows(c: dict[str, int]) -> list[int]:
    """Rows of each table: n_params // dim rows split as evenly as possible over n_tensors."""
    q, r = divmod(c["n_params"] // c["dim"], c["n_tensors"])
    return [q + (1 if k < r else 0) for k in range(c["n_tensors"])]


class Ids:
    """Sample i is ids_per_sample row numbers, a fixed function of (split, i)."""

    def __init__(self, c: dict[str, int]) -> None:
        self.n_train, self.n_val = c["n_train"], c["n_val"]
        self.k = c["ids_per_sample"]
        self.rows = min(_rows(c))

    def batch(self, split: str, indices: np.ndarray) -> tuple[torch.Tensor]:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        idx = np.asarray(indices, dtype=np.int64) + (0 if split == "train" else self.n_train)
        ids = (idx[:, None] * 7919 + np.arange(self.k) * 104729) % self.rows
        return (torch.from_numpy(ids),)


class BigModel(nn.Module):
    def __init__(self, c: dict[str, int]) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(r, c["dim"]) for r in _rows(c))
        rest = c["n_params"] - c["dim"] * sum(_rows(c))
        self.rest = nn.Parameter(torch.zeros(rest)) if rest else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        loss = sum(t(ids).pow(2).mean() for t in self.tables)
        if self.rest is not None:
            loss = loss + self.rest.pow(2).mean()
        return loss


def make_dataset(cfg: dict[str, Any]) -> Ids:
    return Ids(_config(cfg))


def make_model(cfg: dict[str, Any]) -> nn.Module:
    return BigModel(_config(cfg))
