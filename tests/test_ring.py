"""Ring all-reduce over real iroh endpoints on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math

import numpy as np
import pytest
from conftest import run_async

from drift.compress import CODECS, make_codec, relative_error
from drift.diloco import NesterovOuter, checksum
from drift.gather import Gather
from drift.protocol import RingMember
from drift.ring import (
    COLUMN,
    GATHER,
    GRID_FROM,
    ROW,
    Ring,
    RingError,
    _links,
    grid,
    proves_forgery,
    segment_bounds,
    segment_owner,
    signer,
)
from drift.transport import GATHER_ALPN, RING_ALPN, Endpoint, TransportError
from drift.workers.torch_codec import TorchCodecKernels


async def _ring_of(n: int, **kw) -> tuple[list[Endpoint], list[Ring], list[asyncio.Task]]:
    eps = [await Endpoint.bind("local") for _ in range(n)]
    rings = [Ring(ep, **kw) for ep in eps]

    tasks = [asyncio.ensure_future(e.serve({RING_ALPN: r.handle_incoming})) for e, r in zip(eps, rings)]
    return eps, rings, tasks


async def _close(eps, rings, tasks) -> None:
    for t in tasks:
        t.cancel()
    for r in rings:
        r.close()
    for e in eps:
        await e.close()


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("size", [4096, 1_000_003])
def test_ring_allreduce_equals_numpy_mean(n: int, size: int) -> None:
    rng = np.random.default_rng(n * size)
    inputs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]

    async def main() -> list[np.ndarray]:
        eps, rings, tasks = await _ring_of(n, chunk_bytes=256 * 1024)  # several chunks per segment
        members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=1 / n) for e in eps]
        xs = [(x * np.float32(1 / n)).astype(np.float32) for x in inputs]
        try:
            for rnd in range(2):  # the second round reuses the connections
                bufs = [x.copy() for x in xs]
                await asyncio.gather(*(r.allreduce_sum(b, members, rnd) for r, b in zip(rings, bufs)))
            return bufs
        finally:
            await _close(eps, rings, tasks)

    outs = run_async(main())
    want = np.mean(np.stack(inputs), axis=0)
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    for out in outs[1:]:  # replicas bit-identical, not merely close
        assert out.tobytes() == outs[0].tobytes()


def test_segment_bounds_cover_everything() -> None:
    for n, parts in [(10, 3), (3, 4), (0, 2), (1_000_003, 4)]:
        b = segment_bounds(n, parts)
        assert b[0] == 0 and b[-1] == n and len(b) == parts + 1
        assert max(np.diff(b)) - min(np.diff(b)) <= 1


def test_wrong_round_header_fails_loudly() -> None:
    """A chunk stamped with another round must abort the reduce, not be summed in."""

    async def main() -> str:
        eps, rings, tasks = await _ring_of(2, timeout=10)
        members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=0.5) for e in eps]
        a, b = np.ones(1000, np.float32), np.ones(1000, np.float32)
        try:
            results = await asyncio.gather(
                rings[0].allreduce_sum(a, members, 3), rings[1].allreduce_sum(b, members, 4), return_exceptions=True
            )
        finally:
            await _close(eps, rings, tasks)
        errors = [str(r) for r in results if isinstance(r, RingError)]
        assert len(errors) == 2, results  # neither node returns numbers
        # whoever noticed first says why; its neighbour may only see the connection close
        return next(e for e in errors if "unexpected ring chunk" in e)

    msg = run_async(main())
    assert "round 4 (expected 3)" in msg or "round 3 (expected 4)" in msg


def test_rejects_non_float32() -> None:
    async def main() -> None:
        eps, rings, tasks = await _ring_of(1)
        try:
            with pytest.raises(ValueError):
                await rings[0].allreduce_sum(np.ones(4, np.float64), [], 0)
        finally:
            await _close(eps, rings, tasks)

    run_async(main())


async def _reduce(n: int, inputs_per_round: list[list[np.ndarray]], codec: str, on_device: tuple[int, ...] = (), **kw):
    """Run one all-reduce per entry of inputs_per_round on a fresh n-node ring; returns
    (outputs per round, the rings' residuals after each round). Nodes in `on_device` run the
    codec's arithmetic through torch (as a GPU worker does; here on torch's CPU device)."""
    eps, rings, tasks = await _ring_of(n, chunk_bytes=32 * 1024, codec=make_codec(codec, **kw))  # many chunks
    for i in on_device:
        rings[i].codec = make_codec(codec, kernels=TorchCodecKernels("cpu"), **kw)
    members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=1 / n) for e in eps]
    outs, residuals = [], []
    try:
        for rnd, xs in enumerate(inputs_per_round):
            bufs = [x.copy() for x in xs]
            await asyncio.gather(*(r.allreduce_sum(b, members, rnd) for r, b in zip(rings, bufs)))
            outs.append(bufs)
            residuals.append([None if r.residual is None else r.residual.copy() for r in rings])
        return outs, residuals
    finally:
        await _close(eps, rings, tasks)


def _pseudo_grads(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(size).astype(np.float32)  # nodes move in similar directions
    return [((common + rng.standard_normal(size)) * np.float32(1e-3 / n)).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("codec,n", [(c, 3) for c in CODECS] + [("int8", 2), ("int8", 4), ("topk", 4)])
def test_compressed_round_leaves_replicas_byte_identical(codec: str, n: int) -> None:
    """After a compressed all-reduce and the outer step, theta is the same bytes on every node,
    and the averaged delta is close to the exact one (as close as the codec allows)."""
    size = 600_011
    xs = _pseudo_grads(n, size, seed=1)
    outs, residuals = run_async(_reduce(n, [xs], codec, topk_fraction=0.05))
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    err = relative_error(outs[0][0], exact)
    if codec != "topk":
        assert err < {"fp32": 1e-6, "fp16": 1e-3, "bf16": 1e-2, "int8": 3e-2}[codec], err
    else:
        # What top-k can do: no better than keeping the largest 5 % of the exact sum (here ~0.85;
        # a random 5 % would be ~0.975), a little worse since each hop selects from a partial sum.
        keep = np.argsort(-np.abs(exact))[: int(0.05 * size)]
        best = np.zeros_like(exact)
        best[keep] = exact[keep]
        assert err <= 1.06 * relative_error(best, exact), (err, relative_error(best, exact))
        # And with error feedback nothing is lost: what was not sent waits in the residuals (an
        # answer half the right one, or a random 5 %, breaks this).
        held = sum(r.astype(np.float64) for r in residuals[0])
        assert relative_error(outs[0][0] + held, exact) < 1e-6
    thetas = []
    for out in outs[0]:
        theta = np.linspace(-1, 1, size, dtype=np.float32)
        NesterovOuter(size).step(theta, out)
        thetas.append(checksum(theta))
    assert len(set(thetas)) == 1
    assert len({o.tobytes() for o in outs[0]}) == 1


@pytest.mark.parametrize("size", [3, 5, 1030])
def test_int8_ring_of_tiny_segments_agrees(size: int) -> None:
    """Segments of 0 or 1 values (where an int8 payload outgrows its chunk's own memory) and
    chunks of a few values: replicas still end with the same bytes, near the exact sum."""
    xs = _pseudo_grads(4, size, seed=4)
    outs, _ = run_async(_reduce(4, [xs], "int8"))
    assert len({o.tobytes() for o in outs[0]}) == 1
    assert relative_error(outs[0][0], np.sum(np.stack(xs).astype(np.float64), axis=0)) < 3e-2


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_a_node_encoding_on_its_device_gets_the_same_bytes_as_the_others(codec: str) -> None:
    """One node of three runs the codec through torch (a GPU worker's path, on torch's CPU here):
    every node ends with the same bytes, and the same bytes as a ring encoding all in numpy."""
    xs = _pseudo_grads(3, 300_007, seed=3)
    mixed, _ = run_async(_reduce(3, [xs], codec, on_device=(1,), topk_fraction=0.05))
    plain, _ = run_async(_reduce(3, [xs], codec, topk_fraction=0.05))
    assert len({o.tobytes() for o in mixed[0]}) == 1
    assert mixed[0][0].tobytes() == plain[0][0].tobytes()


def test_topk_error_feedback_carries_the_residual_into_the_next_round() -> None:
    """What top-k leaves out in round 0 stays in the nodes' residuals and is sent later:
    result + residuals always add up to everything that was put in."""
    n, size = 3, 300_007
    xs = _pseudo_grads(n, size, seed=2)
    zeros = [np.zeros(size, np.float32) for _ in range(n)]
    outs, residuals = run_async(_reduce(n, [xs, zeros, zeros], "topk", topk_fraction=0.02))
    total_in = np.sum(np.stack(xs).astype(np.float64), axis=0)
    assert all(r is not None and np.any(r) for r in residuals[0])
    # round 1 had zero inputs, yet sends something: the residual of round 0
    assert np.count_nonzero(outs[1][0]) > 0
    for rnd in range(3):
        sent = sum(outs[k][0].astype(np.float64) for k in range(rnd + 1))
        held = sum(r.astype(np.float64) for r in residuals[rnd])
        np.testing.assert_allclose(sent + held, total_in, atol=1e-9)
    # and the carried mass makes the running sum converge to the exact sum
    e0 = relative_error(outs[0][0], total_in)
    e2 = relative_error(sum(outs[k][0].astype(np.float64) for k in range(3)), total_in)
    assert e2 < e0


def test_codec_mismatch_fails_loudly() -> None:
    async def main() -> str:
        eps, rings, tasks = await _ring_of(2, timeout=10)
        members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=0.5) for e in eps]
        a, b = np.ones(1000, np.float32), np.ones(1000, np.float32)
        try:
            results = await asyncio.gather(
                rings[0].allreduce_sum(a, members, 0, codec="int8"),
                rings[1].allreduce_sum(b, members, 0, codec="fp32"),
                return_exceptions=True,
            )
        finally:
            await _close(eps, rings, tasks)
        errors = [str(r) for r in results if isinstance(r, RingError)]
        assert len(errors) == 2, results  # neither node returns numbers
        return next(e for e in errors if "unexpected ring chunk" in e)

    msg = run_async(main())
    assert "codec" in msg and "int8" in msg and "fp32" in msg


def test_size_mismatch_fails_loudly() -> None:
    async def main() -> str:
        eps, rings, tasks = await _ring_of(2, timeout=10)
        members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=0.5) for e in eps]
        try:
            results = await asyncio.gather(
                rings[0].allreduce_sum(np.ones(1000, np.float32), members, 0),
                rings[1].allreduce_sum(np.ones(1200, np.float32), members, 0),
                return_exceptions=True,
            )
        finally:
            await _close(eps, rings, tasks)
        errors = [str(r) for r in results if isinstance(r, RingError)]
        assert len(errors) == 2, results  # neither node returns numbers
        return next(e for e in errors if "unexpected ring chunk" in e)

    msg = run_async(main())
    assert "unexpected ring chunk" in msg and "vector size" in msg


def test_failed_round_leaves_the_residual_untouched() -> None:
    """A top-k all-reduce that fails midway must not half-update the residual: the retry starts
    from the same state, and nothing put in is lost."""
    n, size = 2, 200_003
    xs = _pseudo_grads(n, size, seed=4)

    async def main():
        eps, rings, tasks = await _ring_of(n, timeout=10, chunk_bytes=64 * 1024, codec=make_codec("topk"))
        members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=0.5) for e in eps]
        try:
            await asyncio.gather(*(r.allreduce_sum(x.copy(), members, 0) for r, x in zip(rings, xs)))
            before = [r.residual.copy() for r in rings]
            bad = await asyncio.gather(
                rings[0].allreduce_sum(xs[0].copy(), members, 1),
                rings[1].allreduce_sum(xs[1].copy(), members, 2),
                return_exceptions=True,
            )
            assert all(isinstance(b, RingError) for b in bad), bad
            after = [r.residual.copy() for r in rings]
        finally:
            await _close(eps, rings, tasks)
        return before, after

    before, after = run_async(main())
    for b, a in zip(before, after):
        assert b.tobytes() == a.tobytes()


def test_ring_refuses_peers_this_node_has_not_verified() -> None:
    """A BarrierReady (from the coordinator) cannot make a node open a ring connection to, or
    accept one from, a peer that it did not verify itself."""

    async def main() -> tuple[str, bool]:
        eps, rings, tasks = await _ring_of(2, timeout=2.0)  # node 1 gives up on node 0 after 2 s
        rings[0].trusted = lambda peer: False  # node 0 verified nobody
        members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=0.5) for e in eps]
        try:
            x = np.ones(16, np.float32)
            other = asyncio.ensure_future(rings[1].allreduce_sum(x.copy(), members, 0))  # trusts node 0
            with pytest.raises(RingError, match="has not verified") as e0:
                await rings[0].allreduce_sum(x.copy(), members, 0)
            with pytest.raises(RingError):  # node 0 turned it away, so node 1's reduce cannot finish
                await other
            return str(e0.value), eps[1].node_id in rings[0]._incoming
        finally:
            await _close(eps, rings, tasks)

    msg, accepted = run_async(main())
    assert "has not verified" in msg and not accepted


def test_proof_of_forgery_holds_against_the_forwarder_and_against_nobody_else() -> None:
    # Real Ed25519 keys (NodeKey: the key a node id is). The owner signs its chunk; a forwarder that
    # alters the bytes and signs what it sent is proven guilty; an honest forwarder cannot be
    # framed: an accuser can neither sign in its name nor swap the owner's signature it vouched for.
    import hashlib

    from drift.auth.keys import NodeKey
    from drift.protocol import Forgery
    from drift.ring import hop_message, owner_message, proves_forgery

    owner, fwd = NodeKey.generate(), NodeKey.generate()
    payload = np.arange(1000, dtype=np.float32).tobytes()

    def chunk(data: bytes, owner_sig: bytes | None = None, hop_key: NodeKey = fwd) -> Forgery:
        digest = hashlib.sha256(data).digest()
        owned = owner_message(owner.node_id, 7, 2, 1, 100, 1100, 5000, digest)
        good = owner_message(owner.node_id, 7, 2, 1, 100, 1100, 5000, hashlib.sha256(payload).digest())
        owner_sig = owner_sig or bytes.fromhex(owner.sign(good))
        hop_sig = bytes.fromhex(hop_key.sign(hop_message(3, 0, owned, owner_sig)))
        return Forgery(
            forwarder=fwd.node_id,
            round=7,
            generation=2,
            segment=1,
            lo=100,
            hi=1100,
            total=5000,
            digest=digest.hex(),
            owner_sig=owner_sig.hex(),
            step=3,
            chunk=0,
            hop_sig=hop_sig.hex(),
        )

    forged = b"\x01" + payload[1:]
    assert proves_forgery(chunk(forged), owner.node_id)  # it signed bytes the owner did not
    assert not proves_forgery(chunk(payload), owner.node_id)  # an honest forward proves nothing
    assert not proves_forgery(chunk(forged, hop_key=NodeKey.generate()), owner.node_id)  # not its signature
    honest = chunk(payload)
    swapped = honest.model_copy(update={"owner_sig": "00" * 64})  # the accuser swaps the owner's signature
    assert not proves_forgery(swapped, owner.node_id)
    other = honest.model_copy(update={"round": 8})  # or claims another round, chunk or range
    assert not proves_forgery(other, owner.node_id)
    assert not proves_forgery(honest, NodeKey.generate().node_id)  # or names another owner


def test_a_payload_in_one_byte_frames_cannot_outlast_its_deadline() -> None:
    """A member sends its (signed, valid) gather payload one byte a frame, each frame well within
    the per-read timeout: the payload as a whole has a deadline (timeout + size / MIN_RATE), so the
    all-gather fails naming it instead of waiting size x timeout."""
    size = 40

    async def main() -> tuple[RingError | None, str]:
        a_ep, b_ep = await Endpoint.bind("local"), await Endpoint.bind("local")
        a, b = Gather(a_ep, timeout=1.0), Gather(b_ep, timeout=1.0)

        async def b_takes(conn) -> None:  # b reads a's payload as an honest member does, and answers ok
            ch = await Endpoint.accept_channel(conn, timeout=10)
            await ch.recv_frame(1024, timeout=10)
            await ch.recv_frame(size, timeout=10)
            await ch.send_frame(b"ok", 10)
            with contextlib.suppress(TransportError):
                await ch.recv_frame(0, 10)

        serving = [
            asyncio.ensure_future(a_ep.serve({GATHER_ALPN: a.handle_incoming})),
            asyncio.ensure_future(b_ep.serve({GATHER_ALPN: b_takes})),
        ]
        members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=0.5) for e in (a_ep, b_ep)]
        try:
            gathering = asyncio.ensure_future(a.allgather(bytes(size), members, 0, size))
            ch = await b_ep.connect(a_ep.ticket(), GATHER_ALPN)
            payload = bytes(range(size))
            await ch.send_frame(b.header(0, 0, payload))  # its own, signed: nothing wrong but the pace
            for i in range(size):
                if gathering.done():
                    break
                await ch.send_frame(payload[i : i + 1])
                await asyncio.sleep(0.2)
            try:
                await gathering
            except RingError as e:
                return e, b_ep.node_id
            return None, b_ep.node_id
        finally:
            for t in serving:
                t.cancel()
            for e in (a_ep, b_ep):
                await e.close()

    err, trickler = run_async(main())
    assert err is not None, "a payload trickled one byte a frame was taken"
    assert "the payload did not arrive within 1s + 1 MiB/s" in str(err), err
    assert err.suspect == trickler


class _Dawdler(Ring):
    """A hostile ring member: honest bytes, each chunk sent just within the receiver's timeout."""

    async def _send_chunk(self, *args, **kwargs) -> None:
        await asyncio.sleep(0.3)
        await super()._send_chunk(*args, **kwargs)


def test_a_neighbour_that_sends_each_chunk_just_in_time_cannot_stretch_a_pass() -> None:
    """Every chunk of a pass arrives within the per-read timeout (1 s), but the pass has many
    (16 a segment): it has a deadline as a whole (timeout + its bytes / MIN_RATE), so the node
    after the dawdler fails it naming the dawdler instead of waiting chunks x timeout."""
    size = 2 * 16 * 64  # 2 nodes, 16 chunks of 64 values a segment

    async def main() -> tuple[BaseException | None, str]:
        eps = [await Endpoint.bind("local") for _ in range(2)]
        rings = [Ring(eps[0], timeout=1.0, chunk_bytes=256), _Dawdler(eps[1], timeout=60.0, chunk_bytes=256)]
        tasks = [asyncio.ensure_future(e.serve({RING_ALPN: r.handle_incoming})) for e, r in zip(eps, rings)]
        members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=0.5) for e in eps]
        try:
            got = await asyncio.gather(
                *(r.allreduce_sum(np.ones(size, np.float32), members, 0) for r in rings), return_exceptions=True
            )
            return (got[0] if isinstance(got[0], BaseException) else None), eps[1].node_id
        finally:
            await _close(eps, rings, tasks)

    err, dawdler = run_async(main())
    assert isinstance(err, RingError), "a pass stretched to chunks x timeout was waited for"
    assert "the all-reduce did not arrive within 1s + 1 MiB/s" in str(err), err
    assert err.suspect == dawdler


# --- the grid: a ring of rings from GRID_FROM members ------------------------------------------


@pytest.mark.parametrize("n", [GRID_FROM, GRID_FROM + 1, 99, 100, 256, 257, 1000, 1024])
def test_a_grid_wires_every_member_once_in_far_fewer_steps(n: int) -> None:
    layout = grid(n, "int8")
    assert layout is not None and grid(n, "topk") is None and grid(GRID_FROM - 1, "int8") is None
    q, rows = layout.q, layout.rows
    seated = [p for i in range(rows) for p in layout.row(i)]
    riders = [layout.rider(i) for i in range(rows) if layout.rider(i) is not None]
    assert sorted(seated + riders) == list(range(n))  # every member in one row, or riding with one
    assert all(layout.passenger(p) for p in riders) and len(riders) < q  # at most one a row
    for p in seated:  # a column: the members that own the same segment, one a row
        assert [c % q for c in layout.column(p)] == [p % q] * rows and p in layout.column(p)
    ids = [f"{i:064x}" for i in range(n)]
    sends = {i: _links(ids, p, layout)[0] for p, i in enumerate(ids)}
    takes = {i: _links(ids, p, layout)[1] for p, i in enumerate(ids)}
    # every connection a member opens is one its peer waits for, and nothing else is waited for
    assert sorted((a, b) for a in ids for b in sends[a]) == sorted((a, b) for b in ids for a in takes[b])
    assert max(map(len, sends.values())) <= max(3, q)  # a passenger sends to its row; others to <= 3
    steps = 2 * (q - 1) + 2 * (rows - 1)
    assert steps <= 4 * math.isqrt(n) and steps < (2 * (n - 1)) / 4  # 1,000 members: 122 steps, not 1,998


def test_who_signs_a_grid_chunk_comes_from_the_ring_never_the_accuser() -> None:
    n = 70  # 8 rows of 8, and 6 passengers
    ids = [f"{i:064x}" for i in range(n)]
    layout = grid(n, "int8")
    f = 19  # row 2, place 3 of it: it owns the row's segment 4; its column: places 3, 11, 19, ...
    col = [ids[p] for p in layout.column(f)]
    assert signer(ids, "int8", ids[f], COLUMN, 5, part=4) == segment_owner(col, 5)  # its own column's pass
    # in its row's all-gather it forwards segment 2 of the row as the column of its owner (place 17) signed it
    assert signer(ids, "int8", ids[f], COLUMN, 5, part=2) == segment_owner([ids[p] for p in layout.column(17)], 5)
    assert signer(ids, "int8", ids[f], GATHER, 5, part=4) is None  # no row member signs a chunk of its own
    assert signer(ids, "int8", ids[f], ROW, 5) is None  # a reduce-scatter chunk carries no owner's signature
    assert signer(ids, "int8", ids[f], COLUMN, 8, part=4) is None  # no such segment
    assert signer(ids, "int8", ids[66], COLUMN, 1, part=1) is None  # a passenger forwards nothing
    assert signer(ids, "int8", "ff" * 32, COLUMN, 1, part=1) is None  # nor does a stranger
    assert signer(ids[:10], "int8", ids[3], ROW, 4) == segment_owner(ids[:10], 4)  # the flat ring
    # told to reduce on the flat ring (BarrierReady.flat), the 70 sign as a ring of 70
    assert grid(n, "int8", flat=True) is None
    assert signer(ids, "int8", ids[f], ROW, 5, flat=True) == segment_owner(ids, 5)
    assert signer(ids, "int8", ids[f], COLUMN, 5, part=4, flat=True) is None


async def _grid_round(n: int, size: int, codec: str, cls: dict[int, type[Ring]] | None = None):
    """One all-reduce of `size` values among n in-process members (member i's Ring class from
    `cls`); (inputs, outputs or errors, stats, ids)."""
    eps = await asyncio.gather(*(Endpoint.bind("local") for _ in range(n)))
    rings = [(cls or {}).get(i, Ring)(ep, timeout=30.0, chunk_bytes=16 * 1024) for i, ep in enumerate(eps)]
    tasks = [asyncio.ensure_future(e.serve({RING_ALPN: r.handle_incoming})) for e, r in zip(eps, rings)]
    members = [RingMember(node_id=e.node_id, ticket=e.ticket(), weight=1 / n) for e in eps]
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    bufs = [x.copy() for x in xs]
    try:
        got = await asyncio.gather(
            *(r.allreduce_sum(b, members, 1, codec=codec) for r, b in zip(rings, bufs)), return_exceptions=True
        )
    finally:
        await _close(eps, rings, tasks)
    return xs, [g if isinstance(g, BaseException) else b for g, b in zip(got, bufs)], got, [e.node_id for e in eps]


@pytest.mark.parametrize("codec,size", [("fp32", 50_003), ("int8", 50_003), ("int8", 5)])
def test_a_grid_sums_like_the_flat_ring_and_every_member_holds_the_same_bytes(codec: str, size: int) -> None:
    # 8 rows of 8, and 6 passengers (rows 0-5 carry one); 5 values: most segments and chunks empty
    n = GRID_FROM + 6
    xs, outs, stats, _ = run_async(_grid_round(n, size, codec))
    assert all(isinstance(o, np.ndarray) for o in outs), [o for o in outs if not isinstance(o, np.ndarray)][:1]
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    # fp32: float32 sums in another order; int8: one encoding a pass (the flat ring of 63 measured 0.04)
    assert relative_error(outs[0], exact) < (1e-6 if codec == "fp32" else 0.03)
    assert all(o.tobytes() == outs[0].tobytes() for o in outs)  # bit-identical replicas
    if size < n:
        return  # (the bytes are headers and signatures)
    flat = 2 * (n - 1) / n * make_codec(codec).encoded_nbytes(size)  # what a flat ring's member sends
    layout = grid(n, codec)
    sent = [s.bytes_sent for s in stats]
    # a member sends about the flat ring's bytes: 2/q of θ more, with a passenger 1/q more again
    assert max(sent) < flat * (1 + 3 / layout.q) * 1.05 and min(sent) > flat / 2 * 0.95


class _Forger(Ring):
    """A hostile member: alters one byte of every all-gather chunk it forwards (not its own) in
    its column's pass or in its row's all-gather (`where`), and signs what it sent, as
    tests/wrappers/fault_node.py's tamper-forward does. In the row's all-gather that is what a
    member would do to hand its row (or its passenger) another θ than the one it keeps."""

    where = "column"

    async def _send_chunk(self, ch, payload, codec, round_, step, chunk, n, total, signed=None, timeout=None) -> None:
        if (
            signed is not None
            and signed[0][-64:-32].hex() != self.node_id
            and (total < 20_000) == (self.where == "column")
        ):
            forged = bytearray(memoryview(payload).cast("B"))
            forged[0] ^= 1
            signed, payload = (signed[0][:-32] + hashlib.sha256(forged).digest(), signed[1]), forged
        await super()._send_chunk(ch, payload, codec, round_, step, chunk, n, total, signed, timeout)


@pytest.mark.swarm
@pytest.mark.parametrize("where,bad", [("column", 19), ("row", 19), ("row", 3)])
def test_a_member_that_forges_in_either_pass_of_a_grid_is_proven_and_nobody_else_is_named(where: str, bad: int) -> None:
    # 66 members: 8 rows of 8, passengers ride with rows 0 and 1. Member 19 (row 2) or 3 (row 0,
    # whose passenger takes each segment from its owner) forwards altered bytes under its own hop
    # signature: the next member of its column, of its row, or its passenger holds proof.
    n = GRID_FROM + 2

    class Forger(_Forger):
        pass

    Forger.where = where
    xs, outs, got, ids = run_async(_grid_round(n, 20_000, "fp32", {bad: Forger}))
    errors = [g for g in got if isinstance(g, RingError)]
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    # nobody holds a sum with forged bytes in it: a forged column stalls every row; in a row's
    # all-gather the other rows finish with the true sum
    assert errors and all(relative_error(o, exact) < 1e-6 for o in outs if isinstance(o, np.ndarray))
    proofs = [e.proof for e in errors if e.proof is not None]
    assert proofs and all(p.forwarder == ids[bad] and p.level == COLUMN for p in proofs)
    for p in proofs:  # the coordinator's check: the owner by the ring it sent
        assert proves_forgery(p, signer(ids, "fp32", p.forwarder, p.level, p.segment, p.part))
    assert {e.suspect for e in errors} <= {"", ids[bad]}  # no honest member is named
    if bad == 3:  # its passenger (place 64) caught it too, on its own
        assert got[64].proof is not None and got[64].suspect == ids[bad]
