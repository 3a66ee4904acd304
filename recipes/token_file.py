"""nanoGPT's token files as a task: DATA_DIR/train.bin and DATA_DIR/val.bin, uint16 token ids
one after another (what nanoGPT's prepare.py scripts write), memory-mapped, never read whole, so
the files may be larger than RAM. The model is the default task's GPT (recipes/shakespeare_char.py).

Sample i of a split is the window tokens[i*block_size : i*block_size + block_size + 1]; batch()
returns the windows as uint16 ({"tokens": (n, block_size + 1)}), 2 bytes a token: what a node
fetches per sample when the files live with the coordinator only (recipe `data:`, drift/data.py).

task_config: data_dir (relative to this file's directory, or absolute), vocab_size (default 65536,
or nanoGPT's meta.pkl beside the files when there is one), and the GPT's block_size, n_layer,
n_head, n_embd, dropout.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

MODEL_KEYS = ("block_size", "n_layer", "n_head", "n_embd", "dropout")
DEFAULTS: dict[str, Any] = {"data_dir": "data", "vocab_size": None, "block_size": 64}


class _PlainData(pickle.Unpickler):
    """Unpickles plain data only (dicts, lists, strings, numbers): a pickle that names any
    class or function (the way a pickle runs code) is refused, not imported."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}: only plain data is read")


def _meta_vocab_size(meta: Path) -> int:
    """nanoGPT's meta.pkl ({"vocab_size": N, "itos": ..., "stoi": ...}): its vocab_size, read as
    plain data. The directory is named by a recipe, which may come from someone else's repo."""
    try:
        with open(meta, "rb") as f:
            got = _PlainData(f).load()
        return int(got["vocab_size"])
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, IndexError) as e:
        raise ValueError(
            f"token_file: {meta}: not a nanoGPT meta.pkl ({e}); set task_config vocab_size instead"
        ) from None


def _config(cfg: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(cfg) - set(DEFAULTS) - set(MODEL_KEYS))
    if unknown:
        raise ValueError(f"token_file: unknown task_config key(s) {unknown}")
    return {**DEFAULTS, **cfg}


class TokenFile:
    """train.bin / val.bin of uint16 tokens, in windows of block_size + 1."""

    def __init__(self, data_dir: Path, block_size: int, vocab_size: int | None) -> None:
        self.paths = {s: data_dir / f"{s}.bin" for s in ("train", "val")}
        tokens = {s: p.stat().st_size // 2 for s, p in self.paths.items()}  # FileNotFoundError if absent
        self.block_size = block_size
        self.n_train = max(0, (tokens["train"] - 1) // block_size)
        self.n_val = max(0, (tokens["val"] - 1) // block_size)
        meta = data_dir / "meta.pkl"
        if vocab_size is None and meta.is_file():
            vocab_size = _meta_vocab_size(meta)
        self.vocab_size = int(vocab_size or 65536)
        self._offsets = np.arange(block_size + 1)

    def batch(self, split: str, indices: np.ndarray) -> dict[str, np.ndarray]:
        if split not in self.paths:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        n = self.n_train if split == "train" else self.n_val
        idx = np.asarray(indices, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise ValueError(f"{split} sample index out of range [0, {n})")
        # A fresh map per call, as nanoGPT does: a long-lived one keeps every page it touched.
        tokens = np.memmap(self.paths[split], dtype=np.uint16, mode="r")
        return {"tokens": np.ascontiguousarray(tokens[idx[:, None] * self.block_size + self._offsets])}


def make_dataset(cfg: dict[str, Any]) -> TokenFile:
    c = _config(cfg)
    d = Path(c["data_dir"]).expanduser()
    return TokenFile(d if d.is_absolute() else Path(__file__).parent / d, int(c["block_size"]), c["vocab_size"])


def make_torch_model(cfg: dict[str, Any], vocab_size: int):
    from shakespeare_char import make_torch_model as gpt  # beside this file (the task's directory is on sys.path)

    return gpt({k: v for k, v in _config(cfg).items() if k in MODEL_KEYS}, vocab_size)


def loss(model, batch: dict[str, Any]):
    t = batch["tokens"].long()
    return model(t[:, :-1], t[:, 1:])
