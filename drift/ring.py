"""Ring all-reduce of a flat float32 vector between nodes, over iroh (ALPN ``drift-ring/0``).

Each node sends to its right neighbour and receives from its left, on connections it keeps
between rounds while the ring order stays the same. The vector is cut into N segments
(reduce-scatter, then all-gather) and each segment into chunks; a chunk is forwarded as soon as
it has been received and reduced, so the 2(N-1) steps overlap on the wire.

Invariant (replicas bit-identical): every reduced segment is computed once, at the node that
owns it after reduce-scatter, and then copied verbatim around the ring; no node ever adds the
same numbers in a different order from another.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from dataclasses import dataclass

import numpy as np

from drift.protocol import RingMember
from drift.transport import RING_ALPN, Channel, Endpoint, TransportError

_HEADER = struct.Struct(">4sIIIBI")  # magic, round, step, chunk, codec, n elements
_MAGIC = b"DRNG"
CODEC_FP32 = 0
CHUNK_BYTES = 1 << 20  # 1 MiB writes measured fastest through the binding


class RingError(Exception):
    """The all-reduce cannot produce a correct result (peer gone, bad chunk, timeout)."""


@dataclass
class ReduceStats:
    seconds: float
    bytes_sent: int
    bytes_received: int


def segment_bounds(n: int, parts: int) -> list[int]:
    """Boundaries of `parts` near-equal segments of range(n) (like np.array_split)."""
    q, r = divmod(n, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + q + (1 if k < r else 0))
    return bounds


class Ring:
    """This node's side of the ring: accepts its left neighbour, connects to its right."""

    def __init__(self, endpoint: Endpoint, timeout: float = 120.0, chunk_bytes: int = CHUNK_BYTES):
        self.endpoint = endpoint
        self.node_id = endpoint.node_id
        self.timeout = timeout
        self.chunk_elems = max(1, chunk_bytes // 4)
        self._incoming: dict[str, Channel] = {}
        self._arrived = asyncio.Condition()
        self._right: Channel | None = None
        self._expected: set[str] = set()

    # --- connections ---------------------------------------------------------------------------

    async def handle_incoming(self, conn) -> None:  # noqa: ANN001 - iroh.Connection
        """Register a ring connection accepted by the node's endpoint (called per connection)."""
        peer = str(conn.remote_id())
        try:
            ch = await Endpoint.accept_channel(conn, timeout=self.timeout)
            await ch.recv_frame(4096, timeout=self.timeout)  # hello: makes the stream visible
        except TransportError:
            conn.close(1, b"ring hello failed")
            return
        async with self._arrived:
            if peer not in self._expected:
                ch.close("not in the current ring")
                return
            old = self._incoming.pop(peer, None)
            if old is not None:
                old.close("replaced")
            self._incoming[peer] = ch
            self._arrived.notify_all()

    async def _configure(self, members: list[RingMember]) -> tuple[Channel, Channel]:
        ids = [m.node_id for m in members]
        r = ids.index(self.node_id)
        right, left = members[(r + 1) % len(members)], members[(r - 1) % len(members)]
        async with self._arrived:
            self._expected = set(ids) - {self.node_id}
        if self._right is None or self._right.peer_id != right.node_id:
            if self._right is not None:
                self._right.close("ring changed")
            self._right = await self.endpoint.connect(right.ticket, RING_ALPN, timeout=self.timeout)
            await self._right.send_frame(json.dumps({"node_id": self.node_id}).encode())
        try:
            async with self._arrived:
                await asyncio.wait_for(self._arrived.wait_for(lambda: left.node_id in self._incoming),
                                       self.timeout)
                left_ch = self._incoming[left.node_id]
        except asyncio.TimeoutError:
            raise RingError(f"left neighbour {left.node_id[:10]} never connected "
                            f"(waited {self.timeout:g}s)") from None
        return self._right, left_ch

    def close(self) -> None:
        for ch in [self._right, *self._incoming.values()]:
            if ch is not None:
                ch.close("ring closed")
        self._right, self._incoming = None, {}

    # --- the all-reduce ------------------------------------------------------------------------

    async def allreduce_sum(self, x: np.ndarray, members: list[RingMember], round_: int) -> ReduceStats:
        """Replace x (flat float32, in place) by the sum of every member's x."""
        if x.dtype != np.float32 or x.ndim != 1 or not x.flags.c_contiguous:
            raise ValueError("allreduce_sum needs a flat, contiguous float32 array")
        t0 = time.perf_counter()
        n_nodes = len(members)
        if n_nodes == 1:
            return ReduceStats(0.0, 0, 0)
        try:
            right, left = await self._configure(members)
        except TransportError as e:
            raise RingError(f"ring setup failed: {e}") from None
        sent0, recv0 = right.bytes_sent, left.bytes_received
        r = [m.node_id for m in members].index(self.node_id)
        bounds = segment_bounds(x.size, n_nodes)

        def chunks(seg: int) -> list[tuple[int, int]]:
            lo, hi = bounds[seg], bounds[seg + 1]
            return [(a, min(a + self.chunk_elems, hi)) for a in range(lo, hi, self.chunk_elems)] or [(lo, lo)]

        steps = 2 * (n_nodes - 1)
        send_seg = [(r - s) % n_nodes if s < n_nodes - 1 else (r + 1 - (s - n_nodes + 1)) % n_nodes
                    for s in range(steps)]
        recv_seg = [(r - s - 1) % n_nodes if s < n_nodes - 1 else (r - (s - n_nodes + 1)) % n_nodes
                    for s in range(steps)]
        # What a node sends at step g >= 1 is exactly what it received at step g-1, so a chunk
        # may be forwarded as soon as it has been reduced: the queue carries that hand-off.
        forward: asyncio.Queue[tuple[int, int, int, int]] = asyncio.Queue()

        async def sender() -> None:
            for c, (a, b) in enumerate(chunks(send_seg[0])):
                await self._send_chunk(right, x, a, b, round_, 0, c)
            for _ in range(sum(len(chunks(send_seg[g])) for g in range(1, steps))):
                g, c, a, b = await forward.get()
                await self._send_chunk(right, x, a, b, round_, g, c)

        async def receiver() -> None:
            for g in range(steps):
                for c, (a, b) in enumerate(chunks(recv_seg[g])):
                    data = await self._recv_chunk(left, round_, g, c, b - a)
                    if g < n_nodes - 1:
                        x[a:b] += data   # reduce-scatter: accumulate into our partial sum
                    else:
                        x[a:b] = data    # all-gather: take the owner's final values verbatim
                    if g + 1 < steps:
                        forward.put_nowait((g + 1, c, a, b))

        tasks = [asyncio.ensure_future(sender()), asyncio.ensure_future(receiver())]
        try:
            await asyncio.gather(*tasks)
        except (TransportError, RingError) as e:
            for t in tasks:
                t.cancel()
            self.close()
            raise RingError(f"all-reduce of round {round_} failed: {e}") from None
        return ReduceStats(time.perf_counter() - t0, right.bytes_sent - sent0,
                           left.bytes_received - recv0)

    async def _send_chunk(self, ch: Channel, x: np.ndarray, a: int, b: int,
                          round_: int, step: int, chunk: int) -> None:
        head = _HEADER.pack(_MAGIC, round_, step, chunk, CODEC_FP32, b - a)
        await ch.send_parts([head, x[a:b]], timeout=self.timeout)

    async def _recv_chunk(self, ch: Channel, round_: int, step: int, chunk: int, n: int) -> np.ndarray:
        frame = await ch.recv_frame(_HEADER.size + 4 * n, timeout=self.timeout)
        if len(frame) < _HEADER.size:
            raise RingError(f"ring chunk of {len(frame)} bytes is shorter than its header")
        magic, fr, fs, fc, codec, fn = _HEADER.unpack_from(frame)
        want = (_MAGIC, round_, step, chunk, CODEC_FP32, n)
        if (magic, fr, fs, fc, codec, fn) != want or len(frame) != _HEADER.size + 4 * n:
            raise RingError(f"unexpected ring chunk: got (round {fr}, step {fs}, chunk {fc}, codec {codec}, "
                            f"{fn} values), expected (round {round_}, step {step}, chunk {chunk}, "
                            f"codec {CODEC_FP32}, {n} values)")
        return np.frombuffer(frame, dtype=np.float32, offset=_HEADER.size)
