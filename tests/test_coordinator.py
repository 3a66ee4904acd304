"""The coordinator survives bad peers: malformed, truncated, oversized and unexpected frames; and
it takes θ (a checkpoint, Ctrl-C's last one) only from nodes that can still hand it over."""

from __future__ import annotations

import asyncio
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import dropped, make_task_repo, run_async

from drift import protocol as P
from drift.checkpoint import load_checkpoint
from drift.coordinator import Coordinator
from drift.diloco import ParamLayout, checksum
from drift.recipe import load_recipe
from drift.round import RoundResult
from drift.state import StateServer
from drift.swarm import Peer
from drift.transport import CONTROL_ALPN, MAX_CONTROL_FRAME, STATE_ALPN, Endpoint


def test_bad_frames_are_dropped_and_coordinator_keeps_serving(
    tiny_recipe: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = load_recipe(tiny_recipe)

    async def main() -> tuple[list[str], P.Message]:
        coord = Coordinator(recipe, tmp_path / "run")
        ticket = await coord.start()
        clients: list[Endpoint] = []
        channels = []  # kept alive: dropping the last handle closes a QUIC connection at once
        try:

            async def bad(send) -> None:
                ep = await Endpoint.bind("local")
                clients.append(ep)
                ch = await ep.connect(ticket, CONTROL_ALPN)
                await send(ch)
                channels.append(ch)

            async def garbage(ch) -> None:
                await ch.send_frame(b"\xff\x00 not json")

            async def truncated(ch) -> None:
                await ch._send.write_all(struct.pack(">I", 100) + b"only ten b")
                await ch.finish()  # the stream ends 90 bytes short

            async def oversized(ch) -> None:
                await ch._send.write_all(struct.pack(">I", MAX_CONTROL_FRAME + 1) + b"x" * 64)

            async def unexpected(ch) -> None:
                await ch.send_frame(P.encode(P.Ping()))

            async def impostor(ch) -> None:
                await ch.send_frame(
                    P.encode(P.NodeInfo(node_id="f" * 64, name="x", backend="torch", device="cpu", ring_ticket="t"))
                )

            for send in (garbage, truncated, oversized, unexpected, impostor):
                await bad(send)
            for _ in range(100):  # the drops happen in the coordinator's own tasks
                if len(dropped(caplog)) == 5:
                    break
                await asyncio.sleep(0.1)

            # A well-behaved node is still served.
            good = await Endpoint.bind("local")
            clients.append(good)
            ch = await good.connect(ticket, CONTROL_ALPN)
            await ch.send_frame(
                P.encode(
                    P.NodeInfo(
                        node_id=good.node_id, name="good", backend="torch", device="cpu", ring_ticket=good.ticket()
                    )
                )
            )
            reply = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=20))
            return dropped(caplog), reply
        finally:
            await coord.close()
            for c in clients:
                await c.close()

    rejected, reply = run_async(main())
    assert isinstance(reply, P.TrainConfig) and reply.recipe["name"] == "tiny"
    text = "\n".join(rejected)
    assert len(rejected) == 5, text
    assert "not JSON" in text
    assert "reading a 100-byte frame" in text  # truncated
    assert f"exceeds the {MAX_CONTROL_FRAME}-byte cap" in text
    assert "expected NodeInfo first, got Ping" in text
    assert "not the id of the connecting endpoint" in text


def test_a_member_that_stops_reading_does_not_keep_the_others_from_being_pinged(tmp_path: Path) -> None:
    """A member stops reading its control stream: a send to it fills its window and waits (up to
    a send's timeout, then it is dropped). Meanwhile every other member still hears a Ping within
    its patience, or it would take the coordinator for gone and leave."""
    recipe = load_recipe(make_task_repo(tmp_path / "repo", heartbeat_s=0.1, stale_after_s=1.5))

    async def main() -> list[float]:
        coord = Coordinator(recipe, tmp_path / "run")
        await coord.start()
        server, stuck_end, honest_end = [await Endpoint.bind("local") for _ in range(3)]
        try:
            peers = []
            for client in (stuck_end, honest_end):  # the coordinator's side of two members' channels
                accepting = asyncio.ensure_future(server.accept())
                ch = await client.connect(server.ticket(), CONTROL_ALPN)
                await ch.send_frame(b"hello")
                _, conn = await accepting
                theirs = await Endpoint.accept_channel(conn)
                await theirs.recv_frame(64)
                peers.append((ch, theirs))
            (_, stuck), (honest_ch, honest) = peers
            for node_id, mine in ((stuck_end.node_id, stuck), (honest_end.node_id, honest)):
                info = P.NodeInfo(node_id=node_id, name=node_id[:4], backend="numpy", device="cpu", ring_ticket="t")
                coord.ready[node_id] = Peer(info, mine)  # (stuck first: the ping pass reaches it first)

            async def fill() -> None:  # frames to the member that does not read: its window (~1 MiB) fills
                for _ in range(8):
                    await stuck.send_frame(b"x" * (MAX_CONTROL_FRAME // 2), timeout=30)

            blocked = asyncio.ensure_future(fill())
            gaps, last = [], asyncio.get_running_loop().time()
            while len(gaps) < 3:  # the honest member reads as a node does, within its patience
                assert isinstance(P.decode(await honest_ch.recv_frame(MAX_CONTROL_FRAME, timeout=30)), P.Ping)
                now = asyncio.get_running_loop().time()
                gaps.append(now - last)
                last = now
            assert not blocked.done()  # (the send to the member that does not read still waits)
            return gaps
        finally:
            coord.ready.clear()
            await coord.close()
            for ep in (server, stuck_end, honest_end):
                await ep.close()

    gaps = run_async(main(), timeout=120)
    assert max(gaps) < recipe.stale_after_s, gaps


def test_a_node_flooding_data_reports_fills_no_disk(tiny_recipe: Path, tmp_path: Path) -> None:
    """A member sends a thousand DataReports (each with a reason of the longest size allowed):
    metrics.jsonl keeps MAX_DATA_REPORTS of them, not one event each."""
    from drift.coordinator import MAX_DATA_REPORTS
    from drift.monitor import Monitor
    from drift.swarm import Peer

    monitor = Monitor(tmp_path / "run", live=False)
    coord = Coordinator(load_recipe(tiny_recipe), tmp_path / "run", monitor=monitor)
    info = P.NodeInfo(node_id="ab" * 32, name="flood", backend="torch", device="cpu", ring_ticket="t")
    flood = Peer(info, ch=None)
    for _ in range(1000):
        coord.data_report(flood, P.DataReport(kind="bad_chunk", round=0, reason="x" * P.MAX_TEXT))
    monitor.close()
    events = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"data_bad_chunk"' in e for e in events) == MAX_DATA_REPORTS


# --- who is asked for θ ---------------------------------------------------------------------------

LAYOUT = ParamLayout(("w", "b"), ((3, 4), (5,)))
THETA = np.arange(LAYOUT.size, dtype=np.float32)
VELOCITY = -THETA
AGREED = checksum(THETA, VELOCITY)


class Donors:
    """Nodes of a coordinator's swarm that hold θ of round 3 and serve it on real iroh endpoints
    (drift-state/1), as members do; `asked` names each one that was asked, in order."""

    def __init__(self, coord: Coordinator):
        self.coord = coord
        self.asked: list[str] = []
        self.eps: list[Endpoint] = []
        self.tasks: list[asyncio.Future] = []
        coord.n_params = LAYOUT.size
        coord.swarm.checksums[3] = AGREED
        coord.samples_at[3], coord.positions[3] = 96, {}

    async def add(self, name: str, speed: float, lies: bool = False) -> Peer:
        """A member holding θ of round 3, connected (in coord.ready), `speed` samples/s; one that
        `lies` serves another velocity under the agreed checksum."""
        server = StateServer(allowed=lambda peer: peer == self.coord.endpoint.node_id)
        server.publish(3, (THETA, VELOCITY + 1 if lies else VELOCITY), AGREED, LAYOUT)
        ep = await Endpoint.bind("local", alpns=(STATE_ALPN,))

        async def handle(conn) -> None:
            self.asked.append(name)
            await server.handle(conn)

        self.eps.append(ep)
        self.tasks.append(asyncio.ensure_future(ep.serve({STATE_ALPN: handle})))
        info = P.NodeInfo(node_id=ep.node_id, name=name, backend="numpy", device="cpu", ring_ticket=ep.ticket())
        peer = Peer(info, ch=None)  # type: ignore[arg-type]  # (no control connection: nothing is sent)
        self.coord.ready[peer.id] = peer
        self.coord.swarm.enter(peer, -1)
        self.coord.swarm.speed[peer.id] = speed
        self.coord.swarm.holds(peer.id, 3)
        return peer

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for ep in self.eps:
            await ep.close()


def _holds_the_agreed_theta(path: Path | None) -> None:
    assert path is not None
    ck = load_checkpoint(path)
    assert ck.round == 3 and ck.manifest["checksum"] == AGREED
    assert np.array_equal(ck.theta_flat, THETA) and np.array_equal(ck.state_flat["velocity"], VELOCITY)


def test_theta_is_never_asked_of_a_node_that_left_or_whose_connection_ended(tiny_recipe: Path, tmp_path: Path) -> None:
    """A node dropped from the run (drift coord --local drops one whose process exited) stays
    connected for a moment and still serves its θ; one whose control connection just ended is a
    member until the round loop reads that. Both joined first and are the fastest, yet the
    checkpoint takes θ from the member that can hand it over, and neither is asked."""

    async def main() -> tuple[Path | None, list[str]]:
        coord = Coordinator(load_recipe(tiny_recipe), tmp_path / "run")
        await coord.start()
        donors = Donors(coord)
        try:
            left = await donors.add("left", speed=300.0)
            gone = await donors.add("gone", speed=200.0)
            await donors.add("live", speed=100.0)
            coord.swarm.leave(left.id)  # as Coordinator.drop does (its connection closes later)
            gone.gone = "connection closed"  # as the connection's reader does when it ends
            path = await coord.checkpoint(3, {"checksum": AGREED})
            return path, donors.asked
        finally:
            coord.ready.clear()  # (no control connections to close)
            await donors.close()
            await coord.close()

    path, asked = run_async(main())
    assert asked == ["live"]
    _holds_the_agreed_theta(path)


def test_ctrl_c_asks_the_next_holder_when_the_first_does_not_answer(tiny_recipe: Path, tmp_path: Path) -> None:
    """Ctrl-C (or a --local node that died) keeps the newest finished round. The fastest holder's
    machine is gone without a word (its connection not yet known to be closed), so a connect to
    it hangs: it is given up after its per-donor wait, the next holder hands θ over, and the
    stop names the checkpoint written."""

    async def main() -> str:
        coord = Coordinator(load_recipe(tiny_recipe), tmp_path / "run")
        await coord.start()
        donors = Donors(coord)
        try:
            await donors.add("dead", speed=300.0)
            await donors.add("live", speed=100.0)
            await donors.eps[0].close()  # its machine died
            coord.ready.clear()  # (no control connections here: nobody to tell that the run stopped)
            return await coord.interrupt("stopped", per_donor_s=1.0)
        finally:
            await donors.close()
            await coord.close()

    line = run_async(main())
    assert line.startswith("checkpoint of round 3: "), line
    _holds_the_agreed_theta(Path(line.removeprefix("checkpoint of round 3: ")))


def test_a_checkpoint_asks_at_most_donor_tries_holders(tiny_recipe: Path, tmp_path: Path) -> None:
    """However many nodes hold θ, a checkpoint asks at most DONOR_TRIES of them, fastest first:
    when those fail (here each sends a θ that is not the agreed one) the round is not
    checkpointed, and the run goes on instead of working through the whole swarm."""
    from drift.swarm import DONOR_TRIES

    async def main() -> tuple[Path | None, list[str], str]:
        coord = Coordinator(load_recipe(tiny_recipe), tmp_path / "run")
        await coord.start()
        donors = Donors(coord)
        try:
            for k in range(DONOR_TRIES):
                await donors.add(f"liar{k}", speed=300.0 - k, lies=True)
            await donors.add("honest", speed=100.0)
            path = await coord.checkpoint(3, {"checksum": AGREED})
            return path, donors.asked, coord.checkpoint_error
        finally:
            coord.ready.clear()  # (no control connections to close)
            await donors.close()
            await coord.close()

    path, asked, why = run_async(main())
    assert path is None and not (tmp_path / "run" / "checkpoints" / "round-000003").exists()
    assert sorted(set(asked)) == [f"liar{k}" for k in range(DONOR_TRIES)]  # (each perhaps twice: pieces come back)
    assert why.startswith("no peer could hand over the state of round 3: ") and "is not the swarm's" in why, why


def test_settled_rounds_keep_their_figures_not_their_units(tiny_recipe: Path, tmp_path: Path) -> None:
    """A thousand members train thousands of units a round. The coordinator keeps each settled
    round's figures (the run's results), not its units or per-member bytes (those are in the
    round's event, metrics.jsonl): kept, they would grow it by megabytes a round, for the run."""
    coord = Coordinator(load_recipe(tiny_recipe), tmp_path / "run")
    members = [f"{k:064x}" for k in range(1000)]

    def result(r: int) -> RoundResult:
        units = [P.WorkUnit(epoch=0, id=r * 2000 + k, lo=0, hi=8) for k in range(2000)]
        return RoundResult(r, 2.0, 2.1, f"c{r}", 16_000, 1.0, units, dict.fromkeys(members, 10), None, units[:10])

    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        one = result(0)
        a_round = tracemalloc.get_traced_memory()[0] - start  # what one round's units and bytes take
        del one
        start = tracemalloc.get_traced_memory()[0]
        for r in range(20):
            coord._record(result(r))  # (what settling a round keeps)
        held = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert [(x.round, x.samples, x.checksum) for x in coord.results] == [(r, 16_000, f"c{r}") for r in range(20)]
    assert coord.samples_seen == 20 * 16_000
    assert held < a_round / 10, (held, a_round)
