"""Handing the swarm's state (θ and the sync rule's shared state arrays) to whoever lacks it: a late
joiner, a node that sat a round out, an evaluator, the coordinator writing a checkpoint.
ALPN ``drift-state/0``, peer to peer.

Every training node serves its own live θ and state (no copies: a node keeps nothing twice)
to the members of the run. A transfer streams them in bounded chunks, so there is no size cap and
neither side ever holds a second copy; the node's outer step waits while a transfer is reading
(`StateServer.updating`), and a transfer asked for meanwhile waits for the outer step. Either side gives a transfer up once it falls behind MIN_RATE (after
SLACK_S), so a slow or stalling donor cannot hold a fetch, and a slow reader cannot hold a
donor's outer step, for longer than SLACK_S + size / MIN_RATE. The receiver checks the checksum the coordinator agreed on for that
round, over θ and the state arrays, before it uses any of it: a peer cannot slip in another state.
The arrays follow θ in the rule's order (drift/sync/); both sides run the same rule, so the
header does not name them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import iroh
import numpy as np

from drift.diloco import ParamLayout, PieceHash
from drift.protocol import MAX_ROUND, printable
from drift.transport import (
    STATE_ALPN,
    Channel,
    DropFn,
    Endpoint,
    TransportError,
    TransportTimeout,
    close_conn,
    parse_ticket,
    peer_of,
)

log = logging.getLogger("drift.state")

REQUEST_TIMEOUT = 10.0  # a peer sends its request as soon as it connects
DONE_TIMEOUT = 60.0  # for the peer's "ok" once the state is sent
MAX_REQUEST = 256  # bytes: a request is {"round": N}
MAX_HEADER = 1 << 24  # bytes: the header names every tensor of the model (16 MiB: ~100k tensors)
MAX_CLIENTS = 64  # connections served at once; more are refused at once
MAX_CLIENTS_PER_PEER = 4  # of those, from one peer
MIN_RATE = 1 << 20  # bytes/s: a transfer slower than this overall (after SLACK_S) is given up, both sides
SLACK_S = 10.0  # on top of size / MIN_RATE: connecting, the header, a slow start
CHUNK_BYTES = 4 << 20  # one frame of a transfer
MAX_TENSORS = 1 << 20
MAX_VALUES = 1 << 40  # values in θ a receiver will accept at all (it also checks the size it expects)


class StateError(Exception):
    """No peer could hand over the state asked for."""


class _Lied(StateError):
    """A donor sent a state that is not the one the swarm agreed on (its checksum differs)."""


# What a node learned about donors, per its node id, for as long as the process lives: donor id
# -> "lied" (sent another state: never asked again) or "failed" (too slow, hung up, garbled:
# asked after the others). A success clears "failed".
_DONORS: dict[str, dict[str, str]] = {}


def _donor_id(ticket: str) -> str:
    try:
        return str(parse_ticket(ticket).id())
    except TransportError:
        return ticket


@dataclass
class Published:
    round: int  # θ after this round's outer step (-1: the initial θ)
    arrays: tuple[np.ndarray, ...]  # the node's live θ, then the rule's state arrays: not copies
    checksum: str
    layout: ParamLayout


class StateServer:
    """Serves this node's published state to peers that ask (one request per connection), if
    `allowed(peer id)`: θ goes only to members of the run (a private model stays private)."""

    def __init__(
        self, allowed: Callable[[str], bool] = lambda peer: False, min_rate: float = MIN_RATE, slack: float = SLACK_S
    ) -> None:
        self.current: Published | None = None
        self.allowed = allowed
        self.min_rate, self.slack = min_rate, slack  # a reader slower than this is dropped
        self._clients = 0  # requests being served now (MAX_CLIENTS)
        self._by_peer: dict[str, int] = {}  # the same per peer (MAX_CLIENTS_PER_PEER)
        self._reading = 0  # transfers streaming the arrays right now
        self._writing = False
        self._fetching = 0  # updating() calls taking the arrays from a peer: requests are refused at once
        self._writers = 0  # updating() calls waiting for the transfers in flight to end
        self._cond = asyncio.Condition()

    def publish(self, rnd: int, arrays: tuple[np.ndarray, ...], checksum: str, layout: ParamLayout) -> None:
        """From now on serve these arrays (θ, then the rule's state) as the state after round
        `rnd` (call inside updating())."""
        self.current = Published(rnd, tuple(arrays), checksum, layout)

    @contextlib.asynccontextmanager
    async def updating(self, fetching: bool = False) -> AsyncIterator[None]:
        """Hold off transfers while the published arrays change (the outer step, a fetch into
        them): wait for those in flight to end, then keep new ones waiting until we are done.
        A transfer asked for while we wait starts after us: a member that keeps asking cannot
        hold the outer step longer than the transfers already in flight (each bounded by MIN_RATE).
        `fetching`: the arrays come from a peer, for as long as that takes: requests are refused
        at once instead (two nodes fetching from each other would wait on each other for good)."""
        async with self._cond:
            self._writers += 1
            self._fetching += fetching
            self._cond.notify_all()  # (requests waiting on an outer step hear they are refused)
            try:
                await self._cond.wait_for(lambda: self._reading == 0 and not self._writing)
            except BaseException:
                self._fetching -= fetching
                raise
            finally:
                self._writers -= 1
                self._cond.notify_all()  # (a cancelled wait: the transfers held off may go)
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._fetching -= fetching
                self._cond.notify_all()

    async def handle(
        self, conn: iroh.Connection, on_drop: DropFn | None = None, on_stranger: DropFn | None = None
    ) -> None:
        """Serve one request: ``{"round": r}`` in, the state after round r (or an error) out.

        Whatever the peer sends or fails to send, this returns normally: a request that is not
        valid, or a peer that stalls, ends in one on_drop(peer, reason) (default: a log line).
        A peer that is not `allowed` is closed at once, before anything is read and without
        holding a slot, and reported to on_stranger (default: on_drop; pass a Throttle). A peer
        with MAX_CLIENTS_PER_PEER requests in progress (or any, at MAX_CLIENTS) is refused too."""
        drop = on_drop or (lambda peer, why: log.warning("dropping state request from %s: %s", peer[:10], why))
        peer = peer_of(conn)
        try:
            if not self.allowed(peer):
                (on_stranger or drop)(peer, "state request refused: not a member of this run")
                close_conn(conn, "not a member of this run")
                return
            if self._clients >= MAX_CLIENTS or self._by_peer.get(peer, 0) >= MAX_CLIENTS_PER_PEER:
                raise StateError("refused: too many state requests in progress")
            self._clients += 1
            self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
            try:
                ch = await Endpoint.accept_channel(conn, timeout=REQUEST_TIMEOUT)
                await self._serve(ch)
            finally:
                self._clients -= 1
                if (left := self._by_peer.pop(peer) - 1) > 0:
                    self._by_peer[peer] = left
            try:  # the peer says when it has everything (its slot is free already); hanging up is fine too
                await ch.recv_frame(16, timeout=DONE_TIMEOUT)
            except TransportError:
                pass
        except Exception as e:
            drop(
                peer,
                printable(e if isinstance(e, (StateError, TransportError)) else f"{e.__class__.__name__}: {e}", 300),
            )
        finally:
            try:
                conn.close(0, b"done")
            except Exception:
                pass

    async def _serve(self, ch: Channel) -> None:
        rnd = _parse_request(await ch.recv_frame(MAX_REQUEST, timeout=REQUEST_TIMEOUT))
        async with self._cond:
            await self._cond.wait_for(lambda: self._fetching or (not self._writing and not self._writers))
            if self._fetching:
                cur = None
            else:
                cur = self.current
                if cur is not None and cur.round == rnd:
                    self._reading += 1
        if self._fetching:
            await ch.send_frame(json.dumps({"error": "busy: taking θ from a peer"}).encode())
            return
        if cur is None or cur.round != rnd:
            have = None if cur is None else cur.round
            await ch.send_frame(json.dumps({"error": f"have round {have}"}).encode())
            return
        try:
            size = sum(a.nbytes for a in cur.arrays)
            end = time.monotonic() + self.slack + size / self.min_rate
            await ch.send_frame(
                json.dumps(
                    {
                        "round": cur.round,
                        "checksum": cur.checksum,
                        "n": int(cur.arrays[0].size),
                        "names": list(cur.layout.names),
                        "shapes": [list(x) for x in cur.layout.shapes],
                        "buffers": cur.layout.n_buffers,
                    }
                ).encode(),
                timeout=self.slack,
            )
            for a in cur.arrays:
                view = memoryview(a).cast("B")
                for i in range(0, len(view), CHUNK_BYTES):
                    left = end - time.monotonic()
                    if left <= 0:
                        raise TransportTimeout("")
                    await ch.send_frame(view[i : i + CHUNK_BYTES], timeout=left)
        except TransportTimeout:
            raise StateError(
                f"reader too slow: {size / 2**20:.1f} MiB not taken within {self.slack:g} s + "
                f"{self.min_rate / 2**20:g} MiB/s; dropped so the outer step can go on"
            ) from None
        finally:
            async with self._cond:
                self._reading -= 1
                self._cond.notify_all()


def _parse_request(frame: bytes) -> int:
    """The round a state request asks for; StateError unless it is exactly ``{"round": r}``."""
    try:
        want = json.loads(frame.decode("utf-8"))
    except (ValueError, RecursionError):
        raise StateError("state request is not JSON") from None
    rnd = want.get("round") if isinstance(want, dict) and len(want) == 1 else None
    if type(rnd) is not int or not -1 <= rnd <= MAX_ROUND:
        raise StateError(f'state request is not {{"round": R}} with -1 <= R <= {MAX_ROUND}')
    return rnd


def _parse_header(head: dict, size: int | None) -> ParamLayout:
    """The layout a donor announces, checked against itself and the size we expect."""
    if "error" in head:
        raise StateError(printable(head["error"], 200))
    names, shapes, n, n_buffers = head.get("names"), head.get("shapes"), head.get("n"), head.get("buffers", 0)
    if not (
        isinstance(names, list)
        and isinstance(shapes, list)
        and len(names) == len(shapes) <= MAX_TENSORS
        and all(isinstance(x, str) and len(x) <= 1024 for x in names)
        and len(set(names)) == len(names)
        and all(
            isinstance(s, list) and len(s) <= 32 and all(type(d) is int and 0 <= d <= MAX_VALUES for d in s)
            for s in shapes
        )
        and type(n) is int
        and 0 <= n <= MAX_VALUES
        and type(n_buffers) is int
        and 0 <= n_buffers <= len(names)
    ):
        raise StateError("the peer's state header is malformed")
    layout = ParamLayout(tuple(names), tuple(tuple(s) for s in shapes), n_buffers)
    if layout.size != n or (size is not None and n != size):
        raise StateError(f"peer sent {n} values, expected {size if size is not None else layout.size}")
    return layout


def _first_difference(got: ParamLayout, want: ParamLayout) -> str:
    for i, (a, b) in enumerate(zip(got.names, want.names)):
        if a != b:
            return f"tensor {i} is {printable(a, 80)!r}, here {printable(b, 80)!r}"
    for i, (a, b) in enumerate(zip(got.shapes, want.shapes)):
        if a != b:
            return f"{printable(want.names[i], 80)!r} has shape {list(a)}, here {list(b)}"
    if len(got.names) != len(want.names):
        return f"{len(got.names)} tensors, here {len(want.names)}"
    return f"{got.n_buffers} buffers, here {want.n_buffers}"


Sink = Callable[[int, int, memoryview], None]  # (which: 0 θ / 1.. the state arrays, byte offset, bytes)


async def fetch_state(
    endpoint: Endpoint,
    tickets: list[str],
    rnd: int,
    want_checksum: str,
    sink: Callable[[ParamLayout], Sink],
    size: int | None = None,
    timeout: float = 120.0,
    min_rate: float = MIN_RATE,
    layout: ParamLayout | None = None,
    arrays: int = 2,
) -> ParamLayout:
    """The state after round `rnd`, streamed from the first peer in `tickets` that has it, into
    `sink(layout)` (which returns where the bytes go: arrays, or files); returns the layout once
    the bytes match `want_checksum` (and `size` values, when given). A sink written by a peer that
    then failed holds garbage: the next peer overwrites it, and StateError means none could.

    `timeout` bounds each step (connecting, each frame); the whole transfer from one peer must
    also keep up `min_rate` bytes/s after `timeout` s, or that peer is given up. With `layout`
    (the model this node built itself), the donor's tensor names, shapes and order must be
    exactly those: same-sized tensors in another order would otherwise load mislabeled.
    `arrays`: how many arrays of θ's size come (θ and the rule's state arrays)."""
    errors = []
    known = _DONORS.setdefault(endpoint.node_id, {})
    for ticket in sorted(tickets, key=lambda t: known.get(_donor_id(t)) == "failed"):  # (a stable sort)
        donor = _donor_id(ticket)
        if known.get(donor) == "lied":
            errors.append(f"{donor[:10]}: not asked: it sent a state that was not the swarm's before")
            continue
        try:
            ch = await endpoint.connect(ticket, STATE_ALPN, timeout=timeout)
            try:
                await ch.send_frame(json.dumps({"round": rnd}).encode())
                try:
                    head = json.loads(await ch.recv_frame(MAX_HEADER, timeout=timeout))
                except (ValueError, RecursionError):
                    raise StateError("the peer's state header is not JSON") from None
                if not isinstance(head, dict):
                    raise StateError("the peer's state header is malformed")
                got_layout = _parse_header(head, size)
                if layout is not None and got_layout != layout:
                    raise StateError(
                        f"the peer's tensors are not this model's: {_first_difference(got_layout, layout)}"
                    )
                write = sink(got_layout)
                end = time.monotonic() + timeout + 4 * arrays * got_layout.size / min_rate
                h = PieceHash()  # as diloco.checksum: θ's pieces, then the state's
                for which in range(arrays):
                    got, total = 0, 4 * got_layout.size
                    while got < total:
                        left = end - time.monotonic()
                        try:
                            if left <= 0:
                                raise TransportTimeout("")
                            frame = await ch.recv_frame(min(CHUNK_BYTES, total - got), timeout=min(timeout, left))
                        except TransportTimeout:
                            if left >= timeout:
                                raise
                            raise StateError(
                                f"transfer too slow: {4 * arrays * got_layout.size / 2**20:.1f} MiB not received within "
                                f"{timeout:g} s + {min_rate / 2**20:g} MiB/s"
                            ) from None
                        if not frame:
                            raise StateError("the peer sent an empty chunk")
                        view = memoryview(frame)
                        h.update(view)
                        write(which, got, view)
                        got += len(view)
                    h.end_array()
                await ch.send_frame(b"ok")
            finally:
                ch.close("state received")
            if h.hexdigest() != want_checksum:
                raise _Lied(f"checksum {h.hexdigest()} of θ and outer state is not the swarm's {want_checksum}")
            known.pop(donor, None)
            return got_layout
        except (StateError, TransportError) as e:
            known[donor] = "lied" if isinstance(e, _Lied) else "failed"
            errors.append(f"{ticket[:20]}...: {e}")
    raise StateError(f"no peer could hand over the state of round {rnd}: " + "; ".join(errors or ["no peer to ask"]))


def into_arrays(theta: np.ndarray, *state: np.ndarray) -> Callable[[ParamLayout], Sink]:
    """A fetch_state sink that writes into these flat float32 arrays (θ, then the state's)."""

    def sink(layout: ParamLayout) -> Sink:
        if layout.size != theta.size:
            raise StateError(f"peer sent {layout.size} values, expected {theta.size}")
        views = tuple(memoryview(a).cast("B") for a in (theta, *state))

        def write(which: int, offset: int, data: memoryview) -> None:
            dst = views[which][offset : offset + len(data)]
            if which >= 1 and not np.frombuffer(data, np.uint8).any() and not np.frombuffer(dst, np.uint8).any():
                return  # zeros over zeros (no outer momentum): pages never written stay unbacked
            dst[:] = data

        return write

    return sink
