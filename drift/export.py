"""`drift export RUN_DIR [--out DIR] [--merge]`: a run's newest checkpoint as files any PyTorch or
Hugging Face user loads without drift: `model.safetensors` (the model's state dict); for a
Hugging Face model a `save_pretrained` folder as well, a peft adapter for a LoRA model (its base
merged in with --merge)."""

from __future__ import annotations

from pathlib import Path

from drift.sample import SampleError, load_model


def export(run_dir: Path, out: Path, repo: Path, merge: bool = False) -> list[str]:
    """Write the files into `out`; their names. Raises SampleError (one line) when there is nothing to export."""
    from safetensors.torch import save_model

    _, model, ck = load_model(run_dir, repo)
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "peft_config") and merge:
        model = model.merge_and_unload()
    elif merge:
        raise SampleError(f"{ck.path}: --merge is for LoRA (peft) models, and this one has no adapter")
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(out)  # safetensors; peft: adapter_model.safetensors + adapter_config.json
    if not (out / "model.safetensors").exists():
        save_model(model, str(out / "model.safetensors"))  # tied weights once (safetensors refuses shared storage)
    return sorted(p.name for p in out.iterdir())
