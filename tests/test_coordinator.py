"""The coordinator survives bad peers: malformed, truncated, oversized and unexpected frames."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest
from conftest import dropped, run_async

from drift import protocol as P
from drift.coordinator import Coordinator
from drift.recipe import load_recipe
from drift.transport import CONTROL_ALPN, MAX_CONTROL_FRAME, Endpoint


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
