"""All-gather of per-node payloads over iroh (ALPN ``drift-gather/0``): the collective of sync
rules whose contributions do not sum into something as small (drift/sync/sparse.py: sums of
sparse vectors are not sparse). Each member sends its payload to every other member at once and
receives every other member's, in one step: each node uploads N-1 payloads and downloads N-1,
which no scheme that forwards payloads unchanged beats from the busiest node (BENCHMARKS.md,
"the home link"; a tree of Bruck's steps, measured there, moved the same bytes and was removed).

Each payload is signed by its owner (Ed25519, its node key) over ``payload_message``: the round,
the attempt (the coordinator's ring epoch), the owner's id and sha256 of the payload. A receiver
checks the signature before it keeps a payload, and reports what it got from each member to the
coordinator (RoundDone.heard: the digest and the signature). So a member that sends different
payloads to different members signs each of them, and two reports of different digests, both
signed, prove it (drift.rules.equivocation); no member can make such proof against another,
since it cannot sign in its name.

A stream per payload, on a connection each sender keeps to each receiver across levels, attempts
and rounds (a new QUIC connection per payload was most of a round's sync at 256 nodes on one
machine, and costs a round trip a level on real links). A stream's first frame is a header, then
the payload in frames of at most CHUNK_BYTES, then the receiver answers ``ok`` and both ends
finish the stream; a transfer that fails closes its connection, and the next opens a new one::

    >4s B I I Q 64s B = magic "DGTH", version, round, generation (the coordinator's ring epoch),
                        payload bytes, the owner's signature of payload_message, level

A swarm larger than the sparse rule's `fanout` gathers in levels (drift/hierarchy.py, `tree`):
at level 0 each member's own payload, above it the payload of the sender's block, which it
computed (SparseLoCo.merge) and signs as its own with the level's number: a payload signed for
one level cannot pass for another, and one that differs from what its block signed is proof
(drift.rules.equivocation).

Trust, as the ring's: only members this node verified connect or are connected to; a member has
at most one connection (a newer one replaces it), STREAMS streams open on it at once, and one
payload waiting (a newer one replaces it); every frame is bounded by the size the
rule expects (its payload size, or 0 for a member with nothing to send); every connect, read and
write has a deadline, and a member that stalls, sends what was not expected or a payload it did
not sign fails the attempt with RingError naming it (`suspect`), which the node reports like a
broken ring (RingFailed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import nacl.signing

from drift import hierarchy
from drift.protocol import MAX_ROUND, Heard, RingMember, printable
from drift.ring import CHUNK_BYTES, HELLO_TIMEOUT, MIN_RATE, ReduceStats, RingError, recv_by, together, verify
from drift.transport import GATHER_ALPN, Channel, Endpoint, TransportError, TransportTimeout, close_conn, peer_of

_HEADER = struct.Struct(">4sBIIQ64sB")
_MAGIC = b"DGTH"
_VERSION = 3  # 3: the level (2 had none: one flat all-gather; 1 no signature, and a tree mode)
_SIGNED = struct.Struct(">4sIIB")  # "DGSG", round, generation, level
MAX_LEVEL = 16  # levels of a hierarchy (hierarchy.shape: log_fanout of the members, fanout >= 2)
STREAMS = 4  # streams a member may have open on its connection to us at once (it sends one at a time)

if TYPE_CHECKING:
    from drift.sync import Combined

log = logging.getLogger("drift.gather")

LATE_FACTOR = 4.0  # a payload still missing this many times what half the others took, plus
# a slack (BarrierReady.slack_s), plus its size at MIN_RATE per payload its sender uploads, is late


def late_after(arrivals: list[float], others: int, nbytes: int, slack_s: float) -> float | None:
    """Seconds after the all-gather started by which every other member's payload must have
    arrived (or taken ours), once at least half of them did (`arrivals`: their times): LATE_FACTOR
    times what that half took, plus `slack_s` (BarrierReady.slack_s), plus the time a link of
    MIN_RATE takes to carry all `others` payloads of `nbytes` at once. None before then: only the
    connections' own deadlines apply. A member that withholds its payload, or never takes ours,
    is named by every member it holds up, after seconds, not after the connection's timeout."""
    need = (others + 1) // 2
    if need == 0 or len(arrivals) < need:
        return None
    return LATE_FACTOR * sorted(arrivals)[need - 1] + slack_s + others * nbytes / MIN_RATE


def payload_message(owner: str, round_: int, generation: int, digest: bytes, level: int = 0) -> bytes:
    """What the sender of a payload signs: round, attempt, level, its id, sha256 of the payload."""
    return _SIGNED.pack(b"DGSG", round_, generation, level) + bytes.fromhex(owner) + digest


def signed_payload(owner: str, round_: int, generation: int, digest: str, sig: str, level: int = 0) -> bool:
    """True when `sig` (hex) is `owner`'s signature of the payload of sha256 `digest` (hex) in
    this round, attempt and level (what RoundDone.heard reports)."""
    try:
        message = payload_message(owner, round_, generation, bytes.fromhex(digest), level)
        return verify(owner, message, bytes.fromhex(sig))
    except (ValueError, struct.error):
        return False


class Gather:
    """This node's side of all-gathers: serves incoming payloads, sends its own."""

    def __init__(
        self,
        endpoint: Endpoint,
        timeout: float = 120.0,
        trusted: Callable[[str], bool] = lambda p: True,
        ticket_of: Callable[[str], str | None] = lambda p: None,
    ):
        """`trusted` and `ticket_of` (a member named by id alone): as drift.ring.Ring's."""
        self.endpoint = endpoint
        self.trusted = trusted
        self.ticket_of = ticket_of
        self.node_id = endpoint.node_id
        self._key = nacl.signing.SigningKey(bytes(endpoint.ep.secret_key().to_bytes()))  # its node id's key
        self.timeout = timeout
        # member -> (round, generation, level, payload bytes, signature, channel)
        self._incoming: dict[str, tuple[int, int, int, int, bytes, Channel]] = {}
        self._arrived = asyncio.Condition()
        self._from: dict[str, object] = {}  # member -> its connection to us (iroh.Connection)
        self._to: dict[str, tuple[str, object]] = {}  # member -> (its ticket, our connection to it)

    async def handle_incoming(self, conn) -> None:
        """Serve a member's payload connection while it lasts: each stream's header is read and
        kept until an all-gather takes the stream. Returns normally whatever the peer does (a bad
        one is closed with a log line)."""
        peer = peer_of(conn)
        if not self.trusted(peer):
            log.warning("dropping gather connection from %s: not a verified member of this run", peer[:10])
            close_conn(conn, "not a verified member of this run")
            return
        with contextlib.suppress(Exception):
            conn.set_max_concurrent_bi_streams(STREAMS)
        if (old := self._from.pop(peer, None)) is not None:
            close_conn(old, "replaced by a newer connection")
        self._from[peer] = conn
        try:
            while True:
                try:
                    ch = await Endpoint.accept_channel(conn, timeout=None)
                except TransportError:
                    return  # the connection closed
                if not await self._header(peer, conn, ch):
                    return
        finally:
            if self._from.get(peer) is conn:
                del self._from[peer]
            waiting = self._incoming.get(peer)
            if waiting is not None and waiting[-1].conn is conn:  # its stream ended with it
                del self._incoming[peer]

    async def _header(self, peer: str, conn, ch: Channel) -> bool:
        """Read a new stream's header and keep the stream for the exchange that takes it; a bad
        header, or a member no longer verified, closes the connection (False)."""
        try:
            t = min(self.timeout, HELLO_TIMEOUT)
            head = await ch.recv_frame(_HEADER.size, timeout=t)
            if len(head) != _HEADER.size:
                raise RingError(f"gather header of {len(head)} bytes")
            magic, version, rnd, gen, size, sig, level = _HEADER.unpack(head)
            if magic != _MAGIC or version != _VERSION or rnd > MAX_ROUND or gen > MAX_ROUND or level > MAX_LEVEL:
                raise RingError("not a drift gather header")
            if not self.trusted(peer):
                raise RingError("no longer a verified member of this run")
        except Exception as e:
            why = e if isinstance(e, (RingError, TransportError)) else repr(e)
            log.warning("dropping gather connection from %s: %s", peer[:10], printable(f"{why}", 300))
            close_conn(conn, "bad gather header")
            return False
        async with self._arrived:
            old = self._incoming.pop(peer, None)
            self._incoming[peer] = (rnd, gen, level, size, sig, ch)
            self._arrived.notify_all()
        if old is not None:
            await old[-1].abort()  # replaced by a newer payload
        return True

    def header(self, round_: int, generation: int, payload: bytes, level: int = 0) -> bytes:
        """The header of our payload: its size and our signature of it."""
        signed = payload_message(self.node_id, round_, generation, hashlib.sha256(payload).digest(), level)
        sig = self._key.sign(signed).signature
        return _HEADER.pack(_MAGIC, _VERSION, round_, generation, len(payload), sig, level)

    async def allgather(
        self,
        payload: bytes,
        members: list[RingMember],
        round_: int,
        nbytes: int,
        generation: int = 0,
        slack_s: float = 5.0,
    ) -> tuple[list[bytes], ReduceStats]:
        """Every member's payload, in the members' order (this node's own at its place), and in
        the stats what it got from each other member (`heard`). Each is `nbytes` long or empty (a
        member with nothing to send), and signed by its sender. RingError if any member's payload
        does not arrive, whole, signed and as expected, within the deadlines."""
        others = [m for m in members if m.node_id != self.node_id]
        return await self.exchange(payload, members, others, round_, nbytes, generation, slack_s)

    async def tree(
        self,
        payload: bytes,
        ring: list[RingMember],
        round_: int,
        nbytes: int,
        generation: int,
        slack_s: float,
        fanout: int,
        merge: Callable[[list[bytes], list[RingMember]], tuple[bytes, Combined]],
    ) -> tuple[list[bytes], list[RingMember], ReduceStats, list[str]]:
        """The hierarchy's gather (drift/hierarchy.py): level by level, the payloads of the
        blocks this node's parent joins, from the members plan() names, merged into the parent's
        payload (`merge`, SparseLoCo.merge: (payloads, the children as members, each weighing what
        its members weigh together) -> (payload, what it found)). At the top: the top's
        payloads and children for the rule's combine, the stats of all levels (`heard` tagged
        with each level) and the merges' outliers. At most `fanout` members: the flat all-gather.
        RingError names the level where it failed."""
        t0 = time.perf_counter()
        me = next(i for i, m in enumerate(ring) if m.node_id == self.node_id)
        levels = hierarchy.plan(len(ring), fanout)
        total = ReduceStats(0.0, 0, 0, codec="sparse")
        outliers: list[str] = []
        for depth, level in enumerate(levels):
            sources = level.sources(me)
            weights = level.weights(me, [m.weight for m in ring])
            children = [ring[src].model_copy(update={"weight": w}) for (_, src), w in zip(sources, weights)]
            give = [ring[t] for t in level.targets(me)]
            try:
                result, stats = await self.exchange(payload, children, give, round_, nbytes, generation, slack_s, depth)
            except RingError as e:
                raise RingError(f"level {depth}: {e}", suspect=e.suspect, level=depth) from None
            total.bytes_sent += stats.bytes_sent
            total.bytes_received += stats.bytes_received
            total.check_seconds += stats.check_seconds
            total.heard += stats.heard
            if depth == len(levels) - 1:
                total.seconds = time.perf_counter() - t0
                return result, children, total, outliers
            # On the loop, as combine and apply are: an attempt cancelled for a retry must not leave
            # a merge running that would still write the rule's buffers under the new attempt.
            payload, found = merge(result, children)
            outliers += found.outliers
        raise AssertionError("a plan always has a top level")

    async def exchange(
        self,
        payload: bytes,
        take: list[RingMember],
        give: list[RingMember],
        round_: int,
        nbytes: int,
        generation: int = 0,
        slack_s: float = 5.0,
        level: int = 0,
    ) -> tuple[list[bytes], ReduceStats]:
        """The payloads of the members in `take`, in its order (this node's own at its place),
        while ours goes to every member in `give`; in the stats what it got from each (`heard`).
        Each is `nbytes` long or empty (a member with nothing to send), and signed by its sender
        for this level. RingError if any payload does not arrive, or ours is not taken, whole,
        signed and as expected, within the deadlines."""
        t0 = time.perf_counter()
        ids = [m.node_id for m in take] + [m.node_id for m in give]
        if unverified := [i for i in ids if i != self.node_id and not self.trusted(i)]:
            raise RingError(f"the ring names {unverified[0][:10]}, a node this one has not verified")
        out: list[bytes] = [payload if m.node_id == self.node_id else b"" for m in take]
        heard: dict[int, Heard] = {}  # place -> what came from that member
        arrived: dict[str, float] = {}  # member -> seconds after t0 its payload was in, signed
        acked: dict[str, float] = {}  # member -> seconds after t0 it confirmed ours
        news = asyncio.Event()  # set at each arrival
        count = [0, 0]  # bytes sent, received
        check = [0.0]  # seconds hashing, signing and verifying (RoundDone.check_s)

        async def recv_from(k: int, m: RingMember) -> None:
            size, sig, ch = await self._take(m.node_id, round_, generation, level)
            try:
                if size not in (0, nbytes):
                    raise RingError(
                        f"{m.node_id[:10]} announced a payload of {size} bytes, expected {nbytes}", suspect=m.node_id
                    )
                out[k] = await self._receive(ch, m.node_id, size, count)
            except asyncio.CancelledError:
                _abort_soon(ch)  # this stream only: the connection may carry the next attempt's
                raise
            except BaseException:
                ch.close("payload not received")
                raise
            await ch.finish()
            t = time.perf_counter()
            digest = hashlib.sha256(out[k]).digest()
            signed = verify(m.node_id, payload_message(m.node_id, round_, generation, digest, level), sig)
            check[0] += time.perf_counter() - t
            if not signed:
                raise RingError(f"{m.node_id[:10]} sent a payload it did not sign", suspect=m.node_id)
            heard[k] = Heard(owner=m.node_id, digest=digest.hex(), sig=sig.hex(), level=level)
            arrived[m.node_id] = time.perf_counter() - t0
            news.set()

        async def send_to(m: RingMember) -> None:
            await self._send(m, head, payload, count)
            acked[m.node_id] = time.perf_counter() - t0
            news.set()

        async def watch() -> None:
            """A member still silent long after half the others were done (late_after) is named."""
            while len(arrived) < len(others) or len(acked) < len(give):
                news.clear()
                lefts = []
                for done, want, what in ((arrived, others, "sent no payload"), (acked, give, "did not take ours")):
                    until = late_after([*done.values()], len(want), nbytes, slack_s)
                    if len(done) == len(want) or until is None:
                        continue
                    left = until - (time.perf_counter() - t0)
                    if left <= 0:
                        late = next(m.node_id for m in want if m.node_id not in done)
                        raise RingError(f"{late[:10]} {what} within {until:.1f}s, as half the others did", suspect=late)
                    lefts.append(left)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(news.wait(), min(lefts, default=None))

        t = time.perf_counter()
        head = self.header(round_, generation, payload, level)
        check[0] += time.perf_counter() - t
        others = [m for m in take if m.node_id != self.node_id]
        try:
            await together(
                [send_to(m) for m in give]
                + [recv_from(k, m) for k, m in enumerate(take) if m.node_id != self.node_id]
                + [watch()]
            )
        except RingError as e:
            raise RingError(f"all-gather of round {round_} failed: {e}", suspect=e.suspect) from None
        got = [heard[k] for k in sorted(heard)]
        return out, ReduceStats(
            time.perf_counter() - t0, count[0], count[1], codec="sparse", check_seconds=check[0], heard=got
        )

    async def _send(self, m: RingMember, head: bytes, payload: bytes, count: list[int]) -> None:
        """On a new stream to `m`, the header, then the payload in CHUNK_BYTES frames; wait for
        ok. A transfer that fails closes its connection (the next opens a new one); one cancelled
        (a newer attempt) abandons its stream only."""
        ch = await self._open(m)
        try:
            await ch.send_frame(head, self.timeout)
            view = memoryview(payload)
            for a in range(0, len(view), CHUNK_BYTES):
                await ch.send_frame(view[a : a + CHUNK_BYTES], self.timeout)
            if await ch.recv_frame(16, self.timeout) != b"ok":
                raise RingError(f"{m.node_id[:10]} did not confirm our payload", suspect=m.node_id)
            count[0] += ch.bytes_sent
            await ch.finish()
        except asyncio.CancelledError:
            _abort_soon(ch)
            raise
        except TransportTimeout as e:
            self._forget(m.node_id, ch.conn)
            raise RingError(f"sending to {m.node_id[:10]}: {e}", suspect=m.node_id) from None
        except TransportError as e:
            self._forget(m.node_id, ch.conn)
            raise RingError(f"sending to {m.node_id[:10]}: {e}") from None
        except BaseException:
            self._forget(m.node_id, ch.conn)
            raise

    async def _open(self, m: RingMember) -> Channel:
        """A new stream to `m`: on the connection kept from an earlier payload while it is open,
        else on a new one, kept from then on. A member that came back with a new ticket (a
        restarted node) gets a new connection."""
        ticket, conn = self._to.get(m.node_id, ("", None))
        if (now := m.ticket or self.ticket_of(m.node_id)) is None:
            raise RingError(f"the coordinator never told this node the ticket of {m.node_id[:10]}")
        if conn is not None and ticket == now and conn.close_reason() is None:
            with contextlib.suppress(TransportError):
                return await Endpoint.open_channel(conn, min(self.timeout, HELLO_TIMEOUT))
        self._forget(m.node_id, conn)
        try:
            conn = await self.endpoint.dial(now, GATHER_ALPN, timeout=self.timeout)
            ch = await Endpoint.open_channel(conn, self.timeout)
        except TransportError as e:
            raise RingError(f"could not reach {m.node_id[:10]}: {e}", suspect=m.node_id) from None
        self._to[m.node_id] = (now, conn)
        return ch

    def _forget(self, peer: str, conn) -> None:
        """Close `conn` and drop it if it is the one kept to `peer` (a newer may be kept by now)."""
        if conn is None:
            return
        close_conn(conn, "payload not sent")
        if self._to.get(peer, ("", None))[1] is conn:
            del self._to[peer]

    def connected(self, peer: str) -> bool:
        """Whether this node keeps an open connection to `peer` for its next payload."""
        conn = self._to.get(peer, ("", None))[1]
        return conn is not None and conn.close_reason() is None

    def retain(self, members: set[str]) -> None:
        """Close the connections to and from anyone not in `members` (who left the run)."""
        for peer in [p for p in self._to if p not in members]:
            close_conn(self._to.pop(peer)[1], "no longer a member")
        for peer in [p for p in self._from if p not in members]:
            close_conn(self._from.pop(peer), "no longer a member")

    async def _take(self, peer: str, round_: int, generation: int, level: int) -> tuple[int, bytes, Channel]:
        """(size, signature, channel) of the connection `peer` opened for this round, attempt
        and level, once there."""
        want = (round_, generation, level)
        try:
            async with self._arrived:
                await asyncio.wait_for(
                    self._arrived.wait_for(lambda: self._incoming.get(peer, (-1, -1, -1))[:3] == want), self.timeout
                )
                return self._incoming.pop(peer)[3:]
        except asyncio.TimeoutError:
            raise RingError(f"{peer[:10]} never sent its payload (waited {self.timeout:g}s)", suspect=peer) from None

    async def _receive(self, ch: Channel, peer: str, size: int, count: list[int]) -> bytes:
        """A payload of exactly `size` bytes, the last read of this stream: then answer ok, wait
        for the sender to finish its side and count the bytes received."""
        try:
            parts, got = [], 0
            until = time.monotonic() + self.timeout + size / MIN_RATE  # for the whole payload, not each frame
            while got < size:
                frame = await recv_by(ch, min(CHUNK_BYTES, size - got), self.timeout, until, "the payload")
                if not frame:
                    raise RingError(f"{peer[:10]} sent an empty frame", suspect=peer)
                parts.append(frame)
                got += len(frame)
            await ch.send_frame(b"ok", self.timeout)
            count[1] += ch.bytes_received
            with contextlib.suppress(TransportError):  # the sender hangs up once it has read our ok
                await ch.recv_frame(0, min(self.timeout, HELLO_TIMEOUT))
            return b"".join(parts)
        except TransportTimeout as e:
            raise RingError(f"receiving from {peer[:10]}: {e}", suspect=peer) from None
        except TransportError as e:
            raise RingError(f"receiving from {peer[:10]}: {e}") from None


_aborting: set[asyncio.Task] = set()


def _abort_soon(ch: Channel) -> None:
    """Abandon a stream without waiting (from a task being cancelled)."""
    task = asyncio.ensure_future(ch.abort())
    _aborting.add(task)
    task.add_done_callback(_aborting.discard)
