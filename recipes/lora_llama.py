"""LoRA fine-tuning of a small Llama (HuggingFace transformers + peft) on Shakespeare's bytes.

The base model is built from a LlamaConfig, so nothing is downloaded; peft wraps it with LoRA
adapters (rank 8 on the attention's q and v projections by default) and freezes everything else.
drift's θ is the trainable state only: the swarm sends, averages, transfers and checkpoints the
adapters, and checks once at join that every node built the same frozen base. With the defaults
(4 layers, 512 wide): 17.1M parameters, of which 65,536 train.

A real fine-tune ships its base from one machine: `init_weights: path/to/base` in the recipe (a
save_pretrained directory of the Llama, on the coordinator only); every node fetches it once,
verified, into this model's frozen parameters. Or each node loads it itself with
`LlamaForCausalLM.from_pretrained(...)` in make_model; the frozen-base digest checks at join that
they all did the same.

    make_dataset(cfg) -> ByteDataset     # batch(split, indices) -> {"input_ids", "labels"}
    make_model(cfg) -> PeftModel         # model(**batch).loss: the default loss
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from gpt2_shakespeare import VOCAB_SIZE, ByteDataset
from shakespeare_char import load_text

if TYPE_CHECKING:
    import torch

DEFAULTS: dict[str, Any] = {
    "block_size": 64,  # bytes of context per sample
    "n_layer": 4,
    "n_head": 8,
    "n_embd": 512,
    "intermediate": 2048,  # the MLP's width
    "lora_r": 8,  # 0: no adapters, every parameter trains (the full fine-tune of the same model)
    "lora_alpha": 16,
    "lora_targets": ["q_proj", "v_proj"],
}


def _config(cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg merged over DEFAULTS; an unknown key (a typo in a recipe) is a ValueError."""
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"lora_llama: unknown task_config key(s) {unknown}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **cfg}


def make_dataset(cfg: dict[str, Any]) -> ByteDataset:
    """Shakespeare's plays as bytes, in windows of cfg['block_size']."""
    return ByteDataset(load_text().encode("utf-8"), block_size=int(_config(cfg)["block_size"]))


def make_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """A LlamaForCausalLM from a config (initialised from torch's RNG), with LoRA adapters
    (none when lora_r is 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    c = _config(cfg)
    base = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=int(c["n_embd"]),
            intermediate_size=int(c["intermediate"]),
            num_hidden_layers=int(c["n_layer"]),
            num_attention_heads=int(c["n_head"]),
            num_key_value_heads=int(c["n_head"]),
            max_position_embeddings=int(c["block_size"]),
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
        )
    )
    base.loss_type = "ForCausalLM"
    if int(c["lora_r"]) == 0:
        return base
    lora = LoraConfig(
        r=int(c["lora_r"]),
        lora_alpha=int(c["lora_alpha"]),
        target_modules=list(c["lora_targets"]),
        lora_dropout=0.0,
        bias="none",
    )
    with warnings.catch_warnings():  # peft calls a transformers method that transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(base, lora)
