"""Strangers cost nothing, and no transfer waits forever (issue 20).

Real iroh endpoints on loopback: a stranger (or one endpoint) holding many idle connections to
the coordinator's drift/0 or a state server's drift-state/0 must not keep an allowlisted node
from joining, nor a member from fetching θ, and its refusals stay a few lines of metrics.jsonl.
A donor that trickles bytes cannot hold a fetch past its deadline, a reader that does not read
cannot hold the donor's outer step, and a donor's tensors in another order are refused.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import iroh
import numpy as np
import pytest
from conftest import dropped, run_async

from drift import protocol as P
from drift.auth import NodeKey
from drift.coordinator import MAX_JOINING, MAX_JOINING_PER_PEER, MAX_JOINING_PER_SOURCE, Coordinator
from drift.diloco import ParamLayout, checksum, pieces_of
from drift.monitor import Monitor
from drift.node import JOIN_TRIES, REJOIN_PATIENCE_S, join_again
from drift.recipe import load_recipe
from drift.state import MAX_CLIENTS, StateError, StateServer, fetch_state, into_arrays
from drift.transport import CONTROL_ALPN, MAX_CONTROL_FRAME, STATE_ALPN, Endpoint, TransportError, parse_ticket

IDLE = MAX_JOINING + 16  # more idle connections than there are joining slots in all


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


async def _idle_connections(ep: Endpoint, ticket: str, alpn: bytes, n: int) -> list[iroh.Connection]:
    """n QUIC connections from one endpoint that never open a stream (what an attacker holds)."""
    addr = parse_ticket(ticket)
    return [await asyncio.wait_for(ep.ep.connect(addr, alpn), 10) for _ in range(n)]


async def _hello(ep: Endpoint, ticket: str) -> P.Message:
    """A node's first exchange: NodeInfo out, the coordinator's first answer back."""
    ch = await ep.connect(ticket, CONTROL_ALPN)
    info = P.NodeInfo(node_id=ep.node_id, name="n", backend="torch", device="cpu", ring_ticket=ep.ticket())
    await ch.send_frame(P.encode(info))
    return P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=20))


@pytest.mark.parametrize("allowlisted", [True, False])
def test_idle_connections_of_one_endpoint_do_not_lock_out_a_joining_node(
    tiny_recipe: Path, tmp_path: Path, allowlisted: bool
) -> None:
    """With an allowlist the flood comes from a stranger; without one, from one endpoint that
    anyone with the ticket may run. Either way the node that joins next is served."""
    recipe = load_recipe(tiny_recipe)
    good = NodeKey.generate()
    if allowlisted:
        recipe.allowlist, recipe.min_nodes = [good.node_id], 1
    run_dir = tmp_path / "run"

    async def main():
        monitor = Monitor(run_dir, live=False)
        coord = Coordinator(recipe, run_dir, monitor=monitor)
        ticket = await coord.start()
        flood = await Endpoint.bind("local")
        told = await Endpoint.bind("local")  # a second stranger, a real node that asks and listens
        node = await Endpoint.bind("local", secret_key=good.seed)
        try:
            held = await _idle_connections(flood, ticket, CONTROL_ALPN, IDLE)
            answer_told = await _hello(told, ticket) if allowlisted else None
            answer = await _hello(node, ticket)
            return held, answer_told, answer, flood.node_id
        finally:
            await coord.close()
            monitor.close()
            for ep in (flood, told, node):
                await ep.close()

    held, answer_told, answer, flood_id = run_async(main(), 120)
    assert len(held) == IDLE
    assert isinstance(answer, P.TrainConfig), answer  # admitted to the handshake, not "already joining"
    if allowlisted:  # an honest stranger is still told why, and what its operator can do
        assert isinstance(answer_told, P.TrainingCancel) and "not on this swarm's allowlist" in answer_told.reason
    about_flood = [e for e in _events(run_dir) if flood_id[:10] in json.dumps(e)]
    if allowlisted:  # a stranger's flood is a line of metrics.jsonl, not two per connection
        assert len(about_flood) == 1 and "not on this swarm's allowlist" in about_flood[0]["reason"], about_flood
        assert not [e for e in _events(run_dir) if e["event"] == "node_refused"]
    else:  # 4 of its connections hold slots; the others are refused, a line at most a minute
        assert 1 <= len(about_flood) <= IDLE - MAX_JOINING_PER_PEER, about_flood
        assert all("connections from this node are already joining" in e["reason"] for e in about_flood)


async def _bind_at(host: str) -> Endpoint:
    """An endpoint of a fresh id on a loopback address of its own (127.0.0.2: another machine)."""
    opts = iroh.EndpointOptions(
        preset=iroh.preset_minimal(), bind_addr=f"{host}:0", alpns=[], secret_key=NodeKey.generate().seed
    )
    return Endpoint(await iroh.Endpoint.bind(opts), "local")


def test_fresh_ids_from_one_address_do_not_lock_out_a_joining_node(
    tiny_recipe: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No allowlist: one machine makes 16 node ids (free) and holds 4 joining connections with
    each, as many as there are joining slots in all. It gets MAX_JOINING_PER_SOURCE of them; a
    node from another address is still served."""
    recipe = load_recipe(tiny_recipe)
    run_dir = tmp_path / "run"
    ids = MAX_JOINING // MAX_JOINING_PER_PEER

    async def main():
        monitor = Monitor(run_dir, live=False)
        coord = Coordinator(recipe, run_dir, monitor=monitor)
        ticket = await coord.start()
        flood = [await _bind_at("127.0.0.2") for _ in range(ids)]
        node = await Endpoint.bind("local")
        try:
            held = [c for ep in flood for c in await _idle_connections(ep, ticket, CONTROL_ALPN, MAX_JOINING_PER_PEER)]
            while coord._joining_conns + coord._busy.count < len(held):  # it has seen each of them
                await asyncio.sleep(0.02)
            answer = await _hello(node, ticket)
            return coord._joining_conns, coord._busy.count, dropped(caplog), answer
        finally:
            await coord.close()
            monitor.close()
            for ep in (*flood, node):
                await ep.close()

    holding, refused, rejected, answer = run_async(main(), 120)
    assert isinstance(answer, P.TrainConfig), answer  # admitted to the handshake, not "already joining"
    assert holding == MAX_JOINING_PER_SOURCE + 1 < MAX_JOINING  # the flood's share, and the node
    assert refused == MAX_JOINING - MAX_JOINING_PER_SOURCE
    # a line per node id at most (they come back by themselves: a thousand knocking is a few lines)
    assert 1 <= len(rejected) <= ids, rejected
    assert all(f"{MAX_JOINING_PER_SOURCE} connections from 127.0.0.2 are already joining" in r for r in rejected)
    # ... and says it is busy, so that an honest node refused with these (many nodes of one machine
    # that start at once: `--local 32`) tries again, until the node's patience runs out
    assert all(join_again([r] * 9, reached=False, waited_s=60.0) for r in rejected)
    assert not any(join_again([r] * 9, reached=False, waited_s=REJOIN_PATIENCE_S + 1) for r in rejected)


def test_a_node_refused_while_the_coordinator_is_busy_with_handshakes_tries_again() -> None:
    """An endpoint with its QUIC handshakes full refuses the connection itself (a thousand nodes
    that start at once): the node is told nothing more, and must come back like one refused as
    busy, not give up as if the coordinator were unreachable."""

    async def main() -> str:
        coord = await Endpoint.bind("local", alpns=[CONTROL_ALPN])
        serving = asyncio.ensure_future(coord.serve({CONTROL_ALPN: lambda conn: asyncio.sleep(1)}, max_handshakes=0))
        node = await Endpoint.bind("local")
        try:
            await node.connect(coord.ticket(), CONTROL_ALPN, timeout=10)
        except TransportError as e:
            return str(e)
        finally:
            serving.cancel()
            await node.close()
            await coord.close()
        return "connected"

    reason = run_async(main(), 60)
    assert join_again([reason] * 9, reached=False, waited_s=60.0), reason
    assert not join_again([reason] * 9, reached=False, waited_s=REJOIN_PATIENCE_S + 1)


def test_a_node_tries_its_handshake_again_only_when_that_can_help() -> None:
    assert not join_again(["cannot reach the coordinator: timed out"], reached=False, waited_s=0.0)
    hung_up = "connection lost: the peer closed the connection"  # reached, then no word: a transient fault
    assert join_again([hung_up] * (JOIN_TRIES - 1), reached=True, waited_s=5.0)
    assert not join_again([hung_up] * JOIN_TRIES, reached=True, waited_s=5.0)
    # a busy coordinator's answers are not hang-ups: they leave every try for a real fault
    busy = f"the coordinator hung up ({P.JOIN_BUSY}: 16 connections from 127.0.0.1 are already joining)"
    assert join_again([busy] * 5 + [hung_up] * (JOIN_TRIES - 1), reached=True, waited_s=5.0)
    assert not join_again([busy, *[hung_up] * JOIN_TRIES], reached=True, waited_s=5.0)


def test_strangers_on_the_state_alpn_cost_a_member_nothing() -> None:
    """Idle drift-state/0 connections of a stranger are closed at once and hold no slot: a
    member's fetch right after them is served."""
    layout = ParamLayout(("w",), ((256,),))
    rng = np.random.default_rng(0)
    theta, velocity = rng.standard_normal(256).astype(np.float32), rng.standard_normal(256).astype(np.float32)
    lines: list[tuple[str, str]] = []

    async def main():
        server = StateServer()
        server.publish(3, (theta, velocity), checksum(theta, velocity), layout)
        donor = await Endpoint.bind("local", alpns=(STATE_ALPN,))
        serving = asyncio.ensure_future(
            donor.serve({STATE_ALPN: lambda conn: server.handle(conn, on_drop=lambda *a: lines.append(a))})
        )
        stranger, member = await Endpoint.bind("local"), await Endpoint.bind("local")
        server.allowed = lambda peer: peer == member.node_id
        got_theta, got_velocity = np.zeros_like(theta), np.zeros_like(velocity)
        try:
            await _idle_connections(stranger, donor.ticket(), STATE_ALPN, MAX_CLIENTS + 16)
            while len(lines) + server._clients < MAX_CLIENTS + 16:  # the server has seen each of them
                await asyncio.sleep(0.02)
            await fetch_state(
                member, [donor.ticket()], 3, checksum(theta, velocity), into_arrays(got_theta, got_velocity), timeout=10
            )
            return got_theta, got_velocity, stranger.node_id
        finally:
            serving.cancel()
            for ep in (stranger, member, donor):
                await ep.close()

    got_theta, got_velocity, stranger_id = run_async(main(), 120)
    assert np.array_equal(got_theta, theta) and np.array_equal(got_velocity, velocity)
    # One line per refused connection at most (the coordinator and nodes throttle them further).
    assert lines and all(peer == stranger_id and "not a member" in why for peer, why in lines), lines


async def _trickling_donor(layout: ParamLayout, theta: np.ndarray, velocity: np.ndarray):
    """A hostile donor: a valid header and manifest, then each piece asked for one byte every 0.3 s."""

    async def handle(conn) -> None:
        ch = await Endpoint.accept_channel(conn, timeout=10)
        await ch.recv_frame(256, timeout=10)
        head = {
            "round": 1,
            "checksum": checksum(theta, velocity),
            "n": layout.size,
            "names": list(layout.names),
            "shapes": [list(s) for s in layout.shapes],
            "pieces": [d.hex() for d in pieces_of(checksum(theta, velocity))],
        }
        await ch.send_frame(json.dumps(head).encode())
        i = json.loads(await ch.recv_frame(256, timeout=10))["piece"]
        data = (theta, velocity)[i].tobytes()
        await ch._send.write_all(len(data).to_bytes(4, "big"))  # (a frame's header, then its body byte by byte)
        for b in data:
            await ch._send.write_all(bytes([b]))
            await asyncio.sleep(0.3)

    ep = await Endpoint.bind("local", alpns=(STATE_ALPN,))
    return ep, asyncio.ensure_future(ep.serve({STATE_ALPN: handle}))


def test_a_trickling_donor_cannot_hold_a_fetch_past_its_deadline() -> None:
    layout = ParamLayout(("w",), ((64,),))
    theta, velocity = np.ones(64, np.float32), np.zeros(64, np.float32)

    async def main():
        donor, serving = await _trickling_donor(layout, theta, velocity)
        client = await Endpoint.bind("local")
        try:
            with pytest.raises(StateError, match="piece 0 not received within") as e:
                # Each byte comes well within timeout=1.0; the piece as a whole does not.
                await asyncio.wait_for(
                    fetch_state(
                        client,
                        [donor.ticket()],
                        1,
                        checksum(theta, velocity),
                        into_arrays(np.zeros(64, np.float32), np.zeros(64, np.float32)),
                        timeout=1.0,
                    ),
                    60,  # only a guard against the hang this test is about
                )
            return str(e.value)
        finally:
            serving.cancel()
            await client.close()
            await donor.close()

    assert "MiB/s" in run_async(main(), 120)


def test_a_reader_that_does_not_read_cannot_hold_the_donors_outer_step() -> None:
    """The outer step (`updating()`) goes at once while a transfer is in flight (it reads on from a
    copy); a reader that stops reading falls behind the minimum rate and is dropped, which frees
    its slot and the copy."""
    n = 8 << 20  # 64 MiB of θ + velocity: more than any QUIC window buffers
    layout = ParamLayout(("w",), ((n,),))
    theta, velocity = np.ones(n, np.float32), np.zeros(n, np.float32)
    drops: list[str] = []

    async def main():
        server = StateServer(min_rate=256 << 20, slack=1.0)
        server.publish(5, (theta, velocity), checksum(theta, velocity), layout)
        donor = await Endpoint.bind("local", alpns=(STATE_ALPN,))
        serving = asyncio.ensure_future(
            donor.serve({STATE_ALPN: lambda conn: server.handle(conn, on_drop=lambda p, why: drops.append(why))})
        )
        reader = await Endpoint.bind("local")
        server.allowed = lambda peer: peer == reader.node_id
        try:
            ch = await reader.connect(donor.ticket(), STATE_ALPN)
            await ch.send_frame(json.dumps({"round": 5}).encode())
            head = json.loads(await ch.recv_frame(1 << 20, timeout=10))
            while not server._reading:  # the transfer is under way: it has the arrays
                await asyncio.sleep(0.01)
            # ...and the reader reads nothing more. The outer step still happens, at once.
            async with server.updating():
                theta[0] = 2.0
            assert server._reading == 1 and not drops  # (the transfer is still under way)
            for _ in range(1000):  # until it falls behind the minimum rate: 1 s + 64 MiB / 256 MiB/s
                if drops:
                    break
                await asyncio.sleep(0.01)
            return head
        finally:
            serving.cancel()
            await reader.close()
            await donor.close()

    head = run_async(main(), 120)
    assert head["n"] == n
    assert any("reader too slow" in d for d in drops), drops


def test_a_donor_whose_tensors_are_in_another_order_is_refused() -> None:
    """Two same-shaped tensors swapped: the bytes and checksum are the agreed ones, the labels
    are not. The node checks them against the model it built itself."""
    mine = ParamLayout(("a", "b"), ((4,), (4,)))
    swapped = ParamLayout(("b", "a"), ((4,), (4,)))
    theta, velocity = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)

    async def main():
        server = StateServer()
        server.publish(2, (theta, velocity), checksum(theta, velocity), swapped)
        donor = await Endpoint.bind("local", alpns=(STATE_ALPN,))
        serving = asyncio.ensure_future(donor.serve({STATE_ALPN: server.handle}))
        client = await Endpoint.bind("local")
        server.allowed = lambda peer: peer == client.node_id
        try:
            with pytest.raises(StateError, match="not this model's: tensor 0 is 'b', here 'a'"):
                await fetch_state(
                    client,
                    [donor.ticket()],
                    2,
                    checksum(theta, velocity),
                    into_arrays(np.zeros(8, np.float32), np.zeros(8, np.float32)),
                    layout=mine,
                    timeout=10,
                )
        finally:
            serving.cancel()
            await client.close()
            await donor.close()

    run_async(main(), 60)
