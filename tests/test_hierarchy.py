"""The sparse rule's hierarchy (drift/hierarchy.py, SparseLoCo.merge), in milliseconds: every
member receives each sibling block's payload exactly once a level, its bytes stay bounded as the
swarm grows, and the round's update is the flat all-gather's less what stayed in the members'
error feedback, the same bits on every member. And the reduce-scatter (drift.hierarchy.segments,
SparseLoCo.piece / reduce / gathered): each segment's owner sums every member's piece of it, and
the round applies the flat all-gather's update to within the int8 sums' rounding, nothing left
waiting, at ~θ's int8 bytes a node whatever the swarm's size."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import run_async

from drift import hierarchy
from drift import protocol as P
from drift.diloco import ParamLayout, checksum
from drift.gather import Gather, signed_payload
from drift.recipe import Recipe
from drift.sync import make_rule
from drift.sync.sparse import PayloadError
from drift.transport import GATHER_ALPN, Endpoint
from harness.tree import hierarchical_round, node_id, scattered_round

LAYOUT = ParamLayout(("w",), ((12_000,),))
SPARSE = Recipe.model_validate(
    {
        "name": "x",
        "task": "t.py",
        "rounds": 1,
        "inner_steps": 1,
        "batch_size": 1,
        "sync": "sparse",
        # no clip: the sum is exact; one outer lr whatever the contributions (lr_growth 1), so a flat
        # sum of members and a top level's of blocks step alike
        "sync_params": {"chunk": 1024, "k": 16, "clip": 1e6, "outlier": 1e6, "lr_growth": 1.0},
    }
)


@pytest.mark.parametrize("n", [*range(1, 40), 64, 100, 255, 256, 257, 1000])
def test_each_member_receives_every_sibling_blocks_payload_once_from_a_member_of_it(n: int) -> None:
    levels = hierarchy.plan(n, fanout=8 if n < 40 else hierarchy.FANOUT)
    assert len(levels[-1].parents) == 1 and levels[-1].parents[0][0].start == 0  # the top holds everyone
    assert levels[-1].parents[0][-1].stop == n
    for level in levels:
        for m in range(n):
            children = level.children(m)
            sources = level.sources(m)
            assert [k for k, _ in sources] == list(range(len(children)))
            for (_, src), child in zip(sources, children):
                assert src in child  # every member of a block holds its payload
                assert src == m or m in level.targets(src)  # ... and the one named sends it to m
            assert sum(m in c for c in children) == 1


def test_per_member_bytes_stay_bounded_as_the_swarm_grows() -> None:
    # a node's payloads at 1,000 members within 2x of those at 16, at fanout 16 and at the default
    up16, down16 = hierarchy.transfers(16, 16)
    assert (up16, down16) == (15, 15) == hierarchy.transfers(16)  # at most `fanout` members: flat
    for fanout in (16, hierarchy.FANOUT):
        for n in (64, 256, 1000):
            up, down = hierarchy.transfers(n, fanout)
            if n > fanout:
                assert up <= 2 * up16 and down <= 2 * down16, (fanout, n, up, down)
    assert hierarchy.transfers(1000, 16) == (27, 27)  # 3 levels of 10, where flat moves 999 each way
    # the default (64): flat up to 64 members, then levels of at most 16 blocks (at 1,000 three
    # levels of 10, where two levels of 31 or 32 blocks would move 62 down and up to 69 up)
    assert [hierarchy.transfers(n) for n in (64, 65, 256, 1000)] == [(63, 63), (15, 15), (30, 30), (27, 27)]


def _deltas(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    common = rng.normal(0, 1e-3, LAYOUT.size).astype(np.float32)  # members' Δs overlap, as in training
    return [common + rng.normal(0, 1e-3, LAYOUT.size).astype(np.float32) for _ in range(n)]


def test_the_hierarchys_update_is_the_flat_one_less_what_stays_in_error_feedback() -> None:
    n, fanout = 12, 4  # 2 levels: 3 blocks of 4, then the 3 blocks
    assert hierarchy.shape(n, fanout) == (2, 4)
    weights = list(np.random.default_rng(3).dirichlet(np.ones(n)))
    deltas = _deltas(n, 1)

    flat = [make_rule(LAYOUT, SPARSE) for _ in range(n)]
    hier = [make_rule(LAYOUT, SPARSE) for _ in range(n)]
    hierarchical_round(flat, [d.copy() for d in deltas], weights, fanout=n)  # one level: flat
    found = hierarchical_round(hier, [d.copy() for d in deltas], weights, fanout=fanout)
    assert all(f.outliers == [] for f in found)

    theta0 = np.zeros(LAYOUT.size, np.float32)  # (θ of 0: the update itself, no rounding of θ + it)
    previews = {rule.preview(theta0) for rule in hier}
    assert len(previews) == 1  # every member lands on the same θ
    thetas = []
    for rules in (flat, hier):
        theta = theta0.copy()
        for i, rule in enumerate(rules):
            rule.apply(theta if i == 0 else theta0.copy())
        thetas.append(theta)
    assert checksum(thetas[1]) == previews.pop()
    lr = np.float32(flat[0].params.lr)
    update_flat, update_hier = ((theta0 - t) / lr for t in thetas)
    kept = sum(np.float64(w) * (h.ef - f.ef) for w, h, f in zip(weights, hier, flat))  # the merges' residuals
    assert np.linalg.norm(update_hier - update_flat) > 0.1 * np.linalg.norm(update_flat)  # re-encoding loses much...
    np.testing.assert_allclose(update_hier + kept, update_flat, atol=1e-5 * np.abs(update_flat).max())  # ... all kept


def test_the_members_of_a_block_agree_on_its_payload_and_a_zero_weight_member_keeps_nothing() -> None:
    n = 6
    weights = [0.2, 0.2, 0.0, 0.2, 0.2, 0.2]  # member 2 sat the round out
    rules = [make_rule(LAYOUT, SPARSE) for _ in range(n)]
    hierarchical_round(rules, _deltas(n, 2), weights, fanout=3)  # 2 blocks of 3
    theta = np.zeros(LAYOUT.size, np.float32)
    assert len({r.preview(theta) for r in rules}) == 1
    for r in rules:
        r.apply(np.zeros(LAYOUT.size, np.float32))
    assert rules[2].ef is None  # it sent nothing and keeps nothing for the others
    assert all(np.abs(r.ef).sum() > 0 for i, r in enumerate(rules) if i != 2)


def test_real_endpoints_gather_level_by_level_and_land_on_the_in_process_result() -> None:
    # 9 members, fanout 2: four levels (blocks of 2 or 1, then of about 2 blocks, ...). Every
    # node ends on the same θ, the one benchmarks/harness/tree.py computes, and reports what it
    # heard at each level, signed for that level.
    n, fanout = 9, 2
    assert hierarchy.shape(n, fanout) == (4, 2)
    weights = [0.1, 0.2, 0.1, 0.15, 0.15, 0.1, 0.05, 0.1, 0.05]
    deltas = _deltas(n, 5)
    params = {**SPARSE.sync_params, "fanout": fanout}
    recipe = SPARSE.model_copy(update={"sync_params": params})

    async def main():
        eps = [await Endpoint.bind("local") for _ in range(n)]
        gathers = [Gather(ep, timeout=10.0) for ep in eps]
        serving = [asyncio.ensure_future(ep.serve({GATHER_ALPN: g.handle_incoming})) for ep, g in zip(eps, gathers)]
        ring = [P.RingMember(node_id=ep.node_id, ticket=ep.ticket(), weight=w) for ep, w in zip(eps, weights)]
        rules = [make_rule(LAYOUT, recipe) for _ in range(n)]
        mine = [
            rule.contribute(d.copy(), w, 3) for rule, d, w in zip(rules, deltas, weights)
        ]  # (past the dense rounds)
        try:
            got = await asyncio.gather(
                *(
                    g.tree(p, ring, 3, rules[0].payload_nbytes, 1, 5.0, fanout, r.merge)
                    for g, p, r in zip(gathers, mine, rules)
                )
            )
            return rules, got
        finally:
            for s in serving:
                s.cancel()
            for ep in eps:
                await ep.close()

    rules, got = run_async(main(), 60)
    theta = np.zeros(LAYOUT.size, np.float32)
    previews = set()
    for rule, (result, members, stats, outliers) in zip(rules, got):
        assert len(result) == 2 and outliers == []  # the top joins two blocks
        assert rule.combine(result, members).outliers == []
        previews.add(rule.preview(theta))
        assert {h.level for h in stats.heard} <= {0, 1, 2, 3} and 3 in {h.level for h in stats.heard}
        for h in stats.heard:
            assert signed_payload(h.owner, 3, 1, h.digest, h.sig, h.level)
            assert not signed_payload(h.owner, 3, 1, h.digest, h.sig, h.level + 1)
    assert len(previews) == 1
    local = [make_rule(LAYOUT, recipe) for _ in range(n)]
    hierarchical_round(local, [d.copy() for d in deltas], weights, fanout)
    assert {r.preview(theta) for r in local} == previews


# The reduce-scatter: enough chunks that a dozen members each own a segment of several units.
WIDE = ParamLayout(("w",), ((100_000,),))
WIDE_SPARSE = SPARSE.model_copy(update={"sync_params": {**SPARSE.sync_params, "chunk": 512}})


def _wide_deltas(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    common = rng.normal(0, 1e-3, WIDE.size).astype(np.float32)
    return [common + rng.normal(0, 1e-3, WIDE.size).astype(np.float32) for _ in range(n)]


def _landed(rules: list, theta0: np.ndarray) -> np.ndarray:
    """θ0 after every member applies its round (member 0's θ returned)."""
    theta = theta0.copy()
    for i, rule in enumerate(rules):
        rule.apply(theta if i == 0 else theta0.copy())
    return theta


@pytest.mark.parametrize("chunks", [1, 7, 8, 9, 196, 1000, 244_141])
@pytest.mark.parametrize("n", [1, 2, 12, 25, 26, 64, 1000])
def test_the_segments_cover_every_chunk_once_in_order_on_unit_boundaries(chunks: int, n: int) -> None:
    segs = hierarchy.segments(chunks, n)
    assert len(segs) == n
    assert [c for s in segs for c in s] == list(range(chunks))
    assert all(s.start % hierarchy.UNIT == 0 for s in segs if s)
    units = [-(-len(s) // hierarchy.UNIT) for s in segs]
    assert max(units) - min(units) <= 1  # spread evenly


def test_a_payloads_piece_holds_exactly_its_segments_values() -> None:
    rule = make_rule(WIDE, WIDE_SPARSE)
    payload = rule.contribute(_wide_deltas(1, 4)[0], 1.0, 3)
    whole = np.zeros(WIDE.size, np.float32)
    for flat, vals in rule.codec.pieces(payload):
        whole[flat] = vals
    c = rule.codec.chunk
    for chunks in hierarchy.segments(rule.codec.m, 7):
        part = np.zeros(min(chunks.stop * c, WIDE.size) - chunks.start * c, np.float32)
        for flat, vals in rule.segment_codec(chunks).pieces(rule.piece(payload, chunks)):
            part[flat] = vals
        np.testing.assert_array_equal(part, whole[chunks.start * c : chunks.start * c + part.size])


@pytest.mark.parametrize("n", [3, 12, 30])
def test_the_scattered_update_is_the_flat_one_within_int8_and_nothing_waits(n: int) -> None:
    # Every payload reaches its segments' sums whole: the round applies what the flat all-gather
    # would, to within the int8 sums' rounding, and every member's error feedback is the flat
    # round's (the levels' hierarchy leaves much of it waiting there).
    weights = list(np.random.default_rng(3).dirichlet(np.ones(n)))
    deltas = _wide_deltas(n, 1)
    flat = [make_rule(WIDE, WIDE_SPARSE) for _ in range(n)]
    scattered = [make_rule(WIDE, WIDE_SPARSE) for _ in range(n)]
    hierarchical_round(flat, [d.copy() for d in deltas], weights, fanout=n)
    found = scattered_round(scattered, [d.copy() for d in deltas], weights)
    assert found and all(f == [] for f in found)
    theta0 = np.zeros(WIDE.size, np.float32)
    previews = {rule.preview(theta0) for rule in scattered}
    assert len(previews) == 1  # every member lands on the same θ
    update_flat = -_landed(flat, theta0)
    landed = _landed(scattered, theta0)
    assert checksum(landed) == previews.pop()
    # an int8 block's rounding is at most half a step of its largest value
    np.testing.assert_allclose(-landed, update_flat, rtol=0, atol=1.01 * np.abs(update_flat).max() / 254)
    assert np.linalg.norm(-landed - update_flat) < 0.02 * np.linalg.norm(update_flat)
    for f, s in zip(flat, scattered):
        np.testing.assert_array_equal(f.ef, s.ef)


def test_an_owner_clips_and_names_a_liar_in_its_segment() -> None:
    n, liar = 6, 2
    recipe = WIDE_SPARSE.model_copy(update={"sync_params": {"chunk": 512, "k": 16}})  # the clip's defaults
    deltas = _wide_deltas(n, 6)
    deltas[liar] *= 100
    honest = _wide_deltas(n, 6)
    rules = [make_rule(WIDE, recipe) for _ in range(n)]
    found = scattered_round(rules, deltas, [1 / n] * n)
    assert found and all(f == [node_id(liar)] for f in found)  # every owner names it
    fair = [make_rule(WIDE, recipe) for _ in range(n)]
    scattered_round(fair, honest, [1 / n] * n)
    theta0 = np.zeros(WIDE.size, np.float32)
    # what the liar sent added nothing: the others' update, less the liar's own honest share
    assert np.linalg.norm(_landed(rules, theta0)) < np.linalg.norm(_landed(fair, theta0))


def test_a_segment_sum_that_does_not_decode_is_refused() -> None:
    rule = make_rule(WIDE, WIDE_SPARSE)
    chunks = hierarchy.segments(rule.codec.m, 4)[1]
    good = rule.sums.encode(np.ones(rule.segment_codec(chunks).n, np.float32)).tobytes()
    with pytest.raises(PayloadError, match="bytes, expected"):
        rule.gathered([(chunks, good[:-1])], 4)
    bad_scale = np.frombuffer(good, np.uint8).copy()
    bad_scale[:4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    with pytest.raises(PayloadError, match="not finite"):
        rule.gathered([(chunks, bad_scale.tobytes())], 4)


def test_a_nodes_bytes_reduce_scattered_at_1000_stay_within_2x_of_the_flat_all_gather_at_16() -> None:
    # θ of 1B float32 values at the rule's defaults: flat at 16 members moves 15 payloads each way
    rule = make_rule(ParamLayout(("w",), ((1_000_000_000,),)), SPARSE.model_copy(update={"sync_params": {}}))
    flat16 = 15 * rule.payload_nbytes
    for n in (64, 256, 1000):
        up, down = rule.scatter_nbytes(n)
        assert up <= 2 * flat16 and down <= 2 * flat16, (n, up, down, flat16)
    assert max(rule.scatter_nbytes(1000)) > (1000 - 1) / 1000 * 1_000_000_000  # ~θ at int8 each way
