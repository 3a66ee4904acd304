"""Hostile peers, for tests and benchmarks: the bad connections and frames a peer can throw at
each of drift's ALPNs (``drift/0``, ``drift-state/0``, ``drift-ring/0``). Nothing here is used by
a real run.

Each attack opens one connection from a client endpoint, misbehaves (a few frames, or none), then
waits at most `patience` seconds for the server to close the connection, so that the caller
knows the server has dealt with it; then it hangs up itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import iroh

from drift import protocol as P
from drift.transport import (
    CONTROL_ALPN,
    MAX_CONTROL_FRAME,
    Channel,
    Endpoint,
    TransportError,
)

# A name no terminal or rich markup may interpret: markup closing tags, ANSI colour and screen
# clearing escapes, a newline that would forge a log line, a bidi override.
MARKUP_NAME = "[/x][bold red]\x1b[31m\x1b[2Jevil\nnode joined: forged\u202e"
V = b'{"v":%d,' % P.SCHEMA_VERSION  # how a raw frame of this schema begins
DEEP_JSON = V + b'"type":"Ping","nonce":' + b"[" * 100_000 + b"]" * 100_000 + b"}"

Attack = Callable[[Endpoint, str, bytes, float], Awaitable[tuple[int, bool]]]


@dataclass
class Tally:
    """What a barrage did: connections opened, frames sent, and how many of those connections the
    server closed (or refused) within the attack's patience."""

    connections: int = 0
    frames: int = 0
    closed_by_server: int = 0

    def add(self, other: Tally) -> None:
        self.connections += other.connections
        self.frames += other.frames
        self.closed_by_server += other.closed_by_server


async def _closed(ch: Channel, patience: float) -> bool:
    """Wait until the server closes the connection (True) or patience runs out (False); hang up."""
    try:
        await asyncio.wait_for(ch.conn.closed(), patience)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        ch.close("done")


async def _raw(ch: Channel, data: bytes) -> None:
    """Bytes straight onto the stream: a length prefix that lies, or no framing at all."""
    try:
        await ch._send.write_all(data)
    except iroh.IrohError as e:  # the server hung up first
        raise TransportError(f"write failed: {e}") from None


def _frames(*frames: bytes) -> Attack:
    """An attack that sends these frames (stopping early once the server has hung up)."""

    async def attack(ep: Endpoint, ticket: str, alpn: bytes, patience: float) -> tuple[int, bool]:
        ch = await ep.connect(ticket, alpn)
        sent = 0
        try:
            for f in frames:
                await ch.send_frame(f)
                sent += 1
        except TransportError:
            pass
        return sent, await _closed(ch, patience)

    return attack


def _bytes(data: bytes, finish: bool = False) -> Attack:
    async def attack(ep: Endpoint, ticket: str, alpn: bytes, patience: float) -> tuple[int, bool]:
        ch = await ep.connect(ticket, alpn)
        try:
            await _raw(ch, data)
            if finish:
                await ch.finish()
        except TransportError:
            pass
        return 1, await _closed(ch, patience)

    return attack


async def _idle(ep: Endpoint, ticket: str, alpn: bytes, patience: float) -> tuple[int, bool]:
    """A connection that never opens a stream: held until the server gives up on it, or we do."""
    ch = await ep.connect(ticket, alpn)  # opening a stream sends nothing until data flows
    return 0, await _closed(ch, patience)


async def _hangup(ep: Endpoint, ticket: str, alpn: bytes, patience: float) -> tuple[int, bool]:
    ch = await ep.connect(ticket, alpn)
    ch.close("bye")
    return 0, True


def _json(obj: object) -> bytes:
    return json.dumps(obj).encode()


def junk_attacks() -> dict[str, Attack]:
    """Bad frames any ALPN must survive."""
    return {
        "random bytes": _frames(os.urandom(7), os.urandom(300), os.urandom(4000)),
        "unframed bytes": _bytes(os.urandom(64)),
        "huge length prefix": _bytes(struct.pack(">I", 0xFFFFFFFF) + b"x" * 32),
        "truncated frame": _bytes(struct.pack(">I", 100) + b"only ten b", finish=True),
        "empty frame": _frames(b""),
        "deep JSON": _frames(DEEP_JSON),
        "invalid UTF-8": _frames(V + b'"type":"\xff\xfe\xfd"}', b"\xc3\x28"),
        "lone surrogate": _frames(V + b'"type":"NodeInfo","name":"\\ud800"}'),
        "NaN and Infinity": _frames(V + b'"type":"Heartbeat","round":NaN}', b'{"round":Infinity}'),
        "JSON that is not an object": _frames(b"[1,2,3]", b'"string"', b"null"),
        "idle connection": _idle,
        "hang up at once": _hangup,
    }


def _node_info(ep: Endpoint, **over: object) -> bytes:
    body = {
        "v": P.SCHEMA_VERSION,
        "type": "NodeInfo",
        "node_id": ep.node_id,
        "name": "hostile",
        "backend": "torch",
        "device": "cpu",
        "ring_ticket": ep.ticket(),
        **over,
    }
    return json.dumps(body).encode()


def _after_hello(*frames: bytes, name: str = "hostile") -> Attack:
    """A valid NodeInfo (this endpoint's own id and ticket), the TrainConfig read, then `frames`;
    then it reads what the server answers (a refusal it must let us read, or the close)."""

    async def attack(ep: Endpoint, ticket: str, alpn: bytes, patience: float) -> tuple[int, bool]:
        ch = await ep.connect(ticket, alpn)
        sent, answered = 0, False
        try:
            await ch.send_frame(_node_info(ep, name=name))
            sent += 1
            await ch.recv_frame(MAX_CONTROL_FRAME, timeout=patience)  # TrainConfig (or a refusal)
            for f in frames:
                await ch.send_frame(f)
                sent += 1
            await ch.recv_frame(MAX_CONTROL_FRAME, timeout=patience)  # TrainingCancel, say
            answered = True
        except TransportError:
            pass
        return sent, await _closed(ch, 0.0 if answered else patience) or answered

    return attack


def _with_node_info(**over: object) -> Attack:
    async def attack(ep: Endpoint, ticket: str, alpn: bytes, patience: float) -> tuple[int, bool]:
        return await _frames(_node_info(ep, **over))(ep, ticket, alpn, patience)

    return attack


def control_attacks(other: Endpoint) -> dict[str, Attack]:
    """Attacks on a coordinator's drift/0; `other` is an endpoint whose id and ticket a hostile
    node may claim as its own."""
    bad_unit = _json(
        {
            "v": P.SCHEMA_VERSION,
            "type": "BarrierSync",
            "round": 0,
            "samples": 0,
            "steps": 1,
            "loss": 1.0,
            "trained": [{"id": 0, "lo": 50, "hi": 3}],
        }
    )
    unsigned = _json(
        {
            "v": P.SCHEMA_VERSION,
            "type": "RepoCommit",
            "repo": "x",
            "commit": None,
            "tree": None,
            "node_id": other.node_id,
            "timestamp": 1.0,
            "nonce": "n" * 16,
            "param_checksum": "p",
            "n_train": 1,
        }
    )
    return {
        **junk_attacks(),
        "wrong message first": _frames(P.encode(P.Ping()), P.encode(P.TrainComplete(rounds=1))),
        "NodeInfo for another id": _frames(_node_info(other)),
        "NodeInfo with another's ring ticket": _with_node_info(ring_ticket=other.ticket()),
        "NodeInfo out of range": _with_node_info(samples_per_s=-1.0),
        "NodeInfo of the wrong types": _with_node_info(name=7, node_id=None),
        "NodeInfo with a huge ticket": _with_node_info(ring_ticket="e" * 100_000),
        "marked-up name, then WorkUnit lo > hi": _after_hello(bad_unit, name=MARKUP_NAME),
        "RepoCommit signed by nobody": _after_hello(unsigned),
        "frames after the handshake": _after_hello(P.encode(P.Ping()), DEEP_JSON, b"\xff" * 10),
    }


def state_attacks() -> dict[str, Attack]:
    """Attacks on drift-state/0 (a node's or a resumed coordinator's state server)."""
    bad = [
        b"[]",
        b'{"round": "x"}',
        b'{"round": 1e30}',
        b'{"round": 10000000000000000000000}',
        b'{"round": -5}',
        b'{"round": 1, "more": 2}',
        b'{"round": true}',
        b"[" * 120 + b"]" * 120,
    ]

    return {
        **junk_attacks(),
        **{f"bad request {r[:16]!r}": _frames(r) for r in bad},
        "deep JSON request": _frames(b"[" * 2000 + b"]" * 2000),
        "oversized request": _frames(b'{"round": 0, "pad": "' + b"x" * 5000 + b'"}'),
    }


def ring_attacks() -> dict[str, Attack]:
    """Attacks on a node's drift-ring/0 by endpoints the ring does not name."""
    return {
        **junk_attacks(),
        "hello that is a list": _frames(b"[0]"),
        "hello with a bad generation": _frames(b'{"generation": "x"}'),
        "hello with a negative generation": _frames(b'{"generation": -1}'),
        "hello with a huge generation": _frames(b'{"generation": 1e300}'),
        "ring chunk instead of a hello": _frames(b"DRNG" + os.urandom(60)),
    }


async def stranger(ep: Endpoint, ticket: str, alpn: bytes, patience: float) -> tuple[int, bool]:
    """A well-formed ring hello from an endpoint no ring names: it waits for a while to be named."""
    return await _frames(b'{"generation": 0}')(ep, ticket, alpn, patience)


async def wrong_alpn(ep: Endpoint, ticket: str, alpn: bytes, patience: float) -> tuple[int, bool]:
    """A connection on an ALPN the server does not serve: the QUIC handshake must fail fast."""
    try:
        ch = await ep.connect(ticket, alpn, timeout=patience)
    except TransportError:
        return 0, True
    return 0, await _closed(ch, patience)


async def barrage(
    clients: list[Endpoint],
    ticket: str,
    alpn: bytes,
    attacks: Mapping[str, Attack],
    repeat: int = 1,
    concurrency: int = 16,
    patience: float = 20.0,
    tally: Tally | None = None,
) -> Tally:
    """Run every attack `repeat` times, `concurrency` at a time, from the client endpoints in turn;
    counts go into `tally` as they happen (a new one by default), which is returned."""
    sem = asyncio.Semaphore(concurrency)
    tally = Tally() if tally is None else tally

    async def one(i: int, attack: Attack) -> None:
        async with sem:
            try:
                frames, closed = await attack(clients[i % len(clients)], ticket, alpn, patience)
            except TransportError:  # the server hung up before the attack could start
                frames, closed = 0, True
            tally.connections += 1
            tally.frames += frames
            tally.closed_by_server += closed

    jobs = [a for _ in range(repeat) for a in attacks.values()]
    await asyncio.gather(*(one(i, a) for i, a in enumerate(jobs)))
    return tally


async def clients(n: int) -> list[Endpoint]:
    """`n` client endpoints on loopback."""
    return [await Endpoint.bind("local", alpns=(CONTROL_ALPN,)) for _ in range(n)]
