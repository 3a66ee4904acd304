"""`sync: sparse`: a rule of the SparseLoCo class (arXiv 2508.15706). Each node keeps an
error-feedback buffer e; every round e <- ef_decay * e + Δ, it sends the `k` largest |values| of
every `chunk` values of e (chunked top-k; in-chunk indices Elias-Fano coded: 8 bits each for 64
of 4096, where plain indices take 12), each as its sign alone (1 bit; the chunk's one magnitude,
the mean |value| of its top-k, rides along as a bfloat16), and keeps what the payload did not
carry: e <- e - decode(payload). SparseLoCo sends 2 bits a value; here the bit saved buys a
fifth more values in the same bytes, which learned as well or better (what one magnitude gets
wrong stays in e and goes out later; BENCHMARKS.md, "One bit a value").
Payloads are all-gathered (sums of sparse vectors are not sparse, so no ring): every member
decodes every payload, clips each to `clip` x the round's median contribution norm, and adds
w_i x them in ring order; θ -= lr x that (buffers: the plain weighted sum), the lr growing with
the number of contributions summed (`round_lr`; in levels, the top level's). The reduce-scatter
(drift.hierarchy.segments; in-process only so far, benchmarks/harness/tree.py) sums the same
payloads in segments: each member's payload goes in pieces to the segments' owners (`piece`),
each owner clips its pieces to the median of its segment's and sums them (`reduce`), and every
member applies the owners' sums, int8 (`gathered`): the flat all-gather's update to within the
int8 rounding, at about θ's int8 bytes a node whatever the swarm's size.

About 0.30 bits per value of θ per round with the defaults (160 of 4096), against 8.15 for int8.

The first `dense_rounds` rounds (2 by default) go around the ring instead, dense (w·Δ summed in
the recipe's `codec`, int8 by default), and θ -= dense_lr x the sum: a run's first Δs, from θ0,
are its largest, and a few percent of them a round is where the sparse rule lost most against the
ring at DiLoCo's H (BENCHMARKS.md, "Where the 16-node gap is: the first rounds"). The error
feedback stays empty until the first sparse round. The round number alone decides
(`collective_at`), so the coordinator and every node agree, a retry included.

Shared state: none (θ only is checksummed). The error-feedback buffer is node-local: it is not
in the checksum, not transferred and not checkpointed; a node that joins (or rejoins after a
restart) starts with zeros, and a round whose θ a node took from a peer instead of applying it
itself leaves its buffer as it was. Memory: θ_global, Δ's buffer (which holds the next e from
contribute to apply) and e, 3 x θ; the round's update stays as the payloads until it is applied.

Every node computes the same result to the bit: decoding and the clip factors use only the
payload bytes, the ring's weights and deterministic arithmetic (norms from exact float64 terms
and math.fsum), and the sum runs in ring order whatever order the payloads arrived in. Encoding
is numpy's, so torch, mlx and numpy workers produce the same payloads.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field, model_validator

from drift import hierarchy
from drift.compress import Bf16, Int8Block
from drift.diloco import CHUNK, ParamLayout, checksum_of, sgd_preview, sgd_step
from drift.sync import Combined, Params, SyncRule, checked_sum, weighted

if TYPE_CHECKING:
    from drift.protocol import RingMember
    from drift.recipe import Recipe

# chunks per piece of an encode/decode pass (a multiple of 8: bit fields stay byte-aligned); also
# the norm's fsum blocks, so changing it would change a norm's last bit: a swarm would disagree
BLOCK_ROWS = 256


class SparseParams(Params):
    chunk: int = Field(4096, ge=2, le=65536, description="values per top-k chunk (a power of two)")
    # k 160, lr 2.5 growing to 5 and 2 dense first rounds: within 2 % of the int8 ring at DiLoCo's H 25
    # from 2 to 16 nodes, where 64 and lr 1 were +18 % at 16 (BENCHMARKS.md, "The sparse rule's
    # defaults at H 25")
    k: int = Field(160, ge=1, description="values sent per chunk")
    # 0.7: on a 22M-parameter model at 4 nodes 0.9 trailed the int8 ring by 2.7 %, 0.7 by 1.95 %; on
    # the default task it is within 2 % from 2 to 16 nodes, as 0.9 was (BENCHMARKS.md, "Error
    # feedback that forgets sooner"). 0.95 and 1 were worse than 0.9 at every outer lr (BENCHMARKS.md,
    # "Longer runs, and the rule's two knobs").
    ef_decay: float = Field(0.7, ge=0, le=1, description="error feedback: e <- ef_decay * e + Δ")
    lr: float = Field(2.5, gt=0, description="outer learning rate (plain SGD on the clipped sum) of 2 contributions")
    lr_growth: float = Field(
        2.0, ge=1, description="with n contributions the lr is lr x √(n / 2), up to lr_growth x lr"
    )
    # 1, not 3: a liar under the outlier bound, clipped to 3 x, undid a 4-node run (BENCHMARKS.md)
    clip: float = Field(1.0, ge=1, description="each contribution's norm is clipped to clip x the round's median")
    outlier: float = Field(6.0, ge=1, description="a contribution over outlier x the median is reported")
    fanout: int = Field(
        hierarchy.FANOUT,
        ge=2,
        le=256,
        description="above this many members, payloads gather in levels (of at most min(fanout, 16) blocks)",
    )

    dense_rounds: int = Field(2, ge=0, description="the run's first this many rounds go around the dense ring")
    dense_lr: float = Field(1.3, gt=0, description="their outer learning rate (plain SGD on the ring's sum)")

    @model_validator(mode="after")
    def _shape(self) -> SparseParams:
        if self.chunk & (self.chunk - 1):
            raise ValueError(f"chunk must be a power of two, got {self.chunk}")
        if self.k > self.chunk:
            raise ValueError(f"k ({self.k}) cannot exceed chunk ({self.chunk})")
        return self


class PayloadError(Exception):
    """A payload that does not decode (wrong size, indices out of order, a bad scale)."""


class Codec:
    """The payload format: for m = ceil(n / chunk) chunks, in order
        m x 1 bfloat16 (drift.compress's bf16: little-endian, nearest even): the chunk's magnitude,
        m x k x `low` bits: each index's low bits (MSB first, packed),
        m x `span` bits: each chunk's high parts, Elias-Fano: the chunk's j-th index sets bit
            (index >> low) + j of its span, so a span holds exactly k ones,
        m x k bits: each value's sign (1 = negative).
    Indices increase within a chunk; low = floor(log2(chunk / k)), span = k + chunk >> low: about
    2 + low bits an index (8 for 64 of 4096, 6 for 160). A payload of 0 bytes carries nothing (weight 0)."""

    def __init__(self, n: int, chunk: int, k: int):
        self.n, self.chunk, self.k = n, chunk, k
        self.low = chunk.bit_length() - 1 - (k - 1).bit_length()
        self.span = k + (chunk >> self.low)
        self.m = max(1, -(-n // chunk))
        self.shifts = np.arange(self.low - 1, -1, -1, dtype=np.uint32)
        self.i_index = 2 * self.m
        self.i_high = self.i_index + -(-self.m * k * self.low // 8)
        self.i_values = self.i_high + -(-self.m * self.span // 8)
        self.nbytes = self.i_values + -(-self.m * k // 8)
        self.bf16 = Bf16()

    def _bytes(self, start: int, row_bits: int, r0: int, r1: int) -> slice:
        """Rows [r0, r1) of the bit field at byte `start` that holds `row_bits` bits a chunk (r0 is
        a block's first row: a multiple of 8, so its bits start on a byte)."""
        return slice(start + r0 * row_bits // 8, start + -(-r1 * row_bits // 8))

    def blocks(self):
        for r0 in range(0, self.m, BLOCK_ROWS):
            yield r0, min(self.m, r0 + BLOCK_ROWS)

    def _rows(self, x: np.ndarray, r0: int, r1: int) -> np.ndarray:
        a, b = r0 * self.chunk, r1 * self.chunk
        if b <= x.size:
            return x[a:b].reshape(r1 - r0, self.chunk)
        rows = np.zeros((r1 - r0) * self.chunk, np.float32)
        rows[: x.size - a] = x[a:]
        return rows.reshape(r1 - r0, self.chunk)

    def _top_k(self, rows: np.ndarray, mags: np.ndarray, part: np.ndarray) -> np.ndarray:
        """Each row's k largest |values|' columns, increasing: the set np.argpartition picks.
        A row's k-th largest magnitude (a partition of the values, not of indices: twice as fast)
        bounds them; a row where that bound ties (or a NaN) takes np.argpartition's own pick."""
        k, c = self.k, self.chunk
        np.abs(rows, out=mags)
        np.copyto(part, mags)
        part.partition(c - k, axis=1)
        sel = mags >= part[:, c - k : c - k + 1]
        ok = np.count_nonzero(sel, axis=1) == k
        if ok.all():
            return (np.flatnonzero(sel) & (c - 1)).reshape(-1, k)
        idx = np.empty((rows.shape[0], k), np.int64)
        idx[ok] = (np.flatnonzero(sel[ok]) & (c - 1)).reshape(-1, k)
        tied = np.argpartition(mags[~ok], c - k, axis=1)[:, c - k :]
        tied.sort(axis=1)
        idx[~ok] = tied
        return idx

    def encode(self, x: np.ndarray) -> bytes:
        """The payload of x (float32, n values): its chunked top-k, a bit a value."""
        out = np.zeros(self.nbytes, np.uint8)
        k = self.k
        scratch = np.empty((2, min(self.m, BLOCK_ROWS), self.chunk), np.float32)
        for r0, r1 in self.blocks():
            rows = self._rows(x, r0, r1)
            idx = self._top_k(rows, scratch[0, : r1 - r0], scratch[1, : r1 - r0])
            vals = np.take_along_axis(rows, idx, axis=1)
            self.bf16.encode(np.abs(vals).sum(axis=1) / np.float32(k), out[2 * r0 : 2 * r1])
            ibits = ((idx.astype(np.uint32)[..., None] >> self.shifts) & 1).astype(np.uint8)
            out[self._bytes(self.i_index, k * self.low, r0, r1)] = np.packbits(ibits.reshape(-1))
            upper = np.zeros((r1 - r0, self.span), np.uint8)
            np.put_along_axis(upper, (idx >> self.low) + np.arange(k), 1, axis=1)
            out[self._bytes(self.i_high, self.span, r0, r1)] = np.packbits(upper.reshape(-1))
            out[self._bytes(self.i_values, k, r0, r1)] = np.packbits((vals < 0).reshape(-1))
        return out.tobytes()

    def _blocks(self, payload: bytes):
        """(flat indices, negative, the chunks' magnitudes) a block of chunks at a time, indices
        past n still in; PayloadError if the payload does not decode."""
        if len(payload) != self.nbytes:
            raise PayloadError(f"payload of {len(payload)} bytes, expected {self.nbytes}")
        buf = np.frombuffer(payload, np.uint8)
        scales = self.bf16.decode(buf[: self.i_index], np.empty(self.m, np.float32))
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise PayloadError("a chunk's magnitude is negative or not finite")
        k, c, low, span = self.k, self.chunk, self.low, self.span
        # index j of a block starts at bit j * low: read the 3 bytes around it big-endian (low <= 16)
        starts = np.arange(min(self.m, BLOCK_ROWS) * k, dtype=np.int64) * low
        first, shift = starts >> 3, (24 - low - (starts & 7)).astype(np.uint32)
        for r0, r1 in self.blocks():
            n = (r1 - r0) * k
            upper = buf[self._bytes(self.i_high, span, r0, r1)]
            upper = np.unpackbits(upper, count=(r1 - r0) * span).reshape(r1 - r0, span)
            if not (np.count_nonzero(upper, axis=1) == k).all():
                raise PayloadError(f"a chunk's index span does not hold {k} indices")
            idx = (np.flatnonzero(upper).reshape(r1 - r0, k) % span - np.arange(k)) << low
            low_bytes = buf[self._bytes(self.i_index, k * low, r0, r1)]  # none when low is 0 (k > chunk / 2)
            window = np.zeros(low_bytes.size + 3, np.uint32)
            window[: low_bytes.size] = low_bytes
            f = first[:n]
            word = (window[f] << 16) | (window[f + 1] << 8) | window[f + 2]
            idx |= ((word >> shift[:n]) & ((1 << low) - 1)).astype(np.int64).reshape(r1 - r0, k)
            if k > 1 and not (idx[:, 1:] > idx[:, :-1]).all():
                raise PayloadError("indices not increasing within a chunk")
            if not (idx[:, -1] < c).all():
                raise PayloadError("an index past its chunk")
            negative = np.unpackbits(buf[self._bytes(self.i_values, k, r0, r1)], count=n).view(bool)
            idx += (np.arange(r0, r1, dtype=np.int64) * c)[:, None]
            yield idx.reshape(-1), negative, scales[r0:r1]

    def rows(self, payload: bytes, r0: int, r1: int) -> bytes:
        """Chunks [r0, r1) of a payload (r0 a multiple of 8, where every bit field starts on a
        byte), itself a payload of those chunks: each field's rows, in the fields' order."""
        fields = [
            slice(2 * r0, 2 * r1),
            self._bytes(self.i_index, self.k * self.low, r0, r1),
            self._bytes(self.i_high, self.span, r0, r1),
            self._bytes(self.i_values, self.k, r0, r1),
        ]
        return b"".join(payload[f] for f in fields)

    def _values(self, negative: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """A block's values: its chunk's magnitude (`scales`, float32), signed."""
        vals = np.repeat(scales, self.k)
        np.negative(vals, out=vals, where=negative)
        return vals

    def pieces(self, payload: bytes, coef: np.float32 | None = None):
        """(flat indices, values) of a payload (x `coef`, a float32, when given: the same bits as
        multiplying the values), a block of chunks at a time; PayloadError if it does not decode.
        Indices past n (the last chunk's padding) are dropped."""
        for flat, negative, scales in self._blocks(payload):
            vals = self._values(negative, scales if coef is None else coef * scales)
            keep = flat < self.n
            yield (flat, vals) if keep.all() else (flat[keep], vals[keep])

    def norm(self, payload: bytes) -> float:
        """||decode(payload)||, the same to the bit on every machine (exact float64 terms, fsum);
        PayloadError if it does not decode."""
        # A block's sum of squares is math.fsum of its values' exact float64 squares, correctly
        # rounded; each chunk's values are ± its magnitude, so it is fsum of count x square terms,
        # each square (exact: a bfloat16's 8 bits squared) times the count, exact too.
        terms = []
        for flat, _, scales in self._blocks(payload):
            count = np.count_nonzero((flat < self.n).reshape(-1, self.k), axis=1)
            terms.append(math.fsum((count * scales.astype(np.float64) ** 2).tolist()))
        return math.sqrt(math.fsum(terms))


def segment_values(chunks: range, chunk: int, n_values: int) -> range:
    """The values of θ (of n_values) that a segment's chunks hold (the last chunk may be short)."""
    return range(chunks.start * chunk, min(chunks.stop * chunk, n_values))


def scatter_transfers(n_values: int, chunk: int, k: int, n: int) -> list[tuple[int, int, int, int]]:
    """Each of n members' bytes in a reduce-scattered round of θ of n_values: (up, down) as it
    sends its payload's pieces to the other owners and takes every member's piece of its own
    segment, then (up, down) as it sends its segment's int8 sum to every other member and takes
    the other segments' sums."""
    sizes = [len(segment_values(s, chunk, n_values)) for s in hierarchy.segments(Codec(n_values, chunk, k).m, n)]
    piece = [Codec(v, chunk, k).nbytes if v else 0 for v in sizes]
    summed = [Int8Block().encoded_nbytes(v) if v else 0 for v in sizes]
    total_piece, total_summed = sum(piece), sum(summed)
    return [
        (total_piece - piece[o], (n - 1) * piece[o], (n - 1) * summed[o], total_summed - summed[o]) for o in range(n)
    ]


def scatter_nbytes(n_values: int, chunk: int, k: int, n: int) -> tuple[int, int]:
    """(most bytes any of n members uploads, most it downloads) in a reduce-scattered round."""
    each = scatter_transfers(n_values, chunk, k, n)
    return max(ru + gu for ru, _, gu, _ in each), max(rd + gd for _, rd, _, gd in each)


class SparseLoCo(SyncRule):
    name = "sparse"
    collective = "allgather"
    Params = SparseParams

    def __init__(self, layout: ParamLayout, recipe: Recipe):
        super().__init__(layout, recipe)
        p = self.params
        self.codec = Codec(layout.size, p.chunk, p.k)
        self.ef: np.ndarray | None = None  # node-local error feedback (zeros until the first round)
        self._ef_next: np.ndarray | None = None  # what it becomes once this round is applied (in Δ's buffer)
        self._update: list[tuple[bytes, np.float32]] = []  # the round's: (payload, coefficient) in ring order
        self._lr = np.float32(self.params.lr)  # the round's (lr_growth)
        self._sum: np.ndarray | None = None  # a dense round's: what contribute gave the ring, then the sum
        self._segments: list[tuple[int, int, bytes]] = []  # a reduce-scattered round's: (a, b, int8 sum of θ[a:b])
        self.sums = Int8Block()  # the reduce-scatter's segment sums

    @classmethod
    def collective_at(cls, params: SparseParams, rnd: int) -> Literal["ring", "allgather"]:
        return "ring" if rnd < params.dense_rounds else "allgather"

    def round_lr(self, n: int) -> np.float32:
        """The outer lr of a sum of n contributions. Their top-k sets overlap little, so their mean
        is shorter than each (1/√n as long where they do not overlap at all): the lr grows as
        √(n / 2) from 2 contributions, up to lr_growth x lr (2 nodes wanted 2.5 where 5 was +7 %,
        16 nodes 5 where 2.5 was +4.9 % and 7 diverged: BENCHMARKS.md)."""
        p = self.params
        return np.float32(p.lr * min(p.lr_growth, max(1.0, math.sqrt(n / 2))))

    @property
    def payload_nbytes(self) -> int:
        return self.codec.nbytes

    def contribute(self, delta: np.ndarray, weight: float, rnd: int) -> bytes | np.ndarray:
        """This round's payload: top-k of ef_decay * e + Δ. `delta` becomes what e will be once
        the round is applied (what the payload did not carry); e itself changes only then, so a
        retried attempt sends the same bytes and an abandoned round leaves e as it was. In a dense
        round: w * Δ in place, for the ring to sum (a node of weight 0 sends exact zeros)."""
        self._ef_next = self._sum = None
        if self.collective_at(self.params, rnd) == "ring":
            self._sum = weighted(delta, weight)
            return delta
        if weight == 0:
            return b""
        if self.ef is None:
            self.ef = np.zeros_like(delta)
        d, scratch = np.float32(self.params.ef_decay), np.empty(min(CHUNK, delta.size), np.float32)
        for a in range(0, delta.size, CHUNK):
            s = scratch[: min(CHUNK, delta.size - a)]
            np.multiply(self.ef[a : a + CHUNK], d, out=s)
            delta[a : a + CHUNK] += s
        payload = self.codec.encode(delta)
        for flat, vals in self.codec.pieces(payload):
            delta[flat] -= vals
        self._ef_next = delta
        return payload

    def combine(self, result: list[bytes | None], ring: list[RingMember], bound: float | None = None) -> Combined:
        """The update Σ_i w_i · clip(decode(payload_i)), kept as the payloads and their
        coefficients (decoded again by preview and apply: no θ-sized sum); members whose payload
        does not decode add nothing, and they and any far outside the median (three or more
        members: then every member names the same) are the outliers: a far one adds nothing
        either, where clipped it would still pull θ its way for a round. A dense round's sum (the
        ring's, in place) is refused if larger than the members' reported norms allow (`bound`)."""
        if self._sum is not None:
            assert result is self._sum
            return checked_sum(result, bound, self.ring_codec)
        self._update, self._segments = [], []
        kept, bad, far = self._clipped(result, ring, self.codec)
        self._update = [(result[i], coef) for i, coef in kept]
        self._lr = self.round_lr(len(self._update))
        return Combined(outliers=bad + far)

    def _clipped(
        self, result: list[bytes | None], ring: list[RingMember], codec: Codec
    ) -> tuple[list[tuple[int, np.float32]], list[str], list[str]]:
        """(index, w_i x clip factor) of each payload that counts, in ring order; the members whose
        payload does not decode; those far outside the median (three or more payloads: then every
        member names the same)."""
        bad, norms = [], {}
        for m, payload in zip(ring, result):
            if m.weight == 0 or not payload:
                continue
            try:
                norms[m.node_id] = codec.norm(payload)
            except PayloadError:
                bad.append(m.node_id)
        if not norms:
            return [], bad, []
        # A payload of norm 0 adds nothing and sets no limit: with two members, the lower median
        # would otherwise be 0 and clip every other contribution to nothing (θ stops).
        ordered = sorted(v for v in norms.values() if v > 0) or [0.0]
        median = ordered[(len(ordered) - 1) // 2]  # the lower one: with two, the smaller
        limit = self.params.clip * median
        far = [i for i, v in norms.items() if v > self.params.outlier * median] if len(norms) >= 3 else []
        kept = []
        for i, m in enumerate(ring):
            if m.node_id in norms and m.node_id not in far:
                scale = min(1.0, limit / norms[m.node_id]) if norms[m.node_id] > 0 else 1.0
                kept.append((i, np.float32(m.weight * scale)))
        return kept, bad, far

    def merge(self, result: list[bytes | None], ring: list[RingMember]) -> tuple[bytes, Combined]:
        """One level of the hierarchy below its top (drift/hierarchy.py): the payload of the block
        whose children's payloads are `result` (in order; `ring`: the children as members, each
        weighing what its members weigh together), and what looked wrong. The children are
        combined as `combine` does; their sum over the block's weight W is encoded as one payload,
        the same bytes on every member. What it does not carry, sum / W - decode(payload), joins
        this node's error feedback when the round is applied: a member contributing w sends w x
        that later, so the block's members together send all of it, as a member sends what its
        own payload left out. Nothing is lost, only delayed."""
        found = self.combine(result, ring)
        weight = math.fsum(m.weight for m in ring)
        update, self._update = self._update, []
        if not update or weight == 0:
            return b"", found
        total = np.zeros(self.layout.size, np.float32)
        for payload, coef in update:
            for flat, vals in self.codec.pieces(payload, coef):
                total[flat] += vals
        total /= np.float32(weight)
        payload = self.codec.encode(total)
        if self._ef_next is not None:
            for flat, vals in self.codec.pieces(payload):
                total[flat] -= vals
            self._ef_next += total
        return payload, found

    def segment_codec(self, chunks: range) -> Codec:
        """The payload format of a segment's piece: chunks [start, stop) of θ's."""
        c = self.codec
        return Codec(len(segment_values(chunks, c.chunk, c.n)), c.chunk, c.k)

    def piece(self, payload: bytes, chunks: range) -> bytes:
        """The part of a payload that segment `chunks` (drift.hierarchy.segments: it starts on a
        unit) needs: itself a payload of `segment_codec(chunks)`; b"" from a payload of nothing."""
        if not payload:
            return b""
        return self.codec.rows(payload, chunks.start, chunks.stop)

    def scatter_nbytes(self, n: int) -> tuple[int, int]:
        """(most bytes any of n members uploads, most it downloads) in a reduce-scattered round."""
        return scatter_nbytes(self.codec.n, self.codec.chunk, self.codec.k, n)

    def reduce(self, pieces: list[bytes | None], ring: list[RingMember], chunks: range) -> tuple[bytes, Combined]:
        """A segment owner's part of the reduce-scatter: Σ_i w_i · clip(decode(piece_i)) over the
        segment (each piece clipped to `clip` x the median of the segment's pieces, so an owner
        needs nothing beyond them), int8-encoded for the all-gather; and the members whose piece
        did not decode or was far outside the others'."""
        codec = self.segment_codec(chunks)
        kept, bad, far = self._clipped(pieces, ring, codec)
        total = np.zeros(codec.n, np.float32)
        for i, coef in kept:
            for flat, vals in codec.pieces(pieces[i], coef):
                total[flat] += vals
        return self.sums.encode(total).tobytes(), Combined(outliers=bad + far)

    def gathered(self, sums: list[tuple[range, bytes]], contributions: int) -> None:
        """The round's update from the all-gathered segment sums (`reduce`'s bytes, each with its
        chunks; a segment missing from the list adds nothing), `contributions` members having
        sent a payload; PayloadError if a sum does not decode."""
        self._update, self._segments = [], []
        for chunks, data in sums:
            values = segment_values(chunks, self.codec.chunk, self.codec.n)
            if len(data) != (want := self.sums.encoded_nbytes(len(values))):
                raise PayloadError(f"a segment sum of {len(data)} bytes, expected {want}")
            if not np.isfinite(np.frombuffer(data, np.float32, -(-len(values) // self.sums.block))).all():
                raise PayloadError("a segment sum's scale is not finite")
            self._segments.append((values.start, values.stop, data))
        self._lr = self.round_lr(contributions)

    def _steps(self, theta: np.ndarray):
        """θ after the step, a block of chunks at a time: (a, b, θ[a:b]'s step, lr x the update
        on the parameters and the update itself on the buffers). The members' values are added in
        ring order, into a block of zeros: the same bits as one θ-sized sum."""
        n, params, lr = theta.size, self.layout.params_size, self._lr
        if self._segments:
            done = 0
            for a, b, data in [*sorted(self._segments), (n, n, b"")]:
                if a > done:  # a segment nobody summed: no step
                    yield done, a, np.zeros(a - done, np.float32)
                if b > a:
                    step = self.sums.decode(data, np.empty(b - a, np.float32))
                    step[: max(0, params - a)] *= lr
                    yield a, b, step
                done = b
            return
        span = BLOCK_ROWS * self.codec.chunk
        block = np.empty(min(span, n), np.float32)
        streams = [self.codec.pieces(payload, coef) for payload, coef in self._update]
        for a in range(0, n, span):
            b = min(a + span, n)
            step = block[: b - a]
            step[...] = 0
            for stream in streams:
                flat, vals = next(stream)
                step[flat - a] += vals
            step[: max(0, params - a)] *= lr
            yield a, b, step

    def apply(self, theta: np.ndarray) -> None:
        """θ -= lr * update on the parameters, θ -= update on the buffers; the error feedback of
        this round becomes the node's. A dense round: θ -= dense_lr * sum (the sum is scratch)."""
        if self._sum is not None:
            sgd_step(theta, self._sum, np.float32(self.params.dense_lr), self.layout.params_size)
            self._sum = None
            return
        for a, b, step in self._steps(theta):
            theta[a:b] -= step
        if self._ef_next is not None:
            np.copyto(self.ef, self._ef_next)
            self._ef_next = None
        self._update, self._segments = [], []

    def preview(self, theta: np.ndarray) -> str:
        if self._sum is not None:
            return sgd_preview(theta, self._sum, np.float32(self.params.dense_lr), self.layout.params_size)
        stepped = (theta[a:b] - step for a, b, step in self._steps(theta))
        return checksum_of((stepped, *([a] for a in self.state.values())))

    def abandon(self) -> None:
        self._ef_next = self._sum = None
        self._update, self._segments = [], []
