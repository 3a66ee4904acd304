"""All-gather of per-node payloads over iroh (ALPN ``drift-gather/0``): the collective of sync
rules whose contributions do not sum into something as small (drift/sync/sparse.py: sums of
sparse vectors are not sparse). Two shapes, the same result:

  * direct: each member sends its payload to every other member at once and receives every
    other member's (one step);
  * tree (Bruck's all-gather, any N): ceil(log2 N) steps; at step j (d = 2^j) the member at ring
    place r sends the payloads it holds, those of places r .. r+c-1 (c = min(d, N-d)), to place
    r-d and receives those of places r+d .. r+d+c-1 from place r+d.

Either way each node uploads N-1 payloads and downloads N-1: in an all-gather every node must
download every other payload, and with unicast links every byte downloaded was uploaded by
someone, so no scheme that forwards payloads unchanged sends fewer bytes than direct from the
busiest node (BENCHMARKS.md, "the home link"). The tree trades N-1 streams for log2 N rounds of
one (fewer connections, a round trip more per step), and a forwarded payload is only as honest as
its forwarder: a tampered one shows as a checksum mismatch, not as its culprit.

One connection per sender, receiver, step and attempt. Its first frame is a header, then the
payload(s) in frames of at most CHUNK_BYTES, then the receiver answers ``ok`` and the sender hangs up::

    direct  >4s B I I Q = magic "DGTH", version, round, generation (the coordinator's ring epoch), payload bytes
    tree    >4s B I I B H = magic "DGTB", version, round, generation, step, payloads; then a frame of one
            byte per payload (1: `nbytes` long, 0: empty), then the non-empty ones in ring order

Trust, as the ring's: only members this node verified connect or are connected to; a member has
at most one connection waiting (a newer one replaces it); every frame is bounded by the size the
rule expects (its payload size, or 0 for a member with nothing to send); every connect, read and
write has a deadline, and a member that stalls or sends what was not expected fails the attempt
with RingError naming it (`suspect`), which the node reports like a broken ring (RingFailed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Callable

from drift.protocol import MAX_ROUND, RingMember, printable
from drift.ring import CHUNK_BYTES, HELLO_TIMEOUT, ReduceStats, RingError
from drift.transport import GATHER_ALPN, Channel, Endpoint, TransportError, TransportTimeout, close_conn, peer_of

_HEADER = struct.Struct(">4sBIIQ")
_MAGIC = b"DGTH"
_TREE = struct.Struct(">4sBIIBH")
_TREE_MAGIC = b"DGTB"
_DIRECT = 255  # the "step" of a direct payload (a tree has at most 32 steps)
_VERSION = 1

log = logging.getLogger("drift.gather")


class Gather:
    """This node's side of all-gathers: serves incoming payloads, sends its own."""

    def __init__(self, endpoint: Endpoint, timeout: float = 120.0, trusted: Callable[[str], bool] = lambda p: True):
        self.endpoint = endpoint
        self.trusted = trusted
        self.node_id = endpoint.node_id
        self.timeout = timeout
        # member -> (round, generation, step, payload bytes (direct) or payloads (tree), channel)
        self._incoming: dict[str, tuple[int, int, int, int, Channel]] = {}
        self._arrived = asyncio.Condition()

    async def handle_incoming(self, conn) -> None:
        """Keep a member's incoming payload connection (its header read) until an all-gather
        takes it. Returns normally whatever the peer does (a bad one is closed with a log line)."""
        peer = peer_of(conn)
        if not self.trusted(peer):
            log.warning("dropping gather connection from %s: not a verified member of this run", peer[:10])
            close_conn(conn, "not a verified member of this run")
            return
        try:
            t = min(self.timeout, HELLO_TIMEOUT)
            ch = await Endpoint.accept_channel(conn, timeout=t)
            head = await ch.recv_frame(max(_HEADER.size, _TREE.size), timeout=t)
            if len(head) == _HEADER.size:
                magic, version, rnd, gen, size = _HEADER.unpack(head)
                step, ok = _DIRECT, magic == _MAGIC
            elif len(head) == _TREE.size:
                magic, version, rnd, gen, step, size = _TREE.unpack(head)
                ok = magic == _TREE_MAGIC and step < 32
            else:
                raise RingError(f"gather header of {len(head)} bytes")
            if not ok or version != _VERSION or rnd > MAX_ROUND or gen > MAX_ROUND:
                raise RingError("not a drift gather header")
        except Exception as e:
            why = e if isinstance(e, (RingError, TransportError)) else repr(e)
            log.warning("dropping gather connection from %s: %s", peer[:10], printable(f"{why}", 300))
            close_conn(conn, "bad gather header")
            return
        async with self._arrived:
            old = self._incoming.pop(peer, None)
            if old is not None:
                old[4].close("replaced by a newer connection")
            self._incoming[peer] = (rnd, gen, step, size, ch)
            self._arrived.notify_all()

    async def allgather(
        self,
        payload: bytes,
        members: list[RingMember],
        round_: int,
        nbytes: int,
        generation: int = 0,
        tree: bool = False,
    ) -> tuple[list[bytes], ReduceStats]:
        """Every member's payload, in the members' order (this node's own at its place). Each is
        `nbytes` long or empty (a member with nothing to send). `tree`: Bruck's steps instead of
        direct sends (the module's docstring). RingError if any member's payload does not arrive,
        whole and as expected, within the deadlines."""
        t0 = time.perf_counter()
        ids = [m.node_id for m in members]
        if unverified := [i for i in ids if i != self.node_id and not self.trusted(i)]:
            raise RingError(f"the ring names {unverified[0][:10]}, a node this one has not verified")
        me = ids.index(self.node_id)
        out: list[bytes] = [b""] * len(members)
        out[me] = payload
        count = [0, 0]  # bytes sent, received
        try:
            if tree:
                await self._tree(out, members, me, round_, nbytes, generation, count)
            else:
                await self._direct(out, members, me, round_, nbytes, generation, count)
        except RingError as e:
            raise RingError(f"all-gather of round {round_} failed: {e}", suspect=e.suspect) from None
        return out, ReduceStats(time.perf_counter() - t0, count[0], count[1], codec="sparse")

    async def _direct(self, out, members: list[RingMember], me: int, round_, nbytes, generation, count) -> None:
        async def recv_from(k: int, m: RingMember) -> None:
            size, ch = await self._take(m.node_id, round_, generation, _DIRECT)
            try:
                if size not in (0, nbytes):
                    raise RingError(
                        f"{m.node_id[:10]} announced a payload of {size} bytes, expected {nbytes}", suspect=m.node_id
                    )
                (out[k],) = await self._receive(ch, m.node_id, [size], count)
            finally:
                ch.close("payload received")

        head = _HEADER.pack(_MAGIC, _VERSION, round_, generation, len(out[me]))
        others = [(k, m) for k, m in enumerate(members) if k != me]
        await _all([self._send(m, [head], [out[me]], count) for _, m in others] + [recv_from(k, m) for k, m in others])

    async def _tree(self, out, members: list[RingMember], me: int, round_, nbytes, generation, count) -> None:
        n = len(members)
        step, d = 0, 1
        while d < n:
            c = min(d, n - d)
            to, frm = members[(me - d) % n], members[(me + d) % n]

            async def recv(frm: RingMember = frm, c: int = c, step: int = step, d: int = d) -> None:
                peer = frm.node_id
                got, ch = await self._take(peer, round_, generation, step)
                try:
                    if got != c:
                        raise RingError(f"{peer[:10]} announced {got} payloads, expected {c}", suspect=peer)
                    (flags,) = await self._receive(ch, peer, [c], None)
                    if any(f > 1 for f in flags):
                        raise RingError(f"{peer[:10]} sent a bad payload table", suspect=peer)
                    for i, b in enumerate(await self._receive(ch, peer, [f * nbytes for f in flags], count)):
                        out[(me + d + i) % n] = b
                finally:
                    ch.close("payloads received")

            mine = [out[(me + i) % n] for i in range(c)]
            head = _TREE.pack(_TREE_MAGIC, _VERSION, round_, generation, step, c)
            flags = bytes(1 if b else 0 for b in mine)
            await _all([self._send(to, [head, flags], mine, count), recv()])
            step, d = step + 1, 2 * d

    async def _send(self, m: RingMember, frames: list[bytes], payloads: list[bytes], count: list[int]) -> None:
        """Connect to `m`, send the frames, then the payloads in CHUNK_BYTES frames; wait for ok."""
        try:
            ch = await self.endpoint.connect(m.ticket, GATHER_ALPN, timeout=self.timeout)
        except TransportError as e:
            raise RingError(f"could not reach {m.node_id[:10]}: {e}", suspect=m.node_id) from None
        try:
            for f in frames:
                await ch.send_frame(f, self.timeout)
            for p in payloads:
                view = memoryview(p)
                for a in range(0, len(view), CHUNK_BYTES):
                    await ch.send_frame(view[a : a + CHUNK_BYTES], self.timeout)
            if await ch.recv_frame(16, self.timeout) != b"ok":
                raise RingError(f"{m.node_id[:10]} did not confirm our payload", suspect=m.node_id)
            count[0] += ch.bytes_sent
        except TransportTimeout as e:
            raise RingError(f"sending to {m.node_id[:10]}: {e}", suspect=m.node_id) from None
        except TransportError as e:
            raise RingError(f"sending to {m.node_id[:10]}: {e}") from None
        finally:
            ch.close("payload sent")

    async def _take(self, peer: str, round_: int, generation: int, step: int) -> tuple[int, Channel]:
        """(size or count, channel) of the connection `peer` opened for this round, attempt and
        step, once it is there."""
        try:
            async with self._arrived:
                await asyncio.wait_for(
                    self._arrived.wait_for(
                        lambda: self._incoming.get(peer, (-1,) * 3)[:3] == (round_, generation, step)
                    ),
                    self.timeout,
                )
                return self._incoming.pop(peer)[3:]
        except asyncio.TimeoutError:
            raise RingError(f"{peer[:10]} never sent its payload (waited {self.timeout:g}s)", suspect=peer) from None

    async def _receive(self, ch: Channel, peer: str, sizes: list[int], count: list[int] | None) -> list[bytes]:
        """Blobs of exactly these sizes; with `count`, the last read of this connection: then
        answer ok, wait for the sender to hang up and count the bytes received."""
        try:
            blobs = []
            for size in sizes:
                parts, got = [], 0
                while got < size:
                    frame = await ch.recv_frame(min(CHUNK_BYTES, size - got), self.timeout)
                    if not frame:
                        raise RingError(f"{peer[:10]} sent an empty frame", suspect=peer)
                    parts.append(frame)
                    got += len(frame)
                blobs.append(b"".join(parts))
            if count is not None:
                await ch.send_frame(b"ok", self.timeout)
                count[1] += ch.bytes_received
                with contextlib.suppress(TransportError):  # the sender hangs up once it has read our ok
                    await ch.recv_frame(0, min(self.timeout, HELLO_TIMEOUT))
            return blobs
        except TransportTimeout as e:
            raise RingError(f"receiving from {peer[:10]}: {e}", suspect=peer) from None
        except TransportError as e:
            raise RingError(f"receiving from {peer[:10]}: {e}") from None


async def _all(coros) -> None:
    """Run them together; the first error cancels the rest (also when the caller is cancelled:
    a newer ring for the round)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
