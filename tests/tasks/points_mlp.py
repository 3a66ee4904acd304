"""A task written from the README alone: a 2-layer MLP classifying synthetic 2-D points into
rings. Its inner steps take about a millisecond, like a small model on a fast GPU: fast enough to
expose races between grants, StopRound and progress messages that slow steps hide."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

CLASSES = 4


class Points:
    """Points in the plane, labelled by which ring (distance band from the origin) they fall in."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.uniform(-1, 1, size=(n, 2)).astype(np.float32)
        r = np.sqrt((self.x**2).sum(1))
        self.y = np.minimum((r * CLASSES / 1.42).astype(np.int64), CLASSES - 1)
        self.n_train = int(n * 0.9)
        self.n_val = n - self.n_train
        self.vocab_size = CLASSES

    def batch(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        base = 0 if split == "train" else self.n_train
        return self.x[base + indices], self.y[base + indices]


class MLP(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


def make_dataset(cfg: dict) -> Points:
    return Points(int(cfg.get("points", 20000)), int(cfg.get("data_seed", 0)))


def make_torch_model(cfg: dict, vocab_size: int) -> nn.Module:
    return MLP(int(cfg.get("hidden", 32)), vocab_size)
