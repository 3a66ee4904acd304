"""Ring all-reduce over real iroh endpoints on loopback."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

from conftest import run_async
from drift.protocol import RingMember
from drift.ring import Ring, RingError, segment_bounds
from drift.transport import RING_ALPN, Endpoint


async def _ring_of(n: int, **kw) -> tuple[list[Endpoint], list[Ring], list[asyncio.Task]]:
    eps = [await Endpoint.bind("local") for _ in range(n)]
    rings = [Ring(ep, **kw) for ep in eps]

    async def accept(ep: Endpoint, ring: Ring) -> None:
        while True:
            alpn, conn = await ep.accept()
            assert alpn == RING_ALPN
            asyncio.ensure_future(ring.handle_incoming(conn))

    tasks = [asyncio.ensure_future(accept(e, r)) for e, r in zip(eps, rings)]
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
            results = await asyncio.gather(rings[0].allreduce_sum(a, members, 3),
                                           rings[1].allreduce_sum(b, members, 4), return_exceptions=True)
        finally:
            await _close(eps, rings, tasks)
        errors = [r for r in results if isinstance(r, RingError)]
        assert errors, results
        return str(errors[0])

    msg = run_async(main())
    assert "unexpected ring chunk" in msg and "round" in msg


def test_rejects_non_float32() -> None:
    async def main() -> None:
        eps, rings, tasks = await _ring_of(1)
        try:
            with pytest.raises(ValueError):
                await rings[0].allreduce_sum(np.ones(4, np.float64), [], 0)
        finally:
            await _close(eps, rings, tasks)

    run_async(main())
