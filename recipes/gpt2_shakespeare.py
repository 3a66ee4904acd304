"""A GPT-2-small-class model (HuggingFace transformers) on Shakespeare's plays, one byte a token.

The model is built from a GPT2Config, so nothing is downloaded: GPT2LMHeadModel(GPT2Config(...)),
12 layers, 768 wide, 12 heads, 1024 positions by default. With a byte vocabulary (256 tokens
instead of GPT-2's 50257) it has 86.0M parameters rather than 124M: the difference is the token
embedding. The text is the default task's (shakespeare_char.load_text(), imported as a sibling
module: load_task puts this file's directory on sys.path), UTF-8 encoded.

    make_dataset(cfg) -> ByteDataset       # batch(split, indices) -> {"input_ids", "labels"}
    make_model(cfg) -> GPT2LMHeadModel     # model(**batch).loss: the default loss (HF convention)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from shakespeare_char import load_text, window_starts

if TYPE_CHECKING:
    import torch

DEFAULTS: dict[str, Any] = {
    "block_size": 1024,  # bytes of context per sample (GPT-2's n_positions)
    "n_layer": 12,
    "n_head": 12,
    "n_embd": 768,
    "dropout": 0.0,
}
VOCAB_SIZE = 256
VAL_FRACTION = 0.1


def _config(cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg merged over DEFAULTS; an unknown key (a typo in a recipe) is a ValueError."""
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"gpt2_shakespeare: unknown task_config key(s) {unknown}; known: {sorted(DEFAULTS)}")
    c = {**DEFAULTS, **cfg}
    if int(c["n_embd"]) % int(c["n_head"]):
        raise ValueError(f"gpt2_shakespeare: n_embd ({c['n_embd']}) must be divisible by n_head ({c['n_head']})")
    return c


class ByteDataset:
    """The text as UTF-8 bytes, train = first 90 %, val = last 10 %.

    Sample i of a split is the window bytes[i*block_size : (i+1)*block_size]; the model shifts the
    labels itself, so each window trains block_size - 1 next-byte predictions.
    """

    def __init__(self, data: bytes, block_size: int) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        tokens = np.frombuffer(data, dtype=np.uint8)
        n = int(len(tokens) * (1 - VAL_FRACTION))
        self.block_size = block_size
        self.vocab_size = VOCAB_SIZE
        self._splits = {"train": tokens[:n], "val": tokens[n:]}
        self.n_train: int = n // block_size
        self.n_val: int = (len(tokens) - n) // block_size

    def batch(self, split: str, indices: np.ndarray) -> dict[str, np.ndarray]:
        """{"input_ids": int64 (B, block_size), "labels": the same array} for these windows."""
        starts = window_starts(self, split, indices)
        ids = self._splits[split][starts[:, None] + np.arange(self.block_size)].astype(np.int64)
        return {"input_ids": ids, "labels": ids}


def make_dataset(cfg: dict[str, Any]) -> ByteDataset:
    """Shakespeare's plays as bytes, in windows of cfg['block_size'] (default 1024)."""
    return ByteDataset(load_text().encode("utf-8"), block_size=int(_config(cfg)["block_size"]))


def make_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """GPT2LMHeadModel with a byte vocabulary, initialised by transformers (from torch's RNG)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = _config(cfg)
    p = float(c["dropout"])
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=int(c["block_size"]),
        n_embd=int(c["n_embd"]),
        n_layer=int(c["n_layer"]),
        n_head=int(c["n_head"]),
        resid_pdrop=p,
        embd_pdrop=p,
        attn_pdrop=p,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,  # training only: no key/value cache in the outputs
    )
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # what transformers falls back to for this class, named so it does not warn
    return model
