"""`drift export RUN_DIR [--out DIR] [--merge]`: a run's newest checkpoint as files any PyTorch or
Hugging Face user loads without drift: `model.safetensors` (the model's state dict); for a
Hugging Face model a `save_pretrained` folder as well, a peft adapter for a LoRA model (its base
merged in with --merge)."""

from __future__ import annotations

from pathlib import Path

from drift.sample import SampleError, load_model


def export(run_dir: Path, out: Path, repo: Path, merge: bool = False) -> list[str]:
    """Write the files into `out` (a new folder, renamed into place once complete); their names.
    Raises SampleError (one line) when there is nothing to export or `out` is taken."""
    import shutil
    import tempfile

    from safetensors.torch import save_model

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SampleError(f"{out} exists and is not empty: give another --out")
    _, model, ck = load_model(run_dir, repo)
    if hasattr(model, "peft_config") and merge:
        model = model.merge_and_unload()
    elif merge:
        raise SampleError(f"{ck.path}: --merge is for LoRA (peft) models, and this one has no adapter")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(tmp)  # safetensors; peft: adapter_model.safetensors + adapter_config.json
        if not (tmp / "model.safetensors").exists():
            save_model(model, str(tmp / "model.safetensors"))  # tied weights once (shared storage is refused)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(p.name for p in out.iterdir())
