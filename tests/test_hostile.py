"""Nothing from the network can crash the coordinator or a node.

Real iroh endpoints on loopback throw hostile connections and frames (benchmarks/harness/hostile.py) at each
ALPN: the coordinator's drift/0, a state server's drift-state/0, a node ring's drift-ring/0, and
an ALPN nobody serves. Each bad connection must end in one dropped-connection line with its
reason, closed, while the server goes on serving: a real handshake, a state fetch, an all-reduce,
and a real swarm of `drift coord` + `drift join` processes that trains to the end.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import dropped, make_task_repo, run_async
from rich.console import Console

from drift import protocol as P
from drift.auth import NodeKey, sign_message
from drift.coordinator import Coordinator
from drift.diloco import ParamLayout, checksum
from drift.monitor import Monitor, NodeView
from drift.recipe import load_recipe
from drift.ring import MAX_PENDING, Ring
from drift.state import StateServer, fetch_state, into_arrays
from drift.transport import (
    CONTROL_ALPN,
    HANDSHAKES_FULL,
    MAX_CONTROL_FRAME,
    RING_ALPN,
    STATE_ALPN,
    Endpoint,
    Throttle,
)
from harness import hostile
from harness.simulate import Swarm

# How long an attack waits for the server to hang up before it hangs up itself.
PATIENCE = 1.0


class LoopErrors:
    """What asyncio reports as unhandled in this loop ("Task exception was never retrieved")."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, ctx: self.seen.append(f"{ctx.get('message')}: {ctx.get('exception')!r}")
        )

    def check(self) -> list[str]:
        gc.collect()  # a failed task reports its unretrieved exception when it is collected
        return self.seen


async def _until(pred: Callable[[], bool], what: str) -> None:
    """Wait for a state the server reaches on its own (the test's overall timeout bounds it)."""
    while not pred():
        await asyncio.sleep(0.05)


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _admit(ticket: str, name: str) -> tuple[Endpoint, object]:
    """A well-behaved node (real key, signed RepoCommit) that joins under `name`."""
    key = NodeKey.generate()
    ep = await Endpoint.bind("local", secret_key=key.seed)
    ch = await ep.connect(ticket, CONTROL_ALPN)
    await ch.send_frame(
        P.encode(
            P.NodeInfo(
                node_id=ep.node_id,
                name=name,
                backend="torch",
                device="cpu",
                ring_ticket=ep.ticket(),
            )
        )
    )
    cfg = P.decode(await ch.recv_frame(MAX_CONTROL_FRAME, timeout=30))
    assert isinstance(cfg, P.TrainConfig), cfg
    rc = P.RepoCommit(
        repo="x",
        commit=cfg.commit,
        tree=None,
        node_id=key.node_id,
        timestamp=time.time(),
        nonce=os.urandom(16).hex(),
        param_checksum="p",
        n_train=100,
        run_id=cfg.run_id,
    )
    await ch.send_frame(P.encode(P.RepoCommit.model_validate(sign_message(key, rc.model_dump(mode="json")))))
    return ep, ch


@pytest.mark.swarm  # seconds of floods or training: the slow tier
def _accounted(events: list[dict], coord: Coordinator) -> int:
    """Connections the coordinator dropped: one event each, or counted among its busy refusals
    (of which only a few are lines and events)."""
    drops = [e for e in events if e["event"] == "connection_dropped"]
    return len([e for e in drops if not _busy(e["reason"])]) + coord._busy.count


def _busy(reason: str) -> bool:
    return P.JOIN_BUSY in reason or HANDSHAKES_FULL in reason


def test_coordinator_drops_each_hostile_connection_once_and_keeps_admitting(
    tiny_recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = load_recipe(tiny_recipe)
    run_dir = tmp_path / "run"

    async def main() -> tuple:
        errors = LoopErrors()
        monitor = Monitor(run_dir, live=False)
        coord = Coordinator(recipe, run_dir, monitor=monitor)
        ticket = await coord.start()
        clients = await hostile.clients(4)
        other = await Endpoint.bind("local")
        keep = []
        try:
            tally = await hostile.barrage(
                clients,
                ticket,
                CONTROL_ALPN,
                hostile.control_attacks(other),
                repeat=25,
                concurrency=32,
                patience=PATIENCE,
            )
            # Then each attack once more, one at a time: under the barrage an attack that needs
            # admission first can find every try refused because another connection of its node
            # id is joining (one CI run never got "lo 50 > hi 3" in); alone, each reaches the server.
            await hostile.barrage(
                clients,
                ticket,
                CONTROL_ALPN,
                hostile.control_attacks(other),
                concurrency=1,
                patience=PATIENCE,
                tally=tally,
            )
            # A node with a name made of markup, escapes and a newline is admitted, and shown as it is.
            ep, ch = await _admit(ticket, hostile.MARKUP_NAME)
            keep += [ep, ch]
            await _until(lambda: ep.node_id in coord.ready, "the node is admitted")
            await _until(
                lambda: _accounted(_events(run_dir), coord) >= tally.connections, "every bad connection is dropped"
            )
            return (
                tally,
                _events(run_dir),
                coord.ready[ep.node_id].info.name,
                errors.check(),
                _accounted(_events(run_dir), coord),
            )
        finally:
            await coord.close()
            monitor.close()
            for c in [*clients, other, *keep[:1]]:
                await c.close()

    tally, events, name, loop_errors, accounted = run_async(main(), 300)
    out = capsys.readouterr().out
    drops = [e for e in events if e["event"] == "connection_dropped"]
    # Fewer frames than connections: 4 joining slots per node id refuse many before their first
    # frame, how many depends on scheduling (493 of 1,050 in one CI run, when the barrage was twice
    # this one); the reasons below prove that each kind of attack reached the server.
    assert tally.connections >= 500 and tally.frames >= tally.connections // 4, tally
    # One line each (no silence, no flood), but "busy, try again" (the joining slots full under the
    # barrage): those are counted, and a few lines a minute say so (a thousand nodes knock too).
    assert accounted == tally.connections
    assert len([e for e in drops if _busy(e["reason"])]) <= Throttle(print).burst * 2
    assert all(e["peer"] and e["reason"] and e["reason"].isprintable() for e in drops)
    reasons = "\n".join(e["reason"] for e in drops)
    for needle in (
        "nested more than 32 levels",  # deep JSON: a RecursionError escaped _serve before
        "lo 50 > hi 3",
        "exceeds the 1048576-byte cap",
        "not the id of the connecting endpoint",
        "ring_ticket names another endpoint",
        "expected NodeInfo first, got Ping",
        "wrong signer",
    ):
        assert needle in reasons, needle
    assert sorted(dropped(caplog)) == sorted(e["reason"] for e in drops)  # and the same line in its log
    assert loop_errors == []  # no "Task exception was never retrieved"
    assert name == P.printable(hostile.MARKUP_NAME, P.MAX_NAME)
    joined = [line for line in out.splitlines() if line.startswith("node joined:")]
    assert joined == [
        f"node joined: {name} (cpu) {next(e for e in events if e['event'] == 'node_joined')['node_id'][:10]}"
    ]
    assert "[/x][bold red]\\x1b[31m\\x1b[2Jevil\\nnode" in joined[0]
    assert "\x1b" not in out and "Traceback" not in out


def test_a_connection_on_an_alpn_nobody_serves_does_not_stop_the_accept_loop(
    tiny_recipe: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Such a connection fails inside the QUIC handshake; that used to end the accept loop."""
    recipe = load_recipe(tiny_recipe)

    async def main() -> tuple:
        coord = Coordinator(recipe, tmp_path / "run")
        ticket = await coord.start()
        clients = await hostile.clients(2)
        keep = []
        try:
            tally = await hostile.barrage(
                clients,
                ticket,
                RING_ALPN,
                {"wrong ALPN": hostile.wrong_alpn},
                repeat=20,
            )
            ep, ch = await _admit(ticket, "good")
            keep += [ep, ch]
            await _until(lambda: ep.node_id in coord.ready, "the node is admitted")
            return tally, dropped(caplog)
        finally:
            await coord.close()
            for c in [*clients, *keep[:1]]:
                await c.close()

    tally, rejected = run_async(main(), 120)
    assert tally.connections == tally.closed_by_server == 20
    # at least one refusal each: under load a client's retransmitted Initial can reach the server as a second
    # handshake after the first was refused (a CI run logged 21 for 20)
    assert len(rejected) >= 20 and all("handshake" in r for r in rejected), rejected


def test_live_table_and_log_lines_show_network_text_as_plain_text(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    monitor = Monitor(tmp_path / "run", live=False)
    try:
        monitor.nodes["a" * 64] = NodeView(name="[/x] [bold]", device="[red]cuda:0")
        screen = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
        screen.print(monitor._table())  # rich markup in a cell used to raise MarkupError here
        monitor.event("node_left", node_id="a" * 64, name="[/x]", reason="bye\x1b[2J\n[/red]")
        monitor.say("[/x] :thumbs_up: [bold]said as it is[/bold]")
    finally:
        monitor.close()
    table = screen.file.getvalue()
    assert "[/x] [bold]" in table and "[red]cuda:0" in table
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "node left: [/x] (bye\\x1b[2J\\n[/red])",  # markup and escapes as typed, not interpreted
        "[/x] :thumbs_up: [bold]said as it is[/bold]",
    ]


@pytest.mark.swarm  # seconds of floods or training: the slow tier
def test_state_server_survives_hostile_requests_and_still_hands_over_state() -> None:
    theta, velocity = np.arange(5000, dtype=np.float32), np.ones(5000, np.float32)

    async def main() -> tuple:
        errors = LoopErrors()
        server_ep = await Endpoint.bind("local")
        server = StateServer()
        server.publish(3, (theta, velocity), checksum(theta, velocity), ParamLayout(("w",), ((theta.size,),)))
        drops: list[tuple[str, str]] = []

        def on_drop(peer: str, why: str) -> None:
            drops.append((peer, why))

        serving = asyncio.ensure_future(
            server_ep.serve(
                {STATE_ALPN: lambda conn: server.handle(conn, on_drop=on_drop)},
                on_drop=on_drop,
            )
        )
        clients = await hostile.clients(4)
        server.allowed = lambda peer: peer == clients[0].node_id  # one of the attackers is a member
        try:
            tally = await hostile.barrage(
                clients,
                server_ep.ticket(),
                STATE_ALPN,
                hostile.state_attacks(),
                repeat=50,
                concurrency=32,
                patience=PATIENCE,
            )
            got = (np.empty_like(theta), np.empty_like(velocity))
            await fetch_state(clients[0], [server_ep.ticket()], 3, checksum(theta, velocity), into_arrays(*got))
            await _until(lambda: len(drops) >= tally.connections, "every bad request is dropped")
            return tally, drops, got, serving.done(), errors.check()
        finally:
            serving.cancel()
            for c in [*clients, server_ep]:
                await c.close()

    tally, drops, (got_theta, got_velocity), stopped, loop_errors = run_async(main(), 300)
    assert tally.connections >= 1000, tally
    assert len(drops) == tally.connections and all(p and why.isprintable() for p, why in drops)
    reasons = "\n".join(why for _, why in drops)
    assert 'state request is not {"round": R}' in reasons and "exceeds the 256-byte cap" in reasons
    assert not stopped and loop_errors == []
    assert np.array_equal(got_theta, theta) and np.array_equal(got_velocity, velocity)


@pytest.mark.swarm  # seconds of floods or training: the slow tier
def test_ring_bounds_what_strangers_hold_and_still_reduces(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="drift")

    async def main() -> tuple:
        errors = LoopErrors()
        eps = [await Endpoint.bind("local") for _ in range(3)]
        rings = [Ring(ep, timeout=60) for ep in eps]
        serving = [asyncio.ensure_future(ep.serve({RING_ALPN: r.handle_incoming})) for ep, r in zip(eps, rings)]
        clients = await hostile.clients(4)
        strangers = await hostile.clients(MAX_PENDING + 4)
        chans = []
        try:
            # Junk at node 0: every connection is dropped with one line.
            tally = await hostile.barrage(
                clients,
                eps[0].ticket(),
                RING_ALPN,
                hostile.ring_attacks(),
                repeat=50,
                concurrency=32,
                patience=PATIENCE,
            )

            def dropped() -> int:
                return sum("dropping" in r.getMessage() and "connection from" in r.getMessage() for r in caplog.records)

            await _until(
                lambda: dropped() >= tally.connections,
                "every junk connection is dropped",
            )
            junk_drops = dropped()
            # Strangers with well-formed hellos wait to be named by the ring, at most MAX_PENDING at once.
            for s in strangers:
                ch = await s.connect(eps[0].ticket(), RING_ALPN)
                await ch.send_frame(b'{"generation": 0}')
                chans.append(ch)
                await _until(lambda s=s: s.node_id in rings[0]._pending, "the stranger waits")
            pushed = [await asyncio.wait_for(ch.conn.closed(), 30) for ch in chans[:4]]
            waiting = [ch.conn.close_reason() for ch in chans[4:]]
            # Meanwhile a two-node all-reduce works.
            two = [P.RingMember(node_id=e.node_id, ticket=e.ticket(), weight=0.5) for e in eps[:2]]
            xs = [np.full(1000, 1, np.float32), np.full(1000, 2, np.float32)]
            await asyncio.gather(*(r.allreduce_sum(x, two, 0) for r, x in zip(rings, xs)))
            # Node 2 joins the ring at the next generation and dials node 0 before node 0 knows that
            # ring (the legitimate race): it waits (pushing out the oldest stranger), and is admitted
            # once node 0 learns the ring.
            three = [P.RingMember(node_id=e.node_id, ticket=e.ticket(), weight=1 / 3) for e in eps]
            ys = [np.full(1000, k, np.float32) for k in (1, 2, 3)]
            late = asyncio.ensure_future(rings[2].allreduce_sum(ys[2], three, 1, generation=1))
            await _until(lambda: eps[2].node_id in rings[0]._pending, "node 2 waits at node 0")
            await asyncio.gather(
                *(r.allreduce_sum(y, three, 1, generation=1) for r, y in zip(rings[:2], ys)),
                late,
            )
            # The strangers still waiting are refused now that the ring has moved past their generation.
            refused = [await asyncio.wait_for(ch.conn.closed(), 30) for ch in chans[4:]]
            return (
                tally,
                junk_drops,
                pushed,
                waiting,
                refused,
                xs,
                ys,
                [t.done() for t in serving],
                errors.check(),
            )
        finally:
            for t in serving:
                t.cancel()
            for r in rings:
                r.close()
            for c in [*clients, *strangers, *eps]:
                await c.close()

    tally, junk_drops, pushed, waiting, refused, xs, ys, stopped, loop_errors = run_async(main(), 300)
    assert tally.connections >= 800 and junk_drops == tally.connections, (
        tally,
        junk_drops,
    )
    assert all("too many connections wait for the ring" in r for r in pushed), pushed
    assert waiting == [None] * MAX_PENDING  # the newest MAX_PENDING were still waiting, no more
    assert "too many connections wait for the ring" in refused[0]  # the oldest, when node 2 came
    assert all("not in the current ring" in r for r in refused[1:]), refused
    assert all((x == 3).all() for x in xs) and all((y == 6).all() for y in ys)
    assert not any(stopped) and loop_errors == []


@pytest.mark.swarm
def test_real_swarm_trains_through_hostile_traffic_and_shows_names_literally(
    tmp_path: Path,
) -> None:
    """`[/x]` as a node name used to make `drift coord` exit 1 mid-run (rich markup error)."""
    recipe = make_task_repo(
        tmp_path / "repo",
        min_nodes=3,  # the run starts once the barrage is over: every hostile connection is counted
        rounds=2,
        inner_steps=4,
        batch_size=8,
        unit_steps=1,
        eval_batches=1,
    )
    swarm = Swarm(recipe, tmp_path)
    names = ["[/x]", "\x1b[31mred\x1b[0m\nnode joined: forged"]

    async def attack() -> list[hostile.Tally]:
        clients = await hostile.clients(2)
        other = await Endpoint.bind("local")
        try:  # while the named nodes load and wait for the third
            return [
                # (2 at a time from each client: within the joining slots of a node id, so every
                # connection is dropped for what it sent, in a line of its own; "busy" is throttled)
                await hostile.barrage(clients, swarm.ticket, alpn, attacks, repeat=3, concurrency=4, patience=PATIENCE)
                for alpn, attacks in (
                    (RING_ALPN, {"wrong ALPN": hostile.wrong_alpn}),
                    (CONTROL_ALPN, hostile.control_attacks(other)),
                    (STATE_ALPN, hostile.state_attacks()),
                )
            ]
        finally:
            for c in [*clients, other]:
                await c.close()

    try:
        for name in names:
            swarm.join(name=name)
        tallies = run_async(attack(), 300)
        swarm.join(name="third")
        rc = swarm.coord.wait(300)
        node_rcs = [p.wait(60) for p in swarm.nodes]
    finally:
        swarm.finish(timeout=1)  # whatever is still running is killed
    log = swarm.log()
    assert rc == 0, log
    events = swarm.events()
    assert [e["round"] for e in events if e["event"] == "round"] == [0, 1]
    assert events[-1]["event"] == "complete"
    ids = {e["name"]: e["node_id"][:10] for e in events if e["event"] == "node_joined"}
    shown = [P.printable(n, P.MAX_NAME) for n in names]
    assert sorted(ids) == sorted([*shown, "third"])
    for n in shown:
        assert f"node joined: {n} (cpu) {ids[n]}" in log
    assert "\x1b" not in log and "Traceback" not in log and "never retrieved" not in log
    assert not any(line.startswith("node joined: forged") for line in log.splitlines())  # no forged line
    drops = [e for e in events if e["event"] == "connection_dropped"]
    # drift-state/0 closes non-members before reading a byte, in a line per peer a minute at most.
    strangers = [e for e in drops if "not a member of this run" in e["reason"]]
    assert 1 <= len(strangers) <= 2
    assert not [e for e in drops if _busy(e["reason"])]
    assert len(drops) - len(strangers) == sum(t.connections for t in tallies[:2])
    assert node_rcs == [0, 0, 0]
