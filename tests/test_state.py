"""Handing θ and the outer optimizer's state to a node that lacks it (drift-state/1), over real
iroh endpoints: in bounded pieces, from several holders at once, only to members of the run, and
a holder cannot slip in another θ or another velocity (the checksum the swarm agreed on is the
root of every piece's digest, and each piece is checked as it arrives)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import numpy as np
import pytest
from conftest import run_async

from drift.diloco import PIECE_BYTES, ParamLayout, checksum
from drift.state import _DONORS, MAX_HEADER, StateError, StateServer, _donor_id, fetch_state, into_arrays
from drift.transport import STATE_ALPN, Endpoint

LAYOUT = ParamLayout(("a", "b", "bn.running_mean"), ((3, 4), (5,), (2,)), n_buffers=1)


def _state(seed: int, layout: ParamLayout = LAYOUT) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(layout.size).astype(np.float32), rng.standard_normal(layout.size).astype(np.float32)


def _serving(
    rnd: int, theta: np.ndarray, velocity: np.ndarray, layout: ParamLayout = LAYOUT, announced: str | None = None
) -> StateServer:
    server = StateServer()
    server.publish(rnd, (theta, velocity), announced or checksum(theta, velocity), layout)
    return server


def _fetch(
    server: StateServer, rnd: int, want: str, layout: ParamLayout = LAYOUT, member: bool = True, held: float = np.nan
):
    """(layout, θ, velocity) as a peer receives them, into arrays of its own (holding `held`)."""

    async def main():
        ep = await Endpoint.bind("local", alpns=(STATE_ALPN,))
        serving = asyncio.ensure_future(ep.serve({STATE_ALPN: server.handle}))
        client = await Endpoint.bind("local")
        if member:
            server.allowed = lambda peer: peer == client.node_id
        theta, velocity = np.full(layout.size, held, np.float32), np.full(layout.size, held, np.float32)
        try:
            got = await fetch_state(
                client, [ep.ticket()], rnd, want, into_arrays(theta, velocity), size=layout.size, timeout=10
            )
            return got, theta, velocity
        finally:
            serving.cancel()
            await client.close()
            await ep.close()

    return run_async(main())


def test_a_member_gets_exactly_the_agreed_state() -> None:
    theta, velocity = _state(0)
    layout, got_theta, got_velocity = _fetch(_serving(4, theta, velocity), 4, checksum(theta, velocity))
    assert layout == LAYOUT
    assert np.array_equal(got_theta, theta) and np.array_equal(got_velocity, velocity)


def test_a_zero_velocity_arrives_as_zeros_whatever_was_there() -> None:
    """No outer momentum: the donor's velocity is zeros. A node holding zeros keeps its own (their
    pages untouched); one holding anything else gets them overwritten."""
    theta, _ = _state(8)
    zeros = np.zeros_like(theta)
    for held in (0.0, 3.0, np.nan):
        _, got_theta, got_velocity = _fetch(_serving(2, theta, zeros), 2, checksum(theta, zeros), held=held)
        assert np.array_equal(got_theta, theta) and got_velocity.tobytes() == zeros.tobytes()


def test_a_state_larger_than_one_frame_streams_in_chunks() -> None:
    """No frame holds a whole θ: a 9.5 MiB θ (and as much velocity) arrives as 3 pieces each of at
    most PIECE_BYTES (4 MiB), counted where the receiver writes them, and exact."""
    big = ParamLayout(("w",), ((2_500_000,),))
    theta, velocity = _state(5, big)
    server = _serving(1, theta, velocity, big)
    got_theta, got_velocity = np.full(big.size, np.nan, np.float32), np.full(big.size, np.nan, np.float32)
    chunks: list[tuple[int, int, int]] = []

    def counting(layout: ParamLayout):
        write = into_arrays(got_theta, got_velocity)(layout)

        def each(which: int, offset: int, data: memoryview) -> None:
            chunks.append((which, offset, len(data)))
            write(which, offset, data)

        return each

    async def main() -> None:
        ep = await Endpoint.bind("local", alpns=(STATE_ALPN,))
        serving = asyncio.ensure_future(ep.serve({STATE_ALPN: server.handle}))
        client = await Endpoint.bind("local")
        server.allowed = lambda peer: peer == client.node_id
        try:
            await fetch_state(client, [ep.ticket()], 1, checksum(theta, velocity), counting, timeout=30)
        finally:
            serving.cancel()
            await client.close()
            await ep.close()

    run_async(main())
    size = 4 * big.size
    want = [(w, o, min(PIECE_BYTES, size - o)) for w in (0, 1) for o in range(0, size, PIECE_BYTES)]
    assert PIECE_BYTES == 4 << 20 and len(want) == 6 and sorted(chunks) == want, chunks
    assert np.array_equal(got_theta, theta) and np.array_equal(got_velocity, velocity)


def test_a_stranger_gets_nothing() -> None:
    theta, velocity = _state(1)
    with pytest.raises(StateError, match="not a member"):
        _fetch(_serving(2, theta, velocity), 2, checksum(theta, velocity), member=False)


def test_a_poisoned_velocity_is_refused() -> None:
    theta, velocity = _state(2)
    agreed = checksum(theta, velocity)
    bad = velocity.copy()
    bad[0] += 1.0  # same θ, another outer state, announced under the swarm's checksum
    with pytest.raises(StateError, match="not the swarm's"):
        _fetch(_serving(3, theta, bad, announced=agreed), 3, agreed)
    assert np.array_equal(_fetch(_serving(3, theta, velocity), 3, agreed)[2], velocity)


def test_a_donor_of_another_size_is_refused() -> None:
    theta, velocity = _state(3)
    small = ParamLayout(("a",), ((4,),))
    with pytest.raises(StateError, match="expected 19"):
        _fetch(_serving(1, theta[:4].copy(), velocity[:4].copy(), small), 1, checksum(theta, velocity))


def test_a_checkpoint_streams_from_a_donor_to_disk(tmp_path) -> None:
    """The coordinator's checkpoint: θ and the velocity stream from a donor, piece by piece, into
    the checkpoint's files (never whole in memory), and load back exact, buffers named as such."""
    from drift.checkpoint import CheckpointWriter, load_checkpoint

    big = ParamLayout(("w", "b", "bn.running_var"), ((1200, 1000), (1000,), (1000,)), n_buffers=1)  # 2 pieces each
    theta, velocity = _state(7, big)
    writers: list[CheckpointWriter] = []

    def sink(layout: ParamLayout):
        writers.append(CheckpointWriter(tmp_path / "ck", 9, layout.names, layout.shapes))
        return writers[-1].write

    async def main() -> None:
        server = _serving(9, theta, velocity, big)
        ep = await Endpoint.bind("local", alpns=(STATE_ALPN,))
        serving = asyncio.ensure_future(ep.serve({STATE_ALPN: server.handle}))
        client = await Endpoint.bind("local")
        server.allowed = lambda peer: peer == client.node_id
        try:
            await fetch_state(client, [ep.ticket()], 9, checksum(theta, velocity), sink, size=big.size, timeout=10)
        finally:
            serving.cancel()
            await client.close()
            await ep.close()

    run_async(main())
    path = writers[-1].commit({"buffers": big.n_buffers})
    ck = load_checkpoint(path)
    assert ck.names == big.names and ck.manifest["buffers"] == 1
    assert np.array_equal(ck.theta_flat, theta) and np.array_equal(ck.state_flat["velocity"], velocity)


def test_a_member_that_keeps_asking_cannot_hold_the_outer_step() -> None:
    """A reader holds a transfer open (it stops reading after the header) when the outer step
    comes: the step waits for it. A second request made meanwhile (a member that keeps asking) is
    not started before the step: once the first reader is done the step goes, and the second gets
    the next round's answer instead of holding the step for its own transfer."""
    big = ParamLayout(("w",), ((8_000_000,),))  # 61 MiB in all: more than the stream lets through unread
    theta, velocity = _state(6, big)
    server = _serving(4, theta, velocity, big)
    total = 2 * theta.nbytes

    async def main() -> list[str]:
        ep = await Endpoint.bind("local", alpns=(STATE_ALPN,))
        serving = asyncio.ensure_future(ep.serve({STATE_ALPN: server.handle}))
        a, b = await Endpoint.bind("local"), await Endpoint.bind("local")
        server.allowed = lambda peer: peer in (a.node_id, b.node_id)
        order: list[str] = []
        try:
            first = await a.connect(ep.ticket(), STATE_ALPN)
            await first.send_frame(b'{"round": 4}')
            head = json.loads(await first.recv_frame(MAX_HEADER))
            assert head["round"] == 4
            for i in range(len(head["pieces"])):  # asks for every piece, and reads no further
                await first.send_frame(json.dumps({"piece": i}).encode())

            async def outer_step() -> None:
                async with server.updating():
                    order.append("outer step")
                    server.publish(5, (theta, velocity), checksum(theta, velocity), big)

            step = asyncio.ensure_future(outer_step())
            await asyncio.sleep(0)  # the step waits for the transfer in flight
            second = await b.connect(ep.ticket(), STATE_ALPN)
            await second.send_frame(b'{"round": 4}')
            answer = asyncio.ensure_future(second.recv_frame(MAX_HEADER, timeout=60))
            await asyncio.sleep(0.5)  # (without the fix the second transfer starts here)
            got = 0
            while got < total:
                got += len(await first.recv_frame(PIECE_BYTES, timeout=60))
            # the second reader was held off, then told the round moved on (without the fix: round
            # 4's header, and the step would wait on for a reader that never reads)
            assert json.loads(await answer) == {"error": "have round 5"}
            await asyncio.wait_for(step, 60)
            return order
        finally:
            serving.cancel()
            for e in (a, b, ep):
                await e.close()

    assert run_async(main()) == ["outer step"]


def test_a_reader_that_does_not_read_cannot_hold_the_outer_step_and_gets_its_round_exact() -> None:
    """A reader asks for every piece of round 4 and reads none when the outer step comes: the step
    changes θ and publishes round 5 at once (the reader goes on from a copy of round 4), and the
    reader, reading at last, gets round 4 bit for bit, not a mix of the two."""
    big = ParamLayout(("w",), ((8_000_000,),))  # 61 MiB in all: more than the stream lets through unread
    theta, velocity = _state(7, big)
    before = (theta.copy(), velocity.copy())
    server = _serving(4, theta, velocity, big)

    async def main() -> tuple[int, bytes]:
        ep = await Endpoint.bind("local", alpns=(STATE_ALPN,))
        serving = asyncio.ensure_future(ep.serve({STATE_ALPN: server.handle}))
        a = await Endpoint.bind("local")
        server.allowed = lambda peer: peer == a.node_id
        try:
            reader = await a.connect(ep.ticket(), STATE_ALPN)
            await reader.send_frame(b'{"round": 4}')
            head = json.loads(await reader.recv_frame(MAX_HEADER))
            for i in range(len(head["pieces"])):
                await reader.send_frame(json.dumps({"piece": i}).encode())
            await asyncio.sleep(0.2)  # (the holder is sending, into a stream nobody reads)

            async with server.updating():
                np.add(theta, 1.0, out=theta)  # (in place: the live arrays the reader was served from)
                np.multiply(velocity, 2.0, out=velocity)
                server.publish(5, (theta, velocity), checksum(theta, velocity), big)
            in_flight = server._reading  # the step is done: is the transfer still under way?
            got = bytearray()
            while len(got) < 2 * theta.nbytes:
                got += await reader.recv_frame(PIECE_BYTES, timeout=60)
            return in_flight, bytes(got)
        finally:
            serving.cancel()
            for e in (a, ep):
                await e.close()

    in_flight, got = run_async(main())
    assert in_flight == 1  # the step did not wait for the transfer to end
    assert got == before[0].tobytes() + before[1].tobytes()


async def _holders(servers: list[StateServer], body, held: tuple[StateServer, ...] = (), release=None):
    """Serve each server on its own endpoint and run `body(client, tickets, asked)` (asked: the
    servers' names in the order connections reached them). The servers in `held` answer no request
    until `release(client, tickets, asked)` is true: their outer step is under way (StateServer.updating)."""
    eps = [await Endpoint.bind("local", alpns=(STATE_ALPN,)) for _ in servers]
    asked: list[int] = []

    def counting(k: int):
        async def handle(conn) -> None:
            asked.append(k)
            await servers[k].handle(conn)

        return handle

    serving = [asyncio.ensure_future(ep.serve({STATE_ALPN: counting(k)})) for k, ep in enumerate(eps)]
    client = await Endpoint.bind("local")
    for server in servers:
        server.allowed = lambda peer: peer == client.node_id
    try:
        async with contextlib.AsyncExitStack() as stack:
            for server in held:
                await stack.enter_async_context(server.updating())
            tickets = [e.ticket() for e in eps]
            run = asyncio.ensure_future(body(client, tickets, asked))
            while held and not run.done() and not release(client, tickets, asked):
                await asyncio.sleep(0.01)
        return await run
    finally:
        for t in serving:
            t.cancel()
        for e in (*eps, client):
            await e.close()


def test_theta_comes_from_several_holders_at_once_and_exact() -> None:
    """Three holders, 16 pieces: the joiner takes pieces from more than one of them at once,
    and what it writes is θ and the velocity bit for bit."""
    big = ParamLayout(("w",), ((8 << 20,),))  # 32 MiB of θ and as much velocity
    theta, velocity = _state(11, big)
    servers = [_serving(6, theta, velocity, big) for _ in range(3)]
    into = np.full(big.size, np.nan, np.float32), np.full(big.size, np.nan, np.float32)

    async def body(client, tickets, asked):
        return await fetch_state(client, tickets, 6, checksum(theta, velocity), into_arrays(*into), timeout=10)

    # the holders answer once all three have been asked (none gets a head start)
    assert (
        run_async(_holders(servers, body, held=tuple(servers), release=lambda client, tickets, asked: len(asked) == 3))
        == big
    )
    assert np.array_equal(into[0], theta) and np.array_equal(into[1], velocity)
    served = [s.served for s in servers]
    assert sum(served) == 2 * -(-theta.nbytes // PIECE_BYTES) and sum(n > 0 for n in served) >= 2, served


def test_a_holder_that_sends_a_bad_piece_is_passed_over_and_never_asked_again(caplog) -> None:
    """The liar hands out the swarm's manifest but another velocity (its θ changed after its
    checksum was taken): its first bad piece names it a liar, the others serve that piece
    instead, and the next fetch (another round, the liar named first again) does not ask it."""
    theta, velocity = _state(4)
    agreed = checksum(theta, velocity)  # (the digests this process computed: the liar serves them)
    bad = velocity.copy()
    bad[0] += 1.0
    liar, honest = _serving(3, theta, bad, announced=agreed), [_serving(3, theta, velocity) for _ in range(2)]
    servers = [liar, *honest]

    async def body(client, tickets, asked):
        got = []
        for rnd in (3, 4):
            for server in servers:
                server.publish(rnd, (theta, bad if server is liar else velocity), agreed, LAYOUT)
            into = np.full(LAYOUT.size, np.nan, np.float32), np.full(LAYOUT.size, np.nan, np.float32)
            await fetch_state(client, tickets, rnd, agreed, into_arrays(*into), timeout=10)
            got.append(into[1])
            if rnd == 3:
                assert _DONORS[client.node_id][_donor_id(tickets[0])] == "lied"
                assert len(asked) == 3
        return got

    def caught(client, tickets, asked) -> bool:  # the honest holders wait for the liar's bad piece
        return _DONORS.get(client.node_id, {}).get(_donor_id(tickets[0])) == "lied"

    with caplog.at_level("WARNING", logger="drift.state"):
        got = run_async(_holders(servers, body, held=tuple(honest), release=caught))
    assert all(np.array_equal(v, velocity) for v in got)
    assert "its piece 1 is not the swarm's" in caplog.text
    assert liar.served == 2  # round 3: θ's piece (good), then the velocity's (bad); round 4: none


def test_a_holder_that_stalls_costs_one_piece_timeout(caplog) -> None:
    """A holder sends the manifest, then nothing: it is dropped after the first piece it was asked
    for, both pieces it had in flight go to the others, and the fetch ends exact."""

    class Stalling(StateServer):
        async def _send_piece(self, ch, data, timeout) -> None:
            asked_piece.set()
            await asyncio.sleep(3600)

    asked_piece = asyncio.Event()
    theta, velocity = _state(12)
    staller = Stalling()
    staller.publish(7, (theta, velocity), checksum(theta, velocity), LAYOUT)
    honest = [_serving(7, theta, velocity) for _ in range(2)]
    into = np.full(LAYOUT.size, np.nan, np.float32), np.full(LAYOUT.size, np.nan, np.float32)

    async def body(client, tickets, asked):
        await fetch_state(client, tickets, 7, checksum(theta, velocity), into_arrays(*into), timeout=1)
        return _DONORS[client.node_id][_donor_id(tickets[0])]

    with caplog.at_level("WARNING", logger="drift.state"):
        known = run_async(
            _holders(
                [staller, *honest],
                body,
                held=tuple(honest),
                release=lambda client, tickets, asked: asked_piece.is_set(),
            )
        )
    assert np.array_equal(into[0], theta) and np.array_equal(into[1], velocity)
    lines = [r.getMessage() for r in caplog.records if "passing over" in r.getMessage()]
    assert len(lines) == 1 and "piece 0 not received within" in lines[0], lines
    assert known == "failed" and staller.served == 0 and sum(s.served for s in honest) == 2


def test_a_manifest_that_is_not_the_agreed_checksum_is_refused() -> None:
    """A holder whose θ is not the swarm's (its own checksum, honestly): its manifest does not make
    the agreed root, so nothing of it is written and it is named a liar."""
    theta, velocity = _state(13)
    other = theta.copy()
    other[5] = 0.0
    written: list[int] = []

    def sink(layout: ParamLayout):
        written.append(1)
        return into_arrays(np.zeros_like(theta), np.zeros_like(velocity))(layout)

    async def body(client, tickets, asked):
        try:
            await fetch_state(client, tickets, 2, checksum(theta, velocity), sink, timeout=10)
        except StateError as e:
            return str(e), _DONORS[client.node_id][_donor_id(tickets[0])]
        return "took it", None

    error, known = run_async(_holders([_serving(2, other, velocity)], body))
    assert (
        f"its pieces make the checksum {checksum(other, velocity)}, not the swarm's {checksum(theta, velocity)}"
        in error
    )
    assert known == "lied" and written == []


def test_a_node_taking_theta_from_a_peer_refuses_requests_at_once_instead_of_holding_them() -> None:
    """B's arrays are being replaced from a peer when A asks B for θ (an abandoned round sends
    every node to fetch the round before): A is refused at once while B is still fetching, and
    asks another holder. Before, A's request waited for B's fetch to end; with B fetching from A
    the same way, both waited for good (241 s a round)."""
    theta, velocity = _state(8)
    b = _serving(3, theta.copy(), velocity.copy())

    async def main() -> str:
        ep_a, ep_b = await Endpoint.bind("local"), await Endpoint.bind("local", alpns=(STATE_ALPN,))
        serving = asyncio.ensure_future(ep_b.serve({STATE_ALPN: b.handle}))
        b.allowed = lambda peer: peer == ep_a.node_id
        into = into_arrays(np.zeros_like(theta), np.zeros_like(velocity))
        try:
            async with b.updating(fetching=True):  # (B's own fetch, held until A has its answer)
                try:
                    await fetch_state(
                        ep_a, [ep_b.ticket()], 3, checksum(theta, velocity), into, size=LAYOUT.size, timeout=20
                    )
                except StateError as e:
                    return str(e)
            return "took it"
        finally:
            serving.cancel()
            for e in (ep_a, ep_b):
                await e.close()

    assert "busy: taking θ from a peer" in run_async(main())


def test_a_holder_that_no_longer_remembers_the_digests_hashes_its_state_again() -> None:
    """The piece digests come with the checksum a node computes each round; a holder that has
    not computed it lately (it took θ long ago, many checksums since) hashes its arrays again to
    hand out the manifest."""
    from drift.diloco import _RECENT_MAX, pieces_of

    theta, velocity = _state(14)
    agreed = checksum(theta, velocity)
    for k in range(_RECENT_MAX):  # as many newer checksums as a process remembers
        checksum(np.full(1, k, np.float32))
    assert pieces_of(agreed) is None
    _, got_theta, got_velocity = _fetch(_serving(5, theta, velocity, announced=agreed), 5, agreed)
    assert np.array_equal(got_theta, theta) and np.array_equal(got_velocity, velocity)
