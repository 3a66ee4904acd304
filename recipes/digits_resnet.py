"""A small ResNet with BatchNorm on scikit-learn's handwritten digits (8x8 images, 10 classes).

The data ships inside the scikit-learn wheel (`load_digits()`, 1797 images), so nothing is
downloaded. The task shows the general task interface (workers/base.py): dict batches
{"x", "y"}, a model that returns logits, and the task's own loss(model, batch). BatchNorm's running
statistics are buffers, which workers expose with get_buffers / set_buffers.

    make_dataset(cfg) -> DigitsDataset     # n_train, n_val, batch(split, indices) -> {"x", "y"}
    make_model(cfg) -> torch.nn.Module     # forward(x) -> logits (N, 10)
    loss(model, batch) -> scalar tensor    # cross-entropy
    metrics(model, batch) -> {"accuracy"}  # reported per round beside the val loss
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

DEFAULTS: dict[str, Any] = {
    "width": 32,  # channels of the first stage; the second has twice as many
    "blocks": 1,  # residual blocks per stage
}
VAL_FRACTION = 0.2
SPLIT_SEED = 0  # the same train/val split on every node


def _config(cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg merged over DEFAULTS; an unknown key (a typo in a recipe) is a ValueError."""
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"digits_resnet: unknown task_config key(s) {unknown}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **cfg}


class DigitsDataset:
    """The digits, shuffled once with a fixed seed: the last 20 % are the validation split.

    x is float32 (N, 1, 8, 8) scaled to [0, 1] (the pixels are 0..16), y the int64 class.
    """

    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        order = np.random.default_rng(SPLIT_SEED).permutation(len(digits.target))
        x = (digits.images[order] / 16.0).astype(np.float32)[:, None, :, :]
        y = digits.target[order].astype(np.int64)
        n_val = int(len(y) * VAL_FRACTION)
        self._splits = {"train": (x[n_val:], y[n_val:]), "val": (x[:n_val], y[:n_val])}
        self.n_train: int = len(y) - n_val
        self.n_val: int = n_val

    def batch(self, split: str, indices: np.ndarray) -> dict[str, np.ndarray]:
        """{"x": float32 (B, 1, 8, 8), "y": int64 (B,)} for these sample indices of the split."""
        if split not in self._splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        x, y = self._splits[split]
        idx = np.asarray(indices)
        if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
            raise ValueError(f"indices must be a 1-D integer array, got shape {idx.shape} dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= len(y)):
            bad = idx[(idx < 0) | (idx >= len(y))][0]
            raise ValueError(f"{split} sample index {int(bad)} out of range [0, {len(y)})")
        return {"x": x[idx], "y": y[idx]}


def make_dataset(cfg: dict[str, Any]) -> DigitsDataset:
    """The digits split into train and val (the config only shapes the model)."""
    _config(cfg)
    return DigitsDataset()


def make_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """A ResNet: 3x3 stem, a stage at 8x8 and one at 4x4 of basic blocks, global average pool, linear."""
    from torch import nn

    c = _config(cfg)
    width, blocks = int(c["width"]), int(c["blocks"])
    if width < 1 or blocks < 1:
        raise ValueError(f"digits_resnet: width and blocks must be >= 1, got {width}, {blocks}")

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = nn.Sequential()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.bn1(self.conv1(x)).relu()
            return (self.bn2(self.conv2(h)) + self.shortcut(x)).relu()

    def stage(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(BasicBlock(cin, cout, stride), *(BasicBlock(cout, cout, 1) for _ in range(blocks - 1)))

    return nn.Sequential(
        nn.Conv2d(1, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        stage(width, width, 1),
        stage(width, 2 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 10),
    )


def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the model's logits against the labels."""
    import torch.nn.functional as F

    return F.cross_entropy(model(batch["x"]), batch["y"])


def metrics(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """The share of the batch's images classified right (drift averages it over the val set)."""
    return {"accuracy": float((model(batch["x"]).argmax(dim=1) == batch["y"]).float().mean())}
