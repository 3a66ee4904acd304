"""Handing θ and the outer optimizer's state to a node that lacks it (drift-state/0), over real
iroh endpoints: only members of the run get it, and a donor cannot slip in another θ or another
velocity (the checksum the swarm agreed on covers both)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_async
from drift.diloco import ParamLayout, checksum
from drift.state import StateError, StateServer, fetch_state
from drift.transport import STATE_ALPN, Endpoint

LAYOUT = ParamLayout(("a", "b"), ((3, 4), (5,)))


async def _serve(server: StateServer) -> tuple[Endpoint, object]:
    import asyncio

    ep = await Endpoint.bind("local", alpns=(STATE_ALPN,))

    async def accept() -> None:
        while True:
            _, conn = await ep.accept()
            asyncio.ensure_future(server.handle(conn))

    return ep, asyncio.ensure_future(accept())


def _state(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(LAYOUT.size).astype(np.float32), rng.standard_normal(LAYOUT.size).astype(np.float32)


def _fetch(server: StateServer, rnd: int, want: str, member: bool = True):  # noqa: ANN202
    async def main():  # noqa: ANN202
        ep, task = await _serve(server)
        client = await Endpoint.bind("local")
        if member:
            server.allowed = lambda peer: peer == client.node_id
        try:
            return await fetch_state(client, [ep.ticket()], rnd, want, LAYOUT.size, timeout=10)
        finally:
            task.cancel()
            await client.close()
            await ep.close()
    return run_async(main())


def test_a_member_gets_exactly_the_agreed_state() -> None:
    theta, velocity = _state(0)
    server = StateServer(LAYOUT)
    server.publish(4, theta, velocity)
    snap = _fetch(server, 4, checksum(theta, velocity))
    assert snap.round == 4 and snap.layout == LAYOUT
    assert np.array_equal(snap.theta, theta) and np.array_equal(snap.velocity, velocity)


def test_a_stranger_gets_nothing() -> None:
    theta, velocity = _state(1)
    server = StateServer(LAYOUT)  # allowed: nobody by default
    server.publish(2, theta, velocity)
    with pytest.raises(StateError, match="not a member"):
        _fetch(server, 2, checksum(theta, velocity), member=False)


def test_a_poisoned_velocity_is_refused() -> None:
    theta, velocity = _state(2)
    agreed = checksum(theta, velocity)
    server = StateServer(LAYOUT)
    bad = velocity.copy()
    bad[0] += 1.0                       # same θ, another outer state
    server.publish(3, theta, bad)
    with pytest.raises(StateError, match="not the swarm's"):
        _fetch(server, 3, agreed)
    server.publish(3, theta, velocity)  # the right one passes
    assert _fetch(server, 3, agreed).round == 3
