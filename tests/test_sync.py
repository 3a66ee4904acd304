"""The sync rules at their seam (drift/sync/), in milliseconds: the recipe's view of them, the
sparse rule's payload (round trip, error feedback, a fixed-order sum that is the same bits on
every node, the clip of a contribution far outside the others), and the all-gather that carries
it (real iroh endpoints on loopback)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import numpy as np
import pytest
from conftest import run_async

from drift import protocol as P
from drift.diloco import ParamLayout, checksum, norm_bound
from drift.gather import LATE_FACTOR, Gather, late_after, signed_payload
from drift.recipe import Recipe, RecipeError, load_recipe
from drift.ring import MIN_RATE, RingError
from drift.sync import collective, make_rule
from drift.sync.sparse import Codec, PayloadError, SparseParams
from drift.transport import GATHER_ALPN, Endpoint

BASE = {"name": "x", "task": "t.py", "rounds": 1, "inner_steps": 1, "batch_size": 1}
SPARSE_ROUND = SparseParams().dense_rounds  # the first round the default sparse rule all-gathers
LAYOUT = ParamLayout(("b", "w"), ((100,), (3, 4000)))  # 12,100 values: 3 chunks, the last one short


def recipe(**fields) -> Recipe:
    return Recipe.model_validate({**BASE, **fields})


def members(n: int, weights: list[float] | None = None) -> list[P.RingMember]:
    w = weights or [1 / n] * n
    return [P.RingMember(node_id=f"{i:064x}", ticket="t", weight=w[i]) for i in range(n)]


def test_the_old_sync_names_still_mean_what_they_did() -> None:
    assert (recipe().sync, recipe().overlap) == ("dense", False)
    assert (recipe(sync="blocking").sync, recipe(sync="blocking").overlap) == ("dense", False)
    assert (recipe(sync="overlapped").sync, recipe(sync="overlapped").overlap) == ("dense", True)
    rule = make_rule(LAYOUT, recipe())
    assert list(rule.state) == ["velocity"] and rule.collective == "ring"
    theta = np.arange(LAYOUT.size, dtype=np.float32)
    # The checksum over θ and the named state is the one every node reported before: θ, velocity.
    assert checksum(theta, *rule.state.values()) == checksum(theta, np.zeros(LAYOUT.size, np.float32))
    assert list(make_rule(LAYOUT, recipe(sync="sparse")).state) == []  # error feedback is node-local


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        ({"sync": "sprase"}, "x.yaml: sync: 'sprase' is not a sync rule (dense, sparse, blocking, overlapped)"),
        (
            {"sync": "sparse", "sync_params": {"k": 0}},
            "x.yaml: sync_params: k: Input should be greater than or equal to 1",
        ),
        ({"sync": "sparse", "sync_params": {"chunk": 1000}}, "x.yaml: sync_params: chunk must be a power of two"),
        ({"sync": "sparse", "sync_params": {"topk": 3}}, "x.yaml: sync_params: topk: unknown field (sync: sparse)"),
        ({"sync": "dense", "sync_params": {"k": 64}}, "x.yaml: sync_params: k: unknown field (sync: dense)"),
    ],
)
def test_a_bad_sync_setting_is_one_line_naming_the_field(tmp_path: Path, fields: dict, line: str) -> None:
    import yaml

    f = tmp_path / "x.yaml"
    f.write_text(yaml.safe_dump({**BASE, **fields}))
    with pytest.raises(RecipeError) as e:
        load_recipe(f, check_task=False)
    assert len(str(e.value).splitlines()) == 1 and str(e.value).startswith(f"{tmp_path}/{line}"), str(e.value)


def _delta(seed: int, scale: float = 1e-3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal(LAYOUT.size) ** 3).astype(np.float32)  # heavy-tailed, as Δ is


def _decoded(codec: Codec, payload: bytes) -> np.ndarray:
    out = np.zeros(codec.n, np.float32)
    for flat, vals in codec.pieces(payload):
        out[flat] = vals
    return out


def test_sparse_payload_carries_each_chunks_top_k_in_a_bit_each() -> None:
    codec = Codec(LAYOUT.size, 4096, 64)
    x = _delta(0)
    payload = codec.encode(x)
    # per chunk: a bfloat16 magnitude, 64 indices of 6 low bits and a span of 64 + 64 high bits, a sign bit a value
    assert len(payload) == codec.nbytes == 3 * (2 + 64 * 6 // 8 + 128 // 8 + 64 // 8)  # ~0.14 bits a value
    got = _decoded(codec, payload)
    for a in range(0, x.size, 4096):
        chunk, dec = x[a : a + 4096], got[a : a + 4096]
        top = np.argsort(-np.abs(chunk), kind="stable")[: min(64, chunk.size)]
        assert set(np.flatnonzero(dec)) <= set(top)  # only top-k positions carry a value
        assert np.array_equal(np.sign(dec[top]), np.sign(chunk[top]))  # with their signs
        assert len(np.unique(np.abs(dec[top]))) == 1  # and the chunk's one magnitude: its top-k's mean |value|
        assert np.abs(dec[top][0]) == pytest.approx(np.abs(chunk[top]).mean(), rel=2**-8)
    assert np.dot(got, x) > 0.5 * np.linalg.norm(got) * np.linalg.norm(x[np.abs(x) >= np.sort(np.abs(x))[-192]])
    assert codec.norm(payload) == pytest.approx(float(np.linalg.norm(got)), rel=1e-6)
    with pytest.raises(PayloadError):
        next(codec.pieces(payload[:-1]))
    for bits in (b"\x80\xbf", b"\xc0\x7f", b"\x80\x7f"):  # the first chunk's magnitude: -1, NaN, +inf
        with pytest.raises(PayloadError, match="magnitude"):
            codec.norm(bits + payload[2:])
    bad = bytearray(payload)
    bad[codec.i_index : codec.i_index + 2] = b"\xff\xff"  # the first two indices' low bits: both 63
    with pytest.raises(PayloadError, match="increasing"):
        list(codec.pieces(bytes(bad)))
    bad = bytearray(payload)
    bad[codec.i_high] |= 0xFF  # the first chunk's span now holds more than 64 indices
    with pytest.raises(PayloadError, match="does not hold 64"):
        codec.norm(bytes(bad))
    top = Codec(LAYOUT.size, 4096, 1)  # one index a chunk, 12 low bits and a span of 2 bits: "10" is high part 0
    bad = bytearray(top.encode(x))
    bad[top.i_high] = 0b01101010  # chunks 0-3's spans: "01" is high part 1, the index 4096 or more
    with pytest.raises(PayloadError, match="past its chunk"):
        list(top.pieces(bytes(bad)))


def test_a_chunks_magnitude_travels_as_bfloat16_rounded_to_nearest_even() -> None:
    x = np.array([1, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, 3e-39, 0], np.float32)
    bf16 = Codec(1, 2, 1).bf16  # the chunks' magnitudes go through drift.compress's bf16 codec
    bits = bf16.encode(x).view("<u2")
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020, 0x0021, 0]  # ties to even; subnormals kept
    decoded = bf16.decode(bits.view(np.uint8), np.empty(x.size, np.float32))
    assert decoded.tolist() == [1, 1, 1 + 2**-6, 1 + 2**-7, -2.5, (np.uint32(0x21) << 16).view(np.float32), 0]


@pytest.mark.parametrize("k", [9, 16])  # over half the chunk: indices have no low bits, only the span
def test_a_payload_keeping_most_of_each_chunk_decodes_to_its_top_k(k: int) -> None:
    codec = Codec(1000, 16, k)
    x = _delta(3)[:1000]
    got = _decoded(codec, codec.encode(x))
    for a in range(0, 1000, 16):
        chunk = np.abs(x[a : a + 16])
        top = np.argsort(-chunk, kind="stable")[: min(k, chunk.size)]
        assert set(np.flatnonzero(got[a : a + 16])) == set(top)


def test_error_feedback_keeps_what_the_payload_did_not_carry() -> None:
    rule = make_rule(LAYOUT, recipe(sync="sparse"))
    d1, d2 = _delta(1), _delta(2)
    payload = rule.contribute(d1.copy(), 0.5, SPARSE_ROUND)
    assert rule.contribute(d1.copy(), 0.5, SPARSE_ROUND) == payload  # a retried attempt sends the same bytes
    rule.combine([payload], members(1))
    rule.apply(np.zeros(LAYOUT.size, np.float32))  # the round is applied
    sent = _decoded(rule.codec, payload)
    np.testing.assert_allclose(rule.ef + sent, d1, atol=1e-9)  # e = Δ - what was sent
    payload2 = rule.contribute(d2.copy(), 0.5, SPARSE_ROUND)
    rule.abandon()  # this round's θ came from a peer: the buffer stays as it was
    np.testing.assert_allclose(rule.ef + sent, d1, atol=1e-9)
    rule.combine([rule.contribute(d2.copy(), 0.5, SPARSE_ROUND)], members(1))
    rule.apply(np.zeros(LAYOUT.size, np.float32))
    want = np.float32(rule.params.ef_decay) * (d1 - sent) + d2 - _decoded(rule.codec, payload2)
    np.testing.assert_allclose(rule.ef, want, atol=1e-8)
    assert rule.contribute(d2.copy(), 0.0, SPARSE_ROUND) == b""  # weight 0: nothing sent, nothing kept


def test_the_sum_is_the_same_bits_whatever_order_payloads_arrive_in() -> None:
    ring = members(4, [0.1, 0.2, 0.3, 0.4])
    loose = recipe(sync="sparse", sync_params={"clip": 3.0})  # similar norms: none is clipped
    payloads = [make_rule(LAYOUT, loose).contribute(_delta(10 + i), 0.25, SPARSE_ROUND) for i in range(4)]
    results = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):  # arrival orders: each lands at its ring position
        arrived: list[bytes] = [b""] * 4
        for k in order:
            arrived[k] = bytes(bytearray(payloads[k]))  # a fresh copy, as off the wire
        node = make_rule(LAYOUT, loose)
        assert node.combine(arrived, ring).outliers == []
        theta = np.ones(LAYOUT.size, np.float32)
        node.apply(theta)
        results.append(theta.tobytes())
    assert len(set(results)) == 1
    want = sum(m.weight * _decoded(make_rule(LAYOUT, loose).codec, p) for m, p in zip(ring, payloads))
    # four contributions: the outer lr is lr x √(4 / 2) (lr_growth)
    moved = (np.ones(LAYOUT.size, np.float32) - np.frombuffer(results[0], np.float32)) / (node.params.lr * 2**0.5)
    np.testing.assert_allclose(moved, want, atol=1e-7)


def test_the_sparse_rules_outer_lr_grows_with_the_contributions_summed_up_to_its_cap() -> None:
    # One or two contributions step θ by lr; n by lr x √(n / 2) (their top-k sets overlap little:
    # their mean is shorter than each), up to lr_growth x lr. Counted are the contributions summed:
    # not a member of weight 0, nor one that sent nothing, nor one far outside the others.
    rule = make_rule(LAYOUT, recipe(sync="sparse"))
    lr = rule.params.lr
    assert [round(float(rule.round_lr(n)) / lr, 4) for n in (1, 2, 3, 4, 8, 16, 1000)] == [
        *(1.0, 1.0, 1.2247, 1.4142),
        *(2.0, 2.0, 2.0),
    ]
    assert make_rule(LAYOUT, recipe(sync="sparse", sync_params={"lr_growth": 1})).round_lr(16) == np.float32(lr)
    ring = members(6)
    payloads = [
        make_rule(LAYOUT, recipe(sync="sparse")).contribute(_delta(40 + i), 1 / 6, SPARSE_ROUND) for i in range(4)
    ]
    far = make_rule(LAYOUT, recipe(sync="sparse")).contribute(np.float32(1000) * _delta(45), 1 / 6, SPARSE_ROUND)
    steps = []
    for result in ([*payloads, b"", b""], [*payloads, far, b""]):  # 4 summed either way
        node = make_rule(LAYOUT, recipe(sync="sparse", sync_params={"clip": 3.0}))  # (none clipped)
        node.combine(result, ring)
        theta = np.zeros(LAYOUT.size, np.float32)
        node.apply(theta)
        steps.append(theta)
    want = sum(np.float32(1 / 6) * _decoded(rule.codec, p) for p in payloads)
    np.testing.assert_allclose(-steps[0], lr * 2**0.5 * want, rtol=1e-5, atol=1e-9)
    assert np.array_equal(steps[0], steps[1])


UNIT_LR = recipe(sync="sparse", sync_params={"lr": 1.0, "lr_growth": 1.0})  # (for _combined: θ moves by the update)


def _combined(rule, result: list[bytes], ring) -> tuple[list[str], np.ndarray]:
    """The outliers combine names, and the update it leads to (outer lr 1 from θ = 0: θ is
    -update, and 0 - θ gives its bits back)."""
    assert rule.params.lr == rule.params.lr_growth == 1
    outliers = rule.combine(result, ring).outliers
    theta = np.zeros(LAYOUT.size, np.float32)
    rule.apply(theta)
    return outliers, np.subtract(np.float32(0), theta)


def test_a_contribution_far_outside_the_others_adds_nothing_and_is_named() -> None:
    ring = members(4)
    honest = [make_rule(LAYOUT, recipe(sync="sparse")).contribute(_delta(20 + i), 0.25, SPARSE_ROUND) for i in range(3)]
    rule = make_rule(LAYOUT, UNIT_LR)
    _, honest_only = _combined(rule, [*honest, b""], ring)
    for scale in (1000, -10):  # x1000, and the -10x flip (clipped, it still pulled θ back for a round)
        hostile = make_rule(LAYOUT, recipe(sync="sparse")).contribute(
            np.float32(scale) * _delta(23), 0.25, SPARSE_ROUND
        )
        outliers, out = _combined(rule, [*honest, hostile], ring)
        assert outliers == [ring[3].node_id] and np.array_equal(out, honest_only)
    # Within the outlier bound a contribution is clipped to clip x the median, not dropped.
    norms = [rule.codec.norm(p) for p in honest]
    big = make_rule(LAYOUT, recipe(sync="sparse")).contribute(np.float32(3) * _delta(23), 0.25, SPARSE_ROUND)
    outliers, out = _combined(rule, [*honest, big], ring)
    assert outliers == [] and not np.array_equal(out, honest_only)
    assert float(np.linalg.norm(out - honest_only)) <= 0.25 * rule.params.clip * sorted(norms)[1] * (1 + 1e-5)
    # A payload that does not decode adds nothing and is named too; two honest ones cannot tell.
    outliers, out = _combined(rule, [*honest, hostile[:-3]], ring)
    assert outliers == [ring[3].node_id] and np.array_equal(out, honest_only)
    assert rule.combine([honest[0], hostile, b"", b""], ring).outliers == []


def test_a_zero_payload_does_not_clip_the_other_member_of_two_to_nothing() -> None:
    ring = members(2, [0.5, 0.5])
    honest = make_rule(LAYOUT, recipe(sync="sparse")).contribute(_delta(30), 0.5, SPARSE_ROUND)
    nothing = make_rule(LAYOUT, recipe(sync="sparse")).contribute(np.zeros(LAYOUT.size, np.float32), 0.5, SPARSE_ROUND)
    rule = make_rule(LAYOUT, UNIT_LR)
    assert rule.codec.norm(nothing) == 0
    _, out = _combined(rule, [honest, nothing], ring)
    _, alone = _combined(rule, [honest, b""], ring)
    assert np.linalg.norm(alone) > 0 and np.array_equal(out, alone)  # θ still moves by the honest half


def test_allgather_brings_every_payload_and_names_a_member_that_stalls() -> None:
    async def main():
        eps = [await Endpoint.bind("local") for _ in range(3)]
        gathers = [Gather(ep, timeout=3.0) for ep in eps]
        serving = [asyncio.ensure_future(ep.serve({GATHER_ALPN: g.handle_incoming})) for ep, g in zip(eps, gathers)]
        ring = [P.RingMember(node_id=ep.node_id, ticket=ep.ticket(), weight=1 / 3) for ep in eps]
        payloads = [bytes([i]) * 3_000_000 for i in range(3)]  # three frames each
        try:
            got = await asyncio.gather(*(g.allgather(p, ring, 4, 3_000_000, 1) for g, p in zip(gathers, payloads)))
            stalled = await asyncio.gather(
                *(g.allgather(p, ring, 5, 3_000_000, 1) for g, p in zip(gathers[:2], payloads)),
                return_exceptions=True,
            )
            return got, stalled, ring
        finally:
            for s in serving:
                s.cancel()
            for ep in eps:
                await ep.close()

    got, stalled, ring = run_async(main(), 60)
    for out, stats in got:
        assert out == [bytes([i]) * 3_000_000 for i in range(3)]
        assert stats.bytes_sent > 2 * 3_000_000
    assert all(isinstance(e, RingError) and e.suspect == ring[2].node_id for e in stalled), stalled


def test_members_keep_their_gather_connections_across_rounds_and_replace_broken_ones() -> None:
    # Each payload is a stream on a connection its sender keeps to the receiver: a second round
    # opens no new connection (a handshake a payload was most of a 256-node round's sync), and
    # after a member's connections closed between rounds (an idle timeout, a restarted router)
    # every payload still arrives the next round, on new ones. (One closed while a payload is on
    # it fails that attempt, naming nobody, as a broken connection always did.)
    async def main():
        eps = [await Endpoint.bind("local") for _ in range(3)]
        gathers = [Gather(ep, timeout=3.0) for ep in eps]
        accepted: list[list] = [[] for _ in eps]  # the connections each endpoint accepted

        def counting(g: Gather, seen: list):
            async def handle(conn) -> None:
                seen.append(conn)
                await g.handle_incoming(conn)

            return handle

        serving = [
            asyncio.ensure_future(ep.serve({GATHER_ALPN: counting(g, seen)}))
            for ep, g, seen in zip(eps, gathers, accepted)
        ]
        ring = [P.RingMember(node_id=ep.node_id, ticket=ep.ticket(), weight=1 / 3) for ep in eps]
        payloads = [bytes([i]) * 1000 for i in range(3)]
        try:
            rounds = [
                await asyncio.gather(*(g.allgather(p, ring, r, 1000, 1) for g, p in zip(gathers, payloads)))
                for r in range(2)
            ]
            kept = [len(seen) for seen in accepted]
            for conn in accepted[0]:
                conn.close(0, b"gone")
            while any(g.connected(ring[0].node_id) for g in gathers[1:]):  # the others learn of it
                await asyncio.sleep(0.01)
            rounds.append(await asyncio.gather(*(g.allgather(p, ring, 2, 1000, 1) for g, p in zip(gathers, payloads))))
            return rounds, kept, [len(seen) for seen in accepted]
        finally:
            for s in serving:
                s.cancel()
            for ep in eps:
                await ep.close()

    rounds, kept, final = run_async(main(), 60)
    assert all(out == [bytes([i]) * 1000 for i in range(3)] for got in rounds for out, _ in got)
    assert kept == [2, 2, 2]  # one connection from each other member, for both rounds
    assert final == [4, 2, 2]  # the two it closed were replaced, once each


def test_a_payload_missing_long_after_half_the_others_arrived_is_late() -> None:
    # Attack 3: a member that withholds its payload, while receiving everyone's, is named after
    # seconds, relative to what the others took, not after the connection's 120 s timeout.
    slack = 1.0  # BarrierReady.slack_s
    assert late_after([], 3, 0, slack) is None and late_after([0.2], 3, 0, slack) is None  # fewer than half
    assert late_after([0.2, 0.3], 3, 0, slack) == pytest.approx(LATE_FACTOR * 0.3 + slack)
    assert late_after([0.5], 2, 0, slack) == pytest.approx(LATE_FACTOR * 0.5 + slack)  # three members
    assert late_after([], 1, 0, slack) is None  # two members: the one other is all there is
    # A sender on a slow uplink sends `others` payloads at once: each gets its share of MIN_RATE.
    assert late_after([0.2, 0.3], 3, 4 * MIN_RATE, slack) == pytest.approx(LATE_FACTOR * 0.3 + slack + 12)


def test_a_member_that_takes_payloads_but_never_confirms_them_is_named_in_seconds() -> None:
    # Attack 3's other half: x sends its own payload but never confirms ours (it reads, and holds
    # the connection). Each honest member names it once half the others confirmed, not at 60 s.

    class TakesButNeverConfirms(Gather):  # the attacker's code, not drift's
        async def _receive(self, ch, peer, size, count):
            await asyncio.Event().wait()

    async def main():
        eps = [await Endpoint.bind("local") for _ in range(4)]
        gathers = [Gather(ep, timeout=60.0) for ep in eps[:3]] + [TakesButNeverConfirms(eps[3], timeout=60.0)]
        serving = [asyncio.ensure_future(ep.serve({GATHER_ALPN: g.handle_incoming})) for ep, g in zip(eps, gathers)]
        ring = [P.RingMember(node_id=ep.node_id, ticket=ep.ticket(), weight=0.25) for ep in eps]
        hostile = asyncio.ensure_future(gathers[3].allgather(b"x" * 100, ring, 4, 100, 1))
        try:
            return ring, await asyncio.wait_for(
                asyncio.gather(
                    *(g.allgather(bytes([i]) * 100, ring, 4, 100, 1, slack_s=0.5) for i, g in enumerate(gathers[:3])),
                    return_exceptions=True,
                ),
                30,
            )
        finally:
            hostile.cancel()
            for s in serving:
                s.cancel()
            for ep in eps:
                await ep.close()

    ring, failed = run_async(main(), 60)
    assert all(isinstance(e, RingError) and e.suspect == ring[3].node_id for e in failed), failed
    assert all("did not take ours" in str(e) for e in failed), failed


def test_allgather_payloads_are_signed_by_their_senders_and_reported_as_heard() -> None:
    """Each node's stats.heard holds, per other member, sha256 of the payload it got and the
    sender's signature (an empty payload of weight 0 too), valid for this round and attempt only.
    A payload sent under the signature of other bytes fails the all-gather naming its sender."""

    async def main():
        eps = [await Endpoint.bind("local") for _ in range(3)]
        gathers = [Gather(ep, timeout=3.0) for ep in eps]
        serving = [asyncio.ensure_future(ep.serve({GATHER_ALPN: g.handle_incoming})) for ep, g in zip(eps, gathers)]
        ring = [P.RingMember(node_id=ep.node_id, ticket=ep.ticket(), weight=w) for ep, w in zip(eps, [0.5, 0.5, 0])]
        payloads = [b"a" * 1000, b"b" * 1000, b""]
        try:
            got = await asyncio.gather(*(g.allgather(p, ring, 4, 1000, 2) for g, p in zip(gathers, payloads)))
            # node 2 sends node 0 its payload under the signature of node 1's bytes
            refused = asyncio.ensure_future(gathers[0].allgather(payloads[0], ring, 5, 1000, 2))
            forged = b"c" * 1000
            await gathers[2]._send(ring[0], gathers[2].header(5, 2, payloads[1]), forged, [0, 0])
            return got, (await asyncio.gather(refused, return_exceptions=True))[0], ring
        finally:
            for s in serving:
                s.cancel()
            for ep in eps:
                await ep.close()

    got, refused, ring = run_async(main(), 60)
    for k, (out, stats) in enumerate(got):
        assert out == [b"a" * 1000, b"b" * 1000, b""]
        others = [i for i in range(3) if i != k]
        assert [h.owner for h in stats.heard] == [ring[i].node_id for i in others]
        assert stats.check_seconds > 0  # its hashes and signatures are reported (RoundDone.check_s)
        for i, h in zip(others, stats.heard):
            assert h.digest == hashlib.sha256(out[i]).hexdigest()
            assert signed_payload(h.owner, 4, 2, h.digest, h.sig)
            assert not signed_payload(h.owner, 4, 3, h.digest, h.sig)  # another attempt
            assert not signed_payload(h.owner, 3, 2, h.digest, h.sig)  # another round
            assert not signed_payload(ring[k].node_id, 4, 2, h.digest, h.sig)  # another signer
    assert isinstance(refused, RingError) and refused.suspect == ring[2].node_id, refused
    assert "did not sign" in str(refused)


def test_the_sparse_rules_first_rounds_go_around_the_ring_dense_and_leave_its_error_feedback_empty() -> None:
    # Which collective: the recipe and the round number alone (the coordinator and every node agree).
    sparse = recipe(sync="sparse")
    assert [collective(sparse, k) for k in range(4)] == ["ring", "ring", "allgather", "allgather"]
    assert collective(recipe(sync="sparse", sync_params={"dense_rounds": 0}), 0) == "allgather"
    assert collective(recipe(sync="sparse", sync_params={"dense_rounds": 5}), 4) == "ring"
    assert all(collective(recipe(), k) == "ring" for k in range(4))  # sync: dense, every round
    # A dense round: each member gives the ring w·Δ; θ -= dense_lr x the sum on the parameters, the
    # plain sum on the buffers.
    layout = ParamLayout(("a", "buf"), ((9000,), (5,)), n_buffers=1)
    rng = np.random.default_rng(7)
    theta = rng.standard_normal(layout.size).astype(np.float32)
    deltas = [np.float32(1e-2) * rng.standard_normal(layout.size).astype(np.float32) for _ in range(2)]
    weights = [0.25, 0.75]
    rules = [make_rule(layout, sparse) for _ in weights]
    sent = [rule.contribute(d.copy(), w, 1) for rule, d, w in zip(rules, deltas, weights)]
    assert all(np.array_equal(x, np.float32(w) * d) for x, w, d in zip(sent, weights, deltas))
    total = sent[0] + sent[1]
    bound = norm_bound((w, float(np.linalg.norm(d))) for w, d in zip(weights, deltas))
    after = []
    for rule, x in zip(rules, sent):
        x[...] = total  # the ring's sum, in place
        assert rule.combine(x, members(2, weights), bound).problem is None
        t = theta.copy()
        rule.apply(t)
        after.append(t)
    want = theta.copy()
    want[:9000] -= np.float32(SparseParams().dense_lr) * total[:9000]
    want[9000:] -= total[9000:]
    assert all(np.array_equal(t, want) for t in after)
    # its error feedback is as empty as a new node's: the first sparse round sends the same bytes
    d = np.float32(1e-2) * rng.standard_normal(layout.size).astype(np.float32)
    new = make_rule(layout, sparse).contribute(d.copy(), 0.5, SPARSE_ROUND)
    assert rules[0].contribute(d.copy(), 0.5, SPARSE_ROUND) == new
    # a ring sum larger than the members' reported norms allow is refused: θ must not move
    rule = make_rule(layout, sparse)
    x = rule.contribute(deltas[0].copy(), 1.0, 0)
    x *= np.float32(1000)  # (a member sent 1,000 x what it reported)
    assert "reported norms allow" in (rule.combine(x, members(1), float(np.linalg.norm(deltas[0]))).problem or "")


@pytest.mark.parametrize(
    ("fields", "rnd"),
    [
        ({}, 0),
        ({"outer_optimizer": {"momentum": 0.0}}, 0),
        ({"outer_optimizer": {"nesterov": False}}, 0),
        ({"sync": "sparse"}, 0),  # a dense round of the sparse rule
        ({"sync": "sparse"}, SPARSE_ROUND),
    ],
)
def test_preview_is_the_checksum_the_outer_step_leads_to_and_changes_nothing(fields: dict, rnd: int) -> None:
    # (a ring of two compares it before either member applies the step: BarrierReady.confirm)
    layout = ParamLayout(("a", "b", "buf"), ((1_500_000,), (600_001,), (7,)), n_buffers=1)  # 3 chunks
    rule = make_rule(layout, rule_recipe := recipe(**fields))
    rng = np.random.default_rng(1)
    theta, delta = (rng.standard_normal(layout.size).astype(np.float32) for _ in range(2))
    for x in rule.state.values():
        x[: layout.params_size] = rng.standard_normal(layout.params_size)
    sent = rule.contribute(delta, 1.0, rnd)  # a ring of one: the sum is what this node sent
    assert rule.combine(sent if collective(rule_recipe, rnd) == "ring" else [sent], members(1)).problem is None
    held = checksum(theta, *rule.state.values())
    announced = rule.preview(theta)
    assert checksum(theta, *rule.state.values()) == held != announced
    rule.apply(theta)
    assert checksum(theta, *rule.state.values()) == announced
