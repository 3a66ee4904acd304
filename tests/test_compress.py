"""Codecs: exact sizes, deterministic decoding, bounded error, refusal of malformed payloads."""

from __future__ import annotations

import numpy as np
import pytest

from drift.compress import CODECS, CodecError, Int8Block, TopK, make_codec, relative_error
from drift.workers.torch_codec import TorchCodecKernels, codec_kernels

ALL = list(CODECS)


def _x(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 1e-3).astype(np.float32)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 100_003])
def test_payload_size_is_exact_and_roundtrip_decodes(name: str, n: int) -> None:
    c = make_codec(name)
    x = _x(n)
    p = c.encode(x)
    assert p.dtype == np.uint8 and p.size == c.encoded_nbytes(n)
    out = np.full(n, 7.0, np.float32)
    c.decode(p.tobytes(), out)  # from plain bytes, as received off the wire
    acc = np.ones(n, np.float32)
    c.decode_add(p.tobytes(), acc)
    np.testing.assert_array_equal(acc, np.float32(1) + out)
    if n and name != "topk":
        assert relative_error(out, x) < {"fp32": 1e-9, "fp16": 1e-3, "bf16": 5e-3, "int8": 1e-2}[name]


@pytest.mark.parametrize("name", ALL)
def test_encode_into_preallocated_buffer(name: str) -> None:
    c = make_codec(name)
    x = _x(5000)
    buf = np.zeros(c.encoded_nbytes(5000) + 64, np.uint8)
    p = c.encode(x, out=buf)
    assert np.shares_memory(p, buf)
    assert p.tobytes() == make_codec(name).encode(x).tobytes()


@pytest.mark.parametrize("name", ["int8", "topk"])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 100_003])
def test_device_kernels_give_the_same_payload_and_values(name: str, n: int) -> None:
    """The arithmetic a GPU worker runs on its device (workers/torch_codec.py, here on torch's
    CPU) encodes to the same bytes as numpy and decodes to the same float32 values."""
    x = _x(n, seed=n)
    x[n // 2] = 0.0  # (and an all-zero block's scale is 0, not NaN)
    if n > 512:
        x[256:512] = 0.0
    host, dev = (
        make_codec(name, topk_fraction=0.05),
        make_codec(name, topk_fraction=0.05, kernels=TorchCodecKernels("cpu")),
    )
    p = dev.encode(x)
    assert p.tobytes() == host.encode(x).tobytes()
    a, b = np.empty(n, np.float32), np.empty(n, np.float32)
    assert dev.decode(p.tobytes(), a).tobytes() == host.decode(p.tobytes(), b).tobytes()


def test_only_a_cuda_worker_hands_the_codec_to_its_device() -> None:
    """ROCm builds call AMD GPUs "cuda" too; on the CPU numpy is the faster path (bench_codec.py)."""
    assert codec_kernels("cpu") is None and codec_kernels("mps") is None
    k = codec_kernels("cuda:1")
    assert isinstance(k, TorchCodecKernels) and str(k.device) == "cuda:1"


def test_bf16_rounds_to_nearest_even_like_torch() -> None:
    import torch

    x = np.concatenate([_x(10_000), np.array([1.0, -2.5, 3.4e38, 1e-40, 0.0, -0.0], np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    c = make_codec("bf16")
    got = c.decode(c.encode(x), np.empty_like(x))
    assert got.tobytes() == want.tobytes()
    nan = c.decode(c.encode(np.array([np.nan], np.float32)), np.empty(1, np.float32))
    assert np.isnan(nan).all()


def test_fp16_clips_instead_of_overflowing() -> None:
    c = make_codec("fp16")
    out = c.decode(c.encode(np.array([1e6, -1e6], np.float32)), np.empty(2, np.float32))
    assert np.isfinite(out).all() and out[0] == 65504


def test_int8_blocks_have_their_own_scale() -> None:
    """A large value in one block must not wipe out the small values of the next."""
    c = Int8Block(block=4)
    x = np.array([1000, 1, 1, 1, 0.001, 0.002, -0.003, 0.004, 0.5], np.float32)
    out = c.decode(c.encode(x), np.empty_like(x))
    np.testing.assert_allclose(out[4:8], x[4:8], rtol=0.01)
    assert out[8] == np.float32(0.5)
    assert c.encoded_nbytes(9) == 9 + 3 * 4


def test_topk_keeps_the_largest_magnitudes() -> None:
    x = _x(10_000) * np.float32(1000)  # ~N(0, 1): the 10 largest are all within 2x of each other
    x[[3, 500, 9999]] = [5.0, -6.0, 7.0]
    c = TopK(fraction=0.001)  # k = 10
    out = c.decode(c.encode(x), np.empty_like(x))
    assert np.count_nonzero(out) == 10
    kept = np.flatnonzero(out)
    assert set(np.argsort(-np.abs(x))[:10]) == set(kept)
    np.testing.assert_allclose(out[[3, 500, 9999]], [5.0, -6.0, 7.0], rtol=0.01)


def test_decoding_is_deterministic_bytes_to_bytes() -> None:
    """Two decoders (two nodes) given the same payload produce the same bits."""
    x = _x(70_000, seed=3)
    for name in ALL:
        p = make_codec(name).encode(x).tobytes()
        a = make_codec(name).decode(p, np.empty_like(x))
        b = make_codec(name).decode(p, np.empty_like(x))
        assert a.tobytes() == b.tobytes()


def test_unknown_codec_lists_valid_ones() -> None:
    with pytest.raises(CodecError) as e:
        make_codec("int4")
    for name in ALL:
        assert name in str(e.value)


@pytest.mark.parametrize("name", ALL)
def test_wrong_payload_size_is_refused(name: str) -> None:
    c = make_codec(name)
    p = c.encode(_x(1000)).tobytes()
    with pytest.raises(CodecError, match="bytes"):
        c.decode(p[:-1], np.empty(1000, np.float32))
    with pytest.raises(CodecError):
        c.decode(p, np.empty(500, np.float32))


def test_topk_refuses_out_of_range_or_repeated_indices() -> None:
    c = TopK(fraction=0.01)
    p = bytearray(c.encode(_x(1000)).tobytes())
    bad = bytearray(p)
    bad[0:4] = (5000).to_bytes(4, "little")  # first index beyond the chunk... and out of order
    with pytest.raises(CodecError):
        c.decode(bytes(bad), np.empty(1000, np.float32))
    dup = bytearray(p)
    dup[4:8] = dup[0:4]
    with pytest.raises(CodecError):
        c.decode(bytes(dup), np.empty(1000, np.float32))


def test_bad_options_are_refused() -> None:
    with pytest.raises(CodecError):
        make_codec("topk", topk_fraction=0)
    with pytest.raises(CodecError):
        make_codec("int8", block=0)


def test_unknown_codec_in_recipe_is_a_clear_error(tmp_path) -> None:
    import yaml

    from drift.recipe import RecipeError, load_recipe

    p = tmp_path / "r.yaml"
    p.write_text(
        yaml.safe_dump({"name": "x", "task": "t.py", "rounds": 1, "inner_steps": 1, "batch_size": 1, "codec": "int4"})
    )
    with pytest.raises(RecipeError) as e:
        load_recipe(p, check_task=False)
    assert "codec" in str(e.value)
    for name in ALL:  # every codec the ring knows is offered, and no other
        assert repr(name) in str(e.value)
    p.write_text(
        yaml.safe_dump(
            {
                "name": "x",
                "task": "t.py",
                "rounds": 1,
                "inner_steps": 1,
                "batch_size": 1,
                "codec": "topk",
                "topk_fraction": 0.05,
            }
        )
    )
    r = load_recipe(p, check_task=False)
    assert make_codec(r.codec, topk_fraction=r.topk_fraction).encoded_nbytes(1000) == TopK(0.05).encoded_nbytes(1000)
