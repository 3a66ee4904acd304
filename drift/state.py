"""Handing the swarm's state (θ and the outer optimizer's velocity) to a node that lacks it:
a late joiner, or an evaluator that wants the newest θ. ALPN ``drift-state/0``, peer to peer.

Every training node publishes a snapshot after each outer step. A node that needs the state of
round r asks any peer that has it, and checks the checksum the coordinator agreed on for round r
before using it: a peer cannot slip it a different θ.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable

import iroh
import numpy as np

from drift.diloco import ParamLayout, checksum
from drift.protocol import MAX_ROUND, printable
from drift.transport import (
    STATE_ALPN,
    Channel,
    DropFn,
    Endpoint,
    TransportError,
    peer_of,
)

log = logging.getLogger("drift.state")

REQUEST_TIMEOUT = 10.0  # a peer sends its request as soon as it connects
DONE_TIMEOUT = 60.0     # for the peer's "ok" once the state is sent
MAX_REQUEST = 256       # bytes: a request is {"round": N}
MAX_CLIENTS = 64        # connections served at once; more are refused at once


class StateError(Exception):
    """No peer could hand over the state asked for."""


@dataclass(frozen=True)
class Snapshot:
    round: int            # θ after this round's outer step (-1: the initial θ)
    theta: np.ndarray
    velocity: np.ndarray
    checksum: str
    layout: ParamLayout | None = None  # names and shapes (for checkpoints)


class StateServer:
    """Serves this node's latest snapshot to peers that ask (one request per connection), if
    `allowed(peer id)`: θ goes only to members of the run (a private model stays private)."""

    def __init__(self, layout: ParamLayout | None = None, allowed: Callable[[str], bool] = lambda peer: False) -> None:
        self.snapshot: Snapshot | None = None
        self.layout = layout
        self.allowed = allowed
        self._clients = 0  # requests being served now (MAX_CLIENTS)

    def publish(self, rnd: int, theta: np.ndarray, velocity: np.ndarray) -> None:
        # Copies: the node keeps updating its own arrays in place while a peer may be reading.
        self.snapshot = Snapshot(rnd, theta.copy(), velocity.copy(), checksum(theta, velocity), self.layout)

    async def handle(self, conn: iroh.Connection, on_drop: DropFn | None = None) -> None:
        """Serve one request: ``{"round": r}`` in, the snapshot of round r (or an error) out.

        Whatever the peer sends or fails to send, this returns normally: a request that is not
        valid, or a peer that stalls, ends in one on_drop(peer, reason) (default: a log line)."""
        try:
            if self._clients >= MAX_CLIENTS:
                raise StateError(f"refused: {MAX_CLIENTS} state requests already in progress")
            self._clients += 1
            try:
                await self._serve(await Endpoint.accept_channel(conn, timeout=REQUEST_TIMEOUT))
            finally:
                self._clients -= 1
        except Exception as e:  # noqa: BLE001 - a peer's bytes end its request, never the server
            why = printable(e if isinstance(e, (StateError, TransportError)) else f"{e.__class__.__name__}: {e}", 300)
            if on_drop is not None:
                on_drop(peer_of(conn), why)
            else:
                log.warning("dropping state request from %s: %s", peer_of(conn)[:10], why)
        finally:
            try:
                conn.close(0, b"done")
            except Exception:  # noqa: BLE001, S110 - already closed
                pass

    async def _serve(self, ch: Channel) -> None:
        rnd = _parse_request(await ch.recv_frame(MAX_REQUEST, timeout=REQUEST_TIMEOUT))
        snap = self.snapshot
        if not self.allowed(ch.peer_id):
            await ch.send_frame(json.dumps({"error": "not a member of this run"}).encode())
        elif snap is None or snap.round != rnd:
            have = None if snap is None else snap.round
            await ch.send_frame(json.dumps({"error": f"have round {have}"}).encode())
        else:
            layout = {} if snap.layout is None else {"names": list(snap.layout.names),
                                                      "shapes": [list(x) for x in snap.layout.shapes]}
            await ch.send_frame(json.dumps({"round": snap.round, "checksum": snap.checksum,
                                            "n": int(snap.theta.size), **layout}).encode())
            await ch.send_frame(snap.theta)
            await ch.send_frame(snap.velocity)
        try:  # the peer says when it has everything; hanging up instead is fine too
            await ch.recv_frame(16, timeout=DONE_TIMEOUT)
        except TransportError:
            pass


def _parse_request(frame: bytes) -> int:
    """The round a state request asks for; StateError unless it is exactly ``{"round": r}``."""
    try:
        want = json.loads(frame.decode("utf-8"))
    except (ValueError, RecursionError):
        raise StateError("state request is not JSON") from None
    rnd = want.get("round") if isinstance(want, dict) and len(want) == 1 else None
    if type(rnd) is not int or not -1 <= rnd <= MAX_ROUND:
        raise StateError(f"state request is not {{\"round\": R}} with -1 <= R <= {MAX_ROUND}")
    return rnd


async def fetch_state(endpoint: Endpoint, tickets: list[str], rnd: int, want_checksum: str,
                      size: int | None = None, timeout: float = 120.0) -> Snapshot:
    """The state after round `rnd` from the first peer in `tickets` that has it and whose θ
    matches `want_checksum` (and has `size` parameters, when given)."""
    errors = []
    for ticket in tickets:
        try:
            ch = await endpoint.connect(ticket, STATE_ALPN, timeout=timeout)
            try:
                await ch.send_frame(json.dumps({"round": rnd}).encode())
                head = json.loads(await ch.recv_frame(4096, timeout=timeout))
                if "error" in head:
                    raise StateError(head["error"])
                n = head.get("n")
                if not isinstance(n, int) or n < 0 or (size is not None and n != size):
                    raise StateError(f"peer sent {n} parameters, expected {size}")
                size = n
                layout = ParamLayout(tuple(head["names"]), tuple(tuple(x) for x in head["shapes"])) \
                    if "names" in head else None
                theta = np.frombuffer(await ch.recv_frame(4 * size, timeout=timeout), dtype=np.float32).copy()
                velocity = np.frombuffer(await ch.recv_frame(4 * size, timeout=timeout), dtype=np.float32).copy()
                await ch.send_frame(b"ok")
            finally:
                ch.close("state received")
            got = checksum(theta, velocity)
            if got != want_checksum:
                raise StateError(f"checksum {got} of θ and outer state is not the swarm's {want_checksum}")
            return Snapshot(rnd, theta, velocity, got, layout)
        except (StateError, TransportError, ValueError, KeyError, TypeError) as e:
            errors.append(f"{ticket[:20]}...: {e}")
    raise StateError(f"no peer could hand over the state of round {rnd}: " + "; ".join(errors))
