"""Handing the swarm's state (θ and the sync rule's shared state arrays) to whoever lacks it: a late
joiner, a node that sat a round out, an evaluator, the coordinator writing a checkpoint.
ALPN ``drift-state/1``, peer to peer.

The state is content-addressed (drift/diloco.py, PieceHash): each array is cut into PIECE_BYTES
pieces, and the checksum the coordinator agreed on for a round is the root of the pieces'
digests. A transfer, on one connection::

    asker: {"round": r}        holder: header: the layout and the piece digests (the manifest)
    asker: {"piece": i} ...    holder: piece i's bytes, one frame per request, in order
    asker: "ok"

The asker checks the manifest against the agreed checksum before it takes any piece, and each
piece against its digest as it arrives: a peer cannot slip in another state, and a piece is
never written unchecked. It takes the pieces from up to PARALLEL holders at once, each
connection pulling the next piece wanted from one shared queue (a slow holder serves fewer);
a holder that sends a piece that is not the swarm's is never asked again by this process, one
that stalls is dropped from the fetch after one piece's timeout, and their pieces go to the
others.

Every training node serves its own live θ and state to the members of the run (no copy while
nothing changes them). When its outer step comes while transfers are reading them, those go on
from a copy of the round they asked for (`StateServer.updating`): no reader, however slow, holds
the step up; a transfer asked for meanwhile starts after the step. Either side gives a transfer
up once it falls behind MIN_RATE (after SLACK_S), so a slow or stalling holder cannot hold a
fetch for longer than SLACK_S + size / MIN_RATE. The arrays follow θ in the rule's order
(drift/sync/); both sides run the same rule, so the header does not name them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import iroh
import numpy as np

from drift.diloco import PIECE_DIGEST, ParamLayout, PieceHash, piece_digest, piece_spans, pieces_of, root_of
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
DONE_TIMEOUT = 60.0  # for the peer to hang up once it has our last frame
MAX_REQUEST = 256  # bytes: a request is {"round": N} or {"piece": i}
MAX_HEADER = 1 << 24  # bytes: the header names every tensor of the model (16 MiB: ~100k tensors)
MAX_CLIENTS = 64  # connections served at once; more are refused at once
MAX_CLIENTS_PER_PEER = 4  # of those, from one peer
MIN_RATE = 1 << 20  # bytes/s: a transfer slower than this overall (after SLACK_S) is given up, both sides
SLACK_S = 10.0  # on top of size / MIN_RATE: connecting, the header, a slow start
PARALLEL = 4  # holders a fetch takes pieces from at once
DEPTH = 2  # piece requests in flight per holder: the next is asked for before the last arrives
MAX_TENSORS = 1 << 20
MAX_VALUES = 1 << 40  # values in θ a receiver will accept at all (it also checks the size it expects)


class StateError(Exception):
    """No peer could hand over the state asked for."""


class _Lied(StateError):
    """A holder sent a state that is not the one the swarm agreed on (its manifest or a piece)."""


# What a node learned about donors, per its node id, for as long as the process lives: donor id
# -> "lied" (sent another state: never asked again) or "failed" (too slow, hung up, garbled:
# asked after the others). A success clears "failed".
_DONORS: dict[str, dict[str, str]] = {}


def lied_to(node_id: str) -> set[str]:
    """The holders that sent the node `node_id` (this process) a state that was not the swarm's."""
    return {d for d, how in _DONORS.get(node_id, {}).items() if how == "lied"}


def _donor_id(ticket: str) -> str:
    try:
        return str(parse_ticket(ticket).id())
    except TransportError:
        return ticket


@dataclass
class Published:
    round: int  # θ after this round's outer step (-1: the initial θ)
    arrays: tuple[np.ndarray, ...]  # the node's live θ, then the rule's state arrays: not copies ...
    checksum: str
    layout: ParamLayout
    set_aside: bool = False  # ... until the arrays changed under transfers reading them: then a copy


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
        self.served = 0  # pieces handed out so far

    def publish(self, rnd: int, arrays: tuple[np.ndarray, ...], checksum: str, layout: ParamLayout) -> None:
        """From now on serve these arrays (θ, then the rule's state) as the state after round
        `rnd` (call inside updating())."""
        self.current = Published(rnd, tuple(arrays), checksum, layout)

    @contextlib.asynccontextmanager
    async def updating(self, fetching: bool = False) -> AsyncIterator[None]:
        """Hold off new transfers while the published arrays change (the outer step, a fetch into
        them). Transfers in flight never hold it up: they go on reading a copy of the round they
        asked for (made here, only when there are any), so however slow a reader is, the step
        waits only for that copy. A transfer asked for meanwhile starts after us.
        `fetching`: the arrays come from a peer, for as long as that takes: requests are refused
        at once instead (two nodes fetching from each other would wait on each other for good)."""
        async with self._cond:
            self._writers += 1
            self._fetching += fetching
            self._cond.notify_all()  # (requests waiting on an outer step hear they are refused)
            try:
                await self._cond.wait_for(lambda: not self._writing)
                cur = self.current
                if cur is not None and self._reading and not cur.set_aside:
                    # (no await between reading a piece and copying it: see _serve)
                    cur.arrays = await asyncio.to_thread(lambda: tuple(a.copy() for a in cur.arrays))
                    cur.set_aside = True
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
        """Serve one transfer: ``{"round": r}`` in, the manifest of the state after round r (or
        an error) out, then the pieces asked for.

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
            try:  # the peer hangs up once it has read our last frame (its slot is free already)
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
            spans = piece_spans(cur.arrays[0].nbytes, len(cur.arrays))
            size = sum(a.nbytes for a in cur.arrays)
            end = time.monotonic() + self.slack + size / self.min_rate
            digests = pieces_of(cur.checksum)
            if digests is None or len(digests) != len(spans):  # not computed here lately: hash θ again
                digests = await asyncio.to_thread(_digests, cur.arrays)
            await ch.send_frame(
                json.dumps(
                    {
                        "round": cur.round,
                        "checksum": cur.checksum,
                        "n": int(cur.arrays[0].size),
                        "names": list(cur.layout.names),
                        "shapes": [list(x) for x in cur.layout.shapes],
                        "buffers": cur.layout.n_buffers,
                        "pieces": [d.hex() for d in digests],
                    }
                ).encode(),
                timeout=self.slack,
            )
            for _ in range(len(spans)):  # as many pieces as there are, or fewer and "ok"
                try:
                    frame = await ch.recv_frame(MAX_REQUEST, timeout=max(end - time.monotonic(), 0.001))
                except TransportTimeout:
                    raise
                except TransportError:  # (not a timeout)
                    return  # the peer hung up: it has what it wanted, or gave up on us
                if frame == b"ok":
                    return
                which, offset, n = spans[_parse_piece(frame, len(spans))]
                left = end - time.monotonic()
                if left <= 0:
                    raise TransportTimeout("")
                # A copy of the piece, taken before anything is awaited: the arrays may change
                # once this send is under way (updating() sets cur.arrays aside first).
                piece = bytes(memoryview(cur.arrays[which]).cast("B")[offset : offset + n])
                await self._send_piece(ch, piece, left)
                self.served += 1
        except TransportTimeout:
            raise StateError(
                f"reader too slow: {size / 2**20:.1f} MiB not taken within {self.slack:g} s + "
                f"{self.min_rate / 2**20:g} MiB/s; dropped"
            ) from None
        finally:
            async with self._cond:
                self._reading -= 1
                self._cond.notify_all()

    async def _send_piece(self, ch: Channel, data: bytes, timeout: float) -> None:
        await ch.send_frame(data, timeout=timeout)


def _digests(arrays: tuple[np.ndarray, ...]) -> tuple[bytes, ...]:
    """The piece digests of these arrays (diloco.checksum's pieces)."""
    h = PieceHash()
    for a in arrays:
        h.update(a)
        h.end_array()
    h.hexdigest()
    return tuple(h.pieces)


def _parse_piece(frame: bytes, n: int) -> int:
    """The piece a request asks for; StateError unless it is exactly ``{"piece": i}``, 0 <= i < n."""
    try:
        want = json.loads(frame.decode("utf-8"))
    except (ValueError, RecursionError):
        raise StateError("piece request is not JSON") from None
    i = want.get("piece") if isinstance(want, dict) and len(want) == 1 else None
    if type(i) is not int or not 0 <= i < n:
        raise StateError(f'piece request is not {{"piece": i}} with 0 <= i < {n}')
    return i


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


@dataclass
class _Fetch:
    """What one fetch_state shares among its holders' connections."""

    rnd: int
    want: str
    layout: ParamLayout | None = None  # known once a holder's manifest checked out
    write: Sink | None = None
    digests: list[bytes] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)
    todo: deque[int] = field(default_factory=deque)  # pieces no connection has asked for
    left: int = 0  # pieces not written yet

    @property
    def done(self) -> bool:
        return self.layout is not None and self.left == 0


def _manifest(head: dict, layout: ParamLayout, arrays: int) -> list[bytes]:
    """The piece digests a holder announces, as many as `arrays` arrays of this layout have."""
    pieces, want = head.get("pieces"), len(piece_spans(4 * layout.size, arrays))
    if not isinstance(pieces, list) or len(pieces) != want:
        n = len(pieces) if isinstance(pieces, list) else "no"
        raise StateError(f"the peer's manifest has {n} pieces, expected {want}")
    try:
        if not all(isinstance(p, str) and len(p) == 2 * PIECE_DIGEST for p in pieces):
            raise ValueError
        return [bytes.fromhex(p) for p in pieces]
    except ValueError:
        raise StateError("the peer's manifest is malformed") from None


async def _take(
    f: _Fetch,
    endpoint: Endpoint,
    ticket: str,
    sink: Callable[[ParamLayout], Sink],
    size: int | None,
    timeout: float,
    min_rate: float,
    layout: ParamLayout | None,
    arrays: int,
) -> int:
    """Take pieces of f from one holder until none is left to ask for; returns how many it
    served. StateError (or _Lied) if it fails; the pieces it was asked for go back to f.todo."""
    ch = await endpoint.connect(ticket, STATE_ALPN, timeout=timeout)
    asked: deque[int] = deque()  # in flight on this connection, in order
    served = 0
    try:
        await ch.send_frame(json.dumps({"round": f.rnd}).encode())
        try:
            head = json.loads(await ch.recv_frame(MAX_HEADER, timeout=timeout))
        except (ValueError, RecursionError):
            raise StateError("the peer's state header is not JSON") from None
        if not isinstance(head, dict):
            raise StateError("the peer's state header is malformed")
        got_layout = _parse_header(head, size)
        if layout is not None and got_layout != layout:
            raise StateError(f"the peer's tensors are not this model's: {_first_difference(got_layout, layout)}")
        digests = _manifest(head, got_layout, arrays)
        if (root := root_of(digests)) != f.want:
            raise _Lied(f"its pieces make the checksum {root}, not the swarm's {f.want}")
        if f.layout is None:
            f.write = sink(got_layout)
            f.layout, f.digests = got_layout, digests
            f.spans = piece_spans(4 * got_layout.size, arrays)
            f.todo.extend(range(len(f.spans)))
            f.left = len(f.spans)
        elif got_layout != f.layout:
            raise StateError(f"the peer's tensors are not the others': {_first_difference(got_layout, f.layout)}")
        assert f.write is not None
        # Each piece must come within slack + its size / min_rate of the one before (a holder that
        # stalls costs one piece's wait), and all it sends must keep up min_rate after slack.
        slack, start, got = min(timeout, SLACK_S), time.monotonic(), 0
        while True:
            while len(asked) < DEPTH and f.todo:
                i = f.todo.popleft()
                asked.append(i)
                await ch.send_frame(json.dumps({"piece": i}).encode(), timeout=timeout)
            if not asked:
                break
            i = asked[0]
            which, offset, n = f.spans[i]
            wait = min(slack + n / min_rate, start + slack + (got + n) / min_rate - time.monotonic())
            try:
                if wait <= 0:
                    raise TransportTimeout("")
                frame = await ch.recv_frame(n, timeout=wait)
            except TransportTimeout:
                raise StateError(
                    f"piece {i} not received within {max(wait, 0):.3g} s ({slack:g} s + {min_rate / 2**20:g} MiB/s)"
                ) from None
            if len(frame) != n:
                raise StateError(f"piece {i} has {len(frame)} bytes, not {n}")
            if piece_digest(frame) != f.digests[i]:
                raise _Lied(f"its piece {i} is not the swarm's (the digest differs)")
            asked.popleft()
            f.write(which, offset, memoryview(frame))
            f.left -= 1
            got += n
            served += 1
        await ch.send_frame(b"ok")
        return served
    finally:
        f.todo.extendleft(reversed(asked))  # first in line for the other holders
        ch.close("state received")


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
    """The state after round `rnd`, from the peers in `tickets` (up to PARALLEL at once, in
    order), a piece at a time into `sink(layout)` (which returns where the bytes go: arrays, or
    files; each piece is written once, checked, in no particular order); returns the layout once
    every piece is in. The pieces' digests must make `want_checksum`, and the layout `size`
    values, when given. StateError if the holders could not hand over every piece between them.

    `timeout` bounds connecting and the header; each piece must come within min(timeout,
    SLACK_S) + its size / `min_rate`, and a holder's pieces altogether keep up `min_rate`, or
    that holder is given up. With `layout` (the model this node built itself), the holder's
    tensor names, shapes and order must be exactly those: same-sized tensors in another order
    would otherwise load mislabeled. `arrays`: how many arrays of θ's size come (θ and the
    rule's state arrays)."""
    errors: list[str] = []
    known = _DONORS.setdefault(endpoint.node_id, {})
    waiting: deque[str] = deque()
    for ticket in sorted(tickets, key=lambda t: known.get(_donor_id(t)) == "failed"):  # (a stable sort)
        if known.get(donor := _donor_id(ticket)) == "lied":
            errors.append(f"{donor[:10]}: not asked: it sent a state that was not the swarm's before")
        else:
            waiting.append(ticket)
    f = _Fetch(rnd, want_checksum)
    taking: dict[asyncio.Task, str] = {}
    try:
        while not f.done:
            while waiting and len(taking) < PARALLEL and (f.layout is None or f.todo):
                ticket = waiting.popleft()
                task = asyncio.ensure_future(_take(f, endpoint, ticket, sink, size, timeout, min_rate, layout, arrays))
                taking[task] = ticket
            if not taking:
                break
            ended, _ = await asyncio.wait(taking, return_when=asyncio.FIRST_COMPLETED)
            for task in ended:
                ticket = taking.pop(task)
                donor = _donor_id(ticket)
                try:
                    task.result()
                except (StateError, TransportError) as e:
                    known[donor] = "lied" if isinstance(e, _Lied) else "failed"
                    errors.append(f"{ticket[:20]}...: {e}")
                    if f.layout is not None:
                        log.warning("passing over state holder %s: %s", donor[:10], e)
                else:
                    known.pop(donor, None)
                    waiting.append(ticket)  # asked again if a piece comes back from another holder
    finally:
        for task in taking:
            task.cancel()
        if taking:
            await asyncio.wait(taking)
            for task in taking:  # (retrieved: their errors no longer matter)
                if not task.cancelled():
                    task.exception()
    if f.done:
        assert f.layout is not None
        return f.layout
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
