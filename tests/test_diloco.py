"""The algorithm without the network: outer step, flattening, work units."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from drift.diloco import (
    PIECE_BYTES,
    NesterovOuter,
    ParamLayout,
    checksum,
    checksum_of,
    epoch_order,
    piece_digest,
    piece_spans,
    pieces_of,
    root_of,
    unit_indices,
    weighted_delta,
)
from drift.protocol import WorkUnit
from drift.scheduler import UnitQueue, split_proportional


def test_outer_step_matches_torch_nesterov_sgd() -> None:
    rng = np.random.default_rng(0)
    theta = rng.standard_normal(1000).astype(np.float32)
    ref = torch.nn.Parameter(torch.from_numpy(theta.copy()))
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    outer = NesterovOuter(theta.size, lr=0.7, momentum=0.9)
    for _ in range(5):
        g = rng.standard_normal(1000).astype(np.float32)
        ref.grad = torch.from_numpy(g.copy())
        opt.step()
        outer.step(theta, g)
    np.testing.assert_allclose(theta, ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_outer_step_without_momentum_is_sgd_and_leaves_the_velocity_zero() -> None:
    """Momentum 0 (the Shakespeare recipe's outer step): θ -= lr·Δ as torch's SGD does, and the
    velocity is never written (zeros, so a node does not pay memory for it)."""
    rng = np.random.default_rng(1)
    theta = rng.standard_normal(3000).astype(np.float32)
    ref = torch.nn.Parameter(torch.from_numpy(theta.copy()))
    opt = torch.optim.SGD([ref], lr=1.3, momentum=0.0)
    outer = NesterovOuter(theta.size, lr=1.3, momentum=0.0, params=2000)
    for _ in range(3):
        g = rng.standard_normal(3000).astype(np.float32)
        ref.grad = torch.from_numpy(np.concatenate([g[:2000], np.zeros(1000, np.float32)]))
        before = theta[2000:].copy()
        opt.step()
        outer.step(theta, g.copy())
        np.testing.assert_array_equal(theta[2000:], before - g[2000:])  # buffers: the plain average
    np.testing.assert_allclose(theta[:2000], ref.detach().numpy()[:2000], rtol=1e-5, atol=1e-6)
    assert not outer.velocity.any()


def test_layout_round_trip_and_errors() -> None:
    params = {"b": np.ones((2, 3), np.float32), "a": np.arange(4, dtype=np.float32)}
    layout = ParamLayout.of(params)
    flat = layout.flatten(params)
    assert flat.tolist()[:4] == [0, 1, 2, 3] and flat.size == 10
    back = layout.unflatten(flat)
    assert all(np.array_equal(back[k], params[k]) for k in params)
    bad = dict(params, b=np.ones((3, 2), np.float32))
    try:
        layout.flatten(bad)
    except ValueError as e:
        assert "parameter b" in str(e)
    else:
        raise AssertionError("shape mismatch accepted")


def test_layout_from_shapes_is_the_layout_of_the_tensors() -> None:
    """A node learns θ's layout from shapes alone: the same names, order, digest and buffer split
    (so its checksum and what peers match against are unchanged)."""
    params = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32)}
    buffers = {"bn.mean": np.zeros(2, np.float32)}
    shaped = ParamLayout.of_shapes({k: v.shape for k, v in params.items()}, {k: v.shape for k, v in buffers.items()})
    assert shaped == ParamLayout.of(params, buffers)
    assert shaped.digest() == ParamLayout.of(params, buffers).digest() and shaped.params_size == 9
    try:
        ParamLayout.of_shapes({"x": (1,)}, {"x": (1,)})
    except ValueError as e:
        assert "both a parameter and a buffer" in str(e)
    else:
        raise AssertionError("a name both parameter and buffer accepted")


def test_weighted_delta_and_checksum() -> None:
    g, loc = np.full(4, 2.0, np.float32), np.full(4, 1.5, np.float32)
    assert weighted_delta(g, loc, 0.5).tolist() == [0.25] * 4
    assert checksum(g) == checksum(g.copy()) != checksum(loc)


def test_units_tile_the_epoch_exactly_once() -> None:
    n, per = 1000, 64
    order = epoch_order(n, seed=3, epoch=0)
    assert np.array_equal(order, epoch_order(n, seed=3, epoch=0))
    assert not np.array_equal(order, epoch_order(n, seed=3, epoch=1))
    q = UnitQueue(n, per)
    seen: list[WorkUnit] = []
    epoch, units = q.take(5 * per)
    assert len(units) == 5
    cut = units[3]
    seen += [*units[:3], WorkUnit(id=cut.id, lo=0, hi=20)]  # unit 3 stopped after 20 samples
    q.give_back([WorkUnit(id=cut.id, lo=20, hi=per), units[4]])
    e, units = q.take(per)
    assert e == epoch and units[0] == WorkUnit(id=cut.id, lo=20, hi=per)  # the tail comes first
    seen += units
    while True:  # a round does not stop short at the epoch's end: its budget continues in the next
        _, units = q.take(4 * per)
        seen += [u for u in units if u.epoch == epoch]
        if any(u.epoch != epoch for u in units):
            assert sum(u.hi - u.lo for u in units) >= 4 * per and units[-1].epoch == epoch + 1
            break
    samples = np.concatenate([unit_indices(order, u, per) for u in seen])
    assert sorted({u.id for u in seen}) == list(range(q.units_per_epoch))
    assert np.array_equal(np.sort(samples), np.arange(n))  # every sample once, none twice


def test_split_proportional() -> None:
    units = list(range(10))
    shares = split_proportional(units, [1.0, 0.5, 0.25, 0.25])
    assert [len(s) for s in shares] == [5, 3, 1, 1]  # 5, 2.5, 1.25, 1.25: largest remainder wins
    assert [u for share in shares for u in share] == units
    assert [len(s) for s in split_proportional(units, [1, 1, 1])] == [4, 3, 3]


def test_delta_check_refuses_an_absurdly_large_pseudo_gradient() -> None:
    """A Δ far larger per inner step than this node's recent ones (a blown-up step, a bad GPU) is
    reported instead of sent; a large Δ from proportionally more steps, or a merely 50x larger
    one, goes through; and before three rounds of history nothing is judged by size."""
    from drift.diloco import DeltaCheck

    rng = np.random.default_rng(0)
    base = rng.standard_normal(10_000).astype(np.float32)
    check = DeltaCheck(factor=100.0)
    assert check.problem(base * 1e6, steps=10) is None  # no history yet: nothing to compare with
    check = DeltaCheck(factor=100.0)
    for steps in (10, 20, 5):
        assert check.problem(base * steps, steps=steps) is None  # the same size per step
    assert check.problem(base * 1000, steps=1000) is None  # 1000 steps: 1000x the Δ is fine
    assert check.problem(base * 50 * 10, steps=10) is None  # 50x per step: within the factor
    problem = check.problem(base * 1000 * 10, steps=10)
    assert problem is not None and "1000x larger per step than its recent ones" in problem, problem
    assert check.problem(np.full(4, np.nan, np.float32), steps=1) == "its pseudo-gradient has NaN or Inf values"


def test_the_checksum_is_the_root_of_the_pieces_however_the_bytes_come() -> None:
    """Each array is cut into PIECE_BYTES pieces (the last one short); the checksum is the root of
    their digests in order, the same whether the arrays come whole or in uneven blocks, and the
    digests are remembered under it (what a state server hands a joiner)."""
    rng = np.random.default_rng(3)
    theta, velocity = (rng.standard_normal(1_300_000).astype(np.float32) for _ in range(2))  # 2 pieces each
    spans = piece_spans(theta.nbytes, 2)
    assert [n for _, _, n in spans] == [PIECE_BYTES, theta.nbytes - PIECE_BYTES] * 2
    raw = (theta.view(np.uint8), velocity.view(np.uint8))
    digests = [piece_digest(raw[w][o : o + n]) for w, o, n in spans]
    root = checksum(theta, velocity)
    assert root == root_of(digests) and pieces_of(root) == tuple(digests)
    cuts = (0, 12_345, 1_000_001, theta.size)
    blocks = [theta[a:b] for a, b in itertools.pairwise(cuts)]
    assert checksum_of([blocks, [velocity[:7], velocity[7:]]]) == root
    velocity[1_200_000] += 1  # one value of the velocity's second piece
    assert checksum(theta, velocity) != root
    assert pieces_of(checksum(theta, velocity))[:3] == tuple(digests[:3])
