"""recipe init_weights from one machine (drift/base.py), in process over real iroh: the manifest
and its digests, the check against the model before any tensor moves, a holder's corrupted bytes
refused, and a node's cache that makes a second fetch free."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, run_async
from safetensors.torch import save_file

from drift import protocol as P
from drift.base import (
    BaseCache,
    BaseError,
    BaseServer,
    Manifest,
    Misfit,
    as_float32,
    fetch_base,
    fit,
    model_state,
    read_weights,
    task_state,
)
from drift.transport import BASE_ALPN, Endpoint
from drift.workers import load_task

TINY_LORA = {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32, "intermediate": 64, "lora_r": 4}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "half": torch.randn(5, generator=g).half(),
        "brain": torch.randn(2, 3, generator=g).bfloat16(),
        "steps": torch.arange(3),  # not floating: not a weight
    }


def _file(tmp_path: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    f = tmp_path / "weights" / "model.safetensors"
    f.parent.mkdir(exist_ok=True)
    save_file(tensors or _tensors(), str(f))
    return f


def test_the_manifest_digests_every_floating_tensor_as_stored(tmp_path: Path) -> None:
    tensors = _tensors()
    stored = read_weights(_file(tmp_path, tensors))
    m = Manifest(tuple(s.tensor for s in stored))
    assert [t.name for t in m.tensors] == ["brain", "half", "w"]
    assert {t.name: t.dtype for t in m.tensors} == {"brain": "BF16", "half": "F16", "w": "F32"}
    assert m.size == 2 * 6 + 2 * 5 + 4 * 12  # as stored: bfloat16 stays 2 bytes a value
    assert Manifest.decode(m.encode()) == m and m.root == Manifest.decode(m.encode()).root
    for s in stored:
        with open(s.file, "rb") as fh:
            fh.seek(s.offset)
            data = fh.read(s.tensor.size)
        assert np.array_equal(as_float32(s.tensor, data), tensors[s.tensor.name].float().numpy())
        assert s.tensor.digest == hashlib.blake2b(data, digest_size=16).hexdigest()  # of the bytes as stored
    # another value anywhere is another root
    other = Manifest(tuple(s.tensor for s in read_weights(_file(tmp_path, {**tensors, "w": tensors["w"] + 1}))))
    assert other.root != m.root
    with pytest.raises(BaseError, match="malformed"):
        Manifest.decode(b'{"tensors": [["w", "F32", [3, -4], "00"]]}')


def _lora_shapes(**cfg) -> tuple[dict, dict]:
    torch.manual_seed(0)
    return model_state(load_task(ROOT / "recipes" / "lora_llama.py").make_model({**TINY_LORA, **cfg}))


def test_a_save_pretrained_base_is_the_frozen_part_of_a_peft_model(tmp_path: Path) -> None:
    torch.manual_seed(1)
    load_task(ROOT / "recipes" / "lora_llama.py").make_model({**TINY_LORA, "lora_r": 0}).save_pretrained(tmp_path / "b")
    m = Manifest(tuple(s.tensor for s in read_weights(tmp_path / "b")))
    theta, frozen = _lora_shapes()
    plan = fit(m.tensors, theta, frozen)
    assert sorted(p.name for p in plan) == sorted(frozen) and not any(p.theta for p in plan)  # adapters: the seed's
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in {p.name for p in plan}
    # the same file is the whole trainable state of the full fine-tune (lora_r 0): a pretrained start
    theta0, frozen0 = _lora_shapes(lora_r=0)
    assert not frozen0 and sorted(p.name for p in fit(m.tensors, theta0, frozen0) if p.theta) == sorted(theta0)
    # the coordinator builds the task's model with no storage and finds the same shapes
    assert task_state(load_task(ROOT / "recipes" / "lora_llama.py"), TINY_LORA) == (theta, frozen)


def test_weights_that_do_not_fit_name_the_file_and_the_tensor(tmp_path: Path) -> None:
    theta, frozen = {"a": (2,)}, {"w": (3, 4), "half": (5,), "brain": (2, 3)}
    m = Manifest(tuple(s.tensor for s in read_weights(_file(tmp_path))))
    assert len(fit(m.tensors, theta, frozen)) == 3
    with pytest.raises(Misfit, match=r"tensor w has shape \[3, 4\], the model's w \[4, 3\]"):
        fit(m.tensors, theta, {**frozen, "w": (4, 3)})
    with pytest.raises(Misfit, match="tensor brain is not in the model"):
        fit(m.tensors, theta, {"w": (3, 4), "half": (5,)})
    with pytest.raises(Misfit, match="holds 3 of the model's 4 frozen tensors; more is missing"):
        fit(m.tensors, theta, {**frozen, "more": (1,)})
    f = tmp_path / "weights" / "model.safetensors"
    with pytest.raises(Misfit, match=rf"^{f}: tensor w has shape \[3, 4\], the model's w \[4, 3\]$"):
        BaseServer.open(f, (theta, {**frozen, "w": (4, 3)}), allowed=lambda peer: True)
    with pytest.raises(BaseError, match="no such file"):
        read_weights(tmp_path / "nothing")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(BaseError, match="not a safetensors file"):
        read_weights(tmp_path / "bad.safetensors")


def test_a_save_pretrained_directory_with_tied_weights_is_read_by_name(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    model.save_pretrained(tmp_path / "tiny")
    stored = read_weights(tmp_path / "tiny")
    theta, frozen = model_state(model)
    plan = fit(tuple(s.tensor for s in stored), theta, frozen)
    assert sorted(p.name for p in plan) == sorted(theta) and all(p.theta for p in plan)  # tied lm_head: once
    params = dict(model.named_parameters())
    for p in plan:
        s = stored[p.index]
        with open(s.file, "rb") as fh:
            fh.seek(s.offset)
            assert np.array_equal(as_float32(s.tensor, fh.read(s.tensor.size)), params[p.name].detach().numpy())


def _serve(server: BaseServer, cache: Path, check=lambda m: None, root: str | None = None):
    """fetch_base by a member over real iroh: (Fetched or the BaseError, tensor bytes the holder sent)."""

    async def main():
        ep = await Endpoint.bind("local", alpns=(BASE_ALPN,))
        serving = asyncio.ensure_future(ep.serve({BASE_ALPN: server.handle}))
        client = await Endpoint.bind("local")
        server.allowed = lambda peer: peer == client.node_id
        src = P.BaseSource(root=root or server.root, size=server.manifest.size, tickets=[ep.ticket()])
        try:
            return await fetch_base(client, src, BaseCache(cache), check)
        except BaseError as e:
            return e
        finally:
            serving.cancel()
            await client.close()
            await ep.close()

    return run_async(main()), server.sent


def test_a_node_fetches_each_tensor_once_verified_and_cached(tmp_path: Path) -> None:
    f = _file(tmp_path)
    cache = tmp_path / "home" / "base"
    got, sent = _serve(BaseServer.open(f, None, lambda peer: False), cache)
    assert (got.cached, got.fetched, got.bytes) == (0, 3, got.manifest.size) and sent == got.manifest.size
    for t in got.manifest.tensors:  # content-addressed: each tensor under its digest, as stored
        s = next(s for s in read_weights(f) if s.tensor.name == t.name)
        with open(f, "rb") as fh:
            fh.seek(s.offset)
            assert (cache / t.digest).read_bytes() == fh.read(t.size)
    assert (cache / got.manifest.root).is_file() and not list(cache.glob(".*"))  # no temporary file left
    again, sent = _serve(BaseServer.open(f, None, lambda peer: False), cache)
    assert (again.cached, again.fetched, again.bytes, sent) == (3, 0, 0, 0)  # a second run fetches nothing


def test_a_corrupted_tensor_from_the_holder_is_refused(tmp_path: Path) -> None:
    f = _file(tmp_path)
    server = BaseServer.open(f, None, lambda peer: False)  # digested here: the manifest is the file's
    w = next(s for s in server.stored if s.tensor.name == "w")
    data = bytearray(f.read_bytes())
    data[w.offset + 5] ^= 0x01  # then the holder's disk (or the holder) flips one bit of w
    f.write_bytes(bytes(data))
    cache = tmp_path / "home" / "base"
    got, _ = _serve(server, cache)
    assert isinstance(got, BaseError)
    assert (
        str(got)
        == f"init_weights from the coordinator: tensor w: its bytes do not match the manifest's digest {w.tensor.digest[:12]}; refused"
    )
    assert not (cache / w.tensor.digest).exists() and not list(cache.glob(".*"))


def test_a_misfit_is_refused_before_any_tensor_moves(tmp_path: Path) -> None:
    server = BaseServer.open(_file(tmp_path), None, lambda peer: False)

    def check(m: Manifest) -> None:
        fit(m.tensors, {}, {"w": (4, 3), "half": (5,), "brain": (2, 3)})

    got, sent = _serve(server, tmp_path / "base", check)
    assert isinstance(got, Misfit) and "tensor w has shape [3, 4]" in str(got)
    assert sent == 0


def test_a_manifest_other_than_the_announced_one_is_refused(tmp_path: Path) -> None:
    got, sent = _serve(BaseServer.open(_file(tmp_path), None, lambda peer: False), tmp_path / "base", root="ab" * 16)
    assert isinstance(got, BaseError) and "not the one the coordinator announced" in str(got)
    assert sent == 0
