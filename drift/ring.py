"""Ring all-reduce of a flat float32 vector between nodes, over iroh (ALPN ``drift-ring/0``).

Each node sends to its right neighbour and receives from its left, on connections it keeps
between rounds while the ring order stays the same. The vector is cut into N segments
(reduce-scatter, then all-gather) and each segment into chunks of ~1 MiB on the wire; a chunk is
forwarded as soon as it has been received and reduced, so the 2(N-1) steps overlap on the wire.
Sending and receiving run as two concurrent tasks.

From GRID_FROM members the ring is a grid (`Grid`), unless the coordinator says to reduce flat
(`BarrierReady.flat`, after a grid attempt failed with nobody named): rows reduce-scatter, columns all-reduce the
segment they own, rows all-gather; each a ring as below, on its part of the vector. A ring of
1,000 walks 1,998 steps one after another, each a chance for a late hop; the grid walks 122, for
about the same bytes a member.

Chunks travel compressed by a codec (drift/compress.py):
  * reduce-scatter: a node decodes the partial sum it receives, adds its own float32 values
    (float32 accumulation) and encodes the new partial sum for its right neighbour;
  * the owner of a segment (the node that adds the last contribution) encodes the full sum once;
  * all-gather: that payload is forwarded byte for byte, and every node, the owner included,
    decodes the same bytes.

Invariant (replicas bit-identical): every reduced chunk is encoded once, at its owner, and every
node's result for that chunk is ``decode(those bytes)``; no node ever computes its copy of the
result any other way. Decoding is deterministic (compress.py), so all replicas agree to the bit.

Error feedback (codecs with ``error_feedback``, i.e. top-k): whenever this node encodes a chunk
(as a reduce-scatter hop or as the owner) it first adds its residual for that range, and keeps
as its new residual what the payload failed to carry. Nothing is lost: the sum over nodes of
(residual before + input) equals result + residual after, up to float rounding. Every node
encodes each range of the vector exactly once per round, so the new residual is written whole
into a second buffer and swapped in only when the all-reduce succeeds: a failed or cancelled
attempt leaves the residual as it was, and its retry starts from the same state.

Forwarded bytes are bound to their owner (nobody can frame a neighbour): the owner of a segment
signs, with its node key (Ed25519, the key its node id is), each chunk of its reduced segment:
``owner_message`` (round, ring generation, segment, its bounds, the owner's id, sha256 of the
payload). Every forwarder adds a *hop* signature over what it passes on (``hop_message``: step,
chunk, the owner's message and signature). A receiver checks both before it decodes or forwards a
chunk: a forwarder that altered the bytes it passes on is caught by the first honest node after
it, before any θ moves, and when the forwarder signed what it sent (its hop signature holds, the
owner's does not) the receiver holds proof that any third party can check (``Forgery``,
``proves_forgery``). A receiver cannot make such proof against an honest forwarder: it cannot sign
in the forwarder's name, and the hop signature covers the owner's signature, so it cannot swap
that either. An accusation without proof (a missing hop signature, garbage, silence) is one
neighbour's word, and counts only with the other neighbour's (drift.rules.caught).

Wire format of one chunk: a frame (transport.py: 4-byte length) holding a 32-byte header, then
(all-gather only) the owner's and the sender's 64-byte signatures, then the codec's payload::

    >4s B B H I I I Q I = magic "DRNG", version, codec id, step, round, chunk index,
                          n values, vector size, payload bytes

The receiver checks every header field against what it expects at that point of the ring and the
payload size against the codec, and aborts the all-reduce with RingError on any mismatch.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import logging
import math
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import nacl.exceptions
import nacl.signing
import numpy as np

from drift.compress import CODEC_IDS, CODECS, Codec, CodecError, Fp32, make_codec
from drift.protocol import MAX_ROUND, Forgery, Heard, RingMember, printable
from drift.transport import RING_ALPN, Channel, Endpoint, TransportError, TransportTimeout, close_conn, peer_of

_HEADER = struct.Struct(">4sBBHIIIQI")
_MAGIC = b"DRNG"
_RELAYED = "ring neighbour failed: "
_VERSION = (
    3  # 3: the grid's levels in the owner's message; 2: all-gather chunks carry the owner's and the sender's signatures
)
_SIG = 64  # an Ed25519 signature
_OWNER = struct.Struct(">4sIIBIQQQ")  # "DRSG", round, generation, level, segment, lo, hi, vector size
_HOP = struct.Struct(">4sII")  # "DRHP", step, chunk
CHUNK_BYTES = 1 << 20  # ~1 MiB on the wire per chunk: 1 MiB writes measured fastest through the binding
# What a connecting peer can hold. A neighbour sends its hello as soon as it connects; a peer the
# ring does not name yet (a neighbour that learned this round's ring before we did, or a stranger)
# waits at most PENDING_WAIT for our side to name it, and at most MAX_PENDING such peers wait at
# once (a newer one pushes out the oldest).
HELLO_TIMEOUT = 10.0
MAX_HELLO = 4096
PENDING_WAIT = 30.0
MAX_PENDING = 8
MAX_POOLED = 16  # free payload buffers kept between chunks and rounds (~1 MiB each)
# A pass (and a gather payload) must also keep up this rate overall, after `timeout`: a neighbour
# that sends each chunk just before its own timeout cannot stretch a pass to chunks x timeout.
MIN_RATE = 1 << 20  # bytes/s

log = logging.getLogger("drift.ring")


def tune_allocator() -> bool:
    """Keep glibc from mmap-ing and unmapping every ~1 MiB chunk buffer (idempotent).

    Each chunk passes through fresh 1 MiB buffers on both sides of iroh's binding (Python bytes,
    Rust Vecs). By default glibc serves them with mmap and returns them with munmap, so every
    chunk page-faults 256 times on first touch: that measured as the largest main-thread cost of a
    transfer. A fixed mmap threshold above the chunk size and a lazy trim keep them in the heap
    (measured: receiver CPU per MiB down about a third). Process-wide, glibc only; else a no-op."""
    global _TUNED
    if _TUNED is None:
        _TUNED = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL("libc.so.6")
                M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
                _TUNED = bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(
                    libc.mallopt(M_TRIM_THRESHOLD, 128 << 20)
                )
            except (OSError, AttributeError):
                pass
    return _TUNED


_TUNED: bool | None = None


class RingError(Exception):
    """The all-reduce cannot produce a correct result (peer gone, bad chunk, timeout). `suspect`
    is the neighbour whose bytes or connection failed, when that is known (not when it only
    passed on another node's failure); `proof`, when the suspect signed bytes its owner did not."""

    def __init__(self, msg: str, suspect: str = "", proof: Forgery | None = None, level: int = 0):
        super().__init__(msg)
        self.suspect = suspect
        self.proof = proof
        self.level = level  # where it failed: the sparse rule's hierarchy's level, or the grid's pass (Grid)
        self.placed = False  # its level is set (_placed)


def owner_message(
    owner: str, round_: int, generation: int, seg: int, lo: int, hi: int, total: int, digest: bytes, level: int = 0
) -> bytes:
    """What the owner of a reduced segment signs for each chunk x[lo:hi] of it (`level`: of the
    grid, where a pass's x is part of θ: a signature from one pass cannot pass for another's)."""
    return _OWNER.pack(b"DRSG", round_, generation, level, seg, lo, hi, total) + bytes.fromhex(owner) + digest


def hop_message(step: int, chunk: int, owned: bytes, owner_sig: bytes) -> bytes:
    """What a node signs for each all-gather chunk it sends: the owner's message and signature."""
    return _HOP.pack(b"DRHP", step, chunk) + owned + owner_sig


_KEYS: dict[str, nacl.signing.VerifyKey] = {}


def verify(node_id: str, message: bytes, sig: bytes) -> bool:
    """True when `sig` is node_id's Ed25519 signature of `message`."""
    try:
        if node_id not in _KEYS:
            if len(_KEYS) > 4096:
                _KEYS.clear()
            _KEYS[node_id] = nacl.signing.VerifyKey(bytes.fromhex(node_id))
        _KEYS[node_id].verify(message, sig)
        return True
    except (ValueError, TypeError, nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError):
        return False


def proves_forgery(p: Forgery, owner: str) -> bool:
    """True when `p` proves that p.forwarder passed on, as `owner`'s chunk, bytes that `owner` did
    not sign: the forwarder's hop signature holds over the owner's message and signature, and
    the owner's signature does not. `owner`: the segment's owner by the ring the caller sent
    (never the accuser's word)."""
    try:
        digest = bytes.fromhex(p.digest)
        owned = owner_message(owner, p.round, p.generation, p.segment, p.lo, p.hi, p.total, digest, p.level)
        owner_sig, hop_sig = bytes.fromhex(p.owner_sig), bytes.fromhex(p.hop_sig)
    except (ValueError, struct.error):
        return False
    return verify(p.forwarder, hop_message(p.step, p.chunk, owned, owner_sig), hop_sig) and not verify(
        owner, owned, owner_sig
    )


def segment_owner(ids: list[str], seg: int) -> str:
    """The ring member that completes segment `seg` in reduce-scatter (and signs it)."""
    return ids[(seg - 1) % len(ids)]


@dataclass
class ReduceStats:
    seconds: float
    bytes_sent: int
    bytes_received: int
    codec_seconds: float = 0.0  # encode + decode + accumulate, on this node
    codec: str = "fp32"
    check_seconds: float = 0.0  # binding bytes to their owner (hashes, signatures), on this node
    heard: list[Heard] = field(default_factory=list)  # (all-gather) what came from each other member, signed


def segment_bounds(n: int, parts: int) -> list[int]:
    """Boundaries of `parts` near-equal segments of range(n) (like np.array_split)."""
    q, r = divmod(n, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + q + (1 if k < r else 0))
    return bounds


GRID_FROM = 64  # members from which the ring runs as a grid (BENCHMARKS.md, "A ring of rings")
ROW, COLUMN, GATHER = 0, 1, 2  # the grid's passes (RingError.level, Forgery.level); a flat ring is all 0


@dataclass(frozen=True)
class Grid:
    """A ring too long to walk: its members as `rows` rows of `q` (places 0 .. rows * q - 1, row
    by row) and n - rows * q < q passengers after them, one a row from the first.

    The all-reduce in three passes. Each row reduce-scatters (the ring's first half, among its q
    members), so each member holds its row's sum of one segment of θ; the members holding the
    same segment, one a row (a column), all-reduce it (a ring of `rows`, on that segment); each
    row all-gathers (the ring's second half), its owners encoding and signing the column's sum.
    A passenger sends each segment of its θ to the member of its row that owns it, who adds it
    before the column's pass and sends the passenger its final segment, signed.

    2(q - 1) + 2(rows - 1) steps one after another, not 2(n - 1): 122 at 1,000 members, not
    1,998. A member moves about the flat ring's bytes: 2/q of θ more, and a member with a
    passenger another 1/q each way (`tests/test_ring.py` counts them).

    Trust, as the flat ring's: each segment's sum is encoded and signed once, by its column's
    owners, and travels the row's all-gather and the passenger's feed byte for byte under every
    forwarder's hop signature, so every member decodes the same bytes and a forwarder that alters
    them is proven (Forgery, `signer`). Timeouts are evidence only in the rows' reduce-scatter
    (every member starts it at once); a column starts when its rows' reduce-scatters end and a
    row's all-gather when its columns end, so a wait there can be anybody's delay: it lasts to
    the pass's deadline and names nobody. A member silent there would stall every round unnamed,
    so once an attempt most members report failed ends with nobody named, the swarm reduces on the
    flat ring for a while, where every wait is evidence (rules.flat_from_now, BarrierReady.flat)."""

    q: int
    rows: int
    n: int

    def passenger(self, p: int) -> bool:
        return p >= self.rows * self.q

    def row_of(self, p: int) -> int:
        """The row place p sits in, or rides with."""
        return p - self.rows * self.q if self.passenger(p) else p // self.q

    def row(self, i: int) -> range:
        return range(i * self.q, (i + 1) * self.q)

    def column(self, p: int) -> list[int]:
        """The places that own the same segment as row member p, one a row."""
        return [i * self.q + p % self.q for i in range(self.rows)]

    def rider(self, i: int) -> int | None:
        """Row i's passenger, if it has one."""
        p = self.rows * self.q + i
        return p if p < self.n else None


def grid(n: int, codec: Codec | str, flat: bool = False) -> Grid | None:
    """How n members all-reduce with `codec`: None for the flat ring (fewer than GRID_FROM, a codec
    with error feedback, whose residual needs each value encoded once a round, or `flat`: the
    coordinator's BarrierReady.flat)."""
    feedback = (CODECS[codec] if isinstance(codec, str) else codec).error_feedback
    if flat or n < GRID_FROM or feedback:
        return None
    q = math.isqrt(n)
    return Grid(q, n // q, n)


def signer(
    ids: list[str], codec: str, forwarder: str, level: int, seg: int, part: int = 0, flat: bool = False
) -> str | None:
    """Who must have signed segment `seg` of the all-gather that `forwarder` passed on at `level`
    (in a grid, of its row's segment `part`: every all-gather chunk there is its column's), by the
    ring `ids` (the coordinator's, never an accuser's word); None: no such chunk."""
    layout = grid(len(ids), codec, flat)
    if layout is None:
        group = ids if level == ROW else []
    elif level != COLUMN or forwarder not in ids or layout.passenger(f := ids.index(forwarder)) or part >= layout.q:
        group = []
    else:  # the column of the member owning the forwarder's row's segment `part`
        group = [ids[p] for p in layout.column(f // layout.q * layout.q + (part - 1) % layout.q)]
    return segment_owner(group, seg) if seg < len(group) else None


def neighbours(ids: list[str], member: str, codec: Codec | str, flat: bool = False) -> set[str]:
    """The members `member` sends to or takes from in an all-reduce of `ids`: the only ones whose
    bytes, silence or unreachability it witnesses (whom its RingFailed may name)."""
    send, take = _links(ids, ids.index(member), grid(len(ids), codec, flat))
    return {*send, *take} - {member}


def links(ids: list[str], codec: Codec | str, flat: bool = False) -> dict[str, set[str]]:
    """Every member's `neighbours` in an all-reduce of `ids`, at once."""
    layout = grid(len(ids), codec, flat)
    out = {}
    for me, i in enumerate(ids):
        send, take = _links(ids, me, layout)
        out[i] = {*send, *take} - {i}
    return out


def _links(ids: list[str], me: int, layout: Grid | None) -> tuple[list[str], list[str]]:
    """(the members this one sends to, those it receives from) in an all-reduce of `ids`."""
    n = len(ids)
    if layout is None:
        return [ids[(me + 1) % n]], [ids[(me - 1) % n]]
    if layout.passenger(me):
        row = [ids[p] for p in layout.row(layout.row_of(me))]
        return row, row
    row, col = list(layout.row(me // layout.q)), layout.column(me)
    k, c = row.index(me), col.index(me)
    send = [ids[row[(k + 1) % len(row)]], ids[col[(c + 1) % len(col)]]]
    take = [ids[row[(k - 1) % len(row)]], ids[col[(c - 1) % len(col)]]]
    if (r := layout.rider(me // layout.q)) is not None:
        send.append(ids[r])
        take.append(ids[r])
    return send, take


def _column_signed(
    ids: list[str], layout: Grid, i_row: int, size: int, step: int, round_: int, generation: int
) -> tuple[list[int], list[list[tuple[int, int]]], list[list[int]], Callable[..., tuple[str, bytes, dict]]]:
    """Row i_row's all-gather of x (`size` values): its segments' bounds; each segment s in the
    chunks its column's pass signed them in (the column of the member owning s); the column's
    segment each chunk is of; and who signed chunk c of s, the message signed, and where (a
    Forgery's fields)."""
    q, rows = layout.q, layout.rows
    bounds = segment_bounds(size, q)
    cols = [[ids[p] for p in layout.column(i_row * q + (s - 1) % q)] for s in range(q)]
    chunks, sub = [], []
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        cut = segment_bounds(hi - lo, rows)
        # (an empty chunk carries nothing to forward: a segment smaller than its column has some)
        spans = [(j, a, b) for j in range(rows) for a, b in _chunks(lo + cut[j], lo + cut[j + 1], step) if b > a]
        chunks.append([(a, b) for _, a, b in spans])
        sub.append([j for j, _, _ in spans])

    def vouch(s: int, c: int, a: int, b: int, digest: bytes) -> tuple[str, bytes, dict]:
        lo, hi, j = bounds[s], bounds[s + 1], sub[s][c]
        owner = segment_owner(cols[s], j)
        owned = owner_message(owner, round_, generation, j, a - lo, b - lo, hi - lo, digest, COLUMN)
        return owner, owned, dict(segment=j, lo=a - lo, hi=b - lo, total=hi - lo, level=COLUMN, part=s)

    return bounds, chunks, sub, vouch


def _chunks(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    """x[lo:hi] in chunks of at most `step` values (one empty chunk for an empty segment)."""
    return [(a, min(a + step, hi)) for a in (range(lo, hi, step) if hi > lo else [lo])]


def _placed(e: RingError, level: int) -> RingError:
    """e, marked with the pass where it happened, unless an inner pass marked it first."""
    if not e.placed:
        e.level, e.placed = level, True
    return e


class Ring:
    """This node's side of the ring: accepts the members that send to it, connects to those it
    sends to (its right neighbour; in a grid, also its column's and its row's passenger).

    Holds, per node, the error-feedback residual of codecs that use it (`residual`)."""

    def __init__(
        self,
        endpoint: Endpoint,
        timeout: float = 120.0,
        chunk_bytes: int = CHUNK_BYTES,
        codec: Codec | str = "fp32",
        trusted: Callable[[str], bool] = lambda peer: True,
        ticket_of: Callable[[str], str | None] = lambda peer: None,
    ):
        """`trusted(peer id)`: the run's members (a node checks each one's own signed RepoCommit
        as a connection opens, drift/peers.py); nobody else is connected to or accepted, whatever a
        BarrierReady says. `ticket_of(peer id)`: a member's ticket, where the ring names it by id
        alone (the coordinator told it before: P.Tickets)."""
        tune_allocator()
        self.endpoint = endpoint
        self.trusted = trusted
        self.ticket_of = ticket_of
        self.node_id = endpoint.node_id
        self._key = nacl.signing.SigningKey(bytes(endpoint.ep.secret_key().to_bytes()))  # its node id's key
        self.timeout = timeout
        self.chunk_elems = max(1, chunk_bytes // 4)
        self.codec = make_codec(codec) if isinstance(codec, str) else codec
        self.residual: np.ndarray | None = None
        self._residual_next: np.ndarray | None = None
        self._codecs: dict[tuple, Codec] = {}
        self._pool: list[np.ndarray] = []  # free payload buffers (_payload_pool)
        self._pool_bytes = 0
        self._incoming: dict[str, Channel] = {}
        self._arrived = asyncio.Condition()
        self._out: dict[str, Channel] = {}  # to the members this node sends to
        self._expected: set[str] = set()
        # Connections belong to a generation (the coordinator's ring_epoch). A retried all-reduce
        # uses a new one: whatever a cancelled attempt left half-sent on the old streams is never read.
        self._generation = 0
        self._incoming_gen: dict[str, int] = {}
        self._pending: dict[str, Channel] = {}  # peers waiting for the ring to name them, oldest first

    # --- connections ---------------------------------------------------------------------------

    async def handle_incoming(self, conn) -> None:
        """Register a ring connection accepted by the node's endpoint (called per connection).

        Returns normally whatever the peer does: a connection that fails its hello, whose peer
        this node has not verified, or whose peer the ring does not name, is closed with one log
        line."""
        peer = peer_of(conn)
        if not self.trusted(peer):
            log.warning("dropping ring connection from %s: not a verified member of this run", peer[:10])
            close_conn(conn, "not a verified member of this run")
            return
        try:
            hello_s = min(self.timeout, HELLO_TIMEOUT)
            ch = await Endpoint.accept_channel(conn, timeout=hello_s)
            gen = _parse_hello(await ch.recv_frame(MAX_HELLO, timeout=hello_s))  # also makes the stream visible
            why = await self._admit(peer, ch, gen)
        except Exception as e:
            why = printable(f"ring hello failed: {e if isinstance(e, (RingError, TransportError)) else repr(e)}", 300)
        if why is not None:
            log.warning("dropping ring connection from %s: %s", peer[:10], why)
            close_conn(conn, why)

    async def _admit(self, peer: str, ch: Channel, gen: int) -> str | None:
        """Keep `ch` as the connection from `peer` if the ring names it; else why not."""
        async with self._arrived:
            if peer not in self._expected and self._generation <= gen:
                # A neighbour may reach this round's all-reduce before we do: give our side a
                # little time to learn the ring, then admit only peers it names.
                old = self._pending.pop(peer, None)
                self._pending[peer] = ch
                if old is not None:
                    old.close("replaced by a newer connection")
                if len(self._pending) > MAX_PENDING:
                    oldest = next(iter(self._pending))
                    self._pending.pop(oldest).close("too many connections wait for the ring")
                self._arrived.notify_all()
                try:
                    await asyncio.wait_for(
                        self._arrived.wait_for(
                            lambda: (
                                peer in self._expected or self._generation > gen or self._pending.get(peer) is not ch
                            )
                        ),
                        min(self.timeout, PENDING_WAIT),
                    )
                except asyncio.TimeoutError:
                    pass
                if self._pending.get(peer) is not ch:
                    return "pushed out by newer connections waiting for the ring"
                del self._pending[peer]
            if gen < self._generation or gen < self._incoming_gen.get(peer, -1) or peer not in self._expected:
                return "not in the current ring"
            old = self._incoming.pop(peer, None)
            if old is not None:
                old.close("replaced")
            self._incoming[peer], self._incoming_gen[peer] = ch, gen
            self._arrived.notify_all()
            return None

    async def _configure(
        self, members: list[RingMember], generation: int, send_to: list[str], take_from: list[str]
    ) -> tuple[dict[str, Channel], dict[str, Channel]]:
        """Connections to `send_to` (kept from earlier rounds of this generation where they are
        the same members) and from `take_from`, by member id."""
        ids = [m.node_id for m in members]
        unverified = [i for i in ids if i != self.node_id and not self.trusted(i)]
        if unverified:
            raise RingError(f"the ring names {unverified[0][:10]}, a node this one has not verified")
        tickets = {m.node_id: m.ticket for m in members if m.node_id in send_to}
        async with self._arrived:
            self._expected = set(ids) - {self.node_id}
            self._arrived.notify_all()
            if generation != self._generation:
                self._generation = generation
                for peer in [p for p, g in self._incoming_gen.items() if g < generation]:
                    self._incoming.pop(peer).close("stale ring generation")
                    del self._incoming_gen[peer]
                for ch in self._out.values():
                    ch.close("stale ring generation")
                self._out = {}
        for peer in [p for p in self._out if p not in send_to]:
            self._out.pop(peer).close("ring changed")

        async def dial(peer: str) -> None:
            if (ticket := tickets[peer] or self.ticket_of(peer)) is None:
                raise RingError(f"the coordinator never told this node the ticket of {peer[:10]}")
            try:
                ch = await self.endpoint.connect(ticket, RING_ALPN, timeout=self.timeout)
                await ch.send_frame(json.dumps({"node_id": self.node_id, "generation": generation}).encode())
            except TransportError as e:  # only our own connections are ours to make
                raise RingError(
                    f"ring setup failed: {e}", suspect=peer if isinstance(e, TransportTimeout) else ""
                ) from None
            if generation == self._generation:
                self._out[peer] = ch
            else:  # (a retry began meanwhile: this attempt's connection is stale)
                ch.close("stale ring generation")

        for peer in [p for p in self._incoming if p not in take_from]:  # (its sender closed it: "ring changed")
            self._incoming.pop(peer).close("ring changed")
            self._incoming_gen.pop(peer, None)
        await together([dial(p) for p in send_to if p not in self._out])
        try:
            async with self._arrived:
                await asyncio.wait_for(
                    self._arrived.wait_for(lambda: all(self._incoming_gen.get(p) == generation for p in take_from)),
                    self.timeout,
                )
        except asyncio.TimeoutError:
            late = next(p for p in take_from if self._incoming_gen.get(p) != generation)
            raise RingError(
                f"ring neighbour {late[:10]} never connected (waited {self.timeout:g}s)", suspect=late
            ) from None
        return {p: self._out[p] for p in send_to}, {p: self._incoming[p] for p in take_from}

    def close(self, reason: str = "ring closed") -> None:
        """Close the ring's connections; neighbours see `reason` (cut to 100 bytes) in their error."""
        for ch in [*self._out.values(), *self._incoming.values(), *self._pending.values()]:
            ch.close(reason)
        self._out, self._incoming, self._incoming_gen, self._pending = {}, {}, {}, {}

    # --- the all-reduce ------------------------------------------------------------------------

    async def allreduce_sum(
        self,
        x: np.ndarray,
        members: list[RingMember],
        round_: int,
        codec: Codec | str | None = None,
        generation: int = 0,
        flat: bool = False,
        **codec_options,
    ) -> ReduceStats:
        """Replace x (flat float32, in place) by the sum of every member's x, sent with `codec`
        (a Codec, or a name plus make_codec options; default: the ring's). All members must use
        the same codec and options, or the all-reduce fails. From GRID_FROM members, as a grid,
        unless `flat`."""
        if x.dtype != np.float32 or x.ndim != 1 or not x.flags.c_contiguous:
            raise ValueError("allreduce_sum needs a flat, contiguous float32 array")
        if codec is None:
            codec = self.codec
        elif isinstance(codec, str):
            key = (codec, tuple(sorted(codec_options.items())))
            if key not in self._codecs:  # codecs hold scratch buffers: reuse them across rounds
                self._codecs[key] = make_codec(codec, **codec_options)
            codec = self._codecs[key]
        t0 = time.perf_counter()
        n = len(members)
        if n == 1:
            return ReduceStats(0.0, 0, 0, codec=codec.name)
        ids = [m.node_id for m in members]
        me = ids.index(self.node_id)
        layout = grid(n, codec, flat)
        self._residuals(x.size, codec)
        chunks = x.size // self._chunk_elems(codec) + n
        received = codec.encoded_nbytes(x.size) + 2 * _SIG * chunks  # per half, at most
        tally = ReduceStats(0.0, 0, 0, codec=codec.name)  # its codec and check seconds, as they add up
        try:  # (its setup too: a failure there reaches the neighbours as any other does)
            out, inc = await self._configure(members, generation, *_links(ids, me, layout))
            sent0 = sum(ch.bytes_sent for ch in out.values())
            recv0 = sum(ch.bytes_received for ch in inc.values())
            until = time.monotonic() + self.timeout + (2 if layout is None else 3) * received / MIN_RATE
            if layout is None:
                right, left = out[ids[(me + 1) % n]], inc[ids[(me - 1) % n]]
                feedback = (self.residual, self._residual_next) if codec.error_feedback else (None, None)
                await self._pass(x, ids, right, left, round_, generation, codec, until, tally, feedback)
            elif layout.passenger(me):
                await self._ride(x, ids, me, layout, out, inc, round_, generation, codec, until, tally)
            else:
                await self._grid(x, ids, me, layout, out, inc, round_, generation, codec, until, tally)
        except RingError as e:
            msg, suspect, proof = str(e), e.suspect, e.proof
            if _RELAYED in msg:  # a neighbour's failure reached us: pass on its reason, not ours
                msg, suspect, proof = _RELAYED + msg.split(_RELAYED)[-1].split('"')[0], "", None
            self.close(msg if msg.startswith(_RELAYED) else _RELAYED + msg)  # they fail too, and say why
            raise RingError(
                f"all-reduce of round {round_} failed: {msg}", suspect=suspect, proof=proof, level=e.level
            ) from None
        if codec.error_feedback:
            self.residual, self._residual_next = self._residual_next, self.residual
        return ReduceStats(
            time.perf_counter() - t0,
            sum(ch.bytes_sent for ch in out.values()) - sent0,
            sum(ch.bytes_received for ch in inc.values()) - recv0,
            tally.codec_seconds,
            codec.name,
            tally.check_seconds,
        )

    async def _grid(
        self,
        x: np.ndarray,
        ids: list[str],
        me: int,
        layout: Grid,
        out: dict[str, Channel],
        inc: dict[str, Channel],
        round_: int,
        generation: int,
        codec: Codec,
        until: float,
        tally: ReduceStats,
    ) -> None:
        """A row member's part of the grid (see Grid): its row's pass, with its column's pass on
        the segment it owns between the row's two halves. The row's all-gather forwards the
        column owners' signed chunks byte for byte: nobody re-encodes (or re-signs) a sum, so
        one owner cannot hand its row, or its passenger, bytes its column did not sign."""
        row, col = [ids[p] for p in layout.row(me // layout.q)], [ids[p] for p in layout.column(me)]
        k, c = row.index(self.node_id), col.index(self.node_id)
        rider = layout.rider(me // layout.q)
        rider = ids[rider] if rider is not None else None
        step_elems = self._chunk_elems(codec)
        mine = (k + 1) % len(row)
        _, chunks, sub, vouch = _column_signed(ids, layout, me // layout.q, x.size, step_elems, round_, generation)
        # the column's chunks of our segment, by (its segment, bounds): empty chunks share bounds
        kept: dict[tuple[int, int, int], tuple[bytes, tuple[bytes, bytes]]] = {}
        to_rider: asyncio.Queue = asyncio.Queue()

        async def between(lo: int, hi: int) -> None:
            """Our row's sum of x[lo:hi] is here: add the passenger's, then the column's pass."""
            if rider is not None:
                for i, (a, b) in enumerate(_chunks(lo, hi, step_elems)):
                    try:
                        frame = await self._recv_chunk(inc[rider], codec, round_, mine, i, b - a, x.size, until)
                        codec.decode_add(frame, x[a:b])
                    except CodecError as e:
                        raise _placed(RingError(f"bad chunk from our passenger: {e}", suspect=rider), ROW) from None
                    except RingError as e:
                        raise _placed(e, ROW) from None
                    except TransportTimeout as e:
                        raise _placed(RingError(str(e), suspect=rider), ROW) from None
                    if not np.isfinite(x[a:b]).all():
                        raise _placed(RingError("non-finite values from our passenger", suspect=rider), ROW)

            def keep(seg: int, a: int, b: int, payload, signed: tuple[bytes, bytes]) -> None:
                kept[(seg, lo + a, lo + b)] = bytes(memoryview(payload).cast("B")), signed

            right, left = out[col[(c + 1) % len(col)]], inc[col[(c - 1) % len(col)]]
            await self._pass(
                x[lo:hi], col, right, left, round_, generation, codec, until, tally, level=COLUMN, part=mine, kept=keep
            )

        def relay() -> list[tuple[int, int, bytes, tuple[bytes, bytes]]]:
            """Our segment as the column's owners signed it, in the row's all-gather's chunks."""
            return [(a, b, *kept[(j, a, b)]) for j, (a, b) in zip(sub[mine], chunks[mine])]

        def owned(i: int, a: int, b: int, payload, signed: tuple[bytes, bytes]) -> None:
            if rider is not None:
                to_rider.put_nowait((i, a, b, payload, signed))

        async def feed() -> None:
            """Our segment, as its column signed it, to our row's passenger."""
            for _ in chunks[mine]:
                i, a, b, payload, signed = await to_rider.get()
                await self._send_chunk(out[rider], payload, codec, round_, mine, i, b - a, x.size, signed)

        row_pass = self._pass(
            x, row, out[row[(k + 1) % len(row)]], inc[row[(k - 1) % len(row)]], round_, generation, codec,
            until, tally, level=ROW, gather_level=GATHER, between=between, owned=owned, relay=relay,
            gather_chunks=chunks, vouch=vouch,
        )  # fmt: skip
        await together([row_pass] if rider is None else [row_pass, _side(feed(), rider, [GATHER])])

    async def _ride(
        self,
        x: np.ndarray,
        ids: list[str],
        me: int,
        layout: Grid,
        out: dict[str, Channel],
        inc: dict[str, Channel],
        round_: int,
        generation: int,
        codec: Codec,
        until: float,
        tally: ReduceStats,
    ) -> None:
        """A passenger's part of the grid: each segment of x to the row member that owns it, and
        each segment back from it as the owner's column signed it (a chunk its column did not
        sign, under the owner's own signature, is proof against the owner)."""
        row = [ids[p] for p in layout.row(layout.row_of(me))]
        step_elems = self._chunk_elems(codec)
        bounds, chunks, _, vouch = _column_signed(
            ids, layout, layout.row_of(me), x.size, step_elems, round_, generation
        )
        pool, slot_bytes = self._payload_pool(codec.encoded_nbytes(step_elems))
        lossless = isinstance(codec, Fp32)

        async def give(k: int) -> None:
            s = (k + 1) % len(row)  # the segment row[k] owns
            for i, (a, b) in enumerate(_chunks(bounds[s], bounds[s + 1], step_elems)):
                t = time.perf_counter()
                buf = None if lossless else pool.pop() if pool else np.empty(slot_bytes, np.uint8)
                payload = x[a:b] if lossless else codec.encode(x[a:b], out=buf)
                tally.codec_seconds += time.perf_counter() - t
                # (its owner reads it once its row's reduce-scatter is done: the deadline applies)
                await self._send_chunk(
                    out[row[k]], payload, codec, round_, s, i, b - a, x.size, timeout=until - time.monotonic()
                )
                if buf is not None and len(pool) < MAX_POOLED:
                    pool.append(buf)

        async def take(k: int) -> None:
            s, owner = (k + 1) % len(row), row[k]
            for i, (a, b) in enumerate(chunks[s]):
                frame = await self._recv_chunk(
                    inc[owner], codec, round_, s, i, b - a, x.size, until, 2 * _SIG, patient=True
                )
                t = time.perf_counter()
                owner_sig, hop_sig, payload = bytes(frame[:_SIG]), bytes(frame[_SIG : 2 * _SIG]), frame[2 * _SIG :]
                digest = hashlib.sha256(payload).digest()
                signer_id, owned, where = vouch(s, i, a, b, digest)
                if not verify(owner, hop_message(s, i, owned, owner_sig), hop_sig):
                    raise RingError(f"segment {s} from its owner does not carry its signature", suspect=owner)
                if not verify(signer_id, owned, owner_sig):
                    proof = Forgery(
                        forwarder=owner, round=round_, generation=generation, digest=digest.hex(),
                        owner_sig=owner_sig.hex(), step=s, chunk=i, hop_sig=hop_sig.hex(), **where,
                    )  # fmt: skip
                    raise RingError(f"segment {s} is not what its column signed", suspect=owner, proof=proof)
                tally.check_seconds += time.perf_counter() - t
                t = time.perf_counter()
                try:
                    codec.decode(payload, x[a:b])
                except CodecError as e:
                    raise RingError(f"bad chunk from {owner[:10]}: {e}", suspect=signer_id) from None
                if not np.isfinite(x[a:b]).all():
                    raise RingError(f"non-finite values in segment {s}", suspect=signer_id)
                tally.codec_seconds += time.perf_counter() - t

        await together(
            [_side(give(k), "", [ROW]) for k in range(len(row))]  # (held up by the owner's row: no evidence)
            + [_side(take(k), "", [GATHER]) for k in range(len(row))]
        )

    async def _pass(
        self,
        x: np.ndarray,
        ids: list[str],
        right: Channel,
        left: Channel,
        round_: int,
        generation: int,
        codec: Codec,
        until: float,
        tally: ReduceStats,
        feedback: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
        level: int = ROW,
        gather_level: int | None = None,
        between: Callable[[int, int], Awaitable[None]] | None = None,
        owned: Callable[..., None] | None = None,
        relay: Callable[[], list] | None = None,
        gather_chunks: list[list[tuple[int, int]]] | None = None,
        vouch: Callable[[int, int, int, int, bytes], tuple[str, bytes, dict]] | None = None,
        kept: Callable[..., None] | None = None,
        part: int = 0,
    ) -> None:
        """One ring among `ids` on x (in place): reduce-scatter, then all-gather, their failures
        marked with `level` and `gather_level` (the same by default). `between(lo, hi)` is
        awaited once this node's own segment x[lo:hi] holds the ring's sum, before it encodes
        it as the owner; `owned(chunk, lo, hi, payload, signed)` sees each owner payload, and
        `kept(segment, lo, hi, payload, signed)` each payload of the all-gather (ours and those received).
        `relay()`: what this node sends as its segment's owner after `between` (chunks signed
        elsewhere, forwarded as they are) in place of encoding and signing its own, with
        `gather_chunks` (per segment: the all-gather's chunks) and `vouch(seg, chunk, lo, hi,
        digest)` (who signed such a chunk, what, and where, for a Forgery). `part`: the row's
        segment this pass is of (a Forgery's). `feedback`: the error-feedback residual and the
        buffer its next value goes to. A receive that waits for another pass (a column's first,
        a row's first after its column) waits until the deadline and names nobody."""
        gather_level = level if gather_level is None else gather_level
        n_nodes = len(ids)
        r = ids.index(self.node_id)
        bounds = segment_bounds(x.size, n_nodes)
        step_elems = self._chunk_elems(codec)
        seg_chunks = [_chunks(bounds[s], bounds[s + 1], step_elems) for s in range(n_nodes)]  # per segment
        gather_chunks = gather_chunks or seg_chunks
        lossless = isinstance(codec, Fp32)
        pool, slot_bytes = self._payload_pool(codec.encoded_nbytes(step_elems))
        residual, new_residual = feedback

        steps = 2 * (n_nodes - 1)
        send_seg = [
            (r - s) % n_nodes if s < n_nodes - 1 else (r + 1 - (s - n_nodes + 1)) % n_nodes for s in range(steps)
        ]
        recv_seg = [
            (r - s - 1) % n_nodes if s < n_nodes - 1 else (r - (s - n_nodes + 1)) % n_nodes for s in range(steps)
        ]
        owner_step = n_nodes - 2  # the last reduce-scatter receive completes the segment we own
        mine = (r + 1) % n_nodes  # the segment this node completes, signs and sends first in all-gather
        # In a grid the columns start when their rows' reduce-scatters end, and the rows' all-gathers
        # when their columns end: a wait there may be any member's delay, no evidence against the
        # one it waits on. Such receives (and sends) wait until the deadline and name nobody.
        patient = range(steps) if level == COLUMN else range(owner_step + 1, steps) if between else range(0)

        def chunks_at(g: int, seg: int) -> list[tuple[int, int]]:
            return seg_chunks[seg] if g < n_nodes - 1 else gather_chunks[seg]

        def vouch_own(seg: int, c: int, a: int, b: int, digest: bytes) -> tuple[str, bytes, dict]:
            owner = segment_owner(ids, seg)
            owned = owner_message(owner, round_, generation, seg, a, b, x.size, digest, gather_level)
            return owner, owned, dict(segment=seg, lo=a, hi=b, total=x.size, level=gather_level, part=part)

        vouch = vouch or vouch_own

        def sign(a: int, b: int, payload) -> tuple[bytes, bytes]:
            """The owner's message for chunk x[a:b] of its segment, and its signature."""
            t = time.perf_counter()
            digest = hashlib.sha256(payload).digest()
            owned = owner_message(self.node_id, round_, generation, mine, a, b, x.size, digest, gather_level)
            signed = owned, self._key.sign(owned).signature
            tally.check_seconds += time.perf_counter() - t
            return signed

        def check(g: int, c: int, a: int, b: int, frame: memoryview) -> tuple[memoryview, tuple[bytes, bytes], str]:
            """An all-gather chunk's payload, its owner's message and signature, and the owner, once
            both signatures hold (else RingError naming the left neighbour, with proof when it
            signed bytes their owner did not)."""
            t = time.perf_counter()
            seg, left_id = recv_seg[g], left.peer_id
            owner_sig, hop_sig, payload = bytes(frame[:_SIG]), bytes(frame[_SIG : 2 * _SIG]), frame[2 * _SIG :]
            digest = hashlib.sha256(payload).digest()
            owner, owned, where = vouch(seg, c, a, b, digest)
            if not verify(left_id, hop_message(g, c, owned, owner_sig), hop_sig):
                raise RingError("an all-gather chunk from left neighbour does not carry its signature", suspect=left_id)
            if not verify(owner, owned, owner_sig):
                proof = Forgery(
                    forwarder=left_id,
                    round=round_,
                    generation=generation,
                    digest=digest.hex(),
                    owner_sig=owner_sig.hex(),
                    step=g,
                    chunk=c,
                    hop_sig=hop_sig.hex(),
                    **where,
                )
                raise RingError(
                    f"left neighbour forwarded bytes of segment {seg} that its owner did not sign",
                    suspect=left_id,
                    proof=proof,
                )
            tally.check_seconds += time.perf_counter() - t
            return payload, (owned, owner_sig), owner

        def encode(a: int, b: int, owner: bool):
            """Encode x[a:b] (our partial or full sum) once; owners keep decode(payload) and sign it.
            (payload, the pooled buffer it lives in or None, whether it is parked in x[a:b], the
            owner's message and signature or None)

            An owner's payloads wait for the sender, busy with its own first segment meanwhile:
            all of them at once with 2 nodes. So they wait in x[a:b] itself (its 4 bytes per
            value hold int8's ~1), and x[a:b] becomes decode(payload) once the chunk is sent
            (`unpark`): no buffer holds the owner's segment."""
            if lossless:
                return x[a:b], None, False, sign(a, b, x[a:b]) if owner else None
            v = x[a:b]
            if residual is not None:
                v += residual[a:b]
            buf = take()
            payload = codec.encode(v, out=buf)
            if residual is not None:
                np.subtract(v, codec.decode(payload, new_residual[a:b]), out=new_residual[a:b])
            signed = sign(a, b, payload) if owner else None
            if owner and residual is None and payload.size <= v.nbytes:
                home = v.view(np.uint8)[: payload.size]
                home[...] = payload
                sent(buf)
                return home, None, True, signed
            if owner:
                codec.decode(payload, v)
            return payload, buf, False, signed

        def unpark(a: int, b: int, home: np.ndarray) -> None:
            """x[a:b] <- decode(the payload parked in it), through a buffer (they overlap)."""
            buf = take()
            buf[: home.size] = home
            codec.decode(buf[: home.size], x[a:b])
            sent(buf)

        def take() -> np.ndarray:
            return pool.pop() if pool else np.empty(slot_bytes, np.uint8)

        def sent(buf: np.ndarray | None) -> None:
            """A payload's buffer back to the pool once its chunk is sent (the binding copied it)."""
            if buf is not None and len(pool) < MAX_POOLED:
                pool.append(buf)

        def own(c: int, a: int, b: int) -> tuple:
            """Encode, as its owner, chunk c = x[a:b] of our segment: what the sender sends next."""
            t = time.perf_counter()
            out, buf, parked, signed = encode(a, b, owner=True)
            if owned is not None:
                owned(c, a, b, out, signed)
            if kept is not None:
                kept(mine, a, b, out, signed)
            tally.codec_seconds += time.perf_counter() - t
            return owner_step + 1, c, (a, b), out, buf, parked, signed

        # What a node sends at step g >= 1 is what it finished at step g-1 (a partial sum during
        # reduce-scatter, the owner's payload during all-gather): the queue carries that hand-off.
        forward: asyncio.Queue = asyncio.Queue()
        sending, receiving = [level], [level]  # the pass each side is in, for _side

        async def send(g: int, c: int, a: int, b: int, payload, signed=None) -> None:
            if g not in patient:
                return await self._send_chunk(right, payload, codec, round_, g, c, b - a, x.size, signed)
            try:  # (the next member may be in a pass before this one, not reading yet)
                left_s = until - time.monotonic()
                await self._send_chunk(right, payload, codec, round_, g, c, b - a, x.size, signed, timeout=left_s)
            except TransportTimeout as e:
                raise RingError(f"{e} (the next member waits for a pass before it)") from None

        async def sender() -> None:
            for c, (a, b) in enumerate(seg_chunks[send_seg[0]]):
                t = time.perf_counter()
                payload, buf, _, _ = encode(a, b, owner=False)
                tally.codec_seconds += time.perf_counter() - t
                await send(0, c, a, b, payload)
                sent(buf)
            for _ in range(sum(len(chunks_at(g, send_seg[g])) for g in range(1, steps))):
                g, c, (a, b), payload, buf, parked, signed = await forward.get()
                sending[0] = gather_level if g >= n_nodes - 1 else level
                await send(g, c, a, b, payload, signed)
                sent(buf)
                if parked:
                    t = time.perf_counter()
                    unpark(a, b, payload)
                    tally.codec_seconds += time.perf_counter() - t

        async def receiver() -> None:
            for g in range(steps):
                gather = g >= n_nodes - 1
                receiving[0] = gather_level if gather else level
                held = between is not None and g == owner_step  # our sum waits for `between`
                for c, (a, b) in enumerate(chunks_at(g, recv_seg[g])):
                    frame = await self._recv_chunk(
                        left, codec, round_, g, c, b - a, x.size, until, 2 * _SIG * gather, patient=g in patient
                    )
                    t = time.perf_counter()
                    signed = None
                    if gather:  # the owner's bytes, as it signed them, or nothing
                        payload, signed, signed_by = check(g, c, a, b, frame)
                    else:
                        payload = frame
                        if not np.isfinite(x[a:b]).all():  # (past DeltaCheck: never an honest node's)
                            raise RingError("this node's own contribution is not finite")
                    try:
                        if not gather:
                            codec.decode_add(payload, x[a:b])  # reduce-scatter: fp32 accumulation
                        else:
                            codec.decode(payload, x[a:b])  # all-gather: the owner's bytes
                    except CodecError as e:
                        raise RingError(f"bad chunk from left neighbour: {e}", suspect=left.peer_id) from None
                    if not np.isfinite(x[a:b]).all():
                        # In all-gather the owner signed these bytes: it is the culprit, whoever forwarded them.
                        culprit = signed_by if gather else left.peer_id
                        raise RingError("non-finite values in a chunk from left neighbour", suspect=culprit)
                    if gather and kept is not None:
                        kept(recv_seg[g], a, b, payload, signed)
                    if held:
                        tally.codec_seconds += time.perf_counter() - t
                        continue
                    if g == owner_step:
                        tally.codec_seconds += time.perf_counter() - t
                        item = own(c, a, b)
                    else:
                        if not gather:
                            out, buf, parked, signed = encode(a, b, owner=False)
                            item = (g + 1, c, (a, b), out, buf, parked, signed)
                        else:  # forwarded verbatim, with its owner's signature
                            item = (g + 1, c, (a, b), payload, None, False, signed)
                        tally.codec_seconds += time.perf_counter() - t
                    if g + 1 < steps:
                        forward.put_nowait(item)
                if held:
                    await between(bounds[mine], bounds[mine + 1])
                    if relay is None:
                        for c, (a, b) in enumerate(seg_chunks[mine]):
                            forward.put_nowait(own(c, a, b))
                    else:  # the chunks as others signed them, forwarded as they are
                        for c, (a, b, payload, signed) in enumerate(relay()):
                            if owned is not None:
                                owned(c, a, b, payload, signed)
                            forward.put_nowait((owner_step + 1, c, (a, b), payload, None, False, signed))

        await together([_side(sender(), right.peer_id, sending), _side(receiver(), left.peer_id, receiving)])

    def _chunk_elems(self, codec: Codec) -> int:
        """Values per chunk: about chunk_bytes on the wire whatever the codec (per-frame costs in
        the binding are what a small frame pays: int8 measured faster with ~1 MiB frames than with
        256 KiB ones), but at most 4x the float32 chunk, so top-k still pipelines."""
        per_value = codec.encoded_nbytes(self.chunk_elems) / self.chunk_elems
        return max(1, min(4 * self.chunk_elems, int(4 * self.chunk_elems / max(per_value, 1e-9))))

    def _residuals(self, n: int, codec: Codec) -> None:
        """For error feedback: the residual, and the buffer its next value is written to."""
        if codec.error_feedback and (self.residual is None or self.residual.size != n):
            self.residual = np.zeros(n, np.float32)  # a new model size starts with no residual
            self._residual_next = np.empty(n, np.float32)

    def _payload_pool(self, slot_bytes: int) -> tuple[list[np.ndarray], int]:
        """Free buffers for encoded chunks, each of `slot_bytes` (a chunk's largest payload).
        A payload lives from its encoding until its chunk is sent, so a node holds about as many
        as its sender lags behind its receiver, not one per chunk of θ (that was 0.26 x θ with
        int8). Nobody ever waits for a buffer: an empty pool allocates, so neighbours that hold
        each other's flow control can never deadlock over them."""
        if self._pool_bytes != slot_bytes:
            self._pool, self._pool_bytes = [], slot_bytes
        return self._pool, slot_bytes

    async def _send_chunk(
        self,
        ch: Channel,
        payload,
        codec: Codec,
        round_: int,
        step: int,
        chunk: int,
        n: int,
        total: int,
        signed: tuple[bytes, bytes] | None = None,
        timeout: float | None = None,
    ) -> None:
        """One chunk to the right neighbour; `signed` (all-gather): the owner's message and
        signature, sent on with this node's hop signature over both. `timeout`: the ring's."""
        nbytes = memoryview(payload).nbytes
        head = _HEADER.pack(_MAGIC, _VERSION, codec.id, step, round_, chunk, n, total, nbytes)
        timeout = self.timeout if timeout is None else max(timeout, 0.001)
        if signed is None:
            await ch.send_parts([head, payload], timeout=timeout)
        else:
            owned, owner_sig = signed
            hop_sig = self._key.sign(hop_message(step, chunk, owned, owner_sig)).signature
            await ch.send_parts([head, owner_sig + hop_sig, payload], timeout=timeout)

    async def _recv_chunk(
        self,
        ch: Channel,
        codec: Codec,
        round_: int,
        step: int,
        chunk: int,
        n: int,
        total: int,
        until: float,
        extra: int = 0,
        patient: bool = False,
    ) -> memoryview:
        """A chunk's bytes after its header (`extra` bytes of signatures, then the payload), by
        the pass's deadline `until` (time.monotonic()) at the latest. `patient`: the sender waits
        for another pass first; only the deadline applies, and its passing names nobody."""
        nbytes = codec.encoded_nbytes(n)
        # The cap admits any codec's chunk of our chunk size, so that a peer with another codec or
        # vector size gets a diagnosis from its header rather than a bare "frame too big".
        cap = _HEADER.size + extra + max(nbytes, 8 * self.chunk_elems)
        try:
            frame = await recv_by(
                ch, cap, until - time.monotonic() if patient else self.timeout, until, "the all-reduce"
            )
        except TransportTimeout as e:
            if patient:
                raise RingError(f"{e} (waiting for a pass before it)") from None
            raise
        if len(frame) < _HEADER.size:
            raise RingError(f"ring chunk of {len(frame)} bytes is shorter than its header", suspect=ch.peer_id)
        got = _HEADER.unpack_from(frame)
        want = (_MAGIC, _VERSION, codec.id, step, round_, chunk, n, total, nbytes)
        if got != want or len(frame) != _HEADER.size + extra + nbytes:
            names = ("magic", "version", "codec", "step", "round", "chunk", "values", "vector size", "payload bytes")
            diff = ", ".join(
                f"{k} {_show(k, g)} (expected {_show(k, w)})" for k, g, w in zip(names, got, want) if g != w
            )
            if len(frame) != _HEADER.size + extra + nbytes and got[-1] == nbytes:
                diff = f"frame of {len(frame)} bytes, expected {_HEADER.size + extra + nbytes}"
            raise RingError(f"unexpected ring chunk: {diff}", suspect=ch.peer_id)
        return memoryview(frame)[_HEADER.size :]


async def recv_by(ch: Channel, cap: int, timeout: float, until: float, what: str) -> bytes:
    """One frame within `timeout`, and by `until` (time.monotonic()), the deadline of the whole
    transfer it is part of: TransportTimeout naming `what` once that has passed."""
    try:
        left = until - time.monotonic()
        if left <= 0:
            raise TransportTimeout("")
        return await ch.recv_frame(cap, timeout=min(timeout, left))
    except TransportTimeout:
        if time.monotonic() < until:
            raise
        raise TransportTimeout(f"{what} did not arrive within {timeout:g}s + {MIN_RATE >> 20} MiB/s") from None


async def _side(coro, peer: str, where: list[int]) -> None:
    """Which member a failure points at: one that sent bad bytes (RingError) or went silent (a
    timeout). A closed connection is no evidence: the member may have closed it because it caught
    someone else. `where[0]`: the pass the coroutine is in when it fails."""
    try:
        await coro
    except TransportTimeout as e:
        raise _placed(RingError(str(e), suspect=peer), where[0]) from None
    except TransportError as e:
        raise _placed(RingError(str(e)), where[0]) from None
    except RingError as e:
        raise _placed(e, where[0]) from None


async def together(coros: list) -> None:
    """Run `coros` at once; the first to fail cancels the others (also when the caller is
    cancelled: a newer ring for the round), and its error is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:  # (retrieve the others' errors: they were caused by the first)
            if t.done() and not t.cancelled():
                t.exception()


def _parse_hello(frame: bytes) -> int:
    """The ring generation a neighbour's hello names; RingError unless it is a small JSON object."""
    try:
        hello = json.loads(frame.decode("utf-8"))
    except (ValueError, RecursionError):
        raise RingError("ring hello is not JSON") from None
    gen = hello.get("generation") if isinstance(hello, dict) else None
    if type(gen) is not int or not 0 <= gen <= MAX_ROUND:
        raise RingError(f"ring hello names no generation in [0, {MAX_ROUND}]")
    return gen


def _show(field: str, v) -> str:
    if field == "codec":
        return f"{CODEC_IDS.get(v, '?')}({v})"
    return repr(v) if isinstance(v, bytes) else str(v)
