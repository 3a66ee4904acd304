"""Initial weights that live on one machine (the coordinator's): a safetensors file, or a
`save_pretrained` directory (its *.safetensors files), read into one flat float32 θ₀ that
nodes fetch over drift-state/0 and place by name into their own layout (see node.py).

Only floating-point tensors count (a BatchNorm's integer step counter is not θ). The tensors lie
in θ₀ sorted by name; the outer state served with them is zeros (a fresh start).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from drift.diloco import ParamLayout


class WeightsError(ValueError):
    """Weights that cannot be used; str() names the file and what is wrong."""


def weight_files(path: Path) -> list[Path]:
    """The safetensors file(s) at path: the file itself, or a directory's *.safetensors."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files
        raise WeightsError(f"{path}: no *.safetensors file in this directory")
    raise WeightsError(f"{path}: no such file or directory")


def load_weights(path: Path) -> tuple[ParamLayout, np.ndarray]:
    """(layout, θ₀) of the floating-point tensors at path."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, np.ndarray] = {}
    for f in weight_files(path):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not iterable
                    t = st.get_tensor(name)
                    if not t.is_floating_point():
                        continue
                    if name in tensors:
                        raise WeightsError(f"{f}: tensor {name} is also in another file")
                    tensors[name] = t.float().contiguous().numpy()
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"{f}: not a safetensors file ({str(e).splitlines()[0]})") from None
    if not tensors:
        raise WeightsError(f"{path}: no floating-point tensors")
    layout = ParamLayout.of(tensors)
    return layout, layout.flatten(tensors)


def placement(sent: ParamLayout, mine: ParamLayout) -> str | list[tuple[int, int, int]]:
    """Where each tensor of `sent` goes in `mine`: (source byte start, byte length, destination
    byte start) in source order; or, when the names or shapes differ, what differs (one line)."""
    missing = sorted(set(mine.names) - set(sent.names))
    unexpected = sorted(set(sent.names) - set(mine.names))
    if missing or unexpected:
        parts = [f"{len(missing)} missing (e.g. {missing[0]})"] if missing else []
        parts += [f"{len(unexpected)} not in the model (e.g. {unexpected[0]})"] if unexpected else []
        return "tensor names differ from the model's trainable state: " + ", ".join(parts)
    where = {name: (sl.start * 4, shape) for name, sl, shape in mine.slices()}
    out = []
    for name, sl, shape in sent.slices():
        dst, want = where[name]
        if shape != want:
            return f"tensor {name} has shape {list(shape)}, the model's {list(want)}"
        out.append((sl.start * 4, (sl.stop - sl.start) * 4, dst))
    return out
