"""Who sends which payload to whom in the sparse rule's hierarchy: the all-gather of a swarm too
large for every member to send its payload to every other (issue 39).

In a flat all-gather each member uploads N - 1 payloads and downloads N - 1, so its bytes grow
with the swarm. Here the members (in ring order) form L levels of blocks. Level 0's blocks are
the members themselves; each level joins runs of about g consecutive blocks of the level below
(its *children*) into one block, until one block holds everyone. A swarm of at most `fanout`
members is one level, the flat all-gather; above it L = ceil(log_G N), G = min(fanout, LEVEL), and
g = ceil(N ** (1 / L)).

At each level every member holds its own block's payload (at level 0 its own) and needs the
payload of every sibling block (the other children of its parent). A member at position p of
its block takes sibling b's payload from b's member at position p mod |b|, so each member
downloads g - 1 payloads a level and uploads about as many (blocks' sizes differ little).
With all of them it computes the parent's payload (drift.sync.sparse.SparseLoCo.merge: the
same bytes on every member of the parent), and the last level's sum is the round's update.

Per member and round: (g - 1) x L payloads each way, where the flat all-gather moves N - 1: at
the default fanout of 64, 63 at 64 members (flat), 30 at 256, 27 at 1,000 (3 levels of 10); at
fanout 16, 15 at 16 (flat), 14 at 64, 30 at 256, 27 at 1,000 (`transfers`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

# A swarm of at most this many all-gathers flat. Measured (BENCHMARKS.md, "Swarm size"): at 64
# nodes and H 25 the flat all-gather ended 0.24 % above the int8 ring's val loss and the hierarchy
# 6.1 % (a block's payload carries k of its children's ~g·k values; the rest waits in error
# feedback), though from ~55 members the flat one sends more bytes than the ring (1.2x at 64).
FANOUT = 64
# Most blocks a parent joins above that: a node's payloads at 1,000 members stay within 2x of
# those at 16 (27 against 15), where levels of up to 64 would move 62 (blocks of 31 and 32).
LEVEL = 16


def shape(n: int, fanout: int = FANOUT) -> tuple[int, int]:
    """(levels, children per parent) for n members: one level (flat) up to `fanout` members,
    else the fewest levels of at most min(fanout, LEVEL) children, and the children per parent
    that spreads n evenly over them."""
    if n < 1 or fanout < 2:
        raise ValueError(f"a hierarchy needs n >= 1 and fanout >= 2, got n={n}, fanout={fanout}")
    levels, most = 1, (fanout if n <= fanout else min(fanout, LEVEL))
    while most**levels < n:
        levels += 1
    g = max(2, math.ceil(round(n ** (1 / levels), 9)))  # (round: 1000 ** (1/3) is 9.999999999999998)
    return levels, g


def _split(count: int, parts: int) -> list[int]:
    """`count` consecutive items into `parts` runs whose lengths differ by at most one."""
    q, r = divmod(count, parts)
    return [q + 1] * r + [q] * (parts - r)


@dataclass(frozen=True)
class Level:
    """One level: its parents, each the list of its children, each a range of member places."""

    parents: list[list[range]]

    @cached_property
    def _where(self) -> list[tuple[int, int]]:
        """Each member's (parent, child) indices."""
        return [(i, k) for i, p in enumerate(self.parents) for k, c in enumerate(p) for _ in c]

    def _place(self, m: int) -> tuple[list[range], range]:
        i, k = self._where[m]
        return self.parents[i], self.parents[i][k]

    def sources(self, m: int) -> list[tuple[int, int]]:
        """(child's index in the parent, the member m takes its payload from) for each child of
        m's parent, in order; m's own block's entry names m itself."""
        parent, own = self._place(m)
        pos = m - own.start
        return [(k, m if c is own else c.start + pos % len(c)) for k, c in enumerate(parent)]

    def targets(self, m: int) -> list[int]:
        """The members that take m's block's payload from m."""
        parent, own = self._place(m)
        pos = m - own.start
        return [t for c in parent if c is not own for t in c if (t - c.start) % len(own) == pos]

    def neighbours(self, m: int) -> set[int]:
        """The members m takes payloads from or sends its block's payload to at this level."""
        return ({src for _, src in self.sources(m)} | set(self.targets(m))) - {m}

    def children(self, m: int) -> list[range]:
        """The blocks m's parent joins, in order (m's own among them)."""
        return self._place(m)[0]

    def weights(self, m: int, weights: list[float]) -> list[float]:
        """What each child of m's parent weighs: its members' weights together (at most 1), the
        same bits on every member."""
        return [min(1.0, math.fsum(weights[i] for i in child)) for child in self.children(m)]

    def block(self, m: int) -> range:
        """m's own block: the child of its parent that holds it (whose payload m sends)."""
        return self._place(m)[1]


def plan(n: int, fanout: int = FANOUT) -> list[Level]:
    """The levels of a swarm of n members, bottom up; the last has one parent, everyone."""
    levels, g = shape(n, fanout)
    blocks = [range(i, i + 1) for i in range(n)]
    out = []
    for _ in range(levels):
        parents, i = [], 0
        for size in _split(len(blocks), -(-len(blocks) // g)):
            parents.append(blocks[i : i + size])
            i += size
        out.append(Level(parents))
        blocks = [range(p[0].start, p[-1].stop) for p in parents]
    return out


def transfers(n: int, fanout: int = FANOUT) -> tuple[int, int]:
    """(most payloads any member uploads, most it downloads) in one round."""
    up, down = [0] * n, [0] * n
    for level in plan(n, fanout):
        for m in range(n):
            up[m] += len(level.targets(m))
            down[m] += len(level.sources(m)) - 1
    return max(up), max(down)


# The reduce-scatter (not yet a collective of real swarms: benchmarks/harness/tree.py runs it in
# one process). Each member owns a segment of θ's chunks; every member sends each owner its
# payload's piece of that segment (SparseLoCo.piece), the owner sums them (SparseLoCo.reduce) and
# sends the sum, int8, to every member (SparseLoCo.gathered). Every payload reaches the update
# whole, as in the flat all-gather, and a node moves about θ at 8 bits each way whatever N is.
# Chunks per segment unit: a payload's bit fields are byte-aligned at every 8th chunk, so a
# segment of whole units is a payload of its own (drift.sync.sparse.SparseLoCo.piece).
UNIT = 8


def segments(chunks: int, n: int) -> list[range]:
    """The reduce-scatter's segments: `chunks` top-k chunks in n runs of whole units (the last
    unit may be short), member i (in ring order) owning the i-th; members past the units own an
    empty range."""
    units = -(-chunks // UNIT)
    out, u = [], 0
    for size in _split(units, n):  # (more members than units: the first own one each)
        out.append(range(min(u * UNIT, chunks), min((u + size) * UNIT, chunks)))
        u += size
    return out
